//! One [`Transport`] over two: the ranks of this node through one (the same-host
//! transport), the ranks of other nodes through the other (the socket transport). Each call
//! that names a peer goes to the transport that reaches it; calls about everything
//! (`poll_signals`, `progress`, `cancel`, `close`, ...) reach both. The engine holds one
//! transport either way, so its op state machine does not know which peers are remote.
use crate::device::DevPtr;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use crate::transport::{FlowId, GatedWrite, Incoming, Region, RemoteBuffer, Tag, Transport};

pub struct Route {
    near: Box<dyn Transport>,
    far: Box<dyn Transport>,
    /// By rank: whether `far` reaches it.
    is_far: Vec<bool>,
    /// Errors `progress` could not return yet (it returns one per call).
    held: VecDeque<(u64, Error)>,
}

impl Route {
    pub fn new(near: Box<dyn Transport>, far: Box<dyn Transport>, is_far: Vec<bool>) -> Route {
        Route { near, far, is_far, held: VecDeque::new() }
    }

    fn to(&mut self, peer: usize) -> &mut dyn Transport {
        if self.is_far.get(peer).copied().unwrap_or(false) {
            self.far.as_mut()
        } else {
            self.near.as_mut()
        }
    }
}

impl Transport for Route {
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        self.to(peer).expose(peer, region)
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        self.to(peer).post_ready(peer, tag, remote)
    }

    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32) {
        self.to(peer).signal_failure(peer, pair_seq, code)
    }

    fn poll_signals(&mut self, out: &mut Vec<Incoming>) -> bool {
        let a = self.near.poll_signals(out);
        self.far.poll_signals(out) | a
    }

    fn start_write(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        self.to(peer).start_write(id, peer, tag, src, remote, len)
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        let a = self.near.progress(done, advanced);
        let b = self.far.progress(done, advanced);
        let mut moved = false;
        for r in [a, b] {
            match r {
                Ok(m) => moved |= m,
                Err(e) => self.held.push_back(e),
            }
        }
        match self.held.pop_front() {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    fn cancel(&mut self, seq: u64) {
        self.near.cancel(seq);
        self.far.cancel(seq);
    }

    fn peer_health(&self, peer: usize) -> Option<String> {
        if self.is_far.get(peer).copied().unwrap_or(false) {
            self.far.peer_health(peer)
        } else {
            self.near.peer_health(peer)
        }
    }

    fn data_in_flight(&self) -> bool {
        self.near.data_in_flight() || self.far.data_in_flight() || !self.held.is_empty()
    }

    fn signals_queued(&self) -> bool {
        self.near.signals_queued() || self.far.signals_queued()
    }

    fn describe(&self) -> String {
        format!("this node: {}; other nodes: {}", self.near.describe(), self.far.describe())
    }

    fn close(&mut self) {
        self.near.close();
        self.far.close();
    }

    fn idle(&mut self) {
        self.near.idle();
        self.far.idle();
    }

    fn gated(&mut self, peer: usize, len: usize) -> bool {
        self.to(peer).gated(peer, len)
    }

    fn announce(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) -> Result<()> {
        self.to(peer).announce(peer, tag, remote)
    }

    fn reached(&mut self, peer: usize, pair_seq: u64) {
        self.to(peer).reached(peer, pair_seq)
    }

    fn gated_room(&mut self, peer: usize) -> bool {
        self.to(peer).gated_room(peer)
    }

    fn gated_write(&mut self, peer: usize, pair_seq: u64, start_flag: DevPtr, start_value: u64, writes: &[GatedWrite]) -> Result<()> {
        self.to(peer).gated_write(peer, pair_seq, start_flag, start_value, writes)
    }
}

//! One [`Transport`] over two: the ranks of this node through one (the same-host
//! transport), the ranks of other nodes through the other (the socket transport). Each call
//! that names a peer goes to the transport that reaches it; calls about everything
//! (`poll_signals`, `progress`, `cancel`, `close`, ...) reach both. The engine holds one
//! transport either way, so its op state machine does not know which peers are remote.
//! With [`relay`](crate::transport::relay) set up, the route also hands point-to-point
//! sends to other nodes to this rank's forwarding peer and carries those of the ranks that
//! forward through this one.
use crate::device::{Allocation, DevPtr};
use crate::error::{Error, Result};
use crate::transport::relay::{is_relay_seq, RelaySetup, Relays};
use crate::transport::same_host::SameHost;
use std::collections::VecDeque;
use crate::transport::{FlowId, GatedWrite, Incoming, Region, RemoteBuffer, Tag, Transport};

pub struct Route {
    near: SameHost,
    far: Box<dyn Transport>,
    /// By rank: whether `far` reaches it.
    is_far: Vec<bool>,
    /// Errors `progress` could not return yet (it returns one per call).
    held: VecDeque<(u64, Error)>,
    relays: Option<Relays>,
}

impl Route {
    /// `relay`: run relays (`far` is the socket transport, and some rank of this node
    /// forwards through another).
    pub fn new(near: SameHost, far: Box<dyn Transport>, is_far: Vec<bool>, relay: Option<RelaySetup>) -> Route {
        Route { near, far, is_far, held: VecDeque::new(), relays: relay.map(Relays::new) }
    }

    fn to(&mut self, peer: usize) -> &mut dyn Transport {
        if self.is_far.get(peer).copied().unwrap_or(false) {
            self.far.as_mut()
        } else {
            &mut self.near
        }
    }
}

impl Transport for Route {
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        self.to(peer).expose(peer, region)
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        if self.relays.as_mut().is_some_and(|r| r.post_recv(&mut self.near, tag, &remote)) {
            return;
        }
        self.to(peer).post_ready(peer, tag, remote)
    }

    fn expose_forwarded(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        let far = self.is_far.get(peer).copied().unwrap_or(false);
        match self.relays.as_mut().filter(|r| far && region.len > 0 && r.via().is_some()) {
            Some(r) => r.ask_recv(&mut self.near, peer, region),
            None => self.to(peer).expose(peer, region),
        }
    }

    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32) {
        self.to(peer).signal_failure(peer, pair_seq, code)
    }

    fn poll_signals(&mut self, out: &mut Vec<Incoming>) -> bool {
        let a = self.near.poll_signals(out);
        let b = self.relays.as_mut().is_some_and(|r| r.take_incoming(out));
        self.far.poll_signals(out) | a | b
    }

    fn start_write(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        self.to(peer).start_write(id, peer, tag, src, remote, len)
    }

    fn start_forwarded(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        let far = self.is_far.get(peer).copied().unwrap_or(false);
        match self.relays.as_mut().filter(|r| far && len > 0 && r.via().is_some()) {
            Some(r) => r.hand(&mut self.near, id, peer, tag, src, remote, len),
            None => self.to(peer).start_write(id, peer, tag, src, remote, len),
        }
    }

    fn start_write_mapped(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, src_alloc: Allocation, remote: &RemoteBuffer, len: usize) -> Result<()> {
        self.to(peer).start_write_mapped(id, peer, tag, src, src_alloc, remote, len)
    }

    fn wake_often(&self) -> bool {
        self.relays.as_ref().is_some_and(Relays::serves)
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        let a = self.near.progress(done, advanced);
        let b = self.far.progress(done, advanced);
        let mut moved = false;
        for r in [a, b] {
            match r {
                Ok(m) => moved |= m,
                // A flow this rank carries for another: that rank's send fails.
                Err((seq, e)) if is_relay_seq(seq) => {
                    if let Some(r) = self.relays.as_mut() {
                        r.carried_failed(&mut self.near, seq, e.code(), &e);
                    }
                    moved = true;
                }
                Err(e) => self.held.push_back(e),
            }
        }
        if let Some(r) = self.relays.as_mut() {
            moved |= r.turn(&mut self.near, self.far.as_mut(), &self.is_far, done, advanced, &mut self.held);
        }
        match self.held.pop_front() {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    fn cancel(&mut self, seq: u64) {
        self.near.cancel(seq);
        self.far.cancel(seq);
        if let Some(r) = self.relays.as_mut() {
            r.cancel(&mut self.near, seq);
        }
    }

    fn peer_health(&self, peer: usize) -> Option<String> {
        if self.is_far.get(peer).copied().unwrap_or(false) {
            self.far.peer_health(peer)
        } else {
            self.near.peer_health(peer)
        }
    }

    fn data_in_flight(&self) -> bool {
        self.near.data_in_flight() || self.far.data_in_flight() || !self.held.is_empty() || self.relays.as_ref().is_some_and(Relays::busy)
    }

    fn signals_queued(&self) -> bool {
        self.near.signals_queued() || self.far.signals_queued()
    }

    fn describe(&self) -> String {
        let relays = self.relays.as_ref().map_or(String::new(), |r| format!("; {}", r.describe()));
        format!("this node: {}; other nodes: {}{relays}", self.near.describe(), self.far.describe())
    }

    fn close(&mut self) {
        if let Some(r) = self.relays.as_mut() {
            r.close(&mut self.near, self.far.as_mut());
        }
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

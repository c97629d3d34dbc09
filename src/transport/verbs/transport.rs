//! The verbs transport: ranks of other nodes over RDMA, one [`Channel`] per peer (several
//! reliable-connected queue pairs, `HOCCL_QPS_PER_PEER`), driven from the proxy's turns;
//! nothing here waits once the channels are connected (at communicator creation,
//! `comm::setup`).
//!
//! **Messages.** Everything a peer receives is a chunk of its channel, in one of its
//! receive slots and under the channel's credits, so nothing is ever overwritten: data
//! chunks name their transfer (the receiver's token, 1..2^24), its length (at most the
//! receive buffer's, as for the socket transport) and their offset; control messages
//! are chunks of transfer [`CONTROL`] whose payload is a [`REC`]-byte record
//! `kind | k | pair_seq | a | token`, little-endian. Kinds: `Ready` (a receive buffer: `a`
//! its length, `token` its name at the receiver), `Failed` (`a` the error code), `Done`
//! (the receiver has every byte of `token`), `Cancelled` (the sender cut transfer `token`
//! short: the receiver forgets it), `Bye` (the sender's communicator closed). Control
//! messages go on the channel's first queue pair (`Channel::try_send_ordered`), so they
//! arrive in the order they were posted; data chunks go round robin over all the queue
//! pairs and may arrive in any order (each names its offset). A control message waiting
//! for a credit holds back the data to that peer, never the other way round.
//!
//! **Landing.** As for the socket transport, the receiver counts a transfer's bytes: when
//! all have arrived it reports `Landed` to its own engine (through `poll_signals`) and
//! sends `Done` back; the sender reports the flow done at `Done`. While a long transfer's
//! chunks keep arriving the receiver reports `Progress` at most every
//! [`PROGRESS_EVERY`].
//!
//! **Memory.** The NIC's registered slots are allocated once per peer at creation (the
//! channel's), and nothing per chunk. On the host backend, whose device memory is host
//! memory, the sender copies each chunk from the user's buffer into a send slot and the
//! receiver from its receive slot into the user's buffer (the host backend's checked
//! copies). On CUDA the chunks pass through host staging as the socket transport's do
//! ([`Stage`]: `HOCCL_NET_STAGING` bytes of pinned memory allocated once, half send slots,
//! half receive slots, and one copy queue): the copy queue fills a staging slot from the
//! user's buffer (device to host) and, once its fence has completed, the CPU copies it into
//! a registered send slot and writes it; a landed chunk is copied from its registered slot
//! into a staging slot (returning the credit) and the copy queue drains that into the
//! user's buffer, its bytes counting once the copy's fence has completed. Registering the
//! staging itself with the NIC would save the CPU copy, and registering device memory
//! (GPUDirect RDMA) the staging; neither is built.
//!
//! **Rate limit.** `HOCCL_NET_GBPS` caps this rank's payload bytes per second in each
//! direction with the socket transport's token bucket ([`Bucket`]): a sender writes a chunk
//! only when the bucket grants it, a receiver drains a landed chunk (and returns its
//! credit) only when its own bucket grants it.
//!
//! **Health.** An error completion or a malformed chunk fails the peer's channel and makes
//! the peer gone: its flows fail (the error names the rank) and `peer_health` says why. A
//! peer that closed its communicator says `Bye` first, and is gone from then on. A peer
//! that vanishes without a word is found by the first work request to it that fails (the
//! NIC's retries), or else by the engine's timeout.
use super::channel::{Arrived, Channel};
use super::nic::{Event, Nic};
use super::pinned::Pinned;
use crate::device::{DevPtr, Device};
use crate::transport::fair::Fair;
use crate::transport::host_staging::HostStaging;
use crate::error::{Error, Result};
use crate::transport::socket::{Bucket, PROGRESS_EVERY};
use crate::transport::{FlowId, Incoming, Region, RemoteBuffer, Signal, Tag, Transport, Wire};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

const OP: &str = "verbs transport";
/// The transfer number of control messages (data transfers are 1..2^24).
pub const CONTROL: u32 = 0;
/// Bytes of a control record.
pub const REC: usize = 32;
/// Transfer numbers travel in the immediate's low 24 bits.
const TOKENS: u32 = 1 << 24;
/// How long `close` tries to send the last signals and see them complete.
const CLOSE_FLUSH: Duration = Duration::from_millis(200);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Ready = 1,
    Failed = 2,
    Done = 3,
    Cancelled = 4,
    Bye = 5,
}

/// A control record, decoded.
#[derive(Clone, Copy, Debug)]
struct Ctl {
    kind: Kind,
    k: u32,
    pair_seq: u64,
    a: u64,
    token: u32,
}

impl Ctl {
    fn new(kind: Kind, pair_seq: u64, k: u32) -> Ctl {
        Ctl { kind, k, pair_seq, a: 0, token: 0 }
    }

    fn encode(&self) -> [u8; REC] {
        let mut b = [0u8; REC];
        b[0] = self.kind as u8;
        b[4..8].copy_from_slice(&self.k.to_le_bytes());
        b[8..16].copy_from_slice(&self.pair_seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.a.to_le_bytes());
        b[24..28].copy_from_slice(&self.token.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Ctl> {
        if b.len() != REC {
            return None;
        }
        let kind = match b[0] {
            1 => Kind::Ready,
            2 => Kind::Failed,
            3 => Kind::Done,
            4 => Kind::Cancelled,
            5 => Kind::Bye,
            _ => return None,
        };
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Some(Ctl { kind, k: u32_at(4), pair_seq: u64_at(8), a: u64_at(16), token: u32_at(24) })
    }
}

/// A send with chunks left to write.
struct OutFlow {
    id: FlowId,
    token: u32,
    src: DevPtr,
    len: usize,
    /// Bytes written so far.
    next: usize,
    /// Whether a chunk of it was written (a cancel then tells the receiver).
    begun: bool,
}

/// A receive buffer exposed to the peer, by token.
struct Slot {
    /// The op it belongs to (what an error about it names).
    seq: u64,
    ptr: DevPtr,
    len: usize,
    /// The transfer it was announced for (set by `post_ready`).
    pair_seq: u64,
    k: u32,
    /// The transfer's length (at most `len`), from its first chunk.
    total: Option<u64>,
    received: u64,
    told: Instant,
}

/// Everything about one peer of another node.
struct Peer {
    ch: Channel,
    /// Control records not yet written, in order.
    ctrl: VecDeque<[u8; REC]>,
    flows: VecDeque<OutFlow>,
    /// Flows whose every chunk is written, waiting for the receiver's `Done`, by token.
    awaiting: HashMap<u32, FlowId>,
    slots: HashMap<u32, Slot>,
    /// Data chunks that landed and wait for the receive rate limit (or, staged, a free
    /// receive staging slot), in order.
    held: VecDeque<Arrived>,
    /// Staged: chunks in host staging, ready for the channel, in order.
    ready: VecDeque<Staged>,
    bye: bool,
    gone: Option<String>,
}

/// A chunk in host staging: `n` bytes of op `seq`'s transfer `token` (`total` bytes in
/// all) at `offset`, in send slot `at`.
#[derive(Clone, Copy, Debug)]
struct Staged {
    seq: u64,
    token: u32,
    offset: u64,
    total: u64,
    n: usize,
    at: DevPtr,
}

/// A host-to-device copy of a drained chunk: `n` bytes of receive `token` (op `seq`,
/// `total` bytes in all) from peer `peer`, from receive slot `at`, done at fence `ticket`.
struct Drain {
    ticket: u64,
    peer: usize,
    token: u32,
    total: u64,
    n: usize,
    seq: u64,
    at: DevPtr,
}

/// Host staging and the copy queue that fills and drains it, for device memory that is not
/// host memory (CUDA): send slots the queue fills from the user's buffers, receive slots it
/// drains into them.
struct Stage {
    host: HostStaging,
    pinned: Pinned,
    send_free: Vec<DevPtr>,
    recv_free: Vec<DevPtr>,
    /// Device-to-host copies in flight: (fence ticket, peer, chunk).
    filling: VecDeque<(u64, usize, Staged)>,
    draining: VecDeque<Drain>,
    /// Ops cancelled while their chunks were being copied into staging.
    cancelled: Vec<u64>,
    /// The copy queue failed: copies it had may still write the staging.
    broken: bool,
}

impl Stage {
    fn new(dev: Arc<dyn Device>, bytes: usize, slot: usize) -> Result<Stage> {
        let host = HostStaging::new(dev, bytes, slot)?;
        let n = host.n;
        Ok(Stage {
            pinned: Pinned::new(host.base, host.len()),
            send_free: (0..n).map(|i| host.slot_ptr(i)).collect(),
            recv_free: (n..2 * n).map(|i| host.slot_ptr(i)).collect(),
            filling: VecDeque::with_capacity(n),
            draining: VecDeque::with_capacity(n),
            cancelled: Vec::new(),
            broken: false,
            host,
        })
    }

    fn busy(&self) -> bool {
        !self.filling.is_empty() || !self.draining.is_empty()
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        self.host.release("verbs transport", self.filling.len() + self.draining.len(), self.broken);
    }
}

/// What [`Verbs::new`] needs: this rank, its NIC and, by rank, the channel connected to
/// each rank of another node (None for the ranks of this node).
pub struct VerbsLinks {
    pub rank: usize,
    pub nic: Box<dyn Nic>,
    pub channels: Vec<Option<Channel>>,
    /// `Config::net_gbps`.
    pub gbps: f64,
    /// The NIC, as one line for the log.
    pub nic_name: String,
    /// Bytes of host staging (`Config::net_staging_bytes`), or None to copy between the
    /// slots and the user buffers directly (the host backend, whose device memory is host
    /// memory).
    pub staging: Option<usize>,
}

pub struct Verbs {
    dev: Arc<dyn Device>,
    rank: usize,
    nic: Box<dyn Nic>,
    peers: Vec<Option<Peer>>,
    stage: Option<Stage>,
    next_token: u32,
    send_bucket: Bucket,
    recv_bucket: Bucket,
    /// One chunk's payload on its way between a user buffer and a slot.
    scratch: Vec<u8>,
    events: Vec<Event>,
    /// Results gathered while reaping, handed out by `poll_signals` and `progress`.
    incoming: Vec<Incoming>,
    done: Vec<FlowId>,
    advanced: Vec<u64>,
    failed: VecDeque<(u64, Error)>,
    /// The peer each pass starts at when writing, filling send slots and draining what the
    /// receive rate limit held back ([`Fair`]).
    out_first: Fair,
    fill_first: Fair,
    drain_first: Fair,
}

impl Verbs {
    /// The transport over `links`' connected channels. Direct copies need the host
    /// backend; any other device needs `links.staging`.
    pub fn new(dev: Arc<dyn Device>, links: VerbsLinks) -> Result<Verbs> {
        let payload = links.channels.iter().flatten().map(Channel::max_payload).max().unwrap_or(0);
        let stage = match links.staging {
            Some(bytes) => Some(Stage::new(dev.clone(), bytes, payload.min(bytes / 4).max(4096))?),
            None if dev.backend() == crate::device::Backend::Host => None,
            None => return Err(Error::invalid_usage(OP, "device memory that is not host memory needs host staging")),
        };
        let peers: Vec<Option<Peer>> = links
            .channels
            .into_iter()
            .map(|c| {
                c.map(|ch| Peer {
                    ch,
                    ctrl: VecDeque::with_capacity(64),
                    flows: VecDeque::new(),
                    awaiting: HashMap::new(),
                    slots: HashMap::new(),
                    held: VecDeque::new(),
                    ready: VecDeque::new(),
                    bye: false,
                    gone: None,
                })
            })
            .collect();
        log::info!(
            "rank {}: verbs transport on {}: {} rank(s) of other nodes, chunks of {} KiB, {}, rate {}",
            links.rank,
            links.nic_name,
            peers.iter().flatten().count(),
            payload >> 10,
            stage.as_ref().map_or("direct copies".to_string(), |s| format!("{} staging slots of {} KiB", s.send_free.len() + s.recv_free.len(), s.host.slot >> 10)),
            if links.gbps > 0.0 { format!("{} GB/s", links.gbps) } else { "unlimited".into() }
        );
        Ok(Verbs {
            dev,
            rank: links.rank,
            nic: links.nic,
            peers,
            stage,
            next_token: 1,
            send_bucket: Bucket::new(links.gbps),
            recv_bucket: Bucket::new(links.gbps),
            scratch: vec![0u8; payload.max(REC)],
            events: Vec::new(),
            incoming: Vec::new(),
            done: Vec::new(),
            advanced: Vec::new(),
            failed: VecDeque::new(),
            out_first: Fair::new(links.rank),
            fill_first: Fair::new(links.rank),
            drain_first: Fair::new(links.rank),
        })
    }

    /// Whether this transport reaches `peer`.
    pub fn reaches(&self, peer: usize) -> bool {
        self.peers.get(peer).is_some_and(Option::is_some)
    }

    fn peer(&mut self, peer: usize) -> Result<&mut Peer> {
        let rank = self.rank;
        let p = self.peers.get_mut(peer).and_then(Option::as_mut).ok_or_else(|| Error::internal(OP, format!("rank {rank} has no channel to rank {peer}")))?;
        match &p.gone {
            Some(why) => Err(Error::Remote { op: OP, peer, what: why.clone() }),
            None => Ok(p),
        }
    }

    /// Queue a control record to `peer` (dropped, with a debug line, when it is gone).
    fn post(&mut self, peer: usize, c: Ctl) {
        match self.peers.get_mut(peer).and_then(Option::as_mut) {
            Some(p) if p.gone.is_none() => p.ctrl.push_back(c.encode()),
            Some(p) => log::debug!("rank {}: {:?} to rank {peer} dropped: {}", self.rank, c.kind, p.gone.as_deref().unwrap_or("")),
            None => log::error!("rank {}: no channel to rank {peer}", self.rank),
        }
    }

    /// Peer `i` can no longer be reached: fail its flows, forget its receives. After its
    /// `Bye`, whatever failed says that it closed.
    fn mark_gone(&mut self, i: usize, why: String) {
        let Some(p) = self.peers.get_mut(i).and_then(Option::as_mut) else { return };
        if p.gone.is_some() {
            return;
        }
        let why = if p.bye { "its communicator was destroyed or aborted".to_string() } else { why };
        log::debug!("rank {}: rank {i} is gone: {why}", self.rank);
        let mut seqs: Vec<u64> = p.flows.drain(..).map(|f| f.id.seq).chain(p.awaiting.drain().map(|(_, id)| id.seq)).collect();
        for c in p.ready.drain(..) {
            seqs.push(c.seq);
            if let Some(st) = self.stage.as_mut() {
                st.send_free.push(c.at);
            }
        }
        seqs.sort_unstable();
        seqs.dedup();
        for seq in seqs {
            self.failed.push_back((seq, Error::Remote { op: OP, peer: i, what: why.clone() }));
        }
        p.slots.clear();
        p.ctrl.clear();
        p.held.clear();
        p.gone = Some(why);
    }

    /// Reap the NIC's completions: chunks that landed (control messages handled, data
    /// drained into the receive buffers), writes and credits that completed, errors. Whether
    /// anything happened.
    fn reap(&mut self) -> bool {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        if let Err(e) = self.nic.poll(&mut events) {
            for i in 0..self.peers.len() {
                self.mark_gone(i, format!("polling the NIC's completions failed: {e}"));
            }
            return true;
        }
        let (mut arrived, mut sent) = (Vec::new(), Vec::new());
        for ev in &events {
            let qp = match ev {
                Event::Sent { qp, .. } | Event::WriteLanded { qp, .. } | Event::Received { qp, .. } | Event::Failed { qp, .. } => *qp,
            };
            let Some(i) = self.peers.iter().position(|p| p.as_ref().is_some_and(|p| p.ch.owns(qp))) else { continue };
            let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { continue };
            // Chunks are handled as their events come: a control message that landed
            // before an error completion (a Bye, then the peer's queue pairs destroyed) is
            // read before the channel fails.
            let r = p.ch.handle(self.nic.as_mut(), ev, &mut arrived, &mut sent);
            for a in arrived.drain(..) {
                self.arrive(i, a);
            }
            if r.is_err() {
                let why = self.peers[i].as_ref().and_then(|p| p.ch.failed()).unwrap_or("error completion").to_string();
                self.mark_gone(i, format!("its verbs channel failed: {why}"));
            }
        }
        let any = !events.is_empty();
        self.events = events;
        any
    }

    /// Chunk `a` landed from peer `i`.
    fn arrive(&mut self, i: usize, a: Arrived) {
        let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { return };
        if a.xfer != CONTROL {
            p.held.push_back(a);
            self.drain_held(i);
            return;
        }
        let mut rec = [0u8; REC];
        let ctl = match rec.get_mut(..a.len) {
            Some(buf) => p.ch.take(self.nic.as_mut(), &a, buf).ok().and_then(|_| Ctl::decode(buf)),
            None => None,
        };
        let Some(c) = ctl else {
            self.mark_gone(i, format!("its verbs channel carried a malformed {}-byte control message", a.len));
            return;
        };
        let remote = RemoteBuffer { len: c.a, wire: Wire { alloc_id: u64::from(c.token), ..Wire::empty(0) } };
        let signal = match c.kind {
            Kind::Ready => Signal::Ready { k: c.k, remote },
            Kind::Failed => Signal::Failed { code: c.a as u32 },
            Kind::Done => {
                if let Some(id) = p.awaiting.remove(&c.token) {
                    self.done.push(id);
                    self.advanced.push(id.seq);
                }
                return;
            }
            Kind::Cancelled => {
                p.slots.remove(&c.token);
                return;
            }
            Kind::Bye => {
                p.bye = true;
                self.mark_gone(i, String::new());
                return;
            }
        };
        self.incoming.push(Incoming { from: i, pair_seq: c.pair_seq, signal });
    }

    /// Drain peer `i`'s landed data chunks into their receive buffers (staged: into receive
    /// staging, whose copy to the buffer the copy queue then makes), in order, while the
    /// receive rate limit (and the staging) allows; whether one was drained.
    fn drain_held(&mut self, i: usize) -> bool {
        let mut any = false;
        loop {
            let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { return any };
            let Some(&a) = p.held.front() else { return any };
            let Some(slot) = p.slots.get_mut(&a.xfer) else {
                // Its receive failed or was cancelled: drop the bytes, return the credit.
                p.held.pop_front();
                if let Err(e) = p.ch.take(self.nic.as_mut(), &a, &mut self.scratch[..a.len]) {
                    self.mark_gone(i, format!("its verbs channel failed: {e}"));
                }
                any = true;
                continue;
            };
            let end = a.offset.checked_add(a.len as u64);
            if a.total > slot.len as u64 || end.is_none_or(|e| e > a.total) || slot.total.is_some_and(|t| t != a.total) || a.len > self.scratch.len() {
                let why = format!("its verbs channel wrote {} bytes at {} of a {}-byte transfer into a {}-byte receive (corrupt chunk)", a.len, a.offset, a.total, slot.len);
                self.mark_gone(i, why);
                return true;
            }
            let stage = self.stage.as_mut().filter(|_| a.len > 0);
            if stage.as_ref().is_some_and(|st| st.recv_free.is_empty() || a.len > st.host.slot) || (a.len > 0 && self.recv_bucket.grant(a.len) < a.len) {
                return any;
            }
            p.held.pop_front();
            any = true;
            let buf = &mut self.scratch[..a.len];
            if let Err(e) = p.ch.take(self.nic.as_mut(), &a, buf) {
                self.mark_gone(i, format!("its verbs channel failed: {e}"));
                return true;
            }
            self.recv_bucket.spend(a.len);
            slot.total = Some(a.total);
            let dst = slot.ptr.add(a.offset as usize);
            let written = match stage {
                None if a.len == 0 => Ok(()),
                None => crate::device::host::write(dst, buf),
                Some(st) => {
                    let at = st.recv_free.pop().expect("checked above");
                    let r = st.pinned.write(at, buf).and_then(|_| st.host.queue.copy(dst, at, a.len)).and_then(|_| st.host.queue.fence());
                    match r {
                        Ok(ticket) => {
                            st.draining.push_back(Drain { ticket, peer: i, token: a.xfer, total: a.total, n: a.len, seq: slot.seq, at });
                            continue;
                        }
                        Err(e) => {
                            st.recv_free.push(at);
                            Err(e)
                        }
                    }
                }
            };
            if let Err(e) = written {
                let seq = slot.seq;
                p.slots.remove(&a.xfer);
                self.failed.push_back((seq, e));
                continue;
            }
            self.count(i, a.xfer, a.len as u64, a.total);
        }
    }

    /// `n` more bytes of peer `i`'s transfer `token` (`total` bytes) are in place; when it
    /// has them all, report `Landed` to this rank's engine and queue `Done` to the sender.
    fn count(&mut self, i: usize, token: u32, n: u64, total: u64) {
        let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { return };
        let Some(slot) = p.slots.get_mut(&token) else { return };
        slot.received += n;
        let (pair_seq, k) = (slot.pair_seq, slot.k);
        if slot.received < total {
            if n > 0 && slot.told.elapsed() >= PROGRESS_EVERY {
                slot.told = Instant::now();
                self.incoming.push(Incoming { from: i, pair_seq, signal: Signal::Progress { k } });
            }
            return;
        }
        p.slots.remove(&token);
        self.incoming.push(Incoming { from: i, pair_seq, signal: Signal::Landed { k, len: total } });
        let mut d = Ctl::new(Kind::Done, pair_seq, k);
        (d.a, d.token) = (total, token);
        p.ctrl.push_back(d.encode());
    }

    /// Staged: copy the next chunks of the peers' flows into free send slots, one chunk per
    /// peer per pass while slots (and the send rate limit) last, and reap the copies that
    /// completed (filled slots go to their peer's `ready`, drained receive slots count
    /// their bytes). Whether anything moved.
    fn stage_work(&mut self) -> bool {
        let Some(st) = self.stage.as_mut() else { return false };
        let mut moved = false;
        let mut progress = true;
        while progress && !st.send_free.is_empty() {
            progress = false;
            for i in self.fill_first.order(self.peers.len()) {
                let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { continue };
                let Some(f) = p.flows.front_mut() else { continue };
                let mut n = (f.len - f.next).min(p.ch.max_payload()).min(st.host.slot);
                if n > 0 {
                    n = self.send_bucket.grant(n);
                    if n == 0 {
                        continue;
                    }
                }
                let c = Staged { seq: f.id.seq, token: f.token, offset: f.next as u64, total: f.len as u64, n, at: DevPtr(0) };
                if n == 0 {
                    p.ready.push_back(c);
                } else {
                    let Some(at) = st.send_free.pop() else { break };
                    match st.host.queue.copy(at, f.src.add(f.next), n).and_then(|_| st.host.queue.fence()) {
                        Ok(ticket) => st.filling.push_back((ticket, i, Staged { at, ..c })),
                        Err(e) => {
                            st.send_free.push(at);
                            p.flows.pop_front();
                            self.failed.push_back((c.seq, e));
                            continue;
                        }
                    }
                    self.send_bucket.spend(n);
                }
                (f.next, f.begun) = (f.next + n, true);
                if f.next == f.len {
                    let f = p.flows.pop_front().expect("front exists");
                    p.awaiting.insert(f.token, f.id);
                }
                self.fill_first.moved(i);
                moved = true;
                progress = true;
                if st.send_free.is_empty() {
                    break;
                }
            }
        }
        if !st.busy() {
            return moved;
        }
        let done = match st.host.queue.completed() {
            Ok(t) => t,
            Err(e) => {
                // The queue is broken: every op with a copy on it fails, and those copies'
                // slots are not used again (the device may still write them).
                st.broken = true;
                let mut seqs: Vec<u64> = st.filling.drain(..).map(|(_, _, c)| c.seq).chain(st.draining.drain(..).map(|d| d.seq)).collect();
                seqs.sort_unstable();
                seqs.dedup();
                for seq in seqs {
                    self.failed.push_back((seq, e.clone()));
                }
                return true;
            }
        };
        while st.filling.front().is_some_and(|(t, _, _)| *t <= done) {
            let (_, i, c) = st.filling.pop_front().expect("front exists");
            moved = true;
            match self.peers[i].as_mut().filter(|p| p.gone.is_none()) {
                Some(p) if !st.cancelled.contains(&c.seq) => p.ready.push_back(c),
                _ => st.send_free.push(c.at),
            }
        }
        if st.filling.is_empty() {
            st.cancelled.clear();
        }
        let mut drained = Vec::new();
        while st.draining.front().is_some_and(|d| d.ticket <= done) {
            let d = st.draining.pop_front().expect("front exists");
            st.recv_free.push(d.at);
            drained.push(d);
        }
        for d in drained {
            moved = true;
            self.count(d.peer, d.token, d.n as u64, d.total);
        }
        moved
    }

    /// Write what may be written: each peer's control records first, then its flows'
    /// chunks, one chunk per peer per pass while credits (and the rate limit) allow.
    /// Whether anything was written.
    fn push(&mut self) -> bool {
        let mut moved = false;
        loop {
            let mut any = false;
            let mut last = None;
            for i in self.out_first.order(self.peers.len()) {
                let Some(p) = self.peers[i].as_mut().filter(|p| p.gone.is_none()) else { continue };
                if let Some(rec) = p.ctrl.front() {
                    match p.ch.try_send_ordered(self.nic.as_mut(), CONTROL, 0, REC as u64, rec) {
                        Ok(true) => {
                            p.ctrl.pop_front();
                            any = true;
                        }
                        Ok(false) => {}
                        Err(e) => self.mark_gone(i, format!("its verbs channel failed: {e}")),
                    }
                    continue;
                }
                if !p.ch.can_send() {
                    continue;
                }
                if self.stage.is_some() {
                    if self.send_staged(i) {
                        (any, last) = (true, Some(i));
                    }
                    continue;
                }
                let Some(f) = p.flows.front_mut() else { continue };
                let mut n = (f.len - f.next).min(p.ch.max_payload()).min(self.scratch.len());
                if n > 0 {
                    n = self.send_bucket.grant(n);
                    if n == 0 {
                        continue;
                    }
                }
                let buf = &mut self.scratch[..n];
                if let Err(e) = if n == 0 { Ok(()) } else { crate::device::host::read(f.src.add(f.next), buf) } {
                    let seq = f.id.seq;
                    p.flows.pop_front();
                    self.failed.push_back((seq, e));
                    continue;
                }
                match p.ch.try_send(self.nic.as_mut(), f.token, f.next as u64, f.len as u64, buf) {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(e) => {
                        self.mark_gone(i, format!("its verbs channel failed: {e}"));
                        continue;
                    }
                }
                self.send_bucket.spend(n);
                (f.next, f.begun) = (f.next + n, true);
                if self.advanced.last() != Some(&f.id.seq) {
                    self.advanced.push(f.id.seq);
                }
                if f.next == f.len {
                    let f = p.flows.pop_front().expect("front exists");
                    p.awaiting.insert(f.token, f.id);
                }
                (any, last) = (true, Some(i));
            }
            if let Some(i) = last {
                self.out_first.moved(i);
            }
            if !any {
                return moved;
            }
            moved = true;
        }
    }

    /// Staged: write peer `i`'s next filled staging slot (the channel has a credit); whether
    /// one went.
    fn send_staged(&mut self, i: usize) -> bool {
        let (Some(st), Some(p)) = (self.stage.as_mut(), self.peers[i].as_mut()) else { return false };
        let Some(c) = p.ready.front().copied() else { return false };
        let buf = &mut self.scratch[..c.n];
        let sent = match if c.n == 0 { Ok(()) } else { st.pinned.read(c.at, buf) } {
            Ok(()) => p.ch.try_send(self.nic.as_mut(), c.token, c.offset, c.total, buf),
            Err(e) => {
                // The chunk cannot be read: it is dropped and its op fails.
                self.failed.push_back((c.seq, e));
                Ok(true)
            }
        };
        match sent {
            Ok(true) => {}
            Ok(false) => return false,
            Err(e) => {
                self.mark_gone(i, format!("its verbs channel failed: {e}"));
                return true;
            }
        }
        p.ready.pop_front();
        if c.n > 0 {
            st.send_free.push(c.at);
        }
        if self.advanced.last() != Some(&c.seq) {
            self.advanced.push(c.seq);
        }
        true
    }

    /// Drain what the receive rate limit held back; whether anything was drained.
    fn drain_all(&mut self) -> bool {
        let mut any = false;
        for i in self.drain_first.order(self.peers.len()) {
            if self.drain_held(i) {
                any = true;
                self.drain_first.moved(i);
            }
        }
        any
    }

    /// A token no receive of `peer` holds: 1..2^24 (the immediate's transfer bits).
    fn token(&mut self, peer: usize) -> u32 {
        loop {
            let t = self.next_token;
            self.next_token = if t + 1 >= TOKENS { 1 } else { t + 1 };
            if self.peers.get(peer).and_then(Option::as_ref).is_none_or(|p| !p.slots.contains_key(&t)) {
                return t;
            }
        }
    }
}

impl Transport for Verbs {
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        if region.len > 0 {
            let a = region.alloc.ok_or_else(|| Error::invalid_arg(OP, format!("{:#x}+{}: no allocation holds it", region.ptr.0, region.len)))?;
            let end = region.ptr.0.checked_add(region.len as u64);
            if region.ptr.0 < a.base.0 || end.is_none_or(|e| e > a.base.0 + a.len as u64) {
                return Err(Error::invalid_arg(OP, format!("{:#x}+{} is outside its allocation {:#x}+{}", region.ptr.0, region.len, a.base.0, a.len)));
            }
        }
        let token = self.token(peer);
        let p = self.peer(peer)?;
        let slot = Slot { seq: region.seq, ptr: region.ptr, len: region.len, pair_seq: 0, k: 0, total: None, received: 0, told: Instant::now() };
        p.slots.insert(token, slot);
        let wire = Wire { alloc_id: u64::from(token), ..Wire::empty(std::process::id()) };
        Ok(RemoteBuffer { len: region.len as u64, wire })
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        let token = remote.wire.alloc_id as u32;
        if let Some(slot) = self.peers.get_mut(peer).and_then(Option::as_mut).and_then(|p| p.slots.get_mut(&token)) {
            (slot.pair_seq, slot.k) = (tag.pair_seq, tag.k);
        }
        let mut c = Ctl::new(Kind::Ready, tag.pair_seq, tag.k);
        (c.a, c.token) = (remote.len, token);
        self.post(peer, c);
    }

    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32) {
        // The op's receives from `peer` are over: data still coming for them is dropped.
        if let Some(p) = self.peers.get_mut(peer).and_then(Option::as_mut) {
            p.slots.retain(|_, s| s.pair_seq != pair_seq);
        }
        let mut c = Ctl::new(Kind::Failed, pair_seq, 0);
        c.a = u64::from(code);
        self.post(peer, c);
    }

    fn poll_signals(&mut self, out: &mut Vec<Incoming>) -> bool {
        self.reap();
        self.drain_all();
        let any = !self.incoming.is_empty();
        out.append(&mut self.incoming);
        any
    }

    fn start_write(&mut self, id: FlowId, peer: usize, _tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        let token = u32::try_from(remote.wire.alloc_id).ok().filter(|t| *t != CONTROL && *t < TOKENS);
        let Some(token) = token else {
            return Err(Error::Remote { op: OP, peer, what: format!("announced receive {} is not a verbs transfer", remote.wire.alloc_id) });
        };
        if len as u64 > remote.len {
            return Err(Error::invalid_usage(OP, format!("{len} bytes to rank {peer}'s {}-byte receive", remote.len)));
        }
        self.peer(peer)?.flows.push_back(OutFlow { id, token, src, len, next: 0, begun: false });
        Ok(())
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        let mut moved = self.stage_work();
        moved |= self.reap();
        moved |= self.drain_all();
        moved |= self.push();
        // Landings just drained owe their senders a `Done`; credits just returned let more go.
        moved |= self.stage_work();
        moved |= self.reap();
        moved |= self.drain_all();
        moved |= self.push();
        done.append(&mut self.done);
        advanced.append(&mut self.advanced);
        match self.failed.pop_front() {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    fn cancel(&mut self, seq: u64) {
        for i in 0..self.peers.len() {
            let Some(p) = self.peers[i].as_mut() else { continue };
            let mut cut = Vec::new();
            p.flows.retain(|f| {
                let keep = f.id.seq != seq;
                if !keep && f.begun {
                    cut.push(f.token);
                }
                keep
            });
            p.awaiting.retain(|_, id| id.seq != seq);
            let mut freed = Vec::new();
            p.ready.retain(|c| {
                let keep = c.seq != seq;
                if !keep && c.n > 0 {
                    freed.push(c.at);
                }
                keep
            });
            if let Some(st) = self.stage.as_mut() {
                st.send_free.extend(freed);
                if st.filling.iter().any(|(_, _, c)| c.seq == seq) {
                    st.cancelled.push(seq);
                }
            }
            // Chunks already written stay in the receiver's slots (its credits): it drops
            // them once it forgets the transfer.
            for token in cut {
                let mut c = Ctl::new(Kind::Cancelled, 0, 0);
                c.token = token;
                self.post(i, c);
            }
        }
    }

    fn peer_health(&self, peer: usize) -> Option<String> {
        self.peers.get(peer)?.as_ref()?.gone.clone()
    }

    fn data_in_flight(&self) -> bool {
        self.stage.as_ref().is_some_and(Stage::busy)
            || self.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| {
                !p.flows.is_empty()
                    || !p.ready.is_empty()
                    || !p.awaiting.is_empty()
                    || !p.held.is_empty()
                    || p.ch.in_flight() > 0
                    || p.slots.values().any(|s| s.received > 0)
            })
    }

    fn signals_queued(&self) -> bool {
        self.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| !p.ctrl.is_empty())
    }

    fn describe(&self) -> String {
        let live = self.peers.iter().flatten().filter(|p| p.gone.is_none());
        let (mut flows, mut awaiting, mut slots, mut ctrl, mut writes) = (0, 0, 0, 0, 0);
        for p in live {
            flows += p.flows.len();
            awaiting += p.awaiting.len();
            slots += p.slots.len();
            ctrl += p.ctrl.len();
            writes += p.ch.in_flight();
        }
        let gone: Vec<usize> = (0..self.peers.len()).filter(|i| self.peer_health(*i).is_some()).collect();
        let staging = self.stage.as_ref().map_or(String::new(), |s| format!(", staging: {} copies in, {} out", s.filling.len(), s.draining.len()));
        format!("verbs: {flows} sends with chunks to go, {awaiting} waiting for their receivers' Done, {slots} receives open, {writes} writes in flight, {ctrl} signals queued out{staging}, ranks gone {gone:?}")
    }

    fn close(&mut self) {
        for i in 0..self.peers.len() {
            if self.peers[i].as_ref().is_some_and(|p| p.gone.is_none()) {
                self.post(i, Ctl::new(Kind::Bye, 0, 0));
            }
        }
        // The last signals (a Done, failures at an abort, the Bye) go out and complete
        // within a bound: the NIC may drop work requests of a queue pair destroyed under them.
        let t0 = Instant::now();
        let busy = |v: &Verbs| v.peers.iter().flatten().filter(|p| p.gone.is_none()).any(|p| !p.ctrl.is_empty() || p.ch.in_flight() > 0);
        while busy(self) && t0.elapsed() < CLOSE_FLUSH {
            let moved = self.reap() | self.drain_all() | self.push();
            if !moved {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        for p in self.peers.iter_mut().flatten() {
            p.gone.get_or_insert_with(|| "this rank closed its communicator".into());
        }
        // Copies still in flight (a forced exit) keep the staging allocated (`Stage::drop`).
        while self.stage.as_ref().is_some_and(Stage::busy) && t0.elapsed() < 2 * CLOSE_FLUSH {
            if !self.stage_work() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        self.stage = None;
    }
}

#[cfg(test)]
mod tests {
    use super::super::channel::{Channel, Setup};
    use super::super::nic::fake::FakeNic;
    use super::*;
    use crate::device::host::HostDevice;

    fn host() -> Arc<dyn Device> {
        Arc::new(HostDevice::new().unwrap())
    }

    /// Ranks 0 and 1 on the fake fabric, `qps` queue pairs, `nslots` slots of `slot`
    /// bytes; `hurt` runs on rank 0's NIC before it is boxed (fault injection).
    fn pair(qps: usize, nslots: usize, slot: usize, gbps: f64, hurt: impl FnOnce(&FakeNic)) -> (Arc<dyn Device>, Verbs, Verbs) {
        pair_staged(qps, nslots, slot, gbps, None, hurt)
    }

    /// As `pair`, through `staging` bytes of host staging on each side (the path CUDA takes).
    fn pair_staged(qps: usize, nslots: usize, slot: usize, gbps: f64, staging: Option<usize>, hurt: impl FnOnce(&FakeNic)) -> (Arc<dyn Device>, Verbs, Verbs) {
        let dev = host();
        let (mut na, mut nb) = (FakeNic::new(), FakeNic::new());
        let (mut a, sa) = Channel::new(&mut na, qps, nslots, slot).unwrap();
        let (mut b, sb) = Channel::new(&mut nb, qps, nslots, slot).unwrap();
        a.connect(&mut na, &Setup::from_bytes(&sb.to_bytes()).unwrap()).unwrap();
        b.connect(&mut nb, &Setup::from_bytes(&sa.to_bytes()).unwrap()).unwrap();
        hurt(&na);
        let links = |rank: usize, nic: FakeNic, ch: Channel| {
            let mut channels: Vec<Option<Channel>> = vec![None, None];
            channels[1 - rank] = Some(ch);
            VerbsLinks { rank, nic: Box::new(nic), channels, gbps, nic_name: "fake".into(), staging }
        };
        let t0 = Verbs::new(dev.clone(), links(0, na, a)).unwrap();
        let t1 = Verbs::new(dev.clone(), links(1, nb, b)).unwrap();
        (dev, t0, t1)
    }

    /// Turn both transports until `until` holds (10 s at most); the flows done and the
    /// signals each received.
    fn drive(t: &mut [&mut Verbs; 2], until: impl Fn(&[Vec<FlowId>; 2], &[Vec<Incoming>; 2], &[Option<(u64, Error)>; 2]) -> bool) -> ([Vec<FlowId>; 2], [Vec<Incoming>; 2], [Option<(u64, Error)>; 2]) {
        let (mut done, mut sig): ([Vec<FlowId>; 2], [Vec<Incoming>; 2]) = Default::default();
        let mut err: [Option<(u64, Error)>; 2] = [None, None];
        let t0 = Instant::now();
        while !until(&done, &sig, &err) {
            assert!(t0.elapsed() < Duration::from_secs(10), "no progress: {} / {}", t[0].describe(), t[1].describe());
            for (i, x) in t.iter_mut().enumerate() {
                x.poll_signals(&mut sig[i]);
                if let Err(e) = x.progress(&mut done[i], &mut Vec::new()) {
                    err[i].get_or_insert(e);
                }
            }
        }
        (done, sig, err)
    }

    fn region(dev: &Arc<dyn Device>, seq: u64, len: usize) -> (DevPtr, Region) {
        let p = dev.alloc(len.max(1)).unwrap();
        (p, Region { seq, ptr: p, len, alloc: (len > 0).then(|| dev.allocation(p).unwrap()) })
    }

    /// Rank 1 exposes a receive, announces it; rank 0 writes `len` bytes: the bytes land
    /// intact, rank 1 sees Ready's twin Landed, rank 0 reports the flow.
    fn write_lands(qps: usize, nslots: usize, slot: usize, len: usize) {
        write_lands_via(qps, nslots, slot, len, None);
    }

    fn write_lands_via(qps: usize, nslots: usize, slot: usize, len: usize, staging: Option<usize>) {
        let (dev, mut t0, mut t1) = pair_staged(qps, nslots, slot, 0.0, staging, |_| ());
        let (dst, reg) = region(&dev, 5, len);
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        let (src, _) = region(&dev, 9, len);
        dev.copy_from_host(src, &data).unwrap();
        let remote = t1.expose(0, reg).unwrap();
        t1.post_ready(0, Tag { pair_seq: 3, k: 2 }, remote);
        let (_, sig, _) = drive(&mut [&mut t0, &mut t1], |_, s, _| !s[0].is_empty());
        let Signal::Ready { k: 2, remote } = sig[0][0].signal else { panic!("{:?}", sig[0]) };
        let id = FlowId { seq: 9, idx: 0 };
        t0.start_write(id, 1, Tag { pair_seq: 3, k: 2 }, src, &remote, len).unwrap();
        let (done, sig, err) = drive(&mut [&mut t0, &mut t1], |d, s, _| d[0].contains(&id) && s[1].iter().any(|x| matches!(x.signal, Signal::Landed { .. })));
        assert!(err.iter().all(Option::is_none), "{err:?}");
        assert!(sig[1].iter().any(|x| matches!(x.signal, Signal::Landed { k: 2, len: l } if l == len as u64) && x.pair_seq == 3 && x.from == 0), "{:?}", sig[1]);
        assert_eq!(done[0], vec![id]);
        let mut got = vec![0u8; len];
        dev.copy_to_host(&mut got, dst).unwrap();
        assert!(got == data, "the bytes differ");
        assert!(!t0.data_in_flight() && !t1.data_in_flight(), "{} / {}", t0.describe(), t1.describe());
    }

    /// A rate-limited rank 0 (of 3, on the fake fabric) writing as much to ranks 1 and 2
    /// at once shares its rate between them (`Fair`).
    fn shares_rate(staging: Option<usize>) {
        const LEN: usize = 2 << 20;
        let dev = host();
        let mut nics: Vec<FakeNic> = (0..3).map(|_| FakeNic::new()).collect();
        let mut chans: Vec<Vec<Option<Channel>>> = (0..3).map(|_| (0..3).map(|_| None).collect()).collect();
        for a in 0..3 {
            for b in a + 1..3 {
                let (mut ca, sa) = Channel::new(&mut nics[a], 2, 8, 64 << 10).unwrap();
                let (mut cb, sb) = Channel::new(&mut nics[b], 2, 8, 64 << 10).unwrap();
                ca.connect(&mut nics[a], &Setup::from_bytes(&sb.to_bytes()).unwrap()).unwrap();
                cb.connect(&mut nics[b], &Setup::from_bytes(&sa.to_bytes()).unwrap()).unwrap();
                (chans[a][b], chans[b][a]) = (Some(ca), Some(cb));
            }
        }
        let mut t: Vec<Verbs> = nics
            .into_iter()
            .zip(chans)
            .enumerate()
            .map(|(rank, (nic, channels))| Verbs::new(dev.clone(), VerbsLinks { rank, nic: Box::new(nic), channels, gbps: 0.05, nic_name: "fake".into(), staging }).unwrap())
            .collect();
        crate::transport::fair::assert_shares_rate(&dev, &mut t, LEN);
    }

    #[test]
    fn sender_shares_rate() {
        shares_rate(None);
        shares_rate(Some(1 << 20));
    }

    #[test]
    fn writes_land_in_chunks_over_several_queue_pairs() {
        write_lands(1, 2, 4096, 0);
        write_lands(1, 2, 4096, 1);
        write_lands(3, 4, 1024, 100_000);
        write_lands(2, 8, 64 << 10, 1 << 20);
        // Through host staging (two 4 KiB slots each way: chunks wait for them).
        write_lands_via(1, 2, 4096, 0, Some(16 << 10));
        write_lands_via(3, 4, 64 << 10, 1 << 20, Some(16 << 10));
    }

    #[test]
    fn control_records_round_trip_and_garbage_is_refused() {
        let mut c = Ctl::new(Kind::Done, 1 << 40, 7);
        (c.a, c.token) = (12345, 0x00ab_cdef);
        let d = Ctl::decode(&c.encode()).unwrap();
        assert_eq!((d.kind, d.k, d.pair_seq, d.a, d.token), (Kind::Done, 7, 1 << 40, 12345, 0x00ab_cdef));
        assert!(Ctl::decode(&[9u8; REC]).is_none());
        assert!(Ctl::decode(&c.encode()[..REC - 1]).is_none());
    }

    /// An error completion on rank 0's channel fails its flow naming rank 1, and both sides
    /// report the other gone.
    #[test]
    fn an_error_completion_makes_the_peer_gone() {
        let (dev, mut t0, mut t1) = pair(2, 4, 4096, 0.0, |n| n.inject_error(1, "transport retry counter exceeded"));
        let (_, reg) = region(&dev, 5, 64 << 10);
        let (src, _) = region(&dev, 9, 64 << 10);
        let remote = t1.expose(0, reg).unwrap();
        t1.post_ready(0, Tag { pair_seq: 1, k: 0 }, remote);
        let (_, sig, _) = drive(&mut [&mut t0, &mut t1], |_, s, _| !s[0].is_empty());
        let Signal::Ready { remote, .. } = sig[0][0].signal else { panic!() };
        t0.start_write(FlowId { seq: 9, idx: 0 }, 1, Tag { pair_seq: 1, k: 0 }, src, &remote, 64 << 10).unwrap();
        let (_, _, err) = drive(&mut [&mut t0, &mut t1], |_, _, e| e[0].is_some());
        let (seq, e) = err[0].as_ref().unwrap();
        assert_eq!(*seq, 9);
        assert!(matches!(e, Error::Remote { peer: 1, .. }) && e.to_string().contains("transport retry counter exceeded"), "{e}");
        assert!(t0.peer_health(1).unwrap().contains("channel failed"), "{:?}", t0.peer_health(1));
        // The connection's error state flushes rank 1's receives: it finds rank 0 gone.
        t1.poll_signals(&mut Vec::new());
        assert!(t1.peer_health(0).is_some_and(|w| w.contains("channel failed")), "{:?}", t1.peer_health(0));
        assert!(t0.start_write(FlowId { seq: 10, idx: 0 }, 1, Tag { pair_seq: 2, k: 0 }, src, &remote, 64 << 10).is_err());
    }

    /// A peer that closes says Bye: the other side reports it gone with that reason (also
    /// once the closed side's queue pairs are destroyed), and a flow to it fails naming it.
    #[test]
    fn close_says_bye() {
        let (dev, mut t0, mut t1) = pair(2, 4, 4096, 0.0, |_| ());
        let (src, _) = region(&dev, 9, 100);
        t1.close();
        drop(t1);
        t0.poll_signals(&mut Vec::new());
        let why = t0.peer_health(1).expect("rank 1 gone after its Bye");
        assert!(why.contains("destroyed or aborted"), "{why}");
        let remote = RemoteBuffer { len: 100, wire: Wire { alloc_id: 1, ..Wire::empty(0) } };
        let e = t0.start_write(FlowId { seq: 1, idx: 0 }, 1, Tag { pair_seq: 1, k: 0 }, src, &remote, 100).unwrap_err();
        assert!(matches!(e, Error::Remote { peer: 1, .. }) && e.to_string().contains("destroyed or aborted"), "{e}");
    }

    /// A cancelled transfer never lands; its receiver forgets it and returns the credits of
    /// its chunks, so a later transfer on the same channel lands.
    #[test]
    fn cancel_never_lands_and_frees_the_slots() {
        let (dev, mut t0, mut t1) = pair(1, 2, 1024, 0.0, |_| ());
        let len = 100_000;
        let (_, reg) = region(&dev, 5, len);
        let (src, _) = region(&dev, 9, len);
        let remote = t1.expose(0, reg).unwrap();
        t1.post_ready(0, Tag { pair_seq: 1, k: 0 }, remote);
        let (_, sig, _) = drive(&mut [&mut t0, &mut t1], |_, s, _| !s[0].is_empty());
        let Signal::Ready { remote, .. } = sig[0][0].signal else { panic!() };
        t0.start_write(FlowId { seq: 9, idx: 0 }, 1, Tag { pair_seq: 1, k: 0 }, src, &remote, len).unwrap();
        // A few chunks go (two slots), then the op is cancelled.
        let mut done = Vec::new();
        t0.progress(&mut done, &mut Vec::new()).unwrap();
        t0.cancel(9);
        let mut sig1 = Vec::new();
        for _ in 0..50 {
            t0.poll_signals(&mut Vec::new());
            t0.progress(&mut done, &mut Vec::new()).unwrap();
            t1.poll_signals(&mut sig1);
            t1.progress(&mut Vec::new(), &mut Vec::new()).unwrap();
        }
        assert!(done.is_empty() && !sig1.iter().any(|s| matches!(s.signal, Signal::Landed { .. })), "{done:?} {sig1:?}");
        assert!(!t0.data_in_flight() && !t1.data_in_flight(), "{} / {}", t0.describe(), t1.describe());
        drop((t0, t1));
        write_lands(1, 2, 1024, 5000);
    }
}

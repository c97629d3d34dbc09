//! Point-to-point transfers with other nodes carried by the forwarding peers (NCCL's PXN;
//! docs/design.md, "Send/recv through the forwarding peer"). A rank whose forwarding peer is
//! another rank of its node hands each relayed transfer (a `send` or `recv` with a rank of
//! another node, alone or in a group, at least `Config::staged_min_flow_bytes` long) to that
//! peer: a send's bytes are read by the peer's copy queue from the sender's memory through
//! a mapping and leave through the peer's connections (its NIC); a receive's bytes arrive
//! through the peer's connections and land in the receiver's memory through a mapping.
//!
//! ```text
//!   sender S          forwarding peer F            G (receiver's peer)     receiver R
//!                                                   <- RecvDst, RecvBuf --- Ready due
//!                                                   map R's buffer, open a
//!                                                   receive for S's bytes
//!                                                   --- RecvExposed ------> Ready (G's
//!   <-------------------------------------------------------------------- token, via G)
//!   RelayDst, RelaySrc -> map S's allocation,
//!                         write from the mapping --> Data frames, taken
//!                                                   from S's forwarder
//!                         <---------------------- Done
//!   <- RelayDone -------- unmap                     unmap, RecvLanded ---> Landed (from S)
//! ```
//!
//! Either side may relay without the other (a relayed send to a receiver that lands its
//! bytes itself, a direct send to a relayed receive). The control signals stay between S
//! and R (their ops match as without a relay); only the bytes take the forwarding peers'
//! connections and staging. The forwarding peers run no op: their proxies take the records
//! from their mailboxes whatever their own streams do, and move the bytes as flows and
//! receives of their own (op seqs from [`RELAY_SEQ`]). A relay holds nothing but the
//! buffer its op holds anyway, so relays never wait for each other or for a slot (no
//! deadlock between relays started in different orders), and no byte is copied more than
//! on the direct path. Failures on a forwarding peer come back as `RelayFail` / `RecvFail`
//! and fail the op; an op failing cancels its relays; a forwarding peer gone fails the
//! relays it holds within [`HEALTH_EVERY`]; a buffer the peer cannot map now (stale
//! mappings) is refused, and the rank moves those bytes itself.
use crate::device::DevPtr;
use crate::error::{Error, ErrorCode, Result};
use crate::transport::ipc::Mapped;
use crate::transport::mailbox::{Msg, MsgKind};
use crate::transport::same_host::{SameHost, PROGRESS_EVERY};
use crate::transport::{FlowId, Incoming, Region, RemoteBuffer, Signal, Tag, Transport, Wire};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Relay flows' op seqs on the forwarding peer: apart from the communicator's call-order
/// seqs and from graph instances' (which start at 1 << 62).
pub const RELAY_SEQ: u64 = 1 << 61;
/// How often a sender with relays pending checks that its forwarding peer lives.
pub const HEALTH_EVERY: Duration = Duration::from_millis(50);
const OP: &str = "relay (a transfer through a forwarding peer)";

/// Whether op seq `seq` names a relay flow of this rank's far transport.
pub fn is_relay_seq(seq: u64) -> bool {
    seq & (RELAY_SEQ | 1 << 62 | 1 << 63) == RELAY_SEQ
}

/// Counts a communicator reports (`Communicator::relay_counts`).
#[derive(Default, Debug)]
pub struct RelayStats {
    /// Sends this rank handed to its forwarding peer.
    pub handed: AtomicU64,
    /// Of those, the ones the peer could not carry (sent by this rank itself).
    pub refused: AtomicU64,
    /// Sends of other ranks this rank carried to their receivers, and their bytes.
    pub carried: AtomicU64,
    pub carried_bytes: AtomicU64,
    /// Receives this rank asked its forwarding peer to land, those the peer could not
    /// (landed by this rank itself), and the receives of other ranks this rank landed, with
    /// their bytes.
    pub recv_handed: AtomicU64,
    pub recv_refused: AtomicU64,
    pub recv_carried: AtomicU64,
    pub recv_carried_bytes: AtomicU64,
}

/// [`RelayStats`] read at one moment (`Communicator::relay_counts`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayCounts {
    pub handed: u64,
    pub refused: u64,
    pub carried: u64,
    pub carried_bytes: u64,
    pub recv_handed: u64,
    pub recv_refused: u64,
    pub recv_carried: u64,
    pub recv_carried_bytes: u64,
}

impl RelayStats {
    pub fn snapshot(&self) -> RelayCounts {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayCounts {
            handed: get(&self.handed),
            refused: get(&self.refused),
            carried: get(&self.carried),
            carried_bytes: get(&self.carried_bytes),
            recv_handed: get(&self.recv_handed),
            recv_refused: get(&self.recv_refused),
            recv_carried: get(&self.recv_carried),
            recv_carried_bytes: get(&self.recv_carried_bytes),
        }
    }
}

/// What the engine's route needs to run relays.
pub struct RelaySetup {
    /// This rank's forwarding peer, when it is another rank of this node.
    pub via: Option<usize>,
    /// Whether another rank of this node forwards through this one.
    pub serves: bool,
    /// Refuse every relay, as if no allocation could be mapped (tests of the fallback).
    pub refuse: bool,
    pub stats: Arc<RelayStats>,
}

/// A send handed to the forwarding peer, kept to send it directly if the peer refuses.
struct Handed {
    id: FlowId,
    peer: usize,
    tag: Tag,
    src: DevPtr,
    remote: RemoteBuffer,
    len: usize,
}

/// A send this rank carries for `from` (its relay `cookie` there).
struct Carried {
    from: usize,
    cookie: u64,
    mapped: Mapped,
    len: usize,
    told: Instant,
}

/// A receive this rank asked its forwarding peer to land (relay `cookie` there).
struct Asked {
    /// The op it belongs to, the sender, the receive.
    region: Region,
    peer: usize,
    /// Set once the engine posts its `Ready` ([`Relays::post_recv`]).
    tag: Option<Tag>,
    /// The buffer as the forwarding peer maps it.
    wire: Wire,
}

/// A receive this rank lands for `from` (its relay `cookie` there), as socket receive
/// `token`.
struct Landing {
    from: usize,
    cookie: u64,
    token: u64,
    mapped: Mapped,
}

/// Marks the placeholder [`RemoteBuffer`] of a receive asked of the forwarding peer
/// (`wire.offset`; its `alloc_id` is the relay's cookie).
const ASKED: u64 = u64::MAX;

/// The relays of one rank, both as a sender or receiver and as a forwarding peer.
pub struct Relays {
    via: Option<usize>,
    serves: bool,
    refuse: bool,
    stats: Arc<RelayStats>,
    next_cookie: u64,
    handed: HashMap<u64, Handed>,
    next_seq: u64,
    /// By relay seq.
    carried: HashMap<u64, Carried>,
    /// (sender, cookie) -> relay seq.
    by_origin: HashMap<(usize, u64), u64>,
    /// A sender's `RelayDst` waiting for its `RelaySrc`.
    dst: HashMap<usize, Msg>,
    records: Vec<(usize, Msg)>,
    last_health: Instant,
    /// Receiving side: receives asked of the forwarding peer, by cookie.
    asked: HashMap<u64, Asked>,
    /// Signals for this rank's engine about them (handed out by `take_incoming`).
    incoming: Vec<Incoming>,
    /// Receives landed for other ranks, by relay seq; their tokens to relay seqs.
    landing: HashMap<u64, Landing>,
    by_token: HashMap<u64, u64>,
    /// A receiver's `RecvDst` waiting for its `RecvBuf`.
    recv_dst: HashMap<usize, Msg>,
    landings: Vec<(u64, Signal)>,
}

/// Answer `from`'s request `cookie` to carry a send or land a receive: nothing when it
/// started (`Ok(true)`), `kinds.0` when the buffer cannot be mapped now (counted in
/// `refused`), `kinds.1` with the error's code when it failed.
fn answer(near: &mut SameHost, from: usize, cookie: u64, r: Result<bool>, refused: &AtomicU64, kinds: (MsgKind, MsgKind)) {
    let (kind, code) = match r {
        Ok(true) => return,
        Ok(false) => {
            refused.fetch_add(1, Ordering::Relaxed);
            (kinds.0, 0)
        }
        Err(e) => {
            log::debug!("hoccl: cannot relay rank {from}'s transfer: {e}");
            (kinds.1, e.code() as u32)
        }
    };
    let mut m = Msg::new(kind, cookie, 0);
    m.code = code;
    near.post_record(from, m);
}

/// The far transport's description of a receive, as a `RelayDst` record carries it.
fn remote_of(m: &Msg) -> RemoteBuffer {
    RemoteBuffer { len: m.len, wire: Wire { alloc_id: m.alloc_id, alloc_len: m.alloc_len, base: m.base, offset: m.offset, pid: m.pid, handle: m.handle, gated: false, staged: 0 } }
}

fn with_wire(mut m: Msg, w: &Wire) -> Msg {
    (m.alloc_id, m.alloc_len, m.base, m.offset, m.pid, m.handle) = (w.alloc_id, w.alloc_len, w.base, w.offset, w.pid, w.handle);
    m
}

impl Relays {
    pub fn new(setup: RelaySetup) -> Relays {
        Relays {
            via: setup.via,
            serves: setup.serves,
            refuse: setup.refuse,
            stats: setup.stats,
            next_cookie: 1,
            handed: HashMap::new(),
            next_seq: RELAY_SEQ,
            carried: HashMap::new(),
            by_origin: HashMap::new(),
            dst: HashMap::new(),
            records: Vec::new(),
            last_health: Instant::now(),
            asked: HashMap::new(),
            incoming: Vec::new(),
            landing: HashMap::new(),
            by_token: HashMap::new(),
            recv_dst: HashMap::new(),
            landings: Vec::new(),
        }
    }

    /// The forwarding peer that carries this rank's relayed sends.
    pub fn via(&self) -> Option<usize> {
        self.via
    }

    pub fn serves(&self) -> bool {
        self.serves
    }

    /// Sender: hand send `id` (its `len` bytes at `src`, for `peer`'s receive `remote`) to
    /// the forwarding peer.
    #[allow(clippy::too_many_arguments)]
    pub fn hand(&mut self, near: &mut SameHost, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        let Some(via) = self.via else { return Err(Error::internal(OP, "no forwarding peer")) };
        let wire = near.expose_range(via, src, len, None)?;
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut d = with_wire(Msg::new(MsgKind::RelayDst, tag.pair_seq, tag.k), &remote.wire);
        (d.len, d.code) = (remote.len, peer as u32);
        let mut s = with_wire(Msg::new(MsgKind::RelaySrc, cookie, 0), &wire);
        s.len = len as u64;
        near.post_record(via, d);
        near.post_record(via, s);
        self.handed.insert(cookie, Handed { id, peer, tag, src, remote: *remote, len });
        self.stats.handed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Receiver: ask the forwarding peer to land receive `region` from `peer`; returns the
    /// placeholder the engine posts as the receive's `Ready` ([`post_recv`](Self::post_recv)).
    pub fn ask_recv(&mut self, near: &mut SameHost, peer: usize, region: Region) -> Result<RemoteBuffer> {
        let Some(via) = self.via else { return Err(Error::internal(OP, "no forwarding peer")) };
        let wire = near.expose_range(via, region.ptr, region.len, region.alloc)?;
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.asked.insert(cookie, Asked { region, peer, tag: None, wire });
        Ok(RemoteBuffer { len: region.len as u64, wire: Wire { alloc_id: cookie, offset: ASKED, ..Wire::empty(0) } })
    }

    /// Receiver: the engine posts `Ready` for `remote` (with `tag`): true when it is a
    /// placeholder of [`ask_recv`](Self::ask_recv), whose records then go to the forwarding
    /// peer (its answer posts the real `Ready`).
    pub fn post_recv(&mut self, near: &mut SameHost, tag: Tag, remote: &RemoteBuffer) -> bool {
        if remote.wire.offset != ASKED {
            return false;
        }
        let cookie = remote.wire.alloc_id;
        let (Some(via), Some(a)) = (self.via, self.asked.get_mut(&cookie)) else { return true };
        a.tag = Some(tag);
        let mut d = Msg::new(MsgKind::RecvDst, cookie, 0);
        (d.len, d.code) = (a.region.len as u64, a.peer as u32);
        let b = with_wire(Msg::new(MsgKind::RecvBuf, tag.pair_seq, tag.k), &a.wire);
        near.post_record(via, d);
        near.post_record(via, b);
        self.stats.recv_handed.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Receiver: the signals about receives the forwarding peer landed, for the engine.
    pub fn take_incoming(&mut self, out: &mut Vec<Incoming>) -> bool {
        let any = !self.incoming.is_empty();
        out.append(&mut self.incoming);
        any
    }

    /// Forwarding peer: land `from`'s receive announced by `d`, its buffer `b`; false when
    /// its allocation cannot be mapped now.
    fn land(&mut self, near: &mut SameHost, far: &mut dyn Transport, is_far: &[bool], from: usize, d: &Msg, b: &Msg) -> Result<bool> {
        let (peer, len) = (d.code as usize, d.len as usize);
        if !is_far.get(peer).copied().unwrap_or(false) {
            return Err(Error::Remote { op: OP, peer: from, what: format!("asked to land a receive from rank {peer}, which is not on another node") });
        }
        if self.refuse {
            return Ok(false);
        }
        let wire = Wire { alloc_id: b.alloc_id, alloc_len: b.alloc_len, base: b.base, offset: b.offset, pid: b.pid, handle: b.handle, gated: false, staged: 0 };
        let Some((ptr, alloc, mapped)) = near.map_range(from, &wire, len)? else { return Ok(false) };
        let seq = self.next_seq;
        self.next_seq += 1;
        match far.expose_relayed(peer, Tag { pair_seq: b.seq, k: b.k }, Region { seq, ptr, len, alloc: Some(alloc) }) {
            Ok(token) => {
                self.landing.insert(seq, Landing { from, cookie: d.seq, token, mapped });
                self.by_token.insert(token, seq);
                self.by_origin.insert((from, d.seq), seq);
                let mut m = Msg::new(MsgKind::RecvExposed, d.seq, 0);
                m.alloc_id = token;
                near.post_record(from, m);
                Ok(true)
            }
            Err(e) => {
                near.unmap(&mapped);
                Err(e)
            }
        }
    }

    /// Forwarding peer: the receive landed for another rank under relay seq `seq` is over.
    fn finish_landing(&mut self, near: &mut SameHost, seq: u64) -> Option<Landing> {
        let l = self.landing.remove(&seq)?;
        self.by_token.remove(&l.token);
        self.by_origin.remove(&(l.from, l.cookie));
        near.unmap(&l.mapped);
        Some(l)
    }

    /// One turn, after both transports' `progress`: finish the relay flows `far` reported
    /// in `done` (taken out of it, as are their entries in `advanced`), take the relay
    /// records that arrived, and check the forwarding peer's health. Failures of this rank's
    /// sends go to `failed`.
    pub fn turn(
        &mut self,
        near: &mut SameHost,
        far: &mut dyn Transport,
        is_far: &[bool],
        done: &mut Vec<FlowId>,
        advanced: &mut Vec<u64>,
        failed: &mut VecDeque<(u64, Error)>,
    ) -> bool {
        let mut moved = false;
        if !self.carried.is_empty() {
            let now = Instant::now();
            for seq in advanced.iter().filter(|s| is_relay_seq(**s)) {
                if let Some(c) = self.carried.get_mut(seq).filter(|c| now.duration_since(c.told) >= PROGRESS_EVERY) {
                    c.told = now;
                    near.post_record(c.from, Msg::new(MsgKind::RelayProgress, c.cookie, 0));
                }
            }
            let mut i = 0;
            while i < done.len() {
                if !is_relay_seq(done[i].seq) {
                    i += 1;
                    continue;
                }
                let seq = done.swap_remove(i).seq;
                if let Some(c) = self.finish(near, seq) {
                    near.post_record(c.from, Msg::new(MsgKind::RelayDone, c.cookie, 0));
                    self.stats.carried.fetch_add(1, Ordering::Relaxed);
                    self.stats.carried_bytes.fetch_add(c.len as u64, Ordering::Relaxed);
                    moved = true;
                }
            }
            // Their progress is this rank's to report, not its engine's.
            advanced.retain(|s| !is_relay_seq(*s));
        }
        if !self.landing.is_empty() {
            far.take_relay_landings(&mut self.landings);
            let landings = std::mem::take(&mut self.landings);
            for &(token, signal) in &landings {
                let Some(&seq) = self.by_token.get(&token) else { continue };
                moved = true;
                match signal {
                    Signal::Landed { len, .. } => {
                        if let Some(l) = self.finish_landing(near, seq) {
                            let mut m = Msg::new(MsgKind::RecvLanded, l.cookie, 0);
                            m.len = len;
                            near.post_record(l.from, m);
                            self.stats.recv_carried.fetch_add(1, Ordering::Relaxed);
                            self.stats.recv_carried_bytes.fetch_add(len, Ordering::Relaxed);
                        }
                    }
                    _ => {
                        if let Some(l) = self.landing.get(&seq) {
                            near.post_record(l.from, Msg::new(MsgKind::RecvProgress, l.cookie, 0));
                        }
                    }
                }
            }
            self.landings = landings;
            self.landings.clear();
        }
        near.take_relay_records(&mut self.records);
        let records = std::mem::take(&mut self.records);
        for &(from, m) in &records {
            moved = true;
            self.record(near, far, is_far, from, m, done, advanced, failed);
        }
        self.records = records;
        self.records.clear();
        if let Some(via) = self.via.filter(|_| (!self.handed.is_empty() || !self.asked.is_empty()) && self.last_health.elapsed() >= HEALTH_EVERY) {
            self.last_health = Instant::now();
            if let Some(why) = near.peer_health(via) {
                for (_, h) in self.handed.drain() {
                    failed.push_back((h.id.seq, Error::Remote { op: OP, peer: via, what: format!("this rank's forwarding peer is gone ({why}) while carrying its send to rank {}", h.peer) }));
                }
                for (_, a) in self.asked.drain() {
                    failed.push_back((a.region.seq, Error::Remote { op: OP, peer: via, what: format!("this rank's forwarding peer is gone ({why}) while landing its receive from rank {}", a.peer) }));
                }
                moved = true;
            }
        }
        moved
    }

    /// The relay flow `seq` is over: its mapping released.
    fn finish(&mut self, near: &mut SameHost, seq: u64) -> Option<Carried> {
        let c = self.carried.remove(&seq)?;
        self.by_origin.remove(&(c.from, c.cookie));
        near.unmap(&c.mapped);
        Some(c)
    }

    /// Relay flow `seq` failed (`code`, `why`): tell its sender.
    pub fn carried_failed(&mut self, near: &mut SameHost, seq: u64, code: ErrorCode, why: &dyn std::fmt::Display) {
        if let Some(l) = self.finish_landing(near, seq) {
            log::debug!("hoccl: landing rank {}'s receive failed: {why}", l.from);
            let mut m = Msg::new(MsgKind::RecvFail, l.cookie, 0);
            m.code = code as u32;
            near.post_record(l.from, m);
        }
        if let Some(c) = self.finish(near, seq) {
            log::debug!("hoccl: relay of rank {}'s send failed: {why}", c.from);
            let mut m = Msg::new(MsgKind::RelayFail, c.cookie, 0);
            m.code = code as u32;
            near.post_record(c.from, m);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        near: &mut SameHost,
        far: &mut dyn Transport,
        is_far: &[bool],
        from: usize,
        m: Msg,
        done: &mut Vec<FlowId>,
        advanced: &mut Vec<u64>,
        failed: &mut VecDeque<(u64, Error)>,
    ) {
        let cookie = m.seq;
        match m.kind() {
            Some(MsgKind::RelayDst) => {
                if self.dst.insert(from, m).is_some() {
                    log::error!("hoccl: rank {from} announced two relayed sends without their bytes (malformed records)");
                }
            }
            Some(MsgKind::RelaySrc) => {
                let Some(d) = self.dst.remove(&from) else {
                    log::error!("hoccl: rank {from} sent the bytes of a relayed send it did not announce (malformed records)");
                    let e = Error::internal(OP, "bytes of a send not announced");
                    return answer(near, from, cookie, Err(e), &self.stats.refused, (MsgKind::RelayRefused, MsgKind::RelayFail));
                };
                let r = self.carry(near, far, is_far, from, &d, &m);
                answer(near, from, cookie, r, &self.stats.refused, (MsgKind::RelayRefused, MsgKind::RelayFail));
            }
            Some(MsgKind::RelayCancel) => {
                if let Some(seq) = self.by_origin.get(&(from, cookie)).copied() {
                    far.cancel(seq);
                    self.finish(near, seq);
                }
            }
            Some(MsgKind::RelayDone) => {
                if let Some(h) = self.handed.remove(&cookie) {
                    done.push(h.id);
                    advanced.push(h.id.seq);
                }
            }
            Some(MsgKind::RelayProgress) => {
                if let Some(h) = self.handed.get(&cookie) {
                    advanced.push(h.id.seq);
                }
            }
            Some(MsgKind::RelayFail) => {
                if let Some(h) = self.handed.remove(&cookie) {
                    let what = format!("carrying this rank's send to rank {} failed there (error code {})", h.peer, m.code);
                    failed.push_back((h.id.seq, Error::Remote { op: OP, peer: from, what }));
                }
            }
            Some(MsgKind::RelayRefused) => {
                if let Some(h) = self.handed.remove(&cookie) {
                    // The forwarding peer cannot map the bytes now: send them directly.
                    if let Err(e) = far.start_write(h.id, h.peer, h.tag, h.src, &h.remote, h.len) {
                        failed.push_back((h.id.seq, e));
                    }
                }
            }
            Some(MsgKind::RecvDst) => {
                if self.recv_dst.insert(from, m).is_some() {
                    log::error!("hoccl: rank {from} announced two relayed receives without their buffers (malformed records)");
                }
            }
            Some(MsgKind::RecvBuf) => {
                let Some(d) = self.recv_dst.remove(&from) else {
                    // The cookie to answer came in the missing `RecvDst`: the receive times out.
                    log::error!("hoccl: rank {from} sent the buffer of a relayed receive it did not announce (malformed records)");
                    return;
                };
                let r = self.land(near, far, is_far, from, &d, &m);
                answer(near, from, d.seq, r, &self.stats.recv_refused, (MsgKind::RecvRefused, MsgKind::RecvFail));
            }
            Some(MsgKind::RecvCancel) => {
                if let Some(seq) = self.by_origin.get(&(from, cookie)).copied() {
                    if let Some(l) = self.finish_landing(near, seq) {
                        far.forget_receive(l.token);
                    }
                }
            }
            Some(MsgKind::RecvExposed) => {
                if let Some((a, tag)) = self.asked.get(&cookie).and_then(|a| Some((a, a.tag?))) {
                    // The sender writes to the forwarding peer's receive `alloc_id`.
                    let remote = RemoteBuffer { len: a.region.len as u64, wire: Wire { alloc_id: m.alloc_id, base: from as u64 + 1, ..Wire::empty(0) } };
                    far.post_ready(a.peer, tag, remote);
                }
            }
            Some(MsgKind::RecvLanded) => {
                if let Some(a) = self.asked.remove(&cookie) {
                    let tag = a.tag.unwrap_or(Tag { pair_seq: 0, k: 0 });
                    self.incoming.push(Incoming { from: a.peer, pair_seq: tag.pair_seq, signal: Signal::Landed { k: tag.k, len: m.len } });
                }
            }
            Some(MsgKind::RecvProgress) => {
                if let Some((a, tag)) = self.asked.get(&cookie).and_then(|a| Some((a, a.tag?))) {
                    self.incoming.push(Incoming { from: a.peer, pair_seq: tag.pair_seq, signal: Signal::Progress { k: tag.k } });
                }
            }
            Some(MsgKind::RecvFail) => {
                if let Some(a) = self.asked.remove(&cookie) {
                    let what = format!("landing this rank's receive from rank {} failed there (error code {})", a.peer, m.code);
                    failed.push_back((a.region.seq, Error::Remote { op: OP, peer: from, what }));
                }
            }
            Some(MsgKind::RecvRefused) => {
                if let Some((tag, a)) = self.asked.remove(&cookie).and_then(|a| Some((a.tag?, a))) {
                    // The forwarding peer cannot map the buffer now: take the bytes directly.
                    match far.expose(a.peer, a.region) {
                        Ok(remote) => far.post_ready(a.peer, tag, remote),
                        Err(e) => failed.push_back((a.region.seq, e)),
                    }
                }
            }
            _ => log::error!("hoccl: rank {from} sent a relay record of kind {} (malformed)", m.kind),
        }
    }

    /// Forwarding peer: start carrying `from`'s send announced by `d` with bytes `s`;
    /// false when its allocation cannot be mapped now.
    fn carry(&mut self, near: &mut SameHost, far: &mut dyn Transport, is_far: &[bool], from: usize, d: &Msg, s: &Msg) -> Result<bool> {
        let (peer, len) = (d.code as usize, s.len as usize);
        if !is_far.get(peer).copied().unwrap_or(false) {
            return Err(Error::Remote { op: OP, peer: from, what: format!("asked to carry a send to rank {peer}, which is not on another node") });
        }
        if s.len > d.len {
            return Err(Error::Remote { op: OP, peer: from, what: format!("asked to carry {} bytes into a {}-byte receive", s.len, d.len) });
        }
        if self.refuse {
            return Ok(false);
        }
        let wire = Wire { alloc_id: s.alloc_id, alloc_len: s.alloc_len, base: s.base, offset: s.offset, pid: s.pid, handle: s.handle, gated: false, staged: 0 };
        let Some((src, alloc, mapped)) = near.map_range(from, &wire, len)? else { return Ok(false) };
        let seq = self.next_seq;
        self.next_seq += 1;
        let id = FlowId { seq, idx: 0 };
        if let Err(e) = far.start_write_mapped(id, peer, Tag { pair_seq: d.seq, k: d.k }, src, alloc, &remote_of(d), len) {
            near.unmap(&mapped);
            return Err(e);
        }
        self.carried.insert(seq, Carried { from, cookie: s.seq, mapped, len, told: Instant::now() });
        self.by_origin.insert((from, s.seq), seq);
        Ok(true)
    }

    /// Sender: op `seq` failed; its handed sends are cancelled at the forwarding peer.
    pub fn cancel(&mut self, near: &mut SameHost, seq: u64) {
        let Some(via) = self.via else { return };
        let cookies: Vec<u64> = self.handed.iter().filter(|(_, h)| h.id.seq == seq).map(|(c, _)| *c).collect();
        for c in cookies {
            self.handed.remove(&c);
            near.post_record(via, Msg::new(MsgKind::RelayCancel, c, 0));
        }
        let cookies: Vec<u64> = self.asked.iter().filter(|(_, a)| a.region.seq == seq).map(|(c, _)| *c).collect();
        for c in cookies {
            self.asked.remove(&c);
            near.post_record(via, Msg::new(MsgKind::RecvCancel, c, 0));
        }
    }

    /// Whether a relay is pending either way (its bytes may still be read).
    pub fn busy(&self) -> bool {
        !self.handed.is_empty() || !self.carried.is_empty() || !self.asked.is_empty() || !self.landing.is_empty() || !self.incoming.is_empty()
    }

    pub fn describe(&self) -> String {
        format!(
            "relays: {} sends handed to the forwarding peer, {} carried for others; {} receives asked of it, {} landed for others",
            self.handed.len(),
            self.carried.len(),
            self.asked.len(),
            self.landing.len()
        )
    }

    /// The proxy exits: cancel what this rank carries and what it handed.
    pub fn close(&mut self, near: &mut SameHost, far: &mut dyn Transport) {
        let seqs: Vec<u64> = self.carried.keys().copied().collect();
        for seq in seqs {
            far.cancel(seq);
            self.carried_failed(near, seq, ErrorCode::Remote, &"the forwarding peer's communicator closed");
        }
        let seqs: Vec<u64> = self.landing.keys().copied().collect();
        for seq in seqs {
            if let Some(l) = self.finish_landing(near, seq) {
                far.forget_receive(l.token);
                let mut m = Msg::new(MsgKind::RecvFail, l.cookie, 0);
                m.code = ErrorCode::Remote as u32;
                near.post_record(l.from, m);
            }
        }
        if let Some(via) = self.via {
            for (c, _) in self.handed.drain() {
                near.post_record(via, Msg::new(MsgKind::RelayCancel, c, 0));
            }
            for (c, _) in self.asked.drain() {
                near.post_record(via, Msg::new(MsgKind::RecvCancel, c, 0));
            }
        }
    }
}

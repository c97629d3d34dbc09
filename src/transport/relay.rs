//! Point-to-point sends to other nodes carried by the sender's forwarding peer (NCCL's PXN;
//! docs/design.md, "Send/recv through the forwarding peer"). A rank whose forwarding peer is
//! another rank of its node hands each relayed send (a `send` or a send of a group to a
//! rank of another node, at least `Config::staged_min_flow_bytes` long) to that peer, whose
//! copy queue reads the bytes from the sender's memory through a mapping and whose
//! connections (its NIC) carry them to the receiver:
//!
//! ```text
//!   sender S                          forwarding peer F                  receiver R
//!   Ready from R (socket) <-------------------------------------------- exposes its buffer
//!   start_forwarded: describe the
//!   bytes for F (same-host export)
//!   RelayDst, RelaySrc ------------>  map S's allocation; write from the
//!                                     mapping to R's buffer ----------> Data frames, taken
//!                                                                        from S's forwarder;
//!                                     Done <--------------------------- Landed (from S) to R's engine
//!   RelayDone <-------------------    unmap
//!   the send is done
//! ```
//!
//! The control signals stay between S and R (their ops match as without a relay); only the
//! bytes take F's connections and staging. F runs no op: its proxy takes the records from
//! its mailbox whatever its own stream does, and carries the bytes as a flow of its own
//! (op seqs from [`RELAY_SEQ`]). A relay holds nothing but S's buffer, which S's op holds
//! anyway until `RelayDone`, so relays never wait for each other or for a slot (no
//! deadlock between relays started in different orders), and no byte is copied more than
//! on the direct path: F's copy queue reads S's memory over the GPUs' link straight into
//! F's pinned staging. A failure on F comes back as `RelayFail` and fails S's op; S's op
//! failing cancels the relay (`RelayCancel`); F gone fails S's relays within
//! [`HEALTH_EVERY`]; when F cannot map S's allocation now (stale mappings) it answers
//! `RelayRefused` and S sends the bytes itself.
use crate::device::DevPtr;
use crate::error::{Error, ErrorCode, Result};
use crate::transport::ipc::Mapped;
use crate::transport::mailbox::{Msg, MsgKind};
use crate::transport::same_host::{SameHost, PROGRESS_EVERY};
use crate::transport::{FlowId, RemoteBuffer, Tag, Transport, Wire};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Relay flows' op seqs on the forwarding peer: apart from the communicator's call-order
/// seqs and from graph instances' (which start at 1 << 62).
pub const RELAY_SEQ: u64 = 1 << 61;
/// How often a sender with relays pending checks that its forwarding peer lives.
pub const HEALTH_EVERY: Duration = Duration::from_millis(50);
const OP: &str = "relay (a send through the forwarding peer)";

/// Whether op seq `seq` names a relay flow of this rank's far transport.
pub fn is_relay_seq(seq: u64) -> bool {
    seq & (RELAY_SEQ | 1 << 62 | 1 << 63) == RELAY_SEQ
}

/// Counts a communicator reports (`Communicator::relay_stats`).
#[derive(Default, Debug)]
pub struct RelayStats {
    /// Sends this rank handed to its forwarding peer.
    pub handed: AtomicU64,
    /// Of those, the ones the peer could not carry (sent by this rank itself).
    pub refused: AtomicU64,
    /// Sends of other ranks this rank carried to their receivers, and their bytes.
    pub carried: AtomicU64,
    pub carried_bytes: AtomicU64,
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

/// The relays of one rank, both as a sender and as a forwarding peer.
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
        let wire = near.expose_source(via, src, len)?;
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
        }
        advanced.retain(|s| !is_relay_seq(*s));
        near.take_relay_records(&mut self.records);
        let records = std::mem::take(&mut self.records);
        for &(from, m) in &records {
            moved = true;
            self.record(near, far, is_far, from, m, done, advanced, failed);
        }
        self.records = records;
        self.records.clear();
        if let Some(via) = self.via.filter(|_| !self.handed.is_empty() && self.last_health.elapsed() >= HEALTH_EVERY) {
            self.last_health = Instant::now();
            if let Some(why) = near.peer_health(via) {
                for (_, h) in self.handed.drain() {
                    failed.push_back((h.id.seq, Error::Remote { op: OP, peer: via, what: format!("this rank's forwarding peer is gone ({why}) while carrying its send to rank {}", h.peer) }));
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
                let reply = |near: &mut SameHost, kind: MsgKind, code: u32| {
                    let mut r = Msg::new(kind, cookie, 0);
                    r.code = code;
                    near.post_record(from, r);
                };
                let Some(d) = self.dst.remove(&from) else {
                    log::error!("hoccl: rank {from} sent the bytes of a relayed send it did not announce (malformed records)");
                    return reply(near, MsgKind::RelayFail, ErrorCode::Internal as u32);
                };
                match self.carry(near, far, is_far, from, &d, &m) {
                    Ok(true) => {}
                    Ok(false) => {
                        self.stats.refused.fetch_add(1, Ordering::Relaxed);
                        reply(near, MsgKind::RelayRefused, 0);
                    }
                    Err(e) => {
                        log::debug!("hoccl: cannot carry rank {from}'s send to rank {}: {e}", d.code);
                        reply(near, MsgKind::RelayFail, e.code() as u32);
                    }
                }
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
        let Some((src, alloc, mapped)) = near.map_source(from, &wire, len)? else { return Ok(false) };
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
    }

    /// Whether a relay is pending either way (its bytes may still be read).
    pub fn busy(&self) -> bool {
        !self.handed.is_empty() || !self.carried.is_empty()
    }

    pub fn describe(&self) -> String {
        format!("relays: {} handed to the forwarding peer, {} carried for others", self.handed.len(), self.carried.len())
    }

    /// The proxy exits: cancel what this rank carries and what it handed.
    pub fn close(&mut self, near: &mut SameHost, far: &mut dyn Transport) {
        let seqs: Vec<u64> = self.carried.keys().copied().collect();
        for seq in seqs {
            far.cancel(seq);
            self.carried_failed(near, seq, ErrorCode::Remote, &"the forwarding peer's communicator closed");
        }
        if let Some(via) = self.via {
            for (c, _) in self.handed.drain() {
                near.post_record(via, Msg::new(MsgKind::RelayCancel, c, 0));
            }
        }
    }
}

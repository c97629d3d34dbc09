//! The same-host transport: the sender's proxy copies straight into the receiver's buffer on
//! the device's copy queues, through a cached mapping of the receiver's allocation, and the
//! proxies tell each other "ready", "landed" and "failed" through shared-memory mailboxes.
//!
//! A flow is split into chunks by the [`ChunkScheduler`] (sized from the flow); each chunk is one copy and one fence on a copy queue, and the proxy
//! polls the fences. `Landed` goes out once the last chunk's fence has completed; while a
//! long write's chunks keep landing, `Progress` goes out at most every [`PROGRESS_EVERY`],
//! so the receiver's op, which waits on nothing else meanwhile, does not time out.
//!
//! Signals are pushed into the peer's ring when they are produced; only a full ring leaves
//! them in the outbox for a later call.
//!
//! **Gated transfers** (peers of this host in another process, flows of one copy): the
//! receiver announces its buffer when the op is submitted and raises `ready[sender]` in its
//! mailbox's flag area when its stream reached the op ([`ReadyPrefix`]); the sender queues,
//! on a copy queue of its own per receiver, a wait for its own stream's start flag, a wait
//! for `ready`, the copies, and a write of `landed[sender]` in the receiver's flag area.
//! Both proxies see completion by reading `landed`. No CPU hop lies between the two streams
//! reaching the op and the bytes landing.
use crate::device::{Allocation, CopyQueue, DevPtr, Device, MemOp};
use crate::error::{Error, Result};
use crate::transport::chunk_scheduler::{ChunkScheduler, MIN_CHUNK};
use crate::transport::ipc::{Acquire, ExportCache, ImportCache, Mapped};
use crate::transport::ipc_bounce::Bounce;
use crate::transport::mailbox::{pid_alive, Msg, MsgKind, Segment, READY_GATED, READY_STAGED};
use crate::transport::{FlowId, GatedWrite, Incoming, Region, RemoteBuffer, Signal, Tag, Transport, Wire};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest gated transfer: the chunk scheduler's single-copy limit, so a gated
/// transfer is one copy, as it would be on the proxy's queues.
pub const GATED_MAX: usize = MIN_CHUNK;

/// Batches a gated queue holds at most (queued and not seen landed). Each is two waits, its
/// copies and a flag write; on the H200 a queue given 511 batches behind a wait blocked its
/// enqueuing call for good (the command buffer was full), so the proxy holds later batches
/// back ([`Transport::gated_room`]).
pub const GATED_QUEUE_BATCHES: usize = 32;

/// Whether a transfer of `len` bytes with a peer goes the gated way, from what both ranks
/// of the pair know alike: the setting (`HOCCL_GATED`, None = auto), whether the peer lives
/// in this host but another process, whether both devices reach each other's flag areas
/// (each says so in its mailbox header), and the length.
pub fn gated_eligible(setting: Option<bool>, other_process_here: bool, both_mapped: bool, len: usize) -> bool {
    setting != Some(false) && other_process_here && both_mapped && len <= GATED_MAX
}

/// The receiver's rule for `ready[l]`: the highest pair number p such that every op with a
/// gated receive from sender `l` whose pair number is at most p has been reached by its
/// stream. Ops of different streams may be reached in any order; the rule keeps `ready`
/// from covering an op whose stream has not reached it, at the price of serialising a
/// pair's gated ops in call order (NCCL serialises a communicator's ops in call order too).
#[derive(Default, Debug)]
pub struct ReadyPrefix {
    /// Announced ops by pair number (increasing), and whether their stream reached them.
    pending: VecDeque<(u64, bool)>,
    ready: u64,
}

impl ReadyPrefix {
    /// An op with pair number `p` has gated receives from this sender (once per op; a
    /// repeat is ignored).
    pub fn expect(&mut self, p: u64) {
        if p <= self.ready || self.pending.iter().any(|&(q, _)| q == p) {
            return;
        }
        let at = self.pending.iter().rposition(|&(q, _)| q < p).map_or(0, |i| i + 1);
        self.pending.insert(at, (p, false));
    }

    /// The stream reached op `p`; the new value of `ready` when it grew.
    pub fn reached(&mut self, p: u64) -> Option<u64> {
        let e = self.pending.iter_mut().find(|(q, _)| *q == p)?;
        e.1 = true;
        let before = self.ready;
        while let Some(&(q, true)) = self.pending.front() {
            self.ready = q;
            self.pending.pop_front();
        }
        (self.ready > before).then_some(self.ready)
    }

    pub fn ready(&self) -> u64 {
        self.ready
    }
}

/// The gated writes to one receiver: its own queue (FIFO, so `landed` only grows), what
/// was queued, and what has not been seen landed.
struct GatedQueue {
    queue: Box<dyn CopyQueue>,
    /// The pair number of the last batch queued (the last `landed` value it writes).
    last: u64,
    batches: VecDeque<Batch>,
    /// An enqueue failed midway: the queue's contents are not a whole batch.
    broken: bool,
}

/// One op's gated writes to one receiver.
#[derive(Default)]
struct Batch {
    pair_seq: u64,
    flows: Vec<FlowId>,
    /// Pinned until the batch is seen landed: the copies write through them.
    mapped: Vec<Mapped>,
    cancelled: bool,
}

/// The gated path's state (`SameHost::gated` is None when it is off).
struct Gated {
    setting: Option<bool>,
    /// By global rank: the device address of that peer's flag area (peers of this host in
    /// another process).
    flags_dev: Vec<Option<DevPtr>>,
    /// By sender's local index: the ready rule and the receives not landed yet
    /// (pair number, k, length), in pair order.
    prefix: Vec<ReadyPrefix>,
    expect: Vec<VecDeque<(u64, u32, u64)>>,
    /// By global rank: the queue of gated writes to that receiver (made at first use).
    queues: Vec<Option<GatedQueue>>,
    /// Emptied batches, reused.
    spare: Vec<Batch>,
    /// Batches queued and not seen landed, over all queues (a turn with none reads nothing).
    outstanding: usize,
}

/// How often at most a write in progress tells its receiver that chunks keep landing.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(10);

/// The mailboxes that connect this rank's proxy with the other ranks of its host.
pub struct Links {
    pub rank: usize,
    /// Own mailbox (rings indexed by the sender's local index).
    pub inbox: Segment,
    /// Peer mailboxes by global rank (None for self and for ranks on other nodes).
    pub peers: Vec<Option<Segment>>,
    /// Local index of this rank (its ring in every peer's mailbox).
    pub local_index: usize,
    /// Local index of every rank (None for other nodes).
    pub local_of: Vec<Option<usize>>,
}

/// What a flow in the scheduler is for.
struct Flow {
    /// The peer and transfer to signal `Landed` for, and its length.
    landing: (usize, Tag, u64),
    /// The peer allocation the flow writes into (None for empty writes).
    mapped: Option<Mapped>,
    cancelled: bool,
    /// When the receiver was last told of this write's progress (its start, at first).
    told: Instant,
}

pub struct SameHost {
    dev: Arc<dyn Device>,
    links: Links,
    /// Global rank of every local index.
    global_of_local: Vec<usize>,
    /// By global rank: whether that rank lives in this process (from its mailbox).
    in_process: Vec<bool>,
    sched: ChunkScheduler,
    flows: HashMap<FlowId, Flow>,
    imports: ImportCache,
    exports: ExportCache,
    /// Signals not yet in the peer's ring (it was full), in order.
    outbox: VecDeque<(usize, Msg)>,
    /// Reused by `progress` (it runs on every turn of the proxy loop).
    finished: Vec<FlowId>,
    advanced: Vec<FlowId>,
    /// The gated path (None when `HOCCL_GATED=0`).
    gated: Option<Gated>,
    /// By global rank: why a record from that rank was refused (`peer_health` reports it,
    /// so the ops that wait on the rank fail).
    malformed: Vec<Option<String>>,
    /// Transfers whose receive allocation stale mappings keep from being imported
    /// (`ipc_bounce`), and the op of the receives `expose` described last (their `Ready`
    /// follows).
    bounce: Bounce,
    expose_seq: u64,
    /// Relay records (`relay`) received, for the route that runs relays to take.
    relay_in: Vec<(usize, Msg)>,
}

impl SameHost {
    /// Make `copy_queues` copy queues on `dev` (from the proxy thread, bound to the device)
    /// and take over the mailboxes. Unless `gated` (`HOCCL_GATED`) is `Some(false)`, map
    /// every peer's flag area of this host in another process for the device and say so in
    /// this rank's mailbox header; with `Some(true)` a failure to map is an error, with auto
    /// the gated path is left off (and the peers see that).
    pub fn connect(dev: Arc<dyn Device>, links: Links, copy_queues: usize, chunk_bytes: usize, gated: Option<bool>) -> Result<SameHost> {
        let queues = (0..copy_queues).map(|_| dev.create_copy_queue()).collect::<Result<Vec<_>>>()?;
        let mut global_of_local = vec![usize::MAX; links.local_of.iter().flatten().count()];
        for (g, l) in links.local_of.iter().enumerate() {
            if let Some(l) = l {
                global_of_local[*l] = g;
            }
        }
        let pid = std::process::id();
        let in_process: Vec<bool> = links.peers.iter().map(|p| p.as_ref().is_some_and(|seg| seg.owner_pid() == pid)).collect();
        let gated = match gated {
            Some(false) => None,
            setting => match map_flag_areas(dev.as_ref(), &links, &in_process) {
                Ok(flags_dev) => {
                    links.inbox.set_gated();
                    let n = global_of_local.len();
                    let queues = (0..links.peers.len()).map(|_| None).collect();
                    Some(Gated { setting, flags_dev, prefix: (0..n).map(|_| ReadyPrefix::default()).collect(), expect: vec![VecDeque::new(); n], queues, spare: Vec::new(), outstanding: 0 })
                }
                Err(e) if setting == Some(true) => return Err(e),
                Err(e) => {
                    log::info!("hoccl: rank {}: gated transfers off (HOCCL_GATED=auto): {e}", links.rank);
                    None
                }
            },
        };
        Ok(SameHost {
            dev,
            links,
            global_of_local,
            in_process,
            sched: ChunkScheduler::new(queues, chunk_bytes),
            flows: HashMap::new(),
            imports: ImportCache::default(),
            exports: ExportCache::default(),
            outbox: VecDeque::new(),
            finished: Vec::new(),
            advanced: Vec::new(),
            gated,
            malformed: Vec::new(),
            bounce: Bounce::default(),
            expose_seq: 0,
            relay_in: Vec::new(),
        })
    }

    /// The peer segment of global rank `peer` and this rank's index in it.
    fn peer_seg(&self, peer: usize) -> Option<&Segment> {
        self.links.peers.get(peer).and_then(|s| s.as_ref())
    }

    /// Sender side: report the gated batches seen landed (their flows done, their mappings
    /// unpinned); whether any was.
    fn reap_gated(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> bool {
        let Some(g) = self.gated.as_mut().filter(|g| g.outstanding > 0) else { return false };
        let mut any = false;
        for (peer, q) in g.queues.iter_mut().enumerate() {
            let Some(q) = q.as_mut().filter(|q| !q.batches.is_empty()) else { continue };
            let Some(seg) = self.links.peers.get(peer).and_then(|s| s.as_ref()) else { continue };
            let landed = seg.landed(self.links.local_index).load(Ordering::Acquire);
            while q.batches.front().is_some_and(|b| b.pair_seq <= landed) {
                let Some(mut b) = q.batches.pop_front() else { break };
                g.outstanding -= 1;
                any = true;
                for m in b.mapped.drain(..) {
                    self.imports.release(&m);
                }
                if !b.cancelled {
                    for id in b.flows.drain(..) {
                        if advanced.last() != Some(&id.seq) {
                            advanced.push(id.seq);
                        }
                        done.push(id);
                    }
                }
                b.flows.clear();
                b.cancelled = false;
                g.spare.push(b);
            }
        }
        any
    }

    /// Whether a gated queue holds work not seen landed (or a partial batch): it may wait
    /// for ever, so it may be neither destroyed nor synchronized.
    fn gated_pending(&self) -> bool {
        self.gated.as_ref().is_some_and(|g| g.queues.iter().flatten().any(|q| q.broken || !q.batches.is_empty()))
    }

    /// Tear the gated path down: destroy its queues and unregister the peers' flag areas
    /// when every batch landed; otherwise leave queues, registrations, peer mailboxes and
    /// buffer mappings in place for good (a wait may still pass later and run copies that
    /// read and write them). Returns whether it left them.
    fn close_gated(&mut self) -> bool {
        let stuck = self.gated_pending();
        let Some(mut g) = self.gated.take() else { return false };
        if stuck {
            let n = g.queues.iter().flatten().filter(|q| q.broken || !q.batches.is_empty()).count();
            log::warn!(
                "hoccl: rank {}: {n} gated copy queue(s) still wait after a failure: they, the peers' flag areas and the buffer mappings they use stay in place until the process exits",
                self.links.rank
            );
            for q in g.queues.drain(..).flatten() {
                std::mem::forget(q);
            }
            for seg in self.links.peers.iter_mut().filter_map(Option::take) {
                std::mem::forget(seg);
            }
            return true;
        }
        g.queues.clear();
        for (peer, d) in g.flags_dev.iter().enumerate() {
            if let (Some(_), Some(seg)) = (d, self.peer_seg(peer)) {
                if let Err(e) = self.dev.unmap_host(seg.flag_area().0) {
                    log::warn!("hoccl: rank {}: unregistering rank {peer}'s flag area: {e}", self.links.rank);
                }
            }
        }
        false
    }

    /// Send `m` to rank `to` now; queue it only behind earlier queued signals or when the
    /// ring is full (order per peer is kept: nothing overtakes the outbox).
    fn post(&mut self, to: usize, m: Msg) {
        if self.outbox.is_empty() && self.try_send(to, &m) {
            return;
        }
        self.outbox.push_back((to, m));
    }

    /// Push one signal into `to`'s ring; false when the ring is full. A rank without a
    /// mailbox gets nothing (logged).
    fn try_send(&self, to: usize, m: &Msg) -> bool {
        let Some(seg) = self.links.peers.get(to).and_then(|s| s.as_ref()) else {
            log::error!("rank {}: no mailbox for rank {to}", self.links.rank);
            return true;
        };
        seg.try_push(self.links.local_index, m)
    }

    /// Post the bounce route's records.
    fn post_bounce(&mut self) {
        let mut msgs = std::mem::take(&mut self.bounce.outbox);
        for (to, m) in msgs.drain(..) {
            self.post(to, m);
        }
        self.bounce.outbox = msgs;
    }

    /// Push queued signals into the peers' rings until one is full (retried on the next call).
    fn flush(&mut self) -> bool {
        let mut any = false;
        while let Some((to, m)) = self.outbox.front() {
            if !self.try_send(*to, m) {
                break;
            }
            self.outbox.pop_front();
            any = true;
        }
        any
    }
}

impl SameHost {
    /// How `peer` reaches `ptr` of allocation `alloc` (None: an empty range): the
    /// allocation's identity, base and export handle, and the offset of `ptr` in it.
    fn wire_of(&mut self, peer: usize, alloc: Option<Allocation>, ptr: DevPtr) -> Result<Wire> {
        let mut wire = Wire::empty(std::process::id());
        if let Some(a) = alloc {
            // A peer in this process uses the buffer's own address: no IPC export (a
            // driver call on the allocation) is needed for it.
            if !self.in_process.get(peer).copied().unwrap_or(false) {
                wire.handle = self.exports.get(self.dev.as_ref(), &a)?.0;
            }
            wire.alloc_id = a.id;
            wire.alloc_len = a.len as u64;
            wire.base = a.base.0;
            wire.offset = ptr.0 - a.base.0;
        }
        Ok(wire)
    }

    /// Relays (`relay`): describe `len` bytes at `ptr` (this rank's memory, in `alloc`, else
    /// in the allocation the device finds) for `peer` to read or write through its mapping of
    /// the allocation.
    pub fn expose_range(&mut self, peer: usize, ptr: DevPtr, len: usize, alloc: Option<Allocation>) -> Result<Wire> {
        let a = match alloc {
            Some(a) => a,
            None => self.dev.allocation(ptr)?,
        };
        match ptr.0.checked_add(len as u64) {
            Some(end) if ptr.0 >= a.base.0 && end <= a.base.0 + a.len as u64 => self.wire_of(peer, Some(a), ptr),
            _ => Err(Error::invalid_arg("same-host transport", format!("{:#x}+{len} is outside its allocation {:#x}+{}", ptr.0, a.base.0, a.len))),
        }
    }

    /// Relays: map the `len` bytes `peer` described with [`expose_range`](Self::expose_range)
    /// (to read a relayed send's bytes or write a relayed receive's); their address here,
    /// the mapped allocation as an [`Allocation`] of this address space, and the pin to
    /// [`unmap`](Self::unmap) once no copy uses them. None when stale mappings of the peer
    /// keep the allocation from being mapped now.
    pub fn map_range(&mut self, peer: usize, wire: &Wire, len: usize) -> Result<Option<(DevPtr, Allocation, Mapped)>> {
        check_announced(wire.offset, len as u64, wire.alloc_len).map_err(|what| Error::Remote { op: "same-host transport", peer, what })?;
        match self.imports.acquire(self.dev.as_ref(), peer, wire)? {
            Acquire::Mapped(m) => {
                let alloc = Allocation { base: m.base, len: wire.alloc_len as usize, id: wire.alloc_id };
                Ok(Some((m.base.add(wire.offset as usize), alloc, m)))
            }
            Acquire::Stale(_) => Ok(None),
        }
    }

    /// Relays: a mapping from [`map_range`](Self::map_range) is no longer read.
    pub fn unmap(&mut self, m: &Mapped) {
        self.imports.release(m);
    }

    /// Relays: queue record `m` to `to` (in order with every other record to it).
    pub fn post_record(&mut self, to: usize, m: Msg) {
        self.post(to, m);
    }

    /// Relays: the relay records received since the last call, with their senders.
    pub fn take_relay_records(&mut self, out: &mut Vec<(usize, Msg)>) {
        out.append(&mut self.relay_in);
    }
}

/// Whether `m` is a relay record (`relay`): every kind past the four signals.
fn is_relay(m: &Msg) -> bool {
    m.kind().is_some_and(|k| !matches!(k, MsgKind::Ready | MsgKind::Landed | MsgKind::Fail | MsgKind::Progress))
}

/// The signal a mailbox record carries, or why the record is malformed. A record comes from
/// shared memory another process writes: nothing in it is used before this check.
fn signal_of(m: &Msg) -> std::result::Result<Signal, String> {
    let kind = m.kind().ok_or_else(|| format!("unknown record kind {}", m.kind))?;
    // A Ready's code: 0 (handshake), READY_GATED, or a staged announcement (READY_STAGED +
    // 0 for a receive, + 1 for a send), which names no region: its length is only compared
    // with the own staged transfer's.
    let staged = match m.code {
        c if kind != MsgKind::Ready || c == 0 || c == READY_GATED => 0,
        c if c == READY_STAGED || c == READY_STAGED + 1 => (c - READY_STAGED + 1) as u8,
        c => return Err(format!("Ready for op {} with unknown code {c}", m.seq)),
    };
    if kind == MsgKind::Ready && staged == 0 {
        check_announced(m.offset, m.len, m.alloc_len).map_err(|e| format!("Ready for op {}: {e}", m.seq))?;
    }
    Ok(match kind {
        MsgKind::Ready => Signal::Ready {
            k: m.k,
            remote: RemoteBuffer {
                len: m.len,
                wire: Wire { alloc_id: m.alloc_id, alloc_len: m.alloc_len, base: m.base, offset: m.offset, pid: m.pid, handle: m.handle, gated: m.code == READY_GATED, staged },
            },
        },
        MsgKind::Landed => Signal::Landed { k: m.k, len: m.len },
        MsgKind::Fail => Signal::Failed { code: m.code },
        MsgKind::Progress => Signal::Progress { k: m.k },
        k => return Err(format!("{k:?} record for op {} outside a relay", m.seq)),
    })
}

/// A receive region `[offset, offset + len)` must lie inside the allocation its owner
/// announced (`alloc_len` bytes): writes go to the mapping of that allocation.
fn check_announced(offset: u64, len: u64, alloc_len: u64) -> std::result::Result<(), String> {
    match offset.checked_add(len) {
        Some(end) if len == 0 || end <= alloc_len => Ok(()),
        _ => Err(format!("region of {len} bytes at offset {offset} exceeds the announced {alloc_len}-byte allocation")),
    }
}

impl Transport for SameHost {
    fn expose(&mut self, peer: usize, region: Region) -> Result<RemoteBuffer> {
        if region.alloc.is_some() {
            self.expose_seq = region.seq;
        }
        Ok(RemoteBuffer { len: region.len as u64, wire: self.wire_of(peer, region.alloc, region.ptr)? })
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        let mut m = Msg::new(MsgKind::Ready, tag.pair_seq, tag.k);
        let w = remote.wire;
        m.len = remote.len;
        if w.staged != 0 {
            m.code = READY_STAGED + w.staged as u32 - 1;
        }
        (m.alloc_id, m.alloc_len, m.base, m.offset, m.pid, m.handle) = (w.alloc_id, w.alloc_len, w.base, w.offset, w.pid, w.handle);
        self.post(peer, m);
        // A sender in another process may have to bounce this transfer: its bytes then land
        // here by this rank's own copies.
        if w.staged == 0 && remote.len > 0 && !self.in_process.get(peer).copied().unwrap_or(true) {
            self.bounce.expect(peer, tag, self.expose_seq, DevPtr(w.base.wrapping_add(w.offset)), remote.len);
        }
    }

    fn signal_failure(&mut self, peer: usize, pair_seq: u64, code: u32) {
        let mut m = Msg::new(MsgKind::Fail, pair_seq, 0);
        m.code = code;
        self.post(peer, m);
    }

    fn poll_signals(&mut self, out: &mut Vec<Incoming>) -> bool {
        let mut any = false;
        for l in 0..self.global_of_local.len() {
            while let Some(m) = self.links.inbox.try_pop(l) {
                let from = self.global_of_local[l];
                any = true;
                let got = if Bounce::is_ours(&m) {
                    self.bounce.take(self.dev.as_ref(), &mut self.sched, from, &m).map(|()| None)
                } else if is_relay(&m) {
                    self.relay_in.push((from, m));
                    Ok(None)
                } else {
                    signal_of(&m).map(Some)
                };
                match got {
                    Ok(Some(signal)) => {
                        match signal {
                            Signal::Landed { k, .. } => self.bounce.forget(from, m.seq, Some(k)),
                            Signal::Failed { .. } => self.bounce.forget(from, m.seq, None),
                            _ => {}
                        }
                        out.push(Incoming { from, pair_seq: m.seq, signal })
                    }
                    Ok(None) => {}
                    Err(why) => {
                        log::error!("rank {}: refused a mailbox record from rank {from}: {why}", self.links.rank);
                        if self.malformed.len() <= from {
                            self.malformed.resize(from + 1, None);
                        }
                        self.malformed[from].get_or_insert(format!("it sent a malformed mailbox record ({why})"));
                    }
                }
            }
        }
        any |= self.bounce.take_landed(out);
        self.post_bounce();
        // Gated receives: one load of `landed[l]` per sender with receives outstanding.
        if let Some(g) = self.gated.as_mut() {
            for (l, expect) in g.expect.iter_mut().enumerate().filter(|(_, e)| !e.is_empty()) {
                let landed = self.links.inbox.landed(l).load(Ordering::Acquire);
                while let Some(&(p, k, len)) = expect.front().filter(|e| e.0 <= landed) {
                    expect.pop_front();
                    out.push(Incoming { from: self.global_of_local[l], pair_seq: p, signal: Signal::Landed { k, len } });
                    any = true;
                }
            }
        }
        any
    }

    fn start_write(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        if remote.wire.gated {
            return Err(Error::invalid_usage("SameHost::start_write", format!("rank {peer} announced a gated receive that this rank sends through the handshake (the two ranks decided differently; mismatched calls?)")));
        }
        const OP: &str = "same-host transport";
        check_announced(remote.wire.offset, len as u64, remote.wire.alloc_len).map_err(|what| Error::Remote { op: OP, peer, what })?;
        let (mapped, dst) = if len == 0 {
            (None, DevPtr(0))
        } else {
            match self.imports.acquire(self.dev.as_ref(), peer, &remote.wire)? {
                Acquire::Mapped(m) => (Some(m), m.base.add(remote.wire.offset as usize)),
                // Stale mappings of the receiver block the import: the bytes go through a
                // ring in host memory instead (`ipc_bounce`), which reports the flow.
                Acquire::Stale(_) => return self.bounce.start(self.dev.as_ref(), id, peer, tag, src, len),
            }
        };
        self.flows.insert(id, Flow { landing: (peer, tag, len as u64), mapped, cancelled: false, told: Instant::now() });
        self.sched.add(id, src, dst, len);
        Ok(())
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        let reaped = self.reap_gated(done, advanced) | self.bounce.pump(&mut self.sched) | self.bounce.take_done(done, advanced);
        if self.sched.is_idle() {
            return Ok(self.flush() | reaped);
        }
        let (mut finished, mut moved) = (std::mem::take(&mut self.finished), std::mem::take(&mut self.advanced));
        finished.clear();
        moved.clear();
        let polled = self.sched.poll(&mut finished, &mut moved);
        let mut progressed = matches!(polled, Ok(true)) | reaped;
        let mut now = None;
        for id in moved.drain(..) {
            if advanced.last() != Some(&id.seq) {
                advanced.push(id.seq);
            }
            let Some(f) = self.flows.get_mut(&id) else { continue };
            if f.cancelled {
                continue;
            }
            let (peer, tag, _) = f.landing;
            let t = *now.get_or_insert_with(Instant::now);
            if t.duration_since(f.told) >= PROGRESS_EVERY {
                f.told = t;
                self.post(peer, Msg::new(MsgKind::Progress, tag.pair_seq, tag.k));
            }
        }
        self.advanced = moved;
        for id in finished.drain(..) {
            if self.bounce.owns(&id) {
                self.bounce.chunk_done(&id);
                continue;
            }
            let Some(f) = self.flows.remove(&id) else { continue };
            if let Some(m) = f.mapped {
                self.imports.release(&m);
            }
            if f.cancelled {
                continue;
            }
            let (peer, tag, len) = f.landing;
            let mut m = Msg::new(MsgKind::Landed, tag.pair_seq, tag.k);
            m.len = len;
            self.post(peer, m);
            done.push(id);
        }
        self.finished = finished;
        self.post_bounce();
        progressed |= self.flush();
        polled.map(|_| progressed)
    }

    fn cancel(&mut self, seq: u64) {
        self.sched.cancel(seq);
        self.bounce.cancel(seq);
        for (id, f) in self.flows.iter_mut() {
            if id.seq == seq {
                f.cancelled = true;
            }
        }
        // A queued gated batch cannot be taken back: it is never reported, and its queue is
        // let run to the end. The receiver of a failed op may never raise `ready` for it (it
        // failed there too, or the process died), and a queue that waits for ever keeps its
        // context from being torn down: the process could not exit. So this rank raises the
        // receiver's `ready[me]` itself (its own mapping of the receiver's flag area); the
        // queue's other wait, for this rank's stream to reach the op, passes once the stream
        // runs on (the failure released it). The copies then write into the receiver's buffer
        // of the failed op, whose contents are undefined, possibly before the receiver's
        // stream reached that op; a dead receiver's allocation stays alive while this process
        // maps it.
        let me = self.links.local_index;
        let Some(g) = self.gated.as_mut() else { return };
        for (peer, q) in g.queues.iter_mut().enumerate() {
            let Some(q) = q.as_mut() else { continue };
            let mut hit = false;
            for b in q.batches.iter_mut().filter(|b| b.flows.iter().any(|id| id.seq == seq)) {
                b.cancelled = true;
                hit = true;
            }
            if hit {
                if let Some(seg) = self.links.peers.get(peer).and_then(|s| s.as_ref()) {
                    seg.ready(me).store(u64::MAX, Ordering::Release);
                }
            }
        }
    }

    fn peer_health(&self, peer: usize) -> Option<String> {
        if let Some(why) = self.malformed.get(peer).and_then(Option::clone) {
            return Some(why);
        }
        let seg = self.links.peers.get(peer)?.as_ref()?;
        if !pid_alive(seg.owner_pid()) {
            return Some(format!("process {} exited", seg.owner_pid()));
        }
        // A closed mailbox means its communicator was destroyed or aborted.
        seg.is_closed().then(|| "its communicator was aborted or destroyed".to_string())
    }

    /// Gated batches count while their op may still complete; a cancelled one is not
    /// waited for (it may wait for ever: `close` leaves it in place).
    fn data_in_flight(&self) -> bool {
        !self.sched.is_idle() || self.gated.as_ref().is_some_and(|g| g.queues.iter().flatten().any(|q| q.batches.iter().any(|b| !b.cancelled)))
    }

    fn signals_queued(&self) -> bool {
        !self.outbox.is_empty()
    }

    fn describe(&self) -> String {
        let gated = match &self.gated {
            None => "gated off".to_string(),
            Some(g) => {
                let qs: Vec<String> = g.queues.iter().enumerate().filter_map(|(p, q)| Some((p, q.as_ref()?))).map(|(p, q)| {
                    let landed = self.peer_seg(p).map_or(0, |s| s.landed(self.links.local_index).load(Ordering::Acquire));
                    format!("to {p}: queued {} landed {landed} batches {}{}", q.last, q.batches.len(), if q.broken { " broken" } else { "" })
                }).collect();
                let rs: Vec<String> = g.prefix.iter().enumerate().filter(|(l, r)| r.ready() > 0 || !g.expect[*l].is_empty()).map(|(l, r)| {
                    format!("from {}: ready {} landed {} expected {}", self.global_of_local[l], r.ready(), self.links.inbox.landed(l).load(Ordering::Acquire), g.expect[l].len())
                }).collect();
                format!("gated [{}] [{}]", qs.join(", "), rs.join(", "))
            }
        };
        format!("{}; {} signals queued out; {gated}; {}; {} stale mappings retired", self.sched.describe(), self.outbox.len(), self.bounce.describe(), self.imports.retired())
    }

    fn close(&mut self) {
        // Last signals (failures at an abort) go out if the rings have room.
        self.flush();
        if !self.close_gated() {
            self.imports.clear(self.dev.as_ref());
        }
        if self.sched.is_idle() {
            self.bounce.close(self.dev.as_ref());
        } else {
            // A forced exit with copies in flight: they may still read or write the rings.
            log::warn!("hoccl: rank {}: bounce rings stay mapped until the process exits (copies in flight)", self.links.rank);
            std::mem::forget(std::mem::take(&mut self.bounce));
        }
        self.links.inbox.mark_closed();
    }

    fn idle(&mut self) {
        let n = self.imports.close_retired(self.dev.as_ref());
        if n > 0 {
            log::debug!("hoccl: rank {}: closed {n} retired peer mappings", self.links.rank);
        }
    }

    fn gated(&mut self, peer: usize, len: usize) -> bool {
        let Some(g) = self.gated.as_ref() else { return false };
        let other_process_here = g.flags_dev.get(peer).is_some_and(Option::is_some);
        let both = other_process_here && self.peer_seg(peer).is_some_and(Segment::gated);
        gated_eligible(g.setting, other_process_here, both, len)
    }

    fn announce(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) -> Result<()> {
        let l = self.links.local_of.get(peer).copied().flatten();
        let (Some(g), Some(l)) = (self.gated.as_mut(), l) else {
            return Err(Error::internal("SameHost::announce", format!("rank {peer} is not reached by gated transfers")));
        };
        g.prefix[l].expect(tag.pair_seq);
        g.expect[l].push_back((tag.pair_seq, tag.k, remote.len));
        let mut m = Msg::new(MsgKind::Ready, tag.pair_seq, tag.k);
        let w = remote.wire;
        m.len = remote.len;
        m.code = READY_GATED;
        (m.alloc_id, m.alloc_len, m.base, m.offset, m.pid, m.handle) = (w.alloc_id, w.alloc_len, w.base, w.offset, w.pid, w.handle);
        self.post(peer, m);
        Ok(())
    }

    fn reached(&mut self, peer: usize, pair_seq: u64) {
        let l = self.links.local_of.get(peer).copied().flatten();
        let (Some(g), Some(l)) = (self.gated.as_mut(), l) else { return };
        if let Some(v) = g.prefix[l].reached(pair_seq) {
            self.links.inbox.ready(l).store(v, Ordering::Release);
        }
    }

    fn gated_room(&mut self, peer: usize) -> bool {
        let queued = self.gated.as_ref().and_then(|g| g.queues.get(peer)?.as_ref()).map_or(0, |q| q.batches.len());
        queued < GATED_QUEUE_BATCHES
    }

    fn gated_write(&mut self, peer: usize, pair_seq: u64, start_flag: DevPtr, start_value: u64, writes: &[GatedWrite]) -> Result<()> {
        const OP: &str = "SameHost::gated_write";
        if let Some(w) = writes.iter().find(|w| !w.remote.wire.gated) {
            return Err(Error::invalid_usage(OP, format!("rank {peer} announced the receive of send {} through the handshake, which this rank sends gated (the two ranks decided differently; mismatched calls?)", w.id.idx)));
        }
        let me = self.links.local_index;
        let flags = self.gated.as_ref().and_then(|g| *g.flags_dev.get(peer)?);
        let Some(flags) = flags else { return Err(Error::internal(OP, format!("rank {peer} is not reached by gated transfers"))) };
        let (ready, landed) = (flags.add(Segment::ready_offset(me)), flags.add(Segment::landed_offset(me)));
        let Some(g) = self.gated.as_mut() else { return Err(Error::internal(OP, "gated path off")) };
        if g.queues[peer].is_none() {
            g.queues[peer] = Some(GatedQueue { queue: self.dev.create_copy_queue()?, last: 0, batches: VecDeque::new(), broken: false });
        }
        let q = g.queues[peer].as_mut().expect("made above");
        if q.broken || pair_seq <= q.last {
            return Err(Error::internal(OP, format!("gated batch {pair_seq} to rank {peer} after {} (broken: {})", q.last, q.broken)));
        }
        let mut b = g.spare.pop().unwrap_or_default();
        b.pair_seq = pair_seq;
        for w in writes {
            check_announced(w.remote.wire.offset, w.len as u64, w.remote.wire.alloc_len).map_err(|what| Error::Remote { op: OP, peer, what })?;
        }
        // Map every destination before anything is queued: a failure here leaves the queue
        // as it was.
        for w in writes.iter().filter(|w| w.len > 0) {
            // A gated receiver waits for its landed flag, which only this queue writes: a
            // transfer that stale mappings keep from being imported has no other route here.
            match self.imports.acquire(self.dev.as_ref(), peer, &w.remote.wire).and_then(|a| match a {
                Acquire::Mapped(m) => Ok(m),
                Acquire::Stale(e) => Err(e),
            }) {
                Ok(m) => b.mapped.push(m),
                Err(e) => {
                    for m in b.mapped.drain(..) {
                        self.imports.release(&m);
                    }
                    g.spare.push(b);
                    return Err(e);
                }
            }
        }
        b.flows.extend(writes.iter().map(|w| w.id));
        // Once the first wait is queued, a failure leaves a partial batch: the queue is
        // broken for good (and left in place at close).
        q.broken = true;
        let mut enqueue = || -> Result<()> {
            // Both waits in one driver call (`cuStreamBatchMemOp`).
            q.queue.mem_ops(&[MemOp::WaitGeq { flag: start_flag, value: start_value }, MemOp::WaitGeq { flag: ready, value: pair_seq }])?;
            for (w, m) in writes.iter().filter(|w| w.len > 0).zip(&b.mapped) {
                q.queue.copy(m.base.add(w.remote.wire.offset as usize), w.src, w.len)?;
            }
            q.queue.write_value(landed, pair_seq)
        };
        let r = enqueue();
        // The mappings stay pinned with the batch, landed or not.
        q.batches.push_back(b);
        g.outstanding += 1;
        q.last = pair_seq;
        if r.is_ok() {
            q.broken = false;
        }
        r
    }
}

/// Register the flag area of every peer of this host in another process for `dev`; by
/// global rank, its device address. On a failure, what was registered is undone.
fn map_flag_areas(dev: &dyn Device, links: &Links, in_process: &[bool]) -> Result<Vec<Option<DevPtr>>> {
    let mut out: Vec<Option<DevPtr>> = vec![None; links.peers.len()];
    for (peer, seg) in links.peers.iter().enumerate() {
        let Some(seg) = seg.as_ref().filter(|_| !in_process[peer] && peer != links.rank) else { continue };
        let (area, len) = seg.flag_area();
        match dev.map_host(area, len) {
            Ok(d) => out[peer] = Some(d),
            Err(e) => {
                for (p, d) in out.iter().enumerate() {
                    if let (Some(_), Some(s)) = (d, links.peers[p].as_ref()) {
                        if let Err(u) = dev.unmap_host(s.flag_area().0) {
                            log::warn!("hoccl: unregistering rank {p}'s flag area: {u}");
                        }
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;
    use crate::device::pattern_byte;
    use std::time::{Duration, Instant};

    /// Two ranks of one process, each with its transport, joined by mailboxes.
    fn pair(comm: u64) -> (Arc<dyn Device>, SameHost, SameHost) {
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new().unwrap());
        let pid = std::process::id();
        let name = |r| Segment::name(pid, comm, r);
        let (in0, in1) = (Segment::create(&name(0), 2).unwrap(), Segment::create(&name(1), 2).unwrap());
        let local_of = vec![Some(0), Some(1)];
        let l0 = Links { rank: 0, inbox: in0, peers: vec![None, Some(Segment::open(&name(1), 2).unwrap())], local_index: 0, local_of: local_of.clone() };
        let l1 = Links { rank: 1, inbox: in1, peers: vec![Some(Segment::open(&name(0), 2).unwrap()), None], local_index: 1, local_of };
        let t0 = SameHost::connect(dev.clone(), l0, 2, 4096, None).unwrap();
        let t1 = SameHost::connect(dev.clone(), l1, 2, 4096, None).unwrap();
        (dev, t0, t1)
    }

    /// Drive `t` until `until` holds (or fail after a while); returns the flows it reported.
    fn drive(t: &mut SameHost, until: impl Fn(&SameHost, &[FlowId]) -> bool) -> Vec<FlowId> {
        let (mut done, mut advanced) = (Vec::new(), Vec::new());
        let t0 = Instant::now();
        while !until(t, &done) {
            t.progress(&mut done, &mut advanced).unwrap();
            assert!(t0.elapsed() < Duration::from_secs(10), "no progress: {}", t.describe());
            std::thread::yield_now();
        }
        done
    }

    fn signals(t: &mut SameHost) -> Vec<Incoming> {
        let mut v = Vec::new();
        t.poll_signals(&mut v);
        v
    }

    /// `ready` covers only a prefix of reached ops: an op reached out of call order waits
    /// for the earlier ones; repeats and ops already covered change nothing.
    #[test]
    fn ready_is_the_reached_prefix() {
        let mut r = ReadyPrefix::default();
        for p in [2, 3, 5, 3] {
            r.expect(p);
        }
        assert_eq!(r.reached(3), None, "op 2 not reached: ready stays");
        assert_eq!(r.ready(), 0);
        assert_eq!(r.reached(2), Some(3), "2 and 3 reached: ready covers both");
        assert_eq!(r.reached(4), None, "4 has no gated receive from this sender");
        r.expect(7);
        r.expect(6);
        assert_eq!(r.reached(7), None);
        assert_eq!(r.reached(5), Some(5));
        assert_eq!(r.reached(6), Some(7));
        r.expect(7);
        assert_eq!((r.reached(7), r.ready()), (None, 7), "an op already covered is not expected again");
        r.expect(8);
        assert_eq!(r.reached(8), Some(8));
    }

    /// Gated: never with `HOCCL_GATED=0`, never within one process or without both flag
    /// areas mapped, and only up to one copy.
    #[test]
    fn eligibility() {
        for setting in [None, Some(true)] {
            assert!(gated_eligible(setting, true, true, 0));
            assert!(gated_eligible(setting, true, true, GATED_MAX));
            assert!(!gated_eligible(setting, true, true, GATED_MAX + 1));
            assert!(!gated_eligible(setting, false, true, 4096));
            assert!(!gated_eligible(setting, true, false, 4096));
        }
        assert!(!gated_eligible(Some(false), true, true, 4096));
        assert_eq!(GATED_MAX, crate::transport::chunk_scheduler::MIN_CHUNK);
        assert_eq!(crate::transport::chunk_scheduler::chunk_size(GATED_MAX, 3, 16 << 20), GATED_MAX, "a gated flow is one copy");
        // Ranks of one process never take it (the unit pair is one process).
        let (_dev, mut t0, mut t1) = pair(0x7e57_0002);
        assert!(!t0.gated(1, 4096) && !t1.gated(0, 4096));
        t0.close();
        t1.close();
    }

    /// Ready from the receiver, a chunked write, Landed from the sender's transport; an
    /// empty write lands too; a cancelled write is never reported and signals nothing.
    #[test]
    fn write_lands_and_cancel_is_silent() {
        let (dev, mut t0, mut t1) = pair(0x7e57_0001);
        let len = 3 * 4096 + 5;
        let (src, dst) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
        let data: Vec<u8> = (0..len as u64).map(|i| pattern_byte(3, i)).collect();
        dev.copy_from_host(src, &data).unwrap();
        let region = Region { seq: 9, ptr: dst, len, alloc: Some(dev.allocation(dst).unwrap()) };
        let tag = Tag { pair_seq: 1, k: 0 };
        let remote = t1.expose(0, region).unwrap();
        t1.post_ready(0, tag, remote);
        drive(&mut t1, |t, _| !t.signals_queued());
        let got = signals(&mut t0);
        let [Incoming { from: 1, pair_seq: 1, signal: Signal::Ready { k: 0, remote } }] = got[..] else { panic!("{got:?}") };
        assert!(!t1.signals_queued(), "a signal goes into the ring when it is posted");
        assert_eq!(remote.len, len as u64);

        let id = FlowId { seq: 9, idx: 0 };
        t0.start_write(id, 1, tag, src, &remote, len).unwrap();
        assert_eq!(drive(&mut t0, |t, d| !d.is_empty() && !t.signals_queued()), vec![id]);
        let got = signals(&mut t1);
        assert!(matches!(got[..], [Incoming { from: 0, pair_seq: 1, signal: Signal::Landed { k: 0, len: l } }] if l == len as u64), "{got:?}");
        let mut back = vec![0u8; len];
        dev.copy_to_host(&mut back, dst).unwrap();
        assert!(back == data, "the bytes landed wrong");

        let empty = FlowId { seq: 10, idx: 0 };
        let none = RemoteBuffer { len: 0, wire: Wire::empty(std::process::id()) };
        t0.start_write(empty, 1, Tag { pair_seq: 2, k: 0 }, DevPtr(0), &none, 0).unwrap();
        assert_eq!(drive(&mut t0, |t, d| !d.is_empty() && !t.signals_queued()), vec![empty]);
        let got = signals(&mut t1);
        assert!(matches!(got[..], [Incoming { pair_seq: 2, signal: Signal::Landed { k: 0, len: 0 }, .. }]), "{got:?}");

        t0.start_write(FlowId { seq: 11, idx: 0 }, 1, Tag { pair_seq: 3, k: 0 }, src, &remote, len).unwrap();
        t0.cancel(11);
        assert!(drive(&mut t0, |t, _| !t.data_in_flight() && !t.signals_queued()).is_empty());
        t0.signal_failure(1, 3, 7);
        drive(&mut t0, |t, _| !t.signals_queued());
        let got = signals(&mut t1);
        assert!(matches!(got[..], [Incoming { pair_seq: 3, signal: Signal::Failed { code: 7 }, .. }]), "{got:?}");

        assert_eq!(t0.peer_health(1), None);
        t1.close();
        assert!(t0.peer_health(1).is_some_and(|why| why.contains("aborted or destroyed")));
        t0.close();
        dev.free(src).unwrap();
        dev.free(dst).unwrap();
    }

    /// Records a corrupt or hostile peer writes into a mailbox are checked before use: an
    /// unknown kind and a `Ready` whose region does not lie inside the allocation it
    /// announces are refused, and the rank is reported unhealthy, so the ops that wait on it
    /// fail `Remote`. Writes are bounds-checked too: toward a region past its announced
    /// allocation, or into a mapped allocation that a later record claims is larger, they
    /// are refused before any byte moves.
    #[test]
    fn malformed_records_are_refused() {
        let ready = |offset: u64, len: u64, alloc_len: u64| {
            let mut m = Msg::new(MsgKind::Ready, 1, 0);
            (m.offset, m.len, m.alloc_len) = (offset, len, alloc_len);
            m
        };
        let mut unknown = Msg::new(MsgKind::Landed, 1, 0);
        unknown.kind = 77;
        let cases = [
            (unknown, "unknown record kind 77"),
            (ready(1, 4096, 4096), "4096 bytes at offset 1 exceeds the announced 4096-byte allocation"),
            (ready(u64::MAX - 10, 100, 4096), "exceeds the announced"),
        ];
        for (i, (m, why)) in cases.into_iter().enumerate() {
            let (_dev, mut t0, mut t1) = pair(0x7e57_0100 + i as u64);
            // Rank 1 writes the record straight into its ring of rank 0's mailbox.
            assert!(t1.links.peers[0].as_ref().unwrap().try_push(1, &m));
            assert!(signals(&mut t0).is_empty(), "{why}: a malformed record was delivered");
            let health = t0.peer_health(1).unwrap_or_default();
            assert!(health.contains("malformed mailbox record") && health.contains(why), "{why}: {health:?}");
            t0.close();
            t1.close();
        }

        let (dev, mut t0, mut t1) = pair(0x7e57_0200);
        let len = 4096usize;
        let (src, dst) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
        dev.copy_from_host(src, &vec![0xab; len]).unwrap();
        let region = Region { seq: 1, ptr: dst, len: len / 2, alloc: Some(dev.allocation(dst).unwrap()) };
        let good = t1.expose(0, region).unwrap();
        let past = RemoteBuffer { len: len as u64, wire: Wire { offset: 8, ..good.wire } };
        let e = t0.start_write(FlowId { seq: 1, idx: 0 }, 1, Tag { pair_seq: 1, k: 0 }, src, &past, len).expect_err("past the allocation");
        assert!(matches!(e, Error::Remote { peer: 1, .. }) && e.to_string().contains("exceeds the announced"), "{e}");
        // A good write maps the allocation; a record then claiming it is twice as large is
        // refused by the mapping cache.
        let id = FlowId { seq: 2, idx: 0 };
        t0.start_write(id, 1, Tag { pair_seq: 2, k: 0 }, src, &good, len / 2).unwrap();
        assert_eq!(drive(&mut t0, |t, d| !d.is_empty() && !t.signals_queued()), vec![id]);
        let grown = RemoteBuffer { len: len as u64, wire: Wire { alloc_len: 2 * len as u64, offset: len as u64, ..good.wire } };
        let e = t0.start_write(FlowId { seq: 3, idx: 0 }, 1, Tag { pair_seq: 3, k: 0 }, src, &grown, len).expect_err("grown allocation");
        assert!(matches!(e, Error::Remote { peer: 1, .. }) && e.to_string().contains("mapped as 4096"), "{e}");
        let mut back = vec![0u8; len];
        dev.copy_to_host(&mut back, dst).unwrap();
        assert!(back[..len / 2].iter().all(|b| *b == 0xab) && back[len / 2..].iter().all(|b| *b == 0), "bytes outside the good write changed");
        t0.close();
        t1.close();
        dev.free(src).unwrap();
        dev.free(dst).unwrap();
    }
}

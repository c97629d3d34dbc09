//! The staged path: small transfers between ranks of this host in different processes whose
//! every device operation the calling threads enqueue during their calls, so that no host
//! thread has to make a driver call after the calls return (an application thread waiting
//! inside the driver, a pageable copy or a `cuMemFree`, cannot hold such a transfer up:
//! docs/design.md, "Application threads that wait inside the driver").
//!
//! **Rings.** At creation each rank allocates, per local peer in another process, a receive
//! ring of `R` slots of `S` bytes in its device memory and exports it; every sender imports
//! the rings its peers made for it. Per direction (sender → receiver) two words of the
//! receiver's mailbox flag area ([`Segment::staged_offset`], [`Segment::drained_offset`])
//! count chunks: `staged` (chunk g is in slot (g-1) % R; written by the sender's staged
//! queue) and `drained` (chunk g was copied out; written by the receiver's stream). Both
//! sides number the chunks of a direction alike: they count the same transfers in call order,
//! each `ceil(len / S)` chunks.
//!
//! **At the call.** A transfer's chunks move in copies of runs of consecutive slots
//! ([`copies`]: never across the ring's end, at most `R / 2` slots; `g` below is a run's
//! last chunk, `f` its first). Sender, on its staged queue for that receiver (a copy queue
//! of its own, FIFO): a wait for the user stream's start flag, then per run `wait drained
//! >= g - R`, the copy into the slots, `write copied := base + g` (its own word, see
//! [`Staged::direct_waits`]), `write staged := g`. Receiver, on the user stream after the
//! handshake's `write start`: per run `wait staged >= g`, `wait drained >= f - 1` (the
//! direction's chunks drain in call order over all of the receiver's streams, so `drained`
//! only grows and frees slots in order), the copy out of the slots, `write drained := g`.
//! The stream then waits for the proxy's `finish`, or, for an op staged throughout, on the
//! senders' `copied` words only ([`Staged::direct_waits`]).
//!
//! **Driver calls.** The waits and writes between two copies go to the driver as one batch
//! (`device::batch`, `cuStreamBatchMemOp` on CUDA), on the stream together with the
//! handshake's `write start` and the completion wait. A sendrecv of one run each way is six
//! enqueuing calls: on the stream `[write start, wait staged, wait drained]`, the copy out,
//! `[write drained, wait copied]`; on the staged queue `[wait start, wait for the slot]`,
//! the copy in, `[write copied, write staged]`. An op whose receives are `n` runs in all is
//! `2n + 1` calls on the stream (`n` copies, `n + 1` runs of flag operations); a send of
//! `n` runs is at most `2n + 1` on its queue.
//!
//! **Queue budget.** A staged queue holds at most [`STAGED_QUEUE_ENTRIES`] entries that
//! have not run; the calling thread holds further entries back, in order, and the proxy
//! enqueues them as the queue drains ([`Lane`]). The caller then never blocks in the driver
//! behind a queue that waits for its peer; those transfers depend on the proxy as the
//! handshake's do. They stay staged (both sides have already numbered their chunks: the
//! receiver cannot know how full the sender's queue is, so the path cannot change per op).
//!
//! **Completion.** The op goes to the proxy with one [`StagedWait`] per staged transfer: a
//! flag word (host memory) and the value that completes it; the proxy loads it and writes
//! the stream's finish flag (a host store), which the stream waits for unless the op is
//! staged throughout. The receiver announces each staged receive's
//! length to the sender by message, so a length mismatch fails both sides as on the other
//! paths. On a failure every wait is released by host stores, since a stream or queue that
//! waits for ever keeps its context from being torn down and the process from exiting: the
//! receiver's proxy raises its `staged` and `drained` words (its stream then copies its own
//! slots into its own output: the failed op's output is undefined; the sender's queue waits
//! on `drained`, so its slot waits pass too); the sender's proxy drops the held-back
//! entries and raises its own `copied` word, and where the receiver is gone (its process exited, or it sent malformed
//! records), and at the communicator's end, raises
//! the receiver's `drained` word for itself (its queue's start waits pass as the failure
//! releases its stream). A word found raised fails the peer's op.
use crate::bootstrap::Bootstrap;
use crate::config::Config;
use crate::device::batch::{Batch, OnStream};
use crate::device::{Backend, CopyQueue, DevPtr, Device, ExportHandle, FlagSlab};
use crate::engine::{Fill, Transfer};
use crate::error::{Error, Result};
use crate::topology::Topology;
use crate::transport::mailbox::{FlagArea, Segment};
use std::sync::atomic::Ordering;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// The value a failed receiver stores into its words: above any chunk number, so every
/// wait of its streams on them passes, also under the 32-bit fallback of stream memory
/// operations (which compares the low 32 bits cyclically: they hold 2^30, ahead of any
/// chunk number below 2^30).
pub const RELEASED: u64 = (1 << 62) + (1 << 30);

/// One staged transfer as the proxy tracks it: done once `word` of `area` reached `target`.
#[derive(Clone)]
pub struct StagedWait {
    pub peer: usize,
    /// Index among this op's staged transfers with `peer` in the same direction (matches the
    /// receiver's announcement).
    pub k: u32,
    pub len: u64,
    pub send: bool,
    pub area: Arc<FlagArea>,
    /// Offset of the word in the flag area: the receiver's `staged` word for this sender
    /// (sender side), the own `drained` word for that sender (receiver side).
    pub word: usize,
    pub target: u64,
    /// Receiver side: offset of the own `staged` word to raise to [`RELEASED`] if the op
    /// fails (it releases the stream's waits).
    pub release: Option<usize>,
    /// Sender side: the staged queue to the peer, whose held-back entries the proxy
    /// enqueues ([`Lane::flush`]) and whose waits a failure releases ([`Lane::release`]).
    pub lane: Option<Arc<Mutex<Lane>>>,
    /// The op's stream waits for the proxy's `finish` store (not every transfer of the op
    /// is staged, or a send's entries did not all fit its queue at the call); otherwise it
    /// completes without the proxy ([`Staged::direct_waits`]).
    pub hop: bool,
}

impl StagedWait {
    pub fn value(&self) -> u64 {
        self.area.word(self.word).load(Ordering::Acquire)
    }
    /// After a failure. Receiver side: release what a stream of this rank may wait on for
    /// this transfer, both words, `staged` (the chunk is there) and `drained` (the chunks
    /// before it were copied out); that also releases the sender's queue, which waits on
    /// `drained`. Sender side: drop the queue's held-back entries, and when `peer_gone` (the
    /// receiver cannot release its words any more) raise its `drained` word for this rank
    /// ([`Lane::release`]).
    pub fn release(&self, peer_gone: bool) {
        if let Some(o) = self.release {
            self.area.word(o).fetch_max(RELEASED, Ordering::AcqRel);
            self.area.word(self.word).fetch_max(RELEASED, Ordering::AcqRel);
        }
        if let Some(l) = &self.lane {
            l.lock().unwrap_or_else(|e| e.into_inner()).release(peer_gone);
        }
    }
}

/// Entries (waits, copies, flag writes) a staged queue may hold that have not run yet. A
/// queue whose head waits for a flag fills its command buffer, and the driver then blocks
/// the call that enqueues (on the H200 a gated queue given 511 batches behind a wait, about
/// 2000 entries, blocked for good). For a staged queue that call is the application's: two ranks whose
/// calling threads each block on a queue that waits for work the other has not enqueued yet
/// would hang. So the calling thread enqueues while the queue holds fewer than this many
/// entries that have not run, and leaves the rest, in order, to the proxy
/// ([`Lane::flush`]). 256 entries are 64 single-copy sends.
pub const STAGED_QUEUE_ENTRIES: u64 = 256;

/// Staged chunks per peer and direction in one call at most; further transfers of the call
/// with that peer take the proxy's path. A receive puts four entries per copy, at most one
/// per chunk, on the user's stream at the call: two ranks whose calls each fill their stream with receives before
/// enqueuing their sends would block each other in the driver. Bounded so, one call puts at
/// most 64 entries per peer on the stream. `HOCCL_STAGED_BYTES` may be at most this many
/// slots.
pub const STAGED_CALL_CHUNKS: u64 = 16;

/// The sender's own word for one receiver: its staged queue writes `copied := base + g`
/// right after chunk g's copy (and before `staged := g`), so that a sending stream whose
/// op is staged throughout waits on this word instead of the proxy's `finish`
/// ([`Staged::direct_waits`]). It is this process's memory: a failure may raise it at any
/// time without touching a live receiver's words, and it stays mapped after the
/// communicator's end (a stream may reach its wait later, behind the application's work):
/// words return to a process-wide pool, like the streams' flag pairs, and the next user
/// counts on from `base`.
struct Copied {
    slab: Arc<FlagSlab>,
    idx: usize,
    base: u64,
}

/// A pooled [`Copied`] word: its device and its last value.
struct PooledCopied {
    key: (Backend, usize),
    slab: Arc<FlagSlab>,
    idx: usize,
    value: u64,
}

static COPIED_POOL: Mutex<Vec<PooledCopied>> = Mutex::new(Vec::new());

/// Words per slab of [`Copied`] words (one per receiver of a communicator).
const COPIED_SLAB: usize = 16;

/// A word that counted this far is not reused: chunk numbers stay below 2^30, which the
/// 32-bit fallback's comparison with [`RELEASED`] needs.
const COPIED_REUSE_BELOW: u64 = 1 << 29;

impl Copied {
    fn take(dev: &dyn Device) -> Result<Copied> {
        let key = (dev.backend(), dev.ordinal());
        let mut pool = COPIED_POOL.lock().map_err(|_| Error::internal("Staged::setup", "staged word pool poisoned"))?;
        if let Some(i) = pool.iter().position(|p| p.key == key) {
            let p = pool.swap_remove(i);
            return Ok(Copied { slab: p.slab, idx: p.idx, base: p.value });
        }
        let slab = Arc::new(dev.alloc_flags(COPIED_SLAB)?);
        pool.extend((1..COPIED_SLAB).map(|idx| PooledCopied { key, slab: slab.clone(), idx, value: 0 }));
        Ok(Copied { slab, idx: 0, base: 0 })
    }

    /// The word's device address and the value it holds once chunk `g` was copied.
    fn at(&self, g: u64) -> (DevPtr, u64) {
        (self.slab.dev_addr(self.idx), self.base + g)
    }

    fn raise(&self) {
        self.slab.raise(self.idx, RELEASED);
    }

    /// At the communicator's end, with `sent` chunks queued in all: back to the pool when
    /// the queue wrote the last of them (nothing can write the word any more, and every
    /// stream's wait on it passes), else kept out of use, mapped, until the process exits.
    fn give_back(self, key: (Backend, usize), sent: u64) {
        let value = self.slab.load(self.idx);
        if value == self.base + sent && value < COPIED_REUSE_BELOW {
            if let Ok(mut pool) = COPIED_POOL.lock() {
                pool.push(PooledCopied { key, slab: self.slab, idx: self.idx, value });
                return;
            }
        }
        std::mem::forget(self.slab);
    }
}

/// The copies that move a transfer of `n` chunks whose first is chunk `prev + 1` of its
/// direction, as (first chunk, chunks, index of the first within the transfer): runs of
/// consecutive slots, never across the ring's end, of at most half the ring, so that a
/// transfer longer than that still has a copy in and a copy out in flight at once. A copy
/// and a flag hop cost microseconds whatever the size, so a transfer of up to half the ring
/// that does not cross its end moves in one copy each way (1 MiB with the default ring).
/// Both sides of a direction group alike: the same transfers in the same order.
fn copies(prev: u64, n: u64, slots: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    let most = (slots / 2).max(1);
    let mut c = 0;
    std::iter::from_fn(move || {
        if c >= n {
            return None;
        }
        let g = prev + c + 1;
        let k = (n - c).min(most).min(slots - (g - 1) % slots);
        let item = (g, k, c);
        c += k;
        Some(item)
    })
}

/// One entry of a staged queue, or a few for a chunk.
#[derive(Clone, Copy)]
enum Entry {
    /// Wait for the sending stream's start flag.
    Start { flag: DevPtr, value: u64 },
    /// The chunks up to `g` from where the last left off ([`copies`]): wait for their
    /// slots (when the ring has wrapped), one copy, `write copied := base + g`, `write
    /// staged := g`.
    Chunk { g: u64, dst: DevPtr, src: DevPtr, len: usize },
}

/// The staged queue from this rank to one receiver, shared by the calling threads and the
/// proxy (which enqueues what the callers held back).
pub struct Lane {
    /// The queue, behind a batch: an entry's waits and writes join the run before the
    /// next copy; [`Lane::commit`] enqueues the rest.
    queue: Batch<Box<dyn CopyQueue>>,
    /// The receiver's flag area (its `staged` word for this rank says which chunk's write
    /// ran last) and the device addresses of this rank's `staged` and `drained` words there.
    area: Arc<FlagArea>,
    me: usize,
    staged: DevPtr,
    drained: DevPtr,
    /// This rank's own count of the chunks copied (None once given back at the end).
    copied: Option<Copied>,
    slots: u64,
    /// Entries enqueued so far; per chunk enqueued and not yet seen written, its number and
    /// the entry count through its write; entries seen run.
    entries: u64,
    marks: VecDeque<(u64, u64)>,
    ran: u64,
    /// Entries held back for the proxy, in queue order.
    held: VecDeque<Entry>,
    /// A failure released the queue: nothing more is held back (see [`Lane::submit`]).
    released: bool,
}

impl Lane {
    fn new(queue: Box<dyn CopyQueue>, area: Arc<FlagArea>, area_dev: DevPtr, me: usize, copied: Copied, slots: u64) -> Lane {
        Lane {
            queue: Batch::new(queue),
            area,
            me,
            staged: area_dev.add(Segment::staged_offset(me)),
            drained: area_dev.add(Segment::drained_offset(me)),
            copied: Some(copied),
            slots,
            entries: 0,
            marks: VecDeque::new(),
            ran: 0,
            held: VecDeque::new(),
            released: false,
        }
    }

    fn cost(&self, e: &Entry) -> u64 {
        match *e {
            Entry::Start { .. } => 1,
            Entry::Chunk { g, .. } => self.chunk_cost(g),
        }
    }

    fn chunk_cost(&self, g: u64) -> u64 {
        3 + u64::from(g > self.slots)
    }

    /// Whether entries costing `cost` in all would be enqueued at once, none held back:
    /// nothing is held back and the queue has room for them. Until the next caller, only
    /// the queue's running changes that, towards more room (the proxy enqueues only
    /// held-back entries).
    fn fits(&mut self, cost: u64) -> bool {
        self.held.is_empty() && self.outstanding() + cost <= STAGED_QUEUE_ENTRIES
    }

    /// Entries enqueued that have not run (a chunk's write ran once the receiver's `staged`
    /// word shows it; the queue is in order).
    fn outstanding(&mut self) -> u64 {
        let v = self.area.word(Segment::staged_offset(self.me)).load(Ordering::Acquire);
        while let Some(&(_, n)) = self.marks.front().filter(|m| m.0 <= v) {
            self.ran = n;
            self.marks.pop_front();
        }
        self.entries - self.ran
    }

    /// Give `e` to the batch: a chunk's copy enqueues the run before it, its write starts
    /// the next run (enqueued by the next copy or by [`Lane::commit`]).
    fn enqueue(&mut self, e: Entry) -> Result<()> {
        match e {
            Entry::Start { flag, value } => self.queue.wait_geq(flag, value)?,
            Entry::Chunk { g, dst, src, len } => {
                if g > self.slots {
                    self.queue.wait_geq(self.drained, g - self.slots)?;
                }
                self.queue.copy(dst, src, len)?;
                if let Some(c) = &self.copied {
                    let (w, v) = c.at(g);
                    self.queue.write(w, v)?;
                }
                self.queue.write(self.staged, g)?;
            }
        }
        self.entries += self.cost(&e);
        if let Entry::Chunk { g, .. } = e {
            self.marks.push_back((g, self.entries));
        }
        Ok(())
    }

    /// Enqueue `e` now if nothing is held back and the queue has room (an empty queue takes
    /// any entry), else hold it back for the proxy; on a released queue, drop it instead.
    /// Whether it was held back. A released queue still takes what fits: a sending stream
    /// that waits on the `copied` word ([`Staged::direct_waits`]) was promised at the call
    /// that its op's entries are enqueued, and the queue's last write then releases it
    /// for good once the queue runs to its end (a failure raises the receiver's `drained`
    /// word); a host store could be overwritten by a write still queued.
    fn submit(&mut self, e: Entry) -> Result<bool> {
        if self.held.is_empty() && (self.outstanding() + self.cost(&e) <= STAGED_QUEUE_ENTRIES || self.entries == self.ran) {
            self.enqueue(e)?;
            return Ok(false);
        }
        if self.released {
            return Ok(false);
        }
        self.held.push_back(e);
        Ok(true)
    }

    /// Enqueue the waits and writes the batch still holds (the last chunk's write): every
    /// caller of [`Lane::submit`] calls it before letting go of the lane.
    pub fn commit(&mut self) -> Result<()> {
        self.queue.flush()
    }

    /// Proxy: enqueue held-back entries, in order, while the queue has room. Whether any
    /// moved.
    pub fn flush(&mut self) -> Result<bool> {
        let mut moved = false;
        while let Some(&e) = self.held.front() {
            if self.released || (self.outstanding() + self.cost(&e) > STAGED_QUEUE_ENTRIES && self.entries != self.ran) {
                break;
            }
            self.held.pop_front();
            self.enqueue(e)?;
            moved = true;
        }
        self.commit()?;
        Ok(moved)
    }

    /// Whether entries are held back for the proxy.
    pub fn holds(&self) -> bool {
        !self.held.is_empty()
    }

    /// After a failure: drop the held-back entries (nothing more is held back) and raise
    /// this rank's `copied` word, which releases the sending streams that wait on it (a
    /// write the queue still runs may lower it again: the proxy repeats the release, and
    /// the queue's last write passes every such wait). With `raise`, also raise the
    /// receiver's `drained` word for this rank (this rank's own
    /// mapping of its flag area, a host store), so the queue's slot waits pass and it runs to
    /// its end; its start waits pass once the sending stream runs on (a failure releases
    /// it). A queue that waits for ever keeps its context from being torn down: the process
    /// could not exit. Raised only where the receiver cannot release the word itself (the
    /// transport reports it gone) and at the communicator's end: a live receiver's stream that found
    /// the word raised could copy a slot the queue had already refilled, while the receiver
    /// fails its side of the op (on the sender's `Fail`) and raises the word itself.
    pub fn release(&mut self, raise: bool) {
        self.released = true;
        self.held.clear();
        if let Some(c) = &self.copied {
            c.raise();
        }
        if raise {
            self.area.word(Segment::drained_offset(self.me)).fetch_max(RELEASED, Ordering::AcqRel);
        }
    }
}

/// A peer in another process of this host, reached by the staged path.
struct Peer {
    /// The peer's local index (its words in this rank's flag area).
    local: usize,
    /// The peer's flag area and its device address (this rank's words in it: at this rank's
    /// local index).
    area: Arc<FlagArea>,
    area_dev: DevPtr,
    /// This rank's ring for receiving from the peer (own memory).
    ring_in: DevPtr,
    /// The peer's ring for receiving from this rank (imported), and its length.
    ring_out: DevPtr,
    ring_out_len: usize,
    /// The staged queue for sends to the peer (made at creation).
    lane: Option<Arc<Mutex<Lane>>>,
    /// Chunks sent so far to the peer (queued or held back), and chunks received from it.
    sent: u64,
    received: u64,
}

/// The staged path of one rank (None in the communicator when it is off).
pub struct Staged {
    dev: Arc<dyn Device>,
    max: usize,
    slots: usize,
    slot: usize,
    me_local: usize,
    own: Arc<FlagArea>,
    own_dev: DevPtr,
    /// By global rank.
    peers: Vec<Option<Peer>>,
    /// An enqueue failed midway: the chunk counts may differ from the peers..
    broken: bool,
}

/// A process's second mapping of every local rank's mailbox, by global rank, or the error
/// that prevented it (`comm::setup::connect_mailboxes`).
pub type FlagMaps = Vec<(usize, Result<FlagArea>)>;

/// The receive rings' export handles and lengths, by peer.
type Handles = Vec<(usize, ExportHandle, usize)>;

/// Per peer, what the sender needs: the ring's export handle and length (zero when none).
const REC: usize = 64 + 8;

/// What one rank's staged transfers of a call were turned into.
#[derive(Default)]
pub struct Taken {
    pub sends: Vec<Transfer>,
    pub recvs: Vec<Transfer>,
}

impl Staged {
    /// Set the path up (collective over `b`): rings, exports, imports, queues, flag
    /// registrations. None when `HOCCL_STAGED_BYTES` is 0, when no rank has a local peer in
    /// another process, or when any rank could not set it up (logged; every rank then
    /// leaves it off, so both sides of a pair decide alike).
    /// `flag_maps`: this process's second mapping of every local rank's mailbox, by global
    /// rank (`comm::setup::connect_mailboxes`), or the error that prevented it.
    pub fn setup(dev: &Arc<dyn Device>, b: &dyn Bootstrap, topo: &Topology, flag_maps: FlagMaps, config: &Config) -> Result<Option<Staged>> {
        const OP: &str = "Communicator::new";
        let (rank, n) = (b.rank(), b.size());
        let local = topo.local_peers(rank).to_vec();
        let pid = topo.ranks()[rank].pid;
        let others: Vec<usize> = local.iter().copied().filter(|&r| r != rank && topo.ranks()[r].pid != pid).collect();
        let wanted = config.staged_bytes > 0;
        let mut st = None;
        let mut rec = vec![0u8; 1 + n * REC];
        if wanted && !others.is_empty() {
            match Self::prepare(dev, flag_maps, config, (rank, n), &local, &others) {
                Ok((s, handles)) => {
                    rec[0] = 1;
                    for (p, h, len) in handles {
                        rec[1 + p * REC..1 + p * REC + 64].copy_from_slice(&h.0);
                        rec[1 + p * REC + 64..1 + (p + 1) * REC].copy_from_slice(&(len as u64).to_le_bytes());
                    }
                    st = Some(s);
                }
                Err(e) => log::warn!("hoccl: rank {rank}: staged transfers off: {e}"),
            }
        } else {
            rec[0] = u8::from(!wanted || others.is_empty()) * 2;
        }
        let all = b.all_gather(&rec).map_err(|e| e.with_op(OP))?;
        // 1: set up; 2: nothing to set up here. Any 0 turns the path off everywhere.
        let mut ok = all.iter().all(|r| r.first().is_some_and(|&c| c != 0)) && wanted;
        if ok {
            if let Some(s) = st.as_mut() {
                if let Err(e) = s.import(&all, rank) {
                    log::warn!("hoccl: rank {rank}: staged transfers off: {e}");
                    ok = false;
                }
            }
        }
        let agreed = b.all_gather(&[u8::from(ok)]).map_err(|e| e.with_op(OP))?;
        let on = agreed.iter().all(|r| r.first() == Some(&1));
        match st {
            Some(s) if on => {
                log::info!("hoccl: rank {rank}: staged transfers up to {} B with ranks {others:?} ({} x {} B rings)", s.max, s.slots, s.slot);
                Ok(Some(s))
            }
            Some(mut s) => {
                s.teardown(true);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// This rank's part before the exchange: map the flag areas, allocate and export the
    /// receive rings. Returns the rings' handles by peer.
    fn prepare(dev: &Arc<dyn Device>, flag_maps: FlagMaps, config: &Config, (rank, n): (usize, usize), local: &[usize], others: &[usize]) -> Result<(Staged, Handles)> {
        let (slots, slot) = config.staged_ring;
        let mut maps: Vec<Option<Result<FlagArea>>> = Vec::new();
        for (r, m) in flag_maps {
            if maps.len() <= r {
                maps.resize_with(r + 1, || None);
            }
            maps[r] = Some(m);
        }
        let mut take = |r: usize| -> Result<Arc<FlagArea>> {
            match maps.get_mut(r).and_then(Option::take) {
                Some(m) => m.map(Arc::new).map_err(|e| e.with_op("Staged::setup")),
                None => Err(Error::internal("Staged::setup", format!("rank {r}'s mailbox was not mapped for the staged path"))),
            }
        };
        let me_local = local.iter().position(|&r| r == rank).ok_or_else(|| Error::internal("Staged::setup", "rank not in its node"))?;
        let own = take(rank)?;
        let own_dev = dev.map_host(own.area().0, own.area().1)?;
        let mut s = Staged { dev: dev.clone(), max: config.staged_bytes, slots, slot, me_local, own, own_dev, peers: (0..n).map(|_| None).collect(), broken: false };
        let mut handles = Vec::new();
        // Each peer's part is in `s` as soon as it exists, so a failure undoes all of it.
        let mut add = |s: &mut Staged, p: usize| -> Result<()> {
            let l = local.iter().position(|&r| r == p).ok_or_else(|| Error::internal("Staged::setup", "peer not in the node"))?;
            let area = take(p)?;
            let area_dev = dev.map_host(area.area().0, area.area().1)?;
            s.peers[p] = Some(Peer { local: l, area, area_dev, ring_in: DevPtr::NULL, ring_out: DevPtr::NULL, ring_out_len: 0, lane: None, sent: 0, received: 0 });
            let ring = dev.alloc(slots * slot)?;
            if let Some(peer) = s.peers[p].as_mut() {
                peer.ring_in = ring;
            }
            let a = dev.allocation(ring)?;
            handles.push((p, dev.export(&a)?, a.len));
            Ok(())
        };
        for &p in others {
            if let Err(e) = add(&mut s, p) {
                s.teardown(true);
                return Err(e);
            }
        }
        Ok((s, handles))
    }

    /// Import the rings the peers made for this rank and make the staged queues.
    fn import(&mut self, all: &[Vec<u8>], rank: usize) -> Result<()> {
        for (p, peer) in self.peers.iter_mut().enumerate() {
            let Some(peer) = peer.as_mut() else { continue };
            let r = all.get(p).filter(|r| r.len() > (rank + 1) * REC).ok_or_else(|| Error::internal("Staged::setup", format!("rank {p} sent a short record")))?;
            let mut h = [0u8; 64];
            h.copy_from_slice(&r[1 + rank * REC..1 + rank * REC + 64]);
            let len = u64::from_le_bytes(r[1 + rank * REC + 64..1 + (rank + 1) * REC].try_into().unwrap_or_default()) as usize;
            if len < self.slots * self.slot {
                return Err(Error::internal("Staged::setup", format!("rank {p}'s ring for this rank is {len} bytes, want {}", self.slots * self.slot)));
            }
            peer.ring_out = self.dev.import(&ExportHandle(h), len)?;
            peer.ring_out_len = len;
            let queue = self.dev.create_copy_queue()?;
            let lane = Lane::new(queue, peer.area.clone(), peer.area_dev, self.me_local, Copied::take(self.dev.as_ref())?, self.slots as u64);
            peer.lane = Some(Arc::new(Mutex::new(lane)));
        }
        Ok(())
    }

    /// Whether a transfer goes the staged way, given the staged chunks already taken with
    /// its peer in this call; both ranks of a pair decide alike (the same setting and ring,
    /// the same peer table, the pair's transfers of a call in the same order, the length
    /// checked by announcement).
    fn eligible(&self, x: &Transfer, taken: &[u64]) -> bool {
        x.len <= self.max
            && x.fill == Fill::Exact
            && self.peers.get(x.peer).is_some_and(Option::is_some)
            && taken.get(x.peer).is_some_and(|t| t + self.chunks(x.len) <= STAGED_CALL_CHUNKS)
    }

    /// Move the staged transfers out of `sends` and `recvs` (the rest keeps its order): those
    /// eligible, up to [`STAGED_CALL_CHUNKS`] chunks per peer and direction in the call.
    pub fn split(&self, sends: &mut Vec<Transfer>, recvs: &mut Vec<Transfer>) -> Taken {
        let mut t = Taken::default();
        if self.broken {
            return t;
        }
        for (list, out) in [(sends, &mut t.sends), (recvs, &mut t.recvs)] {
            let mut taken = vec![0u64; self.peers.len()];
            list.retain(|x| {
                if !self.eligible(x, &taken) {
                    return true;
                }
                taken[x.peer] += self.chunks(x.len);
                out.push(*x);
                false
            });
        }
        t
    }

    fn chunks(&self, len: usize) -> u64 {
        len.div_ceil(self.slot) as u64
    }

    /// For an op that the proxy moves nothing of (`all_staged`: every transfer of it is in
    /// `taken`): what its stream waits on instead of the handshake's `finish`, so that it
    /// completes without the proxy. Receives need nothing: the stream's own copies out of
    /// the slots order the data before the work after the call. Sends need their bytes out
    /// of the send buffers: per receiver, the `copied` word at the op's last chunk to it.
    /// None (the stream waits for `finish`) when nothing of the op is staged, or when a
    /// receiver's queue cannot take all of the op's entries at the call: held-back entries
    /// are the proxy's to enqueue, and a failure drops them, so the queue's writes could
    /// never reach such a target. Callers hold the communicator's lock until
    /// [`Staged::enqueue_sends`], so the answer still holds there.
    pub fn direct_waits(&self, taken: &Taken, all_staged: bool) -> Option<Vec<(DevPtr, u64)>> {
        if !all_staged || (taken.sends.is_empty() && taken.recvs.is_empty()) {
            return None;
        }
        let mut peers: Vec<usize> = taken.sends.iter().map(|x| x.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let mut waits = Vec::with_capacity(peers.len());
        for p in peers {
            let peer = self.peers.get(p)?.as_ref()?;
            let mut l = peer.lane.as_ref()?.lock().ok()?;
            // The op's entries on this queue: one start wait, then its copies.
            let (mut sent, mut cost) = (peer.sent, 1);
            for x in taken.sends.iter().filter(|x| x.peer == p) {
                let n = self.chunks(x.len);
                cost += copies(sent, n, self.slots as u64).map(|(g, k, _)| l.chunk_cost(g + k - 1)).sum::<u64>();
                sent += n;
            }
            if sent == peer.sent {
                continue;
            }
            if !l.fits(cost) {
                return None;
            }
            waits.push(l.copied.as_ref()?.at(sent));
        }
        Some(waits)
    }

    /// Receiver, at the call, on the user's stream after its `write start`, through the
    /// stream's batch: per run of slots ([`copies`]), wait for the sender's `staged` (and
    /// for the chunk before to have drained), copy the slots out, write `drained`. The waits
    /// and the write between two copies are one driver call: a receive of `n` runs costs `n`
    /// copies and `n` runs of memory operations, the first joined to the handshake's `write start`, the
    /// last's write to the stream's completion wait, if any. Returns one wait per receive
    /// for the proxy (`hop`: the stream waits for the proxy's `finish`). On a failure,
    /// [`Staged::abandon`] has run.
    pub fn enqueue_recvs(&mut self, b: &mut Batch<OnStream<'_>>, recvs: &[Transfer], hop: bool, out: &mut Vec<StagedWait>) -> Result<()> {
        for (i, x) in recvs.iter().enumerate() {
            let k = recvs[..i].iter().filter(|y| y.peer == x.peer).count() as u32;
            let n = self.chunks(x.len);
            let (slots, slot, own_dev) = (self.slots as u64, self.slot, self.own_dev);
            let peer = peer_mut(&mut self.peers, x.peer)?;
            let (staged, drained) = (own_dev.add(Segment::staged_offset(peer.local)), own_dev.add(Segment::drained_offset(peer.local)));
            for (first, k, c) in copies(peer.received, n, slots) {
                let last = first + k - 1;
                let off = c as usize * slot;
                let len = (k as usize * slot).min(x.len - off);
                // Chunks of a direction drain in order, over all of this rank's streams:
                // `drained` then only grows, and a slot is free once it says so.
                let r = b
                    .wait_geq(staged, last)
                    .and_then(|_| b.wait_geq(drained, first - 1))
                    .and_then(|_| b.copy(x.ptr.add(off), peer.ring_in.add(((first - 1) % slots) as usize * slot), len))
                    .and_then(|_| b.write(drained, last));
                if let Err(e) = r {
                    self.abandon(recvs);
                    return Err(e);
                }
                peer.received = last;
            }
            let area = self.own.clone();
            let peer = self.peer(x.peer)?;
            out.push(StagedWait {
                peer: x.peer,
                k,
                len: x.len as u64,
                send: false,
                area,
                word: Segment::drained_offset(peer.local),
                target: peer.received,
                release: Some(Segment::staged_offset(peer.local)),
                lane: None,
                hop,
            });
        }
        Ok(())
    }

    /// After a failed enqueue of `recvs` (here, or of the rest of their call: their last
    /// operations may not be on the stream): release every wait the stream may hold for
    /// them (this rank's `staged` and `drained` words of their senders, which also releases
    /// those senders' queues), and stop staging: this rank's chunk counts may differ from
    /// the peers' from then on.
    pub fn abandon(&mut self, recvs: &[Transfer]) {
        for x in recvs {
            if let Some(Some(p)) = self.peers.get(x.peer) {
                self.own.word(Segment::staged_offset(p.local)).fetch_max(RELEASED, Ordering::AcqRel);
                self.own.word(Segment::drained_offset(p.local)).fetch_max(RELEASED, Ordering::AcqRel);
            }
        }
        self.broken = true;
    }

    /// Sender, at the call, after the handshake was enqueued: on each receiver's staged
    /// queue, a wait for the stream's `start >= start_value`, then per run of slots
    /// ([`copies`]) a wait for them to be free, the copy into them, `write copied := base +
    /// g` and `write staged := g` (its last chunk);
    /// what does not fit the queue's budget ([`STAGED_QUEUE_ENTRIES`]) is held back for the
    /// proxy. `hop`: the stream waits for the proxy's `finish`; without it the stream waits
    /// on the `copied` words ([`Staged::direct_waits`]), which promised that nothing is held
    /// back. Returns one wait per send.
    pub fn enqueue_sends(&mut self, start_flag: DevPtr, start_value: u64, sends: &[Transfer], hop: bool, out: &mut Vec<StagedWait>) -> Result<()> {
        let (slots, slot, me) = (self.slots as u64, self.slot, self.me_local);
        // Receivers whose queue already waits for this call's start.
        let mut started: Vec<usize> = Vec::new();
        for (i, x) in sends.iter().enumerate() {
            let k = sends[..i].iter().filter(|y| y.peer == x.peer).count() as u32;
            let n = self.chunks(x.len);
            let wait_start = n > 0 && !started.contains(&x.peer);
            if wait_start {
                started.push(x.peer);
            }
            let peer = self.peer(x.peer)?;
            let Some(lane) = peer.lane.clone() else { return Err(Error::internal("Staged::enqueue_sends", format!("no staged queue to rank {}", x.peer))) };
            let mut l = lane.lock().map_err(|_| Error::internal("Staged::enqueue_sends", "staged queue lock poisoned"))?;
            let mut sent = peer.sent;
            let mut enqueue = || -> Result<()> {
                let mut held = false;
                if wait_start {
                    held |= l.submit(Entry::Start { flag: start_flag, value: start_value })?;
                }
                for (first, k, c) in copies(sent, n, slots) {
                    let off = c as usize * slot;
                    let len = (k as usize * slot).min(x.len - off);
                    held |= l.submit(Entry::Chunk { g: first + k - 1, dst: peer.ring_out.add(((first - 1) % slots) as usize * slot), src: x.ptr.add(off), len })?;
                    sent = first + k - 1;
                }
                if held && !hop {
                    // Cannot happen: callers hold the communicator's lock, and the proxy only
                    // moves held-back entries onto the queue. The stream's wait on `copied`
                    // then depends on the proxy's flush, as a held-back send's `finish` does.
                    log::error!("hoccl: staged entries for rank {} held back although the queue had room at the call", x.peer);
                }
                l.commit()
            };
            let r = enqueue();
            drop(l);
            peer.sent = sent;
            if let Err(e) = r {
                self.broken = true;
                if !hop {
                    // The stream waits on the `copied` words of the op's receivers, which
                    // the queues may now never reach: raise them (the end of the
                    // communicator, not clean after this, raises them once more).
                    for p in sends.iter().filter_map(|y| self.peers.get(y.peer)?.as_ref()?.lane.as_ref()) {
                        p.lock().unwrap_or_else(|e| e.into_inner()).release(false);
                    }
                }
                return Err(e);
            }
            let peer = self.peer(x.peer)?;
            out.push(StagedWait { peer: x.peer, k, len: x.len as u64, send: true, area: peer.area.clone(), word: Segment::staged_offset(me), target: peer.sent, release: None, lane: Some(lane), hop });
        }
        Ok(())
    }

    fn peer(&mut self, p: usize) -> Result<&mut Peer> {
        peer_mut(&mut self.peers, p)
    }

    /// Whether every chunk queued or expected has moved: the sends' `staged` words and the
    /// receives' `drained` words reached the counts.
    pub fn quiet(&self) -> bool {
        !self.broken
            && self.peers.iter().flatten().all(|p| {
                p.area.word(Segment::staged_offset(self.me_local)).load(Ordering::Acquire) >= p.sent && self.own.word(Segment::drained_offset(p.local)).load(Ordering::Acquire) >= p.received
            })
    }

    /// At the communicator's end. When the path is quiet, destroy the queues, close the
    /// imports, free the rings and unregister the flag areas; otherwise a queue or a stream
    /// may still wait and later copy through them: leave everything in place until the
    /// process exits (logged).
    /// `clean`: no op of the communicator failed (a failure may have released flags, which
    /// makes the counts say nothing).
    pub fn close(mut self, clean: bool) {
        let clean = clean && self.quiet();
        self.teardown(clean);
    }

    fn teardown(&mut self, clean: bool) {
        if !clean {
            log::warn!("hoccl: staged transfers still pending at the communicator's end (after a failure): their queues, rings and flag registrations stay in place until the process exits");
            // Last release of every wait (the proxy repeated it until now): the streams'
            // chunk waits on this rank's words, the queues' slot waits on the peers'.
            for p in self.peers.drain(..).flatten() {
                self.own.word(Segment::staged_offset(p.local)).fetch_max(RELEASED, Ordering::AcqRel);
                self.own.word(Segment::drained_offset(p.local)).fetch_max(RELEASED, Ordering::AcqRel);
                if let Some(l) = &p.lane {
                    l.lock().unwrap_or_else(|e| e.into_inner()).release(true);
                }
                std::mem::forget(p);
            }
            std::mem::forget(self.own.clone());
            return;
        }
        let dev = self.dev.clone();
        let warn = |what: &str, r: Result<()>| {
            if let Err(e) = r {
                log::warn!("hoccl: staged teardown: {what}: {e}");
            }
        };
        let key = (dev.backend(), dev.ordinal());
        for p in self.peers.drain(..).flatten() {
            if let Some(lane) = p.lane {
                let copied = lane.lock().ok().and_then(|mut l| l.copied.take());
                match copied {
                    // Nothing else can enqueue on the queue any more: the word's count is final.
                    Some(c) if Arc::strong_count(&lane) == 1 => c.give_back(key, p.sent),
                    Some(c) => std::mem::forget(c.slab),
                    None => {}
                }
            }
            if !p.ring_out.is_null() {
                warn("closing a peer's ring", dev.unimport(p.ring_out, p.ring_out_len));
            }
            if !p.ring_in.is_null() {
                warn("freeing a ring", dev.free(p.ring_in));
            }
            if !p.area_dev.is_null() {
                warn("unregistering a peer's flags", dev.unmap_host(p.area.area().0));
            }
        }
        if !self.own_dev.is_null() {
            warn("unregistering the own flags", dev.unmap_host(self.own.area().0));
            self.own_dev = DevPtr::NULL;
        }
    }
}

fn peer_mut(peers: &mut [Option<Peer>], p: usize) -> Result<&mut Peer> {
    peers.get_mut(p).and_then(Option::as_mut).ok_or_else(|| Error::internal("Staged", format!("rank {p} is not reached by staged transfers")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn until(what: &str, f: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A staged queue whose head waits takes entries up to its budget and holds the rest
    /// back; `flush` enqueues them, in order, as the queue runs (here a receiver that drains
    /// every chunk at once), and each chunk's `copied` write precedes its `staged` write.
    /// After a failure the held-back entries are dropped and `copied` is raised; raising
    /// the receiver's `drained` word lets a queue waiting for a slot run to its end, whose
    /// last `copied` write stands; a released queue still takes what fits.
    #[test]
    fn lane_budget_flush_and_release() {
        let dev: Arc<dyn Device> = Arc::new(crate::device::host::HostDevice::new().unwrap());
        let name = format!("/hoccl.{}.ctl.test{}.0", std::process::id(), line!());
        let _seg = Segment::create(&name, 2).unwrap();
        let area = Arc::new(FlagArea::open(&name, 2).unwrap());
        let area_dev = dev.map_host(area.area().0, area.area().1).unwrap();
        let (slots, slot) = (4u64, 4096usize);
        let ring = dev.alloc(slots as usize * slot).unwrap();
        let src = dev.alloc(slot).unwrap();
        let start = dev.alloc_flags(1).unwrap();
        let lane = |area: &Arc<FlagArea>| Lane::new(dev.create_copy_queue().unwrap(), area.clone(), area_dev, 0, Copied::take(dev.as_ref()).unwrap(), slots);
        let chunk = |g: u64| Entry::Chunk { g, dst: ring.add(((g - 1) % slots) as usize * slot), src, len: slot };
        let (staged, drained) = (area.word(Segment::staged_offset(0)), area.word(Segment::drained_offset(0)));

        let mut l = lane(&area);
        assert!(!l.submit(Entry::Start { flag: start.dev_addr(0), value: 1 }).unwrap());
        let n = 200u64;
        let held = (1..=n).map(|g| l.submit(chunk(g)).unwrap()).filter(|h| *h).count() as u64;
        l.commit().unwrap();
        assert!(l.holds() && held > 0, "{n} chunks behind a waiting head were all enqueued");
        assert!(l.entries <= STAGED_QUEUE_ENTRIES, "{} entries enqueued, budget {STAGED_QUEUE_ENTRIES}", l.entries);
        assert!(!l.flush().unwrap(), "the full queue took more");
        start.store(0, 1);
        // The receiver drains each chunk as it lands.
        let t0 = Instant::now();
        while staged.load(Ordering::Acquire) < n {
            drained.fetch_max(staged.load(Ordering::Acquire), Ordering::AcqRel);
            l.flush().unwrap();
            assert!(l.outstanding() <= STAGED_QUEUE_ENTRIES);
            assert!(t0.elapsed() < Duration::from_secs(10), "stuck at chunk {}", staged.load(Ordering::Acquire));
        }
        assert!(!l.holds());
        let copied = |l: &Lane| l.copied.as_ref().map(|c| (c.slab.load(c.idx), c.base)).unwrap();
        let (v, base) = copied(&l);
        assert_eq!(v, base + n, "the copied word after {n} chunks");
        drained.store(n, Ordering::Release);

        // The receiver stops draining: the queue waits for a slot, the rest is held back.
        let more = n + 2 * STAGED_QUEUE_ENTRIES;
        let held = (n + 1..=more).map(|g| l.submit(chunk(g)).unwrap()).filter(|h| *h).count();
        l.commit().unwrap();
        assert!(held > 0);
        until("the queue to fill the ring", || staged.load(Ordering::Acquire) == n + slots);
        let last = l.marks.back().map(|m| m.0).unwrap();
        assert_eq!(copied(&l).0, base + n + slots);
        l.release(false);
        assert!(copied(&l).0 >= RELEASED, "the release did not raise the copied word");
        assert!(!l.holds() && !l.submit(chunk(more + 1)).unwrap() && !l.holds(), "entries kept after the release");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(staged.load(Ordering::Acquire), n + slots, "the queue passed a slot wait unreleased");
        l.release(true);
        until("the released queue to run to its end", || staged.load(Ordering::Acquire) == last);
        until("the queue's last copied write", || copied(&l).0 == base + last);
        // Released, with room: the entry is enqueued (a direct op's stream waits for it).
        let entries = l.entries;
        assert!(!l.submit(chunk(more + 2)).unwrap() && l.entries > entries, "a released queue with room refused an entry");
        l.commit().unwrap();
        until("the entry on the released queue", || staged.load(Ordering::Acquire) == more + 2 && copied(&l).0 == base + more + 2);
        drop(l);
        dev.unmap_host(area.area().0).unwrap();
        dev.free(ring).unwrap();
        dev.free(src).unwrap();
    }

    /// A transfer's runs of slots cover its chunks in order, each within the ring and at
    /// most half of it; a transfer of half the ring that starts at a run boundary is one copy.
    #[test]
    fn copies_cover_chunks_in_runs() {
        let runs = |prev, n, slots| copies(prev, n, slots).collect::<Vec<_>>();
        assert_eq!(runs(0, 4, 8), [(1, 4, 0)]);
        assert_eq!(runs(4, 4, 8), [(5, 4, 0)]);
        assert_eq!(runs(6, 4, 8), [(7, 2, 0), (9, 2, 2)]);
        assert_eq!(runs(0, 16, 8), [(1, 4, 0), (5, 4, 4), (9, 4, 8), (13, 4, 12)]);
        assert_eq!(runs(3, 2, 1), [(4, 1, 0), (5, 1, 1)]);
        assert!(runs(9, 0, 8).is_empty());
        for slots in 1..=9u64 {
            for prev in 0..2 * slots {
                for n in 0..=20u64 {
                    let (mut next, mut c) = (prev + 1, 0);
                    for (g, k, at) in copies(prev, n, slots) {
                        assert!(g == next && at == c && k >= 1 && k <= (slots / 2).max(1), "{slots} slots, after {prev}, {n} chunks: run ({g}, {k}, {at})");
                        assert!((g - 1) % slots + k <= slots, "run ({g}, {k}) crosses the end of a ring of {slots}");
                        next += k;
                        c += k;
                    }
                    assert_eq!(c, n, "{slots} slots, after {prev}: {n} chunks");
                }
            }
        }
    }

    /// A `copied` word returns to the pool with its count when the queue wrote its last
    /// chunk, and the next user counts on from there; a word whose count is not final (or
    /// was raised) never returns.
    #[test]
    fn copied_words_pool() {
        let dev = crate::device::host::HostDevice::new().unwrap();
        let key = (dev.backend(), dev.ordinal());
        let pooled = |slab: &Arc<FlagSlab>, idx: usize| COPIED_POOL.lock().unwrap().iter().find(|p| Arc::ptr_eq(&p.slab, slab) && p.idx == idx).map(|p| p.value);
        let c = Copied::take(&dev).unwrap();
        let (slab, idx, base) = (c.slab.clone(), c.idx, c.base);
        assert_eq!(c.at(5), (slab.dev_addr(idx), base + 5));
        slab.store(idx, base + 5);
        c.give_back(key, 5);
        assert_eq!(pooled(&slab, idx), Some(base + 5), "a final count did not return to the pool");
        // Take that very word back (the pool is shared by the tests of this process).
        let c = {
            let mut pool = COPIED_POOL.lock().unwrap();
            let i = pool.iter().position(|p| Arc::ptr_eq(&p.slab, &slab) && p.idx == idx).unwrap();
            let p = pool.swap_remove(i);
            Copied { slab: p.slab, idx: p.idx, base: p.value }
        };
        assert_eq!(c.at(1).1, base + 6, "the next user does not count on");
        slab.store(idx, base + 6);
        c.give_back(key, 2);
        assert_eq!(pooled(&slab, idx), None, "a word whose queue has a write pending returned to the pool");
        let c = Copied::take(&dev).unwrap();
        let (slab, idx) = (c.slab.clone(), c.idx);
        c.raise();
        c.give_back(key, 0);
        assert_eq!(pooled(&slab, idx), None, "a raised word returned to the pool");
    }

    /// A released word passes every chunk wait: the 64-bit cyclic `>=` and the 32-bit
    /// fallback's comparison of the low halves, for chunk numbers up to 2^30.
    #[test]
    fn released_passes_every_wait() {
        for g in [0u64, 1, 7, 1 << 20, (1 << 30) - 1, 1 << 30] {
            assert!((RELEASED.wrapping_sub(g) as i64) >= 0, "64-bit, chunk {g}");
            assert!(((RELEASED as u32).wrapping_sub(g as u32) as i32) >= 0, "32-bit, chunk {g}");
        }
    }
}

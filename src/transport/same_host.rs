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
use crate::device::{DevPtr, Device};
use crate::error::{Error, Result};
use crate::transport::chunk_scheduler::ChunkScheduler;
use crate::transport::ipc::{ExportCache, ImportCache, Mapped};
use crate::transport::mailbox::{pid_alive, Msg, MsgKind, Segment};
use crate::transport::{FlowId, Incoming, Region, RemoteBuffer, Signal, Tag, Transport, Wire};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// By global rank: why a record from that rank was refused (`peer_health` reports it,
    /// so the ops that wait on the rank fail).
    malformed: Vec<Option<String>>,
}

impl SameHost {
    /// Make `copy_queues` copy queues on `dev` (from the proxy thread, bound to the device)
    /// and take over the mailboxes.
    pub fn connect(dev: Arc<dyn Device>, links: Links, copy_queues: usize, chunk_bytes: usize) -> Result<SameHost> {
        let queues = (0..copy_queues).map(|_| dev.create_copy_queue()).collect::<Result<Vec<_>>>()?;
        let mut global_of_local = vec![usize::MAX; links.local_of.iter().flatten().count()];
        for (g, l) in links.local_of.iter().enumerate() {
            if let Some(l) = l {
                global_of_local[*l] = g;
            }
        }
        let pid = std::process::id();
        let in_process = links.peers.iter().map(|p| p.as_ref().is_some_and(|seg| seg.owner_pid() == pid)).collect();
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
            malformed: Vec::new(),
        })
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

/// The signal a mailbox record carries, or why the record is malformed. A record comes from
/// shared memory another process writes: nothing in it is used before this check.
fn signal_of(m: &Msg) -> std::result::Result<Signal, String> {
    let kind = m.kind().ok_or_else(|| format!("unknown record kind {}", m.kind))?;
    if kind == MsgKind::Ready {
        check_announced(m.offset, m.len, m.alloc_len).map_err(|e| format!("Ready for op {}: {e}", m.seq))?;
    }
    Ok(match kind {
        MsgKind::Ready => Signal::Ready {
            k: m.k,
            remote: RemoteBuffer {
                len: m.len,
                wire: Wire { alloc_id: m.alloc_id, alloc_len: m.alloc_len, base: m.base, offset: m.offset, pid: m.pid, handle: m.handle },
            },
        },
        MsgKind::Landed => Signal::Landed { k: m.k, len: m.len },
        MsgKind::Fail => Signal::Failed { code: m.code },
        MsgKind::Progress => Signal::Progress { k: m.k },
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
        let mut wire = Wire::empty(std::process::id());
        if let Some(a) = region.alloc {
            // A sender in this process writes to the buffer's own address: no IPC export
            // (a driver call on the allocation) is needed for it.
            if !self.in_process.get(peer).copied().unwrap_or(false) {
                wire.handle = self.exports.get(self.dev.as_ref(), &a)?.0;
            }
            wire.alloc_id = a.id;
            wire.alloc_len = a.len as u64;
            wire.base = a.base.0;
            wire.offset = region.ptr.0 - a.base.0;
        }
        Ok(RemoteBuffer { len: region.len as u64, wire })
    }

    fn post_ready(&mut self, peer: usize, tag: Tag, remote: RemoteBuffer) {
        let mut m = Msg::new(MsgKind::Ready, tag.pair_seq, tag.k);
        let w = remote.wire;
        m.len = remote.len;
        (m.alloc_id, m.alloc_len, m.base, m.offset, m.pid, m.handle) = (w.alloc_id, w.alloc_len, w.base, w.offset, w.pid, w.handle);
        self.post(peer, m);
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
                match signal_of(&m) {
                    Ok(signal) => out.push(Incoming { from, pair_seq: m.seq, signal }),
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
        any
    }

    fn start_write(&mut self, id: FlowId, peer: usize, tag: Tag, src: DevPtr, remote: &RemoteBuffer, len: usize) -> Result<()> {
        const OP: &str = "same-host transport";
        check_announced(remote.wire.offset, len as u64, remote.wire.alloc_len).map_err(|what| Error::Remote { op: OP, peer, what })?;
        let (mapped, dst) = if len == 0 {
            (None, DevPtr(0))
        } else {
            let m = self.imports.acquire(self.dev.as_ref(), peer, &remote.wire)?;
            (Some(m), m.base.add(remote.wire.offset as usize))
        };
        self.flows.insert(id, Flow { landing: (peer, tag, len as u64), mapped, cancelled: false, told: Instant::now() });
        self.sched.add(id, src, dst, len);
        Ok(())
    }

    fn progress(&mut self, done: &mut Vec<FlowId>, advanced: &mut Vec<u64>) -> std::result::Result<bool, (u64, Error)> {
        if self.sched.is_idle() {
            return Ok(self.flush());
        }
        let (mut finished, mut moved) = (std::mem::take(&mut self.finished), std::mem::take(&mut self.advanced));
        finished.clear();
        moved.clear();
        let polled = self.sched.poll(&mut finished, &mut moved);
        let mut progressed = matches!(polled, Ok(true));
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
        progressed |= self.flush();
        polled.map(|_| progressed)
    }

    fn cancel(&mut self, seq: u64) {
        self.sched.cancel(seq);
        for (id, f) in self.flows.iter_mut() {
            if id.seq == seq {
                f.cancelled = true;
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

    fn data_in_flight(&self) -> bool {
        !self.sched.is_idle()
    }

    fn signals_queued(&self) -> bool {
        !self.outbox.is_empty()
    }

    fn describe(&self) -> String {
        format!("{}; {} signals queued out", self.sched.describe(), self.outbox.len())
    }

    fn close(&mut self) {
        // Last signals (failures at an abort) go out if the rings have room.
        self.flush();
        self.imports.clear(self.dev.as_ref());
        self.links.inbox.mark_closed();
    }
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
        let t0 = SameHost::connect(dev.clone(), l0, 2, 4096).unwrap();
        let t1 = SameHost::connect(dev.clone(), l1, 2, 4096).unwrap();
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

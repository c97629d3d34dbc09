//! Stream manager: two host-visible 64-bit flags per user stream. The protocol is the
//! paper's handshake with monotonic sequence numbers instead of resets:
//!
//! ```text
//!   stream:  write start := s      ; wait finish >= s      ; (work after the call)
//!   proxy:   sees start >= s → moves the bytes → writes finish := s
//! ```
//!
//! Nothing is ever reset, so several ops of one stream can be enqueued at once; the stream
//! itself serialises them (op s+1's start is written only after op s's finish). Work before
//! the call completes before start is written; work after the call waits for finish.
//!
//! An op that the proxy moves nothing of (every transfer staged, `transport::staged`) waits
//! on other words instead of `finish` (or on none): its stream then passes it without the
//! proxy, and op s+1's start may be written before the proxy wrote op s's finish. Finish
//! flags only ever rise (`FlagSlab::raise`), so a late finish store never lowers them.
use crate::device::batch::{Batch, OnStream};
use crate::device::{Backend, DevPtr, Device, FlagSlab, StreamHandle};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Flags per slab (two per stream).
const SLAB_FLAGS: usize = 64;

struct Slot {
    slab: Arc<FlagSlab>,
    start: usize,
    seq: u64,
}

/// Flag pairs outlive communicators. After a communicator is gone, a stream may still have
/// to execute the wait of its last op (queued behind the user's work); the memory must stay
/// mapped and its value must never drop below that wait's target. So pairs are never freed:
/// a clean teardown returns them here with their last sequence number, and the next user
/// continues counting from it. The user's streams are never queried or touched.
struct PooledPair {
    key: (Backend, usize),
    slab: Arc<FlagSlab>,
    start: usize,
    seq: u64,
}

static POOL: Mutex<Vec<PooledPair>> = Mutex::new(Vec::new());

#[derive(Default)]
pub struct StreamManager {
    slots: HashMap<StreamHandle, Slot>,
    /// Slab with free pairs, and the next free index in it.
    current: Option<(Arc<FlagSlab>, usize)>,
    /// Every slab ever made (kept until the communicator is torn down).
    slabs: Vec<Arc<FlagSlab>>,
}

/// How many streams may wait at once (see [`Admission`]), process-wide: one entry per flag
/// pair whose stream has a wait enqueued that its finish flag has not released yet.
struct Waiter {
    key: (Backend, usize),
    stream: StreamHandle,
    slab: Arc<FlagSlab>,
    finish: usize,
    target: u64,
}

static WAITERS: Mutex<Vec<Waiter>> = Mutex::new(Vec::new());
static WARNED: AtomicBool = AtomicBool::new(false);

/// The limit on streams that wait for collectives at once, per GPU, in this process. A
/// stream blocked in a wait holds one of the context's hardware queues; when every queue is
/// held, the driver blocks further enqueues and the copies that would release the waits do
/// not run (on the H200, as many waiting streams as the context has queues stop the copies,
/// whether one process holds them all or one rank per process does). A collective on a stream that is not
/// already waiting, when `max` others are, blocks the calling thread until one is released.
pub struct Admission<'a> {
    pub max: usize,
    pub timeout: Duration,
    /// Checked while blocked: the communicator's abort or asynchronous error ends the wait.
    pub stop: &'a dyn Fn() -> Option<Error>,
}

/// What shares hardware queues: a CUDA context (one per GPU in a process: the primary
/// context); each host-backend device has its own, never confused with a dropped one.
fn context_key(dev: &dyn Device) -> (Backend, usize) {
    dev.queue_domain()
}

/// After dropping released entries: how many distinct streams of `key` wait (targets not
/// reached), and whether `stream` is one of them. (A few entries: no allocation per call.)
fn waiting_streams(w: &mut Vec<Waiter>, key: (Backend, usize), stream: StreamHandle) -> (usize, bool) {
    w.retain(|e| e.slab.load(e.finish) < e.target);
    let (mut n, mut this) = (0, false);
    for (i, e) in w.iter().enumerate() {
        if e.key == key && !w[..i].iter().any(|p| p.key == key && p.stream == e.stream) {
            n += 1;
            this |= e.stream == stream;
        }
    }
    (n, this)
}

/// Record that `stream` waits until flag `finish` of `slab` reaches `target` (a target the
/// flag has reached withdraws the entry).
fn record(w: &mut Vec<Waiter>, key: (Backend, usize), stream: StreamHandle, slab: &Arc<FlagSlab>, finish: usize, target: u64) {
    match w.iter_mut().find(|e| Arc::ptr_eq(&e.slab, slab) && e.finish == finish) {
        Some(e) => e.target = target,
        None => w.push(Waiter { key, stream, slab: slab.clone(), finish, target }),
    }
}

/// With a limit, wait until `stream` is already waiting or fewer than the limit of other
/// streams are, then record its new wait (see [`record`]).
fn admit(key: (Backend, usize), stream: StreamHandle, slab: &Arc<FlagSlab>, finish: usize, target: u64, op: &'static str, adm: &Admission) -> Result<()> {
    if adm.max == usize::MAX {
        return Ok(());
    }
    let deadline = Instant::now() + adm.timeout;
    loop {
        let others = {
            let mut w = WAITERS.lock().map_err(|_| Error::internal(op, "waiting-stream registry poisoned"))?;
            let (waiting, this) = waiting_streams(&mut w, key, stream);
            if this || waiting < adm.max {
                record(&mut w, key, stream, slab, finish, target);
                return Ok(());
            }
            waiting
        };
        if let Some(e) = (adm.stop)() {
            return Err(e);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                op,
                after: adm.timeout,
                what: format!(
                    "{others} other streams of this process already wait for collectives on this GPU, the most allowed at once \
                     (HOCCL_MAX_WAITING_STREAMS = {}; each holds one of the context's hardware queues), and none was released",
                    adm.max
                ),
            });
        }
        if !WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "hoccl: {op}: {others} streams already wait for collectives on this GPU (HOCCL_MAX_WAITING_STREAMS = {}): \
                 the call waits until one is released (use fewer streams for collectives; logged once)",
                adm.max
            );
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Withdraw this process's waiting-stream entries on `slabs` (a communicator's teardown).
fn forget_waiters(slabs: &[Arc<FlagSlab>]) {
    if let Ok(mut w) = WAITERS.lock() {
        w.retain(|e| !slabs.iter().any(|s| Arc::ptr_eq(s, &e.slab)));
    }
}

/// The handshake enqueued for one op.
pub struct Handshake {
    pub flags: Arc<FlagSlab>,
    pub start_flag: usize,
    pub finish_flag: usize,
    pub stream_seq: u64,
}

impl StreamManager {
    /// Enqueue `write start := s; the copies in local; what between enqueues; wait finish >=
    /// s` on `stream` and return the flags. `local` (dst, src, len) are this rank's copies to
    /// itself: on the caller's stream they run beside the proxy's transfers, on the stream's
    /// copy engine. `between` enqueues more work on `stream` through the batch (the staged
    /// path's receives); when it or any other part fails the handshake is not submitted.
    /// `direct`: the op's completion does not need the proxy (the staged path's
    /// `Staged::direct_waits`): the stream waits for each (word, value) of it instead of
    /// `finish`. The proxy still writes `finish` when it has seen the op complete, which
    /// the waiting-stream limit counts by. With `adm`'s limit reached by other streams,
    /// first blocks until one is released.
    ///
    /// The waits and writes between two copies go to the driver in one call (`Batch`): an
    /// op with no copy on the stream is one call, start and finish together.
    pub fn enqueue_with(
        &mut self,
        dev: &dyn Device,
        stream: StreamHandle,
        op: &'static str,
        local: &[(DevPtr, DevPtr, usize)],
        between: &mut dyn FnMut(&mut Batch<OnStream<'_>>) -> Result<()>,
        direct: Option<&[(DevPtr, u64)]>,
        adm: &Admission,
    ) -> Result<Handshake> {
        if !self.slots.contains_key(&stream) {
            let (slab, idx, seq) = self.take_pair(dev)?;
            self.slots.insert(stream, Slot { slab, start: idx, seq });
        }
        let key = context_key(dev);
        let slot = self.slots.get_mut(&stream).ok_or_else(|| Error::internal(op, "stream slot vanished"))?;
        let s = slot.seq + 1;
        admit(key, stream, &slot.slab, slot.start + 1, s, op, adm)?;
        let mut b = Batch::new(OnStream { dev, stream });
        let enqueued = b
            .write(slot.slab.dev_addr(slot.start), s)
            .and_then(|_| local.iter().try_for_each(|&(dst, src, len)| b.copy(dst, src, len)))
            .and_then(|_| between(&mut b))
            .and_then(|_| match direct {
                None => b.wait_geq(slot.slab.dev_addr(slot.start + 1), s),
                Some(waits) => waits.iter().try_for_each(|&(word, value)| b.wait_geq(word, value)),
            })
            .and_then(|_| b.flush());
        if let Err(e) = enqueued {
            // Not submitted: the stream waits for no more than before.
            if adm.max != usize::MAX {
                if let Ok(mut w) = WAITERS.lock() {
                    record(&mut w, key, stream, &slot.slab, slot.start + 1, slot.seq);
                }
            }
            return Err(e.with_op(op));
        }
        slot.seq = s;
        Ok(Handshake { flags: slot.slab.clone(), start_flag: slot.start, finish_flag: slot.start + 1, stream_seq: s })
    }

    /// [`Self::enqueue_with`] with nothing between.
    #[cfg(test)]
    fn enqueue(&mut self, dev: &dyn Device, stream: StreamHandle, op: &'static str, local: &[(DevPtr, DevPtr, usize)], adm: &Admission) -> Result<Handshake> {
        self.enqueue_with(dev, stream, op, local, &mut |_| Ok(()), None, adm)
    }

    fn take_pair(&mut self, dev: &dyn Device) -> Result<(Arc<FlagSlab>, usize, u64)> {
        let key = (dev.backend(), dev.ordinal());
        if let Ok(mut pool) = POOL.lock() {
            if let Some(i) = pool.iter().position(|p| p.key == key) {
                let p = pool.swap_remove(i);
                self.slabs.push(p.slab.clone());
                return Ok((p.slab, p.start, p.seq));
            }
        }
        self.take_new_pair(dev).map(|(slab, i)| (slab, i, 0))
    }

    fn take_new_pair(&mut self, dev: &dyn Device) -> Result<(Arc<FlagSlab>, usize)> {
        match &mut self.current {
            Some((slab, next)) if *next + 2 <= slab.len() => {
                let i = *next;
                *next += 2;
                Ok((slab.clone(), i))
            }
            _ => {
                let slab = Arc::new(dev.alloc_flags(SLAB_FLAGS)?);
                self.slabs.push(slab.clone());
                self.current = Some((slab.clone(), 2));
                Ok((slab, 0))
            }
        }
    }

    /// Give the flag pairs back at teardown. `clean`: every op finished after its start
    /// flag was written, so nothing but reads of finish flags (targets <= the pair's last
    /// value) can still be queued on any stream: the pairs are recycled. Otherwise a start
    /// write may still be queued; the pairs are kept out of use forever.
    pub fn release(&mut self, dev: &dyn Device, clean: bool) {
        forget_waiters(&self.slabs);
        let key = (dev.backend(), dev.ordinal());
        let mut back: Vec<PooledPair> = Vec::new();
        if clean {
            back.extend(self.slots.drain().map(|(_, sl)| PooledPair { key, slab: sl.slab, start: sl.start, seq: sl.seq }));
            if let Some((slab, next)) = self.current.take() {
                back.extend((next..slab.len() / 2 * 2).step_by(2).map(|i| PooledPair { key, slab: slab.clone(), start: i, seq: 0 }));
            }
        }
        match POOL.lock() {
            Ok(mut pool) => pool.extend(back),
            Err(_) => back.into_iter().for_each(|p| std::mem::forget(p.slab)),
        }
        for s in self.slabs.drain(..) {
            // Pooled pairs hold their own reference; the rest are never freed (see above).
            std::mem::forget(s);
        }
        self.slots.clear();
        self.current = None;
    }
}

impl Drop for StreamManager {
    /// A manager dropped without [`StreamManager::release`] (a failed creation, a test)
    /// withdraws its waiting-stream entries too, so that they never count against the
    /// limit of streams that outlive it.
    fn drop(&mut self) {
        if !self.slabs.is_empty() {
            forget_waiters(&self.slabs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;

    fn adm(max: usize, ms: u64) -> Admission<'static> {
        Admission { max, timeout: Duration::from_millis(ms), stop: &|| None }
    }

    /// Streams past the limit wait for a release, a stream that already waits does not, a
    /// wait that no release ends is a Timeout that names the setting, and a refused call
    /// leaves nothing enqueued.
    /// A device and a manager dropped with streams still waiting (no release) leave nothing
    /// that counts against another device's limit, even one the allocator puts at the
    /// dropped one's address: every host device is its own queue domain.
    #[test]
    fn dropped_waiters_never_count() {
        let (k0, k1) = {
            let a = HostDevice::new().unwrap();
            let ka = context_key(&a);
            drop(a);
            let b = HostDevice::new().unwrap();
            (ka, context_key(&b))
        };
        assert_ne!(k0, k1, "a new host device shares a dropped one's queue domain");
        let dev = HostDevice::new().unwrap();
        let s: Vec<StreamHandle> = (0..2).map(|_| dev.create_stream().unwrap()).collect();
        let key = context_key(&dev);
        let hs = {
            let mut m = StreamManager::default();
            let hs: Vec<Handshake> = s.iter().map(|&st| m.enqueue(&dev, st, "t", &[], &adm(8, 5000)).unwrap()).collect();
            assert_eq!(waiting_streams(&mut WAITERS.lock().unwrap(), key, s[0]), (2, true));
            hs
        };
        assert_eq!(waiting_streams(&mut WAITERS.lock().unwrap(), key, s[0]), (0, false), "a dropped manager's waits still count");
        for h in &hs {
            h.flags.store(h.finish_flag, h.stream_seq);
        }
        for st in s {
            dev.synchronize(st).unwrap();
            dev.destroy_stream(st).unwrap();
        }
    }

    #[test]
    fn waiting_stream_limit() {
        let dev = HostDevice::new().unwrap();
        let mut m = StreamManager::default();
        let s: Vec<StreamHandle> = (0..3).map(|_| dev.create_stream().unwrap()).collect();
        m.enqueue(&dev, s[0], "t", &[], &adm(2, 5000)).unwrap();
        let h1 = m.enqueue(&dev, s[1], "t", &[], &adm(2, 5000)).unwrap();
        let t = Instant::now();
        let h0b = m.enqueue(&dev, s[0], "t", &[], &adm(2, 5000)).unwrap(); // s[0] already waits: no new queue
        assert!(t.elapsed() < Duration::from_millis(500));
        let t = Instant::now();
        let e = m.enqueue(&dev, s[2], "t", &[], &adm(2, 300)).err().expect("timeout");
        assert_eq!(e.code(), crate::error::ErrorCode::Timeout, "{e}");
        assert!(e.to_string().contains("HOCCL_MAX_WAITING_STREAMS = 2"), "{e}");
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(dev.stream_query(s[2]).unwrap(), "a refused call enqueues nothing");
        // Releasing s[1] from another thread lets a blocked call through.
        // (Targets are the pairs' sequence numbers: a pair may come from the pool.)
        let (flags, finish, target) = (h1.flags.clone(), h1.finish_flag, h1.stream_seq);
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            flags.store(finish, target);
        });
        let t = Instant::now();
        let h2 = m.enqueue(&dev, s[2], "t", &[], &adm(2, 5000)).unwrap();
        assert!(t.elapsed() >= Duration::from_millis(150), "admitted before the release");
        releaser.join().unwrap();
        // Unlimited: never waits.
        let s3 = dev.create_stream().unwrap();
        let h3 = m.enqueue(&dev, s3, "t", &[], &adm(usize::MAX, 1)).unwrap();
        for h in [&h0b, &h2, &h3] {
            h.flags.store(h.finish_flag, h.stream_seq);
        }
        for st in s.into_iter().chain([s3]) {
            dev.synchronize(st).unwrap();
            dev.destroy_stream(st).unwrap();
        }
        m.release(&dev, true);
    }

    /// An op given `direct` words waits on them, not on its finish flag: the stream passes
    /// once they reach their values, with finish unwritten; with no words it does not wait
    /// at all; a later op's start is then written ahead of the earlier op's finish, which a
    /// late store of that finish (a raise) never lowers.
    #[test]
    fn direct_waits_replace_finish() {
        let dev = HostDevice::new().unwrap();
        let mut m = StreamManager::default();
        let s = dev.create_stream().unwrap();
        let words = dev.alloc_flags(2).unwrap();
        let none = &adm(usize::MAX, 1);
        let h1 = m.enqueue_with(&dev, s, "t", &[], &mut |_| Ok(()), Some(&[(words.dev_addr(0), 3), (words.dev_addr(1), 1)]), none).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!dev.stream_query(s).unwrap(), "passed its words before they were written");
        words.store(0, 3);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!dev.stream_query(s).unwrap(), "passed with one word of two written");
        words.store(1, 1);
        let h2 = m.enqueue_with(&dev, s, "t", &[], &mut |_| Ok(()), Some(&[]), none).unwrap();
        dev.synchronize(s).unwrap();
        assert!(h1.flags.load(h1.finish_flag) < h1.stream_seq, "the finish flag was written");
        assert_eq!(h2.flags.load(h2.start_flag), h2.stream_seq, "the second op's start");
        h2.flags.raise(h2.finish_flag, h2.stream_seq);
        h1.flags.raise(h1.finish_flag, h1.stream_seq);
        assert_eq!(h1.flags.load(h1.finish_flag), h2.stream_seq, "a late finish lowered the flag");
        dev.destroy_stream(s).unwrap();
        m.release(&dev, false);
    }

    /// The communicator's stop condition (abort, async error) ends a blocked call at once.
    #[test]
    fn waiting_stream_stop() {
        let dev = HostDevice::new().unwrap();
        let mut m = StreamManager::default();
        let s0 = dev.create_stream().unwrap();
        let s1 = dev.create_stream().unwrap();
        let h0 = m.enqueue(&dev, s0, "t", &[], &adm(1, 5000)).unwrap();
        let stop = || Some(Error::Aborted { op: "t" });
        let t = Instant::now();
        let e = m.enqueue(&dev, s1, "t", &[], &Admission { max: 1, timeout: Duration::from_secs(5), stop: &stop }).err().expect("stopped");
        assert_eq!(e.code(), crate::error::ErrorCode::Aborted);
        assert!(t.elapsed() < Duration::from_secs(1));
        h0.flags.store(h0.finish_flag, h0.stream_seq);
        for st in [s0, s1] {
            dev.synchronize(st).unwrap();
            dev.destroy_stream(st).unwrap();
        }
        m.release(&dev, true);
    }
}

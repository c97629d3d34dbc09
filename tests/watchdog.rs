//! A proxy thread blocked inside a device call (as a CUDA proxy is behind another thread's
//! cuMemFree) never hangs its caller: the watchdog reports it (the async error, logged,
//! naming the likely cause once it has been stuck for the communicator's timeout with an
//! operation pending; a warning when it moves again), the collective still ends (done or failed), and abort and
//! destroy return within their bounds with the stream released. And copies that the device
//! does not run (the proxy itself moving on) time out with the state behind them logged,
//! while a transfer longer than the timeout whose chunks keep landing does not.
//! Host backend, with a device whose first copy-engine copy blocks for a while, whose
//! copies stall, or whose copy queues complete one chunk per fixed delay. Its own test binary: its parts run in sequence in one test, each asserting
//! on the records the capturing logger (`common::logs`) kept since the part before.
mod common;
use common::logs::{self, lines_with as logs_with};
use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::comm::Communicator;
use hoccl::config::BackendChoice;
use common::wrap::Wrapped;
use hoccl::device::{self, CopyQueue, DevPtr, Device, StreamHandle};
use hoccl::{Config, DataType, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A copy queue whose next copy blocks for `Gate::dur` once `Gate::armed` is set, whose
/// fences complete no further while `Gate::stall` holds a time to come (copies that the
/// device does not run, as on the H200 when its scheduler holds a queue back), and, with
/// `Gate::per_chunk` set, whose fences complete one per that delay, in order (a slow link;
/// the proxy is never blocked).
struct Gate {
    armed: AtomicBool,
    dur: Duration,
    stall: Mutex<Option<Instant>>,
    per_chunk: Option<Duration>,
}

/// The inner queue, the gate, the fence ticket reported last, and with `per_chunk` the
/// fences not yet reported with the time each completes.
struct SlowQueue(Box<dyn CopyQueue>, Arc<Gate>, u64, VecDeque<(u64, Instant)>);
impl CopyQueue for SlowQueue {
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        if self.1.armed.swap(false, Ordering::AcqRel) {
            std::thread::sleep(self.1.dur);
        }
        self.0.copy(dst, src, len)
    }
    fn fence(&mut self) -> Result<u64> {
        let t = self.0.fence()?;
        if let Some(d) = self.1.per_chunk {
            let after = self.3.back().map_or(Instant::now(), |&(_, due)| due.max(Instant::now()));
            self.3.push_back((t, after + d));
        }
        Ok(t)
    }
    fn completed(&mut self) -> Result<u64> {
        if self.1.stall.lock().unwrap().is_some_and(|until| Instant::now() < until) {
            return Ok(self.2);
        }
        let done = self.0.completed()?;
        if self.1.per_chunk.is_none() {
            self.2 = done;
        }
        while let Some(&(t, due)) = self.3.front() {
            if t > done || due > Instant::now() {
                break;
            }
            self.3.pop_front();
            self.2 = t;
        }
        Ok(self.2)
    }
}

/// The host device, with copy queues that can block.
struct Slow(Arc<Gate>);
impl common::wrap::Hooks for Slow {
    fn copy_queue(&self, q: Box<dyn CopyQueue>) -> Box<dyn CopyQueue> {
        Box::new(SlowQueue(q, self.0.clone(), 0, VecDeque::new()))
    }
}

/// Rank 0 of two: a communicator on a host device whose copies block for `block` once
/// armed, with its buffers, stream and the data to gather; rank 1 (`Peer`) runs in its own
/// thread on a plain host device. Rank 0's block to rank 1 is the copy that blocks (its
/// own block is copied on its stream, never by the proxy).
struct Setup {
    dev: Arc<dyn Device>,
    gate: Arc<Gate>,
    c: Option<Communicator>,
    send: DevPtr,
    recv: DevPtr,
    s: StreamHandle,
    data: Vec<u8>,
    peer: Peer,
}

const LEN: usize = 4096;

/// Rank 1: answers each of rank 0's AllGathers with its own (`true` on the channel), and
/// destroys its communicator when the channel closes.
struct Peer {
    tx: Option<std::sync::mpsc::Sender<bool>>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl Peer {
    fn start(boot: ThreadBootstrap, cfg: Config) -> Peer {
        let (tx, rx) = std::sync::mpsc::channel::<bool>();
        let h = std::thread::spawn(move || {
            let dev = device::open(BackendChoice::Host, 0).expect("host backend");
            let c = Communicator::with_bootstrap(Box::new(boot), Some(dev.clone()), cfg).expect("communicator");
            let send = dev.alloc(LEN).unwrap();
            let recv = dev.alloc(2 * LEN).unwrap();
            let s = dev.create_stream().unwrap();
            while rx.recv().unwrap_or(false) {
                c.all_gather(send, recv, LEN, DataType::U8, s).unwrap();
                dev.synchronize(s).unwrap();
                let _ = c.wait_idle();
            }
            drop(c);
            dev.free(send).unwrap();
            dev.free(recv).unwrap();
        });
        Peer { tx: Some(tx), h: Some(h) }
    }
    fn all_gather(&self) {
        self.tx.as_ref().unwrap().send(true).unwrap();
    }
    /// Rank 1 finishes its current op, destroys its communicator and exits.
    fn stop(&mut self) {
        self.tx.take();
        if let Some(h) = self.h.take() {
            h.join().expect("rank 1");
        }
    }
}

fn setup(timeout: Duration, block: Duration) -> Setup {
    let gate = Arc::new(Gate { armed: AtomicBool::new(false), dur: block, stall: Mutex::new(None), per_chunk: None });
    let dev: Arc<dyn Device> = Arc::new(Wrapped(device::open(BackendChoice::Host, 0).expect("host backend"), Slow(gate.clone())));
    let cfg = Config { timeout, ..Config::default() };
    let mut boots = ThreadBootstrap::group(2);
    // Rank 1 waits longer than rank 0, so that the failures under test are rank 0's own.
    let peer = Peer::start(boots.pop().unwrap(), Config { timeout: timeout * 3, ..cfg.clone() });
    let c = Communicator::with_bootstrap(Box::new(boots.pop().unwrap()), Some(dev.clone()), cfg).expect("communicator");
    let send = dev.alloc(LEN).unwrap();
    let recv = dev.alloc(2 * LEN).unwrap();
    let data: Vec<u8> = (0..LEN as u64).map(|i| device::pattern_byte(5, i)).collect();
    dev.copy_from_host(send, &data).unwrap();
    let s = dev.create_stream().unwrap();
    Setup { dev, gate, c: Some(c), send, recv, s, data, peer }
}

impl Setup {
    fn comm(&self) -> &Communicator {
        self.c.as_ref().unwrap()
    }
    /// An AllGather whose copy to rank 1 blocks the proxy.
    fn stuck_all_gather(&self) {
        self.gate.armed.store(true, Ordering::Release);
        self.peer.all_gather();
        self.comm().all_gather(self.send, self.recv, LEN, DataType::U8, self.s).unwrap();
    }
    fn free(mut self) {
        drop(self.c.take());
        self.peer.stop();
        self.dev.free(self.send).unwrap();
        self.dev.free(self.recv).unwrap();
    }
}

/// A setup whose proxy has been stuck in its AllGather's first copy for 0.3 s, and when
/// that AllGather was called.
fn stuck(timeout: Duration, block: Duration) -> (Setup, Instant) {
    let t = setup(timeout, block);
    let t0 = Instant::now();
    t.stuck_all_gather();
    std::thread::sleep(Duration::from_millis(300));
    (t, t0)
}

#[test]
fn a_stuck_proxy_never_hangs_its_caller() {
    logs::capture();
    reported_and_the_collective_still_ends();
    logs::clear();
    abort_returns_and_releases_the_stream();
    logs::clear();
    destroy_returns_and_releases_the_stream();
    logs::clear();
    a_stalled_copy_times_out_with_the_state_logged();
    logs::clear();
    a_transfer_that_keeps_landing_outlives_the_timeout();
    logs::clear();
    a_chunk_slower_than_the_timeout_times_out();
}

fn reported_and_the_collective_still_ends() {
    let block = Duration::from_millis(2500);
    let t = setup(Duration::from_secs(1), block);
    let t0 = Instant::now();
    t.stuck_all_gather();
    // The stream is released either way: the op completes or fails (its 1 s timeout ran
    // out while the proxy was blocked), and the communicator reports which.
    t.dev.synchronize(t.s).unwrap();
    let outcome = t.comm().wait_idle();
    let took = t0.elapsed();
    assert!(!t.gate.armed.load(Ordering::Acquire), "the collective went through the blocking copy");
    assert!(took >= block, "the proxy was blocked for {block:?}, the call took {took:?}");
    assert!(took < block + Duration::from_secs(5), "no hang: {took:?}");
    if outcome.is_ok() {
        let mut got = vec![0u8; LEN];
        t.dev.copy_to_host(&mut got, t.recv).unwrap();
        assert_eq!(got, t.data, "a collective that reports success delivered the data (own block)");
    }
    // The watchdog looks every 0.5 s: give it one more look after the proxy moved again.
    std::thread::sleep(Duration::from_millis(1200));
    let logs = logs::lines();
    let stuck = logs_with("the proxy thread has made no progress");
    assert_eq!(stuck.len(), 1, "one stall report: {logs:#?}");
    assert!(stuck[0].starts_with("ERROR") && stuck[0].contains("rank 0") && stuck[0].contains("cudaFree"), "{}", stuck[0]);
    assert!(logs.iter().any(|l| l.starts_with("WARN") && l.contains("rank 0: the proxy thread moves again")), "{logs:#?}");
    let e = t.comm().async_error().expect("the stall is the communicator's async error");
    assert_eq!(e.code(), hoccl::ErrorCode::Timeout);
    assert!(e.to_string().contains("made no progress"), "{e}");
    t.free();
}

/// Abort while the proxy is stuck (a 30 s timeout: no op times out meanwhile) returns after
/// its ~1 s wait, with the stream released and the failure reported.
fn abort_returns_and_releases_the_stream() {
    let block = Duration::from_secs(4);
    let (t, t0) = stuck(Duration::from_secs(30), block);
    t.comm().abort();
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(2500), "abort waited for the stuck proxy: {took:?}");
    t.dev.synchronize(t.s).unwrap();
    assert!(t0.elapsed() < Duration::from_millis(2600), "the stream was not released");
    let e = t.comm().async_error().expect("the abort's failure is reported");
    assert!(e.to_string().contains("did not stop"), "{e}");
    assert_eq!(t.comm().pending(), 0);
    assert_eq!(logs_with("did not stop").len(), 1, "{:#?}", logs::lines());
    // The proxy gets out of its call later and exits on its own: nothing breaks.
    std::thread::sleep(block);
    t.free();
}

/// Destroy while the proxy is stuck returns after the timeout and the stop margin.
fn destroy_returns_and_releases_the_stream() {
    let block = Duration::from_secs(6);
    let (t, t0) = stuck(Duration::from_secs(1), block);
    let Setup { dev, c, send, recv, s, mut peer, .. } = t;
    drop(c);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(4500), "destroy waited for the stuck proxy: {took:?}");
    dev.synchronize(s).unwrap();
    assert!(logs_with("did not stop").iter().any(|l| l.contains("Communicator::destroy")), "{:#?}", logs::lines());
    std::thread::sleep(block);
    peer.stop();
    dev.free(send).unwrap();
    dev.free(recv).unwrap();
}

/// Copies that never complete (the proxy itself runs on): the op times out after the
/// communicator's timeout, and the log shows the state behind it: the op, its stream's
/// flags, and the copy still in flight.
fn a_stalled_copy_times_out_with_the_state_logged() {
    let stall = Duration::from_secs(3);
    let t = setup(Duration::from_secs(1), Duration::ZERO);
    *t.gate.stall.lock().unwrap() = Some(Instant::now() + stall);
    let t0 = Instant::now();
    t.peer.all_gather();
    t.comm().all_gather(t.send, t.recv, LEN, DataType::U8, t.s).unwrap();
    t.dev.synchronize(t.s).unwrap();
    let took = t0.elapsed();
    assert!(took >= Duration::from_secs(1) && took < stall, "the stream is released by the timeout: {took:?}");
    let e = t.comm().wait_idle().expect_err("the collective timed out");
    assert_eq!(e.code(), hoccl::ErrorCode::Timeout);
    assert!(e.to_string().contains("copies to rank 1"), "{e}");
    let state = logs_with("rank 0: state at the first failure");
    assert_eq!(state.len(), 1, "{:#?}", logs::lines());
    for want in ["rank 0:", "all_gather: stream seq ", "started", "sends [1:Copying]", "1 in flight"] {
        assert!(state[0].contains(want), "{want:?} not in {}", state[0]);
    }
    // The stream reached the op (start = its seq) and was not yet released (finish below).
    let seq = state[0].split("stream seq ").nth(1).and_then(|r| r.split(' ').next()).and_then(|v| v.parse::<u64>().ok()).expect("seq");
    assert!(state[0].contains(&format!("(stream flags start {seq} finish {})", seq - 1)), "{}", state[0]);
    // Once the device runs the copy the mapping is released; free after that.
    std::thread::sleep(stall.saturating_sub(t0.elapsed()) + Duration::from_millis(200));
    t.free();
}

/// One send from rank 0 to rank 1 of `len` bytes in 64 KiB chunks, on two ranks (threads)
/// whose copy queues complete one chunk per `per_chunk`, with the communicators' `timeout`;
/// each rank's outcome, how long its stream took, and whether rank 1 got the data.
fn slow_sendrecv(len: usize, per_chunk: Duration, timeout: Duration) -> Vec<(Result<()>, Duration, bool)> {
    let cfg = Config { timeout, chunk_bytes: 64 << 10, ..Config::default() };
    // Buffers are freed only once both communicators are gone: a failed op's chunks still
    // in flight land first (the sender's destroy waits for them).
    let gone = Arc::new(std::sync::Barrier::new(2));
    let ranks: Vec<_> = ThreadBootstrap::group_with_timeout(2, Duration::from_secs(30))
        .into_iter()
        .enumerate()
        .map(|(rank, boot)| {
            let (cfg, gone) = (cfg.clone(), gone.clone());
            std::thread::spawn(move || {
                let gate = Arc::new(Gate { armed: AtomicBool::new(false), dur: Duration::ZERO, stall: Mutex::new(None), per_chunk: Some(per_chunk) });
                let dev: Arc<dyn Device> = Arc::new(Wrapped(device::open(BackendChoice::Host, 0).expect("host backend"), Slow(gate)));
                let c = Communicator::with_bootstrap(Box::new(boot), Some(dev.clone()), cfg).expect("communicator");
                let buf = dev.alloc(len).unwrap();
                let data: Vec<u8> = (0..len as u64).map(|i| device::pattern_byte(11, i)).collect();
                let zeros = vec![0u8; len];
                dev.copy_from_host(buf, if rank == 0 { &data } else { &zeros }).unwrap();
                let s = dev.create_stream().unwrap();
                let t0 = Instant::now();
                if rank == 0 {
                    c.send(buf, len, DataType::U8, 1, s).unwrap();
                } else {
                    c.recv(buf, len, DataType::U8, 0, s).unwrap();
                }
                dev.synchronize(s).unwrap();
                let took = t0.elapsed();
                let outcome = c.wait_idle();
                drop(c);
                gone.wait();
                let mut got = vec![0u8; len];
                dev.copy_to_host(&mut got, buf).unwrap();
                dev.free(buf).unwrap();
                (outcome, took, got == data)
            })
        })
        .collect();
    ranks.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

/// 4 MiB in 64 chunks, each landing 40 ms after the one before on its queue: the transfer
/// takes about three times the 300 ms timeout, and neither side times out (the sender's
/// op sees its chunks land, the receiver's op the sender's progress signals).
fn a_transfer_that_keeps_landing_outlives_the_timeout() {
    let timeout = Duration::from_millis(300);
    for (rank, (outcome, took, delivered)) in slow_sendrecv(4 << 20, Duration::from_millis(40), timeout).into_iter().enumerate() {
        assert!(outcome.is_ok(), "rank {rank}: {outcome:?} after {took:?}: {:#?}", logs::lines());
        assert!(took > 2 * timeout, "rank {rank}: the transfer took {took:?}, not longer than the timeout");
        if rank == 1 {
            assert!(delivered, "the data landed wrong");
        }
    }
    assert!(logs_with("timed out").is_empty(), "{:#?}", logs::lines());
}

/// The same transfer with each chunk taking longer than the timeout: it times out (the
/// sender's op waiting for its copies or the receiver's waiting for the data, whichever
/// check runs first; the other side fails by its peer's failure or its own timeout), and
/// both streams are released by the timeout, before the first chunk lands.
fn a_chunk_slower_than_the_timeout_times_out() {
    let timeout = Duration::from_millis(300);
    let per_chunk = Duration::from_millis(1200);
    let got = slow_sendrecv(1 << 20, per_chunk, timeout);
    let errors: Vec<hoccl::Error> = got.iter().map(|(o, _, _)| o.clone().expect_err("the op failed")).collect();
    let timeouts: Vec<String> = errors.iter().filter(|e| e.code() == hoccl::ErrorCode::Timeout).map(|e| e.to_string()).collect();
    assert!(!timeouts.is_empty(), "{errors:?}");
    assert!(timeouts.iter().all(|e| e.contains("copies to rank 1") || e.contains("data from rank 0")), "{timeouts:?}");
    for (rank, (_, took, _)) in got.iter().enumerate() {
        assert!(*took >= timeout && *took < per_chunk, "rank {rank}: the stream is released by the timeout: {took:?}");
    }
}

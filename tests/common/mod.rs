//! Shared test harness: run N ranks as threads (thread bootstrap), each with its own
//! device of the chosen backend; verifiable data from `device::pattern_byte`. The helpers
//! install the capturing logger (`logs`) first, so that errors a test provokes on purpose
//! show only when it fails.
#![allow(dead_code)]
use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::comm::Communicator;
use hoccl::config::BackendChoice;
use hoccl::device::{self, pattern_byte, DevPtr, Device, StreamHandle};
use hoccl::Config;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Host,
    Cuda,
}

/// A device of `backend`. On CUDA a missing GPU FAILS the test (never a silent pass).
pub fn open_device(backend: Backend, rank: usize) -> Arc<dyn Device> {
    logs::capture();
    match backend {
        Backend::Host => device::open(BackendChoice::Host, 0).expect("host backend"),
        Backend::Cuda => {
            let p = device::cuda::probe().expect("this test needs a GPU: CUDA probe failed");
            assert!(p.count > 0, "this test needs a GPU and none was found");
            device::open(BackendChoice::Cuda, rank % p.count).expect("open CUDA device")
        }
    }
}

/// The tests' settings: short timeout, small chunks; the rest from `HOCCL_*` (so a device
/// run can vary the copy streams, say).
pub fn test_config() -> Config {
    logs::capture();
    Config {
        timeout: Duration::from_secs(10),
        chunk_bytes: 64 << 10,
        ..Config::from_env().expect("HOCCL_* settings")
    }
}

/// Run `f(comm)` on `n` ranks (threads); panics in any rank fail the test.
pub fn run_ranks<F>(backend: Backend, n: usize, cfg: Config, f: F)
where
    F: Fn(&Communicator) + Send + Sync + 'static,
{
    logs::capture();
    let f = Arc::new(f);
    let handles: Vec<_> = ThreadBootstrap::group_with_timeout(n, Duration::from_secs(30))
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            let f = f.clone();
            let cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || {
                    let dev = open_device(backend, r);
                    let comm = Communicator::with_bootstrap(Box::new(b), Some(dev), cfg)
                        .expect("communicator");
                    f(&comm);
                    // Free only once no rank of the group has a collective pending: cuMemFree
                    // waits for every stream of the context while holding a driver lock that
                    // the other ranks' proxies need to issue their copies (H200: a rank that
                    // freed as soon as its own ops were done hung the group for good).
                    if comm.wait_idle().is_ok() && comm.bootstrap().barrier().is_ok() {
                        free_deferred();
                    }
                })
                .unwrap()
        })
        .collect();
    let mut failed = Vec::new();
    for (r, h) in handles.into_iter().enumerate() {
        if h.join().is_err() {
            failed.push(r);
        }
    }
    assert!(failed.is_empty(), "ranks {failed:?} failed");
}

/// A barrier of `n` thread ranks whose wait fails after `limit` instead of waiting for
/// good: a rank that panicked never arrives, and the test must then fail with its panic
/// (`run_ranks` reports it) rather than hang. One use: each rank waits once.
pub struct Gate {
    n: usize,
    arrived: std::sync::Mutex<usize>,
    cv: std::sync::Condvar,
}

impl Gate {
    pub fn new(n: usize) -> Gate {
        Gate { n, arrived: std::sync::Mutex::new(0), cv: std::sync::Condvar::new() }
    }

    /// Arrive and wait for every rank (at most `limit`, else panic).
    pub fn wait(&self, limit: Duration) {
        let mut a = self.arrived.lock().unwrap_or_else(|e| e.into_inner());
        *a += 1;
        self.cv.notify_all();
        let (a, t) = self.cv.wait_timeout_while(a, limit, |a| *a < self.n).unwrap_or_else(|e| e.into_inner());
        assert!(!t.timed_out() || *a >= self.n, "{} of {} ranks reached the gate within {limit:?}", *a, self.n);
    }
}

/// Wait until this rank has no collective pending and every rank has reached this point.
/// Ranks that are threads of one process share one CUDA context, where allocation, free and
/// synchronous copies may wait for every stream, including another rank's stream blocked in
/// a collective that waits for this rank: quiesce before such calls between collectives.
pub fn quiesce(c: &Communicator) {
    c.wait_idle().expect("wait_idle");
    c.bootstrap().barrier().expect("barrier");
}

/// After this rank's allocations (which follow a `quiesce`), before its first collective.
/// With `HOCCL_TEST_ALLOC_BARRIER=1`, wait there until every rank has made its own (so that
/// no rank enqueues a collective while another still allocates). Off by default, so that
/// ranks start together and have the most streams waiting on host flags at once, the case
/// the per-context enqueue gate is for (README, Known limits); on, it checks the other order.
pub fn allocated(c: &Communicator) {
    if std::env::var("HOCCL_TEST_ALLOC_BARRIER").is_ok_and(|v| v == "1") {
        c.bootstrap().barrier().expect("barrier");
    }
}

pub mod children;
#[path = "logs.rs"]
pub mod logs;
pub mod wrap;
pub mod ops;
pub mod pair;
#[path = "rng.rs"]
mod rng;
#[allow(unused_imports)] // not every test binary that includes this module draws numbers
pub use rng::Rng;

/// A device buffer with guard bands: `ptr` is `off` bytes into an allocation of
/// `off + len + guard` bytes; everything is pre-filled with a poison pattern.
pub struct Buf {
    pub dev: Arc<dyn Device>,
    pub base: DevPtr,
    pub ptr: DevPtr,
    pub len: usize,
    pub off: usize,
    pub total: usize,
    pub poison: u64,
}

pub const GUARD: usize = 37;

impl Buf {
    pub fn new(dev: &Arc<dyn Device>, len: usize, off: usize, poison: u64) -> Buf {
        let total = off + len + GUARD;
        let base = dev.alloc(total).expect("alloc");
        let b = Buf {
            dev: dev.clone(),
            base,
            ptr: base.add(off),
            len,
            off,
            total,
            poison,
        };
        // Poison from the host (no stream: tests keep the number of streams small, see
        // `CUDA_DEVICE_MAX_CONNECTIONS` in the README).
        let bytes: Vec<u8> = (0..total as u64).map(|i| pattern_byte(poison, i)).collect();
        dev.copy_from_host(base, &bytes).unwrap();
        b
    }
    pub fn read_all(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.total];
        self.dev.copy_to_host(&mut v, self.base).unwrap();
        v
    }
    /// Count bytes outside [off, off+len) that differ from the poison.
    pub fn guard_damage(&self, all: &[u8]) -> usize {
        (0..self.total)
            .filter(|i| {
                (*i < self.off || *i >= self.off + self.len)
                    && all[*i] != pattern_byte(self.poison, *i as u64)
            })
            .count()
    }
}

thread_local! {
    /// Buffers dropped while the rank's test body runs, freed when it ends.
    static DEFERRED: std::cell::RefCell<Vec<(Arc<dyn Device>, DevPtr)>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Drop for Buf {
    /// Ranks that are threads of one process share one CUDA context, where `cuMemFree`
    /// waits for every stream, another rank's stream blocked in a collective included; that
    /// rank may be waiting for this one's next call. So frees wait for `free_deferred`.
    fn drop(&mut self) {
        DEFERRED.with(|d| d.borrow_mut().push((self.dev.clone(), self.base)));
    }
}

thread_local! {
    /// Streams made by the rank's test body, destroyed when it ends.
    static STREAMS: std::cell::RefCell<Vec<(Arc<dyn Device>, StreamHandle)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A stream for this rank's test body, destroyed with its buffers (`free_deferred`; the
/// body must not destroy it itself), so that a test binary's CUDA context does not pile up
/// streams test after test.
pub fn new_stream(dev: &Arc<dyn Device>) -> StreamHandle {
    let s = dev.create_stream().expect("create_stream");
    STREAMS.with(|v| v.borrow_mut().push((dev.clone(), s)));
    s
}

/// Free the buffers this thread dropped and destroy its streams (call when the rank has no
/// collective pending).
pub fn free_deferred() {
    for (dev, p) in DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut())) {
        let _ = dev.free(p);
    }
    for (dev, s) in STREAMS.with(|v| std::mem::take(&mut *v.borrow_mut())) {
        let _ = dev.destroy_stream(s);
    }
}

/// Wrong bytes of `got[at..at+len]` against the pattern of `seed` starting at index 0.
pub fn wrong(got: &[u8], at: usize, len: usize, seed: u64) -> usize {
    (0..len)
        .filter(|i| got[at + i] != pattern_byte(seed, *i as u64))
        .count()
}

pub fn seed_of(test: u64, rank: usize, block: usize) -> u64 {
    test.wrapping_mul(1_000_003) ^ ((rank as u64) << 32) ^ (block as u64).wrapping_mul(7919)
}

pub fn sync(dev: &Arc<dyn Device>, s: StreamHandle) {
    dev.synchronize(s).expect("synchronize");
}

/// Instantiate each test body twice: on the host backend, and on CUDA as an ignored test
/// (`--ignored` on a GPU machine; it fails, never passes, when no GPU is found).
#[macro_export]
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod host {
            $( #[test] fn $name() { super::$name(super::Backend::Host) } )*
        }
        mod cuda {
            $( #[test] #[ignore = "needs a GPU: run with --ignored"] fn $name() { super::$name(super::Backend::Cuda) } )*
        }
    };
}

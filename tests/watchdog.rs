//! A proxy thread blocked inside a device call (as a CUDA proxy is behind another thread's
//! cuMemFree) is reported by the watchdog: an error naming the likely cause once it has been
//! stuck for the communicator's timeout with an operation pending, a warning when it moves
//! again; and the collective still ends (done or failed), never hangs. Host backend, with a
//! device whose first copy-engine copy blocks for a while. Its own test binary: it installs
//! the process's logger.
use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::comm::Communicator;
use hoccl::config::BackendChoice;
use hoccl::device::{self, Allocation, Backend, CopyQueue, DevPtr, Device, ExportHandle, FlagSlab, StreamHandle};
use hoccl::{Config, DataType, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;
impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            LOGS.lock().unwrap().push(format!("{} {}", r.level(), r.args()));
        }
    }
    fn flush(&self) {}
}

/// Set when the next copy must block (once).
static BLOCK_NEXT_COPY: AtomicBool = AtomicBool::new(false);
const BLOCK_FOR: Duration = Duration::from_millis(2500);

struct SlowQueue(Box<dyn CopyQueue>);
impl CopyQueue for SlowQueue {
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        if BLOCK_NEXT_COPY.swap(false, Ordering::AcqRel) {
            std::thread::sleep(BLOCK_FOR);
        }
        self.0.copy(dst, src, len)
    }
    fn fence(&mut self) -> Result<u64> {
        self.0.fence()
    }
    fn completed(&mut self) -> Result<u64> {
        self.0.completed()
    }
}

/// The host device, with copy queues that can block.
struct SlowDevice(Arc<dyn Device>);
impl Device for SlowDevice {
    fn backend(&self) -> Backend {
        self.0.backend()
    }
    fn ordinal(&self) -> usize {
        self.0.ordinal()
    }
    fn name(&self) -> String {
        self.0.name()
    }
    fn pci_bus_id(&self) -> String {
        self.0.pci_bus_id()
    }
    fn bind_thread(&self) -> Result<()> {
        self.0.bind_thread()
    }
    fn alloc(&self, len: usize) -> Result<DevPtr> {
        self.0.alloc(len)
    }
    fn free(&self, p: DevPtr) -> Result<()> {
        self.0.free(p)
    }
    fn allocation(&self, p: DevPtr) -> Result<Allocation> {
        self.0.allocation(p)
    }
    fn export(&self, a: &Allocation) -> Result<ExportHandle> {
        self.0.export(a)
    }
    fn import(&self, h: &ExportHandle, len: usize) -> Result<DevPtr> {
        self.0.import(h, len)
    }
    fn unimport(&self, base: DevPtr, len: usize) -> Result<()> {
        self.0.unimport(base, len)
    }
    fn alloc_flags(&self, n: usize) -> Result<FlagSlab> {
        self.0.alloc_flags(n)
    }
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.0.copy_to_host(dst, src)
    }
    fn copy_from_host(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.0.copy_from_host(dst, src)
    }
    fn create_stream(&self) -> Result<StreamHandle> {
        self.0.create_stream()
    }
    fn destroy_stream(&self, s: StreamHandle) -> Result<()> {
        self.0.destroy_stream(s)
    }
    fn write_value(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        self.0.write_value(s, flag, v)
    }
    fn wait_value_geq(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        self.0.wait_value_geq(s, flag, v)
    }
    fn synchronize(&self, s: StreamHandle) -> Result<()> {
        self.0.synchronize(s)
    }
    fn stream_query(&self, s: StreamHandle) -> Result<bool> {
        self.0.stream_query(s)
    }
    fn memcpy_async(&self, s: StreamHandle, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        self.0.memcpy_async(s, dst, src, len)
    }
    fn fill_pattern_async(&self, s: StreamHandle, dst: DevPtr, len: usize, seed: u64) -> Result<()> {
        self.0.fill_pattern_async(s, dst, len, seed)
    }
    fn copy_engine_count(&self) -> usize {
        self.0.copy_engine_count()
    }
    fn create_copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        Ok(Box::new(SlowQueue(self.0.create_copy_queue()?)))
    }
}

#[test]
fn a_blocked_proxy_is_reported_and_the_collective_still_ends() {
    log::set_logger(&Capture).expect("the first logger of this binary");
    log::set_max_level(log::LevelFilter::Warn);
    let dev: Arc<dyn Device> = Arc::new(SlowDevice(device::open(BackendChoice::Host, 0).expect("host backend")));
    let cfg = Config { timeout: Duration::from_secs(1), ..Config::default() };
    let boot = ThreadBootstrap::group(1).pop().unwrap();
    let c = Communicator::with_bootstrap(Box::new(boot), Some(dev.clone()), cfg).expect("communicator");
    let len = 4096;
    let send = dev.alloc(len).unwrap();
    let recv = dev.alloc(len).unwrap();
    let data: Vec<u8> = (0..len as u64).map(|i| device::pattern_byte(5, i)).collect();
    dev.copy_from_host(send, &data).unwrap();
    let s = dev.create_stream().unwrap();

    BLOCK_NEXT_COPY.store(true, Ordering::Release);
    let t0 = Instant::now();
    c.all_gather(send, recv, len, DataType::U8, s).unwrap();
    // The stream is released either way: the op completes or fails (its 1 s timeout ran
    // out while the proxy was blocked), and the communicator reports which.
    dev.synchronize(s).unwrap();
    let outcome = c.wait_idle();
    let took = t0.elapsed();
    assert!(!BLOCK_NEXT_COPY.load(Ordering::Acquire), "the collective went through the blocking copy");
    assert!(took >= BLOCK_FOR, "the proxy was blocked for {BLOCK_FOR:?}, the call took {took:?}");
    assert!(took < BLOCK_FOR + Duration::from_secs(5), "no hang: {took:?}");
    if outcome.is_ok() {
        let mut got = vec![0u8; len];
        dev.copy_to_host(&mut got, recv).unwrap();
        assert_eq!(got, data, "a collective that reports success delivered the data");
    }
    // The watchdog looks every 0.5 s: give it one more look after the proxy moved again.
    std::thread::sleep(Duration::from_millis(1200));
    let logs = LOGS.lock().unwrap().clone();
    let stuck: Vec<_> = logs.iter().filter(|l| l.contains("the proxy thread has made no progress")).collect();
    assert_eq!(stuck.len(), 1, "one stall report: {logs:#?}");
    assert!(stuck[0].starts_with("ERROR") && stuck[0].contains("rank 0") && stuck[0].contains("cudaFree"), "{}", stuck[0]);
    assert!(logs.iter().any(|l| l.starts_with("WARN") && l.contains("rank 0: the proxy thread moves again")), "{logs:#?}");
    drop(c);
    dev.free(send).unwrap();
    dev.free(recv).unwrap();
}

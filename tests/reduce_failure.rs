//! A reduction whose reduce step cannot be enqueued (as on a CUDA build without the reduce
//! kernel) fails the call with that error on the ranks that reduce, parks it as the
//! communicator's asynchronous error (the peers' matching ops can no longer complete), and
//! hangs nobody: a rank that only sends (Reduce's non-root) has its stream released and the
//! root's failure as its asynchronous error (`Remote`, or at worst a `Timeout` after the
//! communicator's timeout). Host backend, with a device whose `reduce_async` refuses.
mod common;
use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::comm::Communicator;
use hoccl::config::BackendChoice;
use hoccl::device::{self, Allocation, Backend, CopyQueue, DevPtr, Device, ExportHandle, FlagSlab, StreamHandle};
use hoccl::{Config, DataType, ErrorCode, RedOp, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The host device, except that `reduce_async` always fails.
struct NoReduce(Arc<dyn Device>);
impl Device for NoReduce {
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
        fn reduce_async(&self, _s: StreamHandle, _dst: DevPtr, _srcs: &[DevPtr], _count: usize, _dtype: DataType, _op: RedOp) -> Result<()> {
        Err(hoccl::Error::invalid_usage("NoReduce::reduce_async", "this device cannot reduce"))
    }
    fn create_copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        self.0.create_copy_queue()
    }
}

#[test]
fn a_reduce_step_that_fails_hangs_nobody() {
    common::logs::capture();
    let timeout = Duration::from_millis(1500);
    let t0 = Instant::now();
    let hs: Vec<_> = ThreadBootstrap::group(2)
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            std::thread::spawn(move || {
                let dev: Arc<dyn Device> = Arc::new(NoReduce(device::open(BackendChoice::Host, 0).expect("host backend")));
                // A small scratch: the Reduce below runs in several chunks.
                let cfg = Config { timeout, reduce_scratch: 4096, backend: BackendChoice::Host, ..Config::default() };
                let c = Communicator::with_bootstrap(Box::new(b), Some(dev.clone()), cfg).expect("communicator");
                let buf = dev.alloc(64 << 10).unwrap();
                let s = dev.create_stream().unwrap();
                // Root 0 reduces (and fails after the first chunk's exchange); rank 1 only
                // sends every chunk, the second of which the root never posts.
                let res = c.reduce(buf, buf, 16 << 10, DataType::F32, RedOp::Sum, 0, s);
                if r == 0 {
                    let e = res.expect_err("the root's reduce step fails");
                    assert_eq!(e.code(), ErrorCode::InvalidUsage, "{e}");
                    assert!(c.async_error().is_some(), "parked as the asynchronous error");
                    let again = c.all_reduce(buf, buf, 4, DataType::F32, RedOp::Sum, s).expect_err("sticky");
                    assert_eq!(again.code(), e.code());
                } else {
                    res.expect("a rank that only sends enqueues every chunk");
                }
                dev.synchronize(s).expect("the stream is released");
                if r == 1 {
                    let t = Instant::now();
                    while c.async_error().is_none() {
                        assert!(t.elapsed() < timeout * 4, "no asynchronous error on the sender");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                if r == 1 {
                    // The root's failure reaches it (`Remote`), or its op times out.
                    let code = c.async_error().map(|e| e.code());
                    assert!(matches!(code, Some(ErrorCode::Remote | ErrorCode::Timeout)), "{code:?}");
                }
                drop(c);
                dev.destroy_stream(s).unwrap();
                dev.free(buf).unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank");
    }
    assert!(t0.elapsed() < timeout * 8, "took {:?}", t0.elapsed());
}

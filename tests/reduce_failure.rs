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
use common::wrap::Wrapped;
use hoccl::device::{self, Device};
use hoccl::{Config, DataType, ErrorCode, RedOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The host device, except that `reduce_async` always fails.
struct NoReduce;
impl common::wrap::Hooks for NoReduce {
    fn reduce_error(&self) -> Option<hoccl::Error> {
        Some(hoccl::Error::invalid_usage("NoReduce::reduce_async", "this device cannot reduce"))
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
                let dev: Arc<dyn Device> = Arc::new(Wrapped(device::open(BackendChoice::Host, 0).expect("host backend"), NoReduce));
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

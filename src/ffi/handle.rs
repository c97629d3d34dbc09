//! The life cycle of a communicator owned by C or C++ code. A handle is live, aborted or
//! destroyed; only a live one hands out its `Communicator`. Calls take a clone of the `Arc`
//! and run without holding the handle's lock, so a call racing with `destroy` on another
//! thread either runs on a live communicator (which is torn down when that call returns) or
//! fails with `InvalidUsage`: never a use of freed memory.
use crate::comm::Communicator;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, MutexGuard};

enum Slot {
    Live(Arc<Communicator>),
    /// `abort` ran: every call fails with `Aborted`; `destroy` releases the handle quietly.
    Aborted,
    /// `destroy` ran: every call fails with `InvalidUsage`.
    Destroyed,
}

pub struct CommHandle {
    slot: Mutex<Slot>,
}

impl CommHandle {
    pub fn new(comm: Communicator) -> CommHandle {
        CommHandle { slot: Mutex::new(Slot::Live(Arc::new(comm))) }
    }

    /// A handle that never held a communicator (a failed creation): calls fail with
    /// `InvalidUsage`.
    pub fn empty() -> CommHandle {
        CommHandle { slot: Mutex::new(Slot::Destroyed) }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // The slot is replaced in one assignment, so a poisoned lock still holds a valid
        // state: recover it rather than fail forever.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The communicator, or `Aborted` / `InvalidUsage` once it was aborted / destroyed.
    pub fn get(&self, op: &'static str) -> Result<Arc<Communicator>> {
        match &*self.lock() {
            Slot::Live(c) => Ok(c.clone()),
            Slot::Aborted => Err(Error::Aborted { op }),
            Slot::Destroyed => Err(Error::invalid_usage(op, "the communicator was destroyed")),
        }
    }

    /// Tear down from any state: pending operations fail, later calls fail with `Aborted`.
    /// Aborting an aborted handle does nothing; a destroyed one is `InvalidUsage`.
    pub fn abort(&self, op: &'static str) -> Result<()> {
        let comm = {
            let mut slot = self.lock();
            match std::mem::replace(&mut *slot, Slot::Aborted) {
                Slot::Live(c) => c,
                Slot::Aborted => return Ok(()),
                Slot::Destroyed => {
                    *slot = Slot::Destroyed;
                    return Err(Error::invalid_usage(op, "the communicator was destroyed"));
                }
            }
        };
        comm.abort();
        drop(comm); // the last reference (unless a call is running) frees it now
        Ok(())
    }

    /// Wait for pending operations (bounded by the configured timeout), release the
    /// communicator, and report what went wrong: an asynchronous error, or operations that
    /// did not finish. The handle is destroyed whatever the outcome. Destroying an aborted
    /// handle is quiet; destroying twice is `InvalidUsage`.
    pub fn destroy(&self, op: &'static str) -> Result<()> {
        let comm = {
            let mut slot = self.lock();
            match std::mem::replace(&mut *slot, Slot::Destroyed) {
                Slot::Live(c) => c,
                Slot::Aborted => return Ok(()),
                Slot::Destroyed => return Err(Error::invalid_usage(op, "the communicator was already destroyed")),
            }
        };
        let outcome = comm.wait_idle();
        drop(comm);
        outcome
    }

    /// `destroy` for destructors: never an error for an already released handle, and the
    /// outcome is logged as well as returned.
    pub fn release(&self, op: &'static str) -> Result<()> {
        let live = matches!(&*self.lock(), Slot::Live(_));
        let r = if live { self.destroy(op) } else { self.destroy(op).or(Ok(())) };
        if let Err(e) = &r {
            log::error!("hoccl: {op}: {e}");
        }
        r
    }
}

impl Drop for CommHandle {
    fn drop(&mut self) {
        // Reached from C++ destructors: nothing may unwind out of here.
        let slot = std::mem::replace(self.slot.get_mut().unwrap_or_else(|p| p.into_inner()), Slot::Destroyed);
        if let Slot::Live(comm) = slot {
            let r = super::guarded("CommHandle::drop", || {
                drop(comm);
                Ok(())
            });
            if let Err(e) = r {
                log::error!("hoccl: {e}");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bootstrap::thread::ThreadBootstrap;
    use crate::config::{BackendChoice, Config};
    use crate::error::ErrorCode;
    use std::time::Duration;

    /// Run `f(rank, communicator)` on `n` in-process ranks over the host backend.
    pub(crate) fn with_ranks(n: usize, f: impl Fn(usize, Communicator) + Send + Sync + 'static) {
        let f = Arc::new(f);
        let threads: Vec<_> = ThreadBootstrap::group_with_timeout(n, Duration::from_secs(30))
            .into_iter()
            .enumerate()
            .map(|(r, b)| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let cfg = Config { timeout: Duration::from_secs(10), chunk_bytes: 64 << 10, ..Config::default() };
                    let dev = crate::device::open(BackendChoice::Host, 0).expect("host device");
                    let c = Communicator::with_bootstrap(Box::new(b), Some(dev), cfg).expect("communicator");
                    f(r, c)
                })
            })
            .collect();
        let failed: Vec<usize> = threads.into_iter().enumerate().filter_map(|(r, t)| t.join().is_err().then_some(r)).collect();
        assert!(failed.is_empty(), "ranks {failed:?} failed");
    }

    fn code(r: Result<Arc<Communicator>>) -> ErrorCode {
        r.err().expect("an error").code()
    }

    #[test]
    fn life_cycle() {
        with_ranks(2, |_, c| {
            let h = CommHandle::new(c);
            assert!(h.get("x").is_ok());
            h.abort("abort").unwrap();
            h.abort("abort").unwrap(); // idempotent
            assert_eq!(code(h.get("x")), ErrorCode::Aborted);
            h.destroy("destroy").unwrap(); // quiet after abort
            assert_eq!(code(h.get("x")), ErrorCode::InvalidUsage);
            assert_eq!(h.destroy("destroy").unwrap_err().code(), ErrorCode::InvalidUsage);
            assert_eq!(h.abort("abort").unwrap_err().code(), ErrorCode::InvalidUsage);
            h.release("release").unwrap();
        });
        with_ranks(2, |_, c| {
            let h = CommHandle::new(c);
            h.destroy("destroy").unwrap();
            assert_eq!(code(h.get("x")), ErrorCode::InvalidUsage);
            assert!(h.release("release").is_ok());
        });
        assert_eq!(code(CommHandle::empty().get("x")), ErrorCode::InvalidUsage);
    }

    /// Destroy after ranks disagreed: reports the async error promptly, and releases.
    #[test]
    fn destroy_reports_the_async_error() {
        with_ranks(2, |r, c| {
            let dev = c.device().clone();
            let s = dev.create_stream().unwrap();
            let buf = dev.alloc(1000).unwrap();
            let count = if r == 0 { 100 } else { 120 };
            c.all_gather(buf.add(r * count), buf, count, crate::DataType::U8, s).unwrap();
            dev.synchronize(s).unwrap();
            let h = CommHandle::new(c);
            let t = std::time::Instant::now();
            let e = h.destroy("destroy").unwrap_err();
            assert!(matches!(e.code(), ErrorCode::InvalidUsage | ErrorCode::Remote), "{e}");
            assert!(t.elapsed() < Duration::from_secs(5), "destroy waited {:?}", t.elapsed());
            assert_eq!(code(h.get("x")), ErrorCode::InvalidUsage);
        });
    }
}

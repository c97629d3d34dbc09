//! Per-communicator device buffers that ops on several streams of this rank use one after
//! the other (the reductions' scratch, the forwarders' staging): allocated with a flag that
//! each user raises when done, waited for by a user on another stream, and freed at
//! teardown only once the flag says every user is done.
use super::{Communicator, Region};
use crate::device::{DevPtr, FlagSlab, StreamHandle};
use crate::error::Result;
use std::time::{Duration, Instant};

/// A guarded buffer: `region` cut into slots of `slot` bytes, and the flag its users raise.
pub(super) struct Guarded {
    pub(super) base: DevPtr,
    pub(super) region: Region,
    pub(super) slot: usize,
    pub(super) flag: FlagSlab,
    /// Uses so far; the flag reaches this when the last is done.
    pub(super) uses: u64,
    /// The stream of the last of them.
    pub(super) last: Option<StreamHandle>,
}

impl Communicator {
    /// `len` bytes of device memory as a validated region (`op`, `what` name it in errors)
    /// and a one-word flag; nothing stays allocated on failure.
    pub(super) fn alloc_guarded(&self, name: &'static str, op: &'static str, what: &'static str, len: usize) -> Result<(DevPtr, Region, FlagSlab)> {
        let base = self.dev.alloc(len).map_err(|e| e.with_op(name))?;
        match self.dev.allocation(base).and_then(|a| Ok((a, self.dev.alloc_flags(1)?))) {
            Ok((alloc, flag)) => Ok((base, Region { op, what, ptr: base, len, alloc: Some(alloc) }, flag)),
            Err(e) => {
                let _ = self.dev.free(base);
                Err(e.with_op(name))
            }
        }
    }

    /// Before a use on `s`: if the last use (which raises `flag` to `uses` when done) was on
    /// another stream, make `s` wait for it.
    pub(super) fn wait_for_last_use(&self, s: StreamHandle, last: Option<StreamHandle>, flag: &FlagSlab, uses: u64) -> Result<()> {
        match last {
            Some(t) if t != s => self.dev.wait_value_geq(s, flag.dev_addr(0), uses),
            _ => Ok(()),
        }
    }

    /// At teardown: once `flag` reaches `uses` (polled on the host, never a stream query),
    /// free `base`. After `bound` without that, the buffer (`what`, `len` bytes) and its flag
    /// stay allocated, since a stream may still read or write them, and a warning says so.
    pub(super) fn free_after_last_use(&self, base: DevPtr, len: usize, flag: FlagSlab, uses: u64, bound: Duration, what: &str) {
        let t0 = Instant::now();
        while flag.load(0) < uses {
            if t0.elapsed() > bound {
                log::warn!("hoccl: rank {}: an op using the {what} had not run {bound:?} after destroy; the {what} ({len} bytes) stays allocated", self.rank);
                std::mem::forget(flag);
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if let Err(e) = self.dev.free(base) {
            log::warn!("hoccl: rank {}: freeing the {what}: {e}", self.rank);
        }
    }
}

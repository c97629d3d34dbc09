//! Host staging for a transport between nodes whose device memory is not host memory (CUDA):
//! one allocation of `Device::alloc_host` (pinned memory) cut into slots, half to send and
//! half to receive, and the copy queue that fills and drains them. The socket and the verbs
//! transports keep their own free lists and copies in flight over it.
use crate::device::{CopyQueue, DevPtr, Device};
use crate::error::Result;
use std::sync::Arc;

pub struct HostStaging {
    pub dev: Arc<dyn Device>,
    pub queue: Box<dyn CopyQueue>,
    pub base: DevPtr,
    /// Bytes of one slot.
    pub slot: usize,
    /// Slots each way: send slots `0..n`, receive slots `n..2n`.
    pub n: usize,
}

impl HostStaging {
    /// `bytes` of host staging on `dev` in slots of `slot` bytes (at least two each way),
    /// with one copy queue; made on the thread that drives the copies.
    pub fn new(dev: Arc<dyn Device>, bytes: usize, slot: usize) -> Result<HostStaging> {
        let slot = slot.max(1);
        let n = (bytes / slot / 2).max(2);
        let base = dev.alloc_host(2 * n * slot)?;
        let queue = match dev.create_copy_queue() {
            Ok(q) => q,
            Err(e) => {
                let _ = dev.free_host(base);
                return Err(e);
            }
        };
        Ok(HostStaging { dev, queue, base, slot, n })
    }

    /// Slot `i`'s first byte (send slots below [`n`](Self::n)).
    pub fn slot_ptr(&self, i: usize) -> DevPtr {
        self.base.add(i * self.slot)
    }

    /// Bytes of the allocation.
    pub fn len(&self) -> usize {
        2 * self.n * self.slot
    }

    /// The owner is done with the staging: free it, unless `in_flight` copies (or a broken
    /// queue's) may still write it, in which case it stays allocated, said at warn level as
    /// `what`'s.
    pub fn release(&self, what: &str, in_flight: usize, broken: bool) {
        if in_flight > 0 || broken {
            log::warn!("hoccl: {what}: host staging left allocated, {in_flight} copies still in flight");
            return;
        }
        if let Err(e) = self.dev.free_host(self.base) {
            log::warn!("hoccl: {e}");
        }
    }
}

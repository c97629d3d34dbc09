//! The verbs transport's one contact with raw memory: CPU copies between a chunk and the
//! host staging the transport allocated (`Device::alloc_host`: pinned memory on CUDA), which
//! its copy queue also reads and writes. Every copy is checked against the staging's range;
//! the transport never copies a slot while a copy-queue operation on it is in flight.
use crate::device::DevPtr;
use crate::error::{Error, Result};

const OP: &str = "verbs host staging";

/// `len` bytes of host staging at `base`, alive (and readable and writable by this process)
/// until the transport frees it, which it does only when no copy uses it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pinned {
    base: u64,
    len: usize,
}

impl Pinned {
    pub(super) fn new(base: DevPtr, len: usize) -> Pinned {
        Pinned { base: base.0, len }
    }

    fn check(&self, at: DevPtr, n: usize) -> Result<u64> {
        let end = at.0.checked_add(n as u64);
        if at.0 < self.base || end.is_none_or(|e| e > self.base + self.len as u64) {
            return Err(Error::internal(OP, format!("{:#x}+{n} is outside the staging {:#x}+{}", at.0, self.base, self.len)));
        }
        Ok(at.0)
    }

    /// Copy `out.len()` bytes of the staging at `at` into `out`.
    pub(super) fn read(&self, at: DevPtr, out: &mut [u8]) -> Result<()> {
        let a = self.check(at, out.len())?;
        // SAFETY: the range lies inside the live staging (checked); no copy-queue operation
        // writes it now (the transport's contract above); `out` is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(a as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copy `data` into the staging at `at`.
    pub(super) fn write(&self, at: DevPtr, data: &[u8]) -> Result<()> {
        let a = self.check(at, data.len())?;
        // SAFETY: as for `read`; no copy-queue operation reads or writes the range now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), a as *mut u8, data.len()) };
        Ok(())
    }
}

//! The socket transport's one contact with raw memory: `send`/`recv` between a TCP socket
//! and a byte range named by address (a user buffer of the host backend, or the
//! transport's own host staging), and `poll` over its connections. Every [`Span`] is
//! checked when it is made; the I/O calls take offsets inside it.
use crate::device::{Allocation, DevPtr};
use crate::error::{Error, Result};
use std::os::fd::RawFd;

/// `len` bytes of host memory at `addr`, readable and writable by this process for as long
/// as the transfer that named them is pending (the user's contract for the buffers of an
/// op, as for the copy engines; the transport's contract for its staging).
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    addr: u64,
    len: usize,
}

impl Span {
    /// The range `[ptr, ptr + len)` of `alloc`, a live allocation of the host backend (the
    /// engine resolved it through the device's registry); an error when it does not lie
    /// inside it.
    pub(super) fn in_allocation(op: &'static str, ptr: DevPtr, len: usize, alloc: Option<Allocation>) -> Result<Span> {
        if len == 0 {
            return Ok(Span { addr: ptr.0, len: 0 });
        }
        let a = alloc.ok_or_else(|| Error::invalid_arg(op, format!("{:#x}+{len}: no allocation holds it", ptr.0)))?;
        let end = ptr.0.checked_add(len as u64).ok_or_else(|| Error::invalid_arg(op, "address range overflows"))?;
        if ptr.0 < a.base.0 || end > a.base.0 + a.len as u64 {
            return Err(Error::invalid_arg(op, format!("{:#x}+{len} is outside its allocation {:#x}+{}", ptr.0, a.base.0, a.len)));
        }
        Ok(Span { addr: ptr.0, len })
    }


    /// `[ptr, ptr + len)` of host staging this transport allocated (`Device::alloc_host`)
    /// and frees only when no transfer uses it.
    pub(super) fn staging(ptr: DevPtr, len: usize) -> Span {
        Span { addr: ptr.0, len }
    }

    /// The span's first byte, as the device's copy queues address it.
    pub(super) fn ptr(&self) -> DevPtr {
        DevPtr(self.addr)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The bytes `[off, off + n)` of the span, clamped to it.
    fn sub(&self, off: usize, n: usize) -> (u64, usize) {
        let off = off.min(self.len);
        (self.addr + off as u64, n.min(self.len - off))
    }
}

/// Write up to `n` bytes of `span` from `off` to `fd` without waiting; the count written
/// (`WouldBlock` when the socket's buffer is full).
pub(super) fn send(fd: RawFd, span: Span, off: usize, n: usize) -> std::io::Result<usize> {
    let (addr, n) = span.sub(off, n);
    // SAFETY: `[addr, addr + n)` lies inside a span checked at its making and alive while
    // its transfer is pending (see `Span`); MSG_NOSIGNAL turns a closed peer into EPIPE
    // instead of SIGPIPE; MSG_DONTWAIT never blocks.
    let r = unsafe { libc::send(fd, addr as *const libc::c_void, n, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Read up to `n` bytes from `fd` into `span` at `off` without waiting; the count read (0:
/// the peer closed the connection).
pub(super) fn recv(fd: RawFd, span: Span, off: usize, n: usize) -> std::io::Result<usize> {
    let (addr, n) = span.sub(off, n);
    // SAFETY: as for `send`; the range is writable memory of this process and nothing else
    // writes it while the transfer is pending.
    let r = unsafe { libc::recv(fd, addr as *mut libc::c_void, n, libc::MSG_DONTWAIT) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// A poll record asking whether `fd` has something to read.
pub(super) fn poll_in(fd: RawFd) -> libc::pollfd {
    libc::pollfd { fd, events: libc::POLLIN, revents: 0 }
}

/// Fill each record's `revents` (readable, closed or failed) without waiting: one system
/// call for every connection.
pub(super) fn readable(fds: &mut [libc::pollfd]) -> std::io::Result<()> {
    // SAFETY: `fds` is an exclusively borrowed array of `fds.len()` initialised records,
    // which poll only writes the `revents` of; a timeout of 0 never blocks.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

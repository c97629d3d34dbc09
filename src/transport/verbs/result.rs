//! Level 2: one function per verbs call, returning `Result` with an `Error::System` that
//! names the call (`op` is `"verbs"`; the safe layer replaces it with its own operation).
//!
//! Error conventions of libibverbs, mapped here: functions returning a pointer return NULL
//! and set `errno`; functions returning `int` return 0 or a positive errno value (some
//! providers return -1 and set errno, handled too); `ibv_poll_cq` returns a negative value on
//! failure with no errno.
use super::sys::{self, Verbs};
use crate::error::{Error, Result};
use std::ffi::{c_int, c_void, CStr};

const OP: &str = "verbs";

/// `errno` value `code` from `call` as an error.
pub fn errno_error(call: &'static str, code: i32) -> Error {
    Error::System { op: OP, call, errno: code, what: std::io::Error::from_raw_os_error(code).to_string() }
}

/// The thread's current errno after `call` failed (EIO if it left errno at 0).
fn last_errno(call: &'static str) -> Error {
    let code = std::io::Error::last_os_error().raw_os_error().filter(|&c| c != 0).unwrap_or(libc::EIO);
    errno_error(call, code)
}

/// An int return: 0 is success; positive is an errno value; negative means "see errno".
fn rc(call: &'static str, r: c_int) -> Result<()> {
    match r {
        0 => Ok(()),
        r if r > 0 => Err(errno_error(call, r)),
        _ => Err(last_errno(call)),
    }
}

fn non_null<T>(call: &'static str, p: *mut T) -> Result<*mut T> {
    if p.is_null() {
        Err(last_errno(call))
    } else {
        Ok(p)
    }
}

/// The loaded library, or `NoDevice` naming why it could not be loaded.
pub fn lib() -> Result<&'static Verbs> {
    sys::library().map_err(|what| Error::NoDevice { op: OP, what: format!("libibverbs unavailable: {what}") })
}

/// `ibv_get_device_list`: the list and its length. An absent uverbs kernel interface
/// (`ENOSYS`) is reported as an empty list with a null pointer.
pub fn get_device_list(v: &Verbs) -> Result<(*mut *mut sys::ibv_device, usize)> {
    let mut n: c_int = 0;
    // SAFETY: valid out-pointer.
    let list = unsafe { (v.get_device_list)(&mut n) };
    if list.is_null() {
        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        if e == libc::ENOSYS || e == 0 {
            return Ok((std::ptr::null_mut(), 0));
        }
        return Err(errno_error("ibv_get_device_list", e));
    }
    Ok((list, n.max(0) as usize))
}

/// # Safety
/// `list` came from [`get_device_list`] (or is null) and is freed once.
pub unsafe fn free_device_list(v: &Verbs, list: *mut *mut sys::ibv_device) {
    if !list.is_null() {
        // SAFETY: caller contract.
        unsafe { (v.free_device_list)(list) }
    }
}

/// # Safety
/// `dev` is an entry of a live device list.
pub unsafe fn device_name(v: &Verbs, dev: *mut sys::ibv_device) -> String {
    // SAFETY: caller contract; the name is a NUL-terminated string owned by the device.
    let p = unsafe { (v.get_device_name)(dev) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The node GUID in host order.
///
/// # Safety
/// `dev` is an entry of a live device list.
pub unsafe fn device_guid(v: &Verbs, dev: *mut sys::ibv_device) -> u64 {
    // SAFETY: caller contract.
    u64::from_be(unsafe { (v.get_device_guid)(dev) })
}

/// # Safety
/// `dev` is an entry of a live device list.
pub unsafe fn open_device(v: &Verbs, dev: *mut sys::ibv_device) -> Result<*mut sys::ibv_context> {
    // SAFETY: caller contract.
    non_null("ibv_open_device", unsafe { (v.open_device)(dev) })
}

/// # Safety
/// `ctx` came from [`open_device`], has no live children, and is closed once.
pub unsafe fn close_device(v: &Verbs, ctx: *mut sys::ibv_context) -> Result<()> {
    // SAFETY: caller contract.
    rc("ibv_close_device", unsafe { (v.close_device)(ctx) })
}

/// # Safety
/// `ctx` is a live context.
pub unsafe fn query_device(v: &Verbs, ctx: *mut sys::ibv_context) -> Result<sys::ibv_device_attr> {
    let mut attr = sys::ibv_device_attr::default();
    // SAFETY: caller contract; valid out-pointer.
    rc("ibv_query_device", unsafe { (v.query_device)(ctx, &mut attr) })?;
    Ok(attr)
}

/// `ibv_query_port` as the header's inline does it: the provider's extended op when it has
/// one, the exported compat symbol otherwise.
///
/// # Safety
/// `ctx` is a live context.
pub unsafe fn query_port(v: &Verbs, ctx: *mut sys::ibv_context, port: u8) -> Result<sys::ibv_port_attr> {
    let mut attr = sys::ibv_port_attr::default();
    // SAFETY: caller contract; valid out-pointer; the wrapper only uses the ops table.
    let r = unsafe { sys::hoccl_ibv_query_port_ex(ctx, port, &mut attr) };
    if r != -1 {
        rc("ibv_query_port", r)?;
        return Ok(attr);
    }
    attr = sys::ibv_port_attr::default();
    // SAFETY: the compat entry point takes the full struct's prefix; the header's inline
    // passes the full, zeroed struct exactly like this.
    rc("ibv_query_port", unsafe { (v.query_port)(ctx, port, &mut attr as *mut _ as *mut sys::_compat_ibv_port_attr) })?;
    Ok(attr)
}

/// # Safety
/// `ctx` is a live context.
pub unsafe fn query_gid(v: &Verbs, ctx: *mut sys::ibv_context, port: u8, index: i32) -> Result<[u8; 16]> {
    let mut gid = sys::ibv_gid { raw: [0; 16] };
    // SAFETY: caller contract; valid out-pointer.
    rc("ibv_query_gid", unsafe { (v.query_gid)(ctx, port, index, &mut gid) })?;
    // SAFETY: every bit pattern of the union is a valid [u8; 16].
    Ok(unsafe { gid.raw })
}

/// # Safety
/// `ctx` is a live context.
pub unsafe fn alloc_pd(v: &Verbs, ctx: *mut sys::ibv_context) -> Result<*mut sys::ibv_pd> {
    // SAFETY: caller contract.
    non_null("ibv_alloc_pd", unsafe { (v.alloc_pd)(ctx) })
}

/// # Safety
/// `pd` came from [`alloc_pd`], has no live children, and is freed once.
pub unsafe fn dealloc_pd(v: &Verbs, pd: *mut sys::ibv_pd) -> Result<()> {
    // SAFETY: caller contract.
    rc("ibv_dealloc_pd", unsafe { (v.dealloc_pd)(pd) })
}

/// A CQ of at least `cqe` entries, without completion channel.
///
/// # Safety
/// `ctx` is a live context.
pub unsafe fn create_cq(v: &Verbs, ctx: *mut sys::ibv_context, cqe: i32) -> Result<*mut sys::ibv_cq> {
    // SAFETY: caller contract; null cq_context and channel are allowed.
    non_null("ibv_create_cq", unsafe { (v.create_cq)(ctx, cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0) })
}

/// # Safety
/// `cq` came from [`create_cq`], no QP uses it any more, and it is destroyed once.
pub unsafe fn destroy_cq(v: &Verbs, cq: *mut sys::ibv_cq) -> Result<()> {
    // SAFETY: caller contract.
    rc("ibv_destroy_cq", unsafe { (v.destroy_cq)(cq) })
}

/// `ibv_reg_mr` (the macro) for `[addr, addr+len)` with iova = addr.
///
/// # Safety
/// `pd` is live; the memory stays valid (and is not unmapped) until [`dereg_mr`].
pub unsafe fn reg_mr(v: &Verbs, pd: *mut sys::ibv_pd, addr: *mut c_void, len: usize, access: u32) -> Result<*mut sys::ibv_mr> {
    // SAFETY: caller contract.
    non_null("ibv_reg_mr_iova2", unsafe { (v.reg_mr_iova2)(pd, addr, len, addr as u64, access) })
}

/// Register `len` bytes at `offset` of a dma-buf (GPU memory exported by the driver).
///
/// # Safety
/// `pd` is live; `fd` is a dma-buf that stays valid until [`dereg_mr`].
pub unsafe fn reg_dmabuf_mr(v: &Verbs, pd: *mut sys::ibv_pd, offset: u64, len: usize, iova: u64, fd: i32, access: u32) -> Result<*mut sys::ibv_mr> {
    let Some(f) = v.reg_dmabuf_mr else {
        return Err(errno_error("ibv_reg_dmabuf_mr", libc::EOPNOTSUPP));
    };
    // SAFETY: caller contract.
    non_null("ibv_reg_dmabuf_mr", unsafe { f(pd, offset, len, iova, fd, access as c_int) })
}

/// # Safety
/// `mr` came from a registration above and is deregistered once.
pub unsafe fn dereg_mr(v: &Verbs, mr: *mut sys::ibv_mr) -> Result<()> {
    // SAFETY: caller contract.
    rc("ibv_dereg_mr", unsafe { (v.dereg_mr)(mr) })
}

/// # Safety
/// `pd` and the CQs in `attr` are live and outlive the QP.
pub unsafe fn create_qp(v: &Verbs, pd: *mut sys::ibv_pd, attr: &mut sys::ibv_qp_init_attr) -> Result<*mut sys::ibv_qp> {
    // SAFETY: caller contract; attr is valid for the call (the provider writes back caps).
    non_null("ibv_create_qp", unsafe { (v.create_qp)(pd, attr) })
}

/// # Safety
/// `qp` is live.
pub unsafe fn modify_qp(v: &Verbs, qp: *mut sys::ibv_qp, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<()> {
    // SAFETY: caller contract; attr is valid for the call.
    rc("ibv_modify_qp", unsafe { (v.modify_qp)(qp, attr, mask as c_int) })
}

/// # Safety
/// `qp` came from [`create_qp`] and is destroyed once.
pub unsafe fn destroy_qp(v: &Verbs, qp: *mut sys::ibv_qp) -> Result<()> {
    // SAFETY: caller contract.
    rc("ibv_destroy_qp", unsafe { (v.destroy_qp)(qp) })
}

/// # Safety
/// `qp` is live; `wr` is a valid chain whose SGEs reference registered memory that stays
/// valid until the work completes.
pub unsafe fn post_send(qp: *mut sys::ibv_qp, wr: &mut sys::ibv_send_wr) -> Result<()> {
    let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: caller contract; the wrapper calls qp->context->ops.post_send.
    rc("ibv_post_send", unsafe { sys::ibv_post_send(qp, wr, &mut bad) })
}

/// # Safety
/// As [`post_send`], for receive work.
pub unsafe fn post_recv(qp: *mut sys::ibv_qp, wr: &mut sys::ibv_recv_wr) -> Result<()> {
    let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
    // SAFETY: caller contract; the wrapper calls qp->context->ops.post_recv.
    rc("ibv_post_recv", unsafe { sys::ibv_post_recv(qp, wr, &mut bad) })
}

/// Poll up to `wc.len()` completions; returns how many were written.
///
/// # Safety
/// `cq` is live.
pub unsafe fn poll_cq(cq: *mut sys::ibv_cq, wc: &mut [sys::ibv_wc]) -> Result<usize> {
    let n = c_int::try_from(wc.len()).unwrap_or(c_int::MAX);
    // SAFETY: caller contract; wc holds at least n entries.
    let r = unsafe { sys::ibv_poll_cq(cq, n, wc.as_mut_ptr()) };
    if r < 0 {
        return Err(errno_error("ibv_poll_cq", libc::EIO));
    }
    Ok(r as usize)
}

/// Text of a work-completion status ("success", "remote access error", ...).
pub fn wc_status_str(v: &Verbs, status: u32) -> String {
    // SAFETY: ibv_wc_status_str accepts any value and returns a static string.
    let p = unsafe { (v.wc_status_str)(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_call_and_errno() {
        let e = errno_error("ibv_modify_qp", libc::EINVAL);
        match &e {
            Error::System { call, errno, what, .. } => {
                assert_eq!(*call, "ibv_modify_qp");
                assert_eq!(*errno, libc::EINVAL);
                assert!(what.to_lowercase().contains("invalid"), "{what}");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(rc("x", 0).is_ok());
        assert!(matches!(rc("x", libc::ENOMEM), Err(Error::System { errno, .. }) if errno == libc::ENOMEM));
        assert!(matches!(non_null::<u8>("ibv_alloc_pd", std::ptr::null_mut()), Err(Error::System { call: "ibv_alloc_pd", .. })));
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let r = sys::load(c"libhoccl-no-such-library.so.1");
        assert!(r.is_err());
        assert!(r.err().unwrap_or_default().contains("libhoccl-no-such-library"));
    }
}

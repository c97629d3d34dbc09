//! Level 1: raw libibverbs bindings.
//!
//! Types and the static-inline verbs come from bindgen (`build.rs`, allowlisted to what this
//! module uses). The static inlines (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`, `hoccl_ibv_query_port_ex`) are compiled C wrappers that only call
//! through the provider's ops tables, so they may be called directly once a context exists.
//!
//! Exported functions are NOT linked: libibverbs is opened at run time with
//! `dlopen("libibverbs.so.1")` and each function is looked up with `dlsym` into [`Verbs`],
//! so hosts without rdma-core still run. The bindgen declarations of those functions must
//! never be called (that would need libibverbs at link time); they only serve the
//! compile-time signature checks at the bottom of this file.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code, clippy::all)]

include!(concat!(env!("OUT_DIR"), "/verbs_sys.rs"));

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

pub type FnGetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
pub type FnFreeDeviceList = unsafe extern "C" fn(*mut *mut ibv_device);
pub type FnGetDeviceName = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
pub type FnGetDeviceGuid = unsafe extern "C" fn(*mut ibv_device) -> __be64;
pub type FnOpenDevice = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
pub type FnCloseDevice = unsafe extern "C" fn(*mut ibv_context) -> c_int;
pub type FnQueryDevice = unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
/// The exported (compat) `ibv_query_port`; see `hoccl_ibv_query_port_ex`.
pub type FnQueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int;
pub type FnQueryGid = unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
pub type FnAllocPd = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
pub type FnDeallocPd = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
pub type FnCreateCq =
    unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
pub type FnDestroyCq = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
pub type FnRegMrIova2 = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr;
pub type FnRegDmabufMr = unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
pub type FnDeregMr = unsafe extern "C" fn(*mut ibv_mr) -> c_int;
pub type FnCreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
pub type FnModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
pub type FnDestroyQp = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
pub type FnWcStatusStr = unsafe extern "C" fn(ibv_wc_status) -> *const c_char;

/// The exported libibverbs functions, resolved once per process.
/// Invariant: every pointer was returned by `dlsym` on a handle that is never closed, for a
/// symbol whose C signature is the field's type (checked against the headers below).
pub struct Verbs {
    pub get_device_list: FnGetDeviceList,
    pub free_device_list: FnFreeDeviceList,
    pub get_device_name: FnGetDeviceName,
    pub get_device_guid: FnGetDeviceGuid,
    pub open_device: FnOpenDevice,
    pub close_device: FnCloseDevice,
    pub query_device: FnQueryDevice,
    pub query_port: FnQueryPort,
    pub query_gid: FnQueryGid,
    pub alloc_pd: FnAllocPd,
    pub dealloc_pd: FnDeallocPd,
    pub create_cq: FnCreateCq,
    pub destroy_cq: FnDestroyCq,
    /// `ibv_reg_mr` is a macro in current rdma-core; this is the function behind it.
    pub reg_mr_iova2: FnRegMrIova2,
    /// Absent before rdma-core 34 (IBVERBS_1.12).
    pub reg_dmabuf_mr: Option<FnRegDmabufMr>,
    pub dereg_mr: FnDeregMr,
    pub create_qp: FnCreateQp,
    pub modify_qp: FnModifyQp,
    pub destroy_qp: FnDestroyQp,
    pub wc_status_str: FnWcStatusStr,
}

/// The library soname that is opened.
pub const LIBRARY: &CStr = c"libibverbs.so.1";

fn dlerror_string() -> String {
    // SAFETY: dlerror returns null or a thread-local NUL-terminated string.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// `dlsym(handle, name)` as a function pointer of type `F`.
///
/// # Safety
/// `handle` must be a live dlopen handle and `F` a function-pointer type matching the C
/// signature of `name`.
unsafe fn sym<F: Copy>(handle: *mut c_void, name: &CStr) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: handle is live (caller); name is NUL-terminated.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if p.is_null() {
        None
    } else {
        // SAFETY: F is a pointer-sized fn pointer type matching the symbol (caller).
        Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
    }
}

/// Open `soname` and resolve the table. Err is a human-readable reason.
pub fn load(soname: &CStr) -> Result<Verbs, String> {
    // SAFETY: soname is NUL-terminated. The handle is intentionally never closed: providers
    // and the table stay valid for the life of the process.
    let h = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(dlerror_string());
    }
    macro_rules! req {
        ($name:literal) => {
            // SAFETY: h is live; the field type was checked against the header's signature.
            unsafe { sym(h, $name) }.ok_or_else(|| format!("{}: missing symbol {:?}", soname.to_string_lossy(), $name))?
        };
    }
    Ok(Verbs {
        get_device_list: req!(c"ibv_get_device_list"),
        free_device_list: req!(c"ibv_free_device_list"),
        get_device_name: req!(c"ibv_get_device_name"),
        get_device_guid: req!(c"ibv_get_device_guid"),
        open_device: req!(c"ibv_open_device"),
        close_device: req!(c"ibv_close_device"),
        query_device: req!(c"ibv_query_device"),
        query_port: req!(c"ibv_query_port"),
        query_gid: req!(c"ibv_query_gid"),
        alloc_pd: req!(c"ibv_alloc_pd"),
        dealloc_pd: req!(c"ibv_dealloc_pd"),
        create_cq: req!(c"ibv_create_cq"),
        destroy_cq: req!(c"ibv_destroy_cq"),
        reg_mr_iova2: req!(c"ibv_reg_mr_iova2"),
        // SAFETY: as in req!.
        reg_dmabuf_mr: unsafe { sym(h, c"ibv_reg_dmabuf_mr") },
        dereg_mr: req!(c"ibv_dereg_mr"),
        create_qp: req!(c"ibv_create_qp"),
        modify_qp: req!(c"ibv_modify_qp"),
        destroy_qp: req!(c"ibv_destroy_qp"),
        wc_status_str: req!(c"ibv_wc_status_str"),
    })
}

/// The process-wide table, loaded on first use from [`LIBRARY`].
pub fn library() -> Result<&'static Verbs, String> {
    static LIB: OnceLock<Result<Verbs, String>> = OnceLock::new();
    LIB.get_or_init(|| load(LIBRARY)).as_ref().map_err(|e| e.clone())
}

// Compile-time checks that the dlsym'd types match the headers. Coercing a function item to
// a function pointer inside a const is evaluated by the compiler only; no reference to the
// symbol reaches the object file, so nothing needs libibverbs at link time.
const _: () = {
    let _: FnGetDeviceList = ibv_get_device_list;
    let _: FnFreeDeviceList = ibv_free_device_list;
    let _: FnGetDeviceName = ibv_get_device_name;
    let _: FnGetDeviceGuid = ibv_get_device_guid;
    let _: FnOpenDevice = ibv_open_device;
    let _: FnCloseDevice = ibv_close_device;
    let _: FnQueryDevice = ibv_query_device;
    let _: FnQueryPort = ibv_query_port;
    let _: FnQueryGid = ibv_query_gid;
    let _: FnAllocPd = ibv_alloc_pd;
    let _: FnDeallocPd = ibv_dealloc_pd;
    let _: FnCreateCq = ibv_create_cq;
    let _: FnDestroyCq = ibv_destroy_cq;
    let _: FnRegMrIova2 = ibv_reg_mr_iova2;
    let _: FnRegDmabufMr = ibv_reg_dmabuf_mr;
    let _: FnDeregMr = ibv_dereg_mr;
    let _: FnCreateQp = ibv_create_qp;
    let _: FnModifyQp = ibv_modify_qp;
    let _: FnDestroyQp = ibv_destroy_qp;
    let _: FnWcStatusStr = ibv_wc_status_str;
};

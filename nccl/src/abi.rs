//! The pure half of the NCCL ABI: result codes and the mapping of hoccl's errors onto them,
//! `ncclConfig_t` read as far as its `size` says it extends, `NCCL_DEBUG` as a log filter.
//! Nothing here touches a communicator, so all of it is unit-tested.
#![allow(non_camel_case_types)]
use hoccl::{Error, ErrorCode, Result};
use std::ffi::{c_char, c_int, c_uint, CStr};

/// `ncclResult_t` (an int-sized C enum).
pub type ncclResult_t = c_int;
pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;

/// NCCL 2.28.9, the API this library implements: `ncclGetVersion`'s answer and
/// `NCCL_VERSION_CODE` of `include/hoccl-nccl/nccl.h`.
pub const NCCL_VERSION_CODE: c_int = 22809;

/// `ncclNumOps`: reduction operators at or above it are made by `ncclRedOpCreatePreMulSum`.
pub const NCCL_NUM_OPS: c_int = 5;

/// `ncclScalarResidence_t`.
pub const NCCL_SCALAR_DEVICE: c_int = 0;
pub const NCCL_SCALAR_HOST_IMMEDIATE: c_int = 1;

/// `NCCL_SPLIT_NOCOLOR`.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
/// `ncclCommShrink`'s flags: leave the parent's operations, or abort them first.
pub const NCCL_SHRINK_DEFAULT: c_int = 0;
pub const NCCL_SHRINK_ABORT: c_int = 1;
/// `ncclCommRevoke`'s flags: NCCL defines only the default.
pub const NCCL_REVOKE_DEFAULT: c_int = 0;

/// The one mapping of hoccl's error kinds to `ncclResult_t`. NCCL 2.28 has no timeout,
/// corrupt-data or aborted code: a timeout and data that fails validation come from a peer
/// that did not do its part (`ncclRemoteError`); a call on an aborted communicator is a
/// usage error, as it is in NCCL (whose abort frees the communicator).
pub fn result_of(code: ErrorCode) -> ncclResult_t {
    match code {
        ErrorCode::Success => NCCL_SUCCESS,
        ErrorCode::Cuda | ErrorCode::NoDevice => NCCL_UNHANDLED_CUDA_ERROR,
        ErrorCode::System | ErrorCode::Mpi => NCCL_SYSTEM_ERROR,
        ErrorCode::Internal => NCCL_INTERNAL_ERROR,
        ErrorCode::InvalidArgument => NCCL_INVALID_ARGUMENT,
        ErrorCode::InvalidUsage | ErrorCode::Aborted => NCCL_INVALID_USAGE,
        ErrorCode::Remote | ErrorCode::Timeout | ErrorCode::CorruptData => NCCL_REMOTE_ERROR,
        ErrorCode::InProgress => NCCL_IN_PROGRESS,
    }
}

/// `ncclGetErrorString`: a static description of each code.
pub fn error_string(r: ncclResult_t) -> &'static CStr {
    match r {
        NCCL_SUCCESS => c"no error",
        NCCL_UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        NCCL_SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        NCCL_INTERNAL_ERROR => c"internal error - please report this issue to the hoccl developers",
        NCCL_INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        NCCL_INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        NCCL_REMOTE_ERROR => c"remote process exited or there was a network error",
        NCCL_IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}

/// `ncclConfig_t` of NCCL 2.28 (`ncclConfig_v22800`), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
    pub collnet_enable: c_int,
    pub cta_policy: c_int,
    pub shrink_share: c_int,
    pub nvls_ctas: c_int,
    pub n_channels_per_net_peer: c_int,
    pub nvlink_centric_sched: c_int,
}

/// `NCCL_API_MAGIC`: what `NCCL_CONFIG_INITIALIZER` writes to `magic`.
pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT` (what the initializer leaves in fields the caller did not set).
#[cfg(test)]
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// What `NCCL_CONFIG_INITIALIZER` makes (tests build configs from it).
#[cfg(test)]
pub fn initializer() -> ncclConfig_t {
    let u = NCCL_CONFIG_UNDEF_INT;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: NCCL_VERSION_CODE as c_uint,
        blocking: u,
        cga_cluster_size: u,
        min_ctas: u,
        max_ctas: u,
        net_name: std::ptr::null(),
        split_share: u,
        traffic_class: u,
        comm_name: std::ptr::null(),
        collnet_enable: u,
        cta_policy: u,
        shrink_share: u,
        nvls_ctas: u,
        n_channels_per_net_peer: u,
        nvlink_centric_sched: u,
    }
}

/// What hoccl takes from an `ncclConfig_t`; every other field tunes NCCL's own kernels and
/// channels, which hoccl does not have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommOptions {
    /// `blocking = 0` asks for non-blocking creation. hoccl completes creation before the
    /// call returns either way, so `ncclCommGetAsyncError` then reports `ncclSuccess`.
    pub nonblocking: bool,
    /// `commName`, used in log lines.
    pub name: Option<String>,
}

/// Read `cfg` (NULL: defaults) as NCCL does: it must carry `NCCL_API_MAGIC` (set by
/// `NCCL_CONFIG_INITIALIZER`), and a field is read only when `size` says the caller's struct
/// extends past it, so a program built against an older, shorter `ncclConfig_t` works.
pub fn read_config(op: &'static str, cfg: *const ncclConfig_t) -> Result<CommOptions> {
    if cfg.is_null() {
        return Ok(CommOptions::default());
    }
    // SAFETY: non-NULL; the C contract is that it points to an ncclConfig_t set up by
    // NCCL_CONFIG_INITIALIZER. Only `size`, `magic` and `version` (present in every
    // version of the struct) are read before `size` is checked.
    let (size, magic, version) = unsafe { ((*cfg).size, (*cfg).magic, (*cfg).version) };
    if magic != NCCL_API_MAGIC {
        return Err(Error::invalid_arg(op, format!("config magic {magic:#x}: the ncclConfig_t was not set up with NCCL_CONFIG_INITIALIZER")));
    }
    let has = |offset: usize, len: usize| offset + len <= size;
    let mut o = CommOptions::default();
    if has(std::mem::offset_of!(ncclConfig_t, blocking), 4) {
        // SAFETY: inside the caller's struct (checked against its size).
        let b = unsafe { (*cfg).blocking };
        o.nonblocking = b == 0;
    }
    if has(std::mem::offset_of!(ncclConfig_t, comm_name), std::mem::size_of::<*const c_char>()) {
        // SAFETY: inside the caller's struct (checked against its size).
        let p = unsafe { (*cfg).comm_name };
        if !p.is_null() {
            // SAFETY: non-NULL commName is a NUL-terminated string (NCCL's contract).
            o.name = Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    log::debug!("{op}: ncclConfig_t of {size} bytes, version {version}: {o:?}");
    Ok(o)
}

/// The `env_logger` filter for `NCCL_DEBUG` (NONE, VERSION, WARN, INFO, ABORT, TRACE; NCCL
/// ignores case), and whether the level prints the version banner.
pub fn debug_filter(level: &str) -> Option<(&'static str, bool)> {
    match level.trim().to_ascii_uppercase().as_str() {
        "NONE" => Some(("off", false)),
        "VERSION" => Some(("warn", true)),
        "WARN" => Some(("warn", false)),
        "ABORT" => Some(("error", false)),
        "INFO" => Some(("info", true)),
        "TRACE" => Some(("trace", true)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hoccl::{DataType, RedOp};

    #[test]
    fn every_error_kind_has_an_nccl_code() {
        let cases = [
            (ErrorCode::Success, NCCL_SUCCESS),
            (ErrorCode::Cuda, NCCL_UNHANDLED_CUDA_ERROR),
            (ErrorCode::NoDevice, NCCL_UNHANDLED_CUDA_ERROR),
            (ErrorCode::System, NCCL_SYSTEM_ERROR),
            (ErrorCode::Mpi, NCCL_SYSTEM_ERROR),
            (ErrorCode::Internal, NCCL_INTERNAL_ERROR),
            (ErrorCode::InvalidArgument, NCCL_INVALID_ARGUMENT),
            (ErrorCode::InvalidUsage, NCCL_INVALID_USAGE),
            (ErrorCode::Aborted, NCCL_INVALID_USAGE),
            (ErrorCode::Remote, NCCL_REMOTE_ERROR),
            (ErrorCode::Timeout, NCCL_REMOTE_ERROR),
            (ErrorCode::CorruptData, NCCL_REMOTE_ERROR),
            (ErrorCode::InProgress, NCCL_IN_PROGRESS),
        ];
        for (k, r) in cases {
            assert_eq!(result_of(k), r, "{k:?}");
            assert_ne!(error_string(r), c"unknown result code");
        }
        assert_eq!(error_string(8), c"unknown result code");
        assert_eq!(error_string(-1), c"unknown result code");
    }

    /// `ncclDataType_t` and `ncclRedOp_t` values (NCCL 2.28's header) decode to the hoccl
    /// type and operator of the same meaning; the first value past each enum is refused.
    #[test]
    fn nccl_numbering_of_types_and_operators() {
        let types = [
            (0, DataType::I8),
            (1, DataType::U8),
            (2, DataType::I32),
            (3, DataType::U32),
            (4, DataType::I64),
            (5, DataType::U64),
            (6, DataType::F16),
            (7, DataType::F32),
            (8, DataType::F64),
            (9, DataType::BF16),
            (10, DataType::F8E4M3),
            (11, DataType::F8E5M2),
        ];
        for (v, t) in types {
            assert_eq!(DataType::from_raw("t", v).unwrap(), t, "{v}");
        }
        assert_eq!(DataType::from_raw("t", 12).unwrap_err().code(), ErrorCode::InvalidArgument);
        let ops = [(0, RedOp::Sum), (1, RedOp::Prod), (2, RedOp::Max), (3, RedOp::Min), (4, RedOp::Avg)];
        for (v, o) in ops {
            assert_eq!(RedOp::from_raw("t", v).unwrap(), o, "{v}");
        }
        assert!(RedOp::from_raw("t", NCCL_NUM_OPS).is_err());
    }

    #[test]
    fn config_layout_is_nccl_2_28() {
        // Offsets on LP64 as the C compiler lays out NCCL 2.28's struct.
        assert_eq!(std::mem::offset_of!(ncclConfig_t, blocking), 16);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, net_name), 32);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, comm_name), 48);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, nvlink_centric_sched), 76);
        assert_eq!(std::mem::size_of::<ncclConfig_t>(), 80);
    }

    #[test]
    fn config_fields_are_read_as_far_as_size_says() {
        assert_eq!(read_config("c", std::ptr::null()).unwrap(), CommOptions::default());
        let mut c = initializer();
        assert_eq!(read_config("c", &c).unwrap(), CommOptions::default());
        c.blocking = 0;
        let name = c"trainer";
        c.comm_name = name.as_ptr();
        assert_eq!(read_config("c", &c).unwrap(), CommOptions { nonblocking: true, name: Some("trainer".into()) });
        c.blocking = 1;
        assert!(!read_config("c", &c).unwrap().nonblocking);
        // A struct that ends before commName (an older, shorter ncclConfig_t): not read.
        c.blocking = 0;
        c.size = std::mem::offset_of!(ncclConfig_t, comm_name);
        assert_eq!(read_config("c", &c).unwrap(), CommOptions { nonblocking: true, name: None });
        // One that ends before blocking: nothing but the header is read.
        c.size = std::mem::offset_of!(ncclConfig_t, blocking);
        assert_eq!(read_config("c", &c).unwrap(), CommOptions::default());
        c.magic = 0;
        let e = read_config("c", &c).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
        assert!(e.to_string().contains("NCCL_CONFIG_INITIALIZER"), "{e}");
    }

    #[test]
    fn nccl_debug_levels() {
        assert_eq!(debug_filter("VERSION"), Some(("warn", true)));
        assert_eq!(debug_filter("warn"), Some(("warn", false)));
        assert_eq!(debug_filter("Info"), Some(("info", true)));
        assert_eq!(debug_filter("TRACE"), Some(("trace", true)));
        assert_eq!(debug_filter("NONE"), Some(("off", false)));
        assert_eq!(debug_filter("ABORT"), Some(("error", false)));
        assert_eq!(debug_filter("loud"), None);
    }
}

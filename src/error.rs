//! One error type for the whole library. Every variant names the operation that failed.
//! Codes mirror NCCL's `ncclResult_t` where a counterpart exists, so C callers can map them.
use std::fmt;
use std::time::Duration;

/// Numeric result codes of the C ABI and of `hoccl::Error::code()` in C++.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    Success = 0,
    /// A CUDA driver call failed.
    Cuda = 1,
    /// An operating-system call (shared memory, threads, sockets, dlopen) failed.
    System = 2,
    /// A bug inside hoccl (an invariant did not hold).
    Internal = 3,
    /// A bad argument: null or too-short buffer, bad dtype, count overflow, bad rank.
    InvalidArgument = 4,
    /// A bad call sequence: use after destroy, mismatched group calls, peers disagreeing.
    InvalidUsage = 5,
    /// A peer failed or disappeared.
    Remote = 6,
    /// An operation is still in progress.
    InProgress = 7,
    /// An operation did not complete within the configured timeout.
    Timeout = 8,
    /// Compressed input failed validation.
    CorruptData = 9,
    /// The communicator was aborted.
    Aborted = 10,
    /// MPI reported an error.
    Mpi = 11,
    /// The requested backend or device is not present.
    NoDevice = 12,
}

/// The `op` field of any variant (one list of variants for reading and for replacing it).
macro_rules! op_field {
    ($e:expr) => {
        match $e {
            Error::InvalidArgument { op, .. }
            | Error::InvalidUsage { op, .. }
            | Error::Cuda { op, .. }
            | Error::System { op, .. }
            | Error::Mpi { op, .. }
            | Error::Remote { op, .. }
            | Error::Timeout { op, .. }
            | Error::CorruptData { op, .. }
            | Error::Aborted { op }
            | Error::NoDevice { op, .. }
            | Error::Internal { op, .. } => op,
        }
    };
}

/// Every failure hoccl reports. `op` is the public operation (or internal step) that failed.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub enum Error {
    InvalidArgument { op: &'static str, what: String },
    InvalidUsage { op: &'static str, what: String },
    Cuda { op: &'static str, call: &'static str, code: i32, name: String },
    System { op: &'static str, call: &'static str, errno: i32, what: String },
    Mpi { op: &'static str, code: i32 },
    Remote { op: &'static str, peer: usize, what: String },
    Timeout { op: &'static str, after: Duration, what: String },
    CorruptData { op: &'static str, what: String },
    Aborted { op: &'static str },
    NoDevice { op: &'static str, what: String },
    Internal { op: &'static str, what: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Error::InvalidUsage { .. } => ErrorCode::InvalidUsage,
            Error::Cuda { .. } => ErrorCode::Cuda,
            Error::System { .. } => ErrorCode::System,
            Error::Mpi { .. } => ErrorCode::Mpi,
            Error::Remote { .. } => ErrorCode::Remote,
            Error::Timeout { .. } => ErrorCode::Timeout,
            Error::CorruptData { .. } => ErrorCode::CorruptData,
            Error::Aborted { .. } => ErrorCode::Aborted,
            Error::NoDevice { .. } => ErrorCode::NoDevice,
            Error::Internal { .. } => ErrorCode::Internal,
        }
    }

    /// The operation this error names.
    pub fn op(&self) -> &'static str {
        *op_field!(self)
    }

    pub fn invalid_arg(op: &'static str, what: impl Into<String>) -> Self {
        Error::InvalidArgument { op, what: what.into() }
    }
    pub fn invalid_usage(op: &'static str, what: impl Into<String>) -> Self {
        Error::InvalidUsage { op, what: what.into() }
    }
    pub fn internal(op: &'static str, what: impl Into<String>) -> Self {
        Error::Internal { op, what: what.into() }
    }
    pub fn corrupt(op: &'static str, what: impl Into<String>) -> Self {
        Error::CorruptData { op, what: what.into() }
    }
    /// The calling thread's `errno` as a `System` error.
    pub fn last_os(op: &'static str, call: &'static str) -> Self {
        let e = std::io::Error::last_os_error();
        Error::System { op, call, errno: e.raw_os_error().unwrap_or(0), what: e.to_string() }
    }
    pub fn io(op: &'static str, call: &'static str, e: std::io::Error) -> Self {
        Error::System { op, call, errno: e.raw_os_error().unwrap_or(0), what: e.to_string() }
    }
    /// Replace the operation name (used when a lower layer's error surfaces through a
    /// public call).
    pub fn with_op(mut self, new_op: &'static str) -> Self {
        *op_field!(&mut self) = new_op;
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument { op, what } => write!(f, "{op}: invalid argument: {what}"),
            Error::InvalidUsage { op, what } => write!(f, "{op}: invalid usage: {what}"),
            Error::Cuda { op, call, code, name } => write!(f, "{op}: {call} failed: {name} ({code})"),
            Error::System { op, call, errno, what } => write!(f, "{op}: {call} failed: {what} (errno {errno})"),
            Error::Mpi { op, code } => write!(f, "{op}: MPI error {code}"),
            Error::Remote { op, peer, what } => write!(f, "{op}: peer rank {peer}: {what}"),
            Error::Timeout { op, after, what } => write!(f, "{op}: timed out after {after:?}: {what}"),
            Error::CorruptData { op, what } => write!(f, "{op}: corrupt data: {what}"),
            Error::Aborted { op } => write!(f, "{op}: communicator was aborted"),
            Error::NoDevice { op, what } => write!(f, "{op}: no device: {what}"),
            Error::Internal { op, what } => write!(f, "{op}: internal error: {what}"),
        }
    }
}

impl std::error::Error for Error {}

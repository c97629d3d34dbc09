//! hoccl: GPU collectives that take no SMs (copy engines driven by a CPU proxy) and, where
//! bandwidth is the bottleneck, lossless compression fused into the transfer.
//!
//! A [`Communicator`] is created collectively over a [`Bootstrap`] (MPI through
//! [`MpiBootstrap`], or threads of one process through [`ThreadBootstrap`]). Every
//! collective is stream-ordered and asynchronous, as NCCL's: it is enqueued on the caller's
//! stream, returns at once, starts after the work before it on that stream and finishes
//! before the work after it. Failures found later (a peer died, calls that do not match, a
//! timeout) come from [`Communicator::async_error`] and make later calls fail instead of
//! hang. Buffers are device pointers ([`DevPtr`]) of the communicator's [`Device`]: CUDA
//! memory on a GPU, or memory of the host backend, which runs the whole stack without a GPU.
//!
//! ```
//! use hoccl::{BackendChoice, Communicator, Config, DataType, ThreadBootstrap};
//!
//! // Two ranks as threads of this process, on the host backend.
//! let config = Config { backend: BackendChoice::Host, ..Config::default() };
//! let ranks: Vec<_> = ThreadBootstrap::group(2)
//!     .into_iter()
//!     .map(|b| {
//!         let config = config.clone();
//!         std::thread::spawn(move || -> hoccl::Result<Vec<u8>> {
//!             let comm = Communicator::with_bootstrap(Box::new(b), None, config)?;
//!             let dev = comm.device();
//!             let n = 4;
//!             let send = dev.alloc(n)?;
//!             let recv = dev.alloc(n * comm.size())?;
//!             dev.copy_from_host(send, &[comm.rank() as u8 + 1; 4])?;
//!             let stream = dev.create_stream()?;
//!             comm.all_gather(send, recv, n, DataType::U8, stream)?;
//!             dev.synchronize(stream)?;
//!             let mut out = vec![0; n * comm.size()];
//!             dev.copy_to_host(&mut out, recv)?;
//!             comm.wait_idle()?;
//!             dev.destroy_stream(stream)?;
//!             dev.free(send)?;
//!             dev.free(recv)?;
//!             Ok(out)
//!         })
//!     })
//!     .collect();
//! for r in ranks {
//!     assert_eq!(r.join().unwrap()?, [1, 1, 1, 1, 2, 2, 2, 2]);
//! }
//! # Ok::<(), hoccl::Error>(())
//! ```
//!
//! Under `mpirun`, one rank per process: `Communicator::world(Config::from_env()?)?`.
//!
//! The codec ([`compress`]) is usable on its own, on host buffers or on device buffers on a
//! stream:
//!
//! ```
//! use hoccl::compress::{self, Dtype, Params};
//!
//! let values: Vec<u8> = (0..4096u32).flat_map(|i| ((0x3f80 + i % 64) as u16).to_le_bytes()).collect();
//! let packed = compress::compress(Dtype::Bf16, &values, &Params::default())?;
//! assert!(packed.len() < values.len());
//! assert_eq!(compress::decompress(&packed)?, values);
//! # Ok::<(), hoccl::Error>(())
//! ```
//!
//! Layers (each only calls those below it; `docs/design.md`): `bootstrap`, `topology`,
//! `plan`, `sim`, `cost`, `engine`, `device`, `transport`, `compress`, `comm`, `ffi`. The engine,
//! the transports and the FFI layers are internal; C++ and C reach the library through
//! `include/hoccl/hoccl.hpp` and `include/hoccl/hoccl.h`.
pub mod bootstrap;
pub mod comm;
pub mod compress;
pub mod config;
pub mod cost;
pub mod device;
pub(crate) mod engine;
pub mod error;
pub(crate) mod ffi;
pub mod plan;
pub mod reduce;
pub mod sim;
pub mod sysfs;
pub mod topology;
pub(crate) mod transport;
pub mod types;

pub use bootstrap::mpi::{MpiBootstrap, Threading};
pub use bootstrap::tcp::{TcpBootstrap, UniqueId};
pub use bootstrap::thread::ThreadBootstrap;
pub use bootstrap::Bootstrap;
pub use comm::{Collective, Communicator, OpDesc};
pub use config::{BackendChoice, Config, EngineChoice};
pub use device::{Backend, DevPtr, Device, StreamHandle};
pub use error::{Error, ErrorCode, Result};
/// The pieces every foreign surface shares (hoccl's C ABI and C++ bridge, the
/// NCCL-compatible library): a communicator handle's life cycle, the panic guard of an entry
/// point, C rank arguments, and the registry, last error and groups of a C surface.
#[doc(hidden)]
pub use ffi::{guarded, rank_arg, surface, CommHandle};
pub use reduce::RedOp;
pub use types::DataType;

/// RDMA devices as libibverbs reports them (loaded at run time; none is an empty list, a
/// missing library an error), and the inter-node transport `HOCCL_NET` takes (`choose`):
/// diagnostics for the devices the verbs transport opens.
pub mod rdma {
    pub use crate::transport::verbs::{choose, gid_string, probe, usable, RdmaDeviceInfo, RdmaPortInfo};
}

/// Counters of the same-host transport's peer mappings (process-wide): transfers moved
/// through a bounce ring because stale mappings blocked an import, and stale or evicted
/// mappings closed while the process was quiet (`docs/design.md`, "Freed receive buffers
/// between processes").
pub mod ipc {
    pub use crate::transport::ipc::{bounced_transfers, retired_closed};
}

//! hoccl: GPU collectives that take no SMs (copy engines driven by a CPU proxy) and, where
//! bandwidth is the bottleneck, lossless compression fused into the transfer.
//!
//! Layers (each only calls those below it; see `docs/design.md`): `bootstrap`, `topology`, `plan`,
//! `sim`, `engine`, `device`, `transport`, `compress`, `comm`, `ffi`.
pub mod bootstrap;
pub mod comm;
pub mod compress;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod plan;
pub mod sim;
pub mod topology;
pub mod transport;
pub mod types;

pub use config::Config;
pub use error::{Error, ErrorCode, Result};
pub use types::DataType;

//! Point-to-point movers and the control channels between proxies.
//! - [`mailbox`]: shared-memory message rings between the proxies of one host ("buffer
//!   ready", "data landed", errors).
//! - [`ipc`]: same-host transfers straight into the peer's buffer (export/import cache; the
//!   copies themselves run on the device's copy-engine queues).
//! - [`verbs`]: RDMA (rdma-core via bindgen, loaded at run time).
pub mod ipc;
pub mod mailbox;
pub mod verbs;

//! Flow-level simulator of plans on a modeled cluster, with lower bounds and baselines.
//!
//! A plan becomes a task graph ([`fluid::Graph`]) on these resources: each NIC's send and
//! receive side (`nic_bw`; the receive side suffers [`Incast`]), each GPU's NVLink out and in
//! port (`nvlink_bw`), and each copy engine (`ce_bw`). Bandwidth is shared max-min fairly at
//! every instant (progressive filling), recomputed at every event.
//!
//! Fidelity choices, stated so the numbers can be judged:
//! - A route piece is cut into up to `segments` pipeline segments (never below the plan's
//!   chunk); each segment's sender copy, NIC transfer and receiver copies are separate tasks
//!   chained segment by segment, so the three hops overlap as with chunk pipelining.
//! - A copy engine executes one chunk at a time; the plan interleaves a stage's flows on an
//!   engine in proportion to their size, which over more than a few chunks is weighted
//!   sharing of the engine: the engine is a resource shared by weight = flow size, and each
//!   copy consumes `1 + ce_bw · ce_latency / chunk` of engine capacity per byte (the
//!   per-chunk start-up, `docs/design.md`: 2 MiB copies reach 273 of 397 GB/s).
//! - NIC transfers are posted ahead: a transfer's start-up latency (`nic_latency_s`) runs
//!   while the previous transfer of the same NIC is still moving bytes; a transfer starts when
//!   both its NICs have finished their previous stage's transfer (the receiver grants the
//!   next stage's staging slot when the current one fills) and its first segment is staged.
//!   Its rate is capped at `qps · chunk / qp_latency_s` (one chunk in flight per queue pair).
//! - Sender copies run ahead of the NIC into its staging buffer of `staging_bytes`, in the
//!   NIC's transfer order: a transfer's first segment is copied after the previous
//!   transfer's copies, once the transfers still occupying the buffer ahead of it leave room
//!   (counted per transfer).
#![forbid(unsafe_code)]

pub mod baseline;
pub mod exec;
pub mod fluid;

pub use fluid::{Graph, Incast, On, Outcome};

use crate::error::{Error, Result};

/// Cluster behaviour that the plan does not decide.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Model {
    pub incast: Incast,
    /// Post-to-first-byte latency of a NIC transfer.
    pub nic_latency_s: f64,
    /// Round trip of one message on a queue pair.
    pub qp_latency_s: f64,
    pub qps_per_peer: usize,
    /// Start-up cost of one chunk copy on a copy engine.
    pub ce_latency_s: f64,
    /// Pipeline segments per route piece.
    pub segments: usize,
    /// Staging buffer per sending NIC.
    pub staging_bytes: u64,
}

impl Default for Model {
    fn default() -> Self {
        Model { incast: Incast { loss: Incast::DEFAULT_LOSS }, nic_latency_s: 2e-6, qp_latency_s: 5e-6, qps_per_peer: 4, ce_latency_s: 2.4e-6, segments: 64, staging_bytes: 64 << 20 }
    }
}

impl Model {
    /// The same model with congestion off (pure fluid).
    pub fn fluid(mut self) -> Self {
        self.incast = Incast { loss: 0.0 };
        self
    }

    pub fn validate(&self) -> Result<()> {
        let l = self.incast.loss;
        if !(0.0..1.0).contains(&l) {
            return Err(Error::invalid_arg("sim::Model", format!("incast loss {l} must be in [0, 1)")));
        }
        let lat = [self.nic_latency_s, self.qp_latency_s, self.ce_latency_s];
        if lat.iter().any(|x| !(x.is_finite() && *x >= 0.0)) || self.qps_per_peer == 0 || self.segments == 0 || self.staging_bytes == 0 {
            return Err(Error::invalid_arg("sim::Model", "latencies must be >= 0, qps_per_peer, segments and staging_bytes > 0"));
        }
        Ok(())
    }
}

/// The result of simulating one schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimResult {
    pub completion_s: f64,
    pub tasks: usize,
    pub events: usize,
}

impl From<Outcome> for SimResult {
    fn from(o: Outcome) -> Self {
        SimResult { completion_s: o.makespan_s, tasks: o.tasks, events: o.events }
    }
}

//! The collective scheduler (paper §3.4, Algorithm 1), as pure data.
//!
//! `Collective` + `Cluster` → logical flows C → effective traffic T ([`Traffic`]: native
//! NVLink flows and inter-node routes with their forwarding copies) → [`Stage`]s (every stage
//! at most one outgoing and one incoming NIC flow per NIC, NVLink work packed into its slack)
//! → per-copy-engine queues of chunk copies and per-NIC queues of chunk transfers
//! ([`Plan::queues`]), the only interface the engine needs. Deterministic: the same inputs
//! give the same plan on every rank. See `docs/design.md` (Planner and simulator). Pure: no FFI, no I/O.
#![forbid(unsafe_code)]

pub mod bvn;
pub mod cluster;
pub mod collective;
pub mod exec;
pub mod json;
pub mod png;
pub mod queues;
pub mod rng;
pub mod schedule;
pub mod show;
pub mod stages;
pub mod traffic;
pub mod verify;

pub use cluster::{Cluster, CopyKind};
pub use collective::{zipf_sizes, Collective};
pub use queues::{interleave, CopyChunk, NicChunk, Queues};
pub use schedule::NicSlice;
pub use stages::{NativePiece, Stage, StageCost};
pub use traffic::{Bound, Hop, Loads, Native, Route, Traffic};

use crate::error::{Error, Result};

/// Planner knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Copy-engine and NIC work unit; flows are cut into chunks of this size (the last one
    /// shorter) and the chunks of one stage are interleaved per engine.
    pub chunk_bytes: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { chunk_bytes: 4 << 20 }
    }
}

/// A complete schedule for one collective on one cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub cluster: Cluster,
    /// Name of the collective (`alltoall`, …).
    pub collective: String,
    pub chunk_bytes: u64,
    pub traffic: Traffic,
    /// NIC transfers (route pieces), sorted by stage.
    pub nic: Vec<NicSlice>,
    /// Native NVLink pieces, sorted by stage.
    pub native_pieces: Vec<NativePiece>,
    pub stages: Vec<Stage>,
}

/// Builds the plan of collective `c` on cluster `cl`.
pub fn build(cl: &Cluster, c: &Collective, opt: &PlanOptions) -> Result<Plan> {
    cl.validate()?;
    c.validate(cl.num_gpus())?;
    if opt.chunk_bytes == 0 {
        return Err(Error::invalid_arg("plan::build", "chunk_bytes must be > 0"));
    }
    let traffic = Traffic::build(cl, c, opt.chunk_bytes);
    let (mut nic, nic_stages) = schedule::schedule_nics(cl, &traffic.routes);
    let (mut native_pieces, mut stages) = stages::assemble(cl, &traffic, &nic, nic_stages, opt.chunk_bytes);
    // The exact decomposition where its stages are predicted faster (skewed matrices).
    if let Some((bn, bs)) = bvn::schedule_nics(cl, &traffic.routes) {
        let (bp, bst) = stages::assemble(cl, &traffic, &bn, bs, opt.chunk_bytes);
        let est = |s: &[Stage]| s.iter().map(|x| x.cost.total()).sum::<f64>();
        if est(&bst) < est(&stages) * (1.0 - 1e-9) {
            (nic, native_pieces, stages) = (bn, bp, bst);
        }
    }
    Ok(Plan { cluster: cl.clone(), collective: c.name().to_string(), chunk_bytes: opt.chunk_bytes, traffic, nic, native_pieces, stages })
}

impl Plan {
    /// The lower bound of this plan's traffic: max over resources of bytes / bandwidth,
    /// forwarding copies included.
    pub fn bound(&self) -> Bound {
        Loads::of_traffic(&self.cluster, &self.traffic).bound(&self.cluster)
    }

    /// The paper's objective: Σ over stages of the slowest domain's time.
    pub fn estimate_s(&self) -> f64 {
        self.stages.iter().map(|s| s.cost.total()).sum()
    }

    pub fn stage_nic(&self, s: usize) -> &[NicSlice] {
        let (lo, hi) = self.stages[s].nic;
        &self.nic[lo..hi]
    }

    pub fn stage_natives(&self, s: usize) -> &[NativePiece] {
        let (lo, hi) = self.stages[s].native;
        &self.native_pieces[lo..hi]
    }

    /// The stage matrix T^s (G×G, row-major bytes): every effective flow of stage `s`.
    pub fn stage_matrix(&self, s: usize) -> Vec<u64> {
        let cl = &self.cluster;
        let g = cl.num_gpus();
        let mut m = vec![0u64; g * g];
        for x in self.stage_nic(s) {
            let r = &self.traffic.routes[x.route as usize];
            self.traffic.for_each_hop(cl, r, |a, b, _| m[a * g + b] += x.bytes);
        }
        for p in self.stage_natives(s) {
            let n = self.traffic.natives[p.native as usize];
            m[n.src as usize * g + n.dst as usize] += p.bytes;
        }
        m
    }
}

//! The plan layer's own view of a cluster: nodes of identical GPUs, NICs, the forwarding peer
//! map and the bandwidth of each domain. The runtime `topology` layer converts into this.
use crate::error::{Error, Result};

const OP: &str = "plan::Cluster";

/// A homogeneous cluster. GPUs are numbered `node * gpus_per_node + local`, NICs
/// `node * nics_per_node + nic`.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub nics_per_node: usize,
    /// `forwarding_peer[g]`: the local GPU whose NIC-affine staging buffer carries local GPU
    /// `g`'s inter-node traffic (ū in the paper). Identity means local staging.
    pub forwarding_peer: Vec<usize>,
    /// `nic_of_gpu[g]`: the local NIC that reads and writes local GPU `g`'s staging buffer.
    pub nic_of_gpu: Vec<usize>,
    /// Bytes/s of one NIC, per direction.
    pub nic_bw: f64,
    /// Bytes/s of one GPU's NVLink port, per direction (NVSwitch: full crossbar).
    pub nvlink_bw: f64,
    /// Bytes/s of one copy engine.
    pub ce_bw: f64,
    pub ce_per_gpu: usize,
    /// Routes may leave from and land on any NIC of their nodes, not only their ranks'
    /// forwarders' ([`super::traffic::Traffic::build`] spreads a skewed matrix's bytes over
    /// each node's NICs). Needs staging on every GPU that serves a NIC.
    pub balance_nics: bool,
}

impl Cluster {
    /// Defaults after the paper's testbed and the H200 measurements in `docs/design.md`: one
    /// 400 Gb/s NIC per GPU (50 GB/s), 400 GB/s NVLink per direction, copy engines of
    /// 397 GB/s, 3 per GPU, and the paper's forwarding pairs 0↔1, 2↔3, … (identity when the
    /// node has an odd number of GPUs).
    pub fn new(nodes: usize, gpus_per_node: usize) -> Self {
        let fwd = if gpus_per_node % 2 == 0 {
            (0..gpus_per_node).map(|g| g ^ 1).collect()
        } else {
            (0..gpus_per_node).collect()
        };
        Cluster {
            nodes,
            gpus_per_node,
            nics_per_node: gpus_per_node,
            forwarding_peer: fwd,
            nic_of_gpu: (0..gpus_per_node).collect(),
            nic_bw: 50e9,
            nvlink_bw: 400e9,
            ce_bw: 397e9,
            ce_per_gpu: 3,
            balance_nics: false,
        }
    }

    /// Same cluster with identity forwarding (every GPU stages through its own NIC).
    pub fn with_identity_forwarding(mut self) -> Self {
        self.forwarding_peer = (0..self.gpus_per_node).collect();
        self
    }

    pub fn validate(&self) -> Result<()> {
        let k = self.gpus_per_node;
        if self.nodes == 0 || k == 0 || self.nics_per_node == 0 {
            return Err(Error::invalid_arg(OP, "nodes, gpus_per_node and nics_per_node must be > 0"));
        }
        if self.num_gpus() > (u32::MAX / 4) as usize {
            return Err(Error::invalid_arg(OP, "too many GPUs"));
        }
        if self.forwarding_peer.len() != k || self.forwarding_peer.iter().any(|&p| p >= k) {
            return Err(Error::invalid_arg(OP, format!("forwarding_peer must list {k} local GPU indices < {k}")));
        }
        let nics = self.nics_per_node;
        if self.nic_of_gpu.len() != k || self.nic_of_gpu.iter().any(|&n| n >= nics) {
            return Err(Error::invalid_arg(OP, format!("nic_of_gpu must list {k} NIC indices < {nics}")));
        }
        for (name, v) in [("nic_bw", self.nic_bw), ("nvlink_bw", self.nvlink_bw), ("ce_bw", self.ce_bw)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::invalid_arg(OP, format!("{name} must be a positive number")));
            }
        }
        if self.ce_per_gpu == 0 {
            return Err(Error::invalid_arg(OP, "ce_per_gpu must be > 0"));
        }
        Ok(())
    }

    pub fn num_gpus(&self) -> usize {
        self.nodes * self.gpus_per_node
    }
    pub fn num_nics(&self) -> usize {
        self.nodes * self.nics_per_node
    }
    pub fn node_of(&self, gpu: usize) -> usize {
        gpu / self.gpus_per_node
    }
    pub fn local_of(&self, gpu: usize) -> usize {
        gpu % self.gpus_per_node
    }
    pub fn gpu(&self, node: usize, local: usize) -> usize {
        node * self.gpus_per_node + local
    }
    /// ū: the staging GPU (same node) that carries `gpu`'s inter-node traffic.
    pub fn staging_gpu(&self, gpu: usize) -> usize {
        self.gpu(self.node_of(gpu), self.forwarding_peer[self.local_of(gpu)])
    }
    /// The local GPU whose staging serves local NIC `nic` when a route is moved there: a
    /// GPU of that NIC that stages some GPU's traffic, else the first GPU of that NIC;
    /// None when no GPU uses the NIC.
    pub fn stager_of_nic(&self, nic: usize) -> Option<usize> {
        let on = |l: &usize| self.nic_of_gpu[*l] == nic;
        (0..self.gpus_per_node).filter(on).find(|l| self.forwarding_peer.contains(l)).or_else(|| (0..self.gpus_per_node).find(on))
    }
    /// The global NIC serving staging GPU `gpu`.
    pub fn nic_of(&self, gpu: usize) -> usize {
        self.node_of(gpu) * self.nics_per_node + self.nic_of_gpu[self.local_of(gpu)]
    }
    pub fn node_of_nic(&self, nic: usize) -> usize {
        nic / self.nics_per_node
    }
    /// The copy engine of `src` that executes a copy of `kind` towards `dst` (both global
    /// GPUs). A fixed rule, so every rank derives the same queues without talking: kinds go
    /// to different engines when there are enough, destinations spread over engines.
    pub fn engine_for(&self, kind: CopyKind, dst: usize) -> usize {
        (self.local_of(dst) + kind as usize) % self.ce_per_gpu
    }
}

/// The three kinds of copy-engine work (the paper's f, f′, f″ pieces that stay on a node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyKind {
    /// A native intra-node flow u → w over NVLink.
    Native = 0,
    /// The sender-side forwarding copy u → ū (f′).
    Send = 1,
    /// The receiver-side forwarding copy v̄ → v (f″).
    Recv = 2,
}

impl CopyKind {
    pub fn name(self) -> &'static str {
        match self {
            CopyKind::Native => "native",
            CopyKind::Send => "send",
            CopyKind::Recv => "recv",
        }
    }
}

/// Lookup tables of a cluster for the planner's hot loops (no divisions per flow).
pub(crate) struct Index {
    pub node: Vec<u32>,
    pub staging: Vec<u32>,
    /// Global NIC serving each GPU when it stages.
    pub nic: Vec<u32>,
    pub nic_node: Vec<u32>,
    pub nic_rail: Vec<u32>,
    /// `engine[kind * G + dst]`: engine used for a copy of `kind` towards `dst`.
    pub engine: Vec<u8>,
    nodes: u32,
    rails: u32,
    gpn: u32,
}

impl Index {
    pub fn new(cl: &Cluster) -> Index {
        let g = cl.num_gpus();
        let kinds = [CopyKind::Native, CopyKind::Send, CopyKind::Recv];
        Index {
            node: (0..g).map(|x| cl.node_of(x) as u32).collect(),
            staging: (0..g).map(|x| cl.staging_gpu(x) as u32).collect(),
            nic: (0..g).map(|x| cl.nic_of(x) as u32).collect(),
            nic_node: (0..cl.num_nics()).map(|a| (a / cl.nics_per_node) as u32).collect(),
            nic_rail: (0..cl.num_nics()).map(|a| (a % cl.nics_per_node) as u32).collect(),
            engine: kinds.iter().flat_map(|&k| (0..g).map(move |d| cl.engine_for(k, d) as u8)).collect(),
            nodes: cl.nodes as u32,
            rails: cl.nics_per_node as u32,
            gpn: cl.gpus_per_node as u32,
        }
    }
    /// The shift of NIC `b` relative to NIC `a`: node offset major, rail offset minor.
    #[inline]
    pub fn shift_key(&self, a: usize, b: usize) -> usize {
        let (nodes, k) = (self.nodes, self.rails);
        let mut dn = self.nic_node[b] + nodes - self.nic_node[a];
        if dn >= nodes {
            dn -= nodes;
        }
        let mut dr = self.nic_rail[b] + k - self.nic_rail[a];
        if dr >= k {
            dr -= k;
        }
        (dn * k + dr) as usize
    }
    /// v̄ of a route from `src` to `dst` (a node when `fan_out`).
    #[inline]
    pub fn recv_gpu(&self, fan_out: bool, src: u32, dst: u32) -> usize {
        if fan_out {
            (dst * self.gpn + self.staging[src as usize] % self.gpn) as usize
        } else {
            self.staging[dst as usize] as usize
        }
    }
    pub fn engine(&self, kind: CopyKind, dst: usize) -> usize {
        self.engine[kind as usize * self.node.len() + dst] as usize
    }
}

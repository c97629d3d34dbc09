//! C → T: logical flows become native NVLink flows and inter-node routes, each route carrying
//! its sender-side forwarding copy u → ū, its NIC transfer ū → v̄ and its receiver-side
//! copies v̄ → v (paper §3.4, "traffic matrix abstraction").
use super::cluster::{Cluster, CopyKind, Index};
use super::collective::Collective;

/// An intra-node logical flow, executed as one copy-engine copy over NVLink.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Native {
    pub src: u32,
    pub dst: u32,
    pub bytes: u64,
}

/// An inter-node logical flow (or, for shared payloads, one source's data for a whole node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// u: the GPU that owns the data.
    pub src: u32,
    /// ū: the NIC-affine staging GPU on the source node.
    pub send_gpu: u32,
    /// v̄: the staging GPU on the destination node where the NIC writes.
    pub recv_gpu: u32,
    /// v, or the destination node when `fan_out`.
    pub dst: u32,
    /// Delivered to every GPU of node `dst` (AllGather, Broadcast).
    pub fan_out: bool,
    pub bytes: u64,
}

/// One effective flow of T: a copy on one node, or a NIC transfer between staging GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    Copy(CopyKind),
    Nic,
}

/// The effective traffic of a collective: the paper's matrix T in list form.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    pub natives: Vec<Native>,
    pub routes: Vec<Route>,
}

impl Traffic {
    /// Expands collective `c` on cluster `cl` (both validated by the caller).
    pub fn build(cl: &Cluster, c: &Collective) -> Traffic {
        let g = cl.num_gpus();
        let mut t = Traffic::default();
        if c.shared_payload() {
            let mut last: Option<(usize, usize)> = None;
            c.for_each_flow(g, |u, v, b| {
                let (nu, nv) = (cl.node_of(u), cl.node_of(v));
                if nu == nv {
                    t.natives.push(Native { src: u as u32, dst: v as u32, bytes: b });
                } else if last != Some((u, nv)) {
                    // One NIC transfer per (source, destination node): rail-aligned, the
                    // receiving staging GPU has the same local index as ū.
                    last = Some((u, nv));
                    let su = cl.staging_gpu(u);
                    let recv = cl.gpu(nv, cl.local_of(su));
                    t.routes.push(Route { src: u as u32, send_gpu: su as u32, recv_gpu: recv as u32, dst: nv as u32, fan_out: true, bytes: b });
                }
            });
        } else {
            let ix = Index::new(cl);
            let node = &ix.node;
            let mut inter = 0usize;
            c.for_each_flow(g, |u, v, _| inter += usize::from(node[u] != node[v]));
            t.routes.reserve_exact(inter);
            c.for_each_flow(g, |u, v, b| {
                if node[u] == node[v] {
                    t.natives.push(Native { src: u as u32, dst: v as u32, bytes: b });
                } else {
                    t.routes.push(Route { src: u as u32, send_gpu: ix.staging[u], recv_gpu: ix.staging[v], dst: v as u32, fan_out: false, bytes: b });
                }
            });
        }
        t
    }

    pub fn total_bytes(&self) -> u64 {
        self.natives.iter().map(|n| n.bytes).sum::<u64>() + self.routes.iter().map(|r| r.bytes).sum::<u64>()
    }
}

impl Route {
    /// Calls `f(src_gpu, dst_gpu, hop)` for each effective flow that moves this route's bytes,
    /// in dependency order: the sender copy, the NIC transfer, then the receiver copies.
    /// A copy whose source and destination coincide is a local copy into (or out of) the
    /// registered staging buffer: copy-engine work without NVLink traffic.
    pub fn for_each_hop(&self, cl: &Cluster, mut f: impl FnMut(usize, usize, Hop)) {
        f(self.src as usize, self.send_gpu as usize, Hop::Copy(CopyKind::Send));
        f(self.send_gpu as usize, self.recv_gpu as usize, Hop::Nic);
        let r = self.recv_gpu as usize;
        if self.fan_out {
            let node = self.dst as usize;
            for l in 0..cl.gpus_per_node {
                f(r, cl.gpu(node, l), Hop::Copy(CopyKind::Recv));
            }
        } else {
            f(r, self.dst as usize, Hop::Copy(CopyKind::Recv));
        }
    }

    /// Final destinations of this route.
    pub fn destinations(&self, cl: &Cluster) -> Vec<usize> {
        if self.fan_out {
            (0..cl.gpus_per_node).map(|l| cl.gpu(self.dst as usize, l)).collect()
        } else {
            vec![self.dst as usize]
        }
    }
}

/// Bytes through every resource: the inputs of the lower bound.
#[derive(Clone, Debug)]
pub struct Loads {
    pub nic_out: Vec<f64>,
    pub nic_in: Vec<f64>,
    pub nvl_out: Vec<f64>,
    pub nvl_in: Vec<f64>,
    /// Copy-engine bytes issued by each GPU (all its engines together).
    pub ce: Vec<f64>,
}

impl Loads {
    pub fn new(cl: &Cluster) -> Self {
        let (g, n) = (cl.num_gpus(), cl.num_nics());
        Loads { nic_out: vec![0.0; n], nic_in: vec![0.0; n], nvl_out: vec![0.0; g], nvl_in: vec![0.0; g], ce: vec![0.0; g] }
    }

    /// Adds one effective flow of `bytes`.
    pub fn add(&mut self, cl: &Cluster, src: usize, dst: usize, hop: Hop, bytes: f64) {
        match hop {
            Hop::Nic => {
                self.nic_out[cl.nic_of(src)] += bytes;
                self.nic_in[cl.nic_of(dst)] += bytes;
            }
            Hop::Copy(_) => {
                self.ce[src] += bytes;
                if src != dst {
                    self.nvl_out[src] += bytes;
                    self.nvl_in[dst] += bytes;
                }
            }
        }
    }

    pub fn of_traffic(cl: &Cluster, t: &Traffic) -> Self {
        let mut l = Loads::new(cl);
        for n in &t.natives {
            l.add(cl, n.src as usize, n.dst as usize, Hop::Copy(CopyKind::Native), n.bytes as f64);
        }
        for r in &t.routes {
            r.for_each_hop(cl, |s, d, h| l.add(cl, s, d, h, r.bytes as f64));
        }
        l
    }

    /// max over resources of bytes / bandwidth, with the per-domain maxima.
    pub fn bound(&self, cl: &Cluster) -> Bound {
        let mx = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
        let nic = mx(&self.nic_out).max(mx(&self.nic_in)) / cl.nic_bw;
        let nvlink = mx(&self.nvl_out).max(mx(&self.nvl_in)) / cl.nvlink_bw;
        let ce = mx(&self.ce) / (cl.ce_bw * cl.ce_per_gpu as f64);
        Bound { nic_s: nic, nvlink_s: nvlink, ce_s: ce }
    }
}

/// The lower bound split by domain; `total()` is the bound itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    pub nic_s: f64,
    pub nvlink_s: f64,
    pub ce_s: f64,
}

impl Bound {
    pub fn total(&self) -> f64 {
        self.nic_s.max(self.nvlink_s).max(self.ce_s)
    }
}

/// The dense effective matrix T (G×G, row-major, bytes), for small clusters: natives and
/// copies on their NVLink cells, NIC transfers on the (ū, v̄) cell, local copies on the
/// diagonal.
pub fn t_matrix(cl: &Cluster, t: &Traffic) -> Vec<u64> {
    let g = cl.num_gpus();
    let mut m = vec![0u64; g * g];
    for n in &t.natives {
        m[n.src as usize * g + n.dst as usize] += n.bytes;
    }
    for r in &t.routes {
        r.for_each_hop(cl, |s, d, _| m[s * g + d] += r.bytes);
    }
    m
}

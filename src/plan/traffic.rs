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

/// An inter-node logical flow u → v (or, with `Traffic::fan_out`, u's data for every GPU of
/// node `dst`). Its staging GPUs follow from the cluster: ū = `staging_gpu(src)`, and
/// v̄ = `staging_gpu(dst)` (fan-out: the GPU of node `dst` with ū's local index, so the NIC
/// transfer stays on one rail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub src: u32,
    /// v, or the destination node with fan-out.
    pub dst: u32,
    pub bytes: u64,
}

/// One effective flow of T: a copy on one node, or a NIC transfer between staging GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    Copy(CopyKind),
    Nic,
}

/// The effective traffic of a collective: the paper's matrix T in list form. Routes are
/// ordered by NIC shift (node offset, then rail offset), then by sending NIC, so the routes
/// of one NIC pair are adjacent and the scheduler walks them in memory order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Every flow from one source carries the same payload: routes fan out on arrival.
    pub fan_out: bool,
    pub natives: Vec<Native>,
    pub routes: Vec<Route>,
}

impl Traffic {
    /// Expands collective `c` on cluster `cl` (both validated by the caller).
    pub fn build(cl: &Cluster, c: &Collective) -> Traffic {
        let g = cl.num_gpus();
        let ix = Index::new(cl);
        let mut t = Traffic { fan_out: c.shared_payload(), ..Default::default() };
        let k = cl.gpus_per_node;
        if let Collective::SendRecv { .. } = c {
            c.for_each_flow(g, |u, v, b| {
                if ix.node[u] == ix.node[v] {
                    t.natives.push(Native { src: u as u32, dst: v as u32, bytes: b });
                } else {
                    t.routes.push(Route { src: u as u32, dst: v as u32, bytes: b });
                }
            });
            let key = |r: &Route| {
                let (a, b) = (ix.nic[ix.staging[r.src as usize] as usize], ix.nic[ix.staging[r.dst as usize] as usize]);
                (ix.shift_key(a as usize, b as usize), a, r.src, r.dst)
            };
            t.routes.sort_by_key(key);
            return t;
        }
        for node in 0..cl.nodes {
            for lu in 0..k {
                for lv in 0..k {
                    let (u, v) = (node * k + lu, node * k + lv);
                    let b = c.pair_bytes(g, u, v);
                    if b > 0 {
                        t.natives.push(Native { src: u as u32, dst: v as u32, bytes: b });
                    }
                }
            }
        }
        // Locals grouped by the rail (local NIC) that serves their staging GPU.
        let nics = cl.nics_per_node;
        let mut by_rail: Vec<Vec<usize>> = vec![Vec::new(); nics];
        for l in 0..k {
            by_rail[cl.nic_of_gpu[cl.forwarding_peer[l]]].push(l);
        }
        let rails = if t.fan_out { 1 } else { nics };
        // Upper bound, exact for the uniform collectives; untouched capacity costs nothing.
        t.routes.reserve(if t.fan_out { g * (cl.nodes - 1) } else { g * (g - k) });
        for dn in 1..cl.nodes {
            for dr in 0..rails {
                for i in 0..cl.nodes {
                    let j = (i + dn) % cl.nodes;
                    for ra in 0..nics {
                        let rb = (ra + dr) % nics;
                        for &lu in &by_rail[ra] {
                            let u = i * k + lu;
                            if t.fan_out {
                                let b = (0..k).map(|lv| c.pair_bytes(g, u, j * k + lv)).max().unwrap_or(0);
                                if b > 0 {
                                    t.routes.push(Route { src: u as u32, dst: j as u32, bytes: b });
                                }
                                continue;
                            }
                            for &lv in &by_rail[rb] {
                                let b = c.pair_bytes(g, u, j * k + lv);
                                if b > 0 {
                                    t.routes.push(Route { src: u as u32, dst: (j * k + lv) as u32, bytes: b });
                                }
                            }
                        }
                    }
                }
            }
        }
        t
    }

    pub fn total_bytes(&self) -> u64 {
        self.natives.iter().map(|n| n.bytes).sum::<u64>() + self.routes.iter().map(|r| r.bytes).sum::<u64>()
    }

    /// ū of route `r`.
    pub fn send_gpu(&self, cl: &Cluster, r: &Route) -> usize {
        cl.staging_gpu(r.src as usize)
    }

    /// v̄ of route `r`.
    pub fn recv_gpu(&self, cl: &Cluster, r: &Route) -> usize {
        if self.fan_out {
            cl.gpu(r.dst as usize, cl.local_of(cl.staging_gpu(r.src as usize)))
        } else {
            cl.staging_gpu(r.dst as usize)
        }
    }

    /// Final destinations of route `r`.
    pub fn destinations(&self, cl: &Cluster, r: &Route) -> Vec<usize> {
        if self.fan_out {
            (0..cl.gpus_per_node).map(|l| cl.gpu(r.dst as usize, l)).collect()
        } else {
            vec![r.dst as usize]
        }
    }

    /// Calls `f(src_gpu, dst_gpu, hop)` for each effective flow that moves route `r`'s
    /// bytes, in dependency order: the sender copy u → ū, the NIC transfer ū → v̄, then the
    /// receiver copies v̄ → v. A copy whose source and destination coincide is a local copy
    /// into (or out of) the registered staging buffer: copy-engine work without NVLink.
    pub fn for_each_hop(&self, cl: &Cluster, r: &Route, mut f: impl FnMut(usize, usize, Hop)) {
        let (su, rv) = (self.send_gpu(cl, r), self.recv_gpu(cl, r));
        f(r.src as usize, su, Hop::Copy(CopyKind::Send));
        f(su, rv, Hop::Nic);
        for d in self.destinations(cl, r) {
            f(rv, d, Hop::Copy(CopyKind::Recv));
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
            t.for_each_hop(cl, r, |s, d, h| l.add(cl, s, d, h, r.bytes as f64));
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

    /// The NIC bound if every node's bytes between nodes were spread evenly over its NICs:
    /// max over nodes and directions of the node's NIC bytes / (NICs per node × NIC rate).
    /// At most `bound().nic_s`; the gap is what choosing a route's NICs per route (rather
    /// than through the per-GPU forwarding map) could gain on skewed traffic.
    pub fn node_spread_nic_s(&self, cl: &Cluster) -> f64 {
        let k = cl.nics_per_node;
        let per_node = |v: &[f64]| v.chunks(k).map(|c| c.iter().sum::<f64>()).fold(0.0, f64::max);
        per_node(&self.nic_out).max(per_node(&self.nic_in)) / (k as f64 * cl.nic_bw)
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
        t.for_each_hop(cl, r, |s, d, _| m[s * g + d] += r.bytes);
    }
    m
}

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
/// node `dst`), or a part of one, and its staging GPUs: ū = `staging_gpu(src)`, and
/// v̄ = `staging_gpu(dst)` (fan-out: the GPU of node `dst` with ū's local index, so the NIC
/// transfer stays on one rail), unless [`Cluster::balance_nics`] moved the route to other
/// NICs of its nodes. A route carries the flow's bytes `[offset, offset + bytes)`; a flow
/// split over several NIC pairs is several routes whose ranges tile `[0, flow bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub src: u32,
    /// v, or the destination node with fan-out.
    pub dst: u32,
    /// Where this route's bytes start in the flow's payload (0 unless the flow is split).
    pub offset: u64,
    pub bytes: u64,
    /// ū: the GPU whose NIC sends the route (on u's node).
    pub su: u32,
    /// v̄: the GPU whose NIC receives it (on v's node).
    pub rv: u32,
}

/// One effective flow of T: a copy on one node, or a NIC transfer between staging GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    Copy(CopyKind),
    Nic,
}

/// The effective traffic of a collective: the paper's matrix T in list form. Routes are
/// ordered by NIC shift (node offset, then rail offset), then by sending NIC, so the routes
/// of one NIC pair are adjacent and the scheduler walks them in memory order (the parts of
/// one flow by offset).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Every flow from one source carries the same payload: routes fan out on arrival.
    pub fan_out: bool,
    pub natives: Vec<Native>,
    pub routes: Vec<Route>,
}

impl Traffic {
    /// Expands collective `c` on cluster `cl` (both validated by the caller). `chunk`: the
    /// planner's chunk, the preferred cut of a split route ([`Cluster::balance_nics`]).
    pub fn build(cl: &Cluster, c: &Collective, chunk: u64) -> Traffic {
        let g = cl.num_gpus();
        let ix = Index::new(cl);
        let mut t = Traffic { fan_out: c.shared_payload(), ..Default::default() };
        let k = cl.gpus_per_node;
        if let Collective::SendRecv { .. } = c {
            c.for_each_flow(g, |u, v, b| {
                if ix.node[u] == ix.node[v] {
                    t.natives.push(Native { src: u as u32, dst: v as u32, bytes: b });
                } else {
                    t.routes.push(Route { src: u as u32, dst: v as u32, offset: 0, bytes: b, su: ix.staging[u], rv: ix.staging[v] });
                }
            });
            // Routes move whole: a batch may send one pair several transfers, and parts of
            // them could not be told apart.
            if cl.balance_nics {
                balance(cl, &ix, &mut t.routes);
            }
            sort_by_nic_pair(&ix, &mut t.routes);
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
                                    t.routes.push(Route { src: u as u32, dst: j as u32, offset: 0, bytes: b, su: ix.staging[u], rv: ix.recv_gpu(true, u as u32, j as u32) as u32 });
                                }
                                continue;
                            }
                            for &lv in &by_rail[rb] {
                                let b = c.pair_bytes(g, u, j * k + lv);
                                if b > 0 {
                                    let v = j * k + lv;
                                    t.routes.push(Route { src: u as u32, dst: v as u32, offset: 0, bytes: b, su: ix.staging[u], rv: ix.staging[v] });
                                }
                            }
                        }
                    }
                }
            }
        }
        if cl.balance_nics && !t.fan_out {
            let moved = balance(cl, &ix, &mut t.routes);
            if split(cl, &ix, &mut t.routes, chunk) || moved {
                sort_by_nic_pair(&ix, &mut t.routes);
            }
        }
        t
    }

    /// How many flows are split over several routes (parts after the first start past 0).
    pub fn split_flows(&self) -> usize {
        let mut split: Vec<(u32, u32)> = self.routes.iter().filter(|r| r.offset > 0).map(|r| (r.src, r.dst)).collect();
        split.sort_unstable();
        split.dedup();
        split.len()
    }

    pub fn total_bytes(&self) -> u64 {
        self.natives.iter().map(|n| n.bytes).sum::<u64>() + self.routes.iter().map(|r| r.bytes).sum::<u64>()
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
        let (su, rv) = (r.su as usize, r.rv as usize);
        f(r.src as usize, su, Hop::Copy(CopyKind::Send));
        f(su, rv, Hop::Nic);
        for d in self.destinations(cl, r) {
            f(rv, d, Hop::Copy(CopyKind::Recv));
        }
    }
}
/// Routes in the order the scheduler walks them: by NIC shift (node offset, then rail
/// offset) of their (ū, v̄) NICs, then by sending NIC, so the routes of one NIC pair are
/// adjacent.
fn sort_by_nic_pair(ix: &Index, routes: &mut [Route]) {
    routes.sort_by_key(|r| {
        let (a, b) = (ix.nic[r.su as usize] as usize, ix.nic[r.rv as usize] as usize);
        (ix.shift_key(a, b), a, r.src, r.dst, r.offset)
    });
}

/// Moves routes (whole) to other NICs of their nodes while that lowers the busiest NIC
/// port (a NIC's sending or receiving side): take the busiest port, and of its routes and
/// the other NICs of its node that serve a stager ([`Cluster::stager_of_nic`]), the move
/// that leaves the lower of the two ports' new loads the smallest, provided the target
/// stays below the busiest; repeat until no such move exists. Each move lowers the sum of
/// the squared port loads, so this ends; a matrix whose ports are even (uniform traffic)
/// moves nothing. Returns whether a route moved.
fn balance(cl: &Cluster, ix: &Index, routes: &mut [Route]) -> bool {
    let nics = cl.nics_per_node;
    if nics < 2 || routes.is_empty() {
        return false;
    }
    let stager: Vec<Option<usize>> = (0..nics).map(|n| cl.stager_of_nic(n)).collect();
    let na = cl.num_nics();
    // Port loads: [nic] sending, [na + nic] receiving.
    let mut load = vec![0u64; 2 * na];
    for r in routes.iter() {
        load[ix.nic[r.su as usize] as usize] += r.bytes;
        load[na + ix.nic[r.rv as usize] as usize] += r.bytes;
    }
    let mut moved = false;
    for _ in 0..routes.len().min(4096) {
        let (p, lmax) = load.iter().copied().enumerate().max_by_key(|&(i, l)| (l, std::cmp::Reverse(i))).unwrap_or((0, 0));
        let sending = p < na;
        let nic = p % na;
        let node = nic / nics;
        let mut best: Option<(u64, usize, usize)> = None; // (new max of the two ports, route, target NIC)
        for (i, r) in routes.iter().enumerate() {
            let at = if sending { ix.nic[r.su as usize] } else { ix.nic[r.rv as usize] } as usize;
            if at != nic || r.bytes == 0 {
                continue;
            }
            for q in (node * nics..(node + 1) * nics).filter(|&q| q != nic && stager[q % nics].is_some()) {
                let target = load[if sending { q } else { na + q }] + r.bytes;
                let m = target.max(lmax - r.bytes);
                if target < lmax && best.is_none_or(|b| m < b.0) {
                    best = Some((m, i, q));
                }
            }
        }
        let Some((_, i, q)) = best else { break };
        let g = cl.gpu(node, stager[q % nics].unwrap_or(0)) as u32;
        let r = &mut routes[i];
        if sending {
            load[nic] -= r.bytes;
            load[q] += r.bytes;
            r.su = g;
        } else {
            load[na + nic] -= r.bytes;
            load[na + q] += r.bytes;
            r.rv = g;
        }
        moved = true;
    }
    moved
}


/// Splits routes where moving them whole ([`balance`]) leaves a NIC port above the level
/// that spreading every node's bytes evenly over its NICs reaches: the level G is the
/// largest over nodes and directions of ⌈the node's NIC bytes / its NICs that serve a
/// stager⌉. Per node and direction, while its busiest port p is above G: with q the
/// least loaded other port and need = min(p − G, G − q), the largest route of p that fits
/// in need moves whole; else the largest route of p gives its first `need` bytes (cut at a
/// multiple of `chunk` from the route's start when need ≥ `chunk`, so parts stay whole
/// chunks) to a new route on q, provided need is at least `tol / (ports − 1)`, with
/// tol = min(chunk, ⌈G / 64⌉): every port ends below G + tol, within one chunk of the even
/// spread. The sending and the receiving side are independent (a route's ū only loads its
/// node's sending ports). A matrix whose ports are even (uniform traffic) splits nothing.
/// Returns whether a route moved or split.
fn split(cl: &Cluster, ix: &Index, routes: &mut Vec<Route>, chunk: u64) -> bool {
    let nics = cl.nics_per_node;
    if nics < 2 || routes.is_empty() {
        return false;
    }
    let chunk = chunk.max(1);
    let stager: Vec<Option<usize>> = (0..nics).map(|n| cl.stager_of_nic(n)).collect();
    let ports = stager.iter().filter(|s| s.is_some()).count() as u64;
    if ports < 2 {
        return false;
    }
    let na = cl.num_nics();
    let port_of = |r: &Route, sending: bool| if sending { ix.nic[r.su as usize] as usize } else { na + ix.nic[r.rv as usize] as usize };
    let mut load = vec![0u64; 2 * na];
    for r in routes.iter() {
        load[port_of(r, true)] += r.bytes;
        load[port_of(r, false)] += r.bytes;
    }
    let level = (0..2 * cl.nodes).map(|gi| load[gi * nics..(gi + 1) * nics].iter().sum::<u64>().div_ceil(ports)).max().unwrap_or(0);
    let tol = chunk.min(level.div_ceil(64).max(1));
    let min_part = (tol / (ports - 1)).max(1);
    let mut changed = false;
    // Groups of ports: the sending ports of each node, then the receiving ports of each.
    for gi in 0..2 * cl.nodes {
        let sending = gi < cl.nodes;
        let node = gi % cl.nodes;
        let group: Vec<usize> = (0..nics).filter(|&l| stager[l].is_some()).map(|l| gi * nics + l).collect();
        // The routes on this group's ports (new parts join it).
        let mut on: Vec<usize> = (0..routes.len()).filter(|&i| port_of(&routes[i], sending) / nics == gi).collect();
        for _ in 0..4 * group.len() * group.len() + 64 {
            let p = group.iter().copied().max_by_key(|&x| (load[x], std::cmp::Reverse(x))).unwrap_or(0);
            let q = group.iter().copied().filter(|&x| x != p).min_by_key(|&x| (load[x], x)).unwrap_or(p);
            let need = load[p].saturating_sub(level).min(level.saturating_sub(load[q]));
            if need == 0 {
                break;
            }
            // (bytes, index) of the largest route of p that fits in `need`, and of the largest.
            let (mut fit, mut big): (Option<(u64, usize)>, Option<(u64, usize)>) = (None, None);
            for &i in &on {
                let r = &routes[i];
                if r.bytes == 0 || port_of(r, sending) != p {
                    continue;
                }
                let key = Some((r.bytes, i));
                if r.bytes <= need && fit.is_none_or(|f| r.bytes > f.0) {
                    fit = key;
                }
                if big.is_none_or(|b| r.bytes > b.0) {
                    big = key;
                }
            }
            let (i, x) = match (fit, big) {
                (Some((b, i)), _) => (i, b),
                (None, Some((_, i))) if need >= min_part => (i, if need >= chunk { need / chunk * chunk } else { need }),
                _ => break,
            };
            let g = cl.gpu(node, stager[(q - gi * nics) % nics].unwrap_or(0)) as u32;
            let r = &mut routes[i];
            let mut part = *r;
            part.bytes = x;
            r.offset += x;
            r.bytes -= x;
            if sending {
                part.su = g;
            } else {
                part.rv = g;
            }
            if r.bytes == 0 {
                *r = part;
            } else {
                on.push(routes.len());
                routes.push(part);
            }
            load[p] -= x;
            load[q] += x;
            changed = true;
        }
    }
    changed
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

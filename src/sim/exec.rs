//! Plans (and the naive all-at-once schedule of the same traffic) as task graphs.
use super::fluid::{Graph, On};
use super::{Model, SimResult};
use crate::error::Result;
use crate::plan::{Cluster, CopyKind, Plan, Route, Traffic};

/// Resource numbering inside a graph.
pub(crate) struct Res {
    n: u32,
    g: u32,
    ce: u32,
}

impl Res {
    pub(crate) fn new(graph: &mut Graph, cl: &Cluster) -> Res {
        let (n, g) = (cl.num_nics(), cl.num_gpus());
        for (count, cap, incast) in [(n, cl.nic_bw, false), (n, cl.nic_bw, true), (2 * g, cl.nvlink_bw, false), (g * cl.ce_per_gpu, cl.ce_bw, false)] {
            for _ in 0..count {
                graph.resource(cap, incast);
            }
        }
        Res { n: n as u32, g: g as u32, ce: cl.ce_per_gpu as u32 }
    }
    pub(crate) fn nic_out(&self, a: usize) -> u32 {
        a as u32
    }
    pub(crate) fn nic_in(&self, b: usize) -> u32 {
        self.n + b as u32
    }
    pub(crate) fn nvl_out(&self, x: usize) -> u32 {
        2 * self.n + x as u32
    }
    pub(crate) fn nvl_in(&self, x: usize) -> u32 {
        2 * self.n + self.g + x as u32
    }
    fn ce(&self, x: usize, e: usize) -> u32 {
        2 * self.n + 2 * self.g + x as u32 * self.ce + e as u32
    }

    /// Uses of a copy from `src` to each of `dsts` (one task copying to all of them).
    fn copy_uses(&self, cl: &Cluster, kind: CopyKind, src: usize, dsts: &[usize], ce_coef: f64) -> Vec<(u32, f64)> {
        let mut u: Vec<(u32, f64)> = Vec::new();
        let mut add = |r: u32, c: f64| match u.iter_mut().find(|x| x.0 == r) {
            Some(x) => x.1 += c,
            None => u.push((r, c)),
        };
        for &d in dsts {
            add(self.ce(src, cl.engine_for(kind, d)), ce_coef);
            if d != src {
                add(self.nvl_out(src), 1.0);
                add(self.nvl_in(d), 1.0);
            }
        }
        u
    }
}

/// Capacity a copy of `chunk`-byte pieces takes from its engine per byte moved.
fn ce_coef(cl: &Cluster, m: &Model, chunk: f64) -> f64 {
    1.0 + cl.ce_bw * m.ce_latency_s / chunk.max(1.0)
}

/// Segment sizes of a piece of `bytes`.
fn segments(bytes: u64, chunk: u64, max: usize) -> Vec<u64> {
    let n = bytes.div_ceil(chunk.max(1)).clamp(1, max as u64);
    let base = bytes / n;
    (0..n).map(|i| if i + 1 == n { bytes - base * (n - 1) } else { base }).collect()
}

/// The tasks of one route piece: (first NIC task, last NIC task).
struct PieceTasks {
    first_n: u32,
    last_n: u32,
    last_s: u32,
}

/// NIC ordering state of a schedule: the previous transfer of each NIC's two sides, and
/// the recent transfers of each sending NIC (bytes, last NIC task) still holding its staging
/// buffer.
struct NicOrder {
    prev_out: Vec<Option<PieceTasks>>,
    prev_in: Vec<Option<u32>>,
    staged: Vec<std::collections::VecDeque<(u64, u32)>>,
}

impl NicOrder {
    fn new(nics: usize) -> Self {
        NicOrder { prev_out: (0..nics).map(|_| None).collect(), prev_in: vec![None; nics], staged: vec![Default::default(); nics] }
    }

    /// The NIC task whose completion frees enough of NIC `a`'s staging buffer for the next
    /// transfer's first segment: the newest earlier transfer such that it and the transfers
    /// after it fill `window` bytes.
    fn staging_gate(&mut self, a: usize, window: u64) -> Option<u32> {
        let q = &mut self.staged[a];
        let mut sum = 0u64;
        for (i, &(b, t)) in q.iter().enumerate().rev() {
            sum += b;
            if sum >= window {
                q.drain(..i); // older transfers can never gate again
                return Some(t);
            }
        }
        None
    }
}

#[allow(clippy::too_many_arguments)]
/// Adds one route piece; `fifo` (naive schedule) is the sender copy this piece's first
/// sender copy must follow on the same engine. Returns the piece's last sender copy.
fn add_piece(graph: &mut Graph, res: &Res, cl: &Cluster, m: &Model, chunk: u64, t: &Traffic, r: &Route, bytes: u64, order: Option<&mut NicOrder>, fifo: Option<u32>) -> u32 {
    let weighted = fifo.is_none() && order.is_some();
    let (u, su, rv) = (r.src as usize, r.su as usize, r.rv as usize);
    let dsts = t.destinations(cl, r);
    let (a, b) = (cl.nic_of(su), cl.nic_of(rv));
    let w = if weighted { bytes as f64 } else { 1.0 };
    let segs = segments(bytes, chunk, m.segments);
    let (mut prev_s, mut prev_n, mut prev_r) = (None::<u32>, None::<u32>, None::<u32>);
    let mut first_n = 0;
    let prev = order.as_ref().and_then(|o| o.prev_out[a].as_ref().map(|p| (p.first_n, p.last_n, p.last_s)));
    let prev_in = order.as_ref().and_then(|o| o.prev_in[b]);
    let mut order = order;
    let gate = order.as_mut().and_then(|o| o.staging_gate(a, m.staging_bytes));
    for &sb in &segs {
        let c = chunk.min(sb) as f64;
        let coef = ce_coef(cl, m, c);
        let s = graph.task(sb as f64, w, &res.copy_uses(cl, CopyKind::Send, u, &[su], coef));
        let n = graph.task(sb as f64, 1.0, &[(res.nic_out(a), 1.0), (res.nic_in(b), 1.0)]);
        let rr = graph.task(sb as f64, w, &res.copy_uses(cl, CopyKind::Recv, rv, &dsts, coef));
        if m.qp_latency_s > 0.0 {
            graph.set_rate_cap(n, m.qps_per_peer as f64 * c / m.qp_latency_s);
        }
        graph.after(n, s, On::Finish, 0.0);
        graph.after(rr, n, On::Finish, 0.0);
        match (prev_s, prev_n, prev_r) {
            (Some(ps), Some(pn), Some(pr)) => {
                graph.after(s, ps, On::Finish, 0.0);
                graph.after(n, pn, On::Finish, 0.0);
                graph.after(rr, pr, On::Finish, 0.0);
            }
            _ => {
                first_n = n;
                if let Some(f) = fifo.filter(|&f| f != u32::MAX) {
                    graph.after(s, f, On::Finish, 0.0);
                }
                if let Some(gt) = gate {
                    graph.after(s, gt, On::Finish, 0.0);
                }
                match prev {
                    Some((pf, pl, ps)) => {
                        // The copies feeding one NIC are issued in its transfer order.
                        graph.after(s, ps, On::Finish, 0.0);
                        graph.after(n, pf, On::Start, m.nic_latency_s);
                        graph.after(n, pl, On::Finish, 0.0);
                    }
                    None => graph.set_earliest(n, m.nic_latency_s),
                }
                if let Some(pi) = prev_in {
                    graph.after(n, pi, On::Finish, 0.0);
                }
            }
        }
        (prev_s, prev_n, prev_r) = (Some(s), Some(n), Some(rr));
    }
    if let (Some(o), Some(last_n)) = (order, prev_n) {
        o.prev_out[a] = Some(PieceTasks { first_n, last_n, last_s: prev_s.unwrap_or(0) });
        o.prev_in[b] = Some(last_n);
        o.staged[a].push_back((bytes, last_n));
    }
    prev_s.unwrap_or(0)
}

/// Relative weight of native NVLink pieces against forwarding copies in a plan.
pub const NATIVE_WEIGHT: f64 = 1e-3;

/// The task graph of a plan, executed stage by stage on every NIC, without global barriers.
pub fn plan_graph(plan: &Plan, m: &Model) -> Graph {
    let cl = &plan.cluster;
    let mut graph = Graph::new();
    let res = Res::new(&mut graph, cl);
    let mut order = NicOrder::new(cl.num_nics());
    for s in 0..plan.stages.len() {
        for x in plan.stage_nic(s) {
            let r = &plan.traffic.routes[x.route as usize];
            add_piece(&mut graph, &res, cl, m, plan.chunk_bytes, &plan.traffic, r, x.bytes, Some(&mut order), None);
        }
    }
    let mut last_piece: Vec<Option<u32>> = vec![None; plan.traffic.natives.len()];
    for p in &plan.native_pieces {
        let n = plan.traffic.natives[p.native as usize];
        let coef = ce_coef(cl, m, plan.chunk_bytes.min(p.bytes) as f64);
        // Native work fills the slack that forwarding copies leave (they feed the NIC
        // pipeline): it shares NVLink and engines at a small weight, taking what is idle.
        let t = graph.task(p.bytes as f64, p.bytes as f64 * NATIVE_WEIGHT, &res.copy_uses(cl, CopyKind::Native, n.src as usize, &[n.dst as usize], coef));
        if let Some(prev) = last_piece[p.native as usize] {
            graph.after(t, prev, On::Finish, 0.0);
        }
        last_piece[p.native as usize] = Some(t);
    }
    graph
}

/// The same traffic (forwarding copies included) with every flow started at once: no
/// stages and no NIC ordering; each engine serves its sender copies in arrival order.
/// The naive schedule has no stages to pipeline across; 8 segments per route capture its
/// chunk pipelining (64 moves its completion by < 0.1% on 8x8 Zipf traffic) and keep the
/// simulation of a million concurrent flows tractable.
pub const NAIVE_SEGMENTS: usize = 8;

pub fn naive_graph(plan: &Plan, m: &Model) -> Graph {
    let m = &Model { segments: m.segments.min(NAIVE_SEGMENTS), ..*m };
    let cl = &plan.cluster;
    let mut graph = Graph::new();
    let res = Res::new(&mut graph, cl);
    // Each engine takes its sender copies first come, first served (in route order); NIC
    // transfers and receiver copies all run at once, sharing fairly.
    let mut last_send: Vec<Option<u32>> = vec![None; cl.num_gpus() * cl.ce_per_gpu];
    for r in &plan.traffic.routes {
        let (u, su) = (r.src as usize, r.su as usize);
        let slot = u * cl.ce_per_gpu + cl.engine_for(CopyKind::Send, su);
        let prev = last_send[slot].unwrap_or(u32::MAX);
        let fifo = if prev == u32::MAX { None } else { Some(prev) };
        let last = add_piece(&mut graph, &res, cl, m, plan.chunk_bytes, &plan.traffic, r, r.bytes, None, Some(fifo.unwrap_or(u32::MAX)));
        last_send[slot] = Some(last);
    }
    for n in &plan.traffic.natives {
        let coef = ce_coef(cl, m, plan.chunk_bytes.min(n.bytes) as f64);
        graph.task(n.bytes as f64, 1.0, &res.copy_uses(cl, CopyKind::Native, n.src as usize, &[n.dst as usize], coef));
    }
    graph
}

/// Simulates `plan` under model `m`.
pub fn simulate_plan(plan: &Plan, m: &Model) -> Result<SimResult> {
    m.validate()?;
    Ok(plan_graph(plan, m).run(m.incast).into())
}

/// Simulates the naive all-at-once schedule of `plan`'s traffic under model `m`.
pub fn simulate_naive(plan: &Plan, m: &Model) -> Result<SimResult> {
    m.validate()?;
    Ok(naive_graph(plan, m).run(m.incast).into())
}

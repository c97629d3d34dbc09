//! NCCL-style baselines in the same model: SM-driven transfers straight from user buffers
//! (no forwarding copies, no copy engines), each GPU on its own NIC.
//! - AlltoAll/AlltoAllv: the pairwise schedule (step s: rank u sends to u+s, receives from
//!   u−s; a step starts when the rank's previous send and its receiver's previous receive are
//!   done).
//! - AllGather: rings, one per NIC rail; each ring edge carries (G−1)/rings of every rank's
//!   contribution, all edges streaming at once, plus (G−1) step latencies.
//! - Broadcast: a pipelined chain from the root per rail, plus (G−1) step latencies.
//! - Send/recv batches: every pair at once.
use super::exec::Res;
use super::fluid::{Graph, On};
use super::{Model, SimResult};
use crate::error::Result;
use crate::plan::{Cluster, Collective};

fn link(graph: &mut Graph, res: &Res, cl: &Cluster, x: usize, y: usize, bytes: f64) -> u32 {
    if cl.node_of(x) == cl.node_of(y) {
        graph.task(bytes, 1.0, &[(res.nvl_out(x), 1.0), (res.nvl_in(y), 1.0)])
    } else {
        graph.task(bytes, 1.0, &[(res.nic_out(cl.nic_of(x)), 1.0), (res.nic_in(cl.nic_of(y)), 1.0)])
    }
}

fn pairwise(graph: &mut Graph, res: &Res, cl: &Cluster, c: &Collective, m: &Model) {
    let g = cl.num_gpus();
    let sizes = c.matrix(g);
    let mut prev: Vec<Option<u32>> = vec![None; g]; // task sent by u in the previous step
    for s in 1..g {
        let mut cur = vec![None; g];
        for u in 0..g {
            let v = (u + s) % g;
            let t = link(graph, res, cl, u, v, sizes[u * g + v] as f64);
            match prev[u] {
                Some(p) => {
                    graph.after(t, p, On::Start, m.nic_latency_s);
                    graph.after(t, p, On::Finish, 0.0);
                }
                None => graph.set_earliest(t, m.nic_latency_s),
            }
            // v's previous receive came from v − (s − 1).
            if let Some(p) = prev[(v + g - (s - 1)) % g] {
                graph.after(t, p, On::Finish, 0.0);
            }
            cur[u] = Some(t);
        }
        prev = cur;
    }
}

/// Ring order of channel `c`: every node in turn, its GPUs starting at local `c`.
fn ring(cl: &Cluster, c: usize) -> Vec<usize> {
    let k = cl.gpus_per_node;
    (0..cl.nodes).flat_map(|i| (0..k).map(move |j| i * k + (c + j) % k)).collect()
}

/// Builds the NCCL-style baseline of `c` and its name; the result includes the fixed step
/// latencies of rings and chains.
pub fn simulate_nccl(cl: &Cluster, c: &Collective, m: &Model) -> Result<(&'static str, SimResult)> {
    m.validate()?;
    cl.validate()?;
    let g = cl.num_gpus();
    c.validate(g)?;
    let mut graph = Graph::new();
    let res = Res::new(&mut graph, cl);
    let k = cl.gpus_per_node;
    let mut extra = 0.0;
    let name = match c {
        Collective::AlltoAll { .. } | Collective::AlltoAllv { .. } => {
            pairwise(&mut graph, &res, cl, c, m);
            "pairwise"
        }
        Collective::AllGather { bytes } => {
            let per_edge = (g as f64 - 1.0) * (bytes / g as u64) as f64 / k as f64;
            for ch in 0..k {
                let order = ring(cl, ch);
                for i in 0..g {
                    let t = link(&mut graph, &res, cl, order[i], order[(i + 1) % g], per_edge);
                    graph.set_earliest(t, m.nic_latency_s);
                }
            }
            extra = (g as f64 - 1.0) * m.nic_latency_s;
            "ring"
        }
        Collective::Broadcast { root, bytes } => {
            for ch in 0..k {
                let mut order = ring(cl, ch);
                let at = order.iter().position(|x| x == root).unwrap_or(0);
                order.rotate_left(at);
                for i in 0..g.saturating_sub(1) {
                    let t = link(&mut graph, &res, cl, order[i], order[i + 1], *bytes as f64 / k as f64);
                    graph.set_earliest(t, m.nic_latency_s);
                }
            }
            extra = (g as f64 - 1.0) * m.nic_latency_s;
            "ring"
        }
        Collective::SendRecv { .. } => {
            c.for_each_flow(g, |u, v, b| {
                let t = link(&mut graph, &res, cl, u, v, b as f64);
                graph.set_earliest(t, m.nic_latency_s);
            });
            "direct"
        }
    };
    let mut r: SimResult = graph.run(m.incast).into();
    r.completion_s += extra;
    Ok((name, r))
}

//! Inter-node AllGather, AlltoAll, AlltoAllv, Broadcast, Gather and Scatter as the planner's
//! stages, through the forwarding peers (docs/design.md, "Inter-node path"). The op becomes
//! a [`plan::Collective`] on the cluster the topology describes, the planner cuts it into
//! stages (at most one outgoing and one incoming NIC flow per NIC each), [`exec::lower`]
//! turns the stages into steps, and this rank enqueues its part as one engine op whose
//! transfers wait for the ones they depend on ([`exec::dataflow`], an ordered op), or,
//! under the compressed engine, one op per step. Every rank derives the same plan from the
//! same inputs, and both ends of a transfer list it at the same place, so the engine's
//! pair matching pairs them. Plans are cached per (op, sizes, element size). A
//! call takes the direct path instead when its largest flow between nodes is below
//! `Config::staged_min_flow_bytes` (one socket chunk: its flows cross as single frames
//! either way), or when the plan is not predicted faster than the direct sends (every rank
//! decides alike: the flows and the model are the same on every rank).
//!
//! The cluster: the topology's nodes, each padded to the largest node's rank count (a
//! missing rank is a GPU with no flows), one NIC per rank, each rank's forwarding peer
//! taken from the topology when every node agrees on it by local rank (else every rank
//! stages through itself). Nodes of different sizes move AllGather and Broadcast as
//! per-destination flows (the planner's fan-out lands on one GPU of every node by local
//! index, which a smaller node may lack).
//!
//! A forwarding rank receives its peers' pieces into its staging (device memory,
//! `Config::forward_staging_bytes`, four slots, allocated once per communicator at
//! creation) and a receiving forwarder drains its receive slots
//! into its peers' buffers; the dataflow op's waits (or the step order) keep each slot
//! idle → filled → on the NIC → idle. A staged op on another stream of this rank first waits for the flag the
//! last staged op that used the staging raised, so two streams never share the slots.
use super::guard::Guarded;
use super::op::{Collective, OpDesc};
use super::{Communicator, Region, State};
use crate::device::StreamHandle;
use crate::engine::{Dep, Fill, Order, Transfer};
use crate::error::{Error, Result};
use crate::plan::exec::{self, At, Move};
use crate::plan::{self, Collective as Flows, Loads, PlanOptions, Traffic};
use crate::transport::relay::RelayCounts;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The planner's interleave unit, in bytes (converted to elements per call).
const PLAN_CHUNK: usize = 4 << 20;
/// Plans kept per communicator; the cache is emptied when it is full.
const CACHE_PLANS: usize = 64;
/// Names the AlltoAllv counts exchange in its errors.
const OP_EXCHANGE: &str = "all_to_allv (counts exchange)";

/// How the ranks map onto the planner's homogeneous cluster.
pub(super) struct Layout {
    cluster: plan::Cluster,
    /// By rank: its cluster GPU (`node * k + local`).
    gpu: Vec<u32>,
    /// By cluster GPU: its rank (None: padding of a smaller node).
    rank: Vec<Option<usize>>,
    /// Every node has as many ranks.
    even: bool,
    /// Some rank forwards through another.
    forwards: bool,
}

impl Layout {
    fn of(c: &Communicator) -> Layout {
        let nodes: Vec<&[usize]> = c.topo.nodes().iter().map(|n| &n.ranks[..]).filter(|r| !r.is_empty()).collect();
        let k = nodes.iter().map(|r| r.len()).max().unwrap_or(1);
        let mut gpu = vec![0u32; c.size];
        let mut rank = vec![None; nodes.len() * k];
        let mut map: Vec<Option<usize>> = vec![None; k];
        let mut agree = true;
        for (j, rs) in nodes.iter().enumerate() {
            for (l, &r) in rs.iter().enumerate() {
                gpu[r] = (j * k + l) as u32;
                rank[j * k + l] = Some(r);
                let f = c.topo.ranks()[r].forwarding_peer;
                let fl = rs.iter().position(|x| *x == f).unwrap_or(l);
                agree &= *map[l].get_or_insert(fl) == fl;
            }
        }
        let fwd: Vec<usize> = if agree { map.iter().enumerate().map(|(l, f)| f.unwrap_or(l)).collect() } else { (0..k).collect() };
        if !agree {
            log::debug!("rank {}: nodes disagree on forwarding peers by local rank: every rank stages through itself", c.rank);
        }
        let bw = c.topo.bandwidths();
        let nic = if c.config.net_gbps > 0.0 { c.config.net_gbps * 1e9 } else { bw.nic };
        let mut cluster = plan::Cluster::new(nodes.len(), k);
        cluster.forwarding_peer = fwd;
        cluster.nic_bw = nic;
        cluster.nvlink_bw = bw.nvlink;
        cluster.ce_bw = bw.copy_engine;
        cluster.ce_per_gpu = bw.copy_engines_per_gpu.max(1);
        let forwards = cluster.forwarding_peer.iter().enumerate().any(|(l, f)| l != *f);
        let even = nodes.iter().all(|r| r.len() == k);
        // Routes may use any NIC of their nodes (every rank of a node serves one) when
        // every cluster GPU is a rank: a padding GPU has no staging to carry them.
        cluster.balance_nics = c.config.forward_balance && even && k > 1;
        Layout { cluster, gpu, rank, even, forwards }
    }
}

/// A cached plan: the call's flows (element units) and element size.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    kind: u8,
    root: usize,
    count: usize,
    sizes: Vec<u64>,
    es: usize,
}

/// This rank's part of a lowered plan: per op, the moves it sends or receives, in the
/// plan's order, and the same moves as one op whose transfers wait for each other (`flow`,
/// its waits as the engine takes them in `order`).
struct Mine {
    ops: Vec<Vec<Move>>,
    flow: exec::Dataflow,
    order: Arc<Order>,
    /// Whether any of them reads or writes this rank's staging.
    slots: bool,
    /// Whether the plan splits a flow over several NIC pairs (`Route::offset`).
    split: bool,
    stages: usize,
    steps: usize,
    /// Predicted completion of the plan and of the direct path's sends ([`predict`]),
    /// without the ops' fixed costs.
    planned_us: f64,
    direct_us: f64,
}

impl Mine {
    /// The predicted completion of the staged and the direct path, in µs, each op's fixed
    /// cost `fixed_us` included: the staged plan in one op (`ordered`) or one op per step,
    /// the direct path in one.
    fn predicted(&self, ordered: bool, fixed_us: f64) -> (f64, f64) {
        let ops = if ordered { 1 } else { self.ops.len() };
        (self.planned_us + ops as f64 * fixed_us, self.direct_us + fixed_us)
    }
}

/// The staged path must be predicted at least this much faster than the direct one.
const STAGED_GAIN: f64 = 0.98;

/// The predicted completion, in µs, of `plan` (the planner's objective: the sum over its
/// stages of the slowest domain) and of the same flows sent directly, at their best (the
/// busiest NIC port's bytes at full rate: every flow at once from each rank's own NIC,
/// perfectly shared, a shared payload once per destination rank, no staging copies, since
/// the socket transport reads and writes the user buffers; on CUDA both paths cross the
/// transport's pinned host staging alike). Both take time linear in the flows, unlike the
/// simulator (`sim`), which takes seconds on clusters of 64 GPUs.
fn predict(cl: &plan::Cluster, flows: &Flows, plan: &plan::Plan) -> (f64, f64) {
    let g = cl.num_gpus();
    let direct_flows = match flows {
        Flows::AllGather { bytes } => Flows::AlltoAll { bytes: *bytes },
        Flows::Broadcast { root, bytes } => Flows::AlltoAllv { sizes: (0..g * g).map(|i| if i / g == *root && i % g != *root { *bytes } else { 0 }).collect() },
        f => f.clone(),
    };
    let mut identity = cl.clone().with_identity_forwarding();
    identity.ce_bw = 1e18;
    identity.balance_nics = false;
    let direct = Loads::of_traffic(&identity, &Traffic::build(&identity, &direct_flows, 1)).bound(&identity).total();
    (plan.estimate_s() * 1e6, direct * 1e6)
}

/// Per-communicator state of the staged path (inside the communicator's lock).
#[derive(Default)]
pub(super) struct Staged {
    layout: Option<Arc<Layout>>,
    cache: HashMap<Key, Arc<Mine>>,
    /// A forwarder's staging (four slots) and the flag its staged ops raise.
    staging: Option<Guarded>,
    /// Calls that ran staged.
    calls: u64,
    /// Staged calls whose plan split a flow over several NIC pairs.
    split_calls: u64,
}

/// The element counts every rank sends and expects in an AlltoAllv, from the exchange.
pub(super) struct Counts {
    /// `send[u][v]`: elements rank u sends to rank v.
    send: Vec<Vec<usize>>,
}

/// Bytes of one staging slot: a quarter of the staging, rounded down to 256 bytes.
fn slot_bytes(staging: usize) -> usize {
    (staging / 4) & !255
}

/// The transfer of `len` bytes at `off` within `t`, to or from `peer`.
fn sub(name: &'static str, t: &Transfer, off: usize, len: usize, peer: usize) -> Result<Transfer> {
    match off.checked_add(len) {
        Some(end) if end <= t.len => Ok(Transfer { peer, ptr: t.ptr.add(off), len, alloc: t.alloc, fill: Fill::Exact, forward: false }),
        _ => Err(Error::internal(name, format!("staged piece {off}+{len} exceeds its {}-byte range", t.len))),
    }
}

impl Communicator {
    /// Whether `op` runs the staged plan: ranks on several nodes, `HOCCL_FORWARDING` on, a
    /// movement collective (point-to-point calls involve two ranks only, so no plan over
    /// every rank and no forwarder can take part), no group open (a group is one op), and a
    /// stream not being captured (the plan's ops and staging are per call).
    pub(super) fn stages(&self, op: &OpDesc) -> Result<bool> {
        let movement = matches!(
            op.coll,
            Collective::AllGather | Collective::AllToAll | Collective::AllToAllV { .. } | Collective::Broadcast { .. } | Collective::Gather { .. } | Collective::Scatter { .. }
        );
        if !movement || !self.config.forwarding || self.size < 2 || self.topo.nnodes() < 2 {
            return Ok(false);
        }
        let name = op.coll.name();
        if self.lock(name)?.group.depth > 0 {
            return Ok(false);
        }
        Ok(!self.dev.stream_capturing(op.stream).map_err(|e| e.with_op(name))?)
    }

    /// AlltoAllv's plan needs every rank's counts: all-gathered over the bootstrap before
    /// the call is validated, so a rank whose own arguments are refused still takes part
    /// (its peers then wait on the op, as on the direct path). Counts that disagree between
    /// two ranks are refused on every rank alike.
    pub(super) fn exchange_counts(&self, send_counts: &[usize], recv_counts: &[usize]) -> Result<Counts> {
        let n = self.size;
        let ok = send_counts.len() == n && recv_counts.len() == n;
        let mut mine = Vec::with_capacity(8 * (2 * n + 1));
        mine.extend_from_slice(&u64::from(ok).to_le_bytes());
        if ok {
            send_counts.iter().chain(recv_counts).for_each(|c| mine.extend_from_slice(&(*c as u64).to_le_bytes()));
        }
        let all = self.bootstrap.all_gather(&mine).map_err(|e| e.with_op(OP_EXCHANGE))?;
        let word = |b: &[u8], i: usize| -> Option<usize> { b.get(8 * i..8 * i + 8).map(|w| u64::from_le_bytes(w.try_into().unwrap_or([0; 8])) as usize) };
        let mut send = Vec::with_capacity(n);
        let mut recv = Vec::with_capacity(n);
        for (u, b) in all.iter().enumerate() {
            if word(b, 0) != Some(1) || b.len() != 8 * (2 * n + 1) {
                return Err(Error::invalid_arg("all_to_allv", format!("rank {u} passed count arrays of the wrong length")));
            }
            send.push((0..n).map(|v| word(b, 1 + v).unwrap_or(0)).collect::<Vec<_>>());
            recv.push((0..n).map(|v| word(b, 1 + n + v).unwrap_or(0)).collect::<Vec<_>>());
        }
        for u in 0..n {
            for v in 0..n {
                if send[u][v] != recv[v][u] {
                    return Err(Error::invalid_arg(
                        "all_to_allv",
                        format!("rank {u} sends {} elements to rank {v}, which expects {}", send[u][v], recv[v][u]),
                    ));
                }
            }
        }
        Ok(Counts { send })
    }

    /// The call's flows on the layout's cluster, in elements, and its cache key.
    fn flows(&self, lay: &Layout, op: &OpDesc, counts: Option<&Counts>) -> Result<(Flows, Key)> {
        let (n, g, c) = (self.size, lay.rank.len(), op.count);
        let gpu = |r: usize| lay.gpu[r] as usize;
        let matrix = |f: &dyn Fn(usize, usize) -> usize| {
            let mut m = vec![0u64; g * g];
            for u in 0..n {
                for v in (0..n).filter(|v| *v != u) {
                    m[gpu(u) * g + gpu(v)] = f(u, v) as u64;
                }
            }
            m
        };
        let (kind, root, flows) = match op.coll {
            Collective::AllGather if lay.even => (0, 0, Flows::AllGather { bytes: (c * g) as u64 }),
            Collective::AllGather => (1, 0, Flows::AlltoAllv { sizes: matrix(&|_, _| c) }),
            Collective::AllToAll if lay.even => (2, 0, Flows::AlltoAll { bytes: (c * g) as u64 }),
            Collective::AllToAll => (3, 0, Flows::AlltoAllv { sizes: matrix(&|_, _| c) }),
            Collective::AllToAllV { .. } => {
                let k = counts.ok_or_else(|| Error::internal("all_to_allv", "staged without the counts exchange"))?;
                (4, 0, Flows::AlltoAllv { sizes: matrix(&|u, v| k.send[u][v]) })
            }
            Collective::Broadcast { root } if lay.even => (5, root, Flows::Broadcast { root: gpu(root), bytes: c as u64 }),
            Collective::Broadcast { root } => (6, root, Flows::AlltoAllv { sizes: matrix(&|u, _| if u == root { c } else { 0 }) }),
            Collective::Gather { root } => (7, root, Flows::AlltoAllv { sizes: matrix(&|_, v| if v == root { c } else { 0 }) }),
            Collective::Scatter { root } => (8, root, Flows::AlltoAllv { sizes: matrix(&|u, _| if u == root { c } else { 0 }) }),
            _ => return Err(Error::internal(op.coll.name(), "not a staged collective")),
        };
        // Only AlltoAllv needs its sizes in the key; the others are known from the count.
        let sizes = match &flows {
            Flows::AlltoAllv { sizes } if kind == 4 => sizes.clone(),
            _ => Vec::new(),
        };
        Ok((flows, Key { kind, root, count: c, sizes, es: op.dtype.size() }))
    }

    /// This rank's part of the plan of `flows`, from the cache or built now.
    fn plan_for(&self, st: &mut State, lay: &Layout, name: &'static str, flows: Flows, key: Key) -> Result<Arc<Mine>> {
        if let Some(m) = st.internode.cache.get(&key) {
            return Ok(m.clone());
        }
        let es = key.es;
        // The plan counts elements: bandwidths per element keep its times in seconds.
        let mut cl = lay.cluster.clone();
        let per = es as f64;
        (cl.nic_bw, cl.nvlink_bw, cl.ce_bw) = (cl.nic_bw / per, cl.nvlink_bw / per, cl.ce_bw / per);
        let opt = PlanOptions { chunk_bytes: (PLAN_CHUNK / es).max(1) as u64 };
        let plan = plan::build(&cl, &flows, &opt).map_err(|e| e.with_op(name))?;
        let (planned_us, direct_us) = predict(&cl, &flows, &plan);
        // Slots where some route stages on another GPU than its own ends.
        let fan = plan.traffic.fan_out;
        let staged = lay.forwards || plan.traffic.routes.iter().any(|r| r.su != r.src || (!fan && r.rv != r.dst));
        let slot = staged.then(|| (slot_bytes(self.config.forward_staging_bytes) / es).max(1) as u64);
        let steps = exec::lower(&plan, slot);
        let me = lay.gpu[self.rank];
        let flow = exec::dataflow(&steps, lay.cluster.gpus_per_node, me);
        let dep = |d: &exec::Dep| match *d {
            exec::Dep::Send(i) => Dep::Send(i as usize),
            exec::Dep::Recv(i) => Dep::Recv(i as usize),
        };
        let waits = |a: &[Vec<exec::Dep>]| a.iter().map(|w| w.iter().map(dep).collect()).collect();
        let order = Arc::new(Order { send_after: waits(&flow.send_after), recv_after: waits(&flow.recv_after) });
        let ops: Vec<Vec<Move>> = steps.ops.iter().map(|op| op.iter().filter(|m| m.from == me || m.to == me).copied().collect()).collect();
        let slots = ops.iter().flatten().any(|m| (m.from == me && matches!(m.src, At::Slot { .. })) || (m.to == me && matches!(m.dst, At::Slot { .. })));
        let split = plan.traffic.split_flows() > 0;
        let mine = Arc::new(Mine { ops, flow, order, slots, split, stages: steps.stages, steps: steps.steps, planned_us, direct_us });
        if st.internode.cache.len() >= CACHE_PLANS {
            st.internode.cache.clear();
        }
        st.internode.cache.insert(key, mine.clone());
        Ok(mine)
    }

    /// How many calls of this communicator ran the planner's stages (the others of the six
    /// collectives sent directly): which path ran, for tests and diagnostics.
    pub fn staged_calls(&self) -> Result<u64> {
        Ok(self.lock("staged_calls")?.internode.calls)
    }

    /// How many of the staged calls split a flow between nodes over several NIC pairs
    /// (`HOCCL_FORWARD_BALANCE`), as this rank counts them; every rank runs the same plan.
    pub fn staged_split_calls(&self) -> Result<u64> {
        Ok(self.lock("staged_split_calls")?.internode.split_calls)
    }

    /// This rank's relays so far (`transport::relay`): point-to-point sends it handed to its
    /// forwarding peer, those of them the peer could not carry (sent directly), and the
    /// sends of other ranks it carried, with their bytes; the same for receives (landed by
    /// the forwarding peer, `recv_*`).
    pub fn relay_counts(&self) -> RelayCounts {
        self.engine.shared.relays.snapshot()
    }

    /// The layout, computed once.
    fn layout(&self, st: &mut State) -> Arc<Layout> {
        st.internode.layout.get_or_insert_with(|| Arc::new(Layout::of(self))).clone()
    }

    /// Allocate the forwarding staging now if this rank forwards another rank's traffic, or
    /// may carry routes moved to its NIC (`Cluster::balance_nics`: every rank of a node of
    /// several ranks), and the staged path is on. Creation calls it, so the staging never comes into being
    /// while another rank's collective is pending (ranks that are threads of one process on
    /// one GPU would stall each other, docs/design.md, "Several ranks in one process on one
    /// GPU").
    pub(super) fn reserve_forward_staging(&self) -> Result<()> {
        const OP: &str = "Communicator::new";
        if !self.config.forwarding || self.size < 2 || self.topo.nnodes() < 2 {
            return Ok(());
        }
        let mut st = self.lock(OP)?;
        let lay = self.layout(&mut st);
        let k = lay.cluster.gpus_per_node;
        let mine = lay.gpu[self.rank] as usize % k;
        if lay.cluster.balance_nics || lay.cluster.forwarding_peer.iter().enumerate().any(|(l, f)| l != *f && *f == mine) {
            self.forward_staging(&mut st, OP)?;
        }
        Ok(())
    }

    /// Run a validated movement collective as the planner's stages (see the module's
    /// contract). `sends` and `recvs` are the call's byte ranges by peer, as the direct
    /// path would submit them; `counts` the AlltoAllv exchange.
    pub(super) fn run_staged(&self, name: &'static str, op: &OpDesc, counts: Option<&Counts>, sends: Vec<Transfer>, recvs: Vec<Transfer>) -> Result<()> {
        let mut st = self.lock(name)?;
        let lay = self.layout(&mut st);
        let (flows, key) = self.flows(&lay, op, counts)?;
        let es = key.es;
        // Small calls stay direct: every rank sees the same flows, so all decide alike.
        let g = lay.rank.len();
        let mut largest = 0u64;
        flows.for_each_flow(g, |u, v, b| {
            if lay.cluster.node_of(u) != lay.cluster.node_of(v) {
                largest = largest.max(b);
            }
        });
        if !self.config.stage_every_call && (largest as usize).saturating_mul(es) < self.config.staged_min_flow_bytes {
            drop(st);
            return self.submit(name, op.stream, op.dtype, sends, recvs);
        }
        let mine = self.plan_for(&mut st, &lay, name, flows, key)?;
        // Uncompressed, the plan runs as one op whose transfers wait for each other (each
        // slot's state); the compressed engine codes each hop's data on the stream when it
        // reaches the op, so a slot must be filled by an earlier op: one op per step.
        let ordered = self.compress_from.for_dtype(op.dtype).is_none();
        // Each op's fixed cost counts (rank 0's model, so every rank decides alike).
        let (planned_us, direct_us) = mine.predicted(ordered, self.cost_model.ce_fixed_us);
        // Only where a gain is predicted: a uniform exchange with every rank its own
        // forwarder moves the same bytes either way, and its stages would only make the
        // ranks wait for each other.
        if !self.config.stage_every_call && planned_us >= STAGED_GAIN * direct_us {
            log::debug!("rank {}: {name} direct: predicted {planned_us:.1} µs staged, {direct_us:.1} µs direct", self.rank);
            drop(st);
            return self.submit(name, op.stream, op.dtype, sends, recvs);
        }
        st.internode.calls += 1;
        st.internode.split_calls += u64::from(mine.split);
        let n = self.size;
        let mut send_of: Vec<Option<Transfer>> = vec![None; n];
        let mut recv_of: Vec<Option<Transfer>> = vec![None; n];
        let (mut own_sends, mut own_recvs) = (Vec::new(), Vec::new());
        for t in sends {
            if t.peer == self.rank {
                own_sends.push(t);
            } else if t.peer < n {
                send_of[t.peer] = Some(t);
            }
        }
        for t in recvs {
            if t.peer == self.rank {
                own_recvs.push(t);
            } else if t.peer < n {
                recv_of[t.peer] = Some(t);
            }
        }
        let slots = if mine.slots { Some(self.forward_staging(&mut st, name)?) } else { None };
        log::debug!(
            "rank {}: {name} staged: {} stages, {} steps, {}, forwarding {}{}, predicted {planned_us:.1} µs ({direct_us:.1} µs direct)",
            self.rank,
            mine.stages,
            mine.steps,
            if ordered {
                format!("one op of {} sends and {} receives", mine.flow.sends.len(), mine.flow.recvs.len())
            } else {
                format!("{} ops with this rank", mine.ops.iter().filter(|o| !o.is_empty()).count())
            },
            if lay.forwards { "on" } else { "identity" },
            if mine.split { ", flows split over NIC pairs" } else { "" },
        );
        let s = op.stream;
        if slots.is_some() {
            self.wait_for_staging(&mut st, s).map_err(|e| e.with_op(name))?;
        }
        let rank_of = |g: u32| lay.rank[g as usize].ok_or_else(|| Error::internal(name, format!("plan names padding GPU {g}")));
        let place = |at: At, bytes: usize, peer: usize| -> Result<Transfer> {
            match at {
                At::Send { dst, off, .. } => {
                    let t = send_of[rank_of(dst)?].as_ref().ok_or_else(|| Error::internal(name, "plan sends a flow the call does not have"))?;
                    sub(name, t, off as usize * es, bytes, peer)
                }
                At::Recv { src, off, .. } => {
                    let t = recv_of[rank_of(src)?].as_ref().ok_or_else(|| Error::internal(name, "plan receives a flow the call does not have"))?;
                    sub(name, t, off as usize * es, bytes, peer)
                }
                At::Slot { slot, off } => {
                    let (region, sb) = slots.ok_or_else(|| Error::internal(name, "plan uses staging this rank did not allocate"))?;
                    region.part(slot as usize * sb + off as usize * es, bytes, peer)
                }
            }
        };
        let me = lay.gpu[self.rank];
        let mut submitted = false;
        let mut run_ordered = |st: &mut State| -> Result<()> {
            let f = &mine.flow;
            let mut sends = f.sends.iter().map(|m| place(m.src, m.bytes as usize * es, rank_of(m.to)?)).collect::<Result<Vec<_>>>()?;
            let mut recvs = f.recvs.iter().map(|m| place(m.dst, m.bytes as usize * es, rank_of(m.from)?)).collect::<Result<Vec<_>>>()?;
            // The copies to self go last: the order indexes the transfers to peers.
            sends.append(&mut own_sends);
            recvs.append(&mut own_recvs);
            self.launch_ordered(st, name, s, sends, recvs, mine.order.clone())
        };
        if ordered {
            run_ordered(&mut st)?;
            return self.staging_used(&mut st, name, s, slots.is_some());
        }
        let mut run = |st: &mut State| -> Result<()> {
            let mut first = true;
            for ops in &mine.ops {
                let (mut sends, mut recvs) = (Vec::new(), Vec::new());
                if first {
                    // The copies to self go with the first op.
                    sends.append(&mut own_sends);
                    recvs.append(&mut own_recvs);
                    first = false;
                }
                for m in ops {
                    let bytes = m.bytes as usize * es;
                    if m.from == me {
                        sends.push(place(m.src, bytes, rank_of(m.to)?)?);
                    }
                    if m.to == me {
                        recvs.push(place(m.dst, bytes, rank_of(m.from)?)?);
                    }
                }
                if !sends.is_empty() || !recvs.is_empty() {
                    self.launch(st, name, s, Some(op.dtype), sends, recvs)?;
                    submitted = true;
                }
            }
            if !own_sends.is_empty() || !own_recvs.is_empty() {
                self.launch(st, name, s, Some(op.dtype), std::mem::take(&mut own_sends), std::mem::take(&mut own_recvs))?;
            }
            Ok(())
        };
        let r = run(&mut st);
        if let (Err(e), true) = (&r, submitted) {
            // The peers' matching ops of the later steps cannot complete.
            self.engine.shared.set_error(e.clone());
        }
        r?;
        self.staging_used(&mut st, name, s, slots.is_some())
    }

    /// After a staged call's ops on `s`: when they use the staging (`used`), raise its flag
    /// behind them, so a staged op on another stream waits for them.
    fn staging_used(&self, st: &mut State, name: &'static str, s: StreamHandle, used: bool) -> Result<()> {
        if used {
            let sg = st.internode.staging.as_mut().ok_or_else(|| Error::internal(name, "staging vanished"))?;
            sg.last = Some(s);
            self.dev.write_value(s, sg.flag.dev_addr(0), sg.uses + 1).map_err(|e| e.with_op(name))?;
            sg.uses += 1;
        }
        Ok(())
    }

    /// This rank's forwarding staging (allocated now if it has none) and its slot size.
    fn forward_staging(&self, st: &mut State, name: &'static str) -> Result<(Region, usize)> {
        if st.internode.staging.is_none() {
            let slot = slot_bytes(self.config.forward_staging_bytes);
            let (base, region, flag) = self.alloc_guarded(name, "staged collective", "forwarding staging", 4 * slot)?;
            log::debug!("rank {}: forwarding staging of {} bytes (4 slots of {slot})", self.rank, 4 * slot);
            st.internode.staging = Some(Guarded { base, region, slot, flag, uses: 0, last: None });
        }
        let sg = st.internode.staging.as_ref().ok_or_else(|| Error::internal(name, "staging vanished"))?;
        Ok((sg.region, sg.slot))
    }

    /// Before a staged op that uses the staging on `s`: if the last one was on another
    /// stream, make `s` wait until it is done.
    fn wait_for_staging(&self, st: &mut State, s: StreamHandle) -> Result<()> {
        let Some(sg) = st.internode.staging.as_ref() else { return Ok(()) };
        self.wait_for_last_use(s, sg.last, &sg.flag, sg.uses)
    }

    /// At teardown: free the staging once every staged op that used it is done.
    pub(super) fn release_forward_staging(&self, st: &mut State, bound: Duration) {
        let Some(sg) = st.internode.staging.take() else { return };
        self.free_after_last_use(sg.base, sg.region.len, sg.flag, sg.uses, bound, "forwarding staging");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_a_quarter_in_whole_256_byte_units() {
        assert_eq!(slot_bytes(16 << 20), 4 << 20);
        assert_eq!(slot_bytes(64 << 10), 16 << 10);
        assert_eq!(slot_bytes((64 << 10) + 1000) % 256, 0);
    }
}

//! An event-driven fluid simulator with max-min fair sharing (progressive filling).
//!
//! A [`Graph`] holds resources (a capacity in bytes/s) and tasks (bytes to move, a weight,
//! the resources they use with a coefficient each, and dependencies on other tasks' start or
//! finish, with a lag). At every event the rates of the tasks connected to a changed resource
//! are recomputed by weighted progressive filling: all unfrozen tasks of the component grow
//! at rate `weight · λ`; the resource (or task rate cap) that saturates first freezes its
//! tasks; repeat. Resources flagged `incast` lose capacity when several tasks use them at
//! once (see [`Incast`]).
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Receiver congestion: a NIC receiving `m ≥ 1` flows at once delivers
/// `η(m) = 1 − loss · (1 − 1/m)` of its line rate (η(1) = 1, η(∞) = 1 − loss).
///
/// Default `loss = 0.37`, from Xue et al., "Dart: Divide and Specialize for Fast Response to
/// Congestion in RDMA-based Datacenter Networks" (IEEE/ACM ToN 2020, arXiv:1805.11158): under
/// incast, receiver-side exact rate apportioning reached 58% higher throughput than DCQCN and
/// TIMELY at scale, i.e. the deployed RDMA congestion control kept 1/1.58 ≈ 63% of what an
/// ideal receiver-driven share delivers. `loss = 0` is a pure fluid model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Incast {
    pub loss: f64,
}

impl Incast {
    pub const DEFAULT_LOSS: f64 = 0.37;
    pub fn efficiency(&self, m: usize) -> f64 {
        if m <= 1 {
            1.0
        } else {
            1.0 - self.loss * (1.0 - 1.0 / m as f64)
        }
    }
}

/// A time (or level) ordered by `f64::total_cmp`, usable in heaps.
#[derive(Clone, Copy)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// When a dependency is satisfied: at the predecessor's start or at its finish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    Start,
    Finish,
}

/// A task graph on a set of resources.
#[derive(Default)]
pub struct Graph {
    cap: Vec<f64>,
    incast: Vec<bool>,
    bytes: Vec<f64>,
    weight: Vec<f64>,
    rate_cap: Vec<f64>,
    earliest: Vec<f64>,
    use_start: Vec<u32>,
    uses: Vec<(u32, f64)>,
    edges: Vec<(u32, u32, On, f64)>,
}

/// What a run measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    /// Time the last task finished.
    pub makespan_s: f64,
    pub tasks: usize,
    /// Distinct event times processed.
    pub events: usize,
}

impl Graph {
    pub fn new() -> Self {
        Graph { use_start: vec![0], ..Default::default() }
    }
    pub fn resource(&mut self, cap: f64, incast: bool) -> u32 {
        self.cap.push(cap);
        self.incast.push(incast);
        self.cap.len() as u32 - 1
    }
    /// A task moving `bytes` through `uses` (resource, bytes of capacity consumed per byte).
    pub fn task(&mut self, bytes: f64, weight: f64, uses: &[(u32, f64)]) -> u32 {
        self.bytes.push(bytes.max(0.0));
        self.weight.push(weight.max(1e-30));
        self.rate_cap.push(f64::INFINITY);
        self.earliest.push(0.0);
        self.uses.extend_from_slice(uses);
        self.use_start.push(self.uses.len() as u32);
        self.bytes.len() as u32 - 1
    }
    pub fn set_rate_cap(&mut self, t: u32, cap: f64) {
        self.rate_cap[t as usize] = cap;
    }
    pub fn set_earliest(&mut self, t: u32, at: f64) {
        self.earliest[t as usize] = at;
    }
    /// `succ` may start only `lag` seconds after `pred`'s start or finish.
    pub fn after(&mut self, succ: u32, pred: u32, on: On, lag: f64) {
        self.edges.push((pred, succ, on, lag));
    }
    pub fn num_tasks(&self) -> usize {
        self.bytes.len()
    }
    fn uses_of(&self, t: usize) -> &[(u32, f64)] {
        &self.uses[self.use_start[t] as usize..self.use_start[t + 1] as usize]
    }

    /// Runs the graph to completion.
    pub fn run(&self, incast: Incast) -> Outcome {
        Run::new(self, incast).go()
    }
}

const WAITING: u8 = 0;
const ACTIVE: u8 = 1;
const DONE: u8 = 2;

struct Run<'g> {
    g: &'g Graph,
    incast: Incast,
    succ_start: Vec<u32>,
    succ: Vec<(u32, On, f64)>,
    deps: Vec<u32>,
    ready: Vec<f64>,
    state: Vec<u8>,
    remaining: Vec<f64>,
    rate: Vec<f64>,
    last: Vec<f64>,
    version: Vec<u32>,
    /// Active tasks per resource, and each (task, use) slot's position in that list.
    active: Vec<Vec<u32>>,
    pos: Vec<u32>,
    heap: BinaryHeap<Reverse<(Time, u8, u32, u32)>>,
    dirty: Vec<u32>,
    mark_r: Vec<u32>,
    mark_t: Vec<u32>,
    stamp: u32,
    // progressive filling scratch
    rem: Vec<f64>,
    denom: Vec<f64>,
    rstamp: Vec<u32>,
    frozen: Vec<u32>,
    old_rate: Vec<f64>,
    started_at: Vec<f64>,
}

const EV_FINISH: u8 = 0;
const EV_START: u8 = 1;

impl<'g> Run<'g> {
    fn new(g: &'g Graph, incast: Incast) -> Self {
        let (n, r) = (g.num_tasks(), g.cap.len());
        let mut succ_start = vec![0u32; n + 1];
        let mut deps = vec![0u32; n];
        for &(p, s, _, _) in &g.edges {
            succ_start[p as usize + 1] += 1;
            deps[s as usize] += 1;
        }
        for i in 0..n {
            succ_start[i + 1] += succ_start[i];
        }
        let mut fill = succ_start.clone();
        let mut succ = vec![(0u32, On::Start, 0.0); g.edges.len()];
        for &(p, s, on, lag) in &g.edges {
            succ[fill[p as usize] as usize] = (s, on, lag);
            fill[p as usize] += 1;
        }
        Run {
            g,
            incast,
            succ_start,
            succ,
            deps,
            ready: g.earliest.clone(),
            state: vec![WAITING; n],
            remaining: g.bytes.clone(),
            rate: vec![0.0; n],
            last: vec![0.0; n],
            version: vec![0; n],
            active: vec![Vec::new(); r],
            pos: vec![0; g.uses.len()],
            heap: BinaryHeap::new(),
            dirty: Vec::new(),
            mark_r: vec![0; r],
            mark_t: vec![0; n],
            stamp: 0,
            rem: vec![0.0; r],
            denom: vec![0.0; r],
            rstamp: vec![0; r],
            frozen: vec![0; n],
            old_rate: Vec::new(),
            started_at: vec![f64::NAN; n],
        }
    }

    fn go(mut self) -> Outcome {
        for t in 0..self.g.num_tasks() {
            if self.deps[t] == 0 {
                self.heap.push(Reverse((Time(self.ready[t]), EV_START, t as u32, 0)));
            }
        }
        let mut out = Outcome { tasks: self.g.num_tasks(), ..Default::default() };
        while let Some(Reverse((Time(t), _, _, _))) = self.heap.peek().copied() {
            let horizon = t + t.abs() * 1e-12 + 1e-15;
            let mut real = false;
            while let Some(&Reverse((Time(te), kind, task, ver))) = self.heap.peek() {
                if te > horizon {
                    break;
                }
                self.heap.pop();
                if kind == EV_START {
                    self.start(task as usize, t);
                    real = true;
                } else if self.state[task as usize] == ACTIVE && self.version[task as usize] == ver {
                    self.finish(task as usize, t);
                    real = true;
                }
            }
            if real {
                // Stale finish events (superseded by a rate change) are not completions.
                out.events += 1;
                out.makespan_s = out.makespan_s.max(t);
                self.rebalance(t);
            }
        }
        out
    }

    fn fire(&mut self, task: usize, on: On, t: f64) {
        for i in self.succ_start[task] as usize..self.succ_start[task + 1] as usize {
            let (s, when, lag) = self.succ[i];
            if when != on {
                continue;
            }
            let s = s as usize;
            self.ready[s] = self.ready[s].max(t + lag);
            self.deps[s] -= 1;
            if self.deps[s] == 0 {
                self.heap.push(Reverse((Time(self.ready[s]), EV_START, s as u32, 0)));
            }
        }
    }

    fn start(&mut self, task: usize, t: f64) {
        self.fire(task, On::Start, t);
        if self.g.bytes[task] <= 0.0 || self.g.uses_of(task).is_empty() {
            self.state[task] = DONE;
            self.fire(task, On::Finish, t);
            return;
        }
        self.state[task] = ACTIVE;
        self.last[task] = t;
        self.started_at[task] = t;
        let base = self.g.use_start[task] as usize;
        for (k, &(r, _)) in self.g.uses_of(task).iter().enumerate() {
            let list = &mut self.active[r as usize];
            self.pos[base + k] = list.len() as u32;
            list.push(task as u32);
            self.dirty.push(r);
        }
    }

    fn finish(&mut self, task: usize, t: f64) {
        self.state[task] = DONE;
        self.remaining[task] = 0.0;
        let base = self.g.use_start[task] as usize;
        for (k, &(r, _)) in self.g.uses_of(task).iter().enumerate() {
            let p = self.pos[base + k] as usize;
            let list = &mut self.active[r as usize];
            list.swap_remove(p);
            if p < list.len() {
                // Fix the moved task's slot for resource r.
                let moved = list[p] as usize;
                let mb = self.g.use_start[moved] as usize;
                let k2 = self.g.uses_of(moved).iter().position(|u| u.0 == r).unwrap_or(0);
                self.pos[mb + k2] = p as u32;
            }
            self.dirty.push(r);
        }
        self.fire(task, On::Finish, t);
    }

    /// Recomputes the rates of every task connected to a dirty resource.
    fn rebalance(&mut self, t: f64) {
        if self.dirty.is_empty() {
            return;
        }
        self.stamp += 1;
        let stamp = self.stamp;
        let (mut res, mut tasks) = (Vec::new(), Vec::new());
        let mut stack = std::mem::take(&mut self.dirty);
        while let Some(r) = stack.pop() {
            if self.mark_r[r as usize] == stamp {
                continue;
            }
            self.mark_r[r as usize] = stamp;
            res.push(r);
            for &f in &self.active[r as usize] {
                if self.mark_t[f as usize] != stamp {
                    self.mark_t[f as usize] = stamp;
                    tasks.push(f);
                    stack.extend(self.g.uses_of(f as usize).iter().map(|u| u.0));
                }
            }
        }
        let mut old = std::mem::take(&mut self.old_rate);
        old.clear();
        for &f in &tasks {
            let f = f as usize;
            self.remaining[f] = (self.remaining[f] - self.rate[f] * (t - self.last[f])).max(0.0);
            self.last[f] = t;
            old.push(self.rate[f]);
        }
        self.fill(&res, &tasks, stamp);
        for (i, &f) in tasks.iter().enumerate() {
            let f = f as usize;
            if self.rate[f] == old[i] && self.started_at[f] != t {
                continue; // its pending finish event is still exact
            }
            self.version[f] += 1;
            let done = if self.rate[f] > 0.0 { t + self.remaining[f] / self.rate[f] } else { f64::INFINITY };
            if done.is_finite() {
                self.heap.push(Reverse((Time(done), EV_FINISH, f as u32, self.version[f])));
            }
        }
        self.old_rate = old;
    }

    /// Resets the component's residual capacities and weight sums; returns the resources'
    /// saturation levels (a heap) and the rate-capped tasks (largest level first).
    #[allow(clippy::type_complexity)]
    fn fill_init(&mut self, res: &[u32], tasks: &[u32]) -> (BinaryHeap<Reverse<(Time, u32, u32)>>, Vec<(Time, u32)>) {
        let g = self.g;
        for &r in res {
            let r = r as usize;
            let m = self.active[r].len();
            self.rem[r] = g.cap[r] * if g.incast[r] { self.incast.efficiency(m) } else { 1.0 };
            self.denom[r] = 0.0;
            self.rstamp[r] = 0;
        }
        let mut capped: Vec<(Time, u32)> = Vec::new();
        for &f in tasks {
            self.frozen[f as usize] = 0;
            let w = g.weight[f as usize];
            for &(r, c) in g.uses_of(f as usize) {
                self.denom[r as usize] += c * w;
            }
            if g.rate_cap[f as usize].is_finite() {
                capped.push((Time(g.rate_cap[f as usize] / w), f));
            }
        }
        capped.sort_unstable_by(|a, b| b.cmp(a)); // pop from the end: smallest first
        let heap = res
            .iter()
            .filter(|&&r| self.denom[r as usize] > 0.0)
            .map(|&r| Reverse((Time(self.rem[r as usize] / self.denom[r as usize]), r, 0)))
            .collect();
        (heap, capped)
    }

    /// Weighted progressive filling over one component.
    fn fill(&mut self, res: &[u32], tasks: &[u32], stamp: u32) {
        let g = self.g;
        let (mut heap, mut capped) = self.fill_init(res, tasks);
        let mut left = tasks.len();
        while left > 0 {
            // The next resource to saturate (skipping stale heap entries).
            let mut next_r = None;
            while let Some(&Reverse((Time(l), r, s))) = heap.peek() {
                if s != self.rstamp[r as usize] || self.denom[r as usize] <= 0.0 {
                    heap.pop();
                    continue;
                }
                next_r = Some((l, r));
                break;
            }
            while capped.last().is_some_and(|&(_, f)| self.frozen[f as usize] == stamp) {
                capped.pop();
            }
            let next_c = capped.last().map(|&(Time(l), f)| (l, f));
            let pick_r = match (next_r, next_c) {
                (Some((lr, _)), Some((lc, _))) => lr <= lc,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            let (lambda, freeze): (f64, Vec<u32>) = if pick_r {
                let (lr, r) = next_r.unwrap_or((0.0, 0));
                heap.pop();
                (lr, self.active[r as usize].iter().copied().filter(|&f| self.frozen[f as usize] != stamp).collect())
            } else {
                let (lc, f) = next_c.unwrap_or((0.0, 0));
                (lc, vec![f])
            };
            let lambda = lambda.max(0.0);
            for f in freeze {
                let fu = f as usize;
                self.frozen[fu] = stamp;
                left -= 1;
                let w = g.weight[fu];
                self.rate[fu] = w * lambda;
                for &(r, c) in g.uses_of(fu) {
                    let r = r as usize;
                    self.rem[r] = (self.rem[r] - c * w * lambda).max(0.0);
                    self.denom[r] -= c * w;
                    self.rstamp[r] += 1;
                    if self.denom[r] > 1e-12 * c * w {
                        heap.push(Reverse((Time(self.rem[r] / self.denom[r]), r as u32, self.rstamp[r])));
                    } else {
                        self.denom[r] = 0.0;
                    }
                }
            }
        }
        for &f in tasks {
            if self.frozen[f as usize] != stamp {
                self.rate[f as usize] = 0.0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_flows_share_a_link_then_one_speeds_up() {
        let mut g = Graph::new();
        let r = g.resource(10.0, false);
        g.task(10.0, 1.0, &[(r, 1.0)]);
        g.task(30.0, 1.0, &[(r, 1.0)]);
        // 5 B/s each until t=2 (first done), then 10 B/s for the remaining 20 B: t = 4.
        let o = g.run(Incast { loss: 0.0 });
        assert!((o.makespan_s - 4.0).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn max_min_gives_the_unconstrained_flow_the_leftover() {
        let mut g = Graph::new();
        let a = g.resource(10.0, false);
        let b = g.resource(4.0, false);
        g.task(100.0, 1.0, &[(a, 1.0)]); // gets 10 - 2 = 8 ... after b's flows are frozen at 2
        g.task(20.0, 1.0, &[(a, 1.0), (b, 1.0)]);
        g.task(20.0, 1.0, &[(b, 1.0)]);
        // b saturates first at λ = 2; then flow 0 gets 8. Flows 1,2 done at t = 10; flow 0
        // has moved 80 B and finishes its last 20 B at 10 B/s: t = 12.
        let o = g.run(Incast { loss: 0.0 });
        assert!((o.makespan_s - 12.0).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn dependencies_and_lags_order_tasks() {
        let mut g = Graph::new();
        let r = g.resource(1.0, false);
        let a = g.task(1.0, 1.0, &[(r, 1.0)]);
        let b = g.task(1.0, 1.0, &[(r, 1.0)]);
        g.after(b, a, On::Finish, 0.5);
        let o = g.run(Incast { loss: 0.0 });
        assert!((o.makespan_s - 2.5).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn incast_reduces_receiver_capacity() {
        let mut g = Graph::new();
        let r = g.resource(1.0, true);
        g.task(1.0, 1.0, &[(r, 1.0)]);
        g.task(1.0, 1.0, &[(r, 1.0)]);
        let inc = Incast { loss: 0.4 };
        // η(2) = 1 - 0.4·0.5 = 0.8: 2 B at 0.8 B/s = 2.5 s.
        assert!((g.run(inc).makespan_s - 2.5).abs() < 1e-9);
        assert!((g.run(Incast { loss: 0.0 }).makespan_s - 2.0).abs() < 1e-9);
    }
}

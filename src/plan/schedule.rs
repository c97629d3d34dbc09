//! The NIC part of the Birkhoff-like decomposition (paper Algorithm 1, lines 3–6).
//!
//! Routes are grouped into NIC-pair entries (the RDMA cells of T, at NIC granularity). A
//! work-conserving list scheduler then plays the transfers out in time at plan time: whenever
//! a NIC's send side and another NIC's receive side are both idle and the pair has bytes
//! left, the pair starts a transfer of at most `cap` bytes. Each port scans its partners in
//! a fixed preference order, the 2-D cyclic shift (node offset, then NIC offset), so a
//! uniform matrix decomposes into exactly its (N−1)·K shift permutations, every one a perfect
//! matching of equal entries: the Birkhoff–von Neumann decomposition with the line-sum bound
//! met exactly. Skewed matrices get a maximal matching at every instant (never an idle pair
//! that could transfer), which keeps the most loaded port busy; large entries are cut into
//! slices of at most `cap` so that they interleave.
//!
//! A transfer's stage is one more than the last stage of its two ports, so every stage is a
//! matching (at most one outgoing and one incoming NIC flow per NIC), and ordering each NIC's
//! transfers by stage reproduces the planned timeline without any global barrier.
use super::cluster::{Cluster, Index};
use super::traffic::Route;
use std::collections::BTreeMap;

/// A piece `[offset, offset + bytes)` of route `route`, sent over the NIC in `stage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicSlice {
    pub route: u32,
    pub stage: u32,
    pub offset: u64,
    pub bytes: u64,
}

/// All routes between one NIC pair: `order[start..end]` are their ids.
struct Entry {
    a: u32,
    b: u32,
    end: u32,
    cur: u32,
    cur_off: u64,
    remaining: u64,
}

/// Compressed adjacency: `list[start[p]..start[p + 1]]`.
struct Csr {
    start: Vec<u32>,
    list: Vec<u32>,
}

/// The shift of `b` relative to `a`: node offset major, NIC offset minor.
#[inline]
fn shift_key(ix: &Index, nodes: u32, k: u32, a: usize, b: usize) -> usize {
    let mut dn = ix.nic_node[b] + nodes - ix.nic_node[a];
    if dn >= nodes {
        dn -= nodes;
    }
    let mut dr = ix.nic_rail[b] + k - ix.nic_rail[a];
    if dr >= k {
        dr -= k;
    }
    (dn * k + dr) as usize
}

/// Counting sort of `0..items` by `key`, as CSR over `0..n` keys.
fn csr_by(n: usize, items: usize, key: impl Fn(usize) -> usize) -> Csr {
    let mut start = vec![0u32; n + 1];
    for i in 0..items {
        start[key(i) + 1] += 1;
    }
    for p in 0..n {
        start[p + 1] += start[p];
    }
    let mut fill = start.clone();
    let mut list = vec![0u32; items];
    for i in 0..items {
        let p = key(i);
        list[fill[p] as usize] = i as u32;
        fill[p] += 1;
    }
    Csr { start, list }
}

/// Builds NIC-pair entries and both preference lists.
/// Builds NIC-pair entries, numbered sender-major in shift order (so a sender's entries are
/// contiguous: `out_start[a]..out_start[a + 1]`), and the receivers' preference lists.
fn build_entries(cl: &Cluster, ix: &Index, routes: &[Route], order: &mut Vec<u32>) -> (Vec<Entry>, Vec<u32>, Csr) {
    let n = cl.num_nics();
    let (nodes, k) = (cl.nodes as u32, cl.nics_per_node as u32);
    let ra: Vec<u32> = routes.iter().map(|r| ix.nic[r.send_gpu as usize]).collect();
    let by_a = csr_by(n, routes.len(), |i| ra[i] as usize);
    drop(ra);
    let mut slot = vec![u32::MAX; n];
    let mut scratch: Vec<(u32, u32, u32, u64)> = Vec::new(); // (b, first route, last route, bytes)
    let mut next = vec![u32::MAX; routes.len()];
    let mut entries: Vec<Entry> = Vec::with_capacity(routes.len());
    let mut first: Vec<u32> = Vec::with_capacity(routes.len());
    let mut out_start = vec![0u32; n + 1];
    for a in 0..n {
        let bucket = &by_a.list[by_a.start[a] as usize..by_a.start[a + 1] as usize];
        scratch.clear();
        for &r in bucket {
            let rt = &routes[r as usize];
            let b = ix.nic[rt.recv_gpu as usize];
            let key = shift_key(ix, nodes, k, a, b as usize);
            if slot[key] == u32::MAX {
                slot[key] = scratch.len() as u32;
                scratch.push((b, r, r, rt.bytes));
            } else {
                let e = &mut scratch[slot[key] as usize];
                next[e.2 as usize] = r;
                e.2 = r;
                e.3 += rt.bytes;
            }
        }
        if !bucket.is_empty() {
            for sl in slot.iter_mut() {
                if *sl != u32::MAX {
                    let (b, f, _, bytes) = scratch[*sl as usize];
                    entries.push(Entry { a: a as u32, b, end: 0, cur: 0, cur_off: 0, remaining: bytes });
                    first.push(f);
                    *sl = u32::MAX;
                }
            }
        }
        out_start[a + 1] = entries.len() as u32;
    }
    drop(by_a);
    // Lay each entry's routes out contiguously in `order`.
    order.clear();
    order.reserve(routes.len());
    for (e, ent) in entries.iter_mut().enumerate() {
        ent.cur = order.len() as u32;
        let mut r = first[e];
        while r != u32::MAX {
            order.push(r);
            r = next[r as usize];
        }
        ent.end = order.len() as u32;
    }
    let by_b = csr_by(n, entries.len(), |e| entries[e].b as usize);
    let mut in_list: Vec<u32> = Vec::with_capacity(entries.len());
    for b in 0..n {
        let bucket = &by_b.list[by_b.start[b] as usize..by_b.start[b + 1] as usize];
        for &e in bucket {
            slot[shift_key(ix, nodes, k, entries[e as usize].a as usize, b)] = e;
        }
        if !bucket.is_empty() {
            for sl in slot.iter_mut() {
                if *sl != u32::MAX {
                    in_list.push(*sl);
                    *sl = u32::MAX;
                }
            }
        }
    }
    (entries, out_start, Csr { start: by_b.start, list: in_list })
}

/// Slices larger than this are cut: 1/32 of the heaviest port's load, but never below four
/// times a typical entry (so uniform matrices stay one transfer per entry).
fn slice_cap(cl: &Cluster, entries: &[Entry]) -> u64 {
    let n = cl.num_nics();
    let (mut out, mut inn) = (vec![0u64; n], vec![0u64; n]);
    for e in entries {
        out[e.a as usize] += e.remaining;
        inn[e.b as usize] += e.remaining;
    }
    let l = out.iter().chain(inn.iter()).copied().max().unwrap_or(0);
    let step = (entries.len() / 4096).max(1);
    let mut sample: Vec<u64> = entries.iter().step_by(step).map(|e| e.remaining).collect();
    let mid = sample.len() / 2;
    let median = if sample.is_empty() { 0 } else { *sample.select_nth_unstable(mid).1 };
    (l / 32).max(median.saturating_mul(4)).max(1)
}

/// Pending transfer ends, grouped by time; repeated keys (a lock-step round) cost O(1).
#[derive(Default)]
struct Calendar {
    map: BTreeMap<u64, Vec<u32>>,
    hot: Option<(u64, Vec<u32>)>,
}

impl Calendar {
    fn push(&mut self, t: f64, id: u32) {
        let key = t.to_bits();
        match &mut self.hot {
            Some((k, v)) if *k == key => v.push(id),
            _ => {
                self.flush();
                self.hot = Some((key, vec![id]));
            }
        }
    }
    fn flush(&mut self) {
        if let Some((k, v)) = self.hot.take() {
            self.map.entry(k).or_default().extend(v);
        }
    }
    fn pop(&mut self) -> Option<(f64, Vec<u32>)> {
        self.flush();
        self.map.pop_first().map(|(k, v)| (f64::from_bits(k), v))
    }
}

struct Scheduler<'a> {
    cl: &'a Cluster,
    routes: &'a [Route],
    order: Vec<u32>,
    entries: Vec<Entry>,
    out_start: Vec<u32>,
    inn: Csr,
    out_cur: Vec<u32>,
    in_cur: Vec<u32>,
    out_free: Vec<bool>,
    in_free: Vec<bool>,
    out_rem: Vec<u64>,
    in_rem: Vec<u64>,
    next_out: Vec<u32>,
    next_in: Vec<u32>,
    running: Vec<(u32, u32)>,
    cal: Calendar,
    cap: u64,
    slices: Vec<NicSlice>,
}

impl Scheduler<'_> {
    /// Starts `len` bytes of entry `e` at time `t`.
    fn start(&mut self, e: usize, t: f64) {
        let ent = &mut self.entries[e];
        let len = ent.remaining.min(self.cap);
        ent.remaining -= len;
        let (a, b) = (ent.a as usize, ent.b as usize);
        let stage = self.next_out[a].max(self.next_in[b]);
        self.next_out[a] = stage + 1;
        self.next_in[b] = stage + 1;
        let mut left = len;
        while left > 0 {
            let r = self.order[ent.cur as usize];
            let rb = self.routes[r as usize].bytes;
            let take = left.min(rb - ent.cur_off);
            if take > 0 {
                self.slices.push(NicSlice { route: r, stage, offset: ent.cur_off, bytes: take });
            }
            left -= take;
            ent.cur_off += take;
            if ent.cur_off == rb && ent.cur + 1 < ent.end {
                ent.cur += 1;
                ent.cur_off = 0;
            }
        }
        self.out_free[a] = false;
        self.in_free[b] = false;
        self.out_rem[a] -= len;
        self.in_rem[b] -= len;
        let id = self.running.len() as u32;
        self.running.push((a as u32, b as u32));
        self.cal.push(t + len as f64 / self.cl.nic_bw, id);
    }

    fn try_sender(&mut self, a: usize, t: f64) {
        let (lo, hi) = (self.out_cur[a] as usize, self.out_start[a + 1] as usize);
        for e in lo..hi {
            let i = e;
            if self.entries[e].remaining == 0 {
                if i == self.out_cur[a] as usize {
                    self.out_cur[a] += 1;
                }
                continue;
            }
            if self.in_free[self.entries[e].b as usize] {
                return self.start(e, t);
            }
        }
    }

    fn try_receiver(&mut self, b: usize, t: f64) {
        let (lo, hi) = (self.in_cur[b] as usize, self.inn.start[b + 1] as usize);
        for i in lo..hi {
            let e = self.inn.list[i] as usize;
            if self.entries[e].remaining == 0 {
                if i == self.in_cur[b] as usize {
                    self.in_cur[b] += 1;
                }
                continue;
            }
            if self.out_free[self.entries[e].a as usize] {
                return self.start(e, t);
            }
        }
    }

    fn run(&mut self) {
        let n = self.cl.num_nics();
        let mut freed_out: Vec<u32> = (0..n as u32).collect();
        let mut freed_in: Vec<u32> = (0..n as u32).collect();
        let mut t = 0.0;
        loop {
            // The most loaded ports choose first.
            freed_out.sort_unstable_by_key(|&a| (std::cmp::Reverse(self.out_rem[a as usize]), a));
            for &a in &freed_out {
                if self.out_free[a as usize] {
                    self.try_sender(a as usize, t);
                }
            }
            freed_in.retain(|&b| self.in_free[b as usize]);
            freed_in.sort_unstable_by_key(|&b| (std::cmp::Reverse(self.in_rem[b as usize]), b));
            for &b in &freed_in {
                if self.in_free[b as usize] {
                    self.try_receiver(b as usize, t);
                }
            }
            let Some((tn, ids)) = self.cal.pop() else { break };
            t = tn;
            freed_out.clear();
            freed_in.clear();
            for id in ids {
                let (a, b) = self.running[id as usize];
                self.out_free[a as usize] = true;
                self.in_free[b as usize] = true;
                freed_out.push(a);
                freed_in.push(b);
            }
        }
    }
}

/// Decomposes the routes' NIC transfers into stages. Returns the slices (sorted by stage,
/// then by sending NIC) and the number of stages.
pub fn schedule_nics(cl: &Cluster, routes: &[Route]) -> (Vec<NicSlice>, usize) {
    let n = cl.num_nics();
    let mut order = Vec::new();
    let ix = Index::new(cl);
    let (entries, out_start, inn) = build_entries(cl, &ix, routes, &mut order);
    let cap = slice_cap(cl, &entries);
    let (mut out_rem, mut in_rem) = (vec![0u64; n], vec![0u64; n]);
    for e in &entries {
        out_rem[e.a as usize] += e.remaining;
        in_rem[e.b as usize] += e.remaining;
    }
    let out_cur = out_start[..n].to_vec();
    let in_cur = inn.start[..n].to_vec();
    let mut s = Scheduler {
        cl,
        routes,
        order,
        entries,
        out_start,
        inn,
        out_cur,
        in_cur,
        out_free: vec![true; n],
        in_free: vec![true; n],
        out_rem,
        in_rem,
        next_out: vec![0; n],
        next_in: vec![0; n],
        running: Vec::new(),
        cal: Calendar::default(),
        cap,
        slices: Vec::with_capacity(routes.len()),
    };
    s.run();
    let mut slices = s.slices;
    let stages = slices.iter().map(|x| x.stage as usize + 1).max().unwrap_or(0);
    if !slices.windows(2).all(|w| w[0].stage <= w[1].stage) {
        slices.sort_by_key(|x| x.stage); // stable: keeps the start order inside a stage
    }
    (slices, stages)
}

//! Stage assembly (paper Algorithm 1, lines 1–2 and 7–9): native NVLink work is packed into
//! the slack that each stage's NIC work leaves on NVLink ports and copy engines, and every
//! stage gets its cost, the time of its slowest domain.
use super::cluster::{Cluster, CopyKind, Index};
use super::schedule::NicSlice;
use super::traffic::{Native, Traffic};

/// A piece `[offset, offset + bytes)` of native flow `native`, copied in `stage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativePiece {
    pub native: u32,
    pub stage: u32,
    pub offset: u64,
    pub bytes: u64,
}

/// Seconds each domain needs for one stage's work; the stage costs the largest.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageCost {
    pub nic_s: f64,
    pub nvlink_s: f64,
    pub ce_s: f64,
}

impl StageCost {
    pub fn total(&self) -> f64 {
        self.nic_s.max(self.nvlink_s).max(self.ce_s)
    }
}

/// One stage: `plan.nic[nic.0..nic.1]` and `plan.native_pieces[native.0..native.1]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub nic: (usize, usize),
    pub native: (usize, usize),
    pub cost: StageCost,
}

/// One stage's loads on every port and engine. Entries are reset lazily (a stamp per GPU
/// and NIC port) and the domain maxima are kept as loads grow, so a stage costs O(its flows).
pub(crate) struct StageLoads {
    ix: Index,
    ce_n: usize,
    stamp: u32,
    nic: Vec<f64>,
    nic_stamp: Vec<u32>,
    out: Vec<f64>,
    inn: Vec<f64>,
    ce: Vec<f64>,
    gpu_stamp: Vec<u32>,
    max_nic: f64,
    max_nvl: f64,
    max_ce: f64,
}

impl StageLoads {
    pub(crate) fn new(cl: &Cluster) -> Self {
        let g = cl.num_gpus();
        StageLoads {
            ix: Index::new(cl),
            ce_n: cl.ce_per_gpu,
            stamp: 1,
            nic: vec![0.0; 2 * cl.num_nics()],
            nic_stamp: vec![0; 2 * cl.num_nics()],
            out: vec![0.0; g],
            inn: vec![0.0; g],
            ce: vec![0.0; g * cl.ce_per_gpu],
            gpu_stamp: vec![0; g],
            max_nic: 0.0,
            max_nvl: 0.0,
            max_ce: 0.0,
        }
    }

    fn clear(&mut self) {
        self.stamp += 1;
        self.max_nic = 0.0;
        self.max_nvl = 0.0;
        self.max_ce = 0.0;
    }

    #[inline]
    fn gpu(&mut self, g: usize) {
        if self.gpu_stamp[g] != self.stamp {
            self.gpu_stamp[g] = self.stamp;
            self.out[g] = 0.0;
            self.inn[g] = 0.0;
            self.ce[g * self.ce_n..(g + 1) * self.ce_n].fill(0.0);
        }
    }

    /// Current loads of `x`'s NVLink out port, `y`'s in port and engine slot `e` of `x`.
    fn slack_loads(&mut self, x: usize, y: usize, e: usize) -> (f64, f64, f64) {
        self.gpu(x);
        self.gpu(y);
        (self.out[x], self.inn[y], self.ce[x * self.ce_n + e])
    }

    #[inline]
    fn add_nic(&mut self, port: usize, bytes: f64) {
        if self.nic_stamp[port] != self.stamp {
            self.nic_stamp[port] = self.stamp;
            self.nic[port] = 0.0;
        }
        self.nic[port] += bytes;
        self.max_nic = self.max_nic.max(self.nic[port]);
    }

    fn add_copy(&mut self, kind: CopyKind, src: usize, dst: usize, bytes: f64) {
        self.gpu(src);
        self.gpu(dst);
        let e = src * self.ce_n + self.ix.engine(kind, dst);
        self.ce[e] += bytes;
        self.max_ce = self.max_ce.max(self.ce[e]);
        if src != dst {
            self.out[src] += bytes;
            self.inn[dst] += bytes;
            self.max_nvl = self.max_nvl.max(self.out[src]).max(self.inn[dst]);
        }
    }

    fn add_slice(&mut self, cl: &Cluster, t: &Traffic, s: &NicSlice) {
        let r = &t.routes[s.route as usize];
        let b = s.bytes as f64;
        let (su, rv) = (r.su as usize, r.rv as usize);
        let (a, z) = (self.ix.nic[su] as usize, self.ix.nic[rv] as usize);
        self.add_nic(2 * a, b);
        self.add_nic(2 * z + 1, b);
        self.add_copy(CopyKind::Send, r.src as usize, su, b);
        if t.fan_out {
            let k = cl.gpus_per_node;
            for d in r.dst as usize * k..(r.dst as usize + 1) * k {
                self.add_copy(CopyKind::Recv, rv, d, b);
            }
        } else {
            self.add_copy(CopyKind::Recv, rv, r.dst as usize, b);
        }
    }

    fn cost(&self, cl: &Cluster) -> StageCost {
        StageCost { nic_s: self.max_nic / cl.nic_bw, nvlink_s: self.max_nvl / cl.nvlink_bw, ce_s: self.max_ce / cl.ce_bw }
    }
}

/// Packs native flows into the stages' slack, front-loaded: each stage takes as much of
/// every remaining native flow as its NVLink ports and copy engines can absorb without
/// lengthening the stage. What does not fit (or is left after eight stages in a row with no
/// slack) goes into one extra NVLink-only stage (NVLink has no degree constraint, so the
/// whole remainder is one stage).
fn pack_natives(cl: &Cluster, t: &Traffic, nic: &[NicSlice], bounds: &[(usize, usize)], min_piece: u64) -> Vec<NativePiece> {
    let natives: &[Native] = &t.natives;
    let mut rem: Vec<u64> = natives.iter().map(|n| n.bytes).collect();
    let mut active: Vec<u32> = (0..natives.len() as u32).filter(|&i| rem[i as usize] > 0).collect();
    let mut pieces = Vec::new();
    let mut loads = StageLoads::new(cl);
    let mut barren = 0; // consecutive stages that took nothing
    for (s, &(lo, hi)) in bounds.iter().enumerate() {
        // Stop early when NVLink is itself the bottleneck stage after stage (AllGather at
        // 400/50 GB/s): what is left becomes the final NVLink stage.
        if active.is_empty() || barren >= 8 {
            break;
        }
        let before = pieces.len();
        loads.clear();
        nic[lo..hi].iter().for_each(|x| loads.add_slice(cl, t, x));
        let d = loads.cost(cl).total();
        for &i in &active {
            let n = natives[i as usize];
            let (x, y) = (n.src as usize, n.dst as usize);
            let e = loads.ix.engine(CopyKind::Native, y);
            let (lo, li, lc) = loads.slack_loads(x, y, e);
            let slack = (d * cl.nvlink_bw - lo).min(d * cl.nvlink_bw - li).min(d * cl.ce_bw - lc);
            let r = rem[i as usize];
            let take = if slack >= r as f64 { r } else { slack.max(0.0) as u64 };
            if take == 0 || (take < r && take < min_piece) {
                continue;
            }
            pieces.push(NativePiece { native: i, stage: s as u32, offset: n.bytes - r, bytes: take });
            rem[i as usize] -= take;
            loads.add_copy(CopyKind::Native, x, y, take as f64);
        }
        active.retain(|&i| rem[i as usize] > 0);
        barren = if pieces.len() == before { barren + 1 } else { 0 };
    }
    let last = bounds.len() as u32;
    for i in active {
        let n = natives[i as usize];
        let r = rem[i as usize];
        pieces.push(NativePiece { native: i, stage: last, offset: n.bytes - r, bytes: r });
    }
    pieces
}

/// Index ranges of consecutive equal keys over `0..stages`.
fn ranges(stages: usize, keys: impl Iterator<Item = u32>) -> Vec<(usize, usize)> {
    let mut out = vec![(0usize, 0usize); stages];
    let mut counts = vec![0usize; stages];
    for k in keys {
        counts[k as usize] += 1;
    }
    let mut at = 0;
    for s in 0..stages {
        out[s] = (at, at + counts[s]);
        at += counts[s];
    }
    out
}

/// Builds the stages: native pieces, and each stage's cost.
pub fn assemble(cl: &Cluster, t: &Traffic, nic: &[NicSlice], nic_stages: usize, chunk: u64) -> (Vec<NativePiece>, Vec<Stage>) {
    let nic_bounds = ranges(nic_stages, nic.iter().map(|x| x.stage));
    let pieces = pack_natives(cl, t, nic, &nic_bounds, chunk);
    let stages_n = pieces.iter().map(|p| p.stage as usize + 1).max().unwrap_or(0).max(nic_stages);
    let mut nb = nic_bounds;
    nb.resize(stages_n, (nic.len(), nic.len()));
    let pb = ranges(stages_n, pieces.iter().map(|p| p.stage));
    let mut sorted = pieces;
    sorted.sort_by_key(|p| p.stage);
    let mut loads = StageLoads::new(cl);
    let mut stages = Vec::with_capacity(stages_n);
    for s in 0..stages_n {
        loads.clear();
        nic[nb[s].0..nb[s].1].iter().for_each(|x| loads.add_slice(cl, t, x));
        for p in &sorted[pb[s].0..pb[s].1] {
            let n = t.natives[p.native as usize];
            loads.add_copy(CopyKind::Native, n.src as usize, n.dst as usize, p.bytes as f64);
        }
        stages.push(Stage { nic: nb[s], native: pb[s], cost: loads.cost(cl) });
    }
    (sorted, stages)
}

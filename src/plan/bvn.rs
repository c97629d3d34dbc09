//! An exact Birkhoff–von Neumann decomposition of the NIC-level traffic into stages, for
//! skewed matrices on small clusters.
//!
//! The list scheduler ([`super::schedule`]) keeps every port busy on a timeline, but the
//! runtime executes a plan stage by stage, each stage as long as its largest slice: on a
//! skewed matrix (Zipf AlltoAllv over a few NICs) its stages add up to well above the
//! busiest port's bytes. This decomposition meets that bound exactly: the NIC matrix M
//! (sending NIC × receiving NIC, bytes) is padded with dummy bytes D until every row and
//! column sums to the busiest line L; M + D is then a sum of permutation matrices (Birkhoff),
//! found one at a time as a perfect matching on the positive entries, each weighted by its
//! smallest entry w; a stage carries, per matched pair, up to w real bytes (the route bytes
//! of that NIC pair, in route order), so the stages' largest slices sum to at most L. Every
//! stage is a matching: at most one outgoing and one incoming NIC piece per NIC.
//!
//! [`super::build`] takes this decomposition where its stages are predicted faster than the
//! list scheduler's. A uniform matrix gains nothing (the list scheduler already meets L), so
//! it keeps the list schedule.
use super::cluster::{Cluster, Index};
use super::schedule::NicSlice;
use super::traffic::Route;

/// Clusters with more NICs keep the list scheduler (a matching per stage, up to n² stages).
pub const MAX_NICS: usize = 64;
/// A decomposition that needs more stages is not taken (each stage is one op everywhere).
pub const MAX_STAGES: usize = 512;

/// The decomposition of `routes`' NIC transfers: the slices (sorted by stage) and the stage
/// count; None when the cluster is too large, nothing crosses, or it needs too many stages.
pub fn schedule_nics(cl: &Cluster, routes: &[Route]) -> Option<(Vec<NicSlice>, usize)> {
    let n = cl.num_nics();
    if !(2..=MAX_NICS).contains(&n) || routes.is_empty() {
        return None;
    }
    let ix = Index::new(cl);
    // Real bytes per NIC pair, and the routes of each pair in route order.
    let mut real = vec![0u64; n * n];
    let mut of_pair: Vec<Vec<u32>> = vec![Vec::new(); n * n];
    for (i, r) in routes.iter().enumerate() {
        let (a, b) = (ix.nic[r.su as usize] as usize, ix.nic[r.rv as usize] as usize);
        real[a * n + b] += r.bytes;
        of_pair[a * n + b].push(i as u32);
    }
    let row = |m: &[u64], a: usize| m[a * n..(a + 1) * n].iter().sum::<u64>();
    let col = |m: &[u64], b: usize| (0..n).map(|a| m[a * n + b]).sum::<u64>();
    let l = (0..n).map(|a| row(&real, a).max(col(&real, a))).max().unwrap_or(0);
    if l == 0 {
        return None;
    }
    // Pad to line sums L: each row's deficit against the columns' deficits, in order (both
    // deficits total n·L − Σ, so every line ends at L).
    let mut all = real.clone();
    let mut rd: Vec<u64> = (0..n).map(|a| l - row(&real, a)).collect();
    let mut cd: Vec<u64> = (0..n).map(|b| l - col(&real, b)).collect();
    let (mut a, mut b) = (0, 0);
    while a < n && b < n {
        let d = rd[a].min(cd[b]);
        all[a * n + b] += d;
        rd[a] -= d;
        cd[b] -= d;
        if rd[a] == 0 {
            a += 1;
        }
        if cd[b] == 0 {
            b += 1;
        }
    }
    // Per route: bytes already placed in a stage.
    let mut done = vec![0u64; routes.len()];
    let mut next_route = vec![0usize; n * n];
    let mut slices: Vec<NicSlice> = Vec::new();
    let mut stage = 0u32;
    let mut matched = vec![usize::MAX; n]; // column → row
    while all.iter().any(|&x| x > 0) {
        if !bottleneck_matching(&all, n, &mut matched) {
            return None;
        }
        let w = (0..n).map(|b| all[matched[b] * n + b]).min().unwrap_or(0);
        if w == 0 {
            return None;
        }
        let mut any = false;
        for (b, &a) in matched.iter().enumerate() {
            let p = a * n + b;
            all[p] -= w;
            let mut take = w.min(real[p]);
            real[p] -= take;
            while take > 0 {
                let ri = of_pair[p][next_route[p]] as usize;
                let left = routes[ri].bytes - done[ri];
                let t = left.min(take);
                if t > 0 {
                    slices.push(NicSlice { route: ri as u32, stage, offset: done[ri], bytes: t });
                    done[ri] += t;
                    take -= t;
                    any = true;
                }
                if done[ri] == routes[ri].bytes {
                    next_route[p] += 1;
                }
            }
        }
        if any {
            stage += 1;
            if stage as usize > MAX_STAGES {
                return None;
            }
        }
    }
    Some((slices, stage as usize))
}

/// A perfect matching on the positive entries of the n × n matrix `m` whose smallest entry
/// is as large as possible (the largest threshold whose entries still hold a perfect
/// matching, by bisection over the distinct entries), so each stage carries as much as it
/// can and the decomposition needs few stages; `matched[column]` = row. False when none
/// exists (never, for a matrix of equal line sums).
fn bottleneck_matching(m: &[u64], n: usize, matched: &mut [usize]) -> bool {
    let mut values: Vec<u64> = m.iter().copied().filter(|&x| x > 0).collect();
    values.sort_unstable();
    values.dedup();
    if values.is_empty() || !perfect_matching(m, n, values[0], matched) {
        return false;
    }
    // Invariant: values[lo] admits a perfect matching; values[hi] (if in range) does not.
    let (mut lo, mut hi) = (0, values.len());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if perfect_matching(m, n, values[mid], matched) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    perfect_matching(m, n, values[lo], matched)
}

/// A perfect matching on the entries of `m` of at least `min` (Kuhn's augmenting paths,
/// each row trying its columns largest entry first); `matched[column]` = row.
fn perfect_matching(m: &[u64], n: usize, min: u64, matched: &mut [usize]) -> bool {
    matched.iter_mut().for_each(|x| *x = usize::MAX);
    let order: Vec<Vec<usize>> = (0..n)
        .map(|a| {
            let mut cols: Vec<usize> = (0..n).filter(|&b| m[a * n + b] >= min).collect();
            cols.sort_by_key(|&b| std::cmp::Reverse(m[a * n + b]));
            cols
        })
        .collect();
    let mut seen = vec![false; n];
    for a in 0..n {
        seen.iter_mut().for_each(|x| *x = false);
        if !augment(a, &order, matched, &mut seen) {
            return false;
        }
    }
    true
}

fn augment(a: usize, order: &[Vec<usize>], matched: &mut [usize], seen: &mut [bool]) -> bool {
    for &b in &order[a] {
        if seen[b] {
            continue;
        }
        seen[b] = true;
        if matched[b] == usize::MAX || augment(matched[b], order, matched, seen) {
            matched[b] = a;
            return true;
        }
    }
    false
}

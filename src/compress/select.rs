//! The encoder's choice of table and code widths. Decoders accept any valid block; this
//! choice is what the CPU reference (`cpu.rs`) and the CUDA kernels (`cuda/bfx.cuh`,
//! `bfx_choose`) both implement, step for step, so that they emit identical bytes.
//!
//! For a block of `nb` values with exponents `e[p]`, `p = 0..nb` (`E` exponent bits):
//!
//! 1. **Sample.** `h[s] = #{ p < nb : p % 8 == 0 and e[p] == s }` for every symbol
//!    `s < 2^E`; the sample size is `S = ceil(nb / 8)`. (A strided 1/8 sample: within 1 % of
//!    a per-tensor table on real data, and a prefix sample is not.)
//! 2. **Rank.** Every symbol gets a rank: symbols sorted by count descending, equal counts
//!    by symbol ascending (so symbols never sampled follow, in ascending order).
//! 3. **Widths.** Candidates `(k1, k2)` are visited with `k1 = 1..=5` outer and
//!    `k2 = 0..=7` inner (only `k2 = 0` when the caller asks for one tier), skipping those
//!    with `T1 + T2 > 31`. With `C(t)` the sampled count of ranks `< t`,
//!    `E1 = S - C(T1)` and `R = S - C(T1 + T2)`, a candidate costs
//!    `S*k1 + E1*k2 + 8*R` (sample bits; `k2 = 0` gives `S*k1 + 8*E1`). The first candidate
//!    with the smallest cost wins.
//! 4. **Table.** The symbols of ranks `0 .. T1 + T2` in rank order; a value whose symbol has
//!    rank `r` gets tier-1 code `r` if `r < T1`, else an escape with tier-2 code `r - T1` if
//!    `r < T1 + T2`, else (its exponent is stored raw).
//! 5. **Raw fallback.** The exact coded size follows from the exact escape counts of the
//!    whole block; if it is not smaller than the raw block, the block is stored raw.
use super::format::{tier_size, Dtype, MAX_TABLE};

/// The `(k1, k2)` candidates in visiting order (21 of them; one-tier ones have `k2 = 0`).
pub fn candidates() -> impl Iterator<Item = (u32, u32)> {
    (1..=5u32)
        .flat_map(|k1| (0..=7u32).map(move |k2| (k1, k2)))
        .filter(|&(k1, k2)| tier_size(k1) + tier_size(k2) <= MAX_TABLE)
}

/// What the encoder decided for one block (before the raw fallback).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub k1: u32,
    pub k2: u32,
    /// `T1 + T2` symbols, tier 1 first.
    pub table: Vec<u8>,
    /// Rank of every symbol (`2^E` entries).
    pub rank: Vec<u16>,
}

impl Choice {
    pub fn t1(&self) -> usize {
        tier_size(self.k1)
    }
    pub fn t2(&self) -> usize {
        tier_size(self.k2)
    }
}

/// Steps 1–4 over the exponents of one block. `two_tiers = false` restricts `k2` to 0.
pub fn choose(dtype: Dtype, exps: &[u8], two_tiers: bool) -> Choice {
    let nsym = dtype.symbols();
    let mut h = vec![0u32; nsym];
    for &e in exps.iter().step_by(8) {
        h[e as usize & (nsym - 1)] += 1;
    }
    let sample = exps.len().div_ceil(8) as u64;
    let mut order: Vec<usize> = (0..nsym).collect();
    order.sort_by(|&a, &b| h[b].cmp(&h[a]).then(a.cmp(&b)));
    let mut rank = vec![0u16; nsym];
    for (r, &s) in order.iter().enumerate() {
        rank[s] = r as u16;
    }
    // cum[t] = sampled count of ranks < t.
    let mut cum = [0u64; MAX_TABLE + 1];
    for t in 1..=MAX_TABLE {
        cum[t] = cum[t - 1] + h[order[t - 1]] as u64;
    }
    let mut best = (u64::MAX, 0, 0);
    for (k1, k2) in candidates().filter(|&(_, k2)| two_tiers || k2 == 0) {
        let (t1, t2) = (tier_size(k1), tier_size(k2));
        let esc1 = sample - cum[t1];
        let raw = sample - cum[t1 + t2];
        let cost = sample * k1 as u64 + esc1 * k2 as u64 + 8 * raw;
        if cost < best.0 {
            best = (cost, k1, k2);
        }
    }
    let (_, k1, k2) = best;
    let table = order[..tier_size(k1) + tier_size(k2)].iter().map(|&s| s as u8).collect();
    Choice { k1, k2, table, rank }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twenty_one_candidates() {
        let c: Vec<_> = candidates().collect();
        assert_eq!(c.len(), 21);
        assert_eq!(c[0], (1, 0));
        assert_eq!(*c.last().unwrap(), (5, 0));
    }

    #[test]
    fn ties_go_to_the_smaller_symbol() {
        // Two symbols, equal counts: 120 sampled once at p=0, 3 at p=8.
        let mut e = vec![0u8; 16];
        e[0] = 120;
        e[8] = 3;
        let c = choose(Dtype::Bf16, &e, true);
        assert_eq!(&c.table[..2], &[3, 120]);
        assert_eq!(c.rank[3], 0);
        assert_eq!(c.rank[0], 2); // unsampled symbols follow in ascending order
        assert_eq!(c.rank[1], 3);
    }

    #[test]
    fn skewed_data_picks_small_codes() {
        let e: Vec<u8> = (0..16384).map(|i| if i % 97 == 0 { 100 } else { 120 + (i % 3) as u8 }).collect();
        let c = choose(Dtype::Bf16, &e, false);
        assert_eq!((c.k1, c.k2), (2, 0));
    }
}

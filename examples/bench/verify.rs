//! The correctness column: refill inputs with the verifiable pattern, poison the outputs,
//! run the op once, copy the outputs back and count wrong ELEMENTS against expectations
//! computed on the host from (seed, rank, block) alone.
use crate::ctx::{Ctx, Res};
use crate::ops::{expected_blocks, input_blocks, reduced_inputs, Block, Bufs, Geom};
use hoccl::device::{pattern_word, DevPtr};
use hoccl::DataType;

/// Bytes copied back per step (bounds host memory at 1 GiB points).
const CHUNK: usize = 64 << 20;

/// Run the checked call once and return the number of wrong elements summed over ranks.
/// `tag` makes the seeds of this check differ from every other check.
pub fn check_point(ctx: &Ctx, g: &Geom, b: &Bufs, tag: u64, issue: &dyn Fn() -> Res<()>) -> Res<u64> {
    let s = ctx.stream;
    if g.recv_len > 0 {
        ctx.fill(s, b.recv, g.recv_len, tag ^ 0xDEAD_BEEF_0000)?;
    }
    for blk in input_blocks(g, tag, ctx.rank, ctx.n) {
        ctx.fill(s, b.send.add(blk.off), blk.len, blk.seed)?;
    }
    issue()?;
    ctx.sync()?;
    let mut wrong = 0u64;
    for blk in expected_blocks(g, tag, ctx.rank, ctx.n) {
        wrong += count_wrong_block(ctx, b.recv, &blk, g.es)?;
    }
    if let Some((len, seeds)) = reduced_inputs(g, tag, ctx.rank, ctx.n) {
        wrong += count_wrong_reduced(ctx, b.recv, len, &seeds, ctx.opts.dtype)?;
    }
    ctx.sum_u64(wrong)
}

/// Wrong elements of the `len` bytes at `base` against `reduce_into` (the library's
/// reference, in rank order) over inputs holding the patterns of `seeds`, piece by piece.
fn count_wrong_reduced(ctx: &Ctx, base: DevPtr, len: usize, seeds: &[u64], dtype: DataType) -> Res<u64> {
    let mut host = vec![0u8; len.min(CHUNK)];
    let mut wrong = 0u64;
    let mut off = 0;
    while off < len {
        let l = (len - off).min(CHUNK);
        ctx.dev.copy_to_host(&mut host[..l], base.add(off)).map_err(|e| format!("copy back: {e}"))?;
        let threads = ctx.verify_threads.max(1);
        let piece = l.div_ceil(threads).div_ceil(8) * 8;
        let got = &host[..l];
        wrong += std::thread::scope(|sc| {
            let hs: Vec<_> = got
                .chunks(piece)
                .enumerate()
                .map(|(i, part)| sc.spawn(move || wrong_reduced(part, off + i * piece, seeds, dtype)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(u64::MAX / 64)).sum::<u64>()
        });
        off += l;
    }
    Ok(wrong)
}

/// Wrong elements of `got`, bytes `start..` of the reduction (`start` a multiple of 8).
fn wrong_reduced(got: &[u8], start: usize, seeds: &[u64], dtype: DataType) -> u64 {
    let inputs: Vec<Vec<u8>> = seeds
        .iter()
        .map(|s| {
            let mut v = vec![0u8; got.len().div_ceil(4) * 4];
            for (w, out) in v.chunks_exact_mut(4).enumerate() {
                out.copy_from_slice(&pattern_word(*s, (start / 4 + w) as u64).to_le_bytes());
            }
            v.truncate(got.len());
            v
        })
        .collect();
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut want = vec![0u8; got.len()];
    if hoccl::reduce::reduce_into(dtype, crate::ops::RED_OP, &mut want, &refs).is_err() {
        return u64::MAX / 64;
    }
    got.chunks(dtype.size()).zip(want.chunks(dtype.size())).filter(|(a, b)| a != b).count() as u64
}

fn count_wrong_block(ctx: &Ctx, base: DevPtr, blk: &Block, es: usize) -> Res<u64> {
    let mut host = vec![0u8; blk.len.min(CHUNK)];
    let mut wrong = 0u64;
    let mut off = 0;
    while off < blk.len {
        let l = (blk.len - off).min(CHUNK);
        ctx.dev.copy_to_host(&mut host[..l], base.add(blk.off + off)).map_err(|e| format!("copy back: {e}"))?;
        wrong += count_wrong(&host[..l], blk.seed, off, es, ctx.verify_threads);
        off += l;
    }
    Ok(wrong)
}

/// Wrong elements of `got`, which should hold bytes `start..start+got.len()` of the
/// pattern of `seed`. `start` is a multiple of 8 (so of 4 and of `es`); split over threads.
pub fn count_wrong(got: &[u8], seed: u64, start: usize, es: usize, threads: usize) -> u64 {
    let threads = threads.max(1);
    let piece = got.len().div_ceil(threads).div_ceil(8) * 8;
    if threads == 1 || piece >= got.len() {
        return count_wrong_serial(got, seed, start, es);
    }
    std::thread::scope(|sc| {
        let hs: Vec<_> = got
            .chunks(piece)
            .enumerate()
            .map(|(i, part)| sc.spawn(move || count_wrong_serial(part, seed, start + i * piece, es)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(u64::MAX / 64)).sum()
    })
}

fn count_wrong_serial(got: &[u8], seed: u64, start: usize, es: usize) -> u64 {
    debug_assert_eq!(start % 4, 0);
    let mut exp = vec![0u8; got.len().div_ceil(4) * 4];
    for (w, out) in exp.chunks_exact_mut(4).enumerate() {
        out.copy_from_slice(&pattern_word(seed, (start / 4 + w) as u64).to_le_bytes());
    }
    let exp = &exp[..got.len()];
    if got == exp {
        return 0;
    }
    // A trailing partial element (only at a block end that is not element-aligned, which
    // the geometry never produces) counts as one element.
    got.chunks(es).zip(exp.chunks(es)).filter(|(a, b)| a != b).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use hoccl::device::pattern_byte;
    #[test]
    fn counts_elements() {
        let seed = 42;
        let mut v: Vec<u8> = (0..1000u64).map(|i| pattern_byte(seed, i + 64)).collect();
        assert_eq!(count_wrong(&v, seed, 64, 2, 3), 0);
        v[10] ^= 1;
        v[11] ^= 1; // same bf16 element
        v[998] ^= 4;
        assert_eq!(count_wrong(&v, seed, 64, 2, 1), 2);
        assert_eq!(count_wrong(&v, seed, 64, 2, 4), 2);
        assert_eq!(count_wrong(&v, seed, 64, 1, 4), 3);
    }
}

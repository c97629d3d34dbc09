//! Timing of one point, as nccl-tests does it: after a barrier, host wall time around
//! `iters` back-to-back ops on one stream until that stream is synchronized, divided by
//! `iters`; the maximum over ranks. Warm-up ops (and the cold first op, reported apart)
//! are excluded.
use crate::ctx::{Ctx, Res};
use crate::nccl::NcclComm;
use crate::ops::{issue_hoccl, Bufs, Geom};
use hoccl::device::StreamHandle;
use std::time::Instant;

/// Which library runs an op.
#[derive(Clone, Copy)]
pub enum Impl<'a> {
    Hoccl,
    Nccl(&'a NcclComm),
}

impl Impl<'_> {
    pub fn label(&self) -> &str {
        match self {
            Impl::Hoccl => "hoccl",
            Impl::Nccl(c) => &c.label,
        }
    }

    /// Enqueue one op on stream `s`.
    pub fn issue(&self, ctx: &Ctx, g: &Geom, b: &Bufs, s: StreamHandle) -> Res<()> {
        match self {
            Impl::Hoccl => issue_hoccl(&ctx.comm, g, b, ctx.opts.dtype, s).map_err(|e| e.to_string()),
            Impl::Nccl(c) => c.issue(g, b, ctx.opts.dtype, s, ctx.rank, ctx.n),
        }
    }

    /// Wait for `s` and surface asynchronous errors of this implementation.
    pub fn sync(&self, ctx: &Ctx, s: StreamHandle) -> Res<()> {
        ctx.sync_stream(s)?;
        match self {
            Impl::Hoccl => Ok(()),
            Impl::Nccl(c) => c.async_error(),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Mean time per op of the timed run (max over ranks).
    pub time_us: f64,
    /// The first op at this point, alone (max over ranks): includes one-time costs such as
    /// opening peers' buffers.
    pub first_us: f64,
    pub iters: usize,
}

/// `k` ops back to back after a barrier, then sync; seconds on this rank.
fn run_ops(ctx: &Ctx, imp: Impl, g: &Geom, b: &Bufs, k: usize) -> Res<f64> {
    ctx.barrier()?;
    let t0 = Instant::now();
    for _ in 0..k {
        imp.issue(ctx, g, b, ctx.stream)?;
    }
    imp.sync(ctx, ctx.stream)?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Time one point. Every rank calls this with the same arguments (except buffers).
pub fn time_point(ctx: &Ctx, imp: Impl, g: &Geom, b: &Bufs) -> Res<Timing> {
    time_adaptive(ctx, &|k| run_ops(ctx, imp, g, b, k))
}

/// The timing rule of every point: `run(k)` does k back-to-back units of work from a
/// barrier to stream sync and returns this rank's seconds. One cold unit alone first, then
/// `--iters` (after `--warmup` units) or enough units for `--min-time-ms` (the probe's
/// units are the warm-up); every figure is the maximum over ranks.
pub fn time_adaptive(ctx: &Ctx, run: &dyn Fn(usize) -> Res<f64>) -> Res<Timing> {
    let first = ctx.max_f64(run(1)?)?;
    let o = &ctx.opts;
    let iters: usize = match o.iters {
        Some(n) => {
            run(o.warmup.unwrap_or(2))?;
            n
        }
        None => {
            // Probe with a few units (these are the warm-up), then aim for min_time_ms.
            let probe_n = o.warmup.unwrap_or(3).max(1);
            let per = ctx.max_f64(run(probe_n)? / probe_n as f64)?;
            ((o.min_time_ms * 1e-3 / per.max(1e-7)).ceil() as usize).clamp(5, 100_000)
        }
    };
    let mut t = ctx.max_f64(run(iters)?)?;
    // A probe of a few small units is dominated by the sync's fixed cost and overstates
    // their time: when the timed run falls short of half the target, time again with as
    // many units as its own rate asks for (the same decision on every rank: `t` is the
    // maximum over ranks).
    let (mut iters, want) = (iters, o.min_time_ms * 1e-3);
    if o.iters.is_none() && t < want / 2.0 && iters < 100_000 {
        iters = ((want / (t / iters as f64).max(1e-8)).ceil() as usize).clamp(5, 100_000);
        t = ctx.max_f64(run(iters)?)?;
    }
    Ok(Timing { time_us: t / iters as f64 * 1e6, first_us: first * 1e6, iters })
}

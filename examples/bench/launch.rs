//! CPU launch cost: host time of one call (enqueue only, not completion), per op.
use crate::ctx::{Ctx, Res};
use crate::ops::{geom, Bufs};
use crate::report::{human, Json, JsonExt};
use crate::timing::Impl;
use std::fmt::Write as _;
use std::time::Instant;

pub struct LaunchStat {
    pub op: &'static str,
    pub imp: String,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl LaunchStat {
    pub fn json(&self, bytes: usize, calls: usize) -> Json {
        Json::obj(vec![
            ("op", Json::str(self.op)),
            ("impl", Json::str(self.imp.clone())),
            ("bytes", Json::num(bytes as f64)),
            ("calls", Json::num(calls as f64)),
            ("mean_us", Json::num(self.mean_us)),
            ("p50_us", Json::num(self.p50_us)),
            ("p99_us", Json::num(self.p99_us)),
            ("max_us", Json::num(self.max_us)),
        ])
    }
}

/// Per-call host times (seconds) of `calls` calls, synchronizing every 100 (outside the
/// timed calls).
fn call_times(ctx: &Ctx, imp: Impl, g: &crate::ops::Geom, b: &Bufs, calls: usize) -> Res<Vec<f64>> {
    for _ in 0..10 {
        imp.issue(ctx, g, b, ctx.stream)?;
    }
    imp.sync(ctx, ctx.stream)?;
    ctx.barrier()?;
    let mut t = Vec::with_capacity(calls);
    for i in 0..calls {
        let t0 = Instant::now();
        imp.issue(ctx, g, b, ctx.stream)?;
        t.push(t0.elapsed().as_secs_f64());
        if (i + 1) % 100 == 0 {
            imp.sync(ctx, ctx.stream)?;
        }
    }
    imp.sync(ctx, ctx.stream)?;
    Ok(t)
}

/// Mean, p50, p99 and max of this rank's call times, each the worst over ranks (µs).
fn stats(ctx: &Ctx, mut t: Vec<f64>) -> Res<[f64; 4]> {
    t.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| t[((t.len() as f64 * q) as usize).min(t.len() - 1)];
    let mine = [t.iter().sum::<f64>() / t.len() as f64, pick(0.5), pick(0.99), t[t.len() - 1]];
    let mut out = [0.0; 4];
    for (o, v) in out.iter_mut().zip(mine) {
        *o = ctx.max_f64(v * 1e6)?;
    }
    Ok(out)
}

/// Measure every op of `--ops` with every implementation.
pub fn run(ctx: &Ctx, imps: &[Impl]) -> Res<Vec<LaunchStat>> {
    let o = &ctx.opts;
    let mut out = Vec::new();
    for &op in &o.ops {
        let Some(g) = geom(op, o.launch_size, ctx.n, o.dtype.size(), ctx.rank) else { continue };
        let b = Bufs::new(&ctx.dev, g.send_len, g.recv_len)?;
        for &imp in imps {
            let before = hoccl::device::kernels::launch_count();
            let t = call_times(ctx, imp, &g, &b, o.launch_calls)?;
            let launched = hoccl::device::kernels::launch_count() - before;
            if launched != 0 {
                return Err(format!("{} {}: hoccl launched {launched} kernels during the calls", imp.label(), op.name()));
            }
            let [mean_us, p50_us, p99_us, max_us] = stats(ctx, t)?;
            out.push(LaunchStat { op: op.name(), imp: imp.label().to_string(), mean_us, p50_us, p99_us, max_us });
        }
    }
    Ok(out)
}

/// The table, with the target `max_us` for hoccl's worst mean.
pub fn table(ctx: &Ctx, st: &[LaunchStat], max_us: f64) -> String {
    let o = &ctx.opts;
    let mut s = format!(
        "\n# CPU launch cost: host time of one call, enqueue only ({}, {} calls per op, stream sync every 100 calls outside the timed calls; worst rank of {})\n",
        human(o.launch_size),
        o.launch_calls,
        ctx.n
    );
    let _ = writeln!(s, "# {:<10} {:<10} {:>9} {:>9} {:>9} {:>9}", "op", "impl", "mean(us)", "p50(us)", "p99(us)", "max(us)");
    for x in st {
        let _ = writeln!(s, "  {:<10} {:<10} {:>9.2} {:>9.2} {:>9.2} {:>9.1}", x.op, x.imp, x.mean_us, x.p50_us, x.p99_us, x.max_us);
    }
    let worst = st.iter().filter(|x| x.imp == "hoccl").map(|x| x.mean_us).fold(0.0, f64::max);
    let _ = writeln!(s, "# Target: hoccl mean <= {max_us} us per operation: worst op {worst:.2} us  {}", if worst <= max_us { "PASS" } else { "FAIL" });
    s
}

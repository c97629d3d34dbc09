//! Interference: a compute-bound bf16 GEMM on rank 0's GPU, timed alone and while every
//! rank runs back-to-back AllGathers on another stream for the whole GEMM window — once
//! with hoccl (copy engines, no SM) and once per NCCL variant (SM kernels).
use crate::ctx::{Ctx, Res};
use crate::cublas::Gemm;
use crate::ops::{geom, Bufs, Geom, OpKind};
use crate::report::{human, Json};
use crate::timing::{time_point, Impl};
use hoccl::device::kernels::launch_count;
use hoccl::device::StreamHandle;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const BATCHES: usize = 15;

pub struct Row {
    pub imp: String,
    pub tflops: f64,
    pub slowdown_pct: f64,
    /// The background AllGather alone: busbw GB/s and ops run under the GEMM.
    pub bg_busbw: f64,
    pub bg_ops: usize,
    /// Whether the background was still running when the last GEMM finished.
    pub covered: bool,
}

pub struct Outcome {
    pub cublas: String,
    pub gemm_n: usize,
    pub bg_bytes: usize,
    pub alone: f64,
    pub alone_after: f64,
    pub rows: Vec<Row>,
    /// Kernels hoccl launched during the hoccl background sections, summed over ranks, and
    /// rank 0's `launch_count()` before and after its section.
    pub hoccl_launches: u64,
    pub launch_count_before_after: (u64, u64),
}

/// Rank 0's GEMM and its stream (absent on other ranks).
struct Compute {
    gemm: Gemm,
    stream: StreamHandle,
    per_batch: usize,
}

/// Median seconds per GEMM over `BATCHES` batches of back-to-back GEMMs.
fn gemm_seconds(ctx: &Ctx, c: &Compute) -> Res<f64> {
    let mut per = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        let t0 = Instant::now();
        for _ in 0..c.per_batch {
            c.gemm.run()?;
        }
        ctx.dev.synchronize(c.stream).map_err(|e| format!("GEMM sync: {e}"))?;
        per.push(t0.elapsed().as_secs_f64() / c.per_batch as f64);
    }
    per.sort_by(|a, b| a.total_cmp(b));
    Ok(per[BATCHES / 2])
}

fn setup_compute(ctx: &Ctx) -> Res<Compute> {
    ctx.dev.bind_thread().map_err(|e| format!("bind GPU context: {e}"))?;
    let stream = ctx.dev.create_stream().map_err(|e| format!("GEMM stream: {e}"))?;
    let gemm = Gemm::new(&ctx.dev, stream, ctx.opts.gemm_n)?;
    let mut c = Compute { gemm, stream, per_batch: 1 };
    // Warm up (cuBLAS picks its kernel and workspace), then size batches to >= ~5 ms.
    for _ in 0..3 {
        c.gemm.run()?;
    }
    ctx.dev.synchronize(stream).map_err(|e| format!("GEMM sync: {e}"))?;
    let t = Instant::now();
    c.gemm.run()?;
    ctx.dev.synchronize(stream).map_err(|e| format!("GEMM sync: {e}"))?;
    c.per_batch = ((5e-3 / t.elapsed().as_secs_f64().max(1e-6)).ceil() as usize).clamp(2, 1000);
    Ok(c)
}

/// The background thread's loop. While it runs, the thread that started it makes no call
/// on the same communicator (it only runs cuBLAS on another stream) and joins it before
/// the next one (what `NcclComm`'s Sync relies on).
fn enqueue_background(ctx: &Ctx, imp: Impl, bg: &Background, n_ops: usize, started: &AtomicUsize) -> Res<()> {
    ctx.dev.bind_thread().map_err(|e| format!("bind GPU context: {e}"))?;
    for _ in 0..n_ops {
        imp.issue(ctx, &bg.g, &bg.b, bg.stream)?;
        started.fetch_add(1, Ordering::Release);
    }
    Ok(())
}

/// The background AllGather: its shape, buffers and stream.
struct Background {
    g: Geom,
    b: Bufs,
    stream: StreamHandle,
}

/// One background run: every rank enqueues `n_ops` AllGathers on the background stream;
/// rank 0 times the GEMM meanwhile. Returns (seconds per GEMM, covered) on rank 0.
fn with_background(ctx: &Ctx, imp: Impl, comp: Option<&Compute>, bg: &Background, n_ops: usize, lead: Duration) -> Res<(f64, bool)> {
    ctx.barrier()?;
    let Some(c) = comp else {
        for _ in 0..n_ops {
            imp.issue(ctx, &bg.g, &bg.b, bg.stream)?;
        }
        imp.sync(ctx, bg.stream)?;
        return Ok((0.0, true));
    };
    let started = AtomicUsize::new(0);
    let (t, covered, bg_result) = std::thread::scope(|sc| {
        let h = sc.spawn(|| enqueue_background(ctx, imp, bg, n_ops, &started));
        while started.load(Ordering::Acquire) < n_ops.min(4) && !h.is_finished() {
            std::thread::sleep(Duration::from_micros(100));
        }
        std::thread::sleep(lead);
        let t = gemm_seconds(ctx, c);
        let busy = started.load(Ordering::Acquire) < n_ops || !ctx.dev.stream_query(bg.stream).unwrap_or(true);
        let r = h.join().unwrap_or_else(|_| Err("background thread panicked".into()));
        (t, busy, r)
    });
    bg_result?;
    imp.sync(ctx, bg.stream)?;
    Ok((t?, covered))
}

/// Run the whole interference benchmark; Ok(None) with a printed reason when it cannot run.
pub fn run(ctx: &Ctx, imps: &[Impl]) -> Res<Result<Outcome, String>> {
    if !ctx.cuda {
        return Ok(Err("interference skipped: it needs the CUDA backend (cuBLAS GEMM on a GPU)".into()));
    }
    let comp = if ctx.is_root() { Some(setup_compute(ctx)) } else { None };
    let err = comp.as_ref().and_then(|c| c.as_ref().err().cloned()).unwrap_or_default();
    let err = ctx.bcast_str(0, &err)?;
    if !err.is_empty() {
        return Ok(Err(format!("interference skipped: {err}")));
    }
    let comp = comp.and_then(Result::ok);
    let cublas = ctx.bcast_str(0, comp.as_ref().map_or("", |c| c.gemm.path()))?;
    let o = &ctx.opts;
    let g = geom(OpKind::AllGather, o.bg_size, ctx.n, o.dtype.size(), ctx.rank).ok_or("--bg-size too small for one element per rank")?;
    let b = Bufs::new(&ctx.dev, g.send_len, g.recv_len)?;
    let stream = ctx.dev.create_stream().map_err(|e| format!("background stream: {e}"))?;
    let bg = Background { g, b, stream };
    let gemm_s = |c: &Option<Compute>| c.as_ref().map_or(Ok(0.0), |c| gemm_seconds(ctx, c));
    let t_alone = ctx.gather_f64(gemm_s(&comp)?)?[0];
    let flops = 2.0 * (o.gemm_n as f64).powi(3);
    let per_batch = ctx.gather_f64(comp.as_ref().map_or(0.0, |c| c.per_batch as f64))?[0];
    let window = t_alone * per_batch * BATCHES as f64;
    let mut rows = Vec::new();
    let mut hoccl_launches = 0;
    let mut before_after = (0, 0);
    for &imp in imps {
        let t_ag = time_point(ctx, imp, &bg.g, &bg.b)?.time_us * 1e-6;
        let lead = Duration::from_secs_f64((3.0 * t_ag).max(5e-3));
        // Three GEMM windows of background (the GEMM may slow down), plus the lead-in.
        let n_ops = (((lead.as_secs_f64() + 3.0 * window + 0.05) / t_ag).ceil() as usize).clamp(20, 200_000);
        let l0 = launch_count();
        let (t, covered) = with_background(ctx, imp, comp.as_ref(), &bg, n_ops, lead)?;
        let l1 = launch_count();
        if matches!(imp, Impl::Hoccl) {
            hoccl_launches = ctx.sum_u64(l1 - l0)?;
            before_after = (l0, l1);
        }
        let t = ctx.gather_f64(t)?[0];
        let covered = ctx.all(covered)?;
        let algbw = bg.g.bytes as f64 / t_ag / 1e9;
        rows.push(Row {
            imp: imp.label().to_string(),
            tflops: flops / t / 1e12,
            slowdown_pct: (1.0 - t_alone / t) * 100.0,
            bg_busbw: algbw * OpKind::AllGather.bus_factor(ctx.n),
            bg_ops: n_ops,
            covered,
        });
    }
    let alone_after = ctx.gather_f64(gemm_s(&comp)?)?[0];
    ctx.dev.synchronize(bg.stream).map_err(|e| e.to_string())?;
    Ok(Ok(Outcome { cublas, gemm_n: o.gemm_n, bg_bytes: bg.g.bytes, alone: flops / t_alone / 1e12, alone_after: flops / alone_after / 1e12, rows, hoccl_launches, launch_count_before_after: before_after }))
}

pub fn table(ctx: &Ctx, r: &Outcome) -> String {
    let mut s = format!(
        "\n# Interference: bf16 GEMM {n}x{n}x{n} (cuBLAS {}, fp32 accumulate) on rank 0's GPU ({}), median of {BATCHES} batches;\n#   background: back-to-back AllGather of {} (recv total) on all {} ranks, on another stream\n",
        r.cublas,
        ctx.device_name,
        human(r.bg_bytes),
        ctx.n,
        n = r.gemm_n
    );
    let _ = writeln!(s, "# {:<22} {:>9} {:>10} {:>14} {:>8} {:>8}", "condition", "TFLOP/s", "slowdown", "bg busbw GB/s", "bg ops", "covered");
    let _ = writeln!(s, "  {:<22} {:>9.1} {:>10}", "GEMM alone", r.alone, "-");
    for x in &r.rows {
        let _ = writeln!(
            s,
            "  {:<22} {:>9.1} {:>9.1}% {:>14.1} {:>8} {:>8}",
            format!("+ {} AllGather", x.imp),
            x.tflops,
            x.slowdown_pct,
            x.bg_busbw,
            x.bg_ops,
            if x.covered { "yes" } else { "NO" }
        );
    }
    let _ = writeln!(s, "  {:<22} {:>9.1}   (drift check)", "GEMM alone, again", r.alone_after);
    let (l0, l1) = r.launch_count_before_after;
    let _ = writeln!(
        s,
        "# hoccl launch_count() on rank 0 before/after its hoccl background section: {l0}/{l1}; launches in those sections, all ranks: {} {}",
        r.hoccl_launches,
        if r.hoccl_launches == 0 { "(zero-SM: copy engines only)" } else { "<-- ERROR: must be 0" }
    );
    let h = r.rows.iter().find(|x| x.imp == "hoccl").map(|x| x.slowdown_pct);
    let n = r.rows.iter().find(|x| x.imp == "nccl").map(|x| x.slowdown_pct);
    if let (Some(h), Some(n)) = (h, n) {
        let ok = h <= n / 3.0;
        let _ = writeln!(s, "# Target: hoccl slowdown <= 1/3 of NCCL default's: {h:.1}% vs {n:.1}%/3 = {:.1}%  {}", n / 3.0, if ok { "PASS" } else { "FAIL" });
    }
    if r.rows.iter().any(|x| !x.covered) {
        let _ = writeln!(s, "# WARNING: a background finished before the GEMM window ended (covered = NO): that slowdown is understated");
    }
    s
}

pub fn json(r: &Outcome) -> Json {
    let rows = r
        .rows
        .iter()
        .map(|x| {
            Json::obj(vec![
                ("impl", Json::str(x.imp.clone())),
                ("tflops", Json::num(x.tflops)),
                ("slowdown_pct", Json::num(x.slowdown_pct)),
                ("bg_busbw", Json::num(x.bg_busbw)),
                ("bg_ops", Json::num(x.bg_ops as f64)),
                ("covered", Json::Bool(x.covered)),
            ])
        })
        .collect();
    Json::obj(vec![
        ("gemm_n", Json::num(r.gemm_n as f64)),
        ("bg_bytes", Json::num(r.bg_bytes as f64)),
        ("alone_tflops", Json::num(r.alone)),
        ("alone_after_tflops", Json::num(r.alone_after)),
        ("hoccl_launches", Json::num(r.hoccl_launches as f64)),
        ("with", Json::Arr(rows)),
    ])
}

//! Interference: a compute-bound bf16 GEMM on rank 0's GPU, timed alone and while every
//! rank runs a back-to-back background collective (`--bg-op`: AllGather or AllReduce) on
//! another stream for the whole GEMM window — once with hoccl (AllGather: copy engines, no
//! SM; AllReduce: its reduce kernel on `HOCCL_REDUCE_CTAS` CTAs) and once per NCCL variant.
use crate::ctx::{Ctx, Res};
use crate::cublas::Gemm;
use crate::ops::{geom, Bufs, Geom, OpKind};
use crate::report::{human, Json, JsonExt};
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
    /// The background op alone: busbw GB/s and ops run under the GEMM.
    pub bg_busbw: f64,
    pub bg_ops: usize,
    /// Whether the background was still running when the last GEMM finished.
    pub covered: bool,
}

pub struct Outcome {
    /// What ran (cuBLAS GEMM, or the host backend's CPU stand-in).
    pub kernel: String,
    pub gemm_n: usize,
    pub bg_op: OpKind,
    pub bg_bytes: usize,
    pub alone: f64,
    pub alone_after: f64,
    pub rows: Vec<Row>,
    /// Kernels hoccl launched during the hoccl background sections, summed over ranks, and
    /// rank 0's `launch_count()` before and after its section.
    pub hoccl_launches: u64,
    pub launch_count_before_after: (u64, u64),
}

/// What rank 0 computes: the cuBLAS GEMM on its GPU or, on the host backend, a CPU matmul
/// stand-in that only exercises this harness (its figures say nothing about GPUs).
enum Kernel {
    Gpu { gemm: Gemm, stream: StreamHandle },
    Cpu { a: Vec<f32>, b: Vec<f32>, c: Vec<f32> },
}

/// Rank 0's compute job (absent on other ranks).
struct Compute {
    kernel: Kernel,
    n: usize,
    per_batch: usize,
}

impl Compute {
    fn new(ctx: &Ctx) -> Res<Compute> {
        let kernel = if ctx.cuda {
            ctx.dev.bind_thread().map_err(|e| format!("bind GPU context: {e}"))?;
            let stream = ctx.dev.create_stream().map_err(|e| format!("GEMM stream: {e}"))?;
            Kernel::Gpu { gemm: Gemm::new(&ctx.dev, stream, ctx.opts.gemm_n)?, stream }
        } else {
            let n = ctx.opts.gemm_n.min(256);
            let v = |k: usize| (0..n * n).map(|i| ((i * k) % 17) as f32 / 16.0 - 0.5).collect::<Vec<f32>>();
            Kernel::Cpu { a: v(3), b: v(5), c: vec![0.0; n * n] }
        };
        let n = if ctx.cuda { ctx.opts.gemm_n } else { ctx.opts.gemm_n.min(256) };
        let mut c = Compute { kernel, n, per_batch: 1 };
        // Warm up (cuBLAS picks its kernel and workspace), then size batches to >= ~5 ms.
        for _ in 0..3 {
            c.launch()?;
        }
        c.wait(ctx)?;
        let t = Instant::now();
        c.launch()?;
        c.wait(ctx)?;
        c.per_batch = ((5e-3 / t.elapsed().as_secs_f64().max(1e-6)).ceil() as usize).clamp(2, 1000);
        Ok(c)
    }

    /// Enqueue one GEMM (GPU) or compute one (CPU stand-in).
    fn launch(&mut self) -> Res<()> {
        match &mut self.kernel {
            Kernel::Gpu { gemm, .. } => gemm.run(),
            Kernel::Cpu { a, b, c } => {
                let n = self.n;
                c.iter_mut().for_each(|x| *x = 0.0);
                for i in 0..n {
                    for k in 0..n {
                        let aik = a[i * n + k];
                        for (cj, bj) in c[i * n..(i + 1) * n].iter_mut().zip(&b[k * n..(k + 1) * n]) {
                            *cj += aik * bj;
                        }
                    }
                }
                Ok(())
            }
        }
    }

    fn wait(&self, ctx: &Ctx) -> Res<()> {
        match &self.kernel {
            Kernel::Gpu { stream, .. } => ctx.dev.synchronize(*stream).map_err(|e| format!("GEMM sync: {e}")),
            Kernel::Cpu { .. } => Ok(()),
        }
    }

    fn label(&self) -> String {
        match &self.kernel {
            Kernel::Gpu { gemm, .. } => format!("bf16 GEMM, cuBLAS {} (fp32 accumulate)", gemm.path()),
            Kernel::Cpu { .. } => "CPU f32 matmul STAND-IN (host backend: tests the harness only)".into(),
        }
    }
}

/// Median seconds per GEMM over `BATCHES` batches of back-to-back GEMMs.
fn gemm_seconds(ctx: &Ctx, c: &mut Compute) -> Res<f64> {
    let mut per = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        let t0 = Instant::now();
        for _ in 0..c.per_batch {
            c.launch()?;
        }
        c.wait(ctx)?;
        per.push(t0.elapsed().as_secs_f64() / c.per_batch as f64);
    }
    per.sort_by(|a, b| a.total_cmp(b));
    Ok(per[BATCHES / 2])
}

/// Hands an implementation (which may borrow an NCCL communicator, a type that is Send but
/// not Sync) to the background thread.
struct Lent<'a>(Impl<'a>);

// SAFETY: while the background thread runs, the thread that lent the implementation makes
// no call on the same communicator (it only runs cuBLAS on another stream and polls the
// background stream) and joins the background thread before its next call, so calls on
// the communicator never overlap.
unsafe impl Send for Lent<'_> {}

impl<'a> Lent<'a> {
    /// Taking `self` whole makes a closure capture the wrapper, not its field.
    fn get(self) -> Impl<'a> {
        self.0
    }
}

/// The background thread's loop.
fn enqueue_background(ctx: &Ctx, imp: Impl, bg: &Background, n_ops: usize, started: &AtomicUsize) -> Res<()> {
    ctx.dev.bind_thread().map_err(|e| format!("bind GPU context: {e}"))?;
    for _ in 0..n_ops {
        imp.issue(ctx, &bg.g, &bg.b, bg.stream)?;
        started.fetch_add(1, Ordering::Release);
    }
    Ok(())
}

/// The background op: its shape, buffers and stream.
struct Background {
    g: Geom,
    b: Bufs,
    stream: StreamHandle,
}

/// One background run: every rank enqueues `n_ops` background ops on the background stream;
/// rank 0 times the GEMM meanwhile. Returns (seconds per GEMM, covered) on rank 0.
fn with_background(ctx: &Ctx, imp: Impl, comp: Option<&mut Compute>, bg: &Background, n_ops: usize, lead: Duration) -> Res<(f64, bool)> {
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
        let lent = Lent(imp);
        let started = &started;
        let h = sc.spawn(move || enqueue_background(ctx, lent.get(), bg, n_ops, started));
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

/// Run the whole interference benchmark; Ok(Err(reason)) when it cannot run.
pub fn run(ctx: &Ctx, imps: &[Impl]) -> Res<Result<Outcome, String>> {
    let comp = if ctx.is_root() { Some(Compute::new(ctx)) } else { None };
    let err = ctx.bcast_str(0, comp.as_ref().and_then(|c| c.as_ref().err()).map_or("", |e| e.as_str()))?;
    if !err.is_empty() {
        return Ok(Err(format!("interference skipped: {err}")));
    }
    let mut comp = comp.and_then(Result::ok);
    let kernel = ctx.bcast_str(0, &comp.as_ref().map_or(String::new(), |c| c.label()))?;
    let o = &ctx.opts;
    let g = geom(o.bg_op, o.bg_size, ctx.n, o.dtype.size(), ctx.rank).ok_or("--bg-size too small for one element per rank")?;
    let b = Bufs::new(&ctx.dev, g.send_len, g.recv_len)?;
    // `--data`'s bytes when given (the compressed engine's cost depends on them; a copy, no
    // kernel). Otherwise the buffers stay as allocated, so that a copy-engine background
    // section loads no kernel module at all.
    if ctx.opts.data.is_some() {
        crate::Inputs::new(ctx, g.send_len)?.fill(ctx, &b, g.send_len)?;
    }
    let stream = ctx.dev.create_stream().map_err(|e| format!("background stream: {e}"))?;
    let bg = Background { g, b, stream };
    let gemm_s = |c: &mut Option<Compute>| c.as_mut().map_or(Ok(0.0), |c| gemm_seconds(ctx, c));
    // Warm-up: the first batches run at lower clocks (seen on the H200: 722 TFLOP/s first,
    // 789 later), which would flatter every background that comes after.
    gemm_s(&mut comp)?;
    let t_alone = ctx.gather_f64(gemm_s(&mut comp)?)?[0];
    let shape = ctx.gather_f64(comp.as_ref().map_or(0.0, |c| c.n as f64))?[0];
    let flops = 2.0 * shape.powi(3);
    let per_batch = ctx.gather_f64(comp.as_ref().map_or(0.0, |c| c.per_batch as f64))?[0];
    let window = t_alone * per_batch * BATCHES as f64;
    let mut rows = Vec::new();
    let (mut hoccl_launches, mut before_after) = (0, (0, 0));
    for &imp in imps {
        let t_ag = time_point(ctx, imp, &bg.g, &bg.b)?.time_us * 1e-6;
        let lead = Duration::from_secs_f64((3.0 * t_ag).max(5e-3));
        // Three GEMM windows of background (the GEMM may slow down), plus the lead-in.
        let n_ops = (((lead.as_secs_f64() + 3.0 * window + 0.05) / t_ag).ceil() as usize).clamp(20, 200_000);
        let l0 = launch_count();
        let (t, covered) = with_background(ctx, imp, comp.as_mut(), &bg, n_ops, lead)?;
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
            slowdown_pct: t, // seconds for now; a slowdown once both baselines are known
            bg_busbw: algbw * o.bg_op.bus_factor(ctx.n),
            bg_ops: n_ops,
            covered,
        });
    }
    let alone_after = ctx.gather_f64(gemm_s(&mut comp)?)?[0];
    // Slowdowns against the faster of the two baselines (the conservative choice).
    let base = t_alone.min(alone_after);
    for r in &mut rows {
        r.slowdown_pct = (1.0 - base / r.slowdown_pct) * 100.0;
    }
    ctx.dev.synchronize(bg.stream).map_err(|e| e.to_string())?;
    Ok(Ok(Outcome {
        kernel,
        gemm_n: shape as usize,
        bg_op: o.bg_op,
        bg_bytes: bg.g.bytes,
        alone: flops / t_alone / 1e12,
        alone_after: flops / alone_after / 1e12,
        rows,
        hoccl_launches,
        launch_count_before_after: before_after,
    }))
}

pub fn table(ctx: &Ctx, r: &Outcome) -> String {
    let mut s = format!(
        "\n# Interference: {n}x{n}x{n} {} on rank 0 ({}), median of {BATCHES} batches;\n#   background: back-to-back {} of {} on all {} ranks, on another stream\n",
        r.kernel,
        ctx.device_name,
        r.bg_op.name(),
        human(r.bg_bytes),
        ctx.n,
        n = r.gemm_n
    );
    let _ = writeln!(s, "# {:<22} {:>9} {:>10} {:>14} {:>8} {:>8}", "condition", "TFLOP/s", "slowdown", "bg busbw GB/s", "bg ops", "covered");
    let _ = writeln!(s, "  {:<22} {:>9.2} {:>10}", "GEMM alone", r.alone, "-");
    for x in &r.rows {
        let _ = writeln!(
            s,
            "  {:<22} {:>9.2} {:>9.1}% {:>14.1} {:>8} {:>8}",
            format!("+ {} {}", x.imp, r.bg_op.name()),
            x.tflops,
            x.slowdown_pct,
            x.bg_busbw,
            x.bg_ops,
            if x.covered { "yes" } else { "NO" }
        );
    }
    let _ = writeln!(s, "  {:<22} {:>9.2}   (slowdowns are against the faster alone run)", "GEMM alone, again", r.alone_after);
    let (l0, l1) = r.launch_count_before_after;
    // A reduction's reduce step is a kernel by design; data movement must launch none.
    let verdict = match (r.bg_op.is_reduction(), r.hoccl_launches) {
        (true, _) => "(the reduce step's kernels)",
        (false, 0) => "(zero-SM: copy engines only)",
        (false, _) => "<-- ERROR: must be 0",
    };
    let _ = writeln!(
        s,
        "# hoccl launch_count() on rank 0 before/after its hoccl background section: {l0}/{l1}; launches in those sections, all ranks: {} {verdict}",
        r.hoccl_launches,
    );
    let h = r.rows.iter().find(|x| x.imp == "hoccl").map(|x| x.slowdown_pct);
    let n = r.rows.iter().find(|x| x.imp == "nccl").map(|x| x.slowdown_pct);
    if let (Some(h), Some(n), false) = (h, n, r.bg_op.is_reduction()) {
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
        ("kernel", Json::str(r.kernel.clone())),
        ("gemm_n", Json::num(r.gemm_n as f64)),
        ("bg_op", Json::str(r.bg_op.name().to_string())),
        ("bg_bytes", Json::num(r.bg_bytes as f64)),
        ("alone_tflops", Json::num(r.alone)),
        ("alone_after_tflops", Json::num(r.alone_after)),
        ("hoccl_launches", Json::num(r.hoccl_launches as f64)),
        ("with", Json::Arr(rows)),
    ])
}

//! hoccl-example: self-checking
//! hoccl-example-run: --ops allgather,alltoall,gather,scatter --min 64K --max 1M --launch-cost
//! hoccl-example-run: --latency --max 64K --min-time-ms 2 --launch-calls 100 --handshake-rounds 300
//! hoccl-example-run: --ops allreduce,reducescatter,reduce --min 4K --max 256K
//! hoccl-bench: bandwidth of the copy-engine collectives against NCCL, CPU launch cost,
//! GEMM interference, and the per-operation latency run (`--latency`, latency.rs). Run as `mpirun -np N target/release/examples/bench [options]`
//! (`--help` lists them; scripts/gpu/bench.sh is the GPU machine's full run).
//!
//! What is timed (nccl-tests' method): after a barrier, host wall time around `iters`
//! back-to-back ops enqueued on one stream until that stream is synchronized, divided by
//! `iters`, the maximum over ranks. Warm-up ops are excluded; the cold first op of each
//! point is reported apart in the JSON (`first_op_us`). Sizes and bus bandwidth follow
//! nccl-tests. The correctness pass runs after timing (fill kernels are never timed).
mod ctx;
mod cublas;
mod dl;
mod interference;
mod latency;
mod launch;
mod nccl;
mod ops;
mod opts;
mod report;
mod timing;
mod verify;

use ctx::{Ctx, Res};
use hoccl::device::DevPtr;
use std::sync::Arc;
use hoccl::bootstrap::mpi::MpiBootstrap;
use hoccl::comm::Communicator;
use hoccl::device::kernels::{launch_count, module_loaded};
use ops::{geom, Bufs, OpKind};
use report::{Json, JsonExt, Point};
use std::io::Write as _;
use timing::{time_point, Impl};

/// Print on rank 0 only, flushing so that mpirun interleaves sections sensibly.
fn say(ctx: &Ctx, s: &str) {
    if ctx.is_root() {
        print!("{s}");
        let _ = std::io::stdout().flush();
    }
}

fn op_header(op: OpKind, n: usize) -> String {
    let f = format!("busbw = algbw x {}/{n}", n - 1);
    match op {
        OpKind::SendRecv => "each rank sends size bytes to rank+1 and receives from rank-1 in one group; busbw = algbw".into(),
        OpKind::AllGather => format!("size = receive total (n x per-rank block); {f}"),
        OpKind::AlltoAll => format!("size = one rank's send total; {f}"),
        OpKind::Broadcast => "root 0, out of place; size = message; busbw = algbw".into(),
        OpKind::Gather => format!("root 0; size = the root's receive total; {f}"),
        OpKind::Scatter => format!("root 0; size = the root's send total; {f}"),
        OpKind::AllReduce => format!("sum; size = message; busbw = algbw x 2(n-1)/n = {:.3} x algbw; one reduce step per chunk", op.bus_factor(n)),
        OpKind::ReduceScatter => format!("sum; size = one rank's send total; {f}; one reduce step per chunk"),
        OpKind::Reduce => "sum, root 0; size = message; busbw = algbw; one reduce step per chunk at the root".into(),
    }
}

/// What the send buffers hold while timing: `--data`'s bytes tiled (kept in a device copy
/// and copied in before every point, since the check after each point overwrites them),
/// or else random bytes (the verification pattern; incompressible).
enum Inputs {
    File(DevPtr, Arc<dyn hoccl::Device>),
    Random,
}

impl Inputs {
    fn new(ctx: &Ctx, len: usize) -> Res<Inputs> {
        let Some(path) = ctx.opts.data.as_deref() else { return Ok(Inputs::Random) };
        let bytes = std::fs::read(path).map_err(|e| format!("--data {path}: {e}"))?;
        if bytes.is_empty() || len == 0 {
            return Ok(Inputs::Random);
        }
        let tiled: Vec<u8> = bytes.iter().copied().cycle().take(len).collect();
        let p = ctx.dev.alloc(len).map_err(|e| format!("--data buffer: {e}"))?;
        ctx.dev.copy_from_host(p, &tiled).map_err(|e| format!("--data buffer: {e}"))?;
        Ok(Inputs::File(p, ctx.dev.clone()))
    }

    fn fill(&self, ctx: &Ctx, b: &Bufs, len: usize) -> Res<()> {
        if len == 0 {
            return Ok(());
        }
        match self {
            Inputs::File(p, dev) => dev.memcpy_async(ctx.stream, b.send, *p, len).map_err(|e| format!("--data copy: {e}"))?,
            Inputs::Random => ctx.fill(ctx.stream, b.send, len, 0x5EED)?,
        }
        ctx.sync()
    }
}

impl Drop for Inputs {
    fn drop(&mut self) {
        if let Inputs::File(p, dev) = self {
            let _ = dev.free(*p);
        }
    }
}

/// Time (and check) every size of `op` with every implementation.
fn run_op(ctx: &Ctx, oi: usize, op: OpKind, sizes: &[usize], imps: &[Impl]) -> Res<Vec<Point>> {
    let es = ctx.opts.dtype.size();
    let geoms: Vec<_> = sizes.iter().filter_map(|s| geom(op, *s, ctx.n, es, ctx.rank)).collect();
    let Some(largest) = geoms.last() else { return Ok(Vec::new()) };
    let bufs = Bufs::new(&ctx.dev, largest.send_len, largest.recv_len)?;
    let inputs = Inputs::new(ctx, largest.send_len)?;
    let mut pts = Vec::new();
    for (si, g) in geoms.iter().enumerate() {
        for (ii, imp) in imps.iter().enumerate() {
            inputs.fill(ctx, &bufs, g.send_len)?;
            let before = launch_count();
            let t = time_point(ctx, *imp, g, &bufs).map_err(|e| format!("{} {} {}: {e}", imp.label(), op.name(), g.bytes))?;
            // A reduction launches its reduce step (one kernel per chunk on CUDA), the
            // compressed engine its codec kernels; the other operations launch nothing.
            if launch_count() != before && zero_sm(ctx) && !op.is_reduction() {
                return Err(format!("hoccl launched {} kernels while timing {} {}", launch_count() - before, imp.label(), op.name()));
            }
            let wrong = if ctx.opts.check {
                let tag = ((oi * 64 + si) * 16 + ii) as u64;
                Some(verify::check_point(ctx, g, &bufs, tag, &|| imp.issue(ctx, g, &bufs, ctx.stream))?)
            } else {
                None
            };
            let algbw = g.bytes as f64 / (t.time_us * 1e-6) / 1e9;
            pts.push(Point {
                op,
                imp: imp.label().to_string(),
                bytes: g.bytes,
                count: g.total_count,
                time_us: t.time_us,
                first_us: t.first_us,
                iters: t.iters,
                algbw,
                busbw: algbw * op.bus_factor(ctx.n),
                wrong,
            });
        }
    }
    Ok(pts)
}

/// The table's sizes: --min..--max, by default 2M..1G on CUDA and 64K..16M on the host backend.
fn table_sizes(ctx: &Ctx) -> Vec<usize> {
    let o = &ctx.opts;
    let (dmin, dmax) = if ctx.cuda { (2 << 20, 1 << 30) } else { (64 << 10, 16 << 20) };
    opts::sizes(o.min.unwrap_or(dmin), o.max.unwrap_or(dmax))
}

/// Every point of the table; printed per op unless the latency run prints its own rows.
fn run_table(ctx: &Ctx, imps: &[Impl]) -> Res<Vec<Point>> {
    let o = &ctx.opts;
    let sizes = table_sizes(ctx);
    let names: Vec<String> = imps.iter().map(|i| i.label().to_string()).collect();
    let mut all = Vec::new();
    for (oi, &op) in o.ops.iter().enumerate() {
        let pts = run_op(ctx, oi, op, &sizes, imps)?;
        if !o.latency {
            say(ctx, &report::op_table(op, &pts, &names, &op_header(op, ctx.n)));
        }
        all.extend(pts);
    }
    if !o.latency {
        say(ctx, &report::summary(&all, &o.ops, &names, ctx.n, ctx.gpus));
    }
    Ok(all)
}

/// Whether the collectives must launch no kernel: every engine but the compressed one,
/// whose codec kernels run on SMs by design.
fn zero_sm(ctx: &Ctx) -> bool {
    ctx.comm.config().engine != hoccl::EngineChoice::Compressed
}

/// Which kernels hoccl launched in this process, summed over ranks: every one must be a
/// verification fill, unless the run has reductions or the compressed engine. Returns the
/// JSON record and whether the claim held.
fn launch_accounting(ctx: &Ctx) -> Res<(Json, bool)> {
    let total = ctx.sum_u64(launch_count())?;
    let fills = ctx.sum_u64(ctx.fill_launches())?;
    let loaded = ctx.sum_u64(module_loaded() as u64)?;
    let by_collectives = total.saturating_sub(fills);
    let reductions = ctx.opts.ops.iter().any(|o| o.is_reduction()) || (ctx.opts.interference && ctx.opts.bg_op.is_reduction());
    let ok = total == fills || !zero_sm(ctx) || reductions;
    let mut s = format!(
        "\n# hoccl kernel launches, all ranks: {total} = {fills} verification fills (never inside a timed section) + {by_collectives} by collectives{}\n",
        if !zero_sm(ctx) {
            " (HOCCL_ENGINE=compressed: the codec kernels)"
        } else if reductions {
            " (the reductions' reduce steps)"
        } else if ok {
            ""
        } else {
            "  <-- ERROR: collectives must launch no kernel"
        }
    );
    s += &format!("# hoccl kernel module (fatbin) loaded on {loaded} of {} ranks", ctx.n);
    if !ctx.cuda {
        s += " (host backend: there are no kernels)";
    } else {
        s += " (at device open, before any collective; loading runs no kernel)";
    }
    say(ctx, &(s + "\n"));
    let j = Json::obj(vec![
        ("total", Json::num(total as f64)),
        ("verification_fills", Json::num(fills as f64)),
        ("by_collectives", Json::num(by_collectives as f64)),
        ("module_loaded_ranks", Json::num(loaded as f64)),
    ]);
    Ok((j, ok))
}

fn preamble(ctx: &Ctx) -> String {
    let o = &ctx.opts;
    let iters = o.iters.map_or(format!("adaptive (>= {} ms and >= 5 per point)", o.min_time_ms), |n| n.to_string());
    format!(
        "# hoccl bench: {} ranks, {} GPU(s), device {}, backend {}, dtype {}\n\
         # time = host wall time of `iters` back-to-back ops on one stream, from a barrier to stream sync, / iters; max over ranks.\n\
         # Warm-up excluded; iters {iters}; wrong = wrong elements summed over ranks ({}).\n",
        ctx.n,
        ctx.gpus,
        ctx.device_name,
        if ctx.cuda { "cuda" } else { "host" },
        o.dtype.name(),
        if o.check { "checked after timing" } else { "N/A: --no-check" }
    )
}

fn write_json(ctx: &Ctx, path: &str, fields: Vec<(&str, Json)>) -> Res<()> {
    if !ctx.is_root() {
        return Ok(());
    }
    let mut s = String::new();
    Json::obj(fields).write(&mut s);
    std::fs::write(path, s + "\n").map_err(|e| format!("writing {path}: {e}"))?;
    say(ctx, &format!("# JSON written to {path}\n"));
    Ok(())
}

fn run(opts: opts::Opts) -> Res<bool> {
    let mut cfg = hoccl::Config::from_env().map_err(|e| e.to_string())?;
    if let Some(b) = opts.backend {
        cfg.backend = b;
    }
    // Two bootstraps over the world: the communicator owns one, the benchmark's own
    // barriers and result gathers use the other.
    let ctl = MpiBootstrap::world().map_err(|e| e.to_string())?;
    let boot = MpiBootstrap::world().map_err(|e| e.to_string())?;
    let comm = Communicator::with_bootstrap(Box::new(boot), None, cfg).map_err(|e| e.to_string())?;
    let ctx = Ctx::new(opts, ctl, comm)?;
    let o = ctx.opts.clone();
    say(&ctx, &preamble(&ctx));
    let want_nccl = o.compare_nccl || o.interference;
    let nccl = if want_nccl { Some(nccl::setup(&ctx, if o.compare_nccl { &o.nccl_ctas } else { &[] })?) } else { None };
    if let Some(n) = &nccl {
        match (&n.note, &n.api) {
            (Some(note), _) => say(&ctx, &format!("# {note}\n")),
            (None, Some(api)) => say(&ctx, &format!("# NCCL {} from {}: {}\n", api.version_string(), api.lib.path, n.comms.iter().map(|c| c.label.as_str()).collect::<Vec<_>>().join(", "))),
            _ => {}
        }
    }
    let nccl_comms: &[nccl::NcclComm] = nccl.as_ref().map_or(&[], |n| &n.comms);
    let mut imps = vec![Impl::Hoccl];
    if o.compare_nccl {
        imps.extend(nccl_comms.iter().map(Impl::Nccl));
    }
    let (nr, gpus, dev, dt) = (ctx.n, ctx.gpus, ctx.device_name.clone(), o.dtype.name());
    let mut json: Vec<(&str, Json)> = Vec::new();
    let mut wrong_total = 0u64;
    let mut recs: Vec<latency::Rec> = Vec::new();
    if o.table {
        let pts = run_table(&ctx, &imps)?;
        // Summed over ranks already; any wrong element fails the run (exit status 1).
        wrong_total = pts.iter().filter_map(|p| p.wrong).sum();
        if o.latency {
            recs = latency::from_points(&ctx, &pts);
        } else {
            json.push(("points", Json::Arr(pts.iter().map(|p| report::point_json(p, nr, gpus, &dev, dt)).collect())));
        }
    }
    if o.latency {
        recs.extend(latency::d2d(&ctx, &table_sizes(&ctx))?);
        recs.push(latency::handshake(&ctx)?);
        say(&ctx, &latency::table(&ctx, &recs));
    }
    if o.launch_cost {
        let st = launch::run(&ctx, &imps)?;
        say(&ctx, &launch::table(&ctx, &st, if o.latency { 7.0 } else { 10.0 }));
        if o.latency {
            recs.extend(latency::from_launch(&ctx, &st));
        } else {
            json.push(("launch", Json::Arr(st.iter().map(|x| x.json(o.launch_size, o.launch_calls)).collect())));
        }
    }
    if o.interference {
        let mut bg = vec![Impl::Hoccl];
        bg.extend(nccl_comms.iter().map(Impl::Nccl));
        match interference::run(&ctx, &bg)? {
            Ok(r) => {
                say(&ctx, &interference::table(&ctx, &r));
                // A launch there is caught by the accounting below (it would not be a fill).
                json.push(("interference", interference::json(&r)));
            }
            Err(why) => say(&ctx, &format!("\n# {why}\n")),
        }
    }
    let (acc, launches_ok) = launch_accounting(&ctx)?;
    if wrong_total > 0 {
        say(&ctx, &format!("# FAILED: {wrong_total} wrong elements\n"));
    }
    let ok = launches_ok && wrong_total == 0;
    let nv = nccl.as_ref().and_then(|n| n.api.as_ref()).map_or(Json::Null, |a| Json::str(a.version_string()));
    let note = nccl.as_ref().and_then(|n| n.note.clone()).map_or(Json::Null, Json::str);
    let meta = vec![
        ("nranks", Json::num(nr as f64)),
        ("gpus", Json::num(gpus as f64)),
        ("device", Json::str(dev.clone())),
        ("backend", Json::str(if ctx.cuda { "cuda" } else { "host" })),
        ("dtype", Json::str(dt)),
        ("nccl_version", nv),
        ("nccl_note", note),
        ("timing", Json::str("host wall time of iters back-to-back ops on one stream from a barrier to stream sync, / iters, max over ranks")),
        ("checked", Json::Bool(o.check)),
    ];
    if o.latency && ctx.is_root() {
        // The targets cover every record of the file when appending (the one-rank run and
        // the MPS runs of scripts/gpu/latency.sh), else this run's.
        let all = match &o.json {
            Some(path) => {
                let mut run = meta;
                run.retain(|(k, _)| *k != "timing");
                run.push(("mps", Json::Bool(o.mps)));
                run.push(("kernel_launches", acc));
                let all = latency::write(path, o.append, Json::obj(run), &recs, latency::file_meta())?;
                say(&ctx, &format!("# JSON {} {path}\n", if o.append { "appended to" } else { "written to" }));
                all
            }
            None => recs,
        };
        say(&ctx, &latency::targets(&all));
    } else if let (Some(path), false) = (&o.json, o.latency) {
        json.insert(0, ("meta", Json::obj(meta)));
        json.push(("kernel_launches", acc));
        write_json(&ctx, path, json)?;
    }
    ctx.barrier()?;
    drop(nccl); // NCCL communicators go before the streams and the CUDA device
    ctx.comm.wait_idle().map_err(|e| e.to_string())?;
    Ok(ok)
}

fn world_rank_from_env() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"].iter().find_map(|k| std::env::var(k).ok()?.parse().ok())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quiet = world_rank_from_env().is_some_and(|r| r != 0);
    let opts = match opts::parse(&args) {
        Ok(opts::Parsed::Run(o)) => *o,
        Ok(opts::Parsed::Help) => {
            if !quiet {
                println!("{}", opts::USAGE);
            }
            return;
        }
        Err(e) => {
            if !quiet {
                eprintln!("bench: {e}\n\n{}", opts::USAGE);
            }
            std::process::exit(2);
        }
    };
    // NCCL reads this at init; NVLS (multicast objects) stays off in every run. Set while
    // the process still has one thread.
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(v) if v == "0" => {}
        Ok(v) => {
            if !quiet {
                eprintln!("bench: NCCL_NVLS_ENABLE={v} overridden to 0 (no multicast objects in this benchmark)");
            }
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        Err(_) => std::env::set_var("NCCL_NVLS_ENABLE", "0"),
    }
    let code = match run(opts) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("bench: rank {}: {e}", world_rank_from_env().map_or("?".into(), |r| r.to_string()));
            1
        }
    };
    std::process::exit(code);
}

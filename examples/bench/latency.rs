//! The per-operation latency run (`--latency`): per op and size, hoccl's end-to-end time
//! beside NCCL's on the same buffers and stream (the table's timing rule, timing.rs); the
//! floor of the copy-engine design, which is the stream handshake round trip; the
//! device-to-device copy bandwidth of the same sizes; the CPU launch cost; and the targets
//! of the latency work as PASS/FAIL lines (informational).
//!
//! Records (one JSON object each, in `records` of the file; `--append` adds a run's records
//! to an earlier file's, so that one file holds the one-rank run and the MPS runs):
//! - `op` = an operation (`sendrecv`, `allgather`, ...): `time_us` end to end per op,
//!   `algbw_gbs` = bytes / time, `nccl_time_us` NCCL's time (null where NCCL did not run),
//!   `first_op_us`, `iters`, `wrong`, `path` (how hoccl moved the bytes between ranks:
//!   `self` for one rank, copies on the stream; `staged` where every flow to a peer is at
//!   most `HOCCL_STAGED_BYTES`: the same-host staged path, every device operation enqueued
//!   at the call; `gated` where `HOCCL_GATED` is not 0 and
//!   every flow to a peer is one copy, at most 8 MiB: the same-host gated path between
//!   processes; `handshake` otherwise, the proxies' ready/landed exchange);
//! - `op` = `d2d_copy`: `memcpy_async` of `bytes` on the bench stream (every rank at once);
//! - `op` = `handshake`: `time_us` the mean round trip of the stream handshake probe,
//!   `p50_us`, `p99_us`, `min_us`, `rounds`; `bytes` 0;
//! - `op` = `launch_cost`: `time_us` hoccl's mean host time of one call of `call` (enqueue
//!   only), `nccl_time_us` NCCL's;
//!
//! and on every record `ranks` (processes), `bytes`, `mps` (the run was marked `--mps`).
use crate::ctx::{Ctx, Res};
use crate::launch::LaunchStat;
use crate::ops::{Bufs, OpKind, ALL_OPS};
use crate::report::{human, Json, JsonExt, Point};
use crate::timing::time_adaptive;
use hoccl::device::FlagSlab;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One record of latency.json.
#[derive(Clone, Debug, Default)]
pub struct Rec {
    pub op: String,
    pub ranks: usize,
    pub mps: bool,
    pub bytes: u64,
    pub time_us: f64,
    pub algbw_gbs: Option<f64>,
    pub nccl_time_us: Option<f64>,
    /// The fields particular to this kind of record, in file order.
    pub extra: Vec<(String, Json)>,
}

impl Rec {
    fn new(ctx: &Ctx, op: &str, bytes: u64, time_us: f64) -> Rec {
        let algbw = (bytes > 0).then(|| bytes as f64 / (time_us * 1e-6) / 1e9);
        Rec { op: op.into(), ranks: ctx.n, mps: ctx.opts.mps, bytes, time_us, algbw_gbs: algbw, ..Default::default() }
    }

    fn with(mut self, key: &str, v: Json) -> Rec {
        self.extra.push((key.into(), v));
        self
    }

    fn get(&self, key: &str) -> Option<&Json> {
        self.extra.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn json(&self) -> Json {
        let opt = |v: Option<f64>| v.map_or(Json::Null, Json::num);
        let mut f = vec![
            ("op".to_string(), Json::str(self.op.clone())),
            ("ranks".to_string(), Json::Int(self.ranks as i128)),
            ("bytes".to_string(), Json::Int(self.bytes as i128)),
            ("time_us".to_string(), Json::num(self.time_us)),
            ("algbw_gbs".to_string(), opt(self.algbw_gbs)),
            ("nccl_time_us".to_string(), opt(self.nccl_time_us)),
            ("mps".to_string(), Json::Bool(self.mps)),
        ];
        f.extend(self.extra.iter().cloned());
        Json::Obj(f)
    }

    /// A record read back from a file (`--append`); None when a required field is missing.
    pub fn from_json(v: &Json) -> Option<Rec> {
        let Json::Obj(fields) = v else { return None };
        let num = |k: &str| v.get(k).and_then(Json::as_f64);
        let op = match v.get("op")? {
            Json::Str(s) => s.clone(),
            _ => return None,
        };
        let known = ["op", "ranks", "bytes", "time_us", "algbw_gbs", "nccl_time_us", "mps"];
        Some(Rec {
            op,
            ranks: num("ranks")? as usize,
            mps: matches!(v.get("mps"), Some(Json::Bool(true))),
            bytes: num("bytes")? as u64,
            time_us: num("time_us")?,
            algbw_gbs: num("algbw_gbs"),
            nccl_time_us: num("nccl_time_us"),
            extra: fields.iter().filter(|(k, _)| !known.contains(&k.as_str())).cloned().collect(),
        })
    }
}

/// The table's points as records: hoccl's time with NCCL's default communicator beside it.
pub fn from_points(ctx: &Ctx, pts: &[Point]) -> Vec<Rec> {
    let wrong = |w: Option<u64>| Json::opt_num(w);
    pts.iter()
        .filter(|p| p.imp == "hoccl")
        .map(|p| {
            let nccl = pts.iter().find(|q| q.imp == "nccl" && q.op == p.op && q.bytes == p.bytes);
            let mut r = Rec::new(ctx, p.op.name(), p.bytes as u64, p.time_us)
                .with("first_op_us", Json::num(p.first_us))
                .with("iters", Json::Int(p.iters as i128))
                .with("wrong", wrong(p.wrong))
                .with("path", Json::str(path(ctx, p.op, p.bytes)));
            if let Some(q) = nccl {
                r.nccl_time_us = Some(q.time_us);
                r = r.with("nccl_wrong", wrong(q.wrong));
            }
            r
        })
        .collect()
}

/// The gated path's limit: the chunk scheduler's single-copy flow.
const GATED_MAX: usize = 8 << 20;

/// How hoccl moves `bytes` of `op` between this run's ranks (one process each, one host):
/// the largest flow to one peer is the whole buffer for sendrecv and broadcast, a block
/// (`bytes / ranks`) for the others. As configured: the staged path is off where a rank
/// could not set its rings up (logged); `auto` falls back to the handshake only
/// where a device cannot register its peers' flags (logged); the `HOCCL_TRACE_OPS`
/// timelines show the steps an op took.
fn path(ctx: &Ctx, op: OpKind, bytes: usize) -> &'static str {
    let flow = if matches!(op, OpKind::SendRecv | OpKind::Broadcast) { bytes } else { bytes / ctx.n.max(1) };
    if ctx.n == 1 {
        "self"
    } else if flow <= ctx.comm.config().staged_bytes {
        "staged"
    } else if ctx.comm.config().gated != Some(false) && flow <= GATED_MAX {
        "gated"
    } else {
        "handshake"
    }
}

/// Launch-cost statistics as one record per operation (hoccl's mean, NCCL's beside it).
pub fn from_launch(ctx: &Ctx, st: &[LaunchStat]) -> Vec<Rec> {
    let mut out = Vec::new();
    for x in st.iter().filter(|x| x.imp == "hoccl") {
        let mut r = Rec::new(ctx, "launch_cost", ctx.opts.launch_size as u64, x.mean_us)
            .with("call", Json::str(x.op))
            .with("calls", Json::Int(ctx.opts.launch_calls as i128))
            .with("p50_us", Json::num(x.p50_us))
            .with("p99_us", Json::num(x.p99_us))
            .with("max_us", Json::num(x.max_us));
        r.algbw_gbs = None;
        r.nccl_time_us = st.iter().find(|y| y.imp == "nccl" && y.op == x.op).map(|y| y.mean_us);
        out.push(r);
    }
    out
}

/// Device-to-device copy of every size (`memcpy_async` on the bench stream, the table's
/// timing rule): the hardware column, and the 1 GiB figure the "90 % of D2D" target uses.
pub fn d2d(ctx: &Ctx, sizes: &[usize]) -> Res<Vec<Rec>> {
    let Some(&largest) = sizes.last() else { return Ok(Vec::new()) };
    let b = Bufs::new(&ctx.dev, largest, largest)?;
    let mut out = Vec::new();
    for &len in sizes {
        let run = |k: usize| -> Res<f64> {
            ctx.barrier()?;
            let t0 = Instant::now();
            for _ in 0..k {
                ctx.dev.memcpy_async(ctx.stream, b.recv, b.send, len).map_err(|e| format!("memcpy_async: {e}"))?;
            }
            ctx.sync()?;
            Ok(t0.elapsed().as_secs_f64())
        };
        let t = time_adaptive(ctx, &run).map_err(|e| format!("d2d copy {len}: {e}"))?;
        out.push(Rec::new(ctx, "d2d_copy", len as u64, t.time_us).with("iters", Json::Int(t.iters as i128)));
    }
    Ok(out)
}

/// Round trips of the probe excluded from its figures (the first includes the gate).
const HANDSHAKE_WARM: usize = 100;
/// How long the probe waits for one start flag before it releases the stream and fails.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(20);

/// The stream handshake probe, on every rank at once: a stream writes start flag i
/// (`write_value`, `cuStreamWriteValue64` on CUDA) and then waits for finish flag >= i+1
/// (`wait_value_geq`, `cuStreamWaitValue64`); a host thread spins until it sees start i and
/// raises finish to i+1. The time between two start flags seen by the host is one round
/// trip GPU -> CPU -> GPU: the least any op costs whose start and finish pass through a
/// CPU. The whole chain is enqueued before the stream is let go (finish >= 1), so enqueue
/// cost is not in it.
pub fn handshake(ctx: &Ctx) -> Res<Rec> {
    let dev = &ctx.dev;
    let rounds = ctx.opts.handshake_rounds;
    let flags = dev.alloc_flags(2).map_err(|e| format!("alloc_flags: {e}"))?;
    let s = dev.create_stream().map_err(|e| format!("create stream: {e}"))?;
    let (start, finish) = (flags.dev_addr(0), flags.dev_addr(1));
    // On the host backend the stream is a thread that the spinning responder must not
    // starve when cores are few; on CUDA the responder spins without yielding.
    let spin_limit = if ctx.cuda { u32::MAX } else { 256 };
    let (enqueued, abort) = (AtomicBool::new(false), AtomicBool::new(false));
    ctx.barrier()?;
    let (queued, seen) = std::thread::scope(|sc| {
        let responder = sc.spawn(|| respond(&flags, rounds, spin_limit, &enqueued, &abort));
        let queued = (|| -> hoccl::Result<()> {
            dev.wait_value_geq(s, finish, 1)?;
            for i in 1..=rounds as u64 {
                dev.write_value(s, start, i)?;
                dev.wait_value_geq(s, finish, i + 1)?;
            }
            Ok(())
        })();
        if queued.is_err() {
            abort.store(true, Ordering::Release);
        }
        enqueued.store(true, Ordering::Release);
        (queued, responder.join())
    });
    // Every wait of the chain is satisfied by now (the responder raises finish to its last
    // value on success and on failure), so the stream drains before the flags go.
    let synced = dev.synchronize(s).map_err(|e| format!("synchronize: {e}"));
    let _ = dev.destroy_stream(s);
    let seen = queued
        .map_err(|e| format!("handshake probe enqueue: {e}"))
        .and(synced)
        .and_then(|()| seen.map_err(|_| "handshake probe: the responder thread panicked".to_string())?);
    // Every rank reaches the same gathers, failed or not.
    let ok = ctx.all(seen.is_ok())?;
    let seen = seen?;
    if !ok {
        return Err("handshake probe failed on another rank".into());
    }
    let steps: Vec<f64> = seen.windows(2).skip(HANDSHAKE_WARM).map(|w| (w[1] - w[0]).as_secs_f64() * 1e6).collect();
    let mut sorted = steps.clone();
    sorted.sort_by(f64::total_cmp);
    let pick = |q: f64| sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)];
    let mean = steps.iter().sum::<f64>() / steps.len() as f64;
    Ok(Rec::new(ctx, "handshake", 0, ctx.max_f64(mean)?)
        .with("p50_us", Json::num(ctx.max_f64(pick(0.5))?))
        .with("p99_us", Json::num(ctx.max_f64(pick(0.99))?))
        .with("min_us", Json::num(ctx.max_f64(sorted[0])?))
        .with("rounds", Json::Int(steps.len() as i128)))
}

/// The host side of the probe: the time each start flag was first seen. Word 0 is the
/// start flag, word 1 the finish flag. On failure the finish flag is raised past every
/// wait of the chain, so the stream never stays blocked.
fn respond(flags: &FlagSlab, rounds: usize, spin_limit: u32, enqueued: &AtomicBool, abort: &AtomicBool) -> Res<Vec<Instant>> {
    let release_all = || flags.raise(1, rounds as u64 + 1);
    // Let the stream go once the chain is enqueued, or after 100 ms: an enqueue call that
    // blocks on a full command queue must not wait for this gate.
    let t0 = Instant::now();
    while !enqueued.load(Ordering::Acquire) && t0.elapsed() < Duration::from_millis(100) {
        std::thread::yield_now();
    }
    flags.raise(1, 1);
    let mut seen = Vec::with_capacity(rounds);
    let deadline = Instant::now() + HANDSHAKE_LIMIT;
    for i in 1..=rounds as u64 {
        let mut spins = 0u32;
        while flags.load(0) < i {
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && (abort.load(Ordering::Acquire) || Instant::now() > deadline) {
                release_all();
                return Err(format!("handshake probe: start flag {i} of {rounds} not seen (enqueue failed or {HANDSHAKE_LIMIT:?} passed)"));
            }
            if spins > spin_limit {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        seen.push(Instant::now());
        flags.raise(1, i + 1);
    }
    Ok(seen)
}

fn find<'a>(recs: &'a [Rec], op: &str, ranks: usize, mps: bool, bytes: u64) -> Option<&'a Rec> {
    recs.iter().find(|r| r.op == op && r.ranks == ranks && r.mps == mps && r.bytes == bytes)
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.prec$}"))
}

/// This run's rows: per op and size, hoccl beside NCCL and the copy of the same size.
pub fn table(ctx: &Ctx, recs: &[Rec]) -> String {
    let mut s = format!(
        "\n# Latency: {} rank(s) on {} GPU(s), MPS {}; time = end to end per op (table timing: back-to-back ops on one stream, barrier to sync, / iters, worst rank);\n\
         # d2d = memcpy_async of the same size on the same stream, every rank at once; %d2d = hoccl algbw / d2d algbw\n",
        ctx.n,
        ctx.gpus,
        if ctx.opts.mps { "yes" } else { "no" }
    );
    let _ = writeln!(s, "# {:<10} {:>6} {:>10} {:>8} {:>10} {:>6} {:>9} {:>8} {:>5} {}", "op", "size", "hoccl(us)", "GB/s", "nccl(us)", "h/n", "d2d(us)", "GB/s", "%d2d", "path");
    for op in ALL_OPS {
        for r in recs.iter().filter(|r| r.op == op.name()) {
            // The blocked ops round sizes down to whole blocks: the copy of the size asked.
            let copy = recs.iter().rfind(|d| d.op == "d2d_copy" && d.bytes <= r.bytes && d.bytes * 2 > r.bytes);
            let ratio = r.nccl_time_us.map(|n| r.time_us / n);
            let pct = copy.and_then(|d| Some(100.0 * r.algbw_gbs? / d.algbw_gbs?));
            let _ = writeln!(
                s,
                "  {:<10} {:>6} {:>10.2} {:>8.1} {:>10} {:>6} {:>9} {:>8} {:>5} {}",
                r.op,
                human(r.bytes as usize),
                r.time_us,
                r.algbw_gbs.unwrap_or(0.0),
                opt(r.nccl_time_us, 2),
                opt(ratio, 2),
                opt(copy.map(|d| d.time_us), 2),
                opt(copy.and_then(|d| d.algbw_gbs), 1),
                opt(pct, 0),
                match r.get("path") {
                    Some(Json::Str(p)) => p.as_str(),
                    _ => "-",
                }
            );
        }
    }
    if let Some(d) = recs.iter().rfind(|r| r.op == "d2d_copy") {
        let _ = writeln!(s, "# d2d copy, largest size: {} in {:.1} us = {:.1} GB/s", human(d.bytes as usize), d.time_us, d.algbw_gbs.unwrap_or(0.0));
    }
    if let Some(h) = recs.iter().find(|r| r.op == "handshake") {
        let f = |k: &str| h.get(k).and_then(Json::as_f64).unwrap_or(f64::NAN);
        let _ = writeln!(
            s,
            "# stream handshake probe (stream writes start, host thread sees it and writes finish, stream waits for finish; {} round trips, worst rank):\n\
             #   mean {:.2} us, p50 {:.2}, p99 {:.2}, min {:.2}",
            h.get("rounds").and_then(Json::as_f64).unwrap_or(0.0),
            h.time_us,
            f("p50_us"),
            f("p99_us"),
            f("min_us")
        );
    }
    s
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

/// The latency work's targets over `recs` (this run's, with an earlier file's under
/// `--append`). Stated for one H200; printed as information, they do not change the exit
/// status.
pub fn targets(recs: &[Rec]) -> String {
    let mut s = String::from("\n# Targets of the latency work (one H200; informational, not part of the exit status)\n");
    let one: Vec<&Rec> = recs.iter().filter(|r| r.ranks == 1 && !r.mps).collect();
    let (lo, hi) = (4u64 << 10, 1u64 << 20);
    for op in ALL_OPS.map(|o| o.name()) {
        let small: Vec<&&Rec> = one.iter().filter(|r| r.op == op && (lo..=hi).contains(&r.bytes)).collect();
        if let Some(w) = small.iter().max_by(|a, b| a.time_us.total_cmp(&b.time_us)) {
            let _ = writeln!(s, "  1 rank  {op:<10} 4K-1M time <= 12 us:        worst {:>8.2} us @{:<5}  {}", w.time_us, human(w.bytes as usize), verdict(w.time_us <= 12.0));
        }
        let ratios = small.iter().filter_map(|r| Some((r.time_us / r.nccl_time_us?, r.bytes)));
        match ratios.max_by(|a, b| a.0.total_cmp(&b.0)) {
            Some((q, at)) => {
                let _ = writeln!(s, "  1 rank  {op:<10} 4K-1M time <= 1.5 x NCCL:   worst {q:>8.2} x  @{:<5}  {}", human(at as usize), verdict(q <= 1.5));
            }
            None if !small.is_empty() => {
                let _ = writeln!(s, "  1 rank  {op:<10} 4K-1M time <= 1.5 x NCCL:   n/a (no NCCL figures)");
            }
            None => {}
        }
        // At 1 GiB; a run whose sizes stop short says so and reports its largest size.
        let big = one.iter().filter(|r| r.op == op).max_by_key(|r| r.bytes);
        let copy = big.and_then(|b| one.iter().find(|d| d.op == "d2d_copy" && d.bytes == b.bytes));
        if let (Some(b), Some(d)) = (big, copy) {
            let (got, ceil) = (b.algbw_gbs.unwrap_or(0.0), d.algbw_gbs.unwrap_or(f64::INFINITY));
            let at_target = b.bytes == 1 << 30;
            let _ = writeln!(
                s,
                "  1 rank  {op:<10} 1G >= 90 % of d2d:         {got:>8.1} GB/s = {:.0} % of {ceil:.1} @{}  {}",
                100.0 * got / ceil,
                human(b.bytes as usize),
                if at_target { verdict(got >= 0.9 * ceil) } else { "n/a (no 1G point)" }
            );
        }
    }
    let mut mps_ranks: Vec<usize> = recs.iter().filter(|r| r.mps && r.op == "sendrecv").map(|r| r.ranks).collect();
    mps_ranks.sort_unstable();
    mps_ranks.dedup();
    for n in mps_ranks {
        let note = if n == 2 { "" } else { " (stated for 2)" };
        for (bytes, max_us) in [(4u64 << 10, 20.0), (2 << 20, 25.0)] {
            if let Some(r) = find(recs, "sendrecv", n, true, bytes) {
                let _ = writeln!(s, "  MPS {n}   sendrecv   {:<5} time <= {max_us} us:{:>10.2} us{note}  {}", human(bytes as usize), r.time_us, verdict(r.time_us <= max_us));
            }
        }
        if let Some(r) = find(recs, "sendrecv", n, true, 256 << 20) {
            let got = r.algbw_gbs.unwrap_or(0.0);
            let _ = writeln!(s, "  MPS {n}   sendrecv   256M  algbw >= 900 GB/s:{got:>7.1} GB/s{note}  {}", verdict(got >= 900.0));
        }
    }
    let mut groups: Vec<(usize, bool)> = recs.iter().filter(|r| r.op == "launch_cost").map(|r| (r.ranks, r.mps)).collect();
    groups.sort_unstable();
    groups.dedup();
    for (n, mps) in groups {
        let worst = recs.iter().filter(|r| r.op == "launch_cost" && r.ranks == n && r.mps == mps).max_by(|a, b| a.time_us.total_cmp(&b.time_us));
        if let Some(w) = worst {
            let call = match w.get("call") {
                Some(Json::Str(c)) => c.as_str(),
                _ => "?",
            };
            let _ = writeln!(
                s,
                "  {:<7} launch cost <= 7 us per call:     worst {:>8.2} us ({call})  {}",
                if mps { format!("MPS {n}") } else { format!("{n} rank") },
                w.time_us,
                verdict(w.time_us <= 7.0)
            );
        }
    }
    s
}

/// Write the file: this run's records after those of `path` when appending. Returns every
/// record now in the file (for the targets). Rank 0 only.
pub fn write(path: &str, append: bool, run: Json, recs: &[Rec], meta: Json) -> Res<Vec<Rec>> {
    let (mut meta, mut runs, mut old) = (meta, Vec::new(), Vec::new());
    if append {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let v = Json::parse(&text).map_err(|e| format!("{path}: not a latency JSON ({e})"))?;
                let arr = |k: &str| v.get(k).and_then(Json::as_arr).map(<[Json]>::to_vec).ok_or_else(|| format!("{path}: no \"{k}\" array"));
                runs = arr("runs")?;
                old = arr("records")?;
                if let Some(m) = v.get("meta") {
                    meta = m.clone();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("reading {path}: {e}")),
        }
    }
    let mut all: Vec<Rec> = old.iter().map(|v| Rec::from_json(v).ok_or_else(|| format!("{path}: a record without op/ranks/bytes/time_us"))).collect::<Res<_>>()?;
    all.extend(recs.iter().cloned());
    runs.push(run);
    let doc = Json::obj(vec![("meta", meta), ("runs", Json::Arr(runs)), ("records", Json::Arr(all.iter().map(Rec::json).collect()))]);
    let mut s = String::new();
    doc.write(&mut s);
    std::fs::write(path, s + "\n").map_err(|e| format!("writing {path}: {e}"))?;
    Ok(all)
}

/// The file's own description (written by the first run; kept by appending runs).
pub fn file_meta() -> Json {
    Json::obj(vec![
        ("what", Json::str("per-operation latency: hoccl end to end beside NCCL, the stream handshake floor, device-to-device copies, launch cost")),
        ("timing", Json::str("host wall time of iters back-to-back ops on one stream from a barrier to stream sync, / iters, max over ranks")),
        (
            "records",
            Json::str(
                "op = an operation (time_us end to end, algbw_gbs = bytes/time, nccl_time_us NCCL default on the same buffers and stream or null); \
                 d2d_copy = memcpy_async of bytes on the same stream; handshake = mean round trip of cuStreamWriteValue64 start flag -> host thread -> finish flag -> cuStreamWaitValue64 (p50_us, p99_us, min_us, bytes 0); \
                 launch_cost = mean host time of one call of `call`, enqueue only (nccl_time_us: NCCL's); ranks = processes, mps = run under MPS; \
                 path (op records) = self (one rank), staged (every flow to a peer at most HOCCL_STAGED_BYTES: the same-host staged path), gated (HOCCL_GATED not 0 and every flow to a peer one copy of at most 8 MiB: the same-host gated path) or handshake, as configured",
            ),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn records_round_trip_and_feed_the_targets() {
        let rec = |op: &str, ranks, mps, bytes: u64, t: f64| Rec {
            op: op.into(),
            ranks,
            mps,
            bytes,
            time_us: t,
            algbw_gbs: Some(bytes as f64 / t / 1e3),
            nccl_time_us: (ranks == 1).then_some(t / 2.0),
            extra: vec![("iters".into(), Json::Int(7))],
        };
        let recs = vec![rec("sendrecv", 1, false, 4096, 10.0), rec("d2d_copy", 1, false, 1 << 30, 500.0), rec("sendrecv", 1, false, 1 << 30, 520.0), rec("sendrecv", 2, true, 4096, 30.0)];
        let mut text = String::new();
        Json::Arr(recs.iter().map(Rec::json).collect()).write(&mut text);
        let back: Vec<Rec> = Json::parse(&text).unwrap().as_arr().unwrap().iter().map(|v| Rec::from_json(v).unwrap()).collect();
        assert_eq!(back.len(), 4);
        assert_eq!((back[3].ranks, back[3].mps, back[3].bytes), (2, true, 4096));
        assert_eq!(back[0].get("iters"), Some(&Json::Int(7)));
        let t = targets(&back);
        assert!(t.contains("4K-1M time <= 12 us:        worst    10.00 us @4K     PASS"), "{t}");
        assert!(t.contains("1.5 x NCCL:   worst     2.00 x  @4K     FAIL"), "{t}");
        assert!(t.contains("96 % of 2147.5 @1G  PASS"), "{t}");
        assert!(t.contains("MPS 2   sendrecv   4K    time <= 20 us:     30.00 us  FAIL"), "{t}");
    }
}

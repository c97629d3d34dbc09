//! hoccl-example: self-checking
//! hoccl-example-run: --sizes 64K,256K --iters 2 --warmup 1
//! net-bench: measured completion of AllGather, AlltoAll and AlltoAllv (uniform and Zipf)
//! across nodes, next to the simulator's prediction for the same topology and rates;
//! AllReduce, hierarchical (Sum) next to the flat plan (Avg, which stays flat), measured only;
//! and point-to-point sends between nodes (`sendrecv`), direct or relayed through the
//! forwarding peers (`path`: `relayed`), next to the direct prediction.
//!
//! Run as `HOCCL_VIRTUAL_NODES=N HOCCL_NET_GBPS=G mpirun -np R target/release/examples/net_bench
//! [options]` (`--help` lists them; `scripts/net-bench.sh` runs the matrix).
//!
//! Measured: per iteration, after a barrier of the control bootstrap, host wall time from
//! enqueueing one op to its stream's synchronize, the maximum over ranks; the median over
//! `--iters` iterations after `--warmup`. Over the timed iterations also: the kernels hoccl
//! launched (any on an engine other than `compressed` is an error: the raw path is
//! zero-SM), and the CPU time of the proxy threads per GB sent to other nodes (at the
//! kernel's 10 ms tick, so short runs read 0). Every result is verified after timing: each
//! rank's send buffer is a function of (rank, byte index) (the `--data` file's bytes, or
//! the pattern generator), so each rank checks every byte it received.
//!
//! Predicted: `plan::Cluster` from the communicator's topology — nodes, ranks per node (one
//! modeled GPU per rank, its own NIC), the NIC at `HOCCL_NET_GBPS` per direction (without a
//! limit: the topology's NIC figure), the
//! intra-node copy rate (`--copy-gbps`, else measured on the host backend, else the
//! topology's copy-engine figure), the device's copy queues — and two schedules of the same
//! traffic under `sim::Model` (incast loss `--incast`, 0 by default: the limiter is a
//! token bucket, not a congested fabric):
//! - `sim_direct`: every flow at once, each rank sending straight to every remote rank
//!   from its own NIC (`sim::exec::simulate_naive`, identity forwarding; AllGather as one
//!   transfer per destination rank), its staging copies those of the socket transport:
//!   none on the host backend (it sends from and receives into the user buffers), through
//!   pinned host memory at the topology's host-link rate on CUDA. This is what the runtime
//!   executes with `HOCCL_FORWARDING=0`.
//! - `sim_planned`: the planner's staged plan (`plan::build` with the topology's
//!   forwarding peers, AllGather fanned out on arrival), which the runtime executes by
//!   default (`HOCCL_FORWARDING=1`; its pieces cut to the forwarding slots when a rank
//!   forwards through another).
//!
//! Each record says which path ran (`path`: `staged`, `direct`, or `reduction` for the
//! reductions' own plans); `meas/sim` is the measured time over the prediction for that
//! path (staged: `sim_planned`, else `sim_direct`).
//!
//! With `HOCCL_ENGINE=compressed` the prediction moves the bytes the codec makes of the
//! send data (its ratio measured on the host codec), codec time not modeled.
use hoccl::bootstrap::mpi::MpiBootstrap;
use hoccl::bootstrap::Bootstrap;
use hoccl::comm::Communicator;
use hoccl::device::kernels::launch_count;
use hoccl::device::{pattern_byte, Backend, DevPtr, Device, StreamHandle};
use hoccl::plan::json::Json;
use hoccl::plan::{self, Cluster, Collective, PlanOptions};
use hoccl::sim::{self, Incast, Model};
use hoccl::{Config, DataType, EngineChoice};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

#[allow(dead_code)]
mod common;

type Res<T> = Result<T, String>;

const USAGE: &str = "usage: mpirun -np R net_bench [options]   (HOCCL_VIRTUAL_NODES=N HOCCL_NET_GBPS=G)
  --ops LIST       allgather,alltoall,alltoallv,zipf (the default), allreduce, allreduce-flat:
                   zipf is AlltoAllv with Zipf counts; allreduce sums (hierarchical across
                   nodes), allreduce-flat averages, which runs the flat plan (every rank to
                   every rank: the bytes a flat sum moves); neither has a prediction;
                   sendrecv: each rank sends its bytes to the rank of its local index on the
                   next node (a send and a receive in one group), relayed through its
                   forwarding peer when it has one (HOCCL_FORWARDING_PEERS)
  --sizes LIST     bytes per rank (AlltoAll(v): one rank's send total; AllGather: the receive
                   total), K/M/G suffixes (256K,1M,4M)
  --iters N (5)    timed iterations per point; the median is reported
  --warmup N (1)   untimed iterations first
  --dtype T        bf16 | f16 | f32 (bf16)
  --zipf S (1.2)   Zipf exponent of the zipf op: sender u ranks the other ranks by a seeded
                   permutation and sends the rank-r one a share r^-S of its bytes
  --seed N (7)     the permutation's seed (every rank derives the same counts)
  --data FILE      fill send buffers with FILE's bytes (tiled, offset per rank) instead of
                   the pattern; e.g. tests/data/minilm-weight-word-emb.bf16
  --copy-gbps G    intra-node copy rate the simulator assumes, GB/s (default: measured)
  --incast L (0)   the simulator's incast loss
  --json FILE      write the records as JSON
  --no-check       skip verification";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllGather,
    AlltoAll,
    AlltoAllvUniform,
    AlltoAllvZipf,
    /// AllReduce with Sum: hierarchical when the communicator spans nodes.
    AllReduce,
    /// AllReduce with Avg: the flat plan, for comparison.
    AllReduceFlat,
    /// Point-to-point: every rank sends to the rank of its local index on the next node
    /// and receives from the one on the node before, in one group.
    SendRecv,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGather => "allgather",
            Op::AlltoAll => "alltoall",
            Op::AlltoAllvUniform => "alltoallv",
            Op::AlltoAllvZipf => "alltoallv-zipf",
            Op::AllReduce => "allreduce",
            Op::AllReduceFlat => "allreduce-flat",
            Op::SendRecv => "sendrecv",
        }
    }
    fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::AllReduceFlat)
    }
}

struct Opts {
    ops: Vec<Op>,
    sizes: Vec<usize>,
    iters: usize,
    warmup: usize,
    dtype: DataType,
    zipf: f64,
    seed: u64,
    data: Option<Vec<u8>>,
    copy_gbps: Option<f64>,
    incast: f64,
    json: Option<String>,
    check: bool,
}

fn parse_opts(argv: &[String]) -> Res<Opts> {
    let mut o = Opts {
        ops: vec![Op::AllGather, Op::AlltoAll, Op::AlltoAllvUniform, Op::AlltoAllvZipf],
        sizes: vec![256 << 10, 1 << 20, 4 << 20],
        iters: 5,
        warmup: 1,
        dtype: DataType::BF16,
        zipf: 1.2,
        seed: 7,
        data: None,
        copy_gbps: None,
        incast: 0.0,
        json: None,
        check: true,
    };
    let mut i = 0;
    while i < argv.len() {
        let a = argv[i].as_str();
        if a == "--no-check" {
            o.check = false;
            i += 1;
            continue;
        }
        if a == "--help" || a == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = argv.get(i + 1).ok_or_else(|| format!("{a} needs a value"))?.as_str();
        let num = |what: &str| -> Res<f64> { v.parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| format!("{what} {v:?}: not a number")) };
        match a {
            "--ops" => {
                o.ops = v
                    .split(',')
                    .map(|s| match s.trim() {
                        "allgather" => Ok(Op::AllGather),
                        "alltoall" => Ok(Op::AlltoAll),
                        "alltoallv" => Ok(Op::AlltoAllvUniform),
                        "zipf" | "alltoallv-zipf" => Ok(Op::AlltoAllvZipf),
                        "allreduce" => Ok(Op::AllReduce),
                        "allreduce-flat" => Ok(Op::AllReduceFlat),
                        "sendrecv" => Ok(Op::SendRecv),
                        other => Err(format!("--ops: unknown op {other:?} (allgather, alltoall, alltoallv, zipf, allreduce, allreduce-flat, sendrecv)")),
                    })
                    .collect::<Res<_>>()?
            }
            "--sizes" => {
                o.sizes = v.split(',').map(|s| common::parse_size(s).ok_or_else(|| format!("--sizes: bad size {s:?}"))).collect::<Res<_>>()?
            }
            "--iters" => o.iters = v.parse().ok().filter(|&n| n >= 1).ok_or_else(|| format!("--iters {v:?}: want a count >= 1"))?,
            "--warmup" => o.warmup = v.parse().map_err(|_| format!("--warmup {v:?}: want a count"))?,
            "--dtype" => {
                o.dtype = match v {
                    "bf16" => DataType::BF16,
                    "f16" => DataType::F16,
                    "f32" => DataType::F32,
                    other => return Err(format!("--dtype {other:?}: want bf16, f16 or f32")),
                }
            }
            "--zipf" => o.zipf = Some(num("--zipf")?).filter(|&s| s >= 0.0).ok_or("--zipf: the exponent must be >= 0")?,
            "--seed" => o.seed = v.parse().map_err(|_| format!("--seed {v:?}: want an integer"))?,
            "--data" => {
                let bytes = std::fs::read(v).map_err(|e| format!("--data {v}: {e}"))?;
                if bytes.is_empty() {
                    return Err(format!("--data {v}: empty file"));
                }
                o.data = Some(bytes);
            }
            "--copy-gbps" => o.copy_gbps = Some(Some(num("--copy-gbps")?).filter(|&g| g > 0.0).ok_or("--copy-gbps must be > 0")?),
            "--incast" => o.incast = Some(num("--incast")?).filter(|l| (0.0..1.0).contains(l)).ok_or("--incast must be in [0, 1)")?,
            "--json" => o.json = Some(v.to_string()),
            other => return Err(format!("unknown argument {other:?}")),
        }
        i += 2;
    }
    if o.sizes.is_empty() || o.ops.is_empty() {
        return Err("--ops and --sizes must not be empty".into());
    }
    Ok(o)
}

/// Byte `i` of rank `r`'s send buffer: the `--data` file tiled from an offset that differs
/// per rank (a whole number of elements), else the pattern generator seeded by the rank.
fn source_byte(o: &Opts, r: usize, i: usize) -> u8 {
    match &o.data {
        Some(d) => {
            let off = (r * 7919 * o.dtype.size()) % d.len();
            d[(off + i) % d.len()]
        }
        None => pattern_byte(0x6e65_7400 + r as u64, i as u64),
    }
}

/// Element counts between every pair of ranks (`counts[u * n + v]`: u sends to v) and each
/// rank's send and receive totals.
struct Shape {
    counts: Vec<usize>,
    n: usize,
}

impl Shape {
    /// `k`: ranks per node (SendRecv's partner is `k` ranks on).
    fn new(op: Op, bytes: usize, n: usize, k: usize, o: &Opts) -> Shape {
        let es = o.dtype.size();
        let per = bytes / n / es;
        let counts = match op {
            Op::SendRecv => (0..n * n).map(|i| if i % n == (i / n + k) % n { bytes / es } else { 0 }).collect(),
            // AllReduce: `n * per` elements per rank, `counts` its shards.
            Op::AllGather | Op::AlltoAll | Op::AlltoAllvUniform | Op::AllReduce | Op::AllReduceFlat => vec![per; n * n],
            Op::AlltoAllvZipf => plan::zipf_sizes(n, bytes as u64, o.zipf, o.seed).iter().map(|&b| b as usize / es).collect(),
        };
        Shape { counts, n }
    }
    fn c(&self, u: usize, v: usize) -> usize {
        self.counts[u * self.n + v]
    }
    fn send_displs(&self, u: usize) -> Vec<usize> {
        (0..self.n).scan(0, |a, v| Some(std::mem::replace(a, *a + self.c(u, v)))).collect()
    }
    fn recv_displs(&self, v: usize) -> Vec<usize> {
        (0..self.n).scan(0, |a, u| Some(std::mem::replace(a, *a + self.c(u, v)))).collect()
    }
    fn send_total(&self, u: usize) -> usize {
        (0..self.n).map(|v| self.c(u, v)).sum()
    }
    fn recv_total(&self, v: usize) -> usize {
        (0..self.n).map(|u| self.c(u, v)).sum()
    }
}

struct Ctx {
    o: Opts,
    ctl: MpiBootstrap,
    comm: Communicator,
    dev: Arc<dyn Device>,
    stream: StreamHandle,
    rank: usize,
    n: usize,
}

impl Ctx {
    fn barrier(&self) -> Res<()> {
        self.ctl.barrier().map_err(|e| format!("barrier: {e}"))
    }
    fn max_f64(&self, v: f64) -> Res<f64> {
        let all = self.ctl.all_gather(&v.to_le_bytes()).map_err(|e| format!("all_gather: {e}"))?;
        Ok(all.iter().filter_map(|r| r.as_slice().try_into().ok().map(f64::from_le_bytes)).fold(f64::MIN, f64::max))
    }
    fn sum_f64(&self, v: f64) -> Res<f64> {
        let all = self.ctl.all_gather(&v.to_le_bytes()).map_err(|e| format!("all_gather: {e}"))?;
        Ok(all.iter().filter_map(|r| r.as_slice().try_into().ok().map(f64::from_le_bytes)).sum())
    }
    fn all_ok(&self, ok: bool) -> Res<bool> {
        Ok(self.ctl.all_gather(&[ok as u8]).map_err(|e| format!("all_gather: {e}"))?.iter().all(|r| r.first() == Some(&1)))
    }
    fn sync(&self) -> Res<()> {
        self.dev.synchronize(self.stream).map_err(|e| format!("synchronize: {e}"))?;
        self.comm.async_error().map_or(Ok(()), |e| Err(format!("hoccl asynchronous error: {e}")))
    }
}

/// Device buffers of one point, freed on drop.
struct Buf(DevPtr, Arc<dyn Device>);
impl Drop for Buf {
    fn drop(&mut self) {
        let _ = self.1.free(self.0);
    }
}
fn alloc(dev: &Arc<dyn Device>, len: usize) -> Res<Buf> {
    Ok(Buf(dev.alloc(len.max(1)).map_err(|e| format!("alloc {len}: {e}"))?, dev.clone()))
}

fn run_op(ctx: &Ctx, op: Op, sh: &Shape, send: DevPtr, recv: DevPtr) -> Res<()> {
    let (dt, s, r) = (ctx.o.dtype, ctx.stream, ctx.rank);
    let res = match op {
        Op::AllGather => ctx.comm.all_gather(send, recv, sh.c(r, 0), dt, s),
        Op::AlltoAll => ctx.comm.all_to_all(send, recv, sh.c(r, 0), dt, s),
        Op::AlltoAllvUniform | Op::AlltoAllvZipf => {
            let sc: Vec<usize> = (0..sh.n).map(|v| sh.c(r, v)).collect();
            let rc: Vec<usize> = (0..sh.n).map(|u| sh.c(u, r)).collect();
            ctx.comm.all_to_allv(send, &sc, &sh.send_displs(r), recv, &rc, &sh.recv_displs(r), dt, s)
        }
        Op::AllReduce => ctx.comm.all_reduce(send, recv, sh.send_total(r), dt, hoccl::RedOp::Sum, s),
        Op::AllReduceFlat => ctx.comm.all_reduce(send, recv, sh.send_total(r), dt, hoccl::RedOp::Avg, s),
        Op::SendRecv => {
            let (to, from) = ((0..sh.n).find(|&v| sh.c(r, v) > 0).unwrap_or(r), (0..sh.n).find(|&u| sh.c(u, r) > 0).unwrap_or(r));
            let c = &ctx.comm;
            c.group_start()
                .and_then(|_| c.send(send, sh.c(r, to), dt, to, s))
                .and_then(|_| c.recv(recv, sh.c(from, r), dt, from, s))
                .and_then(|_| c.group_end())
        }
    };
    res.map_err(|e| format!("{}: {e}", op.name()))
}

/// Checks `got` (this rank's receive buffer) byte by byte; returns the first mismatch.
fn verify(ctx: &Ctx, op: Op, sh: &Shape, got: &[u8]) -> Option<String> {
    let (es, me) = (ctx.o.dtype.size(), ctx.rank);
    if op.reduces() {
        // The rank-order fold of every rank's input (`reduce::reduce_into`), bit for bit.
        let len = sh.send_total(me) * es;
        let inputs: Vec<Vec<u8>> = (0..sh.n).map(|u| (0..len).map(|i| source_byte(&ctx.o, u, i)).collect()).collect();
        let srcs: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
        let mut want = vec![0u8; len];
        let rop = if op == Op::AllReduce { hoccl::RedOp::Sum } else { hoccl::RedOp::Avg };
        if let Err(e) = hoccl::reduce::reduce_into(ctx.o.dtype, rop, &mut want, &srcs) {
            return Some(format!("reference: {e}"));
        }
        return (0..len).find(|&i| got[i] != want[i]).map(|i| format!("byte {i}: {:#04x}, expected {:#04x}", got[i], want[i]));
    }
    let rd = sh.recv_displs(me);
    for u in 0..sh.n {
        // Where u's block for me starts in u's send buffer (AllGather: u's whole block).
        let from = match op {
            Op::AllGather => 0,
            _ => sh.send_displs(u)[me],
        };
        let at = rd[u];
        for i in 0..sh.c(u, me) * es {
            let (want, have) = (source_byte(&ctx.o, u, from * es + i), got[at * es + i]);
            if want != have {
                return Some(format!("byte {} from rank {u}: {have:#04x}, expected {want:#04x}", at * es + i));
            }
        }
    }
    None
}

/// One measured point.
struct Record {
    op: Op,
    bytes: usize,
    time_us: f64,
    sim_direct_us: Option<f64>,
    sim_planned_us: Option<f64>,
    /// Measured over the prediction of the path that ran.
    ratio: Option<f64>,
    /// `staged`, `direct` or `reduction`.
    path: &'static str,
    checked: bool,
    /// Kernels hoccl launched during the timed iterations, all ranks.
    launches: u64,
    /// CPU seconds of the proxy threads per GB sent to other nodes, all ranks together
    /// (`None` when nothing crossed nodes).
    proxy_cpu_s_per_gb: Option<f64>,
}

/// CPU seconds the proxy threads of this process (`hoccl-proxy-r*`: the socket I/O and the
/// copy submission run there) have used so far, from `/proc/self/task/*/stat` (utime +
/// stime, in the kernel's USER_HZ of 100 ticks per second on Linux).
fn proxy_cpu_s() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0.0 };
    let mut ticks = 0u64;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("hoccl-proxy") {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
        let rest = stat.rsplit_once(')').map_or("", |x| x.1);
        let f: Vec<&str> = rest.split_whitespace().collect();
        ticks += f.get(11).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0) + f.get(12).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    }
    ticks as f64 / 100.0
}

fn measure(ctx: &Ctx, op: Op, bytes: usize, model: &SimSetup) -> Res<Record> {
    let k = ctx.comm.topology().nodes().iter().map(|x| x.ranks.len()).max().unwrap_or(1);
    let sh = Shape::new(op, bytes, ctx.n, k, &ctx.o);
    let es = ctx.o.dtype.size();
    let me = ctx.rank;
    let send_len = if op == Op::AllGather { sh.c(me, 0) } else { sh.send_total(me) } * es;
    let recv_len = sh.recv_total(me) * es;
    let (send, recv) = (alloc(&ctx.dev, send_len)?, alloc(&ctx.dev, recv_len)?);
    let host: Vec<u8> = (0..send_len).map(|i| source_byte(&ctx.o, me, i)).collect();
    ctx.dev.copy_from_host(send.0, &host).map_err(|e| format!("fill: {e}"))?;
    // Whether the calls ran the planner's stages (docs/design.md, "Staged plan"): the
    // runtime's own count, since it decides per call (size floor, predicted gain).
    let staged0 = ctx.comm.staged_calls().map_err(|e| e.to_string())?;
    let handed0 = ctx.comm.relay_counts().handed;
    let mut times = Vec::with_capacity(ctx.o.iters);
    let (mut launches0, mut cpu0) = (0, 0.0);
    for it in 0..ctx.o.warmup + ctx.o.iters {
        ctx.barrier()?;
        if it == ctx.o.warmup {
            (launches0, cpu0) = (launch_count(), proxy_cpu_s());
        }
        let t0 = Instant::now();
        run_op(ctx, op, &sh, send.0, recv.0)?;
        ctx.sync()?;
        let us = ctx.max_f64(t0.elapsed().as_secs_f64() * 1e6)?;
        if it >= ctx.o.warmup {
            times.push(us);
        }
    }
    let launches = ctx.sum_f64((launch_count() - launches0) as f64)? as u64;
    let cpu = ctx.sum_f64(proxy_cpu_s() - cpu0)?;
    // Bytes this rank sent to ranks of other nodes per op (AllGather: its block to each;
    // AllReduce: not counted, they depend on the plan).
    let topo = ctx.comm.topology();
    let remote: usize = (0..ctx.n).filter(|&v| !topo.same_node(me, v) && !op.reduces()).map(|v| if op == Op::AllGather { sh.c(me, 0) } else { sh.c(me, v) }).sum();
    let sent_gb = ctx.sum_f64((remote * es * ctx.o.iters) as f64)? / 1e9;
    // A reduction's reduce step is a kernel on CUDA on every engine.
    if launches > 0 && ctx.comm.config().engine != EngineChoice::Compressed && !op.reduces() {
        return Err(format!("{} {bytes} B: hoccl launched {launches} kernel(s) on the raw path", op.name()));
    }
    times.sort_by(f64::total_cmp);
    let time_us = times[times.len() / 2];
    let mut checked = false;
    if ctx.o.check {
        let mut got = vec![0u8; recv_len];
        ctx.dev.copy_to_host(&mut got, recv.0).map_err(|e| format!("read back: {e}"))?;
        let bad = verify(ctx, op, &sh, &got);
        if let Some(why) = &bad {
            eprintln!("net_bench: rank {me}: {} {bytes} B: WRONG: {why}", op.name());
        }
        if !ctx.all_ok(bad.is_none())? {
            return Err(format!("{} {bytes} B: a result was wrong (see the ranks' messages)", op.name()));
        }
        checked = true;
    }
    let (direct, planned) = model.predict(op, &sh, es)?;
    let proxy_cpu_s_per_gb = (sent_gb > 0.0).then(|| cpu / sent_gb);
    let staged = ctx.comm.staged_calls().map_err(|e| e.to_string())? > staged0;
    // Relayed: some rank's sends went through its forwarding peer.
    let relayed = ctx.sum_f64((ctx.comm.relay_counts().handed - handed0) as f64)? > 0.0;
    let path = if op.reduces() { "reduction" } else if staged { "staged" } else if relayed { "relayed" } else { "direct" };
    let ran = if path == "staged" { planned } else { direct };
    Ok(Record { op, bytes, time_us, sim_direct_us: direct, sim_planned_us: planned, path, ratio: ran.map(|d| time_us / d), checked, launches, proxy_cpu_s_per_gb })
}

/// What the simulator is given.
struct SimSetup {
    /// `None` when ranks per node differ (the modeled cluster is homogeneous).
    cluster: Option<Cluster>,
    model: Model,
    chunk: u64,
    /// Bytes moved per byte of data: the codec's ratio under the compressed engine, else 1.
    scale: f64,
    copy_gbps: f64,
    copy_from: &'static str,
    /// The rate of the socket transport's staging copies through pinned host memory (CUDA);
    /// `None` on the host backend, which stages nothing.
    host_link: Option<f64>,
}

impl SimSetup {
    fn new(ctx: &Ctx, cfg: &Config) -> Res<SimSetup> {
        let topo = ctx.comm.topology();
        let k = topo.nodes()[0].ranks.len();
        let uniform = topo.nodes().iter().all(|n| n.ranks.len() == k);
        let (copy_gbps, copy_from) = match ctx.o.copy_gbps {
            Some(g) => (g, "--copy-gbps"),
            None if ctx.dev.backend() == Backend::Host => (measure_copy_gbps(ctx)?, "measured memcpy"),
            None => (topo.bandwidths().copy_engine / 1e9, "the topology's copy-engine figure"),
        };
        let nic = if cfg.net_gbps > 0.0 { cfg.net_gbps * 1e9 } else { topo.bandwidths().nic };
        let cluster = uniform.then(|| {
            let mut cl = Cluster::new(topo.nnodes(), k);
            cl.forwarding_peer = topo.nodes()[0].ranks.iter().map(|&r| topo.local_rank(topo.forwarding_peer(r).unwrap_or(r)).unwrap_or(0)).collect();
            cl.nic_bw = nic;
            cl.nvlink_bw = copy_gbps * 1e9;
            cl.ce_bw = copy_gbps * 1e9;
            cl.ce_per_gpu = ctx.dev.copy_engine_count().max(1);
            // As the communicator plans (`HOCCL_FORWARD_BALANCE`, nodes of several ranks).
            cl.balance_nics = cfg.forward_balance && k > 1;
            cl
        });
        let model = Model { incast: Incast { loss: ctx.o.incast }, qps_per_peer: cfg.qps_per_peer.max(1), ..Model::default() };
        let scale = if cfg.engine == EngineChoice::Compressed { codec_ratio(&ctx.o)? } else { 1.0 };
        let host_link = (ctx.dev.backend() != Backend::Host).then(|| topo.bandwidths().host_link);
        Ok(SimSetup { cluster, model, chunk: cfg.chunk_bytes.max(1) as u64, scale, copy_gbps, copy_from, host_link })
    }

    /// (direct, planned) completion in µs for the point's traffic.
    fn predict(&self, op: Op, sh: &Shape, es: usize) -> Res<(Option<f64>, Option<f64>)> {
        let Some(cl) = self.cluster.as_ref().filter(|_| !op.reduces()) else { return Ok((None, None)) };
        let g = cl.num_gpus();
        let b = |elems: usize| ((elems * es) as f64 * self.scale).ceil() as u64;
        let (direct_c, planned_c) = match op {
            // Per-rank totals in the plan's convention: AllGather the receive total.
            Op::AllGather => {
                let total = b(sh.c(0, 0)) * g as u64;
                (Collective::AlltoAll { bytes: total }, Collective::AllGather { bytes: total })
            }
            Op::AlltoAll => {
                let total = b(sh.c(0, 0)) * g as u64;
                (Collective::AlltoAll { bytes: total }, Collective::AlltoAll { bytes: total })
            }
            Op::AlltoAllvUniform | Op::AlltoAllvZipf | Op::SendRecv => {
                let sizes: Vec<u64> = sh.counts.iter().map(|&c| b(c)).collect();
                (Collective::AlltoAllv { sizes: sizes.clone() }, Collective::AlltoAllv { sizes })
            }
            Op::AllReduce | Op::AllReduceFlat => return Ok((None, None)),
        };
        let opt = PlanOptions { chunk_bytes: self.chunk };
        // Direct sends stage only what the transport stages: on the host backend nothing
        // (the socket transport reads and writes the user buffers), so the identity staging
        // copies the model adds around each NIC transfer are free (an unbounded engine
        // without start-up cost); on CUDA each chunk crosses pinned host memory, copies at
        // the host link's rate. Intra-node flows stay bounded by the copy rate through the
        // NVLink ports.
        let mut staged = cl.clone().with_identity_forwarding();
        staged.balance_nics = false;
        let direct_model = match self.host_link {
            None => {
                staged.ce_bw = 1e18;
                Model { ce_latency_s: 0.0, ..self.model }
            }
            Some(bw) => {
                staged.ce_bw = bw;
                self.model
            }
        };
        let direct = plan::build(&staged, &direct_c, &opt).map_err(|e| format!("plan: {e}"))?;
        let planned = plan::build(cl, &planned_c, &opt).map_err(|e| format!("plan: {e}"))?;
        let d = sim::exec::simulate_naive(&direct, &direct_model).map_err(|e| format!("simulate: {e}"))?;
        let p = sim::exec::simulate_plan(&planned, &self.model).map_err(|e| format!("simulate: {e}"))?;
        // Point-to-point calls never run a plan; relayed, each send leaves from its
        // forwarding peer's NIC, which the direct model matches where each NIC carries one
        // flow either way (forwarding peers in pairs).
        let planned = (op != Op::SendRecv).then_some(p.completion_s * 1e6);
        Ok((Some(d.completion_s * 1e6), planned))
    }
}

/// Device-to-device copy rate (32 MiB, the median of 5 after one untimed copy), the minimum
/// over ranks, so that no rank is modeled faster than it copies.
fn measure_copy_gbps(ctx: &Ctx) -> Res<f64> {
    const LEN: usize = 32 << 20;
    let (a, b) = (alloc(&ctx.dev, LEN)?, alloc(&ctx.dev, LEN)?);
    let mut rates = Vec::new();
    for _ in 0..6 {
        let t0 = Instant::now();
        ctx.dev.memcpy_async(ctx.stream, b.0, a.0, LEN).map_err(|e| format!("copy: {e}"))?;
        ctx.sync()?;
        rates.push(LEN as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    rates.remove(0); // first touch
    rates.sort_by(f64::total_cmp);
    Ok(-ctx.max_f64(-rates[rates.len() / 2])?)
}

/// Compressed bytes per input byte of rank 0's send data under the host codec (the same
/// encoder choice as the device's), for the compressed engine's prediction.
fn codec_ratio(o: &Opts) -> Res<f64> {
    let dt = hoccl::compress::Dtype::from_data_type("net_bench", o.dtype).map_err(|e| e.to_string())?;
    let len = (4usize << 20) / o.dtype.size() * o.dtype.size();
    let input: Vec<u8> = (0..len).map(|i| source_byte(o, 0, i)).collect();
    let out = hoccl::compress::compress(dt, &input, &hoccl::compress::Params::default()).map_err(|e| e.to_string())?;
    Ok(out.len() as f64 / input.len() as f64)
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

fn json_opt(v: Option<f64>) -> String {
    v.map_or("null".into(), |x| format!("{x:.3}"))
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_opts(&argv) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("net_bench: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(o, &argv) {
        eprintln!("net_bench: {e}");
        std::process::exit(1);
    }
}

fn run(o: Opts, argv: &[String]) -> Res<()> {
    let cfg = Config::from_env().map_err(|e| e.to_string())?;
    let ctl = MpiBootstrap::world().map_err(|e| e.to_string())?;
    let boot = MpiBootstrap::world().map_err(|e| e.to_string())?;
    let comm = Communicator::with_bootstrap(Box::new(boot), None, cfg.clone()).map_err(|e| format!("creating the communicator: {e}"))?;
    let dev = comm.device().clone();
    let stream = dev.create_stream().map_err(|e| format!("create stream: {e}"))?;
    let (rank, n) = (comm.rank(), comm.size());
    let ctx = Ctx { o, ctl, comm, dev, stream, rank, n };
    let sim = SimSetup::new(&ctx, &cfg)?;
    let topo = ctx.comm.topology();
    let (nodes, per_node) = (topo.nnodes(), topo.nodes().iter().map(|x| x.ranks.len()).max().unwrap_or(0));
    // The HOCCL_ENGINE spelling of the engine.
    let engine = match cfg.engine {
        EngineChoice::Auto => "auto",
        EngineChoice::CopyEngine => "ce",
        EngineChoice::Sm => "sm",
        EngineChoice::Compressed => "compressed",
    };
    let peers = if cfg.forwarding_peers.is_empty() {
        String::new()
    } else {
        format!(" HOCCL_FORWARDING_PEERS={}", cfg.forwarding_peers.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","))
    };
    let command = format!(
        "HOCCL_VIRTUAL_NODES={} HOCCL_NET_GBPS={} HOCCL_ENGINE={engine} HOCCL_FORWARDING={}{peers} mpirun -np {n} net_bench {}",
        cfg.virtual_nodes,
        cfg.net_gbps,
        u8::from(cfg.forwarding),
        argv.join(" ")
    );
    let mut text = String::new();
    let _ = writeln!(text, "# {command}");
    let _ = writeln!(
        text,
        "# {nodes} node(s) x {per_node} rank(s), {} backend, NIC limit {} GB/s per rank and direction, engine {engine}, dtype {}, data {}",
        if ctx.dev.backend() == Backend::Host { "host" } else { "cuda" },
        cfg.net_gbps,
        ctx.o.dtype.name(),
        if ctx.o.data.is_some() { "--data file" } else { "pattern (incompressible)" }
    );
    let _ = writeln!(
        text,
        "# sim: copy {:.1} GB/s ({}), {} copy queue(s), incast loss {}, bytes x {:.3} (codec ratio); HOCCL_FORWARDING={}: {}",
        sim.copy_gbps,
        sim.copy_from,
        sim.cluster.as_ref().map_or(0, |c| c.ce_per_gpu),
        ctx.o.incast,
        sim.scale,
        u8::from(cfg.forwarding),
        if cfg.forwarding {
            format!("calls with a flow of {} bytes or more between nodes and a predicted gain run the staged path (meas/sim: over sim_planned), the others direct", cfg.staged_min_flow_bytes)
        } else {
            "every call runs the direct path (meas/sim: over sim_direct)".to_string()
        }
    );
    let _ = writeln!(
        text,
        "{:<15} {:>10} {:>12} {:>12} {:>12} {:>10} {:>10} {:>8} {:>8} {:>12}",
        "op", "bytes", "time_us", "sim_direct", "sim_planned", "meas/sim", "plan/dir", "check", "kernels", "proxy_cpu_s/GB"
    );
    if ctx.rank == 0 {
        print!("{text}");
    }
    let mut records = Vec::new();
    for &op in &ctx.o.ops {
        for &bytes in &ctx.o.sizes {
            if bytes / ctx.n / ctx.o.dtype.size() == 0 {
                continue;
            }
            let r = measure(&ctx, op, bytes, &sim)?;
            let line = format!(
                "{:<15} {:>10} {:>12.1} {:>12} {:>12} {:>10} {:>10} {:>8} {:>8} {:>12}",
                r.op.name(),
                r.bytes,
                r.time_us,
                fmt_opt(r.sim_direct_us, 1),
                fmt_opt(r.sim_planned_us, 1),
                fmt_opt(r.ratio, 3),
                fmt_opt(r.sim_planned_us.zip(r.sim_direct_us).map(|(p, d)| p / d), 3),
                if r.checked { "ok" } else { "skipped" },
                r.launches,
                fmt_opt(r.proxy_cpu_s_per_gb, 3)
            );
            if ctx.rank == 0 {
                println!("{line}");
            }
            text.push_str(&line);
            text.push('\n');
            records.push(r);
        }
    }
    if ctx.rank == 0 {
        if let Some(path) = &ctx.o.json {
            let recs: Vec<String> = records
                .iter()
                .map(|r| {
                    format!(
                        "{{\"op\":\"{}\",\"engine\":\"{engine}\",\"dtype\":\"{}\",\"nodes\":{nodes},\"ranks\":{},\"ranks_per_node\":{per_node},\"bytes\":{},\"gbps_limit\":{},\"time_us\":{:.3},\"sim_direct_us\":{},\"sim_planned_us\":{},\"path\":\"{}\",\"measured_over_sim\":{},\"zipf\":{},\"seed\":{},\"iters\":{},\"checked\":{},\"kernel_launches\":{},\"proxy_cpu_s_per_gb\":{}}}",
                        r.op.name(),
                        ctx.o.dtype.name(),
                        ctx.n,
                        r.bytes,
                        cfg.net_gbps,
                        r.time_us,
                        json_opt(r.sim_direct_us),
                        json_opt(r.sim_planned_us),
                        r.path,
                        json_opt(r.ratio),
                        if r.op == Op::AlltoAllvZipf { ctx.o.zipf.to_string() } else { "null".into() },
                        ctx.o.seed,
                        ctx.o.iters,
                        r.checked,
                        r.launches,
                        json_opt(r.proxy_cpu_s_per_gb)
                    )
                })
                .collect();
            let json = format!(
                "{{\"command\":{},\"forwarding\":{},\"staged_min_flow_bytes\":{},\"copy_gbps\":{:.3},\"copy_from\":\"{}\",\"incast\":{},\"codec_ratio\":{:.4},\"records\":[\n{}\n]}}\n",
                Json::Str(command.clone()),
                cfg.forwarding,
                cfg.staged_min_flow_bytes,
                sim.copy_gbps,
                sim.copy_from,
                ctx.o.incast,
                sim.scale,
                recs.join(",\n")
            );
            std::fs::write(path, json).map_err(|e| format!("--json {path}: {e}"))?;
        }
    }
    ctx.barrier()?;
    let _ = ctx.dev.destroy_stream(ctx.stream);
    Ok(())
}

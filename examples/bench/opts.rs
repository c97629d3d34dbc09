//! Command-line options. Bad input is a clear message and exit status 2, never a panic.
use crate::ops::{OpKind, ALL_OPS};
use hoccl::config::BackendChoice;
use hoccl::DataType;

pub const USAGE: &str = "\
usage: mpirun -np N bench [options]
  --ops LIST          sendrecv,allgather,alltoall,broadcast,gather,scatter,
                      allreduce,reducescatter,reduce (reductions with sum)
                      (default sendrecv,allgather,alltoall,broadcast)
  --min SIZE          smallest size (default 2M on CUDA, 64K on the host backend)
  --max SIZE          largest size, factor 2 between sizes (default 1G / 16M)
  --iters N           timed iterations per point (default: adaptive, >= --min-time-ms, >= 5)
  --warmup N          untimed ops before timing (default: the adaptive probe's 3 ops,
                      or 2 with --iters); the cold first op is always run and reported apart
  --min-time-ms MS    adaptive target time per point (default 20)
  --dtype T           bf16 (default), f16, f32, f64, u8, i8, i32, u32, i64, u64
  --data FILE         time on this file's bytes (tiled over every send buffer, e.g. real
                      bf16 weights for HOCCL_ENGINE=compressed) instead of random bytes
  --json FILE         write every point (and launch/interference results) as JSON
  --compare nccl      run every point through NCCL too (dlopen libnccl.so.2 at run time)
  --nccl-ctas LIST    extra NCCL communicators limited to these CTA counts (default 1,4,8;
                      'none' for the default NCCL only)
  --launch-cost       CPU cost of one call (enqueue only) per op
  --launch-size SIZE  message size for --launch-cost (default 64K)
  --launch-calls N    calls per op for --launch-cost (default 1000, sync every 100)
  --interference      bf16 GEMM (cuBLAS) on rank 0's GPU alone and under background
                      collectives (--bg-op) of hoccl and NCCL
  --bg-op OP          the background collective: allgather (default) or allreduce (hoccl's
                      engine as HOCCL_ENGINE says: sm or compressed; give --data for
                      compressed, unfilled buffers compress unrealistically well)
  --bg-size SIZE      background op size (AllGather: recv total; default 256M)
  --gemm N            GEMM m=n=k (default 8192)
  --no-check          skip the correctness pass (and with it every fill kernel)
  --no-table          skip the bandwidth table (run only --launch-cost/--interference)
  --backend B         host | cuda | auto (default auto; HOCCL_BACKEND also works)
  --latency           the per-operation latency run (issue targets): end-to-end time per op
                      and size beside NCCL's (default NCCL only), the stream handshake probe,
                      device-to-device copy bandwidth per size, launch cost, PASS/FAIL lines.
                      Defaults then: every op, --min 4K, --compare nccl, --nccl-ctas none,
                      --launch-cost (each unless given)
  --mps               mark this run's latency records as taken under MPS (records say mps: true)
  --append            with --latency and --json: add this run's records to FILE's (a
                      latency JSON of an earlier run; a missing FILE is created)
  --handshake-rounds N  round trips of the handshake probe (default 2000, first 100 untimed)
  -h, --help          this text
SIZE accepts K/M/G suffixes (powers of 1024).";

#[derive(Clone, Debug)]
pub struct Opts {
    pub ops: Vec<OpKind>,
    pub min: Option<usize>,
    pub max: Option<usize>,
    pub iters: Option<usize>,
    pub warmup: Option<usize>,
    pub min_time_ms: f64,
    pub dtype: DataType,
    pub json: Option<String>,
    pub compare_nccl: bool,
    pub nccl_ctas: Vec<i32>,
    pub launch_cost: bool,
    pub launch_size: usize,
    pub launch_calls: usize,
    pub interference: bool,
    pub bg_op: OpKind,
    pub bg_size: usize,
    pub gemm_n: usize,
    pub check: bool,
    pub table: bool,
    pub backend: Option<BackendChoice>,
    pub latency: bool,
    pub mps: bool,
    pub append: bool,
    pub handshake_rounds: usize,
    /// `--data`: the file whose bytes fill the send buffers while timing.
    pub data: Option<String>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            ops: vec![OpKind::SendRecv, OpKind::AllGather, OpKind::AlltoAll, OpKind::Broadcast],
            min: None,
            max: None,
            iters: None,
            warmup: None,
            min_time_ms: 20.0,
            dtype: DataType::BF16,
            json: None,
            compare_nccl: false,
            nccl_ctas: vec![1, 4, 8],
            launch_cost: false,
            launch_size: 64 << 10,
            launch_calls: 1000,
            interference: false,
            bg_op: OpKind::AllGather,
            bg_size: 256 << 20,
            gemm_n: 8192,
            check: true,
            table: true,
            backend: None,
            latency: false,
            mps: false,
            append: false,
            handshake_rounds: 2000,
            data: None,
        }
    }
}

/// What parsing decided: run with options, or print help and stop.
pub enum Parsed {
    Run(Box<Opts>),
    Help,
}

/// "2M" → 2097152. Powers of 1024; plain numbers are bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mul: usize = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown size unit (use K, M or G)")),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?}: not a positive size"))
}

fn parse_count(flag: &str, s: &str) -> Result<usize, String> {
    s.trim().parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| format!("{flag} {s:?}: want a positive integer"))
}

fn parse_dtype(s: &str) -> Result<DataType, String> {
    DataType::ALL
        .iter()
        .copied()
        .find(|d| d.name() == s.to_ascii_lowercase())
        .ok_or_else(|| format!("--dtype {s:?}: want one of bf16, f16, f32, f64, u8, i8, i32, u32, i64, u64"))
}

fn parse_ops(s: &str) -> Result<Vec<OpKind>, String> {
    let mut v = Vec::new();
    for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let op = OpKind::from_name(name).ok_or_else(|| format!("--ops: unknown operation {name:?}"))?;
        if !v.contains(&op) {
            v.push(op);
        }
    }
    if v.is_empty() {
        return Err("--ops: empty list".into());
    }
    Ok(v)
}

fn parse_ctas(s: &str) -> Result<Vec<i32>, String> {
    if s.eq_ignore_ascii_case("none") || s.trim().is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|t| t.trim().parse::<i32>().ok().filter(|n| (1..=64).contains(n)).ok_or_else(|| format!("--nccl-ctas: {t:?} is not in 1..=64")))
        .collect()
}

fn parse_backend(s: &str) -> Result<BackendChoice, String> {
    match s.to_ascii_lowercase().as_str() {
        "host" | "cpu" => Ok(BackendChoice::Host),
        "cuda" | "gpu" => Ok(BackendChoice::Cuda),
        "auto" => Ok(BackendChoice::Auto),
        _ => Err(format!("--backend {s:?}: want host, cuda or auto")),
    }
}

/// Parse the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut o = Opts::default();
    // Flags given on the command line: --latency's defaults apply to the others only.
    let mut given: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        // Accept both "--flag value" and "--flag=value".
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        given.push(flag.to_string());
        let mut value = || -> Result<String, String> {
            inline.clone().or_else(|| it.next().cloned()).ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--ops" => o.ops = parse_ops(&value()?)?,
            "--min" | "-b" => o.min = Some(parse_size(&value()?)?),
            "--max" | "-e" => o.max = Some(parse_size(&value()?)?),
            "--iters" | "-n" => o.iters = Some(parse_count(flag, &value()?)?),
            "--warmup" | "-w" => o.warmup = Some(value()?.trim().parse().map_err(|_| format!("{flag}: want an integer"))?),
            "--min-time-ms" => {
                o.min_time_ms = value()?.trim().parse::<f64>().ok().filter(|v| *v > 0.0 && *v < 1e5).ok_or("--min-time-ms: want a number in (0, 100000)")?
            }
            "--dtype" | "-d" => o.dtype = parse_dtype(&value()?)?,
            "--data" => o.data = Some(value()?),
            "--json" => o.json = Some(value()?),
            "--compare" => match value()?.to_ascii_lowercase().as_str() {
                "nccl" => o.compare_nccl = true,
                v => return Err(format!("--compare {v:?}: only 'nccl' is supported")),
            },
            "--nccl-ctas" => o.nccl_ctas = parse_ctas(&value()?)?,
            "--launch-cost" => o.launch_cost = true,
            "--launch-size" => o.launch_size = parse_size(&value()?)?,
            "--launch-calls" => o.launch_calls = parse_count(flag, &value()?)?,
            "--interference" => o.interference = true,
            "--bg-op" => {
                o.bg_op = match OpKind::from_name(&value()?) {
                    Some(op @ (OpKind::AllGather | OpKind::AllReduce)) => op,
                    _ => return Err("--bg-op: want allgather or allreduce".into()),
                }
            }
            "--bg-size" => o.bg_size = parse_size(&value()?)?,
            "--gemm" => o.gemm_n = parse_count(flag, &value()?)?,
            "--no-check" => o.check = false,
            "--no-table" => o.table = false,
            "--backend" => o.backend = Some(parse_backend(&value()?)?),
            "--latency" => o.latency = true,
            "--mps" => o.mps = true,
            "--append" => o.append = true,
            "--handshake-rounds" => o.handshake_rounds = parse_count(flag, &value()?)?,
            _ => return Err(format!("unknown option {a:?}")),
        }
    }
    if o.latency {
        let has = |f: &[&str]| f.iter().any(|f| given.iter().any(|g| g == f));
        if !has(&["--ops"]) {
            // The copy-engine operations; reductions only when --ops names them.
            o.ops = ALL_OPS.into_iter().filter(|op| !op.is_reduction()).collect();
        }
        if !has(&["--min", "-b"]) {
            o.min = Some(4 << 10);
        }
        if !has(&["--nccl-ctas"]) {
            o.nccl_ctas = Vec::new();
        }
        o.compare_nccl = true;
        o.launch_cost = true;
    }
    if (o.mps || o.append) && !o.latency {
        return Err("--mps and --append belong to --latency".into());
    }
    if o.append && o.json.is_none() {
        return Err("--append needs --json FILE".into());
    }
    if o.latency && (!o.table || o.interference) {
        return Err("--latency runs its own sections: without --no-table and --interference".into());
    }
    if o.handshake_rounds < 200 {
        return Err("--handshake-rounds must be at least 200 (the first 100 are untimed)".into());
    }
    if let (Some(lo), Some(hi)) = (o.min, o.max) {
        if lo > hi {
            return Err(format!("--min ({lo}) is larger than --max ({hi})"));
        }
    }
    if o.launch_calls < 100 {
        return Err("--launch-calls must be at least 100 (a sync every 100 calls)".into());
    }
    Ok(Parsed::Run(Box::new(o)))
}

/// Sizes from `min` to `max`, doubling.
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    while s <= max {
        v.push(s);
        match s.checked_mul(2) {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("2M").unwrap(), 2 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("2X").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(sizes(2 << 20, 16 << 20).len(), 4);
    }
    #[test]
    fn latency_defaults_yield_to_given_flags() {
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let Ok(Parsed::Run(o)) = parse(&args("--latency --ops sendrecv --max 1M")) else { panic!("parse") };
        assert_eq!((o.ops.len(), o.min, o.max), (1, Some(4 << 10), Some(1 << 20)));
        assert!(o.compare_nccl && o.launch_cost && o.nccl_ctas.is_empty());
        let Ok(Parsed::Run(o)) = parse(&args("--latency --min=64K")) else { panic!("parse") };
        assert_eq!((o.ops.len(), o.min), (6, Some(64 << 10)));
        assert!(parse(&args("--mps")).is_err());
        assert!(parse(&args("--latency --append")).is_err());
    }
}

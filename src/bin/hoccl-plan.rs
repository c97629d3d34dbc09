//! `hoccl-plan`: build, show and simulate copy-engine collective plans on modeled clusters.
//!
//! ```text
//! hoccl-plan simulate --nodes 16 --gpus-per-node 8 --collective alltoall --bytes 1GiB --json
//! hoccl-plan simulate ... --collective alltoall --skew zipf:1.2 --seed 7
//! hoccl-plan show --nodes 2 --gpus-per-node 2 --collective alltoall --bytes 1GiB --png t.png
//! hoccl-plan plan ... > plan.json
//! ```
use hoccl::error::{Error, Result};
use hoccl::plan::json::Json;
use hoccl::plan::{self, png, Cluster, Collective, Plan, PlanOptions};
use hoccl::sim::{self, Incast, Model};
use std::time::Instant;

const OP: &str = "hoccl-plan";

const USAGE: &str = "usage: hoccl-plan <simulate|show|plan|bench> [options]

cluster:    --nodes N (2) --gpus-per-node K (8) --nics-per-node K
            --forwarding pairs|identity|i,j,... (pairs)   --nic-bw GB/s (50)
            --nvlink-bw GB/s (400) --ce-bw GB/s (397) --ce-per-gpu N (3)
collective: --collective alltoall|alltoallv|allgather|broadcast|sendrecv (alltoall)
            --bytes SIZE per GPU, nccl-tests convention (1GiB)   --skew zipf:S   --seed N (7)
            --root R (broadcast)   --pairs u:v:SIZE,... (sendrecv; default u -> u+K)
plan:       --chunk SIZE (4MiB)
simulate:   --incast LOSS (0.37; 0 = pure fluid)   --nic-latency-us (2) --qp-latency-us (5)
            --qps N (4) --ce-latency-us (2.4) --segments N (64) --staging SIZE (64MiB per NIC)
            --no-naive   --no-baseline
            --naive-max-routes N (20000; larger plans report naive_s: null)   --json
show:       --stages N (4)   --png PATH [--stage S (0)] [--cell PX (auto)]   --json (whole plan)
plan:       prints the whole plan as JSON
bench:      --repeat N (5): fastest planning time of N builds";

struct Args {
    cmd: String,
    opts: Vec<(String, Option<String>)>,
}

impl Args {
    fn parse(argv: &[String]) -> Result<Args> {
        let cmd = argv.first().cloned().ok_or_else(|| Error::invalid_arg(OP, "missing command"))?;
        let flags = ["--json", "--no-naive", "--no-baseline", "--help"];
        let mut opts = Vec::new();
        let mut i = 1;
        while i < argv.len() {
            let a = &argv[i];
            if !a.starts_with("--") {
                return Err(Error::invalid_arg(OP, format!("unexpected argument `{a}`")));
            }
            if let Some((k, v)) = a.split_once('=') {
                opts.push((k.to_string(), Some(v.to_string())));
            } else if flags.contains(&a.as_str()) {
                opts.push((a.clone(), None));
            } else {
                let v = argv.get(i + 1).ok_or_else(|| Error::invalid_arg(OP, format!("`{a}` needs a value")))?;
                opts.push((a.clone(), Some(v.clone())));
                i += 1;
            }
            i += 1;
        }
        Ok(Args { cmd, opts })
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.opts.iter().rev().find(|(n, _)| n == k).and_then(|(_, v)| v.as_deref())
    }
    fn flag(&self, k: &str) -> bool {
        self.opts.iter().any(|(n, _)| n == k)
    }
    fn num<T: std::str::FromStr>(&self, k: &str, default: T) -> Result<T> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| Error::invalid_arg(OP, format!("`{k}`: `{v}` is not a valid number"))),
        }
    }
    fn check_known(&self, known: &[&str]) -> Result<()> {
        match self.opts.iter().find(|(n, _)| !known.contains(&n.as_str())) {
            Some((n, _)) => Err(Error::invalid_arg(OP, format!("unknown option `{n}` for `{}`", self.cmd))),
            None => Ok(()),
        }
    }
}

/// `1GiB`, `512MiB`, `4MB`, `1G` (binary), `4096`.
fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| Error::invalid_arg(OP, format!("bad size `{s}`")))?;
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1048576.0,
        "mb" => 1e6,
        "g" | "gib" => 1073741824.0,
        "gb" => 1e9,
        "t" | "tib" => 1099511627776.0,
        "tb" => 1e12,
        _ => return Err(Error::invalid_arg(OP, format!("bad size unit in `{s}`"))),
    };
    let b = v * mult;
    if !(0.0..9.2e18).contains(&b) {
        return Err(Error::invalid_arg(OP, format!("size `{s}` out of range")));
    }
    Ok(b.round() as u64)
}

fn cluster(a: &Args) -> Result<Cluster> {
    let nodes: usize = a.num("--nodes", 2)?;
    let k: usize = a.num("--gpus-per-node", 8)?;
    if nodes == 0 || k == 0 || nodes.saturating_mul(k) > 1 << 16 {
        return Err(Error::invalid_arg(OP, "--nodes and --gpus-per-node must be > 0, at most 65536 GPUs"));
    }
    let mut cl = Cluster::new(nodes, k);
    match a.get("--forwarding") {
        None | Some("pairs") => {}
        Some("identity") => cl = cl.with_identity_forwarding(),
        Some(list) => {
            let v: std::result::Result<Vec<usize>, _> = list.split(',').map(|x| x.trim().parse()).collect();
            cl.forwarding_peer = v.map_err(|_| Error::invalid_arg(OP, format!("bad --forwarding `{list}`")))?;
        }
    }
    if let Some(n) = a.get("--nics-per-node") {
        let nics: usize = n.parse().map_err(|_| Error::invalid_arg(OP, "bad --nics-per-node"))?;
        cl.nics_per_node = nics;
        cl.nic_of_gpu = (0..k).map(|g| g * nics.max(1) / k).collect();
    }
    cl.nic_bw = a.num("--nic-bw", 50.0)? * 1e9;
    cl.nvlink_bw = a.num("--nvlink-bw", 400.0)? * 1e9;
    cl.ce_bw = a.num("--ce-bw", 397.0)? * 1e9;
    cl.ce_per_gpu = a.num("--ce-per-gpu", 3)?;
    cl.validate()?;
    Ok(cl)
}

fn collective(a: &Args, cl: &Cluster) -> Result<Collective> {
    let g = cl.num_gpus();
    let bytes = parse_size(a.get("--bytes").unwrap_or("1GiB"))?;
    let seed: u64 = a.num("--seed", 7)?;
    let name = a.get("--collective").unwrap_or("alltoall");
    let skew = match a.get("--skew") {
        None => None,
        Some(s) => {
            let v = s.strip_prefix("zipf:").ok_or_else(|| Error::invalid_arg(OP, format!("--skew `{s}`: expected zipf:S")))?;
            let e: f64 = v.parse().map_err(|_| Error::invalid_arg(OP, format!("--skew `{s}`: bad exponent")))?;
            if !(e.is_finite() && e >= 0.0) {
                return Err(Error::invalid_arg(OP, "--skew exponent must be >= 0"));
            }
            Some(e)
        }
    };
    let c = match (name, skew) {
        ("alltoall" | "alltoallv", Some(s)) => Collective::AlltoAllv { sizes: plan::zipf_sizes(g, bytes, s, seed) },
        ("alltoall", None) => Collective::AlltoAll { bytes },
        ("alltoallv", None) => Collective::AlltoAllv { sizes: plan::zipf_sizes(g, bytes, 0.0, seed) },
        ("allgather", None) => Collective::AllGather { bytes },
        ("broadcast", None) => Collective::Broadcast { root: a.num("--root", 0)?, bytes },
        ("sendrecv", None) => match a.get("--pairs") {
            None => Collective::SendRecv { pairs: (0..g).map(|u| (u, (u + cl.gpus_per_node) % g, bytes)).collect() },
            Some(p) => Collective::SendRecv { pairs: parse_pairs(p)? },
        },
        (_, Some(_)) => return Err(Error::invalid_arg(OP, "--skew applies to alltoall/alltoallv only")),
        (other, None) => return Err(Error::invalid_arg(OP, format!("unknown collective `{other}`"))),
    };
    c.validate(g)?;
    Ok(c)
}

fn parse_pairs(s: &str) -> Result<Vec<(usize, usize, u64)>> {
    s.split(',')
        .map(|p| {
            let f: Vec<&str> = p.split(':').collect();
            let bad = || Error::invalid_arg(OP, format!("bad pair `{p}`: expected u:v:SIZE"));
            if f.len() != 3 {
                return Err(bad());
            }
            Ok((f[0].parse().map_err(|_| bad())?, f[1].parse().map_err(|_| bad())?, parse_size(f[2])?))
        })
        .collect()
}

fn model(a: &Args) -> Result<Model> {
    let d = Model::default();
    let m = Model {
        incast: Incast { loss: a.num("--incast", d.incast.loss)? },
        nic_latency_s: a.num("--nic-latency-us", d.nic_latency_s * 1e6)? * 1e-6,
        qp_latency_s: a.num("--qp-latency-us", d.qp_latency_s * 1e6)? * 1e-6,
        qps_per_peer: a.num("--qps", d.qps_per_peer)?,
        ce_latency_s: a.num("--ce-latency-us", d.ce_latency_s * 1e6)? * 1e-6,
        segments: a.num("--segments", d.segments)?,
        staging_bytes: match a.get("--staging") {
            None => d.staging_bytes,
            Some(v) => parse_size(v)?,
        },
    };
    m.validate()?;
    Ok(m)
}

const CLUSTER_OPTS: [&str; 14] = [
    "--nodes", "--gpus-per-node", "--nics-per-node", "--forwarding", "--nic-bw", "--nvlink-bw", "--ce-bw", "--ce-per-gpu",
    "--collective", "--bytes", "--skew", "--seed", "--root", "--pairs",
];

fn build(a: &Args) -> Result<(Cluster, Collective, Plan, f64)> {
    let cl = cluster(a)?;
    let c = collective(a, &cl)?;
    let opt = PlanOptions { chunk_bytes: parse_size(a.get("--chunk").unwrap_or("4MiB"))? };
    let t0 = Instant::now();
    let p = plan::build(&cl, &c, &opt)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    Ok((cl, c, p, ms))
}

/// Completion times of the plan, the naive schedule and the NCCL baseline under one model.
fn measure(a: &Args, cl: &Cluster, c: &Collective, p: &Plan, m: &Model) -> Result<Vec<(&'static str, Json)>> {
    let plan_r = sim::exec::simulate_plan(p, m)?;
    let mut f = vec![("completion_s", Json::Num(plan_r.completion_s))];
    if !a.flag("--no-naive") {
        // Every flow at once makes one max-min component of all flows, recomputed at every
        // completion: quadratic. Past the limit it is skipped (null) rather than left to run
        // for hours.
        let limit: usize = a.num("--naive-max-routes", 20_000)?;
        if p.traffic.routes.len() <= limit {
            f.push(("naive_s", Json::Num(sim::exec::simulate_naive(p, m)?.completion_s)));
        } else {
            f.push(("naive_s", Json::Null));
        }
    }
    if !a.flag("--no-baseline") {
        let (name, r) = sim::baseline::simulate_nccl(cl, c, m)?;
        f.push(("baseline", Json::Str(name.into())));
        f.push(("baseline_s", Json::Num(r.completion_s)));
    }
    Ok(f)
}

fn simulate(a: &Args) -> Result<()> {
    let mut known = CLUSTER_OPTS.to_vec();
    known.extend(["--chunk", "--incast", "--nic-latency-us", "--qp-latency-us", "--qps", "--ce-latency-us", "--segments", "--staging", "--no-naive", "--naive-max-routes", "--no-baseline", "--json"]);
    a.check_known(&known)?;
    let m = model(a)?;
    let (cl, c, p, plan_ms) = build(a)?;
    let lb = p.bound();
    let t0 = Instant::now();
    let main = measure(a, &cl, &c, &p, &m)?;
    let fluid = if m.incast.loss > 0.0 { Some(measure(a, &cl, &c, &p, &m.fluid())?) } else { None };
    let sim_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut fields = vec![
        ("collective", Json::Str(c.name().into())),
        ("nodes", Json::Int(cl.nodes as i128)),
        ("gpus_per_node", Json::Int(cl.gpus_per_node as i128)),
        ("bytes_per_gpu", Json::Int(parse_size(a.get("--bytes").unwrap_or("1GiB"))? as i128)),
        ("skew", a.get("--skew").map_or(Json::Null, |s| Json::Str(s.into()))),
        ("incast", Json::Num(m.incast.loss)),
    ];
    let completion = main[0].1.as_f64().unwrap_or(0.0);
    fields.extend(main);
    fields.extend([
        ("lower_bound_s", Json::Num(lb.total())),
        ("ratio", Json::Num(completion / lb.total().max(1e-300))),
        ("bound_nic_s", Json::Num(lb.nic_s)),
        ("bound_nvlink_s", Json::Num(lb.nvlink_s)),
        ("bound_ce_s", Json::Num(lb.ce_s)),
        ("estimate_s", Json::Num(p.estimate_s())),
        ("stages", Json::Int(p.stages.len() as i128)),
        ("routes", Json::Int(p.traffic.routes.len() as i128)),
        ("split_flows", Json::Int(p.traffic.split_flows() as i128)),
        ("plan_ms", Json::Num(plan_ms)),
        ("sim_ms", Json::Num(sim_ms)),
    ]);
    if let Some(f) = fluid {
        fields.push(("fluid", Json::obj(f)));
    }
    let out = Json::obj(fields);
    if a.flag("--json") {
        println!("{out}");
    } else {
        print_table(&out);
    }
    Ok(())
}

fn print_table(j: &Json) {
    if let Json::Obj(f) = j {
        for (k, v) in f {
            match v {
                Json::Num(x) if k.ends_with("_s") => println!("{k:>16}  {:.6} ms", x * 1e3),
                Json::Obj(_) => {
                    println!("{k:>16}:");
                    print_table(v);
                }
                _ => println!("{k:>16}  {v}"),
            }
        }
    }
}

fn show(a: &Args) -> Result<()> {
    let mut known = CLUSTER_OPTS.to_vec();
    known.extend(["--chunk", "--stages", "--png", "--stage", "--cell", "--json"]);
    a.check_known(&known)?;
    let (_, _, p, _) = build(a)?;
    if a.flag("--json") {
        println!("{}", p.to_json());
    } else {
        print!("{}", p.show_text(a.num("--stages", 4)?));
    }
    if let Some(path) = a.get("--png") {
        let s: usize = a.num("--stage", 0)?;
        if s >= p.stages.len() {
            return Err(Error::invalid_arg(OP, format!("--stage {s}: the plan has {} stages", p.stages.len())));
        }
        let g = p.cluster.num_gpus();
        if g > 4096 {
            return Err(Error::invalid_arg(OP, "--png: at most 4096 GPUs"));
        }
        let cell = a.num("--cell", (512 / g).clamp(1, 64))?.max(1);
        let (w, h, px) = p.stage_image(s, cell);
        std::fs::write(path, png::encode_rgb(w, h, &px)).map_err(|e| Error::io(OP, "write", e))?;
        eprintln!("wrote stage {s} ({w}x{h}) to {path}");
    }
    Ok(())
}

fn plan_cmd(a: &Args) -> Result<()> {
    let mut known = CLUSTER_OPTS.to_vec();
    known.push("--chunk");
    a.check_known(&known)?;
    let (_, _, p, _) = build(a)?;
    println!("{}", p.to_json());
    Ok(())
}

/// Builds the plan `--repeat` times and prints the fastest planning time (and the plan's size).
fn bench(a: &Args) -> Result<()> {
    let mut known = CLUSTER_OPTS.to_vec();
    known.extend(["--chunk", "--repeat", "--json"]);
    a.check_known(&known)?;
    let reps: usize = a.num("--repeat", 5)?;
    let mut best = f64::INFINITY;
    let mut stages = 0;
    for _ in 0..reps.max(1) {
        let (_, _, p, ms) = build(a)?;
        best = best.min(ms);
        stages = p.stages.len();
    }
    // One more build, phase by phase (the same calls `plan::build` makes).
    let cl = cluster(a)?;
    let c = collective(a, &cl)?;
    let chunk = parse_size(a.get("--chunk").unwrap_or("4MiB"))?;
    let t0 = Instant::now();
    let traffic = plan::Traffic::build(&cl, &c, chunk);
    let t1 = Instant::now();
    let (nic, nic_stages) = plan::schedule::schedule_nics(&cl, &traffic.routes);
    let t2 = Instant::now();
    let _ = plan::stages::assemble(&cl, &traffic, &nic, nic_stages, chunk);
    let t3 = Instant::now();
    let ms = |a: Instant, b: Instant| Json::Num((b - a).as_secs_f64() * 1e3);
    let out = Json::obj(vec![
        ("plan_ms", Json::Num(best)),
        ("stages", Json::Int(stages as i128)),
        ("routes", Json::Int(traffic.routes.len() as i128)),
        ("repeat", Json::Int(reps as i128)),
        ("traffic_ms", ms(t0, t1)),
        ("schedule_ms", ms(t1, t2)),
        ("assemble_ms", ms(t2, t3)),
    ]);
    println!("{out}");
    Ok(())
}

fn run(argv: &[String]) -> Result<()> {
    let a = Args::parse(argv)?;
    if a.flag("--help") || a.cmd == "help" || a.cmd == "--help" {
        println!("{USAGE}");
        return Ok(());
    }
    match a.cmd.as_str() {
        "simulate" => simulate(&a),
        "show" => show(&a),
        "plan" => plan_cmd(&a),
        "bench" => bench(&a),
        other => Err(Error::invalid_arg(OP, format!("unknown command `{other}`"))),
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&argv) {
        eprintln!("{e}\n\n{USAGE}");
        std::process::exit(2);
    }
}

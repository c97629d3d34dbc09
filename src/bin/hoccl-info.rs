//! `hoccl-info [--json] [--link KIND] [--ranks N]`: what hoccl sees on this host — GPUs
//! (name, PCI bus id, memory, copy engines, compute capability, peer-access matrix), RDMA
//! devices, the NICs in sysfs (link layer, rate, state, PCI address), the GPU↔NIC PCIe
//! distances and the forwarding GPU each GPU's inter-node traffic would use, the embedded kernels (fatbin size, architectures, kernel names), and the engine
//! `HOCCL_ENGINE=auto` picks for a few calls with the predicted time of each engine
//! (docs/design.md, "Choosing the engine"). Without a driver it prints "no GPU (reason)" and
//! still exits 0; only bad arguments exit non-zero.
//!
//! `hoccl-info --calibrate [--sample FILE]` measures this machine's GPU 0 (device-to-device
//! copy, the codec per dtype, the reduce kernel) and prints the `HOCCL_COST_MODEL` line that
//! carries the figures into the model.
use hoccl::cost::{self, CallKind, CallShape, CostModel, LinkKind};
use hoccl::device::cuda::{self, fatbin, Probe};
use hoccl::rdma::{self as verbs, RdmaDeviceInfo};
use hoccl::sysfs::{HostNics, Nic};
use hoccl::DataType;
use std::fmt::Write as _;

#[path = "hoccl-info/calibrate.rs"]
mod calibrate;

const USAGE: &str = "usage: hoccl-info [--json] [--link same-gpu|nvlink|pcie|nic] [--ranks N]
       hoccl-info --calibrate [--sample FILE.bf16|FILE.f16|FILE.f32]
  Prints the GPUs, RDMA devices, NICs (GPU-NIC distances, forwarding GPUs) and embedded kernels hoccl sees, and the engine HOCCL_ENGINE=auto
  picks per call (for --ranks ranks, default 2, over --link, default: what GPUs 0 and 1 have).
  --calibrate measures GPU 0 and prints the HOCCL_COST_MODEL line for it (--sample: the
  compression ratio of that file's values, whose extension names the dtype).";

struct Report {
    cuda: Result<Probe, String>,
    rdma: Result<Vec<RdmaDeviceInfo>, String>,
    /// The inter-node transport this environment's `HOCCL_NET` takes and why, or why it is
    /// refused (`hoccl::rdma::choose`).
    net: Result<String, String>,
    nics: HostNics,
    /// `HOCCL_FORWARDING_PEERS`, which replaces the sysfs choice (read as GPU i → map\[i\]).
    forwarding_override: Result<Vec<usize>, String>,
    fatbin_bytes: usize,
    fatbin: Option<fatbin::Contents>,
    auto: AutoTable,
}

/// The engine `auto` picks for a few calls, and the predicted µs of each engine.
struct AutoTable {
    model: Result<CostModel, String>,
    link: LinkKind,
    /// Why this link: the GPUs seen, or "hypothetical" when they cannot show it.
    why: String,
    ranks: usize,
}

const SIZES: [(usize, &str); 5] = [(4 << 10, "4K"), (64 << 10, "64K"), (1 << 20, "1M"), (16 << 20, "16M"), (256 << 20, "256M")];
const CALLS: [(CallKind, &str); 3] = [(CallKind::PointToPoint, "sendrecv"), (CallKind::FanOut, "allgather"), (CallKind::AllReduce, "allreduce")];
const DTYPES: [DataType; 3] = [DataType::BF16, DataType::F32, DataType::I32];

/// One row: call, dtype, size, the engine, predicted raw µs, compressed µs.
type Row = (&'static str, DataType, &'static str, cost::Engine, f64, Option<f64>);

fn auto_rows(t: &AutoTable, m: &CostModel) -> Vec<Row> {
    let scratch = hoccl::Config::default().reduce_scratch;
    let mut rows = Vec::new();
    for (kind, name) in CALLS {
        for dt in DTYPES {
            for (bytes, label) in SIZES {
                // `bytes`: the call's size (AllGather: per rank; AllReduce: the whole vector).
                let shape = CallShape::of(kind, dt, bytes / dt.size(), t.ranks, scratch);
                let p = cost::predict(m, &shape, t.link, None);
                rows.push((name, dt, label, cost::choose(m, &shape, t.link), p.raw_us, p.compressed_us));
            }
        }
    }
    rows
}

/// The link to show: `--link`, else what GPUs 0 and 1 have, else a hypothetical NVLink pair.
fn auto_link(arg: Option<LinkKind>, cuda: &Result<Probe, String>) -> (LinkKind, String) {
    if let Some(l) = arg {
        return (l, "--link".into());
    }
    match cuda {
        Ok(p) if p.count >= 2 => {
            let peer = p.peer_access.first().and_then(|r| r.get(1)).copied().unwrap_or(false)
                && p.peer_access.get(1).and_then(|r| r.first()).copied().unwrap_or(false);
            if peer {
                (LinkKind::NvLink, "GPUs 0 and 1 have peer access".into())
            } else {
                (LinkKind::Pcie, "GPUs 0 and 1 have no peer access".into())
            }
        }
        _ => (LinkKind::NvLink, "hypothetical: this host shows fewer than two GPUs".into()),
    }
}

fn bad_usage(why: String) -> ! {
    eprintln!("hoccl-info: {why}\n{USAGE}");
    std::process::exit(2);
}

fn main() {
    let _ = env_logger::Builder::from_env(env_logger::Env::new().filter("HOCCL_LOG")).try_init();
    let (mut json, mut calibrate, mut sample, mut link, mut ranks) = (false, false, None, None, 2usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().unwrap_or_else(|| bad_usage(format!("{what} needs a value")));
        match a.as_str() {
            "--json" => json = true,
            "--calibrate" => calibrate = true,
            "--sample" => sample = Some(value("--sample")),
            "--link" => {
                link = Some(match value("--link").as_str() {
                    "same-gpu" => LinkKind::SameGpu,
                    "nvlink" => LinkKind::NvLink,
                    "pcie" => LinkKind::Pcie,
                    "nic" => LinkKind::Nic,
                    other => bad_usage(format!("--link {other:?}: want same-gpu|nvlink|pcie|nic")),
                })
            }
            "--ranks" => {
                let v = value("--ranks");
                ranks = v.parse().ok().filter(|n| (2..=1 << 16).contains(n)).unwrap_or_else(|| bad_usage(format!("--ranks {v:?}: want a number of ranks >= 2")));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            other => bad_usage(format!("unknown argument {other:?}")),
        }
    }
    if sample.is_some() && !calibrate {
        bad_usage("--sample goes with --calibrate".into());
    }
    let model = hoccl::Config::from_env().map(|c| c.cost_model.clone().with_net_rate(c.net_gbps)).map_err(|e| e.to_string());
    if calibrate {
        std::process::exit(calibrate::run(model, sample.as_deref()));
    }
    let cuda = cuda::probe().map_err(|e| e.to_string());
    let (link, why) = auto_link(link, &cuda);
    let bus_ids: Vec<String> = cuda.as_ref().map(|p| p.gpus.iter().map(|g| g.pci_bus_id.clone()).collect()).unwrap_or_default();
    let report = Report {
        nics: HostNics::read(std::path::Path::new("/"), &bus_ids),
        forwarding_override: hoccl::Config::from_env().map(|c| c.forwarding_peers).map_err(|e| e.to_string()),
        cuda,
        rdma: verbs::probe().map_err(|e| e.to_string()),
        net: hoccl::Config::from_env().map_err(|e| e.to_string()).and_then(|c| verbs::choose(&c)),
        fatbin_bytes: hoccl::device::kernels::fatbin().len(),
        fatbin: fatbin::embedded(),
        auto: AutoTable { model, link, why, ranks },
    };
    let out = if json { to_json(&report) } else { to_text(&report) };
    print!("{out}");
}

fn text_auto(s: &mut String, t: &AutoTable) {
    let m = match &t.model {
        Ok(m) => m,
        Err(e) => {
            let _ = writeln!(s, "Engine choice (HOCCL_ENGINE=auto): ? ({e})");
            return;
        }
    };
    let _ = writeln!(s, "Engine choice (HOCCL_ENGINE=auto), {} ranks over {} ({}); predicted µs per engine:", t.ranks, t.link.name(), t.why);
    let _ = writeln!(s, "  (size: sendrecv the message, allgather each rank's block, allreduce the vector)");
    let _ = writeln!(s, "  {:<10} {:<5} {:>5}  {:<10} {:>10} {:>12}", "call", "dtype", "size", "engine", "ce/sm us", "compressed us");
    for (call, dt, size, engine, raw, comp) in auto_rows(t, m) {
        let comp = comp.map_or("-".into(), |c| format!("{c:.1}"));
        let _ = writeln!(s, "  {call:<10} {:<5} {size:>5}  {:<10} {raw:>10.1} {comp:>12}", format!("{dt:?}").to_lowercase(), engine.name());
    }
    let _ = writeln!(s, "  cost model (HOCCL_COST_MODEL): {m}");
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn to_text(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "hoccl {}", env!("CARGO_PKG_VERSION"));
    match &r.cuda {
        Err(why) => {
            let _ = writeln!(s, "CUDA: no GPU ({why})");
        }
        Ok(p) if p.count == 0 => {
            let _ = writeln!(s, "CUDA: no GPU (driver {} reports 0 devices)", version(p.driver_version));
        }
        Ok(p) => text_gpus(&mut s, p),
    }
    match &r.rdma {
        Err(why) => {
            let _ = writeln!(s, "RDMA: error ({why})");
        }
        Ok(devs) => {
            let _ = writeln!(s, "RDMA: {} device(s)", devs.len());
            for d in devs {
                text_rdma(&mut s, d);
            }
        }
    }
    let _ = match &r.net {
        Ok(line) => writeln!(s, "Inter-node transport: {line}"),
        Err(why) => writeln!(s, "Inter-node transport: refused ({why})"),
    };
    text_nics(&mut s, r);
    let _ = writeln!(s, "Kernels: fatbin {} bytes", r.fatbin_bytes);
    match &r.fatbin {
        None => {
            let _ = writeln!(s, "  (fatbin could not be parsed)");
        }
        Some(c) => {
            let archs: Vec<&str> = c.entries.iter().map(|e| e.arch.as_str()).collect();
            let _ = writeln!(s, "  archs:   {}", if archs.is_empty() { "(none: built with HOCCL_NO_CUDA=1)".into() } else { archs.join(", ") });
            let _ = writeln!(s, "  kernels: {}", if !c.kernels.is_empty() {
                c.kernels.join(", ")
            } else if c.entries.iter().any(|e| e.compressed) {
                "(not listed: nvcc compressed the cubins)".into()
            } else {
                "(none)".into()
            });
        }
    }
    text_auto(&mut s, &r.auto);
    s
}

fn version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// `HOCCL_MAX_WAITING_STREAMS` as a communicator on a GPU would resolve it (text).
fn waiting_limit() -> String {
    match hoccl::Config::from_env() {
        Ok(c) => match c.waiting_stream_limit(hoccl::device::Backend::Cuda) {
            usize::MAX => "unlimited (HOCCL_MAX_WAITING_STREAMS=0)".into(),
            n => format!("{n} (HOCCL_MAX_WAITING_STREAMS)"),
        },
        Err(e) => format!("? ({e})"),
    }
}

fn text_gpus(s: &mut String, p: &Probe) {
    let _ = writeln!(s, "CUDA: driver {}, {} GPU(s)", version(p.driver_version), p.count);
    for g in &p.gpus {
        let _ = writeln!(
            s,
            "  GPU {}: {}  pci {}  {:.1} GiB  copy engines {}  cc {}.{}  SMs {}  64-bit stream mem ops {}",
            g.ordinal,
            g.name,
            g.pci_bus_id,
            gib(g.total_mem_bytes),
            g.async_engines,
            g.compute_capability.0,
            g.compute_capability.1,
            g.sm_count,
            if g.stream_mem_ops_64 { "yes" } else { "no" }
        );
    }
    let _ = writeln!(
        s,
        "  hardware queues per context {} (CUDA_DEVICE_MAX_CONNECTIONS); streams that may wait for collectives at once {}",
        cuda::hardware_queues(),
        waiting_limit()
    );
    let _ = writeln!(s, "  peer access (row can access column):");
    let _ = writeln!(s, "      {}", (0..p.count).map(|j| format!("{j:>3}")).collect::<String>());
    for (i, row) in p.peer_access.iter().enumerate() {
        let cells: String = row.iter().enumerate().map(|(j, &ok)| format!("{:>3}", if i == j { "-" } else if ok { "Y" } else { "N" })).collect();
        let _ = writeln!(s, "  {i:>3} {cells}");
    }
}

fn rate(n: &Nic) -> String {
    n.rate_gbps.map_or("? Gb/s".into(), |r| format!("{r} Gb/s"))
}

/// The NICs, the GPU×NIC distance matrix and each GPU's forwarding GPU and NIC.
fn text_nics(s: &mut String, r: &Report) {
    let h = &r.nics;
    let _ = writeln!(s, "NICs (sysfs): {}", h.nics.len());
    for n in &h.nics {
        let netdevs = if n.netdevs.is_empty() { String::new() } else { format!(" (netdev {})", n.netdevs.join(", ")) };
        let port = n.port.map_or(String::new(), |p| format!(" port {p}"));
        let numa = n.pci.numa_node.map_or("?".into(), |x| x.to_string());
        let _ = writeln!(
            s,
            "  {}{netdevs}: {} {}{port}  {}  {}  pci {}  numa {numa}{}",
            n.name,
            if n.rdma { "rdma" } else { "net" },
            n.link_layer,
            rate(n),
            n.state,
            n.pci.bus_id(),
            if n.usable { "" } else { "  (not usable)" }
        );
    }
    if h.gpus.is_empty() || h.nics.is_empty() {
        let _ = writeln!(s, "  forwarding: identity ({})", if h.gpus.is_empty() { "no GPU" } else { "no NIC" });
    } else {
        let _ = writeln!(s, "  GPU-NIC PCIe distance (PIX one switch, PXB switches, PHB host bridge, SYS across CPUs):");
        let _ = writeln!(s, "         {}", h.nics.iter().map(|n| format!(" {:>10}", n.name)).collect::<String>());
        for (g, row) in h.distance.iter().enumerate() {
            let cells: String = if row.is_empty() { "  (not in sysfs)".into() } else { row.iter().map(|d| format!(" {:>10}", d.to_string())).collect() };
            let _ = writeln!(s, "  GPU {g:>2} {cells}");
        }
        match &h.affinity {
            None => {
                let _ = writeln!(s, "  forwarding: identity (a GPU's PCI path is not in sysfs)");
            }
            Some(a) => {
                let pairs: Vec<String> = a
                    .forwarding
                    .iter()
                    .enumerate()
                    .map(|(g, &f)| format!("{g}->{f} ({})", a.nic_of_gpu[g].map_or("no NIC", |n| h.nics[n].name.as_str())))
                    .collect();
                let _ = writeln!(s, "  forwarding (GPU -> staging GPU (NIC)): {}", pairs.join(", "));
            }
        }
    }
    match &r.forwarding_override {
        Ok(v) if v.is_empty() => {}
        Ok(v) => {
            let _ = writeln!(s, "  HOCCL_FORWARDING_PEERS overrides the choice: {}", v.iter().enumerate().map(|(i, f)| format!("{i}->{f}")).collect::<Vec<_>>().join(", "));
        }
        Err(e) => {
            let _ = writeln!(s, "  HOCCL_FORWARDING_PEERS: ? ({e})");
        }
    }
}

fn text_rdma(s: &mut String, d: &RdmaDeviceInfo) {
    if let Some(e) = &d.error {
        let _ = writeln!(s, "  {}: error ({e})", d.name);
        return;
    }
    let _ = writeln!(s, "  {}: guid {:016x}  fw {}  vendor {:#x}:{:#x}  max_qp {}", d.name, d.node_guid, d.fw_ver, d.vendor_id, d.vendor_part_id, d.max_qp);
    for p in &d.ports {
        let _ = writeln!(
            s,
            "    port {}: {} {}  lid {}  mtu {}  {} Gb/s  gid0 {}",
            p.port,
            p.state,
            p.link_layer,
            p.lid,
            p.active_mtu,
            p.rate_gbps,
            verbs::gid_string(&p.gid0)
        );
    }
}

/// A JSON string literal.
fn js(v: &str) -> String {
    let mut o = String::with_capacity(v.len() + 2);
    o.push('"');
    for c in v.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn list<T>(items: &[T], f: impl Fn(&T) -> String) -> String {
    format!("[{}]", items.iter().map(f).collect::<Vec<_>>().join(","))
}

fn to_json(r: &Report) -> String {
    let cuda = match &r.cuda {
        Err(why) => format!("{{\"ok\":false,\"reason\":{}}}", js(why)),
        Ok(p) => {
            let gpus = list(&p.gpus, |g| {
                format!(
                    "{{\"ordinal\":{},\"name\":{},\"pci_bus_id\":{},\"total_mem_bytes\":{},\"copy_engines\":{},\"compute_capability\":\"{}.{}\",\"sm_count\":{},\"stream_mem_ops_64\":{},\"unified_addressing\":{}}}",
                    g.ordinal, js(&g.name), js(&g.pci_bus_id), g.total_mem_bytes, g.async_engines,
                    g.compute_capability.0, g.compute_capability.1, g.sm_count, g.stream_mem_ops_64, g.unified_addressing
                )
            });
            let peers = list(&p.peer_access, |row| list(row, |b| b.to_string()));
            let limit = hoccl::Config::from_env().map(|c| c.waiting_stream_limit(hoccl::device::Backend::Cuda)).ok();
            format!(
                "{{\"ok\":true,\"driver_version\":{},\"count\":{},\"gpus\":{gpus},\"peer_access\":{peers},\"hardware_queues\":{},\"max_waiting_streams\":{}}}",
                p.driver_version,
                p.count,
                cuda::hardware_queues(),
                match limit {
                    Some(usize::MAX) => "\"unlimited\"".to_string(),
                    Some(n) => n.to_string(),
                    None => "null".to_string(),
                }
            )
        }
    };
    let rdma = match &r.rdma {
        Err(why) => format!("{{\"ok\":false,\"reason\":{}}}", js(why)),
        Ok(devs) => format!("{{\"ok\":true,\"devices\":{}}}", list(devs, json_rdma)),
    };
    let net = match &r.net {
        Ok(line) => format!("{{\"ok\":true,\"choice\":{}}}", js(line)),
        Err(why) => format!("{{\"ok\":false,\"reason\":{}}}", js(why)),
    };
    let fat = match &r.fatbin {
        None => format!("{{\"bytes\":{},\"parsed\":false}}", r.fatbin_bytes),
        Some(c) => format!(
            "{{\"bytes\":{},\"parsed\":true,\"archs\":{},\"kernels\":{}}}",
            r.fatbin_bytes,
            list(&c.entries, |e| js(&e.arch)),
            list(&c.kernels, |k| js(k))
        ),
    };
    let t = &r.auto;
    let auto = match &t.model {
        Err(e) => format!("{{\"ok\":false,\"reason\":{}}}", js(e)),
        Ok(m) => {
            let rows = list(&auto_rows(t, m), |(call, dt, size, engine, raw, comp)| {
                format!(
                    "{{\"call\":{},\"dtype\":{},\"size\":{},\"engine\":{},\"raw_us\":{raw:.2},\"compressed_us\":{}}}",
                    js(call),
                    js(&format!("{dt:?}").to_lowercase()),
                    js(size),
                    js(engine.name()),
                    comp.map_or("null".into(), |c| format!("{c:.2}"))
                )
            });
            format!(
                "{{\"ok\":true,\"ranks\":{},\"link\":{},\"why\":{},\"cost_model\":{},\"rows\":{rows}}}",
                t.ranks,
                js(t.link.name()),
                js(&t.why),
                js(&m.to_spec())
            )
        }
    };
    let nics = json_nics(r);
    format!("{{\"version\":{},\"cuda\":{cuda},\"rdma\":{rdma},\"net\":{net},\"nics\":{nics},\"fatbin\":{fat},\"auto\":{auto}}}\n", js(env!("CARGO_PKG_VERSION")))
}

/// `{"nics": [...], "distance": [[class, ...] per GPU], "forwarding": [...] | null,
/// "nic_of_gpu": [...] | null, "forwarding_override": [...]}`.
fn json_nics(r: &Report) -> String {
    let h = &r.nics;
    let nics = list(&h.nics, |n| {
        format!(
            "{{\"name\":{},\"rdma\":{},\"netdevs\":{},\"link_layer\":{},\"rate_gbps\":{},\"state\":{},\"port\":{},\"usable\":{},\"pci_bus_id\":{},\"numa_node\":{}}}",
            js(&n.name),
            n.rdma,
            list(&n.netdevs, |d| js(d)),
            js(&n.link_layer),
            n.rate_gbps.map_or("null".into(), |x| x.to_string()),
            js(&n.state),
            n.port.map_or("null".into(), |p| p.to_string()),
            n.usable,
            js(n.pci.bus_id()),
            n.pci.numa_node.map_or("null".into(), |x| x.to_string())
        )
    });
    let distance = list(&h.distance, |row| list(row, |d| js(d.class.name())));
    let (fwd, nic_of) = match &h.affinity {
        Some(a) => (list(&a.forwarding, |f| f.to_string()), list(&a.nic_of_gpu, |n| n.map_or("null".into(), |n| n.to_string()))),
        None => ("null".into(), "null".into()),
    };
    let over = match &r.forwarding_override {
        Ok(v) => list(v, |f| f.to_string()),
        Err(e) => format!("{{\"error\":{}}}", js(e)),
    };
    format!("{{\"nics\":{nics},\"distance\":{distance},\"forwarding\":{fwd},\"nic_of_gpu\":{nic_of},\"forwarding_override\":{over}}}")
}

fn json_rdma(d: &RdmaDeviceInfo) -> String {
    let ports = list(&d.ports, |p| {
        format!(
            "{{\"port\":{},\"state\":{},\"link_layer\":{},\"lid\":{},\"active_mtu\":{},\"rate_gbps\":{},\"gid0\":{}}}",
            p.port,
            js(&p.state),
            js(&p.link_layer),
            p.lid,
            p.active_mtu,
            p.rate_gbps,
            js(&verbs::gid_string(&p.gid0))
        )
    });
    let error = d.error.as_deref().map(js).unwrap_or_else(|| "null".into());
    format!(
        "{{\"name\":{},\"node_guid\":\"{:016x}\",\"fw_ver\":{},\"vendor_id\":{},\"vendor_part_id\":{},\"max_qp\":{},\"max_mr_size\":{},\"ports\":{ports},\"error\":{error}}}",
        js(&d.name),
        d.node_guid,
        js(&d.fw_ver),
        d.vendor_id,
        d.vendor_part_id,
        d.max_qp,
        d.max_mr_size
    )
}

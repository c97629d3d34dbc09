//! The one place configuration lives. Built in code (`Config::default()`), then overridden
//! by `HOCCL_*` environment variables (`Config::from_env`); the README lists them all.
use crate::cost::CostModel;
use crate::error::{Error, Result};
use std::time::Duration;

/// Which data engine moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// The default. Each call runs on the engine the cost model (`Config::cost_model`)
    /// predicts fastest for its dtype, op, sizes and links: movement on `CopyEngine` and
    /// reductions on `Sm` unless `Compressed` is predicted faster (`cost::choose`;
    /// docs/design.md, "Choosing the engine").
    Auto,
    /// Copy engines driven by the CPU proxy: no kernel, no SM. Reductions move their data
    /// this way too, and still add their one reduce step on the device (a kernel on CUDA):
    /// the arithmetic has nowhere else to run (docs/design.md, "Reductions").
    CopyEngine,
    /// The `sm` engine of the reductions: their reduce step is the CopyReduce kernel on a
    /// few SMs, their data and every other op move on the copy engines. That is what `ce`
    /// does too (a reduction always reduces on the device); the name keeps the engine
    /// selectable as the others gain choices.
    Sm,
    /// Transfers to peers of bf16/f16/f32 data of 64 KiB or more cross compressed: the codec
    /// kernels compress on the sender's stream and decompress on the receiver's (SMs), the
    /// copy engines move the compressed bytes (`comm::compressed`).
    Compressed,
}

/// Which transport carries the traffic between ranks of different nodes (`HOCCL_NET`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetChoice {
    /// The default: the verbs transport when every rank can take it (a usable RDMA device),
    /// else sockets (`transport::verbs::decide`).
    Auto,
    /// TCP sockets (`transport::socket`): several connections per peer, through host memory.
    Socket,
    /// RDMA verbs (`transport::verbs::transport`): several queue pairs per peer. Refused at
    /// communicator creation, with the reason, without a usable device.
    Ib,
}

/// Which device backend the communicator drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a GPU is present, the host backend otherwise.
    Auto,
    Cuda,
    Host,
}

/// Segments per compressed transfer under `HOCCL_CODEC_SEGMENTS=auto` when ranks of the
/// communicator are on different GPUs.
pub const CODEC_SEGMENTS: usize = 8;

#[derive(Clone, Debug)]
pub struct Config {
    /// `HOCCL_ENGINE` = auto | ce | sm | compressed.
    pub engine: EngineChoice,
    /// `HOCCL_COST_MODEL`: the constants `auto` chooses from (`cost::CostModel`; default:
    /// the H200 figures). The variable holds `key=value,...` overrides, or the path of a file
    /// of them (`hoccl-info --calibrate` prints the line). Rank 0's model is the
    /// communicator's: every rank must choose alike.
    pub cost_model: CostModel,
    /// `HOCCL_BACKEND` = auto | cuda | host.
    pub backend: BackendChoice,
    /// `HOCCL_CHUNK_BYTES`: the largest chunk of copy-engine work (bytes; accepts K/M/G
    /// suffixes). The same-host transport sizes each flow's chunks from the flow (one copy
    /// up to 1 MiB, otherwise spread over the queues, chunks of at least 1 MiB); this bounds
    /// them (`transport::chunk_scheduler`).
    pub chunk_bytes: usize,
    /// `HOCCL_COPY_QUEUES`: copy-engine queues per rank for peer traffic (H200 has 3 async
    /// engines); a rank's copies to itself run on the caller's stream.
    pub copy_queues: usize,
    /// `HOCCL_QPS_PER_PEER`: queue pairs or sockets per remote peer (1..=64): the socket
    /// transport opens this many TCP connections to each rank of another node, the verbs
    /// transport this many queue pairs, and each spreads a transfer's chunks over them.
    pub qps_per_peer: usize,
    /// `HOCCL_NET` = auto | socket | ib: the transport between ranks of different nodes.
    pub net: NetChoice,
    /// `HOCCL_IB_HCA`: the RDMA device the verbs NIC layer opens (exact name, e.g.
    /// `mlx5_0`); `None`: the first device with an active port.
    pub ib_hca: Option<String>,
    /// `HOCCL_IB_GID_INDEX`: the GID index that addresses peers on an Ethernet (RoCE) port
    /// (default 3, the usual RoCE v2 IPv4 entry); InfiniBand ports use the LID.
    pub ib_gid_index: u8,
    /// `HOCCL_VERBS_FAKE=1`: the verbs NIC layer uses the in-memory test fabric
    /// (`transport::verbs::nic::fake`) instead of a device: thread ranks of one process only.
    pub verbs_fake: bool,
    /// `HOCCL_NET_GBPS`: a rate limit of the inter-node transport, in GB/s (10^9 bytes) per
    /// rank and direction, 0 (the default) for none. A token bucket inside the transport
    /// (for measurements with several virtual nodes on one host), not Linux traffic control.
    pub net_gbps: f64,
    /// `HOCCL_NET_STAGING`: bytes of host staging per communicator for the inter-node
    /// transport's data when the device's memory is not host memory (accepts K/M/G
    /// suffixes; at least 64 KiB); allocated once, split between sending and receiving. The
    /// verbs transport also registers this many bytes of slots with the NIC, split over
    /// its peers (`transport::verbs::slots_for`), whatever the device.
    pub net_staging_bytes: usize,
    /// Stage the inter-node transport's data through host staging even when the device's
    /// memory is host memory (no variable): lets the host backend's tests run the path
    /// CUDA takes.
    #[doc(hidden)]
    pub net_stage_host_memory: bool,
    /// With `verbs_fake`: this rank's `n`th send or write (counted from 1) on the test
    /// fabric completes with an injected error, failing that connection (no variable; 0:
    /// never). Lets tests fail a peer's channel mid-transfer.
    #[doc(hidden)]
    pub verbs_fake_fail_at: u64,
    /// A forwarding peer refuses every relayed send (no variable; lets tests drive the
    /// sender's fallback to a direct send).
    #[doc(hidden)]
    pub relay_refuse: bool,
    /// `HOCCL_VIRTUAL_NODES`: split each host's ranks into this many nodes (testing).
    pub virtual_nodes: usize,
    /// `HOCCL_FORWARDING_PEERS`: comma list, entry i = forwarding peer of local GPU i.
    /// Empty means identity (stage locally).
    pub forwarding_peers: Vec<usize>,
    /// `HOCCL_FORWARDING` = 1 | 0: inter-node AllGather, AlltoAll(v), Broadcast, Gather and
    /// Scatter run the planner's stages, each rank's inter-node bytes through its forwarding
    /// peer, where their flows are large enough and a gain is predicted (1, the
    /// default), or every rank sends its own data straight to every remote peer at once
    /// (0, the direct path); the hierarchical reductions' pieces, so their hops between
    /// nodes, lie on the forwarding peers only (1) or on every rank (0); and point-to-point
    /// transfers of `staged_min_flow_bytes` or more with other nodes leave through the
    /// sender's forwarding peer and land through the receiver's, over sockets (1), or
    /// move between the two ranks (0).
    /// docs/design.md, "Staged plan", "Reductions across nodes", "Send/recv through the
    /// forwarding peer".
    pub forwarding: bool,
    /// `HOCCL_FORWARD_BALANCE`: on the staged path, a route between nodes may leave from
    /// and land on any rank's NIC of its nodes, so a skewed exchange spreads its bytes over
    /// a node's NICs, a large flow in parts over several (1, the default, on nodes whose ranks are all alike in number; every
    /// rank of such a node then holds `HOCCL_FORWARD_STAGING`), or only on its ranks'
    /// forwarding peers' (0). docs/design.md, "Staged plan".
    pub forward_balance: bool,
    /// `HOCCL_FORWARD_STAGING`: bytes of device staging per forwarding rank (K/M/G
    /// suffixes; at least 64 KiB), allocated once per communicator at creation on the ranks
    /// that forward another rank's traffic: four slots (two to send, two to receive) bound a
    /// step's NIC piece.
    pub forward_staging_bytes: usize,
    /// The staged path takes a call only when its largest flow between nodes has at least
    /// this many bytes (no variable; default: the socket transport's chunk, below which the
    /// direct path sends each flow as one frame and stages would only add op handshakes).
    #[doc(hidden)]
    pub staged_min_flow_bytes: usize,
    /// Stage every call the staged path can take, whatever its size and the predicted
    /// gain, and relay every non-empty point-to-point transfer a forwarding peer can take
    /// (no variable; for tests of the staged path and of relays).
    #[doc(hidden)]
    pub stage_every_call: bool,
    /// `HOCCL_DEVICE`: GPU ordinal for this rank (default: local rank modulo GPU count).
    pub device: Option<usize>,
    /// `HOCCL_TIMEOUT_MS`: an operation making no progress for this long fails.
    pub timeout: Duration,
    /// `HOCCL_LOG`: env_logger filter syntax (e.g. `hoccl=debug`).
    pub log: Option<String>,
    /// `HOCCL_CODEC_TICKETS` = 0 | 1: the GPU compressor takes each block's index from an
    /// atomic ticket (1) instead of its CTA index (0, the default: faster, and correct
    /// because the GPU starts CTAs in index order, which CUDA does not promise; 1 needs no
    /// such assumption).
    pub codec_tickets: bool,
    /// `HOCCL_CODEC_SEGMENTS`: the compressed engine cuts a transfer of at least two
    /// segments' worth (4 MiB each) into at most this many independently coded segments, so
    /// that coding, moving and decoding overlap (docs/design.md, "Compressed engine"); 1
    /// moves every transfer as one stream, coded before the op and decoded after it. In
    /// 1..=64; `None` (`auto`, the default): 1 when every rank of the communicator is on one
    /// GPU (the three share its memory, so overlap gains nothing), else
    /// [`CODEC_SEGMENTS`]. Every rank must use the same value (a mismatch fails the op).
    pub codec_segments: Option<usize>,
    /// The smallest such segment (no variable; default 4 MiB; tests lower it). Every rank
    /// must use the same value.
    #[doc(hidden)]
    pub codec_segment_bytes: usize,
    /// `HOCCL_MAX_WAITING_STREAMS`: how many streams of this process may wait for collectives
    /// on one GPU at once; a collective on one more stream blocks the calling thread (up to
    /// `timeout`) until one of them is released. `None` (the default): half the context's
    /// hardware queues on CUDA (`CUDA_DEVICE_MAX_CONNECTIONS`, 16 of hoccl's 32), no limit
    /// on the host backend; `0` in the variable: no limit. A waiting stream holds a hardware
    /// queue; when they all hold one, the copies that would release them cannot run
    /// (docs/design.md, "Hardware queues and waiting streams").
    pub max_waiting_streams: Option<usize>,
    /// `HOCCL_SERIAL_ENQUEUE` = auto | 1 | 0: whether the CUDA backend makes one enqueueing
    /// driver call at a time per GPU of this process, because concurrent enqueues from
    /// several threads can leave a stream stalled behind other streams' waits
    /// (`src/device/cuda/enqueue_gate.rs`). `None` (auto, the default): while two or more hoccl
    /// devices are open on the GPU (several ranks in one process); `Some(true)`: always;
    /// `Some(false)`: never.
    pub serial_enqueue: Option<bool>,
    /// `HOCCL_GATED` = auto | 1 | 0: device-gated writes between ranks of this host in
    /// different processes (docs/design.md, "Copy-engine path"): a transfer of at most one
    /// copy is queued on the device when both ops are submitted and runs once both streams
    /// reached the op, with no CPU hop in between. `None` (auto) and `Some(true)`: on where
    /// both processes could map their peers' flags for the device (with `1`, a device that
    /// cannot fails communicator creation); `Some(false)` (the default, until the path has
    /// passed on a GPU): every transfer goes through the proxy's handshake.
    pub gated: Option<bool>,
    /// `HOCCL_STAGED_BYTES`: the longest transfer between ranks of this host in different
    /// processes that takes the staged path (docs/design.md, "Copy-engine path"): every
    /// device operation of it is enqueued by the calling thread during the call, through a
    /// ring of slots in the receiver's device memory, and the proxy makes no driver call for
    /// it. Accepts K/M/G suffixes; 0 (the default, until the path has passed on a GPU) turns
    /// the path off. Every rank must use the same value.
    pub staged_bytes: usize,
    /// `HOCCL_STAGED_RING` = `RxS` (e.g. `8x256K`): slots per receive ring and bytes per
    /// slot; a staged transfer moves in slot-sized chunks, at most R ahead of its receiver.
    /// Every rank must use the same value.
    pub staged_ring: (usize, usize),
    /// `HOCCL_TRACE_OPS` = `A-B` (or `N`, meaning `1-N`): the proxy logs, at info level, the
    /// timeline of ops A..=B of each communicator (call order, from 1): when it saw the op
    /// submitted, its stream reach it, its buffer-ready sent and received, its gated
    /// announcement received, copies queued and landing flag seen, its writes handed to the
    /// transport and done, its data-landed received, and its stream released, in
    /// CLOCK_MONOTONIC nanoseconds (comparable between the processes of one host).
    pub trace_ops: Option<(u64, u64)>,
    /// `HOCCL_REDUCE_CTAS`: CTAs of a CopyReduce kernel launch (`CudaDevice::reduce_kernel_async`);
    /// `None` (the default): `device::cuda::DEFAULT_REDUCE_CTAS`, chosen by measurement
    /// (docs/results/h200-1gpu/reduce_kernels.json).
    pub reduce_ctas: Option<usize>,
    /// `HOCCL_REDUCE_SCRATCH`: bytes of the per-communicator scratch that reductions receive
    /// peers' contributions into (accepts K/M/G suffixes; at least 4096). A reduction whose
    /// `count * ranks` does not fit runs in chunks. Allocated at the first reduction; every
    /// rank must use the same value.
    pub reduce_scratch: usize,
    /// `HOCCL_SOCKET_IFNAME`: the interfaces the TCP bootstrap's root may listen on (NCCL
    /// syntax: comma list of name prefixes, `=` first for exact names, `^` first to
    /// exclude). `None`: the first non-loopback interface that is up, else loopback.
    pub socket_ifname: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            engine: EngineChoice::Auto,
            cost_model: CostModel::default(),
            backend: BackendChoice::Auto,
            chunk_bytes: 16 << 20,
            copy_queues: 3,
            qps_per_peer: 2,
            net: NetChoice::Auto,
            ib_hca: None,
            ib_gid_index: 3,
            verbs_fake: false,
            net_gbps: 0.0,
            net_staging_bytes: 16 << 20,
            net_stage_host_memory: false,
            verbs_fake_fail_at: 0,
            relay_refuse: false,
            virtual_nodes: 1,
            forwarding_peers: Vec::new(),
            forwarding: true,
            forward_balance: true,
            forward_staging_bytes: 16 << 20,
            staged_min_flow_bytes: crate::transport::socket::CHUNK,
            stage_every_call: false,
            device: None,
            timeout: Duration::from_secs(120),
            log: None,
            codec_tickets: false,
            codec_segments: None,
            codec_segment_bytes: 4 << 20,
            max_waiting_streams: None,
            serial_enqueue: None,
            gated: Some(false),
            staged_bytes: 0,
            staged_ring: (8, 256 << 10),
            trace_ops: None,
            reduce_ctas: None,
            reduce_scratch: 64 << 20,
            socket_ifname: None,
        }
    }
}

const OP: &str = "Config::from_env";

fn parse_bytes(key: &str, v: &str) -> Result<usize> {
    let v = v.trim();
    let (num, mul) = match v.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = v[i..].to_ascii_lowercase();
            let mul = match unit.as_str() {
                "k" | "kib" | "kb" => 1usize << 10,
                "m" | "mib" | "mb" => 1 << 20,
                "g" | "gib" | "gb" => 1 << 30,
                "b" => 1,
                _ => return Err(Error::invalid_arg(OP, format!("{key}={v}: unknown unit"))),
            };
            (&v[..i], mul)
        }
        None => (v, 1),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| Error::invalid_arg(OP, format!("{key}={v}: not a byte count")))
}

fn parse_num(key: &str, v: &str) -> Result<usize> {
    v.trim().parse().map_err(|_| Error::invalid_arg(OP, format!("{key}={v}: not a number")))
}

/// `HOCCL_COST_MODEL`: overrides inline when the value holds a `=`, else the path of a file
/// of them.
fn parse_cost_model(base: CostModel, v: &str) -> Result<CostModel> {
    if v.contains('=') || v.trim().is_empty() {
        return base.with_overrides(v);
    }
    let path = v.trim();
    let text = std::fs::read_to_string(path).map_err(|e| Error::invalid_arg(OP, format!("HOCCL_COST_MODEL={path}: not key=value pairs, and not a readable file ({e})")))?;
    base.with_overrides(&text).map_err(|e| Error::invalid_arg(OP, format!("HOCCL_COST_MODEL file {path}: {e}")))
}

impl Config {
    /// Defaults overridden by the process environment.
    pub fn from_env() -> Result<Config> {
        Config::default().with_env(|k| std::env::var(k).ok())
    }

    /// Apply `HOCCL_*` overrides read through `get` (testable without touching the process
    /// environment). Unknown values are errors, not silently ignored.
    pub fn with_env(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        if let Some(v) = get("HOCCL_ENGINE") {
            self.engine = match v.to_ascii_lowercase().as_str() {
                "auto" => EngineChoice::Auto,
                "ce" | "copy" | "copyengine" | "copy_engine" => EngineChoice::CopyEngine,
                "sm" => EngineChoice::Sm,
                "compressed" => EngineChoice::Compressed,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_ENGINE={v}: want auto|ce|sm|compressed"))),
            };
        }
        if let Some(v) = get("HOCCL_COST_MODEL") {
            self.cost_model = parse_cost_model(self.cost_model, &v)?;
        }
        if let Some(v) = get("HOCCL_BACKEND") {
            self.backend = match v.to_ascii_lowercase().as_str() {
                "auto" => BackendChoice::Auto,
                "cuda" | "gpu" => BackendChoice::Cuda,
                "host" | "cpu" => BackendChoice::Host,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_BACKEND={v}: want auto|cuda|host"))),
            };
        }
        if let Some(v) = get("HOCCL_CHUNK_BYTES") {
            self.chunk_bytes = parse_bytes("HOCCL_CHUNK_BYTES", &v)?;
        }
        // An alias of HOCCL_COPY_QUEUES (its former name), read for existing scripts.
        if let Some(v) = get("HOCCL_COPY_STREAMS") {
            self.copy_queues = parse_num("HOCCL_COPY_STREAMS", &v)?;
        }
        if let Some(v) = get("HOCCL_COPY_QUEUES") {
            self.copy_queues = parse_num("HOCCL_COPY_QUEUES", &v)?;
        }
        if let Some(v) = get("HOCCL_QPS_PER_PEER") {
            self.qps_per_peer = parse_num("HOCCL_QPS_PER_PEER", &v)?;
        }
        if let Some(v) = get("HOCCL_NET") {
            self.net = match v.trim().to_ascii_lowercase().as_str() {
                "auto" => NetChoice::Auto,
                "socket" => NetChoice::Socket,
                "ib" => NetChoice::Ib,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_NET={v}: want auto|socket|ib"))),
            };
        }
        if let Some(v) = get("HOCCL_IB_HCA") {
            self.ib_hca = Some(v.trim().to_owned()).filter(|s| !s.is_empty());
        }
        if let Some(v) = get("HOCCL_IB_GID_INDEX") {
            self.ib_gid_index = v.trim().parse::<u8>().map_err(|_| Error::invalid_arg(OP, format!("HOCCL_IB_GID_INDEX={v}: want 0..=255")))?;
        }
        if let Some(v) = get("HOCCL_VERBS_FAKE") {
            self.verbs_fake = match v.trim() {
                "0" => false,
                "1" => true,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_VERBS_FAKE={v}: want 0|1"))),
            };
        }
        if let Some(v) = get("HOCCL_NET_GBPS") {
            self.net_gbps = v.trim().parse::<f64>().map_err(|_| Error::invalid_arg(OP, format!("HOCCL_NET_GBPS={v}: not a number")))?;
        }
        if let Some(v) = get("HOCCL_NET_STAGING") {
            self.net_staging_bytes = parse_bytes("HOCCL_NET_STAGING", &v)?;
        }
        if let Some(v) = get("HOCCL_VIRTUAL_NODES") {
            self.virtual_nodes = parse_num("HOCCL_VIRTUAL_NODES", &v)?;
        }
        if let Some(v) = get("HOCCL_FORWARDING_PEERS") {
            self.forwarding_peers = v
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| parse_num("HOCCL_FORWARDING_PEERS", s))
                .collect::<Result<_>>()?;
        }
        if let Some(v) = get("HOCCL_FORWARDING") {
            self.forwarding = match v.trim() {
                "0" => false,
                "1" => true,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_FORWARDING={v}: want 1|0"))),
            };
        }
        if let Some(v) = get("HOCCL_FORWARD_BALANCE") {
            self.forward_balance = match v.trim() {
                "0" => false,
                "1" => true,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_FORWARD_BALANCE={v}: want 1|0"))),
            };
        }
        if let Some(v) = get("HOCCL_FORWARD_STAGING") {
            self.forward_staging_bytes = parse_bytes("HOCCL_FORWARD_STAGING", &v)?;
        }
        if let Some(v) = get("HOCCL_DEVICE") {
            self.device = Some(parse_num("HOCCL_DEVICE", &v)?);
        }
        if let Some(v) = get("HOCCL_TIMEOUT_MS") {
            self.timeout = Duration::from_millis(parse_num("HOCCL_TIMEOUT_MS", &v)? as u64);
        }
        if let Some(v) = get("HOCCL_TRACE_OPS") {
            let range = match v.trim().split_once('-') {
                Some((a, b)) => (parse_num("HOCCL_TRACE_OPS", a)? as u64, parse_num("HOCCL_TRACE_OPS", b)? as u64),
                None => (1, parse_num("HOCCL_TRACE_OPS", &v)? as u64),
            };
            self.trace_ops = (range.1 >= range.0 && range.1 > 0).then_some(range);
        }
        if let Some(v) = get("HOCCL_LOG") {
            self.log = Some(v);
        }
        if let Some(v) = get("HOCCL_CODEC_SEGMENTS") {
            self.codec_segments = match v.trim() {
                "auto" => None,
                n => Some(n.parse().map_err(|_| Error::invalid_arg(OP, format!("HOCCL_CODEC_SEGMENTS={v}: want auto or a count in 1..=64")))?),
            };
        }
        if let Some(v) = get("HOCCL_CODEC_TICKETS") {
            self.codec_tickets = match v.trim() {
                "0" => false,
                "1" => true,
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_CODEC_TICKETS={v}: want 0|1"))),
            };
        }
        if let Some(v) = get("HOCCL_SERIAL_ENQUEUE") {
            self.serial_enqueue = match v.trim() {
                "auto" => None,
                "1" => Some(true),
                "0" => Some(false),
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_SERIAL_ENQUEUE={v}: want auto|1|0"))),
            };
        }
        if let Some(v) = get("HOCCL_GATED") {
            self.gated = match v.trim() {
                "auto" => None,
                "1" => Some(true),
                "0" => Some(false),
                _ => return Err(Error::invalid_arg(OP, format!("HOCCL_GATED={v}: want auto|1|0"))),
            };
        }
        if let Some(v) = get("HOCCL_STAGED_BYTES") {
            self.staged_bytes = parse_bytes("HOCCL_STAGED_BYTES", &v)?;
        }
        if let Some(v) = get("HOCCL_STAGED_RING") {
            let bad = || Error::invalid_arg(OP, format!("HOCCL_STAGED_RING={v}: want SLOTSxBYTES, e.g. 8x256K"));
            let (r, s) = v.trim().split_once(['x', 'X']).ok_or_else(bad)?;
            let slots = r.trim().parse::<usize>().map_err(|_| bad())?;
            self.staged_ring = (slots, parse_bytes("HOCCL_STAGED_RING", s)?);
        }
        if let Some(v) = get("HOCCL_REDUCE_CTAS") {
            match parse_num("HOCCL_REDUCE_CTAS", &v)? {
                0 => return Err(Error::invalid_arg(OP, "HOCCL_REDUCE_CTAS=0: want at least one CTA")),
                n => self.reduce_ctas = Some(n),
            }
        }
        if let Some(v) = get("HOCCL_REDUCE_SCRATCH") {
            self.reduce_scratch = parse_bytes("HOCCL_REDUCE_SCRATCH", &v)?;
        }
        if let Some(v) = get("HOCCL_MAX_WAITING_STREAMS") {
            self.max_waiting_streams = match parse_num("HOCCL_MAX_WAITING_STREAMS", &v)? {
                0 => Some(usize::MAX),
                n => Some(n),
            };
        }
        if let Some(v) = get("HOCCL_SOCKET_IFNAME") {
            self.socket_ifname = Some(v.trim().to_owned()).filter(|s| !s.is_empty() && s != "^" && s != "=");
        }
        self.validate()?;
        Ok(self)
    }

    /// How many streams of this process may wait for collectives on one GPU of `backend` at
    /// once: `max_waiting_streams`, else half the CUDA context's hardware queues (at least
    /// 1), no limit (`usize::MAX`) on the host backend.
    pub fn waiting_stream_limit(&self, backend: crate::device::Backend) -> usize {
        match (self.max_waiting_streams, backend) {
            (Some(n), _) => n,
            (None, crate::device::Backend::Cuda) => (crate::device::cuda::hardware_queues() / 2).max(1),
            (None, crate::device::Backend::Host) => usize::MAX,
        }
    }

    /// The largest `staged_bytes` the staged ring allows: a call stages at most
    /// `STAGED_CALL_CHUNKS` slots per peer.
    pub fn staged_bytes_max(&self) -> usize {
        self.staged_ring.1.saturating_mul(crate::transport::staged::STAGED_CALL_CHUNKS as usize)
    }

    /// Reject values no engine can run with.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::invalid_arg("Config::validate", what));
        if self.chunk_bytes < 4096 || !self.chunk_bytes.is_power_of_two() {
            return bad(format!("chunk_bytes {} must be a power of two >= 4096", self.chunk_bytes));
        }
        let (slots, slot) = self.staged_ring;
        if !(1..=1024).contains(&slots) || slot < 4096 || slot % 4096 != 0 || slots.saturating_mul(slot) > 1 << 30 {
            return bad(format!("staged ring {slots}x{slot}: want 1..=1024 slots of a multiple of 4096 bytes, at most 1 GiB in all"));
        }
        let most = self.staged_bytes_max();
        if self.staged_bytes > most {
            return bad(format!("staged_bytes {} exceeds {} slots of the staged ring ({most} bytes): a call stages at most that much per peer", self.staged_bytes, crate::transport::staged::STAGED_CALL_CHUNKS));
        }
        if let Some(n) = self.codec_segments.filter(|n| !(1..=64).contains(n)) {
            return bad(format!("codec_segments {n} must be in 1..=64"));
        }
        if self.codec_segment_bytes < 4096 {
            return bad(format!("codec_segment_bytes {} must be at least 4096", self.codec_segment_bytes));
        }
        if self.reduce_scratch < 4096 {
            return bad(format!("reduce_scratch {} must be at least 4096 bytes", self.reduce_scratch));
        }
        if self.copy_queues == 0 || self.copy_queues > 16 {
            return bad(format!("copy_queues {} must be in 1..=16", self.copy_queues));
        }
        if self.qps_per_peer == 0 || self.qps_per_peer > 64 {
            return bad(format!("qps_per_peer {} must be in 1..=64", self.qps_per_peer));
        }
        if !self.net_gbps.is_finite() || self.net_gbps < 0.0 {
            return bad(format!("net_gbps {} must be a finite rate >= 0 (0: no limit)", self.net_gbps));
        }
        if self.net_staging_bytes < 64 << 10 {
            return bad(format!("net_staging_bytes {} must be at least 64 KiB", self.net_staging_bytes));
        }
        if self.forward_staging_bytes < 64 << 10 {
            return bad(format!("forward_staging_bytes {} must be at least 64 KiB", self.forward_staging_bytes));
        }
        if self.virtual_nodes == 0 {
            return bad("virtual_nodes must be >= 1".into());
        }
        if self.max_waiting_streams == Some(0) {
            return bad("max_waiting_streams must be >= 1 (usize::MAX: no limit)".into());
        }
        if self.timeout.is_zero() {
            return bad("timeout must be > 0".into());
        }
        self.cost_model.validate()?;
        Ok(())
    }
}

/// Install the env_logger once, with the filter from `HOCCL_LOG` (default: warnings).
pub fn init_logging(filter: Option<&str>) {
    use std::sync::Once;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let f = filter.map(str::to_owned).or_else(|| std::env::var("HOCCL_LOG").ok()).unwrap_or_else(|| "warn".into());
        let _ = env_logger::Builder::new().parse_filters(&f).format_timestamp_micros().is_test(cfg!(test)).try_init();
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn env_overrides_apply() {
        let c = Config::default()
            .with_env(env(&[
                ("HOCCL_CHUNK_BYTES", "8M"),
                ("HOCCL_ENGINE", "ce"),
                ("HOCCL_VIRTUAL_NODES", "2"),
                ("HOCCL_FORWARDING_PEERS", "1,0,3,2"),
                ("HOCCL_TIMEOUT_MS", "1500"),
                ("HOCCL_CODEC_TICKETS", "1"),
                ("HOCCL_CODEC_SEGMENTS", "3"),
            ]))
            .unwrap();
        assert!(c.codec_tickets);
        assert_eq!((c.codec_segments, Config::default().codec_segments), (Some(3), None));
        assert_eq!(Config::default().with_env(env(&[("HOCCL_CODEC_SEGMENTS", "auto")])).unwrap().codec_segments, None);
        assert!(Config::default().with_env(env(&[("HOCCL_CODEC_SEGMENTS", "65")])).is_err());
        assert!(!Config::default().codec_tickets);
        let engine = |v: &str| Config::default().with_env(env(&[("HOCCL_ENGINE", v)])).unwrap().engine;
        assert_eq!(engine("sm"), EngineChoice::Sm);
        assert_eq!(engine("compressed"), EngineChoice::Compressed);
        assert_eq!(engine("AUTO"), EngineChoice::Auto);
        assert_eq!(c.chunk_bytes, 8 << 20);
        assert_eq!(c.engine, EngineChoice::CopyEngine);
        assert_eq!(c.virtual_nodes, 2);
        assert_eq!(c.forwarding_peers, vec![1, 0, 3, 2]);
        assert_eq!(c.timeout, Duration::from_millis(1500));
        assert_eq!(Config::default().max_waiting_streams, None);
        let w = |v: &str| Config::default().with_env(env(&[("HOCCL_MAX_WAITING_STREAMS", v)])).unwrap().max_waiting_streams;
        assert_eq!(w("6"), Some(6));
        assert_eq!(w("0"), Some(usize::MAX));
        use crate::device::Backend;
        assert_eq!(Config::default().waiting_stream_limit(Backend::Host), usize::MAX);
        assert!(Config::default().waiting_stream_limit(Backend::Cuda) >= 1);
        let six = Config { max_waiting_streams: Some(6), ..Config::default() };
        assert_eq!(six.waiting_stream_limit(Backend::Cuda), 6);
        assert_eq!(six.waiting_stream_limit(Backend::Host), 6);
        assert_eq!(Config::default().serial_enqueue, None);
        let serial = |v: &str| Config::default().with_env(env(&[("HOCCL_SERIAL_ENQUEUE", v)])).unwrap().serial_enqueue;
        assert_eq!(serial("0"), Some(false));
        assert_eq!(serial("1"), Some(true));
        assert_eq!(serial("auto"), None);
        assert_eq!(Config::default().gated, Some(false));
        let gated = |v: &str| Config::default().with_env(env(&[("HOCCL_GATED", v)])).unwrap().gated;
        assert_eq!((gated("0"), gated("1"), gated("auto")), (Some(false), Some(true), None));
        assert_eq!((Config::default().staged_bytes, Config::default().staged_ring), (0, (8, 256 << 10)));
        let staged = Config::default().with_env(env(&[("HOCCL_STAGED_BYTES", "1M"), ("HOCCL_STAGED_RING", "4x64K")])).unwrap();
        assert_eq!((staged.staged_bytes, staged.staged_ring), (1 << 20, (4, 64 << 10)));
        staged.validate().unwrap();
        for bad in ["4", "x64K", "4x", "4x64Q"] {
            assert!(Config::default().with_env(env(&[("HOCCL_STAGED_RING", bad)])).is_err(), "{bad}");
        }
        for ring in [(0, 4096), (2, 1000), (2048, 4096)] {
            assert!(Config { staged_ring: ring, ..Config::default() }.validate().is_err(), "{ring:?}");
        }
        Config { staged_bytes: 16 << 12, staged_ring: (2, 4096), ..Config::default() }.validate().unwrap();
        let e = Config { staged_bytes: (16 << 12) + 1, staged_ring: (2, 4096), ..Config::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("exceeds 16 slots"), "{e}");
        assert_eq!(Config::default().reduce_ctas, None);
        let ctas = |v: &str| Config::default().with_env(env(&[("HOCCL_REDUCE_CTAS", v)])).unwrap().reduce_ctas;
        assert_eq!(ctas("66"), Some(66));
        assert_eq!(Config::default().reduce_scratch, 64 << 20);
        let scratch = Config::default().with_env(env(&[("HOCCL_REDUCE_SCRATCH", "8K")])).unwrap();
        assert_eq!(scratch.reduce_scratch, 8 << 10);
    }

    #[test]
    fn bad_values_are_errors() {
        for (k, v) in [
            ("HOCCL_CHUNK_BYTES", "12345"),
            ("HOCCL_CHUNK_BYTES", "4Q"),
            ("HOCCL_ENGINE", "warp"),
            ("HOCCL_COPY_QUEUES", "0"),
            ("HOCCL_VIRTUAL_NODES", "x"),
            ("HOCCL_TIMEOUT_MS", "0"),
            ("HOCCL_CODEC_TICKETS", "yes"),
            ("HOCCL_CODEC_SEGMENTS", "0"),
            ("HOCCL_CODEC_SEGMENTS", "65"),
            ("HOCCL_CODEC_SEGMENTS", "all"),
            ("HOCCL_MAX_WAITING_STREAMS", "-1"),
            ("HOCCL_SERIAL_ENQUEUE", "on"),
            ("HOCCL_GATED", "yes"),
            ("HOCCL_REDUCE_CTAS", "0"),
            ("HOCCL_REDUCE_CTAS", "many"),
            ("HOCCL_REDUCE_SCRATCH", "1K"),
            ("HOCCL_NET", "tcp"),
            ("HOCCL_NET_GBPS", "-1"),
            ("HOCCL_NET_GBPS", "fast"),
            ("HOCCL_NET_GBPS", "inf"),
            ("HOCCL_NET_STAGING", "4K"),
            ("HOCCL_FORWARDING", "yes"),
            ("HOCCL_FORWARD_BALANCE", "on"),
            ("HOCCL_FORWARD_STAGING", "16K"),
            ("HOCCL_QPS_PER_PEER", "0"),
            ("HOCCL_QPS_PER_PEER", "65"),
        ] {
            let e = Config::default().with_env(env(&[(k, v)])).unwrap_err();
            assert_eq!(e.code(), crate::error::ErrorCode::InvalidArgument, "{k}={v}");
        }
    }

    #[test]
    fn cost_model_from_env() {
        let m = |v: &str| Config::default().with_env(env(&[("HOCCL_COST_MODEL", v)])).map(|c| c.cost_model);
        assert_eq!(m("").unwrap(), CostModel::default());
        let inline = m("nvlink_gbps=100,bf16_ratio=0.7").unwrap();
        assert_eq!((inline.nvlink_gbps, inline.bf16.ratio), (100.0, 0.7));
        let path = std::env::temp_dir().join(format!("hoccl-cost-model-{}.txt", std::process::id()));
        std::fs::write(&path, "# calibrated here\npcie_gbps=25\nnic_gbps=12.5\n").unwrap();
        let file = m(path.to_str().unwrap()).unwrap();
        assert_eq!((file.pcie_gbps, file.nic_gbps), (25.0, 12.5));
        std::fs::write(&path, "pcie_gbps=-3\n").unwrap();
        let e = m(path.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("pcie_gbps"), "{e}");
        std::fs::remove_file(&path).unwrap();
        for bad in ["/nonexistent/hoccl-cost", "nvlink=3", "nvlink_gbps=x"] {
            let e = m(bad).unwrap_err();
            assert_eq!(e.code(), crate::error::ErrorCode::InvalidArgument, "{bad}");
            assert!(e.to_string().contains("HOCCL_COST_MODEL"), "{bad}: {e}");
        }
        let zero = Config { cost_model: CostModel { same_gpu_gbps: 0.0, ..CostModel::default() }, ..Config::default() };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn forwarding_settings() {
        let d = Config::default();
        assert_eq!((d.forwarding, d.forward_staging_bytes), (true, 16 << 20));
        let c = Config::default().with_env(env(&[("HOCCL_FORWARDING", "0"), ("HOCCL_FORWARD_STAGING", "1M")])).unwrap();
        assert_eq!((c.forwarding, c.forward_staging_bytes), (false, 1 << 20));
    }

    #[test]
    fn net_settings() {
        let d = Config::default();
        assert_eq!((d.net, d.net_gbps, d.net_staging_bytes, d.qps_per_peer), (NetChoice::Auto, 0.0, 16 << 20, 2));
        let c = Config::default()
            .with_env(env(&[("HOCCL_NET", "Socket"), ("HOCCL_NET_GBPS", "2.5"), ("HOCCL_NET_STAGING", "1M"), ("HOCCL_QPS_PER_PEER", "3")]))
            .unwrap();
        assert_eq!((c.net, c.net_gbps, c.net_staging_bytes, c.qps_per_peer), (NetChoice::Socket, 2.5, 1 << 20, 3));
        let net = |v: &str| Config::default().with_env(env(&[("HOCCL_NET", v)])).unwrap().net;
        assert_eq!(net("ib"), NetChoice::Ib);
        assert_eq!(net("auto"), NetChoice::Auto);
    }

    #[test]
    fn ib_settings() {
        let d = Config::default();
        assert_eq!((d.ib_hca.as_deref(), d.ib_gid_index, d.verbs_fake), (None, 3, false));
        let c = Config::default().with_env(env(&[("HOCCL_IB_HCA", " mlx5_1 "), ("HOCCL_IB_GID_INDEX", "1"), ("HOCCL_VERBS_FAKE", "1")])).unwrap();
        assert_eq!((c.ib_hca.as_deref(), c.ib_gid_index, c.verbs_fake), (Some("mlx5_1"), 1, true));
        assert!(Config::default().with_env(env(&[("HOCCL_IB_GID_INDEX", "256")])).is_err());
    }

    #[test]
    fn socket_ifname() {
        assert_eq!(Config::default().socket_ifname, None);
        let get = |v: &str| Config::default().with_env(env(&[("HOCCL_SOCKET_IFNAME", v)])).unwrap().socket_ifname;
        assert_eq!(get("^lo,docker").as_deref(), Some("^lo,docker"));
        assert_eq!(get(" eth0 ").as_deref(), Some("eth0"));
        assert_eq!(get(""), None);
    }
}

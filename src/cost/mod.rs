//! The cost model behind `HOCCL_ENGINE=auto` (docs/design.md, "Choosing the engine"): a
//! predicted time per engine for one call, from the link between the ranks, the copy
//! engine's fixed cost per op, the codec's throughput and expected ratio per dtype, and the
//! reduce kernel's throughput at its CTA count; [`choose`] picks the fastest.
//!
//! Every rank must pick the same engine for the same call (the engines differ on the wire),
//! so the inputs are only what all ranks share: the call's dtype, op and sizes, the link kind
//! (from the topology every rank builds alike), and the model (rank 0's, agreed at creation).
//! Nothing measured at run time on one rank enters a choice.
//!
//! Pure: no FFI, no I/O.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::topology::Topology;
use crate::types::DataType;
use std::fmt;

/// Transfers smaller than this move raw whatever the model says: the compressed engine's
/// own floor (`comm::compressed::MIN_BYTES`).
pub const MIN_COMPRESS_BYTES: usize = 64 << 10;

/// What connects two ranks, slowest last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkKind {
    /// Both ranks on one GPU (MPS, or threads of one process): a copy within HBM.
    SameGpu,
    /// Two GPUs of one node with peer access (NVLink on the machines measured).
    NvLink,
    /// Two GPUs of one host without peer access: through host memory over PCIe.
    Pcie,
    /// Different hosts: the NIC.
    Nic,
}

impl LinkKind {
    pub const ALL: [LinkKind; 4] = [LinkKind::SameGpu, LinkKind::NvLink, LinkKind::Pcie, LinkKind::Nic];
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::SameGpu => "same GPU",
            LinkKind::NvLink => "NVLink",
            LinkKind::Pcie => "PCIe",
            LinkKind::Nic => "NIC",
        }
    }
}

/// The link from `me` to each rank of `topo` (to itself: `SameGpu`). Ranks of different
/// nodes, virtual nodes of one host included, reach each other only through the NIC
/// transport, so their link is `Nic` whatever GPU they sit on. Symmetric (peer access must
/// hold both ways for `NvLink`), so both ends of a transfer see the same kind.
pub fn links(topo: &Topology, me: usize) -> Vec<LinkKind> {
    (0..topo.nranks())
        .map(|p| {
            if p == me {
                LinkKind::SameGpu
            } else if !topo.same_node(me, p) {
                LinkKind::Nic
            } else if topo.shares_gpu(me, p) {
                LinkKind::SameGpu
            } else if topo.peer_access(me, p) && topo.peer_access(p, me) {
                LinkKind::NvLink
            } else {
                LinkKind::Pcie
            }
        })
        .collect()
}

/// The engine a call runs on; `auto` resolves to one of these before any transfer is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// Copy engines, raw bytes (data movement).
    Ce,
    /// Reductions: raw exchange on the copy engines, the reduce step on SMs.
    Sm,
    /// The codec on SMs around the copy engines' moves (`comm::compressed`).
    Compressed,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Ce => "ce",
            Engine::Sm => "sm",
            Engine::Compressed => "compressed",
        }
    }
}

/// What kind of call: pure movement, or a reduction (exchange, reduce step, and for
/// AllReduce an AllGather of the shards).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    Movement,
    Reduction,
}

/// One call as the model sees it. Every field is the same on every rank for a collective
/// call (and on both ends for a point-to-point pair).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallShape {
    pub class: OpClass,
    pub dtype: DataType,
    /// Bytes of one transfer to one peer (the unit the compressed engine compresses).
    pub bytes: usize,
    /// Transfers this rank sends per phase (its peers in the call).
    pub transfers: usize,
    /// Exchange phases in sequence: 1, or 2 for AllReduce (reduce-scatter, then AllGather).
    pub phases: usize,
    /// Bytes the reduce step reads (0 for movement).
    pub reduce_read: usize,
}

/// The calls the model describes, by how their bytes move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// Send or receive: one transfer.
    PointToPoint,
    /// AllGather, AlltoAll(v), Broadcast, Gather, Scatter: `count` elements to or from each
    /// of the other ranks.
    FanOut,
    /// AllReduce of `count` elements: a reduce-scatter of shards, then their AllGather.
    AllReduce,
    /// ReduceScatter of `count` elements per rank.
    ReduceScatter,
    /// Reduce of `count` elements to a root.
    Reduce,
}

impl CallShape {
    /// The shape of a call of `count` elements of `dtype` over `ranks` ranks. A reduction's
    /// exchange moves at most one scratch slot (`reduce_scratch / ranks`) per transfer.
    pub fn of(kind: CallKind, dtype: DataType, count: usize, ranks: usize, reduce_scratch: usize) -> CallShape {
        let n = ranks.max(1);
        let bytes = count.saturating_mul(dtype.size());
        let slot = (reduce_scratch / n).max(1);
        let (class, bytes, transfers, phases, reduce_read) = match kind {
            CallKind::PointToPoint => (OpClass::Movement, bytes, 1, 1, 0),
            CallKind::FanOut => (OpClass::Movement, bytes, n - 1, 1, 0),
            CallKind::AllReduce => (OpClass::Reduction, (bytes / n).min(slot), n - 1, 2, bytes),
            CallKind::ReduceScatter => (OpClass::Reduction, bytes.min(slot), n - 1, 1, bytes.saturating_mul(n)),
            CallKind::Reduce => (OpClass::Reduction, bytes.min(slot), 1, 1, bytes.saturating_mul(n)),
        };
        CallShape { class, dtype, bytes, transfers, phases, reduce_read }
    }
}

/// Throughput (GB/s of uncompressed bytes) and expected ratio of the codec for one dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CodecCost {
    pub compress_gbps: f64,
    pub decompress_gbps: f64,
    /// Compressed bytes / raw bytes expected for data of this dtype.
    pub ratio: f64,
}

/// The calibrated constants. [`Default`] holds the H200 figures; each field's comment cites
/// the file of `docs/results` it was read from. GB/s are 1e9 bytes per second.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// `ce_fixed_us`: a copy-engine op's fixed cost (stream handshake, proxy): 7.2 µs, one
    /// rank, sendrecv 4 KiB (docs/results/h200-1gpu/latency.log).
    pub ce_fixed_us: f64,
    /// `same_gpu_gbps`: device-to-device copy, 2131 GB/s at 1 GiB (h200-1gpu/latency.log).
    pub same_gpu_gbps: f64,
    /// `nvlink_gbps`: sendrecv between two H200 over NVLink, 299 GB/s at 512 MiB
    /// (docs/results/h200-2gpu/bench_table.log).
    pub nvlink_gbps: f64,
    /// `pcie_gbps`: pinned host memory to or from a GPU, 55 GB/s (the topology's
    /// `Bandwidths::host_link`, measured on the H200 host).
    pub pcie_gbps: f64,
    /// `nic_gbps`: 50 GB/s, a 400 Gb/s NIC per GPU (nominal: no inter-node path exists to
    /// measure).
    pub nic_gbps: f64,
    /// `compress_fixed_us`: one compress launch back to back, 8.4 µs at 32 KiB
    /// (h200-1gpu/codec-bench-bf16.json, 3.9 GB/s there).
    pub compress_fixed_us: f64,
    /// `decompress_fixed_us`: one decompress launch, 7.8 µs at 32 KiB (same file, 4.2 GB/s).
    pub decompress_fixed_us: f64,
    /// `bf16_*`: 1600 / 2018 GB/s at 256 MiB on the MiniLM weight fixture, ratio 0.679
    /// (h200-1gpu/codec-bench-fixture.json).
    pub bf16: CodecCost,
    /// `f16_*`: 1234 / 1401 GB/s at 256 MiB (h200-1gpu/codec-bench-f16.json); ratio 0.881,
    /// the real fp16 activations (docs/codec.md, "Measured").
    pub f16: CodecCost,
    /// `f32_*`: 1654 / 1894 GB/s at 256 MiB (h200-1gpu/codec-bench-f32.json); ratio 0.840,
    /// the real fp32 weights (docs/codec.md, "Measured").
    pub f32: CodecCost,
    /// `reduce_gbps`: the CopyReduce kernel's read rate at its default CTA count, 2346 GB/s
    /// (132 CTAs, h200-1gpu/reduce_kernels.json).
    pub reduce_gbps: f64,
    /// `reduce_gbps_per_cta`: its rate per CTA below saturation, 19.5 GB/s (8 CTAs: 155.9
    /// GB/s, same file); with `HOCCL_REDUCE_CTAS=c` the rate is min(reduce_gbps, c × this).
    pub reduce_gbps_per_cta: f64,
    /// `reduce_fixed_us`: one reduce launch; not measured apart, taken as the codec's
    /// per-launch figure (8 µs). It is common to both engines of a reduction, so it never
    /// changes a choice.
    pub reduce_fixed_us: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            ce_fixed_us: 7.2,
            same_gpu_gbps: 2131.0,
            nvlink_gbps: 299.0,
            pcie_gbps: 55.0,
            nic_gbps: 50.0,
            compress_fixed_us: 8.4,
            decompress_fixed_us: 7.8,
            bf16: CodecCost { compress_gbps: 1600.0, decompress_gbps: 2018.0, ratio: 0.679 },
            f16: CodecCost { compress_gbps: 1234.0, decompress_gbps: 1401.0, ratio: 0.881 },
            f32: CodecCost { compress_gbps: 1654.0, decompress_gbps: 1894.0, ratio: 0.840 },
            reduce_gbps: 2346.0,
            reduce_gbps_per_cta: 19.5,
            reduce_fixed_us: 8.0,
        }
    }
}

const KEYS: &str = "ce_fixed_us, same_gpu_gbps, nvlink_gbps, pcie_gbps, nic_gbps, compress_fixed_us, decompress_fixed_us, \
{bf16,f16,f32}_{compress_gbps,decompress_gbps,ratio}, reduce_gbps, reduce_gbps_per_cta, reduce_fixed_us";

impl CostModel {
    /// The codec's figures for `dtype`, None for a dtype the codec does not handle.
    pub fn codec(&self, dtype: DataType) -> Option<&CodecCost> {
        match dtype {
            DataType::BF16 => Some(&self.bf16),
            DataType::F16 => Some(&self.f16),
            DataType::F32 => Some(&self.f32),
            _ => None,
        }
    }

    /// GB/s of `link`.
    /// The model with the NIC's rate set to the transport's limit: `gbps` GB/s
    /// (`HOCCL_NET_GBPS`) when it is positive, so that `auto` weighs the rate the bytes
    /// between nodes actually get; unchanged for 0 (no limit).
    pub fn with_net_rate(mut self, gbps: f64) -> CostModel {
        if gbps > 0.0 && gbps.is_finite() {
            self.nic_gbps = gbps;
        }
        self
    }

    pub fn link_gbps(&self, link: LinkKind) -> f64 {
        match link {
            LinkKind::SameGpu => self.same_gpu_gbps,
            LinkKind::NvLink => self.nvlink_gbps,
            LinkKind::Pcie => self.pcie_gbps,
            LinkKind::Nic => self.nic_gbps,
        }
    }

    /// The reduce kernel's read rate (GB/s) at `ctas` CTAs (None: its default count).
    pub fn reduce_rate(&self, ctas: Option<usize>) -> f64 {
        match ctas {
            Some(c) => self.reduce_gbps.min(c as f64 * self.reduce_gbps_per_cta),
            None => self.reduce_gbps,
        }
    }

    fn fields(&self) -> Vec<(String, f64)> {
        let mut v: Vec<(String, f64)> = vec![
            ("ce_fixed_us".into(), self.ce_fixed_us),
            ("same_gpu_gbps".into(), self.same_gpu_gbps),
            ("nvlink_gbps".into(), self.nvlink_gbps),
            ("pcie_gbps".into(), self.pcie_gbps),
            ("nic_gbps".into(), self.nic_gbps),
            ("compress_fixed_us".into(), self.compress_fixed_us),
            ("decompress_fixed_us".into(), self.decompress_fixed_us),
        ];
        for (name, c) in [("bf16", &self.bf16), ("f16", &self.f16), ("f32", &self.f32)] {
            v.push((format!("{name}_compress_gbps"), c.compress_gbps));
            v.push((format!("{name}_decompress_gbps"), c.decompress_gbps));
            v.push((format!("{name}_ratio"), c.ratio));
        }
        v.push(("reduce_gbps".into(), self.reduce_gbps));
        v.push(("reduce_gbps_per_cta".into(), self.reduce_gbps_per_cta));
        v.push(("reduce_fixed_us".into(), self.reduce_fixed_us));
        v
    }

    fn field_mut(&mut self, key: &str) -> Option<&mut f64> {
        Some(match key {
            "ce_fixed_us" => &mut self.ce_fixed_us,
            "same_gpu_gbps" => &mut self.same_gpu_gbps,
            "nvlink_gbps" => &mut self.nvlink_gbps,
            "pcie_gbps" => &mut self.pcie_gbps,
            "nic_gbps" => &mut self.nic_gbps,
            "compress_fixed_us" => &mut self.compress_fixed_us,
            "decompress_fixed_us" => &mut self.decompress_fixed_us,
            "bf16_compress_gbps" => &mut self.bf16.compress_gbps,
            "bf16_decompress_gbps" => &mut self.bf16.decompress_gbps,
            "bf16_ratio" => &mut self.bf16.ratio,
            "f16_compress_gbps" => &mut self.f16.compress_gbps,
            "f16_decompress_gbps" => &mut self.f16.decompress_gbps,
            "f16_ratio" => &mut self.f16.ratio,
            "f32_compress_gbps" => &mut self.f32.compress_gbps,
            "f32_decompress_gbps" => &mut self.f32.decompress_gbps,
            "f32_ratio" => &mut self.f32.ratio,
            "reduce_gbps" => &mut self.reduce_gbps,
            "reduce_gbps_per_cta" => &mut self.reduce_gbps_per_cta,
            "reduce_fixed_us" => &mut self.reduce_fixed_us,
            _ => return None,
        })
    }

    /// This model with the overrides of `spec`: `key=value` pairs separated by commas,
    /// whitespace or newlines (`#` starts a comment to the end of its line), keys as in the
    /// fields' comments. An unknown key, a value that is not a number, a negative or
    /// non-finite value, a zero rate, or a ratio outside (0, 2] is an error naming it.
    pub fn with_overrides(mut self, spec: &str) -> Result<CostModel> {
        const OP: &str = "HOCCL_COST_MODEL";
        for line in spec.lines() {
            let line = line.split('#').next().unwrap_or("");
            for item in line.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()) {
                let Some((k, v)) = item.split_once('=') else {
                    return Err(Error::invalid_arg(OP, format!("{item:?}: want key=value (keys: {KEYS})")));
                };
                let k = k.trim().to_ascii_lowercase();
                let x: f64 = v.trim().parse().map_err(|_| Error::invalid_arg(OP, format!("{k}={v}: not a number")))?;
                let Some(slot) = self.field_mut(&k) else {
                    return Err(Error::invalid_arg(OP, format!("unknown key {k:?} (keys: {KEYS})")));
                };
                *slot = x;
            }
        }
        self.validate()?;
        Ok(self)
    }

    /// Reject values the model cannot use.
    pub fn validate(&self) -> Result<()> {
        for (k, x) in self.fields() {
            let bad = if !x.is_finite() || x < 0.0 {
                Some("must be a finite number >= 0")
            } else if k.ends_with("_ratio") && (x <= 0.0 || x > 2.0) {
                Some("must be in (0, 2]")
            } else if k.ends_with("_gbps") && x <= 0.0 {
                Some("must be > 0")
            } else {
                None
            };
            if let Some(why) = bad {
                return Err(Error::invalid_arg("HOCCL_COST_MODEL", format!("{k}={x}: {why}")));
            }
        }
        Ok(())
    }

    /// The model as one `key=value,...` line that [`with_overrides`](Self::with_overrides)
    /// reads back to an equal model (what `hoccl-info --calibrate` prints, and what rank 0
    /// sends the others at creation).
    pub fn to_spec(&self) -> String {
        self.fields().iter().map(|(k, x)| format!("{k}={x}")).collect::<Vec<_>>().join(",")
    }
}

impl fmt::Display for CostModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_spec())
    }
}

/// Predicted microseconds of one call on each engine that can run it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// `ce` (movement) or `sm` (reduction): raw bytes on the copy engines.
    pub raw_us: f64,
    /// `compressed`; None where it cannot apply (dtype without codec, transfers below
    /// [`MIN_COMPRESS_BYTES`]).
    pub compressed_us: Option<f64>,
}

/// Microseconds of one transfer of `bytes` over `link`: raw, and compressed.
fn transfer_us(m: &CostModel, c: Option<&CodecCost>, link: LinkKind, bytes: usize) -> (f64, Option<f64>) {
    // GB/s = 1e3 bytes per µs.
    let b = bytes as f64 / 1e3;
    let l = m.link_gbps(link);
    let raw = b / l;
    let comp = c.filter(|_| bytes >= MIN_COMPRESS_BYTES).map(|c| {
        m.compress_fixed_us + b / c.compress_gbps + b * c.ratio / l + m.decompress_fixed_us + b / c.decompress_gbps
    });
    (raw, comp)
}

/// Whether one transfer of `bytes` of `dtype` over `link` is predicted faster compressed:
///
/// `bytes/link > compress_fixed + bytes/compress + bytes·ratio/link + decompress_fixed + bytes/decompress`
///
/// (the copy engine's fixed cost is paid either way). Both ends of a transfer evaluate this
/// on the same values, so they agree.
pub fn compressed_wins(m: &CostModel, dtype: DataType, link: LinkKind, bytes: usize) -> bool {
    match transfer_us(m, m.codec(dtype), link, bytes) {
        (raw, Some(comp)) => comp < raw,
        _ => false,
    }
}

/// The smallest transfer (bytes) that [`compressed_wins`] for `dtype` over `link`, None if
/// none up to 2^50 bytes does. The prediction is linear in the size, so every larger
/// transfer wins too; this is the rule `auto` applies per transfer.
pub fn compress_threshold(m: &CostModel, dtype: DataType, link: LinkKind) -> Option<usize> {
    let (mut lo, mut hi) = (MIN_COMPRESS_BYTES, 1usize << 50);
    if !compressed_wins(m, dtype, link, hi) {
        return None;
    }
    if compressed_wins(m, dtype, link, lo) {
        return Some(lo);
    }
    // Invariant: lo loses, hi wins.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if compressed_wins(m, dtype, link, mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

/// Predicted time of `call` over `link` on each engine. `reduce_ctas`: the CopyReduce
/// kernel's CTA count (None: its default).
pub fn predict(m: &CostModel, call: &CallShape, link: LinkKind, reduce_ctas: Option<usize>) -> Prediction {
    let (raw, comp) = transfer_us(m, m.codec(call.dtype), link, call.bytes);
    let t = call.transfers as f64;
    let phases = call.phases.max(1) as f64;
    let reduce = match call.class {
        OpClass::Reduction if call.reduce_read > 0 => m.reduce_fixed_us + call.reduce_read as f64 / 1e3 / m.reduce_rate(reduce_ctas),
        _ => 0.0,
    };
    let total = |per_transfer: f64| phases * (m.ce_fixed_us + t * per_transfer) + reduce;
    Prediction { raw_us: total(raw), compressed_us: comp.filter(|_| call.transfers > 0).map(total) }
}

/// The engine for `call` over `link`: movement runs on `ce` and reductions on `sm` unless
/// the compressed engine is predicted faster (per transfer, [`compressed_wins`]).
pub fn choose(m: &CostModel, call: &CallShape, link: LinkKind) -> Engine {
    let raw = match call.class {
        OpClass::Movement => Engine::Ce,
        OpClass::Reduction => Engine::Sm,
    };
    if call.transfers > 0 && compressed_wins(m, call.dtype, link, call.bytes) {
        Engine::Compressed
    } else {
        raw
    }
}

/// Per communicator: the smallest transfer to each peer that crosses compressed, by dtype
/// (`usize::MAX`: never), resolved once at creation from the engine setting, the model and
/// the link to each peer. The compressed engine reads it per transfer, so the two ends of
/// a transfer always agree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompressFrom {
    /// Indexed by codec dtype (bf16, f16, f32), then by peer rank.
    by_dtype: [Vec<usize>; 3],
}

impl CompressFrom {
    /// Nothing is compressed (`ce`, `sm`).
    pub fn never(ranks: usize) -> CompressFrom {
        CompressFrom { by_dtype: [vec![usize::MAX; ranks], vec![usize::MAX; ranks], vec![usize::MAX; ranks]] }
    }

    /// Every transfer to a peer from [`MIN_COMPRESS_BYTES`] on (`compressed`).
    pub fn always(me: usize, ranks: usize) -> CompressFrom {
        let row: Vec<usize> = (0..ranks).map(|p| if p == me { usize::MAX } else { MIN_COMPRESS_BYTES }).collect();
        CompressFrom { by_dtype: [row.clone(), row.clone(), row] }
    }

    /// Where the model says so (`auto`); `links[p]` is the link to rank p.
    pub fn by_model(m: &CostModel, me: usize, links: &[LinkKind]) -> CompressFrom {
        let row = |dt| links.iter().enumerate().map(|(p, &l)| if p == me { usize::MAX } else { compress_threshold(m, dt, l).unwrap_or(usize::MAX) }).collect();
        CompressFrom { by_dtype: [row(DataType::BF16), row(DataType::F16), row(DataType::F32)] }
    }

    /// Per peer, the smallest transfer of `dtype` that crosses compressed; None when no
    /// transfer of `dtype` does.
    pub fn for_dtype(&self, dtype: DataType) -> Option<&[usize]> {
        let row = match dtype {
            DataType::BF16 => &self.by_dtype[0],
            DataType::F16 => &self.by_dtype[1],
            DataType::F32 => &self.by_dtype[2],
            _ => return None,
        };
        row.iter().any(|&x| x != usize::MAX).then_some(row.as_slice())
    }
}

#[cfg(test)]
mod tests;

//! AllReduce, ReduceScatter and Reduce as a composition of the copy-engine exchange and one
//! reduce step on the caller's stream (docs/design.md, "Reductions"). The exchange is an
//! engine op like any other, so it crosses nodes through whichever transport reaches each
//! peer (the socket transport between nodes). Across nodes, Sum, Prod, Max and Min run the
//! hierarchical plan instead ([`Communicator::run_hierarchical`]: within each node, then
//! node after node in a chain that keeps the rank-order fold); what follows is the flat
//! plan, which every other reduction runs.
//!
//! Every reduction is described the same way: each rank `q` owns one *block* of the result
//! (ReduceScatter: `count` elements; AllReduce: its shard; Reduce: the root owns all of it,
//! the others nothing), and every rank contributes the matching range of its send buffer.
//! In chunks of at most one scratch slot:
//!
//! 1. **Exchange** (one engine op, the stream handshake): every rank copies its contribution
//!    to block `q` into slot `rank` of rank q's scratch; its own contribution stays in place.
//! 2. **Reduce step** (`Device::reduce_async` on the caller's stream, after the exchange's
//!    finish wait): the block is the fold, in rank order 0..n-1, of slot p for p != rank and
//!    the own contribution read in place. So every rank's block is computed from the same
//!    inputs in the same order on every engine, bit for bit `reduce::reduce_into`.
//!
//! AllReduce then runs one copy-engine AllGather of the shards into `recv`.
//!
//! **Compressed engine.** When the exchange crosses compressed, the peers' contributions
//! arrive as codec streams in the stream's staging buffer and the reduce step is one launch
//! of the fused decompress + reduce kernel over them (peers in rank order, the own
//! contribution raw at position `rank`): the same fold, with no decompressed copy in the
//! scratch. Where one launch cannot do it (more than `MAX_FUSED_INPUTS` peers, the host
//! backend) the plan decompresses into the scratch slots and the step runs as above.
//! AllReduce's steps also code the shard for the AllGather in the same kernel
//! (decompress + reduce + compress, one stream over the shard's chunks, which must then end
//! on codec blocks), and the AllGather sends that stream instead of compressing the shard
//! again (`Communicator::drc_unfit` says when not).
//!
//! **Scratch.** One allocation per communicator, `n` slots of `Config::reduce_scratch / n`
//! bytes (rounded down to 256), allocated at the first reduction that receives (or by
//! [`Communicator::reserve_reduce_scratch`]) and freed at destroy. Peers write into a slot only
//! after this rank's `Ready` for the exchange, which its proxy sends only once the stream
//! has reached the op, i.e. after the previous reduce step on that stream has read the
//! scratch. A reduction on another stream first waits (a stream memory wait) for a flag that
//! each reduce step raises when it is done, so reduce steps that share the scratch never
//! overlap with the next exchange whatever the streams.
use super::op::{Collective, OpDesc};
use super::{Communicator, Region, State};
use crate::device::{DevPtr, FlagSlab, StreamHandle};
use crate::error::{Error, Result};
use crate::reduce::RedOp;
use crate::types::DataType;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// First element of AllReduce shard `r` of `count` elements over `n` ranks: `r * count / n`
/// rounded down to a multiple of 256 bytes' worth of elements (shard `n` starts at `count`).
/// Shards are contiguous and cover `[0, count)`; some are empty when `count` is small.
pub fn shard_start(count: usize, n: usize, r: usize, dtype: DataType) -> usize {
    if r >= n {
        return count;
    }
    let align = (256 / dtype.size()).max(1);
    let x = (r as u128 * count as u128 / n as u128) as usize;
    x / align * align
}

/// Bytes of one scratch slot for `n` ranks: `scratch / n`, rounded down to 256 bytes (to 8
/// below 256 bytes, at least 8), so a slot holds a whole number of elements of any type.
fn slot_bytes(scratch: usize, n: usize) -> usize {
    let s = scratch / n.max(1);
    if s >= 256 {
        s & !255
    } else {
        (s & !7).max(8)
    }
}

/// An AllReduce's shard being coded by its reduce steps for the AllGather (`drc_begin`).
struct Drc {
    out_dtype: crate::compress::Dtype,
    out: crate::compress::fused::DrcOut,
    /// The stream's bound: the transfer's length on both ends.
    cap: usize,
    alloc: crate::device::Allocation,
    words: std::sync::Arc<FlagSlab>,
    workspace: (DevPtr, usize),
}

/// What kind of reduction, with its arguments.
#[derive(Clone, Copy, Debug)]
enum Kind {
    AllReduce,
    ReduceScatter,
    Reduce { root: usize },
}

/// A validated reduction, ready to run (now, or at the end of the open group).
#[derive(Clone, Copy)]
pub(super) struct Reduction {
    pub(super) name: &'static str,
    kind: Kind,
    pub(super) op: RedOp,
    pub(super) dtype: DataType,
    /// Elements of the result: AllReduce and Reduce `count`, ReduceScatter `recvcount`.
    count: usize,
    send: Region,
    /// The receive buffer (AllReduce, ReduceScatter; Reduce on the root); None otherwise.
    recv: Option<Region>,
    pub(super) stream: StreamHandle,
}

/// The per-communicator scratch and the flag its reduce steps raise.
pub(super) use super::guard::Guarded as Scratch;

fn overlaps(a: DevPtr, alen: usize, b: DevPtr, blen: usize) -> bool {
    alen > 0 && blen > 0 && a.0 < b.0 + blen as u64 && b.0 < a.0 + alen as u64
}

/// Inputs of one reduce launch (the CUDA CopyReduce kernel's limit).
use crate::device::cuda::MAX_REDUCE_SRCS;

/// The hierarchical plan cuts a reduction into at least this many chunks...
const PIPELINE_CHUNKS: usize = 8;
/// ...of at least this many bytes each (a chunk costs a few op handshakes per hop).
const PIPELINE_MIN_BYTES: usize = 1 << 20;

/// Elements `[a, b)` of a reduction's index space.
type Span = (usize, usize);

/// Elements of a reduction's index space: ReduceScatter's send buffer, else `count`.
fn total_of(red: &Reduction, n: usize) -> usize {
    match red.kind {
        Kind::ReduceScatter => n * red.count,
        _ => red.count,
    }
}

fn meet(x: Span, y: Span) -> Option<Span> {
    let (a, b) = (x.0.max(y.0), x.1.min(y.1));
    (a < b).then_some((a, b))
}

fn width(x: Span) -> usize {
    x.1 - x.0
}

/// The nodes of a hierarchical reduction (contiguous rank ranges, in rank order) and where
/// each rank's piece of a chunk lies.
struct Chain<'a> {
    bounds: &'a [usize],
    dtype: DataType,
    /// Per node, ascending: the ranks that own its pieces ([`Communicator::piece_owners`]).
    owners: Vec<Vec<usize>>,
}

impl Chain<'_> {
    fn nodes(&self) -> usize {
        self.bounds.len() - 1
    }
    fn node_of(&self, r: usize) -> usize {
        self.bounds.partition_point(|b| *b <= r) - 1
    }
    fn ranks(&self, j: usize) -> std::ops::Range<usize> {
        self.bounds[j]..self.bounds[j + 1]
    }
    /// Rank r's piece of chunk `c`: its node splits the chunk into one shard per owner as
    /// AllReduce splits a buffer into shards ([`shard_start`]); a rank that owns none has
    /// an empty piece. Nodes with different owner counts split it differently, so a piece
    /// meets one or more pieces of another node.
    fn piece(&self, r: usize, c: Span) -> Span {
        let own = &self.owners[self.node_of(r)];
        let Some(l) = own.iter().position(|x| *x == r) else { return (c.0, c.0) };
        let (k, len) = (own.len(), width(c));
        (c.0 + shard_start(len, k, l, self.dtype), c.0 + shard_start(len, k, l + 1, self.dtype))
    }
}

impl Communicator {
    /// Validate a reduction (`enqueue`'s arm for AllReduce, ReduceScatter and Reduce).
    pub(super) fn reduction(&self, name: &'static str, op: &OpDesc) -> Result<Reduction> {
        let (kind, rop) = match op.coll {
            Collective::AllReduce { op } => (Kind::AllReduce, op),
            Collective::ReduceScatter { op } => (Kind::ReduceScatter, op),
            Collective::Reduce { op, root } => {
                self.check_root(name, root)?;
                (Kind::Reduce { root }, op)
            }
            _ => return Err(Error::internal(name, "not a reduction")),
        };
        let len = Self::bytes(name, op.count, op.dtype)?;
        if let RedOp::PreMulSum(crate::reduce::Scalar::Device(p)) = rop {
            // The reduce step reads it when it runs: it must be device memory of this GPU.
            self.region(name, "PreMulSum scalar", DevPtr(p), op.dtype.size())?;
        }
        let (send, recv) = match kind {
            Kind::AllReduce => {
                let r = self.region(name, "receive", op.recv, len)?;
                if op.send == op.recv {
                    (r, Some(r))
                } else if overlaps(op.send, len, op.recv, len) {
                    return Err(Error::invalid_arg(name, "send and receive buffers partially overlap (in place is send == recv)"));
                } else {
                    (self.region(name, "send", op.send, len)?, Some(r))
                }
            }
            Kind::ReduceScatter => {
                let total = self.total(name, len)?;
                let s = self.region(name, "send", op.send, total)?;
                let own = op.send.add(self.rank * len);
                if op.recv == own {
                    (s, Some(s.sub(self.rank * len, len)?))
                } else if overlaps(op.send, total, op.recv, len) {
                    return Err(Error::invalid_arg(name, "receive buffer overlaps the send buffer but is not this rank's block (in place is recv == send + rank * recvcount)"));
                } else {
                    (s, Some(self.region(name, "receive", op.recv, len)?))
                }
            }
            Kind::Reduce { root } if root == self.rank => {
                let r = self.region(name, "receive", op.recv, len)?;
                if op.send == op.recv {
                    (r, Some(r))
                } else if overlaps(op.send, len, op.recv, len) {
                    return Err(Error::invalid_arg(name, "send and receive buffers partially overlap (in place is the root's send == recv)"));
                } else {
                    (self.region(name, "send", op.send, len)?, Some(r))
                }
            }
            Kind::Reduce { .. } => (self.region(name, "send", op.send, len)?, None),
        };
        Ok(Reduction { name, kind, op: rop, dtype: op.dtype, count: op.count, send, recv, stream: op.stream })
    }

    /// Rank q's block of the result: its first element in `send` and its length (elements).
    fn block(&self, red: &Reduction, q: usize) -> (usize, usize) {
        let n = self.size;
        match red.kind {
            Kind::AllReduce => {
                let s = shard_start(red.count, n, q, red.dtype);
                (s, shard_start(red.count, n, q + 1, red.dtype) - s)
            }
            Kind::ReduceScatter => (q * red.count, red.count),
            Kind::Reduce { root } => (0, if q == root { red.count } else { 0 }),
        }
    }

    /// Allocate the scratch now, if this communicator has none yet (it is otherwise
    /// allocated by the first reduction that needs it). Several ranks that are threads of
    /// one process on one GPU should call this right after creation: allocating while
    /// another rank's collective is pending can wait for that rank's stream (docs/design.md,
    /// "Several ranks in one process on one GPU").
    /// With one rank there is no exchange and nothing is allocated.
    pub fn reserve_reduce_scratch(&self) -> Result<()> {
        let mut st = self.lock("reserve_reduce_scratch")?;
        if self.size == 1 {
            return Ok(());
        }
        self.scratch(&mut st, "reserve_reduce_scratch").map(|_| ())
    }

    fn scratch<'s>(&self, st: &'s mut State, name: &'static str) -> Result<&'s mut Scratch> {
        if st.scratch.is_none() {
            let slot = slot_bytes(self.config.reduce_scratch, self.size);
            let len = slot * self.size;
            let (base, region, flag) = self.alloc_guarded(name, "reduction", "scratch", len)?;
            log::debug!("rank {}: reduction scratch of {len} bytes ({} slots of {slot})", self.rank, self.size);
            st.scratch = Some(Scratch { base, region, slot, flag, uses: 0, last: None });
        }
        st.scratch.as_mut().ok_or_else(|| Error::internal(name, "scratch vanished"))
    }

    /// Run `red` on its stream: every chunk's exchange and reduce step, then (AllReduce) the
    /// AllGather of the shards. A failure after the first op was submitted also becomes the
    /// communicator's asynchronous error: the peers' matching ops cannot complete.
    pub(super) fn run_reduction(&self, st: &mut State, red: &Reduction) -> Result<()> {
        if self.config.engine == crate::config::EngineChoice::CopyEngine && !self.ce_reduce_logged.swap(true, Ordering::Relaxed) {
            log::debug!("HOCCL_ENGINE=ce: reductions move their data on the copy engines, but their reduce step always runs on the device (a kernel on CUDA)");
        }
        // Decided once before any step: a reduction over peers is recorded whole or not at all.
        if self.capturing(red.name, red.stream, self.size > 1 && red.count > 0)? {
            return self.capture_reduction(st, red, self.captured_slot(red));
        }
        let (mut submitted, mut logged) = (false, false);
        let r = self.run_reduction_steps(st, red, None, &mut submitted, &mut logged);
        if let (Err(e), true) = (&r, submitted) {
            self.engine.shared.set_error(e.clone());
        }
        r
    }

    /// A captured reduction's scratch slot: the largest block, rounded up to 256 bytes,
    /// within the communicator's slot size (the same on every rank: the blocks are).
    pub(super) fn captured_slot(&self, red: &Reduction) -> usize {
        let most = (0..self.size).map(|q| self.block(red, q).1).max().unwrap_or(0) * red.dtype.size();
        slot_bytes(self.config.reduce_scratch, self.size).min(most.div_ceil(256).max(1) * 256)
    }

    /// The flat plan of a reduction being captured (`capture.rs`): its scratch is `region`
    /// (slots of `slot` bytes), owned by the graph, so no other stream's reduce step shares
    /// it and no "step done" flag orders them.
    pub(super) fn run_reduction_captured(&self, st: &mut State, red: &Reduction, region: Region, slot: usize) -> Result<()> {
        let (mut submitted, mut logged) = (false, false);
        self.run_reduction_steps(st, red, Some((region, slot)), &mut submitted, &mut logged)
    }

    /// `captured`: a captured reduction's scratch and slot size, instead of the communicator's.
    /// `logged`: whether this reduction said at debug how its compressed reduce steps run.
    fn run_reduction_steps(&self, st: &mut State, red: &Reduction, captured: Option<(Region, usize)>, submitted: &mut bool, logged: &mut bool) -> Result<()> {
        let (n, me, es, name, s) = (self.size, self.rank, red.dtype.size(), red.name, red.stream);
        if red.count == 0 {
            return Ok(());
        }
        match self.node_chain(red.op) {
            Ok(bounds) if captured.is_none() => {
                log::debug!("rank {me}: {name} ({}, {}): hierarchical over {} nodes, pieces on ranks {:?}", red.dtype.name(), red.op.name(), bounds.len() - 1, self.piece_owners(&bounds));
                return self.run_hierarchical(st, red, &bounds, submitted);
            }
            Ok(_) => return Err(Error::internal(name, "a captured reduction reached the hierarchical plan")),
            Err(Some(why)) => log::debug!("rank {me}: {name} ({}, {}): flat across nodes: {why}", red.dtype.name(), red.op.name()),
            Err(None) => {}
        }
        let blocks: Vec<(usize, usize)> = (0..n).map(|q| self.block(red, q)).collect();
        let (my_off, my_len) = blocks[me];
        // The reduce step needs its inputs and output aligned to the value size (a kernel on
        // CUDA); a user buffer that is not goes through this rank's own scratch slot, which
        // no peer writes, by a plain copy (offsets within a buffer are whole elements, so one
        // check per buffer holds for every chunk).
        let misaligned = |p: DevPtr| p.0 % es as u64 != 0;
        let stage = my_len > 0 && red.recv.is_some_and(|r| misaligned(r.ptr) || misaligned(red.send.ptr));
        // Elements per chunk: one scratch slot; with one rank nothing is exchanged, so the
        // whole block is one reduce step (unless it is staged).
        let cap = match captured {
            Some((_, slot)) => slot / es,
            None if n == 1 && !stage => red.count,
            None => slot_bytes(self.config.reduce_scratch, n) / es,
        };
        let chunks = blocks.iter().map(|b| b.1.div_ceil(cap)).max().unwrap_or(0);
        // Receives into the scratch only where this rank owns a block and has peers.
        let receives = n > 1 && my_len > 0;
        let scratch = match captured {
            _ if !receives && !stage => None,
            Some((region, _)) => Some(region),
            None => Some(self.scratch(st, name)?.region),
        };
        let slot = match captured {
            Some((_, slot)) => slot,
            None => st.scratch.as_ref().map_or(0, |x| x.slot),
        };
        // AllReduce on the compressed engine: the reduce steps also code the shard for the
        // AllGather (decompress + reduce + compress), when they can.
        let drc = match self.drc_unfit(red, captured.is_some(), my_len, cap, chunks) {
            Ok(cdt) => Some(self.drc_begin(st, red, cdt, (my_off, my_len), cap).map_err(|e| e.with_op(name))?),
            Err(why) => {
                if let Some(w) = why.filter(|_| !*logged) {
                    log::debug!("rank {me}: {name} ({}): the AllGather compresses the shard again: {w}", red.dtype.name());
                }
                None
            }
        };
        for k in 0..chunks {
            let part = |len: usize| len.saturating_sub(k * cap).min(cap);
            let mut sends = Vec::new();
            for (q, &(off, len)) in blocks.iter().enumerate() {
                if q != me && len > 0 {
                    sends.push(red.send.part((off + k * cap) * es, part(len) * es, q)?);
                }
            }
            let mine = part(my_len);
            let mut recvs = Vec::new();
            if let (Some(sc), true) = (&scratch, receives) {
                for p in (0..n).filter(|p| *p != me) {
                    recvs.push(sc.part(p * slot, mine * es, p)?);
                }
            }
            let exchanges = !sends.is_empty() || !recvs.is_empty();
            if mine > 0 && (stage || receives && exchanges) && captured.is_none() {
                self.wait_for_scratch(st, s).map_err(|e| e.with_op(name))?;
            }
            // Under the compressed engine the exchange's plan holds the received streams;
            // they are decompressed below, by the fused kernel or by `finish`.
            let plan = if exchanges {
                let p = self.launch_op(st, name, s, Some(red.dtype), sends, recvs, None)?;
                *submitted = true;
                p
            } else {
                None
            };
            let recv = match (&red.recv, mine) {
                (Some(r), 1..) => r,
                _ => {
                    if let Some(p) = &plan {
                        p.finish(self.dev.as_ref(), s).map_err(|e| e.with_op(name))?;
                    }
                    continue;
                }
            };
            let own = red.send.ptr.add((my_off + k * cap) * es);
            let dst = recv.ptr.add(k * cap * es);
            // The AllReduce result is the shard's place in recv; the others' is recv itself.
            let dst = match red.kind {
                Kind::AllReduce => dst.add(my_off * es),
                _ => dst,
            };
            let own_slot = scratch.as_ref().map(|sc| sc.ptr.add(me * slot));
            let (src_own, out) = match own_slot.filter(|_| stage) {
                Some(o) => {
                    if misaligned(own) {
                        self.dev.memcpy_async(s, o, own, mine * es).map_err(|e| e.with_op(name))?;
                    }
                    (if misaligned(own) { o } else { own }, if misaligned(dst) { o } else { dst })
                }
                None => (own, dst),
            };
            let srcs: Vec<DevPtr> = match (&scratch, receives) {
                (Some(sc), true) => (0..n).map(|p| if p == me { src_own } else { sc.ptr.add(p * slot) }).collect(),
                _ => vec![src_own],
            };
            // The peers' slots are where the plan would decompress their streams; the fused
            // kernel reads the streams instead, in rank order with the own contribution at
            // position `me`, and writes the block once.
            let peers: Vec<DevPtr> = srcs.iter().enumerate().filter(|(p, _)| *p != me).map(|(_, x)| *x).collect();
            let fused = plan.as_ref().and_then(|p| p.fused_inputs(&peers, mine));
            let why = match (&fused, red.op) {
                (None, _) => Some("nothing received compressed"),
                // The fused kernels have no prescaling: decompress, then the CopyReduce step.
                (Some(_), RedOp::PreMulSum(_)) => Some("PreMulSum has no fused kernel"),
                (Some(f), _) => self.unfused(f),
            };
            if plan.is_some() && !*logged {
                *logged = true;
                let and = if drc.is_some() { " + compress for the AllGather" } else { "" };
                match why {
                    None => log::debug!("rank {me}: {name} ({}): compressed reduce steps fused (decompress + reduce{and} in one kernel)", red.dtype.name()),
                    Some(w) => log::debug!("rank {me}: {name} ({}): compressed reduce steps in two passes (decompress, then reduce{and}): {w}", red.dtype.name()),
                }
            }
            use crate::compress::fused;
            match (fused, why, &drc) {
                (Some(f), None, Some(d)) => {
                    fused::decompress_reduce_compress_async(self.dev.as_ref(), s, f.dtype, &f.streams, src_own, me, out, mine, red.op, f.status, &d.out, k * cap, d.workspace)
                        .map_err(|e| e.with_op(name))?;
                }
                (Some(f), None, None) => {
                    let acc = fused::accumulator_for(f.dtype, out == src_own && me > 0);
                    fused::decompress_reduce_with_async(self.dev.as_ref(), s, f.dtype, &f.streams, src_own, me, out, mine, red.op, f.status, acc)
                        .map_err(|e| e.with_op(name))?;
                }
                _ => {
                    if let Some(p) = &plan {
                        p.finish(self.dev.as_ref(), s).map_err(|e| e.with_op(name))?;
                    }
                    self.dev.reduce_async(s, out, &srcs, mine, red.dtype, red.op).map_err(|e| e.with_op(name))?;
                    if let Some(d) = &drc {
                        // the step's values, reduced by the two passes, coded into the stream
                        let cdt = d.out_dtype;
                        fused::decompress_reduce_compress_async(self.dev.as_ref(), s, cdt, &[], out, 0, out, mine, red.op, DevPtr(0), &d.out, k * cap, d.workspace)
                            .map_err(|e| e.with_op(name))?;
                    }
                }
            }
            if out != dst {
                self.dev.memcpy_async(s, dst, out, mine * es).map_err(|e| e.with_op(name))?;
            }
            if (receives || stage) && captured.is_none() {
                let sc = st.scratch.as_mut().ok_or_else(|| Error::internal(name, "scratch vanished"))?;
                // The step reads the scratch from now on, whether or not its flag write
                // can be enqueued (if not, the communicator stops with that error).
                sc.last = Some(s);
                self.dev.write_value(s, sc.flag.dev_addr(0), sc.uses + 1).map_err(|e| e.with_op(name))?;
                sc.uses += 1;
            }
        }
        if let (Kind::AllReduce, Some(recv)) = (red.kind, &red.recv) {
            // AllGather of the shards: this rank's shard to every peer, theirs into place.
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            for (q, &(off, len)) in blocks.iter().enumerate().filter(|(q, _)| *q != me) {
                if my_len > 0 {
                    sends.push(recv.part(my_off * es, my_len * es, q)?);
                }
                if len > 0 {
                    recvs.push(recv.part(off * es, len * es, q)?);
                }
            }
            // Whole streams on every rank: a rank's shard may be coded as one by its reduce step.
            st.codec.whole_streams_next();
            if let Some(d) = drc {
                st.codec.precompressed(Some(super::compressed::Precompressed {
                    stream: s,
                    dtype: d.out_dtype,
                    src: (recv.ptr.add(my_off * es), my_len * es),
                    buf: d.out.out,
                    cap: d.cap,
                    alloc: d.alloc,
                    words: d.words,
                }));
            }
            let r = if !sends.is_empty() || !recvs.is_empty() {
                *submitted = true;
                self.launch(st, name, s, Some(red.dtype), sends, recvs)
            } else {
                Ok(())
            };
            st.codec.precompressed(None);
            r?;
        }
        Ok(())
    }

    /// Why the reduce steps of `red` cannot also code the shard for the AllGather (the fused
    /// decompress + reduce + compress kernel), or its codec dtype when they can: an AllReduce
    /// not being captured, whose shard the AllGather sends compressed to some peer, with a
    /// fused kernel for the dtype and operator, at most `MAX_FUSED_INPUTS` peers, on a CUDA
    /// device, and chunks on the codec's block boundaries (one chunk, or `cap` a multiple of
    /// the block). `Err(None)`: nothing compressed to say it about.
    fn drc_unfit(&self, red: &Reduction, captured: bool, my_len: usize, cap: usize, chunks: usize) -> std::result::Result<crate::compress::Dtype, Option<&'static str>> {
        use crate::compress::{fused, Dtype, Params};
        let (me, es) = (self.rank, red.dtype.size());
        let Some(from) = self.compress_from.for_dtype(red.dtype) else { return Err(None) };
        if !matches!(red.kind, Kind::AllReduce) || my_len == 0 || captured {
            return Err(None);
        }
        if !(0..self.size).any(|q| super::compressed::compresses(my_len * es, q, me, from)) {
            return Err(None);
        }
        let cdt = Dtype::from_data_type("AllReduce", red.dtype).map_err(|_| None)?;
        let b = Params::default().check("AllReduce", cdt).map_err(|_| None)? as usize;
        if !fused::supports(cdt) || matches!(red.op, RedOp::PreMulSum(_)) {
            Err(Some("no fused kernel for this dtype and operator"))
        } else if self.size - 1 > fused::MAX_FUSED_INPUTS {
            Err(Some("more peers than one fused launch takes"))
        } else if self.dev.as_cuda().is_none() {
            Err(Some("the host backend has no fused kernel"))
        } else if chunks > 1 && cap % b != 0 {
            Err(Some("the reduce steps' chunks do not end on the codec's blocks (HOCCL_REDUCE_SCRATCH / ranks is not a multiple of 32 KiB)"))
        } else {
            Ok(cdt)
        }
    }

    /// The output of the reduce steps' coding of the shard `(off, len)` (elements) of `red`:
    /// the stream's buffer on the reduction's stream (its bound, then the offsets workspace
    /// of one step), begun.
    fn drc_begin(&self, st: &mut State, red: &Reduction, cdt: crate::compress::Dtype, (_off, len): (usize, usize), cap: usize) -> Result<Drc> {
        use crate::compress::{self, fused, Params};
        let params = Params::default();
        let bound = compress::max_compressed_len(cdt, len, &params)?;
        let ws_at = bound.next_multiple_of(256);
        let ws_len = fused::drc_workspace_len(cdt, self.size - 1, cap.min(len), &params)?;
        let (buf, alloc, words) = st.codec.gather_buffer(self.dev.as_ref(), red.stream, ws_at + ws_len)?;
        let out = fused::DrcOut { out: buf, cap: bound, out_len: words.dev_addr(0), total: len, params };
        fused::drc_begin_async(self.dev.as_ref(), red.stream, cdt, &out)?;
        Ok(Drc { out_dtype: cdt, out, cap: bound, alloc, words, workspace: (buf.add(ws_at), ws_len) })
    }

    /// Whether reductions with `op` run hierarchically on this communicator
    /// (docs/design.md, "Reductions across nodes"); every rank gets the same answer.
    pub fn reduces_hierarchically(&self, op: RedOp) -> bool {
        self.node_chain(op).is_ok()
    }

    /// How many ops this rank has enqueued that exchange data with `peer` (the pair's
    /// sequence number): which ranks a collective reached, for tests and diagnostics.
    pub fn ops_with(&self, peer: usize) -> Result<u64> {
        self.check_peer("ops_with", peer)?;
        let st = self.lock("ops_with")?;
        Ok(st.pair_counts[peer])
    }

    /// The nodes of the hierarchical plan as rank boundaries, `b[j]..b[j + 1]` the ranks of
    /// node j, nodes in rank order. `Err(None)` with one node; `Err(Some(why))` where the
    /// plan could not reproduce the rank-order fold, or has nothing to gain. Depends only on
    /// the topology and the operator, so every rank decides alike.
    pub(super) fn node_chain(&self, op: RedOp) -> std::result::Result<Vec<usize>, Option<&'static str>> {
        if self.topo.nnodes() < 2 {
            return Err(None);
        }
        match op {
            RedOp::Sum | RedOp::Prod | RedOp::Max | RedOp::Min => {}
            RedOp::Avg => return Err(Some("Avg divides the whole fold by n once, so a node's partial fold cannot be carried on")),
            RedOp::PreMulSum(_) => return Err(Some("PreMulSum prescales every input, so a node's partial fold cannot be carried on")),
        }
        let mut nodes: Vec<&[usize]> = self.topo.nodes().iter().map(|x| &x.ranks[..]).filter(|r| !r.is_empty()).collect();
        nodes.sort_by_key(|r| r[0]);
        let mut bounds = vec![0];
        for r in nodes {
            let at = bounds[bounds.len() - 1];
            if r.iter().enumerate().any(|(i, x)| *x != at + i) {
                return Err(Some("a node's ranks are not one contiguous range of ranks"));
            }
            bounds.push(at + r.len());
        }
        if bounds[bounds.len() - 1] != self.size {
            return Err(Some("the nodes do not cover the ranks"));
        }
        if bounds.windows(2).all(|w| w[1] - w[0] == 1) {
            return Err(Some("one rank per node: nothing to combine within a node"));
        }
        Ok(bounds)
    }

    /// Per node of `bounds`, ascending: the ranks that own the node's pieces of the
    /// hierarchical plan, so the only ranks whose memory the hops between nodes read and
    /// write. With `HOCCL_FORWARDING` on, the node's forwarding peers (the image of the
    /// topology's forwarding map: the ranks whose staging the NIC reads and writes; every
    /// rank under the identity map); with it off, every rank. The other ranks only send
    /// their contributions to the owners within the node and, AllReduce, receive the
    /// result from them, which they do in any case: forwarding adds no hop and leaves the
    /// fold order, so the bits, unchanged. Every rank derives the same owners.
    fn piece_owners(&self, bounds: &[usize]) -> Vec<Vec<usize>> {
        bounds
            .windows(2)
            .map(|w| {
                let all: Vec<usize> = (w[0]..w[1]).collect();
                if !self.config.forwarding {
                    return all;
                }
                let mut own: Vec<usize> = all.iter().map(|r| self.topo.ranks()[*r].forwarding_peer).filter(|f| (w[0]..w[1]).contains(f)).collect();
                own.sort_unstable();
                own.dedup();
                if own.is_empty() { all } else { own }
            })
            .collect()
    }

    /// Run `red` hierarchically over the nodes `bounds` (docs/design.md, "Reductions across
    /// nodes"). The index space (AllReduce, Reduce: `count` elements; ReduceScatter: the
    /// `n * count` of the send buffer) is cut into chunks; every node splits each chunk into
    /// one piece per owner ([`Chain::piece`], [`Communicator::piece_owners`]). For chunk t, the owner of a piece on
    /// node j folds, in rank order, the prefix its counterparts on node j - 1 computed (the
    /// fold of ranks `0..b[j]`) and the contributions of its node's ranks, so the last node
    /// holds the rank-order fold of every rank, bit for bit `reduce::reduce_into`; it then
    /// sends the result where it belongs. One op per step, pipelined one chunk deep so the
    /// results of chunk t - 1 travel back while the prefixes of chunk t travel forward:
    ///
    /// - node j < last: X(t) = contributions of chunk t within the node (+ prefix from
    ///   j - 1) and, AllReduce, the node's AllGather of chunk t - 2 (ReduceScatter, Reduce
    ///   on a node whose owners relay: their results of chunk t - 2 to the node's ranks);
    ///   reduce step; Y(t) = prefix of chunk t to node j + 1 and the results of chunk
    ///   t - 1 from the last node;
    /// - last node: X(t) = contributions and prefix of chunk t, and the results of chunk
    ///   t - 1 to their owners (AllReduce: to each node's counterpart, then within the node).
    ///
    /// Two ranks' ops match pair by pair (the engine's pair sequence numbers), so each side
    /// lists a pair's transfers under the same rule and in the same order.
    fn run_hierarchical(&self, st: &mut State, red: &Reduction, bounds: &[usize], submitted: &mut bool) -> Result<()> {
        let (n, me, es, name, s, dt) = (self.size, self.rank, red.dtype.size(), red.name, red.stream, red.dtype);
        let ch = Chain { bounds, dtype: dt, owners: self.piece_owners(bounds) };
        let (j, last) = (ch.node_of(me), ch.nodes() - 1);
        let local = |r: usize| r - bounds[ch.node_of(r)];
        let kmax = (0..ch.nodes()).map(|x| ch.ranks(x).len()).max().unwrap_or(1);
        let kmin = ch.owners.iter().map(Vec::len).min().unwrap_or(1).max(1);
        // Whether node x's owners relay results to ranks of theirs that own no piece: a
        // ReduceScatter's blocks, or a Reduce's root, on a node before the last whose
        // owners are not all its ranks (AllReduce's owners share the results with the
        // whole node anyway). The last node's owners then send those results to the
        // owners, which forward them two ops later, so no piece crosses between nodes to
        // or from a rank that is not a forwarding peer.
        let relays = |x: usize| {
            x != last
                && match red.kind {
                    Kind::AllReduce => false,
                    Kind::ReduceScatter => ch.owners[x].len() < ch.ranks(x).len(),
                    Kind::Reduce { root } => ch.node_of(root) == x && !ch.owners[x].contains(&root),
                }
        };
        // The results node x needs: its ranks' blocks (ReduceScatter), everything (Reduce).
        let needs = |x: usize| match red.kind {
            Kind::ReduceScatter => (bounds[x] * red.count, bounds[x + 1] * red.count),
            _ => (0, total_of(red, n)),
        };
        let relaying = (0..ch.nodes()).any(relays);
        // Scratch layout: kmax + 2 slots of `hs` bytes: one per local rank (the node peers'
        // contributions; this rank's own stages a misaligned input), the prefix from the
        // previous node, and this rank's fold (a prefix, or on the last node the result);
        // when some node relays, one more: the results an owner forwards.
        let sc = self.scratch(st, name)?;
        let region = sc.region;
        let hs = slot_bytes(sc.slot * n, kmax + 2 + usize::from(relaying));
        let (prefix, out, relay) = (kmax * hs, (kmax + 1) * hs, (kmax + 2) * hs);
        let cap = hs / es;
        // Chunk length: as long as keeps every piece within one slot (a split of `len` into
        // k shards gives pieces of at most len / k + one alignment unit; k: the fewest
        // owners of a node).
        let align = (256 / es).max(1);
        let grid = if cap > 2 * align + 1 { (cap - align - 1) * kmin / align * align } else { cap };
        let total = total_of(red, n);
        // At least PIPELINE_CHUNKS chunks once they stay above PIPELINE_MIN_BYTES: the
        // results of one chunk travel back while the next one's prefixes travel forward,
        // which needs several chunks in flight.
        let pipe = total.div_ceil(PIPELINE_CHUNKS).max(PIPELINE_MIN_BYTES / es).div_ceil(align) * align;
        let grid = grid.min(pipe);
        let chunks = total.div_ceil(grid);
        let span = |t: usize| (t * grid, ((t + 1) * grid).min(total));
        let at = |t: Option<usize>| t.filter(|t| *t < chunks).map(span);
        let misaligned = red.send.ptr.0 % es as u64 != 0;
        let recv = red.recv;
        let need_recv = || recv.ok_or_else(|| Error::internal(name, "a hierarchical reduction's result has no receive buffer"));
        self.wait_for_scratch(st, s).map_err(|e| e.with_op(name))?;
        let mut launch = |st: &mut State, sends: Vec<crate::engine::Transfer>, recvs: Vec<crate::engine::Transfer>| -> Result<()> {
            if !sends.is_empty() || !recvs.is_empty() {
                self.launch(st, name, s, Some(dt), sends, recvs)?;
                *submitted = true;
            }
            Ok(())
        };
        // The last node's results of chunk c: sends (from its fold) and this rank's receives.
        let final_sends = |c: Span, sends: &mut Vec<crate::engine::Transfer>| -> Result<()> {
            let p = ch.piece(me, c);
            if width(p) == 0 {
                return Ok(());
            }
            let from = |i: Span, q: usize| region.part(out + (i.0 - p.0) * es, width(i) * es, q);
            match red.kind {
                Kind::AllReduce => {
                    for v in 0..bounds[last] {
                        if let Some(i) = meet(p, ch.piece(v, c)) {
                            sends.push(from(i, v)?);
                        }
                    }
                    for q in ch.ranks(last) {
                        sends.push(from(p, q)?);
                    }
                }
                Kind::ReduceScatter => {
                    for q in (0..n).filter(|q| !relays(ch.node_of(*q))) {
                        if let Some(i) = meet(p, (q * red.count, (q + 1) * red.count)) {
                            sends.push(from(i, q)?);
                        }
                    }
                }
                Kind::Reduce { root } if !relays(ch.node_of(root)) => sends.push(from(p, root)?),
                Kind::Reduce { .. } => {}
            }
            // To the owners of the nodes that relay, for their ranks.
            for x in (0..last).filter(|x| relays(*x)) {
                for &o in &ch.owners[x] {
                    if let Some(i) = meet(p, ch.piece(o, c)).and_then(|i| meet(i, needs(x))) {
                        sends.push(from(i, o)?);
                    }
                }
            }
            Ok(())
        };
        let final_recvs = |c: Span, recvs: &mut Vec<crate::engine::Transfer>| -> Result<()> {
            let p = ch.piece(me, c);
            if relays(j) {
                // An owner takes the results of its piece that its node needs, to forward.
                for u in ch.ranks(last).filter(|_| width(p) > 0) {
                    if let Some(i) = meet(ch.piece(u, c), p).and_then(|i| meet(i, needs(j))) {
                        recvs.push(region.part(relay + (i.0 - p.0) * es, width(i) * es, u)?);
                    }
                }
                return Ok(());
            }
            match red.kind {
                Kind::AllReduce if j == last => {
                    // This node's AllGather of the results (its own through a copy to self).
                    for q in ch.ranks(last) {
                        let pq = ch.piece(q, c);
                        if width(pq) > 0 {
                            recvs.push(need_recv()?.part(pq.0 * es, width(pq) * es, q)?);
                        }
                    }
                }
                Kind::AllReduce => {
                    for u in ch.ranks(last) {
                        if let Some(i) = meet(p, ch.piece(u, c)) {
                            recvs.push(need_recv()?.part(i.0 * es, width(i) * es, u)?);
                        }
                    }
                }
                Kind::ReduceScatter => {
                    for u in ch.ranks(last) {
                        if let Some(i) = meet(ch.piece(u, c), (me * red.count, (me + 1) * red.count)) {
                            recvs.push(need_recv()?.part((i.0 - me * red.count) * es, width(i) * es, u)?);
                        }
                    }
                }
                Kind::Reduce { root } if root == me => {
                    for u in ch.ranks(last) {
                        let pu = ch.piece(u, c);
                        if width(pu) > 0 {
                            recvs.push(need_recv()?.part(pu.0 * es, width(pu) * es, u)?);
                        }
                    }
                }
                Kind::Reduce { .. } => {}
            }
            Ok(())
        };
        for t in 0..chunks + 2 {
            let now = at(Some(t));
            let prev = at(t.checked_sub(1));
            // X(t): within the node (and the prefix from the previous node).
            let (mut sends, mut recvs) = (Vec::new(), Vec::new());
            if let Some(c) = now {
                let p = ch.piece(me, c);
                for q in ch.ranks(j).filter(|q| *q != me) {
                    let pq = ch.piece(q, c);
                    if width(pq) > 0 {
                        sends.push(red.send.part(pq.0 * es, width(pq) * es, q)?);
                    }
                    if width(p) > 0 {
                        recvs.push(region.part(local(q) * hs, width(p) * es, q)?);
                    }
                }
                if j > 0 {
                    for v in ch.ranks(j - 1) {
                        if let Some(i) = meet(ch.piece(v, c), p) {
                            recvs.push(region.part(prefix + (i.0 - p.0) * es, width(i) * es, v)?);
                        }
                    }
                }
            }
            if j == last {
                if let Some(c) = prev {
                    final_sends(c, &mut sends)?;
                    final_recvs(c, &mut recvs)?;
                }
            } else if let (true, Some(c)) = (relays(j), at(t.checked_sub(2))) {
                // The owners forward the results they received in Y(t - 1).
                let held = |o: usize, q: usize| -> Option<Span> {
                    let i = meet(ch.piece(o, c), needs(j))?;
                    match red.kind {
                        Kind::ReduceScatter => meet(i, (q * red.count, (q + 1) * red.count)),
                        _ => Some(i).filter(|_| matches!(red.kind, Kind::Reduce { root } if root == q)),
                    }
                };
                let p = ch.piece(me, c);
                for q in ch.ranks(j) {
                    if let Some(i) = held(me, q) {
                        sends.push(region.part(relay + (i.0 - p.0) * es, width(i) * es, q)?);
                    }
                }
                let base = if matches!(red.kind, Kind::ReduceScatter) { me * red.count } else { 0 };
                for &o in &ch.owners[j] {
                    if let Some(i) = held(o, me) {
                        recvs.push(need_recv()?.part((i.0 - base) * es, width(i) * es, o)?);
                    }
                }
            } else if let (Kind::AllReduce, Some(c)) = (red.kind, at(t.checked_sub(2))) {
                // The node's AllGather of the results its ranks received in Y(t - 1).
                let p = ch.piece(me, c);
                let r = need_recv()?;
                for q in ch.ranks(j).filter(|q| *q != me) {
                    let pq = ch.piece(q, c);
                    if width(p) > 0 {
                        sends.push(r.part(p.0 * es, width(p) * es, q)?);
                    }
                    if width(pq) > 0 {
                        recvs.push(r.part(pq.0 * es, width(pq) * es, q)?);
                    }
                }
            }
            launch(st, sends, recvs)?;
            // The reduce step: prefix, then the node's ranks in rank order, into `out`.
            if let Some(c) = now {
                let p = ch.piece(me, c);
                let len = width(p);
                if len > cap {
                    return Err(Error::internal(name, format!("hierarchical piece of {len} elements exceeds a slot of {cap}")));
                }
                if len > 0 {
                    let mut own = red.send.ptr.add(p.0 * es);
                    if misaligned {
                        let o = region.ptr.add(local(me) * hs);
                        self.dev.memcpy_async(s, o, own, len * es).map_err(|e| e.with_op(name))?;
                        own = o;
                    }
                    let mut srcs = Vec::with_capacity(kmax + 1);
                    if j > 0 {
                        srcs.push(region.ptr.add(prefix));
                    }
                    srcs.extend(ch.ranks(j).map(|q| if q == me { own } else { region.ptr.add(local(q) * hs) }));
                    // One launch takes at most MAX_REDUCE_SRCS inputs; a longer fold goes on
                    // from its own partial result (the ops here carry a fold exactly).
                    let dst = region.ptr.add(out);
                    let mut done = srcs.len().min(MAX_REDUCE_SRCS);
                    self.dev.reduce_async(s, dst, &srcs[..done], len, dt, red.op).map_err(|e| e.with_op(name))?;
                    while done < srcs.len() {
                        let more = (srcs.len() - done).min(MAX_REDUCE_SRCS - 1);
                        let part: Vec<DevPtr> = std::iter::once(dst).chain(srcs[done..done + more].iter().copied()).collect();
                        self.dev.reduce_async(s, dst, &part, len, dt, red.op).map_err(|e| e.with_op(name))?;
                        done += more;
                    }
                }
            }
            // Y(t): the prefix on to the next node; the last node's results of chunk t - 1.
            if j < last {
                let (mut sends, mut recvs) = (Vec::new(), Vec::new());
                if let Some(c) = now {
                    let p = ch.piece(me, c);
                    for u in ch.ranks(j + 1) {
                        if let Some(i) = meet(p, ch.piece(u, c)) {
                            sends.push(region.part(out + (i.0 - p.0) * es, width(i) * es, u)?);
                        }
                    }
                }
                if let Some(c) = prev {
                    final_recvs(c, &mut recvs)?;
                }
                launch(st, sends, recvs)?;
            }
        }
        let sc = st.scratch.as_mut().ok_or_else(|| Error::internal(name, "scratch vanished"))?;
        sc.last = Some(s);
        self.dev.write_value(s, sc.flag.dev_addr(0), sc.uses + 1).map_err(|e| e.with_op(name))?;
        sc.uses += 1;
        Ok(())
    }

    /// Why the compressed reduce step over `f` cannot run as one fused kernel, or None when
    /// it can: a fused instance for the dtype, at most `MAX_FUSED_INPUTS` peers' streams (a
    /// chain of launches would divide Avg early and refold the order), a CUDA device.
    fn unfused(&self, f: &super::compressed::FusedInputs) -> Option<&'static str> {
        use crate::compress::fused;
        if !fused::supports(f.dtype) {
            Some("no fused kernel for this dtype")
        } else if f.streams.len() > fused::MAX_FUSED_INPUTS {
            Some("more peers than one fused launch takes")
        } else if self.dev.as_cuda().is_none() {
            Some("the host backend has no fused kernel")
        } else {
            None
        }
    }

    /// Before an exchange into the scratch on `s`: if the last reduce step that read the
    /// scratch was on another stream, make `s` wait until it is done.
    fn wait_for_scratch(&self, st: &mut State, s: StreamHandle) -> Result<()> {
        let Some(sc) = st.scratch.as_ref() else { return Ok(()) };
        self.wait_for_last_use(s, sc.last, &sc.flag, sc.uses)
    }

    /// At teardown: once every reduce step that read the scratch is done (its flag, polled
    /// on the host, never a stream query), free it. After `bound` without that, the scratch
    /// and its flag are left allocated (a stream may still read or write them) and a warning
    /// says so.
    pub(super) fn release_scratch(&self, st: &mut State, bound: Duration) {
        let Some(sc) = st.scratch.take() else { return };
        self.free_after_last_use(sc.base, sc.region.len, sc.flag, sc.uses, bound, "reduction scratch");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shards are contiguous, cover the count, start on 256-byte boundaries, and differ in
    /// size by at most about one alignment unit from count / n.
    #[test]
    fn shards_cover_the_count() {
        for dtype in [DataType::U8, DataType::BF16, DataType::F32, DataType::F64] {
            let align = 256 / dtype.size();
            for n in 1..=9 {
                for count in [0, 1, 5, n - 1, n, 255, 256, 257, 1000, 4097, 1 << 20, (1 << 20) + 3] {
                    let starts: Vec<usize> = (0..=n).map(|r| shard_start(count, n, r, dtype)).collect();
                    assert_eq!((starts[0], starts[n]), (0, count), "{dtype:?} n {n} count {count}");
                    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{dtype:?} n {n} count {count}: {starts:?}");
                    assert!(starts[..n].iter().all(|s| s % align == 0));
                    let ideal = count / n;
                    for r in 0..n - 1 {
                        let len = starts[r + 1] - starts[r];
                        assert!(len <= ideal + 2 * align && len + 2 * align >= ideal, "{dtype:?} n {n} count {count} shard {r}: {len}");
                    }
                }
            }
        }
        // Huge counts do not overflow the product r * count.
        assert_eq!(shard_start(usize::MAX / 2, 8, 7, DataType::U8) % 256, 0);
    }

    #[test]
    fn slots_hold_whole_elements() {
        assert_eq!(slot_bytes(64 << 20, 8), 8 << 20);
        assert_eq!(slot_bytes(4096, 3), 1280);
        assert_eq!(slot_bytes(4096, 8), 512);
        assert_eq!(slot_bytes(4096, 100), 40);
        assert_eq!(slot_bytes(4096, 1000), 8);
        for n in 1..600 {
            let s = slot_bytes(4096, n);
            assert!(s % 8 == 0 && s >= 8 && (s * n <= 4096 || s == 8), "n {n}: {s}");
        }
    }
}

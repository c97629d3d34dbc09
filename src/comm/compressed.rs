//! The `compressed` engine's data movement (`HOCCL_ENGINE=compressed`): every transfer to a
//! peer of bf16, f16 or f32 data of at least [`MIN_BYTES`] crosses as a codec stream
//! (`BFX1`/`HFX1`/`FFX1`, docs/design.md "Codec format"), so fewer bytes cross the link.
//!
//! **Whole streams.** On the caller's stream, before the handshake: each distinct send range
//! is compressed (SMs) into this stream's staging buffer, and the stream's length is written
//! to a host-visible word. The engine moves the compressed stream with the copy engines into
//! the receiver's staging buffer, reading the length when the stream reaches the op
//! (`Fill::Word`; the receiver accepts up to the bound, `Fill::UpTo`). After the
//! handshake's wait, each received stream is decompressed into the user's buffer. Copies to
//! self stay plain copies on the stream. Both sides decide from what they share (the
//! engine, the dtype and the byte count), so a send is compressed exactly when its receive
//! is; both sides size the staging range with the same bound, so mismatched counts are
//! still caught by the engine's length check.
//!
//! **Pipelined by segment** ([`segments`], `Config::codec_segments`). A transfer of two
//! segments' worth or more is cut, on both sides alike, into independently coded segments,
//! each its own engine transfer; the stream codes them between the op's start and finish,
//! raising a flag per segment that the proxy starts its copy on (`Fill::Coded`), and
//! decodes each received segment after the flag the proxy raises when it landed
//! (`Fill::Landed`), so coding, moving and decoding overlap. Flags count the stream's
//! epoch (one per pipelined op) and live in the first half of its word slab, lengths in
//! the second. A reduction's exchange and AllGather cross whole
//! ([`CodecState::whole_streams_next`]).
//!
//! **Staging.** One device buffer per stream, reused op after op: the stream orders an op's
//! use of it (compress, the peer's write between the op's start and finish, decompress)
//! before the next op's. An op that needs more grows it; outgrown buffers are kept until
//! the communicator is destroyed, since work already queued on the stream may still use
//! them. A user buffer not aligned to the value size goes through the staging buffer by a
//! plain copy first (sends) or after (receives).
//!
//! **Precompressed sends.** The compressed AllReduce codes its shard for the AllGather in
//! its reduce step (the fused decompress + reduce + compress kernel) into a per-stream
//! buffer of its own ([`CodecState::gather_buffer`], kept like the staging, with its own
//! length word); it then registers the range ([`CodecState::precompressed`]), and the
//! AllGather's `prepare` sends that stream instead of compressing the shard again, when the
//! shard is the op's only compressed send source. The receivers see the same stream and
//! the same bound either way.
//!
//! **Corrupt input.** Each decompression writes a status word (a ring of [`STATUS_SLOTS`]
//! host-visible words); the proxy scans the ring (`compress::first_rejection`) and a nonzero
//! word becomes the
//! communicator's asynchronous error (`Corrupt`): the op's output is then unspecified, and
//! the communicator runs nothing more, as after any failure.
use crate::compress::{self, Dtype, Params};
use crate::device::batch::{Batch, OnStream};
use crate::device::{Allocation, DevPtr, Device, FlagSlab, StreamHandle};
use crate::engine::{Fill, Transfer};
use crate::error::Result;
use crate::types::DataType;
use std::collections::HashMap;
use std::sync::Arc;

/// Transfers smaller than this move raw: below it the codec kernels' fixed cost (two
/// launches each side) outweighs the bytes saved.
pub const MIN_BYTES: usize = 64 << 10;
/// Decompression status words, reused round robin: one per received stream or segment, so
/// that a rejection stays in its word until the proxy's scan (every 50 ms) reads it while
/// ops of up to 8 segments per receive run back to back.
pub const STATUS_SLOTS: usize = 2048;
/// Staging ranges start at multiples of this.
const ALIGN: usize = 256;
/// Segments start at multiples of this many values (a multiple of the codec's block).
const SEGMENT_VALUES: usize = 4096;

/// How the next op's compressed transfers are cut (`Config::codec_segments`,
/// `Config::codec_segment_bytes`): at most `count` segments of at least `min_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Segmenting {
    pub count: usize,
    pub min_bytes: usize,
}

/// The segments a compressed transfer of `n` values of `vs` bytes crosses as, (first value,
/// values) each: as many as `seg.count` allows with each at least `seg.min_bytes` (the last
/// may be shorter), starting at multiples of [`SEGMENT_VALUES`]; one segment (the whole
/// transfer) below two segments' worth. Both ends compute it from what they share (the
/// byte count and the communicator's setting), so a send is cut exactly as its receive.
pub(super) fn segments(n: usize, vs: usize, seg: Segmenting) -> Vec<(usize, usize)> {
    let k = seg.count.min(n.saturating_mul(vs) / seg.min_bytes.max(1)).max(1);
    if k == 1 {
        return vec![(0, n)];
    }
    let per = n.div_ceil(k).next_multiple_of(SEGMENT_VALUES);
    (0..n).step_by(per).map(|a| (a, per.min(n - a))).collect()
}

struct StreamStaging {
    buf: DevPtr,
    cap: usize,
    alloc: Allocation,
    /// Two halves: the pipelined ops' flags (`Fill::Coded`, `Fill::Landed`), which only
    /// ever hold epochs, so that a flag of one op never passes for another's; then the
    /// length words of the sends (one per distinct send range or segment of an op).
    words: Arc<FlagSlab>,
}

/// Per communicator: the staging of every stream that ran a compressed op, the status ring
/// and what was outgrown.
#[derive(Default)]
pub(super) struct CodecState {
    streams: HashMap<StreamHandle, StreamStaging>,
    /// Per stream: where a reduce step codes the shard its AllGather sends.
    gather: HashMap<StreamHandle, StreamStaging>,
    /// The stream the next op's `prepare` sends instead of compressing its source.
    pre: Option<Precompressed>,
    status: Option<Arc<FlagSlab>>,
    next_status: usize,
    outgrown: Vec<DevPtr>,
    outgrown_words: Vec<Arc<FlagSlab>>,
    /// How the next `prepare` cuts its transfers (set per op by the caller; None: whole).
    segmenting: Option<Segmenting>,
    /// The next op is a reduction's AllGather, which moves whole streams (its shard may be
    /// precompressed by the reduce step as one stream).
    whole_next: bool,
    /// Per stream: the value its pipelined ops' flags count with (one per op, rising).
    epochs: HashMap<StreamHandle, u64>,
}

/// A send source already coded on `stream` (by the reduce step before the op): the stream
/// of `src` (user buffer, bytes) at `buf`, `cap` = the bound both ends size the transfer
/// with, its length in word 0 of `words` once the stream reaches the op.
pub(super) struct Precompressed {
    pub stream: StreamHandle,
    pub dtype: Dtype,
    pub src: (DevPtr, usize),
    pub buf: DevPtr,
    pub cap: usize,
    pub alloc: Allocation,
    pub words: Arc<FlagSlab>,
}

/// One received stream to decompress after the handshake.
struct Decompress {
    src: DevPtr,
    src_len: usize,
    /// Where the values go: the user's buffer, or a staging range when that is misaligned.
    out: DevPtr,
    n: usize,
    status: DevPtr,
    /// (user buffer, bytes) to copy `out` into afterwards, for a misaligned user buffer.
    bounce_to: Option<(DevPtr, usize)>,
}

/// One piece of a pipelined op's work on the caller's stream, between its start and finish.
enum Step {
    Copy { dst: DevPtr, src: DevPtr, len: usize },
    Compress { input: DevPtr, n: usize, out: DevPtr, cap: usize, len_word: DevPtr },
    /// Raise a `Fill::Coded` flag (the segment before it is coded).
    Coded { flag: DevPtr, v: u64 },
    /// Wait for a `Fill::Landed` flag (the segment after it has landed).
    Landed { flag: DevPtr, v: u64 },
    Decompress(Decompress),
}

/// What an op on the compressed path still enqueues after its handshake, and the words its
/// compressed sends read their lengths from.
pub(super) struct Plan {
    dtype: Dtype,
    decompress: Vec<Decompress>,
    pub len_words: Option<Arc<FlagSlab>>,
    /// A pipelined op: its sends' coding, then its receives' decoding, each on the stream
    /// between the op's start and finish (`Plan::enqueue_coding`, `Plan::enqueue_decoding`).
    coding: Vec<Step>,
    decoding: Vec<Step>,
    /// Its `Fill::Landed` flags (word index in `len_words`, value), raised if the op is not
    /// submitted after its stream work was enqueued.
    landed: Vec<(usize, u64)>,
}

/// Whether a transfer of `len` bytes to or from `peer` is compressed: to a peer, at least
/// [`MIN_BYTES`], and at least `from[peer]` (the communicator's per-peer rule for the dtype,
/// `cost::CompressFrom`, the same on both ends of the transfer).
pub(super) fn compresses(len: usize, peer: usize, me: usize, from: &[usize]) -> bool {
    peer != me && len >= MIN_BYTES.max(from.get(peer).copied().unwrap_or(usize::MAX))
}

fn eligible(x: &Transfer, me: usize, from: &[usize]) -> bool {
    compresses(x.len, x.peer, me, from)
}

fn up(x: usize) -> usize {
    x.next_multiple_of(ALIGN)
}

impl CodecState {
    /// The status ring (allocated at first use).
    pub(super) fn status_ring(&mut self, dev: &dyn Device) -> Result<Arc<FlagSlab>> {
        if let Some(s) = &self.status {
            return Ok(s.clone());
        }
        let s = Arc::new(dev.alloc_flags(STATUS_SLOTS)?);
        self.status = Some(s.clone());
        Ok(s)
    }

    /// Rewrite `sends` and `recvs` of one op of `dtype` on `stream` for the compressed path
    /// and enqueue the compression of its sends; None when nothing of it is compressed (a
    /// dtype the codec does not handle, or only small or local transfers).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prepare(
        &mut self,
        dev: &dyn Device,
        stream: StreamHandle,
        dtype: DataType,
        me: usize,
        from: &[usize],
        sends: &mut Vec<Transfer>,
        recvs: &mut Vec<Transfer>,
    ) -> Result<Option<Plan>> {
        const OP: &str = "compressed engine";
        let segmenting = self.segmenting.take();
        let Ok(cdt) = Dtype::from_data_type(OP, dtype) else {
            return Ok(None);
        };
        if !sends.iter().chain(recvs.iter()).any(|x| eligible(x, me, from)) {
            return Ok(None);
        }
        let vs = cdt.size();
        if let Some(seg) = segmenting {
            if sends.iter().chain(recvs.iter()).any(|x| eligible(x, me, from) && segments(x.len / vs, vs, seg).len() > 1) {
                // A source the reduce step coded is one stream: sent whole, never cut.
                self.pre = None;
                return self.prepare_pipelined(dev, stream, cdt, me, from, seg, sends, recvs).map(Some);
            }
        }
        let params = Params::default();
        let bound = |len: usize| compress::max_compressed_len(cdt, len / vs, &params);
        // Layout: one compressed range (and a bounce range when misaligned) per distinct send
        // source, then one compressed range (and a bounce range) per receive.
        let mut sources: Vec<(DevPtr, usize)> = Vec::new();
        for x in sends.iter().filter(|x| eligible(x, me, from)) {
            if !sources.contains(&(x.ptr, x.len)) {
                sources.push((x.ptr, x.len));
            }
        }
        // A source coded already (the AllReduce's shard) is sent as it is: no staging range,
        // no compression. Only as the op's one source: its length word is its own.
        let pre = self.pre.take().filter(|p| p.stream == stream && p.dtype == cdt && sources == [p.src]);
        if let Some(p) = &pre {
            sources.clear();
            for x in sends.iter_mut().filter(|x| eligible(x, me, from) && (x.ptr, x.len) == p.src) {
                *x = Transfer { peer: x.peer, ptr: p.buf, len: p.cap, alloc: Some(p.alloc), fill: Fill::Word(0), forward: x.forward };
            }
        }
        let mut total = 0usize;
        let mut src_at = Vec::with_capacity(sources.len()); // (compressed off, cap, bounce off)
        for &(ptr, len) in &sources {
            let cap = bound(len)?;
            let bounce = (ptr.0 % vs as u64 != 0).then(|| total + up(cap));
            src_at.push((total, cap, bounce));
            total += up(cap) + if bounce.is_some() { up(len) } else { 0 };
        }
        let mut recv_at = Vec::new(); // (recv index, compressed off, cap, bounce off)
        for (i, x) in recvs.iter().enumerate().filter(|(_, x)| eligible(x, me, from)) {
            let cap = bound(x.len)?;
            let bounce = (x.ptr.0 % vs as u64 != 0).then(|| total + up(cap));
            recv_at.push((i, total, cap, bounce));
            total += up(cap) + if bounce.is_some() { up(x.len) } else { 0 };
        }
        let st = self.staging(dev, stream, total.max(1), sources.len())?;
        let (base, alloc, words, lens) = (st.buf, st.alloc, st.words.clone(), st.words.len() / 2);
        // Compress each source once (AllGather and Broadcast send one range to every peer).
        for (i, (&(ptr, len), &(off, cap, bounce))) in sources.iter().zip(&src_at).enumerate() {
            let i = lens + i;
            let input = match bounce {
                Some(b) => {
                    dev.memcpy_async(stream, base.add(b), ptr, len)?;
                    base.add(b)
                }
                None => ptr,
            };
            compress::compress_async(dev, stream, cdt, input, len / vs, base.add(off), cap, words.dev_addr(i), &params)?;
            for x in sends.iter_mut().filter(|x| eligible(x, me, from) && (x.ptr, x.len) == (ptr, len)) {
                *x = Transfer { peer: x.peer, ptr: base.add(off), len: cap, alloc: Some(alloc), fill: Fill::Word(i), forward: x.forward };
            }
        }
        let ring = self.status_ring(dev)?;
        let mut decompress = Vec::with_capacity(recv_at.len());
        for &(i, off, cap, bounce) in &recv_at {
            let x = recvs[i];
            let slot = self.next_status;
            self.next_status = (slot + 1) % STATUS_SLOTS;
            ring.store(slot, 0);
            decompress.push(Decompress {
                src: base.add(off),
                src_len: cap,
                out: bounce.map_or(x.ptr, |b| base.add(b)),
                n: x.len / vs,
                status: ring.dev_addr(slot),
                bounce_to: bounce.map(|_| (x.ptr, x.len)),
            });
            recvs[i] = Transfer { peer: x.peer, ptr: base.add(off), len: cap, alloc: Some(alloc), fill: Fill::UpTo, forward: x.forward };
        }
        log::trace!(
            "{OP}: {} compressed sends{}, {} compressed receives, {total} staging bytes",
            sources.len(),
            if pre.is_some() { " (one coded by the reduce step)" } else { "" },
            decompress.len()
        );
        let len_words = match pre {
            Some(p) => Some(p.words),
            None => (!sources.is_empty()).then_some(words),
        };
        Ok(Some(Plan { dtype: cdt, decompress, len_words, coding: Vec::new(), decoding: Vec::new(), landed: Vec::new() }))
    }

    /// [`Self::prepare`] for an op with a transfer of more than one segment: every compressed
    /// transfer is replaced, in place, by its segments (one for a short one), each its own
    /// codec stream in its own staging range. The coding of the sends and the decoding of
    /// the receives are returned in the plan for the stream's part between the op's start
    /// and finish: each segment coded, then its `Fill::Coded` flag raised (the proxy starts
    /// its copy); each received segment waited for on its `Fill::Landed` flag (the proxy
    /// raises it when the segment has landed), then decoded. Flags count with the stream's
    /// epoch, one per pipelined op, so they are never reset.
    #[allow(clippy::too_many_arguments)]
    fn prepare_pipelined(
        &mut self,
        dev: &dyn Device,
        stream: StreamHandle,
        cdt: Dtype,
        me: usize,
        from: &[usize],
        seg: Segmenting,
        sends: &mut Vec<Transfer>,
        recvs: &mut Vec<Transfer>,
    ) -> Result<Plan> {
        let vs = cdt.size();
        let params = Params::default();
        let bound = |n: usize| compress::max_compressed_len(cdt, n, &params);
        // (first value, values, staging offset, bound, length word or landed flag) per segment.
        type Seg = (usize, usize, usize, usize, usize);
        let mut total = 0usize;
        let mut take = |len: usize| {
            let at = total;
            total += up(len);
            at
        };
        let cut = |len: usize, next: &mut usize, take: &mut dyn FnMut(usize) -> usize| -> Result<Vec<Seg>> {
            segments(len / vs, vs, seg)
                .into_iter()
                .map(|(a, m)| {
                    let cap = bound(m)?;
                    *next += 1;
                    Ok((a, m, take(cap), cap, *next - 1))
                })
                .collect()
        };
        let (mut nwords, mut nlanded) = (0usize, 0usize);
        // Each distinct send source once: (ptr, len, bounce offset, its segments).
        let mut sources: Vec<(DevPtr, usize, Option<usize>, Vec<Seg>)> = Vec::new();
        for x in sends.iter().filter(|x| eligible(x, me, from)) {
            if !sources.iter().any(|s| (s.0, s.1) == (x.ptr, x.len)) {
                let bounce = (x.ptr.0 % vs as u64 != 0).then(|| take(x.len));
                let segs = cut(x.len, &mut nwords, &mut take)?;
                sources.push((x.ptr, x.len, bounce, segs));
            }
        }
        // Each compressed receive: (index, bounce offset, its segments).
        let mut into: Vec<(usize, Option<usize>, Vec<Seg>)> = Vec::new();
        for (i, x) in recvs.iter().enumerate().filter(|(_, x)| eligible(x, me, from)) {
            let bounce = (x.ptr.0 % vs as u64 != 0).then(|| take(x.len));
            into.push((i, bounce, cut(x.len, &mut nlanded, &mut take)?));
        }
        // Flags: the coded ones, then the landed ones; the lengths in the second half.
        let (coded_at, landed_at) = (0, nwords);
        let st = self.staging(dev, stream, total.max(1), nwords + nlanded)?;
        let (base, alloc, words) = (st.buf, st.alloc, st.words.clone());
        let len_at = words.len() / 2;
        let v = {
            let e = self.epochs.entry(stream).or_insert(0);
            *e += 1;
            *e
        };
        let mut coding = Vec::new();
        for (ptr, len, bounce, segs) in &sources {
            let input = match bounce {
                Some(b) => {
                    coding.push(Step::Copy { dst: base.add(*b), src: *ptr, len: *len });
                    base.add(*b)
                }
                None => *ptr,
            };
            for &(a, m, off, cap, w) in segs {
                coding.push(Step::Compress { input: input.add(a * vs), n: m, out: base.add(off), cap, len_word: words.dev_addr(len_at + w) });
                coding.push(Step::Coded { flag: words.dev_addr(coded_at + w), v });
            }
        }
        let ring = self.status_ring(dev)?;
        let mut decoding = Vec::new();
        let mut landed = Vec::new();
        for (i, bounce, segs) in &into {
            let x = recvs[*i];
            for &(a, m, off, cap, l) in segs {
                let slot = self.next_status;
                self.next_status = (slot + 1) % STATUS_SLOTS;
                ring.store(slot, 0);
                landed.push((landed_at + l, v));
                decoding.push(Step::Landed { flag: words.dev_addr(landed_at + l), v });
                decoding.push(Step::Decompress(Decompress {
                    src: base.add(off),
                    src_len: cap,
                    out: bounce.map_or(x.ptr, |b| base.add(b)).add(a * vs),
                    n: m,
                    status: ring.dev_addr(slot),
                    bounce_to: bounce.map(|_| (x.ptr.add(a * vs), m * vs)),
                }));
            }
        }
        // The transfers, each compressed one replaced in place by its segments (a peer's
        // transfers are matched in order, and both ends cut alike).
        let cut_sends = std::mem::take(sends);
        for x in cut_sends {
            match sources.iter().find(|s| eligible(&x, me, from) && (s.0, s.1) == (x.ptr, x.len)) {
                Some((_, _, _, segs)) => sends.extend(segs.iter().map(|&(_, _, off, cap, w)| Transfer {
                    peer: x.peer,
                    ptr: base.add(off),
                    len: cap,
                    alloc: Some(alloc),
                    fill: Fill::Coded { word: len_at + w, flag: coded_at + w, v },
                    forward: x.forward,
                })),
                None => sends.push(x),
            }
        }
        let cut_recvs = std::mem::take(recvs);
        for (i, x) in cut_recvs.into_iter().enumerate() {
            match into.iter().find(|r| r.0 == i) {
                Some((_, _, segs)) => recvs.extend(segs.iter().map(|&(_, _, off, cap, l)| Transfer {
                    peer: x.peer,
                    ptr: base.add(off),
                    len: cap,
                    alloc: Some(alloc),
                    fill: Fill::Landed { flag: landed_at + l, v },
                    forward: x.forward,
                })),
                None => recvs.push(x),
            }
        }
        log::trace!(
            "compressed engine: pipelined, {} send sources in {nwords} segments, {} receives in {nlanded} segments, {total} staging bytes, epoch {v}",
            sources.len(),
            into.len()
        );
        Ok(Plan { dtype: cdt, decompress: Vec::new(), len_words: Some(words), coding, decoding, landed })
    }

    /// Cut the next op's transfers as `seg` says (`launch`), unless it is a reduction's
    /// AllGather ([`Self::whole_streams_next`]); reset by that op's `prepare`.
    pub(super) fn segment_next(&mut self, seg: Segmenting) {
        self.segmenting = (!std::mem::take(&mut self.whole_next)).then_some(seg);
    }

    /// Whether the next op may be cut in segments: forget a setting `prepare` did not use.
    pub(super) fn segment_none(&mut self) {
        self.segmenting = None;
    }

    /// The next op is a reduction's AllGather: its transfers cross whole on every rank (a
    /// rank's shard may be coded by its reduce step as one stream).
    pub(super) fn whole_streams_next(&mut self) {
        self.whole_next = true;
    }

    /// The buffer on `stream` where a reduce step codes its AllGather's shard, grown to
    /// `bytes` if needed, and its length word (word 0). Kept like the staging: the stream
    /// orders one op's use of it before the next one's; outgrown buffers are freed at
    /// destroy.
    pub(super) fn gather_buffer(&mut self, dev: &dyn Device, stream: StreamHandle, bytes: usize) -> Result<(DevPtr, Allocation, Arc<FlagSlab>)> {
        if let Some(g) = self.gather.get(&stream).filter(|g| g.cap >= bytes) {
            return Ok((g.buf, g.alloc, g.words.clone()));
        }
        let cap = bytes.max(2 * self.gather.get(&stream).map_or(0, |g| g.cap));
        let buf = dev.alloc(cap)?;
        let made = dev.allocation(buf).and_then(|alloc| Ok(StreamStaging { buf, cap, alloc, words: Arc::new(dev.alloc_flags(1)?) }));
        let g = match made {
            Ok(g) => g,
            Err(e) => {
                let _ = dev.free(buf);
                return Err(e);
            }
        };
        let out = (g.buf, g.alloc, g.words.clone());
        if let Some(old) = self.gather.insert(stream, g) {
            self.outgrown.push(old.buf);
            self.outgrown_words.push(old.words);
        }
        Ok(out)
    }

    /// Register (or, None, drop) the send source that the next op's `prepare` on its stream
    /// sends without compressing it.
    /// Dropping it also ends a [`Self::whole_streams_next`] that no op used.
    pub(super) fn precompressed(&mut self, p: Option<Precompressed>) {
        if p.is_none() {
            self.whole_next = false;
        }
        self.pre = p;
    }

    /// The staging of `stream`, grown to `bytes` and to halves of `nwords` words if needed.
    fn staging(&mut self, dev: &dyn Device, stream: StreamHandle, bytes: usize, nwords: usize) -> Result<&StreamStaging> {
        let fits = self.streams.get(&stream).is_some_and(|s| s.cap >= bytes && s.words.len() / 2 >= nwords);
        if !fits {
            let (cap, nw) = match self.streams.get(&stream) {
                Some(s) => (if s.cap >= bytes { s.cap } else { bytes.max(2 * s.cap) }, (2 * nwords).max(s.words.len())),
                None => (bytes, (2 * nwords).max(32)),
            };
            let buf = dev.alloc(cap)?;
            let staged = dev.allocation(buf).and_then(|alloc| Ok(StreamStaging { buf, cap, alloc, words: Arc::new(dev.alloc_flags(nw)?) }));
            let new = match staged {
                Ok(s) => s,
                Err(e) => {
                    let _ = dev.free(buf);
                    return Err(e);
                }
            };
            if let Some(old) = self.streams.insert(stream, new) {
                self.outgrown.push(old.buf);
                self.outgrown_words.push(old.words);
            }
        }
        self.streams.get(&stream).ok_or_else(|| crate::error::Error::internal("compressed engine", "staging vanished"))
    }

    /// Free every staging buffer (the communicator's teardown, once no stream can still use
    /// them: `clean` as for the stream flags). Without `clean` they are left allocated.
    pub(super) fn release(&mut self, dev: &dyn Device, clean: bool) {
        self.pre = None;
        let bufs: Vec<DevPtr> = self.streams.drain().chain(self.gather.drain()).map(|(_, s)| s.buf).chain(self.outgrown.drain(..)).collect();
        self.outgrown_words.clear();
        if clean {
            for b in bufs {
                if let Err(e) = dev.free(b) {
                    log::warn!("hoccl: freeing a staging buffer: {e}");
                }
            }
        }
    }
}

/// The compressed receives of a reduction's exchange, handed to the fused decompress +
/// reduce kernel instead of being decompressed (`Plan::fused_inputs`).
pub(super) struct FusedInputs {
    pub dtype: Dtype,
    /// (compressed stream, its capacity in bytes), in the order of the destinations asked for.
    pub streams: Vec<(DevPtr, usize)>,
    /// The status word the kernel writes (one of the receives' words, already zeroed).
    pub status: DevPtr,
}

impl Plan {
    /// The compressed streams of the receives whose decompression would have written `outs`
    /// (in that order), when every receive of the op is one of them, each of `n` values and
    /// none misaligned; None otherwise (then [`Plan::finish`] decompresses as usual). The
    /// caller then enqueues a kernel that reads them after the handshake instead of `finish`.
    pub(super) fn fused_inputs(&self, outs: &[DevPtr], n: usize) -> Option<FusedInputs> {
        if outs.is_empty() || self.decompress.len() != outs.len() {
            return None;
        }
        let streams = outs
            .iter()
            .map(|o| {
                self.decompress
                    .iter()
                    .find(|d| d.out == *o && d.bounce_to.is_none() && d.n == n)
                    .map(|d| (d.src, d.src_len))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(FusedInputs { dtype: self.dtype, streams, status: self.decompress[0].status })
    }

    /// Enqueue the decompressions (after the handshake's wait on the same stream).
    pub(super) fn finish(&self, dev: &dyn Device, stream: StreamHandle) -> Result<()> {
        for d in &self.decompress {
            d.enqueue(dev, stream, self.dtype)?;
        }
        Ok(())
    }

    /// A pipelined op's coding of its sends, on the stream between its start and finish
    /// (through the handshake's batch, before any wait of the op).
    pub(super) fn enqueue_coding(&self, b: &mut Batch<OnStream<'_>>) -> Result<()> {
        self.enqueue(b, &self.coding)
    }

    /// A pipelined op's decoding of its receives, each segment after its landed flag, on the
    /// stream before the op's finish.
    pub(super) fn enqueue_decoding(&self, b: &mut Batch<OnStream<'_>>) -> Result<()> {
        self.enqueue(b, &self.decoding)
    }

    fn enqueue(&self, b: &mut Batch<OnStream<'_>>, steps: &[Step]) -> Result<()> {
        let params = Params::default();
        for step in steps {
            match *step {
                Step::Copy { dst, src, len } => b.copy(dst, src, len)?,
                Step::Coded { flag, v } => b.write(flag, v)?,
                Step::Landed { flag, v } => b.wait_geq(flag, v)?,
                Step::Compress { input, n, out, cap, len_word } => {
                    b.flush()?;
                    let OnStream { dev, stream } = *b.sink();
                    compress::compress_async(dev, stream, self.dtype, input, n, out, cap, len_word, &params)?;
                }
                Step::Decompress(ref d) => {
                    b.flush()?;
                    let OnStream { dev, stream } = *b.sink();
                    d.enqueue(dev, stream, self.dtype)?;
                }
            }
        }
        Ok(())
    }

    /// The op was not submitted after (part of) its stream work was enqueued: raise its
    /// landed flags, so that its stream never waits for segments no proxy will see land.
    pub(super) fn abandon(&self) {
        if let Some(w) = &self.len_words {
            self.landed.iter().for_each(|&(i, v)| w.raise(i, v));
        }
    }
}

impl Decompress {
    fn enqueue(&self, dev: &dyn Device, stream: StreamHandle, dtype: Dtype) -> Result<()> {
        compress::decompress_async(dev, stream, dtype, self.src, self.src_len, self.out, self.n, self.status)?;
        if let Some((dst, len)) = self.bounce_to {
            dev.memcpy_async(stream, dst, self.out, len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendChoice;

    fn send(dev: &dyn Device, peer: usize, ptr: DevPtr, len: usize) -> Transfer {
        Transfer { peer, ptr, len, alloc: Some(dev.allocation(ptr).unwrap()), fill: Fill::Exact, forward: false }
    }

    /// A registered precompressed source is sent as it is (its buffer, the bound, its own
    /// length word) when it is the op's one compressed source on its stream, and dropped
    /// otherwise (the source then compressed as usual).
    #[test]
    fn a_precompressed_source_is_sent_without_compressing() {
        let dev = crate::device::open(BackendChoice::Host, 0).unwrap();
        let d = dev.as_ref();
        let s = d.create_stream().unwrap();
        let len = 2 * MIN_BYTES;
        let shard = d.alloc(len).unwrap();
        let other = d.alloc(len).unwrap();
        d.copy_from_host(shard, &vec![0x3cu8; len]).unwrap();
        d.copy_from_host(other, &vec![0x3cu8; len]).unwrap();
        let from = [0usize; 3];
        let cap = compress::max_compressed_len(Dtype::Bf16, len / 2, &Params::default()).unwrap();
        let mut st = CodecState::default();
        let (buf, alloc, words) = st.gather_buffer(d, s, cap).unwrap();
        let pre = |stream| Precompressed { stream, dtype: Dtype::Bf16, src: (shard, len), buf, cap, alloc, words: words.clone() };
        // The shard to both peers: sent from the registered stream.
        st.precompressed(Some(pre(s)));
        let mut sends = vec![send(d, 1, shard, len), send(d, 2, shard, len)];
        let plan = st.prepare(d, s, DataType::BF16, 0, &from, &mut sends, &mut vec![]).unwrap().unwrap();
        for x in &sends {
            assert_eq!((x.ptr, x.len, x.alloc, x.fill), (buf, cap, Some(alloc), Fill::Word(0)), "peer {}", x.peer);
        }
        assert!(plan.len_words.as_ref().is_some_and(|w| Arc::ptr_eq(w, &words)), "the length word is the registered one");
        assert!(st.pre.is_none(), "used once");
        // Another stream, or another source beside it: compressed as usual, registration dropped.
        let t = d.create_stream().unwrap();
        for (stream, mut sends) in [(t, vec![send(d, 1, shard, len)]), (s, vec![send(d, 1, shard, len), send(d, 2, other, len)])] {
            st.precompressed(Some(pre(s)));
            let plan = st.prepare(d, stream, DataType::BF16, 0, &from, &mut sends, &mut vec![]).unwrap().unwrap();
            assert!(sends.iter().all(|x| x.ptr != buf && matches!(x.fill, Fill::Word(_))), "compressed into the staging");
            assert!(plan.len_words.as_ref().is_some_and(|w| !Arc::ptr_eq(w, &words)));
            assert!(st.pre.is_none());
            d.synchronize(stream).unwrap();
        }
        st.release(d, true);
        for p in [shard, other] {
            d.free(p).unwrap();
        }
    }

    /// Segments cover the transfer in order without gaps, start at multiples of
    /// `SEGMENT_VALUES`, are at most `count` and at least `min_bytes` (but the last), and a
    /// transfer below two segments' worth is one.
    #[test]
    fn segments_tile_the_transfer() {
        let seg = |count, min_bytes| Segmenting { count, min_bytes };
        assert_eq!(segments(1000, 2, seg(8, 4096)), vec![(0, 1000)]);
        assert_eq!(segments(4095, 2, seg(8, 4096)), vec![(0, 4095)], "below two segments' worth");
        assert_eq!(segments(1 << 20, 2, seg(1, 4096)), vec![(0, 1 << 20)], "one segment asked for");
        for (n, vs, count, min) in [(1usize << 20, 2usize, 8usize, 4usize << 20), (12345678, 4, 8, 4 << 20), (3 << 20, 2, 4, 64 << 10), (98309, 2, 4, 64 << 10), (40000, 2, 64, 4096)] {
            let s = segments(n, vs, seg(count, min));
            assert!(s.len() <= count && (s.len() == 1 || n * vs >= 2 * min), "{n} {vs} {count} {min}: {s:?}");
            let mut at = 0;
            for (i, &(a, m)) in s.iter().enumerate() {
                assert_eq!(a, at, "{n}: contiguous");
                assert!(a % SEGMENT_VALUES == 0 && m > 0);
                assert!(i + 1 == s.len() || m * vs >= min, "{n}: segment {i} of {m} values");
                at += m;
            }
            assert_eq!(at, n);
        }
        assert_eq!(segments(3 << 20, 2, seg(4, 64 << 10)).len(), 4);
    }

    /// A pipelined op cuts every compressed transfer in place into its segments (each the
    /// bound of its values, a distinct staging range), leaves small and local ones alone,
    /// gives sends `Fill::Coded` and receives `Fill::Landed` flags at the stream's next
    /// epoch, and its coding and decoding steps raise and wait for exactly those flags.
    #[test]
    fn a_pipelined_op_cuts_its_transfers_in_place() {
        let dev = crate::device::open(BackendChoice::Host, 0).unwrap();
        let d = dev.as_ref();
        let s = d.create_stream().unwrap();
        let (big, small) = (3 * MIN_BYTES + 2, MIN_BYTES / 2);
        let a = d.alloc(big + 1).unwrap();
        let b = d.alloc(big + 1).unwrap();
        let from = [0usize; 3];
        let seg = Segmenting { count: 4, min_bytes: MIN_BYTES };
        let mut st = CodecState::default();
        for epoch in 1..=2u64 {
            st.segment_next(seg);
            // Rank 0: the big range to peers 1 and 2 (coded once), a small one to 1; the big
            // range from 2 at an odd address (decoded through a bounce range).
            let mut sends = vec![send(d, 1, a, big), send(d, 1, b, small), send(d, 2, a, big)];
            let mut recvs = vec![send(d, 2, b.add(1), big), send(d, 1, b, small)];
            let plan = st.prepare(d, s, DataType::BF16, 0, &from, &mut sends, &mut recvs).unwrap().unwrap();
            let segs = segments(big / 2, 2, seg);
            assert_eq!(segs.len(), 3);
            let caps: Vec<usize> = segs.iter().map(|&(_, m)| compress::max_compressed_len(Dtype::Bf16, m, &Params::default()).unwrap()).collect();
            assert_eq!(sends.len(), 2 * segs.len() + 1);
            assert_eq!(recvs.len(), segs.len() + 1);
            assert_eq!((sends[3].ptr, sends[3].len, sends[3].fill), (b, small, Fill::Exact), "small send untouched, in place");
            assert_eq!((recvs[3].ptr, recvs[3].fill), (b, Fill::Exact));
            let words = plan.len_words.clone().unwrap();
            let half = words.len() / 2;
            for (i, cap) in caps.iter().enumerate() {
                // Flags in the first half (only ever epochs), lengths in the second: no
                // flag of a later op can find a length there.
                let Fill::Coded { word, flag, .. } = sends[i].fill else { panic!() };
                let Fill::Landed { flag: landed, .. } = recvs[i].fill else { panic!() };
                assert!(flag < half && landed < half && word >= half && word < words.len(), "segment {i}: {:?} {:?}", sends[i].fill, recvs[i].fill);
                let (to1, to2) = (sends[i], sends[4 + i]);
                assert_eq!((to1.peer, to2.peer, to1.len, to1.ptr, to1.fill), (1, 2, *cap, to2.ptr, to2.fill), "segment {i}: one coding for both peers");
                let Fill::Coded { flag, v, .. } = to1.fill else { panic!("segment {i}: {:?}", to1.fill) };
                assert_eq!(v, epoch);
                assert!(plan.coding.iter().any(|x| matches!(*x, Step::Coded { flag: f, v: e } if f == words.dev_addr(flag) && e == epoch)));
                let Fill::Landed { flag, v } = recvs[i].fill else { panic!("segment {i}: {:?}", recvs[i].fill) };
                assert_eq!((recvs[i].peer, recvs[i].len, v), (2, *cap, epoch));
                assert!(plan.decoding.iter().any(|x| matches!(*x, Step::Landed { flag: f, v: e } if f == words.dev_addr(flag) && e == epoch)));
            }
            let mut ranges: Vec<(u64, usize)> = sends[..3].iter().chain(&recvs[..3]).map(|x| (x.ptr.0, x.len)).collect();
            ranges.sort_unstable();
            assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 as u64 <= w[1].0), "distinct staging ranges");
            // The decodes write the user's range through the bounce range, segment by segment.
            let bounced: usize = plan.decoding.iter().filter_map(|x| if let Step::Decompress(d) = x { d.bounce_to.map(|(_, l)| l) } else { None }).sum();
            assert_eq!(bounced, big);
            // Not submitted: abandoning raises its landed flags.
            plan.abandon();
            for x in &recvs[..3] {
                let Fill::Landed { flag, v } = x.fill else { unreachable!() };
                assert_eq!(words.load(flag), v);
            }
        }
        // Without a setting (a reduction's exchange) or for a reduction's AllGather: whole.
        for whole in [false, true] {
            if whole {
                st.whole_streams_next();
                st.segment_next(seg);
            }
            let mut sends = vec![send(d, 1, a, big)];
            let plan = st.prepare(d, s, DataType::BF16, 0, &from, &mut sends, &mut vec![]).unwrap().unwrap();
            let half = plan.len_words.as_ref().map_or(0, |w| w.len() / 2);
            assert!(sends.len() == 1 && matches!(sends[0].fill, Fill::Word(i) if i >= half), "{whole}: {sends:?}");
        }
        d.synchronize(s).unwrap();
        st.release(d, true);
        for p in [a, b] {
            d.free(p).unwrap();
        }
    }
}

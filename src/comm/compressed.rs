//! The `compressed` engine's data movement (`HOCCL_ENGINE=compressed`): every transfer to a
//! peer of bf16, f16 or f32 data of at least [`MIN_BYTES`] crosses as a codec stream
//! (`BFX1`/`HFX1`/`FFX1`, docs/design.md "Codec format"), so fewer bytes cross the link.
//!
//! On the caller's stream, before the handshake: each distinct send range is compressed
//! (SMs) into this stream's staging buffer, and the stream's length is written to a
//! host-visible word. The engine moves the compressed stream with the copy engines into
//! the receiver's staging buffer, reading the length when the stream reaches the op
//! (`Fill::Word`; the receiver accepts up to the bound, `Fill::UpTo`). After the
//! handshake's wait, each received stream is decompressed into the user's buffer. Copies to
//! self stay plain copies on the stream. Both sides decide from what they share (the
//! engine, the dtype and the byte count), so a send is compressed exactly when its receive
//! is; both sides size the staging range with the same bound, so mismatched counts are
//! still caught by the engine's length check.
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
use crate::device::{Allocation, DevPtr, Device, FlagSlab, StreamHandle};
use crate::engine::{Fill, Transfer};
use crate::error::Result;
use crate::types::DataType;
use std::collections::HashMap;
use std::sync::Arc;

/// Transfers smaller than this move raw: below it the codec kernels' fixed cost (two
/// launches each side) outweighs the bytes saved.
pub const MIN_BYTES: usize = 64 << 10;
/// Decompression status words, reused round robin.
pub const STATUS_SLOTS: usize = 256;
/// Staging ranges start at multiples of this.
const ALIGN: usize = 256;

struct StreamStaging {
    buf: DevPtr,
    cap: usize,
    alloc: Allocation,
    /// Length words of the compressed sends (one per distinct send range of an op).
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

/// What an op on the compressed path still enqueues after its handshake, and the words its
/// compressed sends read their lengths from.
pub(super) struct Plan {
    dtype: Dtype,
    decompress: Vec<Decompress>,
    pub len_words: Option<Arc<FlagSlab>>,
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
        sends: &mut [Transfer],
        recvs: &mut [Transfer],
    ) -> Result<Option<Plan>> {
        const OP: &str = "compressed engine";
        let Ok(cdt) = Dtype::from_data_type(OP, dtype) else {
            return Ok(None);
        };
        if !sends.iter().chain(recvs.iter()).any(|x| eligible(x, me, from)) {
            return Ok(None);
        }
        let vs = cdt.size();
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
                *x = Transfer { peer: x.peer, ptr: p.buf, len: p.cap, alloc: Some(p.alloc), fill: Fill::Word(0) };
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
        let (base, alloc, words) = (st.buf, st.alloc, st.words.clone());
        // Compress each source once (AllGather and Broadcast send one range to every peer).
        for (i, (&(ptr, len), &(off, cap, bounce))) in sources.iter().zip(&src_at).enumerate() {
            let input = match bounce {
                Some(b) => {
                    dev.memcpy_async(stream, base.add(b), ptr, len)?;
                    base.add(b)
                }
                None => ptr,
            };
            compress::compress_async(dev, stream, cdt, input, len / vs, base.add(off), cap, words.dev_addr(i), &params)?;
            for x in sends.iter_mut().filter(|x| eligible(x, me, from) && (x.ptr, x.len) == (ptr, len)) {
                *x = Transfer { peer: x.peer, ptr: base.add(off), len: cap, alloc: Some(alloc), fill: Fill::Word(i) };
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
            recvs[i] = Transfer { peer: x.peer, ptr: base.add(off), len: cap, alloc: Some(alloc), fill: Fill::UpTo };
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
        Ok(Some(Plan { dtype: cdt, decompress, len_words }))
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
    pub(super) fn precompressed(&mut self, p: Option<Precompressed>) {
        self.pre = p;
    }

    /// The staging of `stream`, grown to `bytes` and `nwords` length words if needed.
    fn staging(&mut self, dev: &dyn Device, stream: StreamHandle, bytes: usize, nwords: usize) -> Result<&StreamStaging> {
        let fits = self.streams.get(&stream).is_some_and(|s| s.cap >= bytes && s.words.len() >= nwords);
        if !fits {
            let (cap, nw) = match self.streams.get(&stream) {
                Some(s) => (if s.cap >= bytes { s.cap } else { bytes.max(2 * s.cap) }, nwords.max(s.words.len())),
                None => (bytes, nwords.max(16)),
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
            compress::decompress_async(dev, stream, self.dtype, d.src, d.src_len, d.out, d.n, d.status)?;
            if let Some((dst, len)) = d.bounce_to {
                dev.memcpy_async(stream, dst, d.out, len)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendChoice;

    fn send(dev: &dyn Device, peer: usize, ptr: DevPtr, len: usize) -> Transfer {
        Transfer { peer, ptr, len, alloc: Some(dev.allocation(ptr).unwrap()), fill: Fill::Exact }
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
        let plan = st.prepare(d, s, DataType::BF16, 0, &from, &mut sends, &mut []).unwrap().unwrap();
        for x in &sends {
            assert_eq!((x.ptr, x.len, x.alloc, x.fill), (buf, cap, Some(alloc), Fill::Word(0)), "peer {}", x.peer);
        }
        assert!(plan.len_words.as_ref().is_some_and(|w| Arc::ptr_eq(w, &words)), "the length word is the registered one");
        assert!(st.pre.is_none(), "used once");
        // Another stream, or another source beside it: compressed as usual, registration dropped.
        let t = d.create_stream().unwrap();
        for (stream, mut sends) in [(t, vec![send(d, 1, shard, len)]), (s, vec![send(d, 1, shard, len), send(d, 2, other, len)])] {
            st.precompressed(Some(pre(s)));
            let plan = st.prepare(d, stream, DataType::BF16, 0, &from, &mut sends, &mut []).unwrap().unwrap();
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
}

//! The CPU reference encoder and decoder of `BFX1`/`HFX1`/`FFX1` (see `format.rs`).
//! The decoder validates everything it reads and never indexes out of bounds: every slice
//! it touches was sized from checked header fields first.
use super::format::{
    block_count, block_offsets, check_block, groups, header_bytes, pad4, raw_block_bytes, rd32, BlockHeader, Dtype,
    Layout, StreamHeader, STREAM_HEADER_BYTES,
};
use super::select::{choose, Choice};
use crate::error::{Error, Result};

// ---------------------------------------------------------------- value split -------------

/// Exponent of a value (the value is the little-endian u16/u32 widened to u32).
#[inline]
pub fn exponent(dt: Dtype, v: u32) -> u32 {
    match dt {
        Dtype::Bf16 => (v >> 7) & 0xff,
        Dtype::F16 => (v >> 10) & 0x1f,
        Dtype::F32 => (v >> 23) & 0xff,
    }
}

#[inline]
fn with_exponent(dt: Dtype, rest: u32, e: u32) -> u32 {
    match dt {
        Dtype::Bf16 => rest | (e << 7),
        Dtype::F16 => rest | (e << 10),
        Dtype::F32 => rest | (e << 23),
    }
}

fn load(dt: Dtype, src: &[u8], i: usize) -> u32 {
    match dt {
        Dtype::Bf16 | Dtype::F16 => u16::from_le_bytes([src[2 * i], src[2 * i + 1]]) as u32,
        Dtype::F32 => u32::from_le_bytes([src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3]]),
    }
}

fn store(dt: Dtype, dst: &mut [u8], i: usize, v: u32) {
    let s = dt.size();
    dst[s * i..s * i + s].copy_from_slice(&v.to_le_bytes()[..s]);
}

/// Writes the payload section(s) of `vals` at `out[0..payload_bytes]` (zero padded).
fn write_payload(dt: Dtype, vals: &[u32], out: &mut [u8]) {
    let nb = vals.len();
    out.fill(0);
    match dt {
        Dtype::Bf16 => {
            for (o, &v) in out.iter_mut().zip(vals) {
                *o = (((v >> 8) & 0x80) | (v & 0x7f)) as u8;
            }
        }
        Dtype::F16 => {
            let (top, lo) = out.split_at_mut(12 * groups(nb));
            for (g, chunk) in vals.chunks(32).enumerate() {
                let mut w = [0u32; 3];
                for (i, &v) in chunk.iter().enumerate() {
                    let t = ((v >> 13) & 4) | ((v >> 8) & 3);
                    for (b, wb) in w.iter_mut().enumerate() {
                        *wb |= ((t >> b) & 1) << i;
                    }
                }
                for (b, wb) in w.iter().enumerate() {
                    top[4 * (3 * g + b)..][..4].copy_from_slice(&wb.to_le_bytes());
                }
            }
            for (o, &v) in lo.iter_mut().zip(vals) {
                *o = v as u8;
            }
        }
        Dtype::F32 => {
            let (hi, lo) = out.split_at_mut(pad4(nb));
            for (i, &v) in vals.iter().enumerate() {
                hi[i] = (((v >> 24) & 0x80) | ((v >> 16) & 0x7f)) as u8;
                lo[2 * i..2 * i + 2].copy_from_slice(&(v as u16).to_le_bytes());
            }
        }
    }
}

/// Reads the payload back into `rest` (the values without their exponent bits).
fn read_payload(dt: Dtype, p: &[u8], rest: &mut [u32]) {
    let nb = rest.len();
    match dt {
        Dtype::Bf16 => {
            for (r, &b) in rest.iter_mut().zip(p) {
                let b = b as u32;
                *r = ((b & 0x80) << 8) | (b & 0x7f);
            }
        }
        Dtype::F16 => {
            let (top, lo) = p.split_at(12 * groups(nb));
            for (i, r) in rest.iter_mut().enumerate() {
                let (g, lane) = (i / 32, i % 32);
                let mut t = 0;
                for b in 0..3 {
                    t |= ((rd32(top, 4 * (3 * g + b)) >> lane) & 1) << b;
                }
                *r = ((t & 4) << 13) | ((t & 3) << 8) | lo[i] as u32;
            }
        }
        Dtype::F32 => {
            let (hi, lo) = p.split_at(pad4(nb));
            for (i, r) in rest.iter_mut().enumerate() {
                let h = hi[i] as u32;
                *r = ((h & 0x80) << 24) | ((h & 0x7f) << 16) | u16::from_le_bytes([lo[2 * i], lo[2 * i + 1]]) as u32;
            }
        }
    }
}

// ---------------------------------------------------------------- encoder -----------------

/// Encoder parameters. `block = 0` means the dtype's default (32 KiB of input per block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Values per block (a multiple of 32, at most 2^24), 0 for the default.
    pub block: u32,
    /// 1: one tier (`k2 = 0` always); 2: the encoder may use a second tier.
    pub tiers: u8,
}

impl Default for Params {
    fn default() -> Self {
        Params { block: 0, tiers: 2 }
    }
}

impl Params {
    pub fn block_for(&self, dt: Dtype) -> u32 {
        if self.block == 0 {
            dt.default_block()
        } else {
            self.block
        }
    }
    pub fn check(&self, op: &'static str, dt: Dtype) -> Result<u32> {
        if self.tiers != 1 && self.tiers != 2 {
            return Err(Error::invalid_arg(op, format!("tiers must be 1 or 2, not {}", self.tiers)));
        }
        let b = self.block_for(dt);
        check_block(op, b)?;
        Ok(b)
    }
}

/// Encodes `input` (raw little-endian values of `dt`) into `out`, which must hold
/// `max_stream_len`; returns the stream's length.
pub fn encode_into(dt: Dtype, input: &[u8], out: &mut [u8], p: &Params) -> Result<usize> {
    const OP: &str = "compress";
    let b = p.check(OP, dt)?;
    if input.len() % dt.size() != 0 {
        return Err(Error::invalid_arg(
            OP,
            format!("{} input bytes are not a whole number of {}", input.len(), dt.name()),
        ));
    }
    let n = (input.len() / dt.size()) as u64;
    let need = super::format::max_stream_len(OP, dt, n, b)?;
    if out.len() < need {
        return Err(Error::invalid_arg(OP, format!("output of {} bytes, {need} needed", out.len())));
    }
    let nblocks = block_count(OP, n, b)?;
    let hdr = StreamHeader { dtype: dt, n, block: b, nblocks };
    out[..STREAM_HEADER_BYTES].copy_from_slice(&hdr.to_bytes());
    let mut off = header_bytes(nblocks);
    let mut scratch = Scratch::default();
    let vb = b as usize * dt.size();
    for (j, src) in input.chunks(vb).enumerate() {
        let bytes = encode_block(dt, src, p.tiers == 2, &mut out[off..], &mut scratch);
        out[STREAM_HEADER_BYTES + 4 * j..][..4].copy_from_slice(&(bytes as u32).to_le_bytes());
        off += bytes;
    }
    Ok(off)
}

#[derive(Default)]
struct Scratch {
    vals: Vec<u32>,
    exps: Vec<u8>,
    code1: Vec<u8>,
    esc: Vec<(u8, u8)>, // (tier-2 code or T2, exponent) of each escape, in value order
}

/// Encodes one block into the front of `out`; returns its size.
fn encode_block(dt: Dtype, src: &[u8], two_tiers: bool, out: &mut [u8], s: &mut Scratch) -> usize {
    let nb = src.len() / dt.size();
    s.vals.clear();
    s.vals.extend((0..nb).map(|i| load(dt, src, i)));
    s.exps.clear();
    s.exps.extend(s.vals.iter().map(|&v| exponent(dt, v) as u8));
    let c = choose(dt, &s.exps, two_tiers);
    let (t1, t2) = (c.t1(), c.t2());
    s.code1.clear();
    s.esc.clear();
    for &e in &s.exps {
        let r = c.rank[e as usize] as usize;
        if r < t1 {
            s.code1.push(r as u8);
        } else {
            s.code1.push(t1 as u8);
            s.esc.push((if r < t1 + t2 { (r - t1) as u8 } else { t2 as u8 }, e));
        }
    }
    let n_esc1 = s.esc.len();
    let n_raw = if c.k2 == 0 { n_esc1 } else { s.esc.iter().filter(|x| x.0 as usize == t2).count() };
    let h = BlockHeader { k1: c.k1, k2: c.k2, n_raw: n_raw as u32, n_esc1: n_esc1 as u32 };
    let l = Layout::new(dt, &h, nb);
    let raw_len = raw_block_bytes(dt, nb);
    if l.end >= raw_len {
        out[..raw_len].fill(0);
        out[8..8 + src.len()].copy_from_slice(src);
        return raw_len;
    }
    write_coded(dt, &c, &h, &l, s, &mut out[..l.end]);
    l.end
}

fn write_coded(dt: Dtype, c: &Choice, h: &BlockHeader, l: &Layout, s: &Scratch, out: &mut [u8]) {
    out.fill(0);
    let [w0, w1] = h.words();
    out[0..4].copy_from_slice(&w0.to_le_bytes());
    out[4..8].copy_from_slice(&w1.to_le_bytes());
    out[l.table..l.table + c.table.len()].copy_from_slice(&c.table);
    put_planes(&mut out[l.planes1..l.planes2], s.code1.iter().copied(), h.k1);
    if h.k2 > 0 {
        put_planes(&mut out[l.planes2..l.raw], s.esc.iter().map(|x| x.0), h.k2);
    }
    let t2 = c.t2() as u8;
    let raws = s.esc.iter().filter(|x| h.k2 == 0 || x.0 == t2).map(|x| x.1);
    for (o, e) in out[l.raw..l.payload].iter_mut().zip(raws) {
        *o = e;
    }
    write_payload(dt, &s.vals, &mut out[l.payload..l.end]);
}

/// Bit planes of `k`-bit codes: bit i of word `g*k + b` is bit b of code 32g+i.
fn put_planes(out: &mut [u8], codes: impl Iterator<Item = u8>, k: u32) {
    let k = k as usize;
    let mut w = [0u32; 8];
    let mut g = 0;
    let flush = |w: &mut [u32; 8], g: usize, out: &mut [u8]| {
        for b in 0..k {
            out[4 * (g * k + b)..][..4].copy_from_slice(&w[b].to_le_bytes());
            w[b] = 0;
        }
    };
    let mut lane = 0;
    for code in codes {
        for (b, wb) in w.iter_mut().enumerate().take(k) {
            *wb |= ((code as u32 >> b) & 1) << lane;
        }
        lane += 1;
        if lane == 32 {
            flush(&mut w, g, out);
            g += 1;
            lane = 0;
        }
    }
    if lane > 0 {
        flush(&mut w, g, out);
    }
}

// ---------------------------------------------------------------- decoder -----------------

/// Decodes a whole stream into `out` (`n * size` bytes, `n` from the header, which
/// [`peek`] returns). Errors on anything corrupt or truncated; `out` is then unspecified.
pub fn decode_into(stream: &[u8], out: &mut [u8]) -> Result<StreamHeader> {
    const OP: &str = "decompress";
    let h = StreamHeader::parse(OP, stream)?;
    let offs = block_offsets(OP, &h, stream)?;
    let need = h.n as usize * h.dtype.size();
    if out.len() != need {
        return Err(Error::invalid_arg(
            OP,
            format!("output of {} bytes for {} values of {}", out.len(), h.n, h.dtype.name()),
        ));
    }
    let mut esc = Vec::new();
    let vb = h.block as usize * h.dtype.size();
    for (j, (&off, dst)) in offs.iter().zip(out.chunks_mut(vb)).enumerate() {
        let bytes = rd32(stream, STREAM_HEADER_BYTES + 4 * j) as usize;
        decode_block(h.dtype, &stream[off..off + bytes], dst, &mut esc)
            .map_err(|e| Error::corrupt(OP, format!("block {j}: {}", what(&e))))?;
    }
    Ok(h)
}

fn what(e: &Error) -> String {
    match e {
        Error::CorruptData { what, .. } => what.clone(),
        other => other.to_string(),
    }
}

/// The stream header of `stream`, checked (nothing else is).
pub fn peek(stream: &[u8]) -> Result<StreamHeader> {
    StreamHeader::parse("decompress", stream)
}

/// Decodes block `blk` (exactly its `block_bytes`) into `dst` (`nb * size` bytes).
fn decode_block(dt: Dtype, blk: &[u8], dst: &mut [u8], esc: &mut Vec<u8>) -> Result<()> {
    const OP: &str = "decompress";
    let nb = dst.len() / dt.size();
    let h = BlockHeader::parse(OP, rd32(blk, 0), rd32(blk, 4), nb)?;
    let l = Layout::new(dt, &h, nb);
    if l.end != blk.len() {
        return Err(Error::corrupt(OP, format!("{} bytes where its header implies {}", blk.len(), l.end)));
    }
    if h.is_raw() {
        dst.copy_from_slice(&blk[8..8 + dst.len()]);
        return Ok(());
    }
    let nsym = dt.symbols() as u32;
    let (t1, t2) = (h.t1(), h.t2());
    let table = &blk[l.table..l.table + t1 + t2];
    if let Some(bad) = table.iter().find(|&&e| e as u32 >= nsym) {
        return Err(Error::corrupt(OP, format!("table symbol {bad} outside the exponent range")));
    }
    escape_exponents(dt, &h, &l, blk, esc)?;
    let planes = &blk[l.planes1..l.planes2];
    let mut rest = vec![0u32; nb];
    read_payload(dt, &blk[l.payload..l.end], &mut rest);
    let k1 = h.k1 as usize;
    let mut ordinal = 0usize;
    for (i, r) in rest.iter().enumerate() {
        let (g, lane) = (i / 32, i % 32);
        let mut code = 0usize;
        for b in 0..k1 {
            code |= ((rd32(planes, 4 * (g * k1 + b)) >> lane) as usize & 1) << b;
        }
        let e = if code < t1 {
            table[code]
        } else {
            let e = *esc.get(ordinal).ok_or_else(|| Error::corrupt(OP, format!("more than {} escapes", h.n_esc1)))?;
            ordinal += 1;
            e
        };
        store(dt, dst, i, with_exponent(dt, *r, e as u32));
    }
    if ordinal != h.n_esc1 as usize {
        return Err(Error::corrupt(OP, format!("{ordinal} escapes where the header says {}", h.n_esc1)));
    }
    Ok(())
}

/// The exponent of every escape (tier 2 or raw), checked.
fn escape_exponents(dt: Dtype, h: &BlockHeader, l: &Layout, blk: &[u8], esc: &mut Vec<u8>) -> Result<()> {
    const OP: &str = "decompress";
    let nsym = dt.symbols() as u32;
    let raw = &blk[l.raw..l.raw + h.n_raw as usize];
    if let Some(bad) = raw.iter().find(|&&e| e as u32 >= nsym) {
        return Err(Error::corrupt(OP, format!("raw exponent {bad} outside the exponent range")));
    }
    esc.clear();
    if h.k2 == 0 {
        esc.extend_from_slice(raw);
        return Ok(());
    }
    let (t1, t2, k2) = (h.t1(), h.t2(), h.k2 as usize);
    let planes = &blk[l.planes2..l.raw];
    let mut nraw = 0usize;
    for o in 0..h.n_esc1 as usize {
        let (g, lane) = (o / 32, o % 32);
        let mut code = 0usize;
        for b in 0..k2 {
            code |= ((rd32(planes, 4 * (g * k2 + b)) >> lane) as usize & 1) << b;
        }
        if code < t2 {
            esc.push(blk[l.table + t1 + code]);
        } else {
            let e = *raw.get(nraw).ok_or_else(|| Error::corrupt(OP, format!("more than {} raw exponents", h.n_raw)))?;
            esc.push(e);
            nraw += 1;
        }
    }
    if nraw != h.n_raw as usize {
        return Err(Error::corrupt(OP, format!("{nraw} raw exponents where the header says {}", h.n_raw)));
    }
    Ok(())
}

// ---------------------------------------------------------------- inspection --------------

/// One block as `hoccl-zip stats` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    pub values: usize,
    pub bytes: usize,
    pub header: BlockHeader,
}

/// The stream header and every block's header, checked (bodies are not decoded).
pub fn inspect(stream: &[u8]) -> Result<(StreamHeader, Vec<BlockInfo>)> {
    const OP: &str = "stats";
    let h = StreamHeader::parse(OP, stream)?;
    let offs = block_offsets(OP, &h, stream)?;
    let mut v = Vec::with_capacity(offs.len());
    for (j, &off) in offs.iter().enumerate() {
        let bytes = rd32(stream, STREAM_HEADER_BYTES + 4 * j) as usize;
        let nb = h.block_values(j as u32);
        let bh = BlockHeader::parse(OP, rd32(stream, off), rd32(stream, off + 4), nb)?;
        if Layout::new(h.dtype, &bh, nb).end != bytes {
            return Err(Error::corrupt(OP, format!("block {j}: size {bytes} disagrees with its header")));
        }
        v.push(BlockInfo { values: nb, bytes, header: bh });
    }
    Ok((h, v))
}

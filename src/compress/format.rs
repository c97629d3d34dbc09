//! The `BFX1`/`HFX1`/`FFX1` stream formats: constants, headers, exact section sizes and the
//! validation every decoder applies. `docs/design.md` ("Codec format") is the long form; this is the contract.
//!
//! ## Stream (all three dtypes; little-endian, every section padded with zeros to 4 bytes)
//!
//! | offset | field | meaning |
//! | --- | --- | --- |
//! | 0 | `u32 magic` | `0x31584642` "BFX1" (bf16), `0x31584648` "HFX1" (fp16), `0x31584646` "FFX1" (fp32) |
//! | 4 | `u32 version` | 1 |
//! | 8 | `u64 n` | number of values |
//! | 16 | `u32 B` | values per block: a multiple of 32, `32 <= B <= 2^24` |
//! | 20 | `u32 nblocks` | `ceil(n / B)` |
//! | 24 | `u32 block_bytes[nblocks]` | size of each block, a multiple of 4 |
//! | 24 + 4·nblocks | blocks | back to back; block j holds values `[jB, min(n, (j+1)B))` |
//!
//! A block never exceeds its slot, `8 + size·B` bytes (`size` = bytes per value), so an
//! encoder can size its output before it sees the data ([`max_stream_len`]).
//!
//! ## Block of `nb` values, `G = ceil(nb/32)` groups (lane i of group g is value 32g+i)
//!
//! `word0` = k1 (bits 0–2) | k2 (bits 3–5) | reserved 0 (bits 6–7) | n_raw (bits 8–31);
//! `word1` = n_esc1 (bits 0–23) | reserved 0 (bits 24–31).
//!
//! * **raw block**: `word0 = word1 = 0`, then the `nb` values verbatim (`size` bytes each).
//! * **coded block**: `1 <= k1`, `T1 = 2^k1 - 1`, `T2 = 2^k2 - 1` (0 when `k2 = 0`),
//!   `T1 + T2 <= 31`, `n_raw <= n_esc1 <= nb`, and `n_raw == n_esc1` when `k2 = 0`. Sections:
//!   1. table: `T1 + T2` exponent bytes (tier 1, then tier 2);
//!   2. planes1: `G·k1` words; bit i of word `g·k1 + b` is bit b of the tier-1 code of value
//!      32g+i. Code `c < T1` means exponent `table[c]`; code `T1` is an escape;
//!   3. planes2 (k2 > 0): `ceil(n_esc1/32)·k2` words, same layout indexed by escape ordinal
//!      (escapes counted in value order). Code `c < T2` means `table[T1 + c]`; `T2` is raw;
//!   4. raw: `n_raw` exponent bytes of the values whose last code was an escape, in value order;
//!   5. the rest of each value, raw (the dtype's *payload*):
//!      * bf16: `nb` bytes `(sign << 7) | mantissa7`;
//!      * fp16: `G·3` words of "top" bit planes (bit i of word `3g + b` is bit b of
//!        `(sign << 2) | (mantissa10 >> 8)` of value 32g+i), then `nb` bytes `mantissa10 & 0xff`;
//!      * fp32: `nb` bytes `(sign << 7) | (mantissa23 >> 16)`, then `nb` u16 `mantissa23 & 0xffff`.
//!
//! Exponent fields are 8 bits (bf16, fp32) or 5 bits (fp16; table and raw bytes must be < 32).
//! Decoders ignore padding bytes and the codes of missing lanes of the last group; encoders
//! write zeros there.
use crate::error::{Error, Result};

/// The stream header's fixed part (before `block_bytes`).
pub const STREAM_HEADER_BYTES: usize = 24;
/// Block header: `word0`, `word1`.
pub const BLOCK_HEADER_BYTES: usize = 8;
pub const VERSION: u32 = 1;
/// Largest `B` the format allows.
pub const MAX_BLOCK: u32 = 1 << 24;
/// Largest table (`T1 + T2`).
pub const MAX_TABLE: usize = 31;

/// The element types the codec handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
}

impl Dtype {
    pub const ALL: [Dtype; 3] = [Dtype::Bf16, Dtype::F16, Dtype::F32];

    pub fn magic(self) -> u32 {
        match self {
            Dtype::Bf16 => 0x3158_4642,
            Dtype::F16 => 0x3158_4648,
            Dtype::F32 => 0x3158_4646,
        }
    }
    pub fn from_magic(m: u32) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.magic() == m)
    }
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }
    /// Width of the exponent field in bits.
    pub fn exp_bits(self) -> u32 {
        match self {
            Dtype::Bf16 | Dtype::F32 => 8,
            Dtype::F16 => 5,
        }
    }
    /// Number of distinct exponent symbols.
    pub fn symbols(self) -> usize {
        1 << self.exp_bits()
    }
    /// Default values per block: 32 KiB of input.
    pub fn default_block(self) -> u32 {
        (32768 / self.size()) as u32
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        }
    }
    pub fn parse(s: &str) -> Option<Dtype> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(Dtype::Bf16),
            "f16" | "fp16" | "float16" | "half" => Some(Dtype::F16),
            "f32" | "fp32" | "float32" | "float" => Some(Dtype::F32),
            _ => None,
        }
    }
    /// Bytes of the payload section(s) of a coded block of `nb` values.
    pub fn payload_bytes(self, nb: usize) -> usize {
        match self {
            Dtype::Bf16 => pad4(nb),
            Dtype::F16 => 12 * groups(nb) + pad4(nb),
            Dtype::F32 => pad4(nb) + pad4(2 * nb),
        }
    }
}

pub fn pad4(x: usize) -> usize {
    (x + 3) & !3
}
pub fn groups(nb: usize) -> usize {
    nb.div_ceil(32)
}

/// `T = 2^k - 1`, 0 for `k = 0`.
pub fn tier_size(k: u32) -> usize {
    (1usize << k) - 1
}

/// Widths and escape counts of one block, as stored in its two header words.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockHeader {
    /// 0: raw block.
    pub k1: u32,
    /// 0: one tier.
    pub k2: u32,
    pub n_raw: u32,
    pub n_esc1: u32,
}

impl BlockHeader {
    pub const RAW: BlockHeader = BlockHeader { k1: 0, k2: 0, n_raw: 0, n_esc1: 0 };

    pub fn is_raw(&self) -> bool {
        self.k1 == 0
    }
    pub fn t1(&self) -> usize {
        tier_size(self.k1)
    }
    pub fn t2(&self) -> usize {
        tier_size(self.k2)
    }
    pub fn words(&self) -> [u32; 2] {
        [self.k1 | (self.k2 << 3) | (self.n_raw << 8), self.n_esc1]
    }
    /// Parse and check the header words of a block of `nb` values (everything that does not
    /// need the block's body).
    pub fn parse(op: &'static str, w0: u32, w1: u32, nb: usize) -> Result<BlockHeader> {
        let h = BlockHeader { k1: w0 & 7, k2: (w0 >> 3) & 7, n_raw: w0 >> 8, n_esc1: w1 & 0x00ff_ffff };
        if w0 & 0xc0 != 0 || w1 >> 24 != 0 {
            return Err(Error::corrupt(op, format!("block header reserved bits set ({w0:#x}, {w1:#x})")));
        }
        if h.k1 == 0 {
            if w0 != 0 || w1 != 0 {
                return Err(Error::corrupt(op, "raw block with nonzero header fields"));
            }
            return Ok(h);
        }
        if h.t1() + h.t2() > MAX_TABLE {
            return Err(Error::corrupt(op, format!("table of {} entries (k1 {}, k2 {})", h.t1() + h.t2(), h.k1, h.k2)));
        }
        if h.n_esc1 as usize > nb || h.n_raw > h.n_esc1 || (h.k2 == 0 && h.n_raw != h.n_esc1) {
            return Err(Error::corrupt(
                op,
                format!("escape counts n_esc1 {} n_raw {} for {nb} values (k2 {})", h.n_esc1, h.n_raw, h.k2),
            ));
        }
        Ok(h)
    }
}

/// Byte offsets of the sections of a coded block, relative to the block start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub table: usize,
    pub planes1: usize,
    pub planes2: usize,
    pub raw: usize,
    pub payload: usize,
    /// Total block bytes.
    pub end: usize,
}

impl Layout {
    pub fn new(dtype: Dtype, h: &BlockHeader, nb: usize) -> Layout {
        if h.is_raw() {
            let end = raw_block_bytes(dtype, nb);
            return Layout { table: 8, planes1: 8, planes2: 8, raw: 8, payload: 8, end };
        }
        let table = BLOCK_HEADER_BYTES;
        let planes1 = table + pad4(h.t1() + h.t2());
        let planes2 = planes1 + 4 * groups(nb) * h.k1 as usize;
        let raw = planes2 + 4 * groups(h.n_esc1 as usize) * h.k2 as usize;
        let payload = raw + pad4(h.n_raw as usize);
        let end = payload + dtype.payload_bytes(nb);
        Layout { table, planes1, planes2, raw, payload, end }
    }
}

/// Bytes of a raw block of `nb` values.
pub fn raw_block_bytes(dtype: Dtype, nb: usize) -> usize {
    BLOCK_HEADER_BYTES + pad4(dtype.size() * nb)
}

/// The largest block of `b` values (its slot).
pub fn max_block_bytes(dtype: Dtype, b: u32) -> usize {
    BLOCK_HEADER_BYTES + dtype.size() * b as usize
}

/// Checks `b` (values per block) against the format's rules.
pub fn check_block(op: &'static str, b: u32) -> Result<()> {
    if b < 32 || b % 32 != 0 || b > MAX_BLOCK {
        return Err(Error::invalid_arg(op, format!("block size {b}: must be a multiple of 32 in 32..=2^24")));
    }
    Ok(())
}

/// `ceil(n / b)` as the `u32` the header stores, or an error if it does not fit.
pub fn block_count(op: &'static str, n: u64, b: u32) -> Result<u32> {
    u32::try_from(n.div_ceil(b as u64))
        .map_err(|_| Error::invalid_arg(op, format!("{n} values need more than 2^32 blocks of {b}")))
}

/// Header bytes (fixed part + `block_bytes`).
pub fn header_bytes(nblocks: u32) -> usize {
    STREAM_HEADER_BYTES + 4 * nblocks as usize
}

/// An upper bound of the stream for `n` values in blocks of `b` (every block raw).
pub fn max_stream_len(op: &'static str, dtype: Dtype, n: u64, b: u32) -> Result<usize> {
    check_block(op, b)?;
    let nblocks = block_count(op, n, b)?;
    (n as usize)
        .checked_mul(dtype.size())
        .and_then(|v| v.checked_add(header_bytes(nblocks)))
        .and_then(|v| v.checked_add(nblocks as usize * (BLOCK_HEADER_BYTES + 3)))
        .ok_or_else(|| Error::invalid_arg(op, format!("{n} values overflow the address space")))
}

/// The parsed stream header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamHeader {
    pub dtype: Dtype,
    pub n: u64,
    pub block: u32,
    pub nblocks: u32,
}

impl StreamHeader {
    pub fn to_bytes(&self) -> [u8; STREAM_HEADER_BYTES] {
        let mut h = [0u8; STREAM_HEADER_BYTES];
        h[0..4].copy_from_slice(&self.dtype.magic().to_le_bytes());
        h[4..8].copy_from_slice(&VERSION.to_le_bytes());
        h[8..16].copy_from_slice(&self.n.to_le_bytes());
        h[16..20].copy_from_slice(&self.block.to_le_bytes());
        h[20..24].copy_from_slice(&self.nblocks.to_le_bytes());
        h
    }

    /// Parse and check the fixed header of the stream `s` (its `block_bytes` array must fit
    /// in `s`).
    pub fn parse(op: &'static str, s: &[u8]) -> Result<StreamHeader> {
        if s.len() < STREAM_HEADER_BYTES {
            return Err(Error::corrupt(op, format!("stream of {} bytes is shorter than its header", s.len())));
        }
        let magic = rd32(s, 0);
        let dtype = Dtype::from_magic(magic).ok_or_else(|| Error::corrupt(op, format!("bad magic {magic:#010x}")))?;
        let version = rd32(s, 4);
        if version != VERSION {
            return Err(Error::corrupt(op, format!("unsupported version {version}")));
        }
        let n = u64::from_le_bytes(s[8..16].try_into().unwrap_or_default());
        let block = rd32(s, 16);
        let nblocks = rd32(s, 20);
        check_block(op, block).map_err(|_| Error::corrupt(op, format!("bad block size {block}")))?;
        if n.div_ceil(block as u64) != nblocks as u64 {
            return Err(Error::corrupt(op, format!("{nblocks} blocks cannot hold {n} values of {block} per block")));
        }
        if s.len() < header_bytes(nblocks) {
            return Err(Error::corrupt(op, format!("stream of {} bytes truncated inside its block table", s.len())));
        }
        Ok(StreamHeader { dtype, n, block, nblocks })
    }

    /// Values in block `j`.
    pub fn block_values(&self, j: u32) -> usize {
        let start = j as u64 * self.block as u64;
        (self.n - start).min(self.block as u64) as usize
    }
}

/// Little-endian u32 at `off` (the caller has checked the bounds).
pub fn rd32(s: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([s[off], s[off + 1], s[off + 2], s[off + 3]])
}

/// The `block_bytes` entries checked against the stream: each within its slot and a
/// multiple of 4, large enough for its values, and all of them ending exactly at
/// `s.len()`. Returns the start offset of every block.
pub fn block_offsets(op: &'static str, h: &StreamHeader, s: &[u8]) -> Result<Vec<usize>> {
    let mut offs = Vec::with_capacity(h.nblocks as usize);
    let mut off = header_bytes(h.nblocks);
    for j in 0..h.nblocks {
        let bytes = rd32(s, STREAM_HEADER_BYTES + 4 * j as usize) as usize;
        let nb = h.block_values(j);
        // Every block stores at least one payload byte per value, so these bounds also cap
        // `n` by the input length before anything is allocated.
        if bytes % 4 != 0 || bytes < BLOCK_HEADER_BYTES + nb || bytes > max_block_bytes(h.dtype, h.block) {
            return Err(Error::corrupt(op, format!("block {j}: size {bytes} impossible for {nb} values")));
        }
        offs.push(off);
        off = off.checked_add(bytes).filter(|e| *e <= s.len()).ok_or_else(|| {
            Error::corrupt(op, format!("block {j} runs past the end of the stream ({} bytes)", s.len()))
        })?;
    }
    if off != s.len() {
        return Err(Error::corrupt(op, format!("{} trailing bytes after the last block", s.len() - off)));
    }
    Ok(offs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_spells_the_name() {
        assert_eq!(&Dtype::Bf16.magic().to_le_bytes(), b"BFX1");
        assert_eq!(&Dtype::F16.magic().to_le_bytes(), b"HFX1");
        assert_eq!(&Dtype::F32.magic().to_le_bytes(), b"FFX1");
    }

    #[test]
    fn layout_of_a_coded_block() {
        let h = BlockHeader { k1: 3, k2: 2, n_raw: 5, n_esc1: 40 };
        let l = Layout::new(Dtype::Bf16, &h, 100);
        assert_eq!(l.planes1, 8 + 12); // table 7 + 3 = 10 -> 12
        assert_eq!(l.planes2, l.planes1 + 4 * 4 * 3);
        assert_eq!(l.raw, l.planes2 + 4 * 2 * 2);
        assert_eq!(l.payload, l.raw + 8);
        assert_eq!(l.end, l.payload + 100);
        assert_eq!(h.words(), [3 | (2 << 3) | (5 << 8), 40]);
        assert_eq!(BlockHeader::parse("t", h.words()[0], h.words()[1], 100).unwrap(), h);
    }

    #[test]
    fn header_checks() {
        assert!(BlockHeader::parse("t", 5 | (1 << 3), 0, 32).is_err()); // 31 + 1 > 31
        assert!(BlockHeader::parse("t", 3 | (4 << 8), 5, 32).is_err()); // one tier, n_raw != n_esc1
        assert!(BlockHeader::parse("t", 3, 33, 32).is_err()); // more escapes than values
        assert!(BlockHeader::parse("t", 0x40 | 3, 0, 32).is_err());
        assert!(BlockHeader::parse("t", 0, 1, 32).is_err());
        assert!(BlockHeader::parse("t", 0, 0, 32).unwrap().is_raw());
    }
}

//! Reduction operators and the one definition of what a reduction computes, bit for bit.
//! Every engine (host threads, the `sm` CopyReduce kernels, the `compressed` engine's fused
//! kernels) must produce exactly these bits; [`reduce_into`] is the reference the tests
//! compare against.
//!
//! **Order.** The inputs are folded left to right in the order given (the engines give them
//! in rank order 0..n-1): `acc = x0; acc = f(acc, x1); …; acc = f(acc, x(n-1))`, each step
//! rounded to the storage type. `Avg` is the `Sum` fold followed by one division by `n`.
//! `PreMulSum(s)` first replaces every input by `Prod(x_i, s)` (one product step of the
//! rules below, with `x_i` as the accumulator: in f32 and rounded to the storage type for
//! 16- and 8-bit floats, wrapping for integers), then folds those with `Sum`.
//!
//! **Arithmetic per dtype.**
//! - Integers (i8, u8, i32, u32, i64, u64): wrapping sum and product; min/max by value;
//!   avg = wrapping sum divided by `n` with truncation toward zero (signed division for the
//!   signed types).
//! - f32, f64: IEEE binary32/binary64, round to nearest even, no fused multiply-add.
//! - f16, bf16, f8e4m3, f8e5m2: each step widens both operands to f32, computes in f32 and
//!   rounds the result to the storage type (nearest even). Avg divides the f32 value of the
//!   rounded sum by `n` in f32 and rounds once.
//!   Rounding f32 to f16/bf16: nearest even; overflow gives ±inf; a NaN gives the quiet NaN
//!   of its sign (f16 `0x7e00`, bf16 `0x7fc0`, sign bit kept).
//!   Rounding f32 to fp8 (OCP formats): nearest even with saturation to the largest finite
//!   value (e4m3 ±448, e5m2 ±57344), as `__NV_SATFINITE`; a NaN gives e4m3 `0x7f` / e5m2
//!   `0x7e` with its sign bit; e5m2 infinities saturate as well.
//! - Min/max on floats, `a` the accumulator and `b` the next input:
//!   `max(a, b) = if b > a || a.is_nan() { b } else { a }`,
//!   `min(a, b) = if b < a || a.is_nan() { b } else { a }` (comparisons in f32/f64; for
//!   16- and 8-bit types the result is the input's own bits, not a rounded copy).
//!
//! **NaN results of arithmetic.** What the rules above leave open is fixed here so that
//! every engine can match it bit for bit (the platforms differ: x86 propagates an operand's
//! payload and generates a negative NaN, CUDA's f32 arithmetic returns `0x7fffffff`):
//! - a sum, product or average step whose result is NaN returns the accumulator if it is a
//!   NaN, else the next input if it is a NaN, quieted (quiet bit set, sign and payload
//!   kept); a NaN generated from non-NaN operands (`inf - inf`, `0 * inf`) is the positive
//!   quiet NaN (`0x7fc00000`, `0x7ff8000000000000`). For 16- and 8-bit types this NaN is
//!   then rounded as above, so only its sign survives.
//! - a NaN input of a 16- or 8-bit type widens to the quiet f32 NaN of its sign.
//! - subnormal inputs and results are kept (IEEE: no flush to zero).
//!
//! The conversions are public (`f32_to_f16`, `bf16_to_f32`, …) so that tests of other
//! engines build their inputs and expectations with the same functions.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::types::DataType;

/// A reduction operator. The built-in ones are numbered as NCCL numbers `ncclRedOp_t` (sum
/// 0, prod 1, max 2, min 3, avg 4: [`RedOp::raw`]); `PreMulSum` is NCCL's
/// `ncclRedOpCreatePreMulSum` operator, which carries its scalar.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    /// `sum(scalar * x_i)`: every input is multiplied by the scalar (one `Prod` step, the
    /// input as the accumulator), then the products are folded with `Sum`.
    PreMulSum(Scalar),
}

/// The scalar of a `PreMulSum`, of the reduction's data type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scalar {
    /// Its bits (the data type's width, in the low bytes), fixed when the operator was made.
    Value(u64),
    /// The address of the scalar in device memory of the communicator's device, read when
    /// each reduce step runs (by the kernel on CUDA, by the stream's worker on the host
    /// backend), so a stream-ordered write to it before the collective applies.
    Device(u64),
}

impl RedOp {
    /// The built-in operators (NCCL's `ncclNumOps` of them).
    pub const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg];

    pub fn from_raw(op: &'static str, v: i32) -> Result<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|r| r.raw() == v)
            .ok_or_else(|| Error::invalid_arg(op, format!("unknown reduction operator {v}")))
    }

    /// The `ncclRedOp_t` number of a built-in operator; `PreMulSum` has none of its own
    /// (NCCL numbers each one made from `ncclNumOps` = 5 up): 5.
    pub fn raw(self) -> i32 {
        match self {
            RedOp::Sum => 0,
            RedOp::Prod => 1,
            RedOp::Max => 2,
            RedOp::Min => 3,
            RedOp::Avg => 4,
            RedOp::PreMulSum(_) => 5,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Max => "max",
            RedOp::Min => "min",
            RedOp::Avg => "avg",
            RedOp::PreMulSum(_) => "premulsum",
        }
    }
}

/// The positive quiet NaNs of an arithmetic step that generates a NaN (module docs).
const F32_QNAN: u32 = 0x7fc0_0000;
const F64_QNAN: u64 = 0x7ff8_0000_0000_0000;

/// The NaN rule of an arithmetic step on f32 (see above): `r` computed from `a` and `b`.
#[inline]
fn nan_rule_f32(a: f32, b: f32, r: f32) -> f32 {
    if !r.is_nan() {
        r
    } else if a.is_nan() {
        f32::from_bits(a.to_bits() | 0x0040_0000)
    } else if b.is_nan() {
        f32::from_bits(b.to_bits() | 0x0040_0000)
    } else {
        f32::from_bits(F32_QNAN)
    }
}

#[inline]
fn nan_rule_f64(a: f64, b: f64, r: f64) -> f64 {
    if !r.is_nan() {
        r
    } else if a.is_nan() {
        f64::from_bits(a.to_bits() | 0x0008_0000_0000_0000)
    } else if b.is_nan() {
        f64::from_bits(b.to_bits() | 0x0008_0000_0000_0000)
    } else {
        f64::from_bits(F64_QNAN)
    }
}

// ---------------------------------------------------------------- conversions ------------

/// `s >> k` rounded to nearest, ties to even.
#[inline]
fn rne_shift(s: u64, k: u32) -> u64 {
    if k == 0 {
        return s;
    }
    if k >= 63 {
        return 0;
    }
    let q = s >> k;
    let rem = s & ((1u64 << k) - 1);
    let half = 1u64 << (k - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// The magnitude of a finite f32 `x` encoded in a binary format with `mbits` stored mantissa
/// bits and exponent bias `bias` (subnormals included, round to nearest even), as the
/// unsigned integer `(biased exponent << mbits) | mantissa`; a carry out of the mantissa
/// lands in the exponent, so the caller only has to check the top of the range.
#[inline]
fn encode_magnitude(x: f32, mbits: u32, bias: i32) -> u64 {
    let b = x.to_bits();
    let exp = ((b >> 23) & 0xff) as i32;
    let man = (b & 0x7f_ffff) as u64;
    if exp == 0 && man == 0 {
        return 0;
    }
    // |x| = s * 2^(e - 23) with s in [2^23, 2^24).
    let (s, e) = if exp == 0 {
        let sh = man.leading_zeros() - 40; // man < 2^23 in a u64: bring bit 23 up
        (man << sh, -126 - sh as i32)
    } else {
        (man | 0x80_0000, exp - 127)
    };
    let emin = 1 - bias;
    if e >= emin {
        (((e - emin) as u64) << mbits) + rne_shift(s, 23 - mbits)
    } else {
        rne_shift(s, 23 - mbits + (emin - e) as u32)
    }
}

/// `2^k` for `k` in -126..=127.
#[inline]
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The value of a finite magnitude encoding (see [`encode_magnitude`]), exactly.
#[inline]
fn decode_magnitude(t: u32, mbits: u32, bias: i32) -> f32 {
    let be = (t >> mbits) as i32;
    let m = t & ((1 << mbits) - 1);
    if be == 0 {
        m as f32 * pow2(1 - bias - mbits as i32)
    } else {
        ((1 << mbits) | m) as f32 * pow2(be - bias - mbits as i32)
    }
}

/// f32 → IEEE binary16: nearest even, overflow to ±inf, NaN to `0x7e00` with its sign.
pub fn f32_to_f16(x: f32) -> u16 {
    let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7e00;
    }
    if x.is_infinite() {
        return sign | 0x7c00;
    }
    let t = encode_magnitude(x, 10, 15);
    sign | t.min(0x7c00) as u16
}

/// IEEE binary16 → f32, exact; a NaN gives the quiet f32 NaN of its sign.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let t = (h & 0x7fff) as u32;
    if t >= 0x7c00 {
        return f32::from_bits(sign | if t == 0x7c00 { 0x7f80_0000 } else { F32_QNAN });
    }
    f32::from_bits(sign | decode_magnitude(t, 10, 15).to_bits())
}

/// f32 → bfloat16: nearest even, overflow to ±inf, NaN to `0x7fc0` with its sign.
pub fn f32_to_bf16(x: f32) -> u16 {
    let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7fc0;
    }
    if x.is_infinite() {
        return sign | 0x7f80;
    }
    let t = encode_magnitude(x, 7, 127);
    sign | t.min(0x7f80) as u16
}

/// bfloat16 → f32, exact; a NaN gives the quiet f32 NaN of its sign.
pub fn bf16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    if (h & 0x7fff) > 0x7f80 {
        return f32::from_bits(sign | F32_QNAN);
    }
    f32::from_bits((h as u32) << 16)
}

/// f32 → OCP fp8 E4M3 (bias 7, no infinities, NaN `0x7f`): nearest even, saturating to
/// ±448 (infinities too), NaN to `0x7f` with its sign.
pub fn f32_to_f8e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7f;
    }
    if x.is_infinite() {
        return sign | 0x7e;
    }
    sign | encode_magnitude(x, 3, 7).min(0x7e) as u8
}

/// OCP fp8 E4M3 → f32, exact; `0x7f`/`0xff` give the quiet f32 NaN of their sign.
pub fn f8e4m3_to_f32(b: u8) -> f32 {
    let sign = ((b as u32) & 0x80) << 24;
    let t = (b & 0x7f) as u32;
    if t == 0x7f {
        return f32::from_bits(sign | F32_QNAN);
    }
    f32::from_bits(sign | decode_magnitude(t, 3, 7).to_bits())
}

/// f32 → OCP fp8 E5M2 (bias 15): nearest even, saturating to ±57344 (infinities too), NaN
/// to `0x7e` with its sign.
pub fn f32_to_f8e5m2(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7e;
    }
    if x.is_infinite() {
        return sign | 0x7b;
    }
    sign | encode_magnitude(x, 2, 15).min(0x7b) as u8
}

/// OCP fp8 E5M2 → f32, exact (`0x7c` is +inf); a NaN gives the quiet f32 NaN of its sign.
pub fn f8e5m2_to_f32(b: u8) -> f32 {
    let sign = ((b as u32) & 0x80) << 24;
    let t = (b & 0x7f) as u32;
    if t >= 0x7c {
        return f32::from_bits(sign | if t == 0x7c { 0x7f80_0000 } else { F32_QNAN });
    }
    f32::from_bits(sign | decode_magnitude(t, 2, 15).to_bits())
}

// ---------------------------------------------------------------- the reference ----------

/// Fold the elements of `srcs` in order into `dst` (see the module documentation for what
/// each step computes). Every slice holds the same number of bytes, a multiple of the
/// element size; `dst` may be any buffer of that length (it is only written). At least one
/// input is required.
pub fn reduce_into(dtype: DataType, op: RedOp, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    const OP: &str = "reduce_into";
    let es = dtype.size();
    if srcs.is_empty() {
        return Err(Error::invalid_arg(OP, "no inputs"));
    }
    if dst.len() % es != 0 {
        return Err(Error::invalid_arg(OP, format!("{} bytes is not a whole number of {}", dst.len(), dtype.name())));
    }
    if let Some(s) = srcs.iter().find(|s| s.len() != dst.len()) {
        return Err(Error::invalid_arg(OP, format!("an input holds {} bytes, the output {}", s.len(), dst.len())));
    }
    if let RedOp::PreMulSum(scalar) = op {
        let Scalar::Value(bits) = scalar else {
            return Err(Error::invalid_arg(OP, "a PreMulSum scalar in device memory is read by the device backend when its step runs; give its value here"));
        };
        let splat: Vec<u8> = bits.to_le_bytes()[..es].iter().copied().cycle().take(dst.len()).collect();
        let mut scaled = vec![vec![0u8; dst.len()]; srcs.len()];
        for (y, x) in scaled.iter_mut().zip(srcs) {
            reduce_into(dtype, RedOp::Prod, y, &[x, &splat])?;
        }
        let scaled: Vec<&[u8]> = scaled.iter().map(|v| v.as_slice()).collect();
        return reduce_into(dtype, RedOp::Sum, dst, &scaled);
    }
    let n = srcs.len() as u64;
    match dtype {
        DataType::I8 => fold::<1>(dst, srcs, |a, b| int_step::<i8>(op, a, b, n)),
        DataType::U8 => fold::<1>(dst, srcs, |a, b| int_step::<u8>(op, a, b, n)),
        DataType::I32 => fold::<4>(dst, srcs, |a, b| int_step::<i32>(op, a, b, n)),
        DataType::U32 => fold::<4>(dst, srcs, |a, b| int_step::<u32>(op, a, b, n)),
        DataType::I64 => fold::<8>(dst, srcs, |a, b| int_step::<i64>(op, a, b, n)),
        DataType::U64 => fold::<8>(dst, srcs, |a, b| int_step::<u64>(op, a, b, n)),
        DataType::F32 => fold::<4>(dst, srcs, |a, b| f32_step(op, a, b, n)),
        DataType::F64 => fold::<8>(dst, srcs, |a, b| f64_step(op, a, b, n)),
        DataType::F16 => fold::<2>(dst, srcs, |a, b| narrow_step(op, a, b, n, |x| f16_to_f32(x as u16), |x| f32_to_f16(x) as u64)),
        DataType::BF16 => fold::<2>(dst, srcs, |a, b| narrow_step(op, a, b, n, |x| bf16_to_f32(x as u16), |x| f32_to_bf16(x) as u64)),
        DataType::F8E4M3 => fold::<1>(dst, srcs, |a, b| narrow_step(op, a, b, n, |x| f8e4m3_to_f32(x as u8), |x| f32_to_f8e4m3(x) as u64)),
        DataType::F8E5M2 => fold::<1>(dst, srcs, |a, b| narrow_step(op, a, b, n, |x| f8e5m2_to_f32(x as u8), |x| f32_to_f8e5m2(x) as u64)),
    }
    Ok(())
}

/// One step of the fold on raw little-endian element bits: `Step(acc, Some(b))` combines,
/// `Step(acc, None)` is the final step (Avg's division; the identity otherwise).
fn fold<const W: usize>(dst: &mut [u8], srcs: &[&[u8]], step: impl Fn(u64, Option<u64>) -> u64) {
    let read = |s: &[u8], i: usize| {
        let mut w = [0u8; 8];
        w[..W].copy_from_slice(&s[i * W..i * W + W]);
        u64::from_le_bytes(w)
    };
    for i in 0..dst.len() / W {
        let mut acc = read(srcs[0], i);
        for s in &srcs[1..] {
            acc = step(acc, Some(read(s, i)));
        }
        acc = step(acc, None);
        dst[i * W..i * W + W].copy_from_slice(&acc.to_le_bytes()[..W]);
    }
}

/// Integer types as raw bits, with wrapping arithmetic and division toward zero.
trait Int: Copy + Ord {
    fn from_bits(b: u64) -> Self;
    fn to_bits(self) -> u64;
    fn wrapping_add(self, o: Self) -> Self;
    fn wrapping_mul(self, o: Self) -> Self;
    /// Division by the input count, truncating toward zero.
    fn div_n(self, n: u64) -> Self;
}

macro_rules! int_impl {
    ($($t:ty: $u:ty, $wide:ty);*) => {$(
        impl Int for $t {
            fn from_bits(b: u64) -> Self { b as $u as $t }
            fn to_bits(self) -> u64 { self as $u as u64 }
            fn wrapping_add(self, o: Self) -> Self { <$t>::wrapping_add(self, o) }
            fn wrapping_mul(self, o: Self) -> Self { <$t>::wrapping_mul(self, o) }
            fn div_n(self, n: u64) -> Self { (self as $wide / n as $wide) as $t }
        }
    )*};
}
int_impl!(i8: u8, i128; u8: u8, u128; i32: u32, i128; u32: u32, u128; i64: u64, i128; u64: u64, u128);

#[inline]
fn int_step<T: Int>(op: RedOp, a: u64, b: Option<u64>, n: u64) -> u64 {
    let a = T::from_bits(a);
    let r = match (op, b.map(T::from_bits)) {
        (RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_), Some(b)) => a.wrapping_add(b),
        (RedOp::Prod, Some(b)) => a.wrapping_mul(b),
        (RedOp::Max, Some(b)) => a.max(b),
        (RedOp::Min, Some(b)) => a.min(b),
        (RedOp::Avg, None) => a.div_n(n),
        (_, None) => a,
    };
    r.to_bits()
}

/// `max`/`min` as the module documentation defines them on floats: `b` replaces the
/// accumulator when it compares greater (smaller), or when the accumulator is NaN.
#[inline]
fn pick<F: PartialOrd + Copy>(op: RedOp, a: F, b: F, a_nan: bool) -> bool {
    match op {
        RedOp::Max => b > a || a_nan,
        _ => b < a || a_nan,
    }
}

#[inline]
fn f32_step(op: RedOp, a: u64, b: Option<u64>, n: u64) -> u64 {
    let fa = f32::from_bits(a as u32);
    let r = match (op, b) {
        (RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_), Some(b)) => {
            let fb = f32::from_bits(b as u32);
            nan_rule_f32(fa, fb, fa + fb)
        }
        (RedOp::Prod, Some(b)) => {
            let fb = f32::from_bits(b as u32);
            nan_rule_f32(fa, fb, fa * fb)
        }
        (RedOp::Max | RedOp::Min, Some(b)) => {
            return if pick(op, fa, f32::from_bits(b as u32), fa.is_nan()) { b } else { a };
        }
        (RedOp::Avg, None) => {
            let d = n as f32;
            nan_rule_f32(fa, d, fa / d)
        }
        (_, None) => return a,
    };
    r.to_bits() as u64
}

#[inline]
fn f64_step(op: RedOp, a: u64, b: Option<u64>, n: u64) -> u64 {
    let fa = f64::from_bits(a);
    let r = match (op, b) {
        (RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_), Some(b)) => {
            let fb = f64::from_bits(b);
            nan_rule_f64(fa, fb, fa + fb)
        }
        (RedOp::Prod, Some(b)) => {
            let fb = f64::from_bits(b);
            nan_rule_f64(fa, fb, fa * fb)
        }
        (RedOp::Max | RedOp::Min, Some(b)) => {
            return if pick(op, fa, f64::from_bits(b), fa.is_nan()) { b } else { a };
        }
        (RedOp::Avg, None) => {
            let d = n as f64;
            nan_rule_f64(fa, d, fa / d)
        }
        (_, None) => return a,
    };
    r.to_bits()
}

/// A 16- or 8-bit float step: both operands widened to f32, computed in f32, rounded back
/// (min/max return the input's own bits).
#[inline]
fn narrow_step(op: RedOp, a: u64, b: Option<u64>, n: u64, widen: impl Fn(u64) -> f32, narrow: impl Fn(f32) -> u64) -> u64 {
    let fa = widen(a);
    match (op, b) {
        (RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_), Some(b)) => {
            let fb = widen(b);
            narrow(nan_rule_f32(fa, fb, fa + fb))
        }
        (RedOp::Prod, Some(b)) => {
            let fb = widen(b);
            narrow(nan_rule_f32(fa, fb, fa * fb))
        }
        (RedOp::Max | RedOp::Min, Some(b)) => {
            if pick(op, fa, widen(b), fa.is_nan()) {
                b
            } else {
                a
            }
        }
        (RedOp::Avg, None) => {
            let d = n as f32;
            narrow(nan_rule_f32(fa, d, fa / d))
        }
        (_, None) => a,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fold of one element per input, as raw little-endian bits of width `W`.
    fn red<const W: usize>(dtype: DataType, op: RedOp, xs: &[u64]) -> u64 {
        assert_eq!(dtype.size(), W);
        let bufs: Vec<Vec<u8>> = xs.iter().map(|x| x.to_le_bytes()[..W].to_vec()).collect();
        let srcs: Vec<&[u8]> = bufs.iter().map(|b| b.as_slice()).collect();
        let mut dst = vec![0xa5u8; W];
        reduce_into(dtype, op, &mut dst, &srcs).unwrap();
        let mut w = [0u8; 8];
        w[..W].copy_from_slice(&dst);
        u64::from_le_bytes(w)
    }
    fn f16(op: RedOp, xs: &[u16]) -> u16 {
        red::<2>(DataType::F16, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as u16
    }
    fn bf16(op: RedOp, xs: &[u16]) -> u16 {
        red::<2>(DataType::BF16, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as u16
    }
    fn e4m3(op: RedOp, xs: &[u8]) -> u8 {
        red::<1>(DataType::F8E4M3, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as u8
    }
    fn e5m2(op: RedOp, xs: &[u8]) -> u8 {
        red::<1>(DataType::F8E5M2, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as u8
    }
    fn f32r(op: RedOp, xs: &[f32]) -> u32 {
        red::<4>(DataType::F32, op, &xs.iter().map(|x| x.to_bits() as u64).collect::<Vec<_>>()) as u32
    }
    fn f64r(op: RedOp, xs: &[f64]) -> u64 {
        red::<8>(DataType::F64, op, &xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    }
    use RedOp::*;

    #[test]
    fn conversions_by_hand() {
        // f16: exact values, ties to even, subnormals, carries, overflow, NaN.
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(-2.0), 0xc000);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // the tie rounds to the even: inf
        assert_eq!(f32_to_f16(1e9), 0x7c00);
        assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000); // tie to even 0
        assert_eq!(f32_to_f16(-(2f32.powi(-25))), 0x8000);
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-25)), 0x0002);
        assert_eq!(f32_to_f16(2f32.powi(-14) - 2f32.powi(-25)), 0x0400); // carry into the exponent
        assert_eq!(f32_to_f16(f32::from_bits(1)), 0x0000); // f32 subnormal
        assert_eq!(f32_to_f16(f32::from_bits(0xffc0_0001)), 0xfe00);
        assert_eq!(f32_to_f16(f32::from_bits(0x7f80_0001)), 0x7e00);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
        assert_eq!(f16_to_f32(0xfd01).to_bits(), 0xffc0_0000);
        // bf16
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up past the largest bf16
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_7fff)), 0x7f7f);
        assert_eq!(f32_to_bf16(f32::from_bits(0x0000_8000)), 0x0000); // tie to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x0001_8000)), 0x0002);
        assert_eq!(f32_to_bf16(f32::from_bits(0xff80_0001)), 0xffc0);
        assert_eq!(bf16_to_f32(0xc0a0), -5.0);
        // fp8 e4m3: saturation, NaN, ties, subnormals.
        assert_eq!(f32_to_f8e4m3(448.0), 0x7e);
        assert_eq!(f32_to_f8e4m3(464.0), 0x7e);
        assert_eq!(f32_to_f8e4m3(1e9), 0x7e);
        assert_eq!(f32_to_f8e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_f8e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_f8e4m3(-f32::NAN), 0xff);
        assert_eq!(f32_to_f8e4m3(1.0), 0x38);
        assert_eq!(f32_to_f8e4m3(1.0625), 0x38);
        assert_eq!(f32_to_f8e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_f8e4m3(2f32.powi(-9)), 0x01);
        assert_eq!(f32_to_f8e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_f8e4m3(-3.0 * 2f32.powi(-10)), 0x82);
        assert_eq!(f8e4m3_to_f32(0x7e), 448.0);
        assert_eq!(f8e4m3_to_f32(0x78), 256.0);
        assert!(f8e4m3_to_f32(0xff).is_nan() && f8e4m3_to_f32(0xff).is_sign_negative());
        // fp8 e5m2
        assert_eq!(f32_to_f8e5m2(57344.0), 0x7b);
        assert_eq!(f32_to_f8e5m2(61440.0), 0x7b);
        assert_eq!(f32_to_f8e5m2(f32::INFINITY), 0x7b);
        assert_eq!(f32_to_f8e5m2(f32::NEG_INFINITY), 0xfb);
        assert_eq!(f32_to_f8e5m2(-f32::NAN), 0xfe);
        assert_eq!(f32_to_f8e5m2(1.0), 0x3c);
        assert_eq!(f32_to_f8e5m2(1.125), 0x3c);
        assert_eq!(f32_to_f8e5m2(1.375), 0x3e);
        assert_eq!(f32_to_f8e5m2(2f32.powi(-16)), 0x01);
        assert_eq!(f8e5m2_to_f32(0x7c), f32::INFINITY);
        assert!(f8e5m2_to_f32(0x7d).is_nan());
        assert_eq!(f8e5m2_to_f32(0x03), 3.0 * 2f32.powi(-16));
    }

    /// Every 16- and 8-bit pattern survives widening and rounding back, except NaNs, which
    /// become the canonical NaN of their sign.
    #[test]
    fn round_trips_are_exact() {
        for h in 0..=u16::MAX {
            let canon = |q: u16| if h & 0x8000 != 0 { q | 0x8000 } else { q };
            let e = if (h & 0x7fff) > 0x7c00 { canon(0x7e00) } else { h };
            assert_eq!(f32_to_f16(f16_to_f32(h)), e, "f16 {h:#06x}");
            let e = if (h & 0x7fff) > 0x7f80 { canon(0x7fc0) } else { h };
            assert_eq!(f32_to_bf16(bf16_to_f32(h)), e, "bf16 {h:#06x}");
        }
        for b in 0..=u8::MAX {
            let s = b & 0x80;
            let e = if b & 0x7f == 0x7f { s | 0x7f } else { b };
            assert_eq!(f32_to_f8e4m3(f8e4m3_to_f32(b)), e, "e4m3 {b:#04x}");
            let e = match b & 0x7f {
                0x7c => s | 0x7b,
                0x7d..=0x7f => s | 0x7e,
                _ => b,
            };
            assert_eq!(f32_to_f8e5m2(f8e5m2_to_f32(b)), e, "e5m2 {b:#04x}");
        }
        // Rounding is monotone: widening sorts the finite f16 values as their bits do.
        let pos: Vec<f32> = (0..0x7c00u16).map(f16_to_f32).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn f16_steps() {
        assert_eq!(f16(Sum, &[0x3c00, 0x1000]), 0x3c00); // 1 + 2^-11: tie to even
        assert_eq!(f16(Sum, &[0x3c01, 0x1000]), 0x3c02); // 1 + 3*2^-11: tie to even, up
        assert_eq!(f16(Sum, &[0x7bff, 0x4c00]), 0x7c00); // 65504 + 16: overflow to inf
        assert_eq!(f16(Sum, &[0x7bff, 0x4800]), 0x7bff); // 65504 + 8
        assert_eq!(f16(Sum, &[0xfbff, 0xcc00]), 0xfc00);
        assert_eq!(f16(Sum, &[0x7c00, 0xfc00]), 0x7e00); // inf - inf: positive NaN
        assert_eq!(f16(Sum, &[0xfc01, 0x3c00]), 0xfe00); // a NaN keeps its sign
        assert_eq!(f16(Sum, &[0x3c00, 0xfd00, 0x7d00]), 0xfe00); // the first NaN wins
        assert_eq!(f16(Sum, &[0x8000, 0x8000]), 0x8000);
        assert_eq!(f16(Sum, &[0x0000, 0x8000]), 0x0000);
        // Each step rounds: (1 + 2^-11) + 2^-11 is 1 after the first step, then 1 again.
        assert_eq!(f16(Sum, &[0x3c00, 0x1000, 0x1000]), 0x3c00);
        assert_eq!(f16(Prod, &[0x4000, 0x4200, 0xc400]), 0xce00); // 2 * 3 * -4 = -24
        assert_eq!(f16(Prod, &[0x5c00, 0x5c00]), 0x7c00); // 256 * 256 overflows
        assert_eq!(f16(Prod, &[0x5bff, 0x5bff]), 0x7bfe); // 255.875^2 = 65472 fits
        assert_eq!(f16(Prod, &[0x0001, 0x3800]), 0x0000); // 2^-24 / 2: tie to even 0
        assert_eq!(f16(Prod, &[0x0000, 0x7c00]), 0x7e00); // 0 * inf
        assert_eq!(f16(Avg, &[0x3c00, 0x4000, 0x4400]), 0x40ab); // 7 / 3
        assert_eq!(f16(Avg, &[0x7bff, 0x7bff]), 0x7c00); // the sum overflows first
        assert_eq!(f16(Avg, &[0x7d55]), 0x7e00); // one input: the NaN still becomes canonical
        assert_eq!(f16(Avg, &[0x8000]), 0x8000);
        assert_eq!(f16(Max, &[0x0000, 0x8000]), 0x0000);
        assert_eq!(f16(Max, &[0x8000, 0x0000]), 0x8000); // equal: the accumulator stays
        assert_eq!(f16(Min, &[0x8000, 0x0000]), 0x8000);
        assert_eq!(f16(Min, &[0x0000, 0x8000]), 0x0000);
        assert_eq!(f16(Max, &[0x7d01, 0x3c00]), 0x3c00); // a NaN accumulator is replaced
        assert_eq!(f16(Max, &[0x3c00, 0x7d01]), 0x3c00); // a NaN input never wins
        assert_eq!(f16(Max, &[0x7d01, 0xfd55]), 0xfd55); // NaN bits kept as they are
        assert_eq!(f16(Min, &[0x4000, 0xc000, 0x3c00]), 0xc000);
        assert_eq!(f16(Max, &[0x4000, 0xfc00, 0x7c00]), 0x7c00);
    }

    #[test]
    fn bf16_steps() {
        assert_eq!(bf16(Sum, &[0x3f80, 0x3b80]), 0x3f80); // 1 + 2^-8: tie to even
        assert_eq!(bf16(Sum, &[0x3f81, 0x3b80]), 0x3f82);
        assert_eq!(bf16(Sum, &[0x7f7f, 0x7b00]), 0x7f80); // max + half an ulp: tie, up to inf
        assert_eq!(bf16(Sum, &[0x7f7f, 0x7a80]), 0x7f7f);
        assert_eq!(bf16(Sum, &[0xff7f, 0xff7f]), 0xff80);
        assert_eq!(bf16(Sum, &[0xff80, 0x7f80]), 0x7fc0);
        assert_eq!(bf16(Sum, &[0xffc1, 0x3f80]), 0xffc0);
        assert_eq!(bf16(Prod, &[0x4040, 0xc000]), 0xc0c0); // 3 * -2
        assert_eq!(bf16(Avg, &[0x3f80, 0x4000, 0x4080]), 0x4015); // 7/3 = 2.333 -> 2.328125
        assert_eq!(bf16(Max, &[0x8000, 0x0000]), 0x8000);
        assert_eq!(bf16(Min, &[0x0000, 0x8000]), 0x0000);
        assert_eq!(bf16(Min, &[0x7fc1, 0x3f80, 0xbf80]), 0xbf80);
    }

    #[test]
    fn fp8_steps() {
        assert_eq!(e4m3(Sum, &[0x7e, 0x7e]), 0x7e); // 896 saturates to 448
        assert_eq!(e4m3(Sum, &[0xfe, 0xfe]), 0xfe);
        assert_eq!(e4m3(Sum, &[0x38, 0x18]), 0x38); // 1 + 1/16: tie to even
        assert_eq!(e4m3(Sum, &[0x39, 0x18]), 0x3a); // 1.125 + 1/16: tie, up
        assert_eq!(e4m3(Sum, &[0x7f, 0x38]), 0x7f);
        assert_eq!(e4m3(Sum, &[0x38, 0xff]), 0xff);
        assert_eq!(e4m3(Prod, &[0x48, 0x48, 0x48]), 0x68); // 4 * 4 * 4 = 64
        assert_eq!(e4m3(Prod, &[0x70, 0x70]), 0x7e); // 64 * 64 saturates
        assert_eq!(e4m3(Avg, &[0x38, 0x40, 0x48]), 0x41); // 7/3 = 2.33 -> 2.25
        assert_eq!(e4m3(Max, &[0x80, 0x00]), 0x80);
        assert_eq!(e4m3(Min, &[0x00, 0x80]), 0x00);
        assert_eq!(e4m3(Max, &[0x7f, 0xb8]), 0xb8);
        assert_eq!(e5m2(Sum, &[0x7b, 0x7b]), 0x7b); // saturates
        assert_eq!(e5m2(Sum, &[0x7c, 0x3c]), 0x7b); // inf input saturates too
        assert_eq!(e5m2(Sum, &[0x7c, 0xfc]), 0x7e); // inf - inf: NaN
        assert_eq!(e5m2(Sum, &[0xfd, 0x3c]), 0xfe);
        assert_eq!(e5m2(Sum, &[0x3c, 0x30]), 0x3c); // 1 + 1/8: tie to even
        assert_eq!(e5m2(Sum, &[0x3d, 0x30]), 0x3e);
        assert_eq!(e5m2(Prod, &[0x40, 0xc2]), 0xc6); // 2 * -3 = -6
        assert_eq!(e5m2(Avg, &[0x3c, 0x40, 0x44]), 0x41); // 7/3 -> 2.5
        assert_eq!(e5m2(Max, &[0x7d, 0x3c, 0x7c]), 0x7c); // NaN replaced; inf bits kept
        assert_eq!(e5m2(Min, &[0x80, 0x00]), 0x80);
    }

    #[test]
    fn f32_f64_steps() {
        let b = |x: f32| x.to_bits();
        assert_eq!(f32r(Sum, &[1.0, 2f32.powi(-24)]), b(1.0));
        assert_eq!(f32r(Sum, &[1.0 + 2f32.powi(-23), 2f32.powi(-24)]), b(1.0 + 2f32.powi(-22)));
        // Fold order is part of the result.
        assert_eq!(f32r(Sum, &[1e8, 1.0, -1e8]), b(0.0));
        assert_eq!(f32r(Sum, &[1e8, -1e8, 1.0]), b(1.0));
        assert_eq!(f32r(Sum, &[f32::MAX, f32::MAX]), b(f32::INFINITY));
        assert_eq!(f32r(Sum, &[f32::INFINITY, f32::NEG_INFINITY]), 0x7fc0_0000);
        assert_eq!(f32r(Sum, &[1.0, f32::from_bits(0xff80_0001)]), 0xffc0_0001); // quieted, kept
        assert_eq!(f32r(Sum, &[f32::from_bits(0x7fc0_0005), f32::from_bits(0xffc0_0001)]), 0x7fc0_0005);
        assert_eq!(f32r(Prod, &[0.0, f32::INFINITY]), 0x7fc0_0000);
        assert_eq!(f32r(Prod, &[-0.0, 5.0]), b(-0.0));
        assert_eq!(f32r(Avg, &[1.0, 2.0, 4.0]), b(7.0 / 3.0));
        assert_eq!(f32r(Avg, &[f32::MAX, f32::MAX]), b(f32::INFINITY));
        assert_eq!(f32r(Max, &[0.0, -0.0]), b(0.0));
        assert_eq!(f32r(Max, &[-0.0, 0.0]), b(-0.0));
        assert_eq!(f32r(Min, &[-0.0, 0.0]), b(-0.0));
        assert_eq!(f32r(Min, &[0.0, -0.0]), b(0.0));
        assert_eq!(f32r(Max, &[f32::from_bits(0x7fc0_0001), 1.0]), b(1.0));
        assert_eq!(f32r(Max, &[1.0, f32::NAN, 2.0]), b(2.0));
        assert_eq!(f32r(Min, &[f32::from_bits(0x7f80_0001), f32::from_bits(0xff80_0002)]), 0xff80_0002); // not quieted
        let d = |x: f64| x.to_bits();
        assert_eq!(f64r(Sum, &[1.0, 2f64.powi(-53)]), d(1.0));
        assert_eq!(f64r(Sum, &[1.0 + 2f64.powi(-52), 2f64.powi(-53)]), d(1.0 + 2f64.powi(-51)));
        assert_eq!(f64r(Prod, &[3.0, -0.5]), d(-1.5));
        assert_eq!(f64r(Avg, &[1.0, 2.0, 4.0]), d(7.0 / 3.0));
        assert_eq!(f64r(Sum, &[f64::NEG_INFINITY, f64::INFINITY]), 0x7ff8_0000_0000_0000);
        assert_eq!(f64r(Max, &[-0.0, 0.0]), d(-0.0));
        assert_eq!(f64r(Min, &[f64::NAN, -1.0]), d(-1.0));
    }

    #[test]
    fn integer_steps() {
        let u8s = |op, xs: &[u8]| red::<1>(DataType::U8, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as u8;
        let i8s = |op, xs: &[i8]| red::<1>(DataType::I8, op, &xs.iter().map(|x| *x as u8 as u64).collect::<Vec<_>>()) as u8 as i8;
        assert_eq!(u8s(Sum, &[200, 100]), 44);
        assert_eq!(u8s(Prod, &[16, 16]), 0);
        assert_eq!(u8s(Avg, &[255, 1]), 0); // the wrapped sum, divided
        assert_eq!(u8s(Avg, &[255, 254, 253]), 83); // 762 wraps to 250, / 3
        assert_eq!(i8s(Sum, &[127, 1]), -128);
        assert_eq!(i8s(Prod, &[-128, -1]), -128);
        assert_eq!(i8s(Avg, &[-3, -4]), -3); // -7 / 2 truncates toward zero
        assert_eq!(i8s(Avg, &[-7, 0, 0]), -2);
        assert_eq!(i8s(Avg, &[100, 100]), -28); // 200 wraps to -56
        assert_eq!(i8s(Max, &[-5, 3, -100]), 3);
        assert_eq!(i8s(Min, &[-5, 3, -100]), -100);
        let i32s = |op, xs: &[i32]| red::<4>(DataType::I32, op, &xs.iter().map(|x| *x as u32 as u64).collect::<Vec<_>>()) as u32 as i32;
        assert_eq!(i32s(Sum, &[i32::MAX, 2]), i32::MIN + 1);
        assert_eq!(i32s(Avg, &[-5, 0, 0, 0]), -1);
        assert_eq!(i32s(Min, &[-1, i32::MIN]), i32::MIN);
        let u32s = |op, xs: &[u32]| red::<4>(DataType::U32, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as u32;
        assert_eq!(u32s(Max, &[u32::MAX, 0]), u32::MAX); // unsigned comparison
        assert_eq!(u32s(Avg, &[7, 0]), 3);
        let i64s = |op, xs: &[i64]| red::<8>(DataType::I64, op, &xs.iter().map(|x| *x as u64).collect::<Vec<_>>()) as i64;
        assert_eq!(i64s(Sum, &[i64::MAX, 1]), i64::MIN);
        assert_eq!(i64s(Avg, &[i64::MIN, 0]), i64::MIN / 2);
        assert_eq!(i64s(Prod, &[1 << 62, 4]), 0);
        assert_eq!(i64s(Max, &[-1, i64::MIN]), -1);
        let u64s = |op, xs: &[u64]| red::<8>(DataType::U64, op, xs);
        assert_eq!(u64s(Sum, &[u64::MAX, 2]), 1);
        assert_eq!(u64s(Avg, &[u64::MAX, 0, 0]), u64::MAX / 3);
        assert_eq!(u64s(Min, &[u64::MAX, 1 << 63]), 1 << 63);
    }

    /// PreMulSum against arithmetic written out here: each input times the scalar in the
    /// contract's arithmetic, then summed left to right, for every float and integer type.
    #[test]
    fn premulsum_is_prescale_then_sum() {
        let pm = |s: u64| PreMulSum(Scalar::Value(s));
        // f32 and f64: plain IEEE arithmetic (finite values).
        let xs = [1.5f32, -2.25, 1e30, 3.0];
        let want = xs.iter().map(|x| x * 0.1f32).fold(None, |a: Option<f32>, y| Some(a.map_or(y, |a| a + y))).unwrap();
        assert_eq!(f32r(pm(0.1f32.to_bits() as u64), &xs), want.to_bits());
        let xd = [1.5f64, -2.25, 1e300, 3.0, 7.0];
        let wd = xd.iter().map(|x| x * -0.3).fold(None, |a: Option<f64>, y| Some(a.map_or(y, |a| a + y))).unwrap();
        assert_eq!(f64r(pm((-0.3f64).to_bits()), &xd), wd.to_bits());
        // 16- and 8-bit floats: each product rounded to the storage type, each sum too.
        let narrow_case = |dt: DataType, s: f32, xs: &[f32], to: &dyn Fn(f32) -> u64, from: &dyn Fn(u64) -> f32| {
            let sb = to(s);
            let xb: Vec<u64> = xs.iter().map(|x| to(*x)).collect();
            let ys: Vec<u64> = xb.iter().map(|x| to(from(*x) * from(sb))).collect();
            let mut acc = ys[0];
            for y in &ys[1..] {
                acc = to(from(acc) + from(*y));
            }
            let w = dt.size();
            assert_eq!(red_any(dt, pm(sb), &xb, w), acc, "{}", dt.name());
        };
        let xs = [1.0f32, 3.0, -0.75, 100.0, 0.3];
        narrow_case(DataType::F16, 0.1, &xs, &|x| f32_to_f16(x) as u64, &|b| f16_to_f32(b as u16));
        narrow_case(DataType::BF16, 0.1, &xs, &|x| f32_to_bf16(x) as u64, &|b| bf16_to_f32(b as u16));
        narrow_case(DataType::F8E4M3, 0.5, &xs, &|x| f32_to_f8e4m3(x) as u64, &|b| f8e4m3_to_f32(b as u8));
        narrow_case(DataType::F8E5M2, 0.5, &xs, &|x| f32_to_f8e5m2(x) as u64, &|b| f8e5m2_to_f32(b as u8));
        // f16: the product rounds before the sum (1 + 2^-11 is 1 in f16; the sum then 2).
        assert_eq!(f16(pm(0x3c00), &[0x3c00, 0x3c00]), 0x4000);
        // (1 + 2^-10) + 2^-11 (1 + 2^-10): the product is exact (0x1001), the sum lies just
        // above the tie between 0x3c01 and 0x3c02, so it rounds up.
        assert_eq!(f16(pm(0x3c01), &[0x3c00, 0x1000]), 0x3c02);
        // Integers: wrapping products and sums.
        let i8s: Vec<u64> = [100i8, -7, 3].iter().map(|x| *x as u8 as u64).collect();
        let w8 = [100i8, -7, 3].iter().fold(0i8, |a, x| a.wrapping_add(x.wrapping_mul(3)));
        assert_eq!(red_any(DataType::I8, pm(3), &i8s, 1) as u8 as i8, w8);
        assert_eq!(red_any(DataType::U8, pm(200), &[2, 3], 1), (2u8.wrapping_mul(200).wrapping_add(3u8.wrapping_mul(200))) as u64);
        let w32 = [i32::MAX, -5, 9].iter().fold(0i32, |a, x| a.wrapping_add(x.wrapping_mul(-2)));
        let i32s: Vec<u64> = [i32::MAX, -5, 9].iter().map(|x| *x as u32 as u64).collect();
        assert_eq!(red_any(DataType::I32, pm((-2i32) as u32 as u64), &i32s, 4) as u32 as i32, w32);
        assert_eq!(red_any(DataType::U32, pm(7), &[u32::MAX as u64, 1], 4), u32::MAX.wrapping_mul(7).wrapping_add(7) as u64);
        assert_eq!(red_any(DataType::I64, pm((-1i64) as u64), &[5, (-9i64) as u64], 8) as i64, 4);
        assert_eq!(red_any(DataType::U64, pm(1 << 63), &[3, 2], 8), 1 << 63);
        // One input: just the product.
        assert_eq!(f32r(pm(2.0f32.to_bits() as u64), &[3.0]), 6.0f32.to_bits());
        // NaN scalar: every product is NaN (quieted), so the sum is.
        assert_eq!(f32r(pm(0x7f80_0001), &[1.0, 2.0]), 0x7fc0_0001);
        // A scalar in device memory cannot be read here.
        let mut out = [0u8; 4];
        assert!(reduce_into(DataType::F32, PreMulSum(Scalar::Device(0x1000)), &mut out, &[&[0u8; 4][..]]).is_err());
        assert_eq!(PreMulSum(Scalar::Value(0)).raw(), 5);
        assert_eq!(PreMulSum(Scalar::Value(0)).name(), "premulsum");
    }

    fn red_any(dt: DataType, op: RedOp, xs: &[u64], w: usize) -> u64 {
        match w {
            1 => red::<1>(dt, op, xs),
            2 => red::<2>(dt, op, xs),
            4 => red::<4>(dt, op, xs),
            _ => red::<8>(dt, op, xs),
        }
    }

    #[test]
    fn many_elements_and_bad_shapes() {
        // Element i of every input folds on its own.
        let a: Vec<u8> = (0..64u8).collect();
        let b: Vec<u8> = (0..64u8).map(|x| x.wrapping_mul(3)).collect();
        let mut out = vec![0u8; 64];
        reduce_into(DataType::U8, Sum, &mut out, &[&a, &b]).unwrap();
        assert!(out.iter().enumerate().all(|(i, v)| *v == (i as u8).wrapping_mul(4)));
        let mut odd = vec![0u8; 3];
        assert!(reduce_into(DataType::F16, Sum, &mut odd, &[&[0u8; 3][..]]).is_err());
        assert!(reduce_into(DataType::U8, Sum, &mut out, &[]).is_err());
        assert!(reduce_into(DataType::U8, Sum, &mut out, &[&a[..63]]).is_err());
        let mut empty: [u8; 0] = [];
        let none: &[u8] = &[];
        reduce_into(DataType::F64, Avg, &mut empty, &[none, none]).unwrap();
        assert_eq!(RedOp::from_raw("t", 4).unwrap(), Avg);
        assert!(RedOp::from_raw("t", 5).is_err());
    }
}

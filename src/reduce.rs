//! Reduction operators and the one definition of what a reduction computes, bit for bit.
//! Every engine (host threads, the `sm` CopyReduce kernels, the `compressed` engine's fused
//! kernels) must produce exactly these bits; [`reduce_into`] is the reference the tests
//! compare against.
//!
//! **Order.** The inputs are folded left to right in the order given (the engines give them
//! in rank order 0..n-1): `acc = x0; acc = f(acc, x1); …; acc = f(acc, x(n-1))`, each step
//! rounded to the storage type. `Avg` is the `Sum` fold followed by one division by `n`.
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
#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// A reduction operator, numbered as NCCL numbers `ncclRedOp_t` (sum 0, prod 1, max 2,
/// min 3, avg 4).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    Sum = 0,
    Prod = 1,
    Max = 2,
    Min = 3,
    Avg = 4,
}

impl RedOp {
    pub const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min, RedOp::Avg];

    pub fn from_raw(op: &'static str, v: i32) -> Result<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|r| *r as i32 == v)
            .ok_or_else(|| Error::invalid_arg(op, format!("unknown reduction operator {v}")))
    }

    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Max => "max",
            RedOp::Min => "min",
            RedOp::Avg => "avg",
        }
    }
}

//! Data types and reduction operators, numbered as NCCL numbers them so C callers can pass
//! `ncclDataType_t` values through unchanged.
use crate::error::{Error, Result};

#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    I8 = 0,
    U8 = 1,
    I32 = 2,
    U32 = 3,
    I64 = 4,
    U64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    BF16 = 9,
    F8E4M3 = 10,
    F8E5M2 = 11,
}

impl DataType {
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::BF16,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    pub fn from_raw(op: &'static str, v: i32) -> Result<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|d| *d as i32 == v)
            .ok_or_else(|| Error::invalid_arg(op, format!("unknown data type {v}")))
    }

    pub fn name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::BF16 => "bf16",
            DataType::F8E4M3 => "f8e4m3",
            DataType::F8E5M2 => "f8e5m2",
        }
    }

    /// `count` elements in bytes, or an error naming `op` if it overflows.
    pub fn bytes(self, op: &'static str, count: usize) -> Result<usize> {
        count
            .checked_mul(self.size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| Error::invalid_arg(op, format!("count {count} of {} overflows", self.name())))
    }
}

//! The codec's half of the cxx bridge (`hoccl::codec` in `include/hoccl/hoccl.hpp`): host
//! buffers synchronously, device buffers on a stream through [`Dev`], and a device opened
//! without a communicator. Declared in `bridge.rs` (cxx wants one bridge per file); the same
//! contract: nothing unwinds, failures are a [`Status`] with an `ErrorCode`.
use super::bridge::{dev_ptr, dtype, status, stream, value, CUstream_st, Dev, Status};
use super::guarded;
use crate::compress::{self, Dtype, Params};
use crate::config::BackendChoice;
use crate::error::{Error, Result};

fn codec_dtype(op: &'static str, v: i32) -> Result<Dtype> {
    Dtype::from_data_type(op, dtype(op, v)?)
}

fn params(op: &'static str, dt: Dtype, block: u32, tiers: u8) -> Result<Params> {
    let p = Params { block, tiers };
    p.check(op, dt)?;
    Ok(p)
}

/// A device of `backend` ("auto", "cuda", "host") at `ordinal`, for the codec (and tests)
/// without a communicator. On failure the returned handle holds no device.
pub(super) fn device_open(backend: &str, ordinal: usize, out: &mut Status) -> Box<Dev> {
    const OP: &str = "Device::open";
    let r = guarded(OP, || {
        let choice = match backend {
            "auto" | "" => BackendChoice::Auto,
            "cuda" => BackendChoice::Cuda,
            "host" => BackendChoice::Host,
            other => return Err(Error::invalid_arg(OP, format!("backend {other:?}: expected auto, cuda or host"))),
        };
        crate::device::open(choice, ordinal)
    });
    Dev::boxed(out, r)
}

pub(super) fn codec_max_compressed_len(dt: i32, count: usize, block: u32, tiers: u8, out: &mut Status) -> usize {
    const OP: &str = "codec::maxCompressedLen";
    value(
        out,
        guarded(OP, || {
            let dt = codec_dtype(OP, dt)?;
            compress::max_compressed_len(dt, count, &params(OP, dt, block, tiers)?)
        }),
    )
}

pub(super) fn codec_compress(dt: i32, input: &[u8], block: u32, tiers: u8, out: &mut Status) -> Vec<u8> {
    const OP: &str = "codec::compress";
    value(
        out,
        guarded(OP, || {
            let dt = codec_dtype(OP, dt)?;
            if input.len() % dt.size() != 0 {
                return Err(Error::invalid_arg(OP, format!("{} bytes is not a whole number of values", input.len())));
            }
            compress::compress(dt, input, &params(OP, dt, block, tiers)?)
        }),
    )
}

/// Decode `stream` into `output`, which must hold exactly the stream's values, of `dt`.
pub(super) fn codec_decompress(dt: i32, stream: &[u8], output: &mut [u8]) -> Status {
    const OP: &str = "codec::decompress";
    status(guarded(OP, || {
        let dt = codec_dtype(OP, dt)?;
        let h = compress::cpu::peek(stream)?;
        if h.dtype != dt {
            return Err(Error::corrupt(OP, format!("the stream holds {} values, not {}", h.dtype.name(), dt.name())));
        }
        let want = (h.n as u128) * dt.size() as u128;
        if want != output.len() as u128 {
            return Err(Error::invalid_arg(
                OP,
                format!("the stream holds {} values ({want} bytes); the output has {} bytes", h.n, output.len()),
            ));
        }
        compress::decompress_into(stream, output).map(|_| ())
    }))
}

/// The meaning of a decoder status word written by `decompress_async`.
pub(super) fn codec_status(word: u32) -> Status {
    status(compress::status_result(word))
}

impl Dev {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compress_async(
        &self,
        dt: i32,
        input: *const u8,
        count: usize,
        output: *mut u8,
        output_cap: usize,
        out_len: *mut u64,
        block: u32,
        tiers: u8,
        s: *mut CUstream_st,
    ) -> Status {
        const OP: &str = "codec::compressAsync";
        status(self.call(OP, |d| {
            let dt = codec_dtype(OP, dt)?;
            let p = params(OP, dt, block, tiers)?;
            compress::compress_async(d, stream(s), dt, dev_ptr(input), count, dev_ptr(output), output_cap, dev_ptr(out_len), &p)
        }))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn decompress_async(
        &self,
        dt: i32,
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        count: usize,
        status_word: *mut u32,
        s: *mut CUstream_st,
    ) -> Status {
        const OP: &str = "codec::decompressAsync";
        status(self.call(OP, |d| {
            let dt = codec_dtype(OP, dt)?;
            compress::decompress_async(d, stream(s), dt, dev_ptr(input), input_len, dev_ptr(output), count, dev_ptr(status_word))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use crate::types::DataType;

    const BF16: i32 = DataType::BF16 as i32;

    #[test]
    fn host_round_trip_and_errors() {
        let data: Vec<u8> = (0..5000u32).flat_map(|i| (0x3c00u16 + (i % 97) as u16).to_le_bytes()).collect();
        let mut st = status(Ok(()));
        let cap = codec_max_compressed_len(BF16, 5000, 0, 2, &mut st);
        assert_eq!(st.code, 0, "{}", st.message);
        let s = codec_compress(BF16, &data, 0, 2, &mut st);
        assert_eq!(st.code, 0, "{}", st.message);
        assert!(s.len() <= cap && s.len() < data.len());
        let mut back = vec![0u8; data.len()];
        assert_eq!(codec_decompress(BF16, &s, &mut back).code, 0);
        assert!(back == data);
        let mut bad = s.clone();
        bad[40] ^= 0xff;
        bad.truncate(bad.len() - 9);
        assert_eq!(codec_decompress(BF16, &bad, &mut back).code, ErrorCode::CorruptData as i32);
        assert_eq!(codec_decompress(BF16, &s, &mut back[1..]).code, ErrorCode::InvalidArgument as i32);
        assert_eq!(codec_decompress(DataType::F32 as i32, &s, &mut back).code, ErrorCode::CorruptData as i32);
        codec_compress(DataType::I32 as i32, &data, 0, 2, &mut st);
        assert_eq!(st.code, ErrorCode::InvalidArgument as i32);
        codec_compress(BF16, &data, 0, 3, &mut st);
        assert_eq!(st.code, ErrorCode::InvalidArgument as i32);
        assert_eq!(codec_status(0).code, 0);
        assert_eq!(codec_status(6 | (3 << 8)).code, ErrorCode::CorruptData as i32);
    }

    #[test]
    fn device_round_trip_on_the_host_backend() {
        let mut st = status(Ok(()));
        let dev = device_open("host", 0, &mut st);
        assert_eq!(st.code, 0, "{}", st.message);
        assert_eq!(device_open("tpu", 0, &mut st).backend(), "");
        assert_eq!(st.code, ErrorCode::InvalidArgument as i32);
        let n = 3000usize;
        let data: Vec<u8> = (0..n as u32).flat_map(|i| (0x4000u16 ^ (i * 7 % 251) as u16).to_le_bytes()).collect();
        let cap = codec_max_compressed_len(BF16, n, 0, 2, &mut st);
        let (input, packed, out, words) =
            (dev.alloc(2 * n, &mut st), dev.alloc(cap, &mut st), dev.alloc(2 * n, &mut st), dev.alloc(16, &mut st));
        assert_eq!(st.code, 0, "{}", st.message);
        let s = dev.create_stream(&mut st);
        assert_eq!(dev.copy_from_host(input, &data).code, 0);
        let len = words as *mut u64;
        let sw = words.wrapping_add(8) as *mut u32;
        assert_eq!(dev.compress_async(BF16, input, n, packed, cap, len, 0, 2, s).code, 0);
        assert_eq!(dev.decompress_async(BF16, packed, cap, out, n, sw, s).code, 0);
        assert_eq!(dev.synchronize(s).code, 0);
        let mut w = [0u8; 16];
        assert_eq!(dev.copy_to_host(&mut w, words).code, 0);
        assert_eq!(codec_status(u32::from_le_bytes(w[8..12].try_into().unwrap())).code, 0);
        let mut back = vec![0u8; 2 * n];
        assert_eq!(dev.copy_to_host(&mut back, out).code, 0);
        assert!(back == data);
        assert_eq!(dev.compress_async(BF16, input, n, packed, cap - 1, len, 0, 2, s).code, ErrorCode::InvalidArgument as i32);
        for p in [input, packed, out, words] {
            assert_eq!(dev.free(p).code, 0);
        }
        assert_eq!(dev.destroy_stream(s).code, 0);
    }
}

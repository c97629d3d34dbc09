//! The bf16/fp16/fp32 codec (compression paper §4): the exponent of every value is coded
//! with a small per-block table (fixed-length codes, escapes to a second tier or to raw
//! bytes); sign and mantissa are stored raw. Formats `BFX1`/`HFX1`/`FFX1` in
//! [`format`](mod@format) and `docs/design.md` ("Codec format"; kernels in `docs/codec.md`); the encoder's exact choice in [`select`].
//!
//! Two implementations that produce identical bytes: the CPU reference ([`cpu`]) and the
//! CUDA kernels (`cuda/bfx.cu`, `cuda/bfx_decode.cu`, launched by [`gpu`]).
//!
//! ## API (what the C++ bridge wraps)
//!
//! Host buffers (synchronous):
//! - [`max_compressed_len`]`(dtype, n, params)`: the output size to allocate;
//! - [`compress`]`(dtype, &[u8], params) -> Vec<u8>`; [`decompress`]`(&[u8]) -> Vec<u8>`
//!   (the dtype comes from the stream's magic); `_into` variants write caller buffers.
//!
//! Device buffers on a stream (asynchronous, stream-ordered; [`compress_async`],
//! [`decompress_async`]): they enqueue work on `stream` and return at once. The compressed
//! length and the decoder's verdict are written to device words the caller passes and reads
//! after the stream reaches them ([`status_result`] turns a status word into a `Result`).
//! On a device without CUDA (the host backend) the same calls queue the CPU codec on the
//! stream (`Device::launch_host_fn`, run by a host thread in stream order): same bytes,
//! same contract, asynchronous too.
use crate::device::{host, DevPtr, Device, StreamHandle};
use crate::error::{Error, Result};
use crate::types::DataType;

pub mod cpu;
pub mod format;
pub mod fused;
pub mod gpu;
pub mod select;

pub use cpu::{BlockInfo, Params};
pub use format::{BlockHeader, Dtype, StreamHeader};

impl Dtype {
    /// The codec dtype of a library data type (bf16, f16, f32 only).
    pub fn from_data_type(op: &'static str, t: DataType) -> Result<Dtype> {
        match t {
            DataType::BF16 => Ok(Dtype::Bf16),
            DataType::F16 => Ok(Dtype::F16),
            DataType::F32 => Ok(Dtype::F32),
            other => Err(Error::invalid_arg(op, format!("the codec does not handle {}", other.name()))),
        }
    }
}

/// Bytes to allocate for the compressed form of `n` values: the stream's upper bound (every
/// block raw, headers included: at most `12·nblocks + 27` bytes over the input) plus the
/// device compressor's look-back scratch (`8·(nblocks + 1) + 8` bytes, used past the end of
/// the stream; host encoders leave it alone). The same bound serves host and device.
pub fn max_compressed_len(dtype: Dtype, n: usize, params: &Params) -> Result<usize> {
    const OP: &str = "max_compressed_len";
    let b = params.check(OP, dtype)?;
    let stream = format::max_stream_len(OP, dtype, n as u64, b)?;
    let nblocks = format::block_count(OP, n as u64, b)? as usize;
    stream
        .checked_add(gpu::scratch_bytes(nblocks))
        .ok_or_else(|| Error::invalid_arg(OP, format!("{n} values overflow the address space")))
}

/// Compress `input` (little-endian values of `dtype`; its length a multiple of the value
/// size) into a new stream.
pub fn compress(dtype: Dtype, input: &[u8], params: &Params) -> Result<Vec<u8>> {
    let n = input.len() / dtype.size();
    let mut out = vec![0u8; max_compressed_len(dtype, n, params)?];
    let len = cpu::encode_into(dtype, input, &mut out, params)?;
    out.truncate(len);
    Ok(out)
}

/// Compress into `out`, which must hold the stream's upper bound
/// ([`format::max_stream_len`]; [`max_compressed_len`] is enough); returns the stream length.
pub fn compress_into(dtype: Dtype, input: &[u8], out: &mut [u8], params: &Params) -> Result<usize> {
    cpu::encode_into(dtype, input, out, params)
}

/// Decompress a whole stream (exactly its bytes) into a new buffer of `n · size` bytes.
pub fn decompress(stream: &[u8]) -> Result<Vec<u8>> {
    let h = cpu::peek(stream)?;
    // Block sizes are checked before anything is decoded and bound `n` by the stream length.
    format::block_offsets("decompress", &h, stream)?;
    let mut out = vec![0u8; h.n as usize * h.dtype.size()];
    cpu::decode_into(stream, &mut out)?;
    Ok(out)
}

/// Decompress into `out`, which must be exactly `n · size` bytes; returns the header.
pub fn decompress_into(stream: &[u8], out: &mut [u8]) -> Result<StreamHeader> {
    cpu::decode_into(stream, out)
}

/// The stream's header and per-block widths, all headers validated (`hoccl-zip stats`).
pub fn inspect(stream: &[u8]) -> Result<(StreamHeader, Vec<BlockInfo>)> {
    cpu::inspect(stream)
}

// ---------------------------------------------------------------- device buffers ---------

/// Enqueue on `stream`: compress `n` values of `dtype` at `input` (device memory, aligned to
/// the value size) into `output` (device memory, 4-byte aligned, `output_cap >=`
/// [`max_compressed_len`] bytes). When the stream reaches the end of the work, the stream
/// occupies `output[..len]` and `len` has been written as a u64 to `out_len` (device or
/// host-mapped memory, 8-byte aligned; null to skip). Returns once enqueued; `input` and
/// `output` must stay valid until then. Arguments are checked before anything is enqueued.
#[allow(clippy::too_many_arguments)]
pub fn compress_async(
    dev: &dyn Device,
    stream: StreamHandle,
    dtype: Dtype,
    input: DevPtr,
    n: usize,
    output: DevPtr,
    output_cap: usize,
    out_len: DevPtr,
    params: &Params,
) -> Result<()> {
    const OP: &str = "compress_async";
    let need = max_compressed_len(dtype, n, params)?;
    if output_cap < need {
        return Err(Error::invalid_arg(OP, format!("output of {output_cap} bytes, {need} needed")));
    }
    check_ptr(OP, "input", input, dtype.size() as u64, n > 0)?;
    check_ptr(OP, "output", output, 4, true)?;
    check_ptr(OP, "out_len", out_len, 8, false)?;
    match dev.as_cuda() {
        Some(cuda) => gpu::compress(cuda, stream, dtype, input, n as u64, output, out_len, params),
        None => host_compress(dev, stream, dtype, input, n, output, out_len, params),
    }
}

/// Enqueue on `stream`: decompress the stream at `input` (device memory, 4-byte aligned,
/// `input_len` bytes or more: the stream describes its own length) into `output` (device
/// memory aligned to the value size), which receives exactly `n` values; the stream must be
/// of `dtype` and hold `n` values. When the stream reaches the end of the work, `status`
/// (device or host-mapped u32, 4-byte aligned) holds 0 or the reason the input was rejected
/// (see [`status_result`]); on rejection `output` is unspecified. `status` may be null
/// (then corrupt input goes unreported: don't). Returns once enqueued.
#[allow(clippy::too_many_arguments)]
pub fn decompress_async(
    dev: &dyn Device,
    stream: StreamHandle,
    dtype: Dtype,
    input: DevPtr,
    input_len: usize,
    output: DevPtr,
    n: usize,
    status: DevPtr,
) -> Result<()> {
    const OP: &str = "decompress_async";
    check_ptr(OP, "input", input, 4, true)?;
    check_ptr(OP, "output", output, dtype.size() as u64, n > 0)?;
    check_ptr(OP, "status", status, 4, false)?;
    dtype.bytes_for(OP, n)?;
    match dev.as_cuda() {
        Some(cuda) => gpu::decompress(cuda, stream, dtype, input, input_len as u64, output, n as u64, status),
        None => host_decompress(dev, stream, dtype, input, input_len, output, n, status),
    }
}

/// The first nonzero status word among `words` (decoders that rejected their input), as the
/// error it stands for; the word is cleared so it is reported once.
pub fn first_rejection(words: &crate::device::FlagSlab) -> Option<Error> {
    (0..words.len()).find_map(|i| {
        let w = (words.load(i) & 0xffff_ffff) as u32;
        if w == 0 {
            return None;
        }
        words.store(i, 0);
        status_result(w).err()
    })
}

/// The meaning of a decoder status word (0: success).
pub fn status_result(status: u32) -> Result<()> {
    gpu::Status::from_word(status).map_or(Ok(()), |(s, block)| Err(Error::corrupt("decompress", s.describe(block))))
}

impl Dtype {
    fn bytes_for(self, op: &'static str, n: usize) -> Result<usize> {
        n.checked_mul(self.size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| Error::invalid_arg(op, format!("{n} values of {} overflow", self.name())))
    }
}

fn check_ptr(op: &'static str, what: &str, p: DevPtr, align: u64, required: bool) -> Result<()> {
    if p.is_null() {
        return if required { Err(Error::invalid_arg(op, format!("{what} is null"))) } else { Ok(()) };
    }
    if p.0 % align != 0 {
        return Err(Error::invalid_arg(op, format!("{what} {:#x} is not {align}-byte aligned", p.0)));
    }
    Ok(())
}

// The host backend: the CPU codec runs on a host thread in stream order
// (`Device::launch_host_fn`), on copies of the buffers, so the call returns once enqueued
// as on CUDA. The ranges are checked at the call; what still fails when the task runs (a
// buffer freed meanwhile, the user's error) is logged and reported through the words the
// caller reads: a length no range holds, a status that rejects the stream.
#[allow(clippy::too_many_arguments)]
fn host_compress(
    dev: &dyn Device,
    s: StreamHandle,
    dtype: Dtype,
    input: DevPtr,
    n: usize,
    output: DevPtr,
    out_len: DevPtr,
    params: &Params,
) -> Result<()> {
    const OP: &str = "compress_async";
    let in_len = dtype.bytes_for(OP, n)?;
    let cap = max_compressed_len(dtype, n, params)?;
    host::check(OP, input, in_len)?;
    host::check(OP, output, cap)?;
    if !out_len.is_null() {
        host::check(OP, out_len, 8)?;
    }
    let params = *params;
    dev.launch_host_fn(
        s,
        Box::new(move || {
            let run = || -> Result<u64> {
                let mut host_in = vec![0u8; in_len];
                host::read(input, &mut host_in)?;
                let out = compress(dtype, &host_in, &params)?;
                host::write(output, &out)?;
                Ok(out.len() as u64)
            };
            let len = run().unwrap_or_else(|e| {
                log::error!("hoccl: host backend: {OP}: {e}");
                u64::MAX
            });
            if !out_len.is_null() {
                let _ = host::write(out_len, &len.to_le_bytes());
            }
        }),
    )
}

#[allow(clippy::too_many_arguments)]
fn host_decompress(
    dev: &dyn Device,
    s: StreamHandle,
    dtype: Dtype,
    input: DevPtr,
    input_len: usize,
    output: DevPtr,
    n: usize,
    status: DevPtr,
) -> Result<()> {
    const OP: &str = "decompress_async";
    host::check(OP, input, input_len)?;
    host::check(OP, output, dtype.bytes_for(OP, n)?)?;
    if !status.is_null() {
        host::check(OP, status, 4)?;
    }
    dev.launch_host_fn(
        s,
        Box::new(move || {
            let mut host_in = vec![0u8; input_len];
            let word = match host::read(input, &mut host_in) {
                Ok(()) => match gpu::host_decode(&host_in, dtype, n) {
                    Ok(values) => host::write(output, &values).map_or_else(
                        |e| {
                            log::error!("hoccl: host backend: {OP}: {e}");
                            gpu::Status::Corrupt.word(0)
                        },
                        |_| 0,
                    ),
                    Err(word) => word,
                },
                Err(e) => {
                    log::error!("hoccl: host backend: {OP}: {e}");
                    gpu::Status::Corrupt.word(0)
                }
            };
            if !status.is_null() {
                let _ = host::write(status, &word.to_le_bytes());
            }
        }),
    )
}

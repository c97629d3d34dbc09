//! The codec's shared test bodies on the CUDA kernels. Ignored by default; run on a GPU
//! machine with `--ignored` (scripts/gpu/codec.sh does). Without a usable GPU they FAIL.
mod codec_common;
use codec_common::device::DeviceCodec;
use codec_common::*;
use hoccl::compress::{self, Dtype, Params};
use hoccl::config::BackendChoice;
use std::sync::Arc;

fn cuda(shift: usize) -> DeviceCodec {
    let dev = hoccl::device::open(BackendChoice::Cuda, 0).unwrap_or_else(|e| panic!("needs a GPU, none usable: {e}"));
    assert!(dev.as_cuda().is_some(), "BackendChoice::Cuda opened a device without CUDA");
    DeviceCodec::new(Arc::clone(&dev), shift)
}

const GPU: &str = "needs a GPU: run with --ignored";

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_same_bytes_as_cpu() {
    same_bytes_as_cpu(&cuda(0));
    same_bytes_as_cpu(&cuda(1));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_all_16bit_patterns() {
    all_16bit_patterns(&cuda(0));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_f32_specials() {
    f32_specials(&cuda(0));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_sizes() {
    sizes(&cuda(0));
    sizes(&cuda(1));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_block_sizes() {
    block_sizes(&cuda(0));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_incompressible() {
    incompressible(&cuda(0));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_distributions() {
    distributions(&cuda(0));
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_real_data() {
    for (file, class, r1, r2) in real_data(&cuda(0)) {
        eprintln!("{file:34} {class:12} one tier {r1:.4}  two tiers {r2:.4}");
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_decodes_cpu_streams() {
    decodes_cpu_streams(&cuda(0));
    decodes_cpu_streams(&cuda(1));
}

/// Large round trips in fresh buffers, one after another (the host-to-device copy must have
/// landed before a kernel on the codec's non-blocking stream reads it).
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_back_to_back_fresh_buffers() {
    back_to_back_fresh_buffers(&cuda(0));
}

/// An input large enough that the decoder's grid has several waves of CTAs (gpu.rs aims at
/// 8 blocks per CTA: 192 Mi bf16 values are ~2.8 waves on an H200), each CTA summing the
/// sizes before its range; both tier modes.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_decoder_grid_of_several_waves() {
    let c = cuda(0);
    let n = 192 << 20;
    let data = normal_values(Dtype::Bf16, n, 0.02, 0x5a5e);
    for tiers in [2u8, 1] {
        round_trip(&c, Dtype::Bf16, &data, &Params { block: 0, tiers }, &format!("bf16 n={n} tiers {tiers}"));
    }
}

/// Compress and decompress back to back on one stream, one synchronization.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_stream_ordered_round_trip() {
    let c = cuda(0);
    for dt in Dtype::ALL {
        for n in [0usize, 1, 5000, 1 << 20] {
            let data = normal_values(dt, n, 0.02, n as u64);
            let back = c.round_trip_on_stream(dt, &data, &Params::default()).unwrap();
            assert!(back == data, "{} n={n}", dt.name());
        }
    }
}

/// Corrupt and mutated streams: the decoder reports a status and never faults, and agrees
/// with the CPU reference on what is valid.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_rejects_corrupt_streams() {
    let c = cuda(0);
    let data = normal_values(Dtype::Bf16, 40_000, 0.02, 1);
    let good = compress::compress(Dtype::Bf16, &data, &Params::default()).unwrap();
    let mut r = Rng(77);
    let mut disagreements = Vec::new();
    for i in 0..300 {
        let mut s = good.clone();
        match i % 3 {
            0 => {
                let bit = r.below(8 * s.len() as u64) as usize;
                s[bit / 8] ^= 1 << (bit % 8);
            }
            1 => s.truncate(r.below(s.len() as u64) as usize),
            _ => {
                let off = 4 * r.below(s.len() as u64 / 4) as usize;
                s[off..off + 4].copy_from_slice(&(r.next() as u32 >> r.below(32)).to_le_bytes());
            }
        }
        check_corrupt(&c, Dtype::Bf16, 40_000, &s, &format!("case {i}"), &mut disagreements);
    }
    assert!(disagreements.is_empty(), "{GPU}: {}", disagreements.join("\n"));
    // The device is still healthy.
    assert!(c.decompress(Dtype::Bf16, &good, 40_000).unwrap() == data);
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_rejects_bad_block_sizes_and_headers() {
    let c = cuda(0);
    let mut bad = bad_block_sizes(&c);
    bad.extend(bad_block_headers(&c));
    bad.extend(bad_f16_exponents(&c));
    bad.extend(padding_codes_ignored(&c));
    assert!(bad.is_empty(), "{GPU}: {}", bad.join("\n"));
    // no fault on the way: the device is still healthy
    let data = normal_values(Dtype::Bf16, 40_000, 0.02, 9);
    let good = compress::compress(Dtype::Bf16, &data, &Params::default()).unwrap();
    assert!(c.decompress(Dtype::Bf16, &good, 40_000).unwrap() == data);
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_bad_arguments_are_errors_before_launch() {
    let c = cuda(0);
    let d = &*c.dev;
    let p = Params::default();
    let buf = codec_common::device::Buf::new(d, 1 << 16, 0).unwrap();
    let cap = compress::max_compressed_len(Dtype::Bf16, 1000, &p).unwrap();
    let s = c.stream;
    assert!(compress::compress_async(
        d,
        s,
        Dtype::Bf16,
        buf.ptr,
        1000,
        buf.ptr.add(2),
        cap,
        hoccl::device::DevPtr::NULL,
        &p
    )
    .is_err());
    assert!(compress::compress_async(
        d,
        s,
        Dtype::Bf16,
        buf.ptr,
        1000,
        buf.ptr,
        cap - 1,
        hoccl::device::DevPtr::NULL,
        &p
    )
    .is_err());
    assert!(compress::compress_async(
        d,
        s,
        Dtype::F32,
        buf.ptr.add(2),
        10,
        buf.ptr,
        cap,
        hoccl::device::DevPtr::NULL,
        &p
    )
    .is_err());
    let big = Params { block: 32768, tiers: 2 };
    let cap = compress::max_compressed_len(Dtype::Bf16, 10, &big).unwrap();
    assert!(compress::compress_async(d, s, Dtype::Bf16, buf.ptr, 10, buf.ptr, cap, hoccl::device::DevPtr::NULL, &big)
        .is_err());
}

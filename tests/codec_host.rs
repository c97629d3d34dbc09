//! The codec's device API on the host backend (the CPU codec behind `compress_async` /
//! `decompress_async`): the same bodies as the CUDA tests, runnable in CI.
mod codec_common;
use codec_common::device::DeviceCodec;
use codec_common::*;
use hoccl::compress::{Dtype, Params};
use hoccl::config::BackendChoice;

/// The host backend; it is always built, so failing to open it is a test failure.
fn host(shift: usize) -> DeviceCodec {
    let dev = hoccl::device::open(BackendChoice::Host, 0).unwrap_or_else(|e| panic!("host backend: {e}"));
    assert!(dev.as_cuda().is_none(), "BackendChoice::Host opened a CUDA device");
    DeviceCodec::new(dev, shift)
}

#[test]
fn host_backend_round_trips() {
    for shift in [0, 1] {
        let c = host(shift);
        sizes(&c);
        distributions(&c);
        same_bytes_as_cpu(&c);
    }
}

#[test]
fn host_backend_real_data_and_cpu_streams() {
    let c = host(0);
    real_data(&c);
    decodes_cpu_streams(&c);
    incompressible(&c);
    back_to_back_fresh_buffers(&c);
}

#[test]
fn host_backend_stream_ordered_round_trip() {
    let c = host(1);
    for dt in Dtype::ALL {
        for n in [0usize, 1, 70_001] {
            let data = normal_values(dt, n, 0.02, 3);
            assert!(c.round_trip_on_stream(dt, &data, &Params::default()).unwrap() == data, "{} n={n}", dt.name());
        }
    }
}

/// Corrupt streams through the device API are `CorruptData` errors, never a panic.
#[test]
fn host_backend_rejects_corrupt_streams() {
    let c = host(0);
    let data = normal_values(Dtype::Bf16, 40_000, 0.02, 1);
    let good = c.compress(Dtype::Bf16, &data, &Params::default()).unwrap();
    assert!(c.decompress(Dtype::Bf16, &good, 40_000).unwrap() == data);
    let mut bad = good.clone();
    bad[0] ^= 1;
    assert!(c.decompress(Dtype::Bf16, &bad, 40_000).is_err(), "wrong magic accepted");
    assert!(c.decompress(Dtype::Bf16, &good[..good.len() / 2], 40_000).is_err(), "truncated stream accepted");
    assert!(c.decompress(Dtype::Bf16, &good, 39_999).is_err(), "wrong count accepted");
}

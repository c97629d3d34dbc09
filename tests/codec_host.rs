//! The codec's device API on the host backend (the CPU codec behind `compress_async` /
//! `decompress_async`): the same bodies as the CUDA tests, runnable in CI.
mod codec_common;
use codec_common::device::DeviceCodec;
use codec_common::*;
use hoccl::compress::{Dtype, Params};
use hoccl::config::BackendChoice;

/// The host backend, or `None` (with a note) while this build has none.
fn host() -> Option<DeviceCodec> {
    match hoccl::device::open(BackendChoice::Host, 0) {
        Ok(dev) => Some(DeviceCodec::new(dev, 1)),
        Err(e) => {
            eprintln!("host backend not available in this build ({e}); device-API tests skipped");
            None
        }
    }
}

#[test]
fn host_backend_round_trips() {
    let Some(c) = host() else { return };
    sizes(&c);
    distributions(&c);
    same_bytes_as_cpu(&c);
}

#[test]
fn host_backend_stream_ordered_round_trip() {
    let Some(c) = host() else { return };
    for dt in Dtype::ALL {
        let data = normal_values(dt, 70_001, 0.02, 3);
        assert!(c.round_trip_on_stream(dt, &data, &Params::default()).unwrap() == data);
    }
}

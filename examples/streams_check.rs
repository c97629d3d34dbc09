//! hoccl-example: self-checking
//! Many streams with collectives pending at once, one rank per process: K user streams per
//! rank each run an AllGather every round (filled afresh before it, on the same stream), so
//! K streams of every process wait on hoccl at the same time, up to the limit of waiting
//! streams (`HOCCL_MAX_WAITING_STREAMS`, 16 on CUDA by default; past it the calls take
//! turns). The README's "Hardware queues" limit is about such waits: on one H200, two
//! processes with 32 waiting streams each stopped for good without the limit, and pass with
//! it. This checks every byte.
//!
//!   mpirun -np 2 target/release/examples/streams_check [--streams 1,4,16,32] [--rounds N] [--bytes 1M]
//!
//! Prints, per stream count, the time per round (slowest rank), the bytes gathered per
//! second over all streams, wrong bytes and failed calls. Exits non-zero if any byte is
//! wrong or any call fails (a timeout included: the communicator's timeout bounds a hang).
mod common;
use common::{arg, parse_size};
use hoccl::comm::Communicator;
use hoccl::device::{pattern_byte, Backend, DevPtr, Device, StreamHandle};
use hoccl::DataType;
use std::sync::Arc;
use std::time::Instant;

fn seed(round: usize, rank: usize, k: usize) -> u64 {
    ((round as u64) << 40) ^ ((rank as u64) << 20) ^ (k as u64) ^ 0x5EED
}

/// One stream's buffers: this rank's block and the gathered blocks of every rank.
struct Lane {
    s: StreamHandle,
    send: DevPtr,
    recv: DevPtr,
}

/// `rounds` rounds of one AllGather on each of `lanes`; returns (seconds, wrong bytes).
fn run(c: &Communicator, dev: &Arc<dyn Device>, lanes: &[Lane], block: usize, rounds: usize) -> hoccl::Result<(f64, usize)> {
    let (n, r) = (c.size(), c.rank());
    c.bootstrap().barrier()?;
    let t0 = Instant::now();
    for round in 0..rounds {
        for (k, l) in lanes.iter().enumerate() {
            dev.fill_pattern_async(l.s, l.send, block, seed(round, r, k))?;
            c.all_gather(l.send, l.recv, block, DataType::U8, l.s)?;
        }
    }
    for l in lanes {
        dev.synchronize(l.s)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    c.wait_idle()?;
    let mut wrong = 0;
    let mut got = vec![0u8; block * n];
    for (k, l) in lanes.iter().enumerate() {
        dev.copy_to_host(&mut got, l.recv)?;
        for p in 0..n {
            let want = seed(rounds - 1, p, k);
            wrong += got[p * block..(p + 1) * block].iter().enumerate().filter(|(i, v)| **v != pattern_byte(want, *i as u64)).count();
        }
    }
    Ok((secs, wrong))
}

fn main() {
    let c = common::world_or_exit("streams_check");
    let (n, r, dev) = (c.size(), c.rank(), c.device().clone());
    let gpu = dev.backend() == Backend::Cuda;
    let counts: Vec<usize> = arg("--streams").unwrap_or_else(|| if gpu { "1,4,16,32" } else { "1,4,8" }.into()).split(',').filter_map(|v| v.trim().parse().ok()).filter(|&k| k > 0).collect();
    let rounds: usize = arg("--rounds").and_then(|v| v.parse().ok()).filter(|&v| v > 0).unwrap_or(if gpu { 20 } else { 3 });
    let block = arg("--bytes").and_then(|v| parse_size(&v)).filter(|&b| b > 0).unwrap_or(if gpu { 1 << 20 } else { 64 << 10 });
    // Every stream and buffer exists before the first collective: in a CUDA context,
    // allocating or creating a stream while a collective is pending can wait for it.
    let most = counts.iter().copied().max().unwrap_or(1);
    let lanes: Vec<Lane> = (0..most)
        .map(|_| Lane { s: dev.create_stream().expect("stream"), send: dev.alloc(block).expect("alloc"), recv: dev.alloc(block * n).expect("alloc") })
        .collect();
    if r == 0 {
        println!("# hoccl streams_check: {n} ranks, backend {:?} ({}), AllGather of {block} bytes per rank, {rounds} rounds", dev.backend(), dev.name());
        println!("# {:>7} {:>14} {:>14} {:>8} {:>7}", "streams", "round(us)", "GB/s(all)", "wrong", "failed");
    }
    let mut bad = false;
    for &k in &counts {
        let (secs, wrong, failed) = match run(&c, &dev, &lanes[..k], block, rounds) {
            Ok((s, w)) => (s, w, 0u64),
            Err(e) => {
                eprintln!("rank {r}: {k} streams: {e}");
                (f64::NAN, 0, 1)
            }
        };
        let rec = [secs.to_le_bytes(), (wrong as u64).to_le_bytes(), failed.to_le_bytes()].concat();
        let all = c.bootstrap().all_gather(&rec).expect("all_gather results");
        let field = |v: &Vec<u8>, i: usize| u64::from_le_bytes(v[i * 8..(i + 1) * 8].try_into().unwrap());
        let t = all.iter().map(|v| f64::from_bits(field(v, 0))).fold(0.0, f64::max);
        let w: u64 = all.iter().map(|v| field(v, 1)).sum();
        let f: u64 = all.iter().map(|v| field(v, 2)).sum();
        if r == 0 {
            let gathered = (k * rounds * block * n) as f64;
            println!("  {k:>7} {:>14.1} {:>14.2} {w:>8} {f:>7}", t / rounds as f64 * 1e6, gathered / t / 1e9);
        }
        bad |= w > 0 || f > 0;
        if f > 0 {
            break; // the communicator's error is sticky
        }
    }
    if c.wait_idle().is_ok() && c.bootstrap().barrier().is_ok() {
        for l in lanes {
            let _ = dev.free(l.send);
            let _ = dev.free(l.recv);
            let _ = dev.destroy_stream(l.s);
        }
    }
    drop(c);
    if bad {
        std::process::exit(1);
    }
}

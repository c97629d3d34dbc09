//! hoccl-example: self-checking
//! The collectives demo (README command one): every copy-engine collective at a few sizes,
//! with time, bandwidth and a count of wrong elements, on the GPUs when present and on the
//! host backend otherwise.
//!
//!   mpirun -np 4 target/release/examples/demo [--sizes 64K,1M,16M] [--iters N]
//!
//! Exits non-zero if any element is wrong or any call fails.
mod common;
use common::{arg, parse_size};
use hoccl::comm::Communicator;
use hoccl::device::{pattern_byte, Backend, DevPtr, Device, StreamHandle};
use hoccl::DataType;
use std::sync::Arc;
use std::time::Instant;

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

struct Ctx<'a> {
    c: &'a Communicator,
    dev: Arc<dyn Device>,
    s: StreamHandle,
    n: usize,
    r: usize,
}

/// Allocates, fills with the verifiable pattern, runs `op` `iters` times, verifies.
/// Returns (seconds per op, wrong elements on this rank, kernels launched by the timed ops).
fn run(x: &Ctx, op: &str, bytes: usize, iters: usize) -> hoccl::Result<(f64, usize, u64)> {
    let (n, r, dev, s) = (x.n, x.r, &x.dev, x.s);
    let es = DataType::BF16.size();
    // per-rank block in bytes, rounded to whole elements
    let block = (bytes / n).max(es) / es * es;
    let count = block / es;
    let send = dev.alloc(block * n)?;
    let recv = dev.alloc(block * n)?;
    let seed = |rank: usize, j: usize| ((rank as u64) << 20) ^ (j as u64) ^ 0xD3_0000;
    for j in 0..n {
        dev.fill_pattern_async(s, send.add(j * block), block, seed(r, j))?;
    }
    let root = 0;
    let call = |_: usize| -> hoccl::Result<()> {
        match op {
            "allgather" => x.c.all_gather(send, recv, count, DataType::BF16, s),
            "alltoall" => x.c.all_to_all(send, recv, count, DataType::BF16, s),
            "broadcast" => x.c.broadcast(send, recv, count * n, DataType::BF16, root, s),
            "gather" => x.c.gather(send, recv, count, DataType::BF16, root, s),
            "scatter" => x.c.scatter(send, recv, count, DataType::BF16, root, s),
            _ => x.c.group(|c| {
                c.send(send, count, DataType::BF16, (r + 1) % n, s)?;
                c.recv(recv, count, DataType::BF16, (r + n - 1) % n, s)
            }),
        }
    };
    call(0)?; // warm-up (maps peer buffers once)
    dev.synchronize(s)?;
    x.c.bootstrap().barrier()?;
    let launches = hoccl::device::kernels::launch_count();
    let t = Instant::now();
    for i in 0..iters {
        call(i)?;
    }
    dev.synchronize(s)?;
    let secs = t.elapsed().as_secs_f64() / iters as f64;
    let launched = hoccl::device::kernels::launch_count() - launches;
    x.c.wait_idle()?;
    let wrong = verify(x, op, recv, block, seed)?;
    dev.free(send)?;
    dev.free(recv)?;
    Ok((secs, wrong, launched))
}

/// Wrong elements of the receive buffer against what each op must produce.
fn verify(x: &Ctx, op: &str, recv: DevPtr, block: usize, seed: impl Fn(usize, usize) -> u64) -> hoccl::Result<usize> {
    let (n, r) = (x.n, x.r);
    let mut got = vec![0u8; block * n];
    x.dev.copy_to_host(&mut got, recv)?;
    // expected (seed, byte offset within that seed's block) for each received block j
    let expect = |j: usize| -> Option<(u64, usize)> {
        match op {
            "allgather" => Some((seed(j, 0), 0)),
            "alltoall" => Some((seed(j, r), 0)),
            "broadcast" => Some((seed(0, j), 0)),
            "gather" => (r == 0).then(|| (seed(j, 0), 0)),
            "scatter" => (j == 0).then(|| (seed(0, r), 0)),
            _ => (j == 0).then(|| (seed((r + n - 1) % n, 0), 0)),
        }
    };
    let es = DataType::BF16.size();
    let mut wrong = 0;
    for j in 0..n {
        let Some((sd, base)) = expect(j) else { continue };
        let blk = &got[j * block..(j + 1) * block];
        wrong += blk.chunks(es).enumerate().filter(|(e, el)| el.iter().enumerate().any(|(b, v)| *v != pattern_byte(sd, (base + e * es + b) as u64))).count();
    }
    Ok(wrong)
}

fn main() {
    let c = common::world_or_exit("demo");
    let dev = c.device().clone();
    let gpu = dev.backend() == Backend::Cuda;
    let default_sizes = if gpu { "2M,32M,256M" } else { "64K,1M,8M" };
    let sizes: Vec<usize> = arg("--sizes").unwrap_or_else(|| default_sizes.into()).split(',').filter_map(parse_size).collect();
    let iters: usize = arg("--iters").and_then(|v| v.parse().ok()).unwrap_or(if gpu { 20 } else { 5 });
    let x = Ctx { c: &c, dev: dev.clone(), s: dev.create_stream().expect("stream"), n: c.size(), r: c.rank() };
    if x.r == 0 {
        println!("# hoccl demo: {} ranks, backend {:?} ({}), bf16, {iters} iterations", x.n, dev.backend(), dev.name());
        println!("# {:<10} {:>8} {:>12} {:>12} {:>8}", "operation", "size", "time(us)", "algbw(GB/s)", "wrong");
    }
    let mut total_wrong = 0usize;
    let mut collective_launches = 0u64;
    let mut failed = false;
    for op in ["sendrecv", "allgather", "alltoall", "broadcast", "gather", "scatter"] {
        for &sz in &sizes {
            let res = run(&x, op, sz, iters);
            let (secs, wrong) = match res {
                Ok((t, w, k)) => {
                    collective_launches += k;
                    (t, w)
                }
                Err(e) => {
                    eprintln!("rank {}: {op} {}: {e}", x.r, human(sz));
                    failed = true;
                    (f64::NAN, usize::MAX / 8)
                }
            };
            // slowest rank's time, sum of wrong elements
            let rec = [secs.to_le_bytes(), (wrong as u64).to_le_bytes()].concat();
            let all = c.bootstrap().all_gather(&rec).expect("all_gather results");
            let t = all.iter().map(|v| f64::from_le_bytes(v[..8].try_into().unwrap())).fold(0.0, f64::max);
            let w: u64 = all.iter().map(|v| u64::from_le_bytes(v[8..16].try_into().unwrap())).sum();
            total_wrong += w as usize;
            if x.r == 0 {
                println!("  {:<10} {:>8} {:>12.1} {:>12.2} {:>8}", op, human(sz), t * 1e6, sz as f64 / t / 1e9, w);
            }
        }
    }
    if x.r == 0 {
        println!("# kernels launched during the timed collectives on rank 0: {collective_launches}");
        println!("# total wrong elements: {total_wrong}");
    }
    drop(c);
    if failed || total_wrong > 0 {
        std::process::exit(1);
    }
}

//! Many mixed operations back to back on two streams, no synchronization between them:
//! AllGather, Broadcast, AlltoAll, a send/recv ring in a group, AllReduce, ReduceScatter and
//! Reduce, random sizes, dtypes, operators and roots, each on a random one of two streams.
//! Only after the last call are both streams synchronized and every result checked against
//! an expectation computed here from every rank's inputs (`reduce_into` in rank order for
//! the reductions). Three engines: `ce`, `compressed` and `auto`. The
//! same bodies run on CUDA with `--ignored` on a GPU machine.
mod common;
use common::*;

use hoccl::config::EngineChoice;
use hoccl::cost::{compress_threshold, CostModel, LinkKind};
use hoccl::device::pattern_byte;
use hoccl::reduce::reduce_into;
use hoccl::{Config, DataType, RedOp};

const OPS: u64 = 1000;
const DTYPES: [DataType; 4] = [DataType::BF16, DataType::F32, DataType::I32, DataType::U8];

/// Rank `p`'s input of op `k`: `len` bytes of a pattern.
fn input(k: u64, p: usize, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern_byte(seed_of(k, p, 3), i)).collect()
}

/// One op's call, the same on every rank (drawn from a shared seed).
struct Call {
    kind: u64,
    dtype: DataType,
    count: usize,
    op: RedOp,
    root: usize,
    stream: usize,
}

fn draw(rng: &mut Rng, n: usize) -> Call {
    let kind = rng.below(7);
    let dtype = DTYPES[rng.below(DTYPES.len() as u64) as usize];
    // Sometimes above the compressed engine's 64 KiB threshold.
    let count = match rng.below(4) {
        0 => rng.below(8) as usize,
        1 => (70_000 / dtype.size()) + rng.below(100) as usize,
        _ => rng.below(3000) as usize + 1,
    };
    // Prod and Avg of random bytes reach inf/NaN quickly, which reduce_into defines too.
    let op = RedOp::ALL[rng.below(5) as usize];
    Call { kind, dtype, count, op, root: rng.below(n as u64) as usize, stream: rng.below(2) as usize }
}

fn run(b: Backend, engine: EngineChoice) {
    run_with(b, Config { engine, ..test_config() })
}

fn run_with(b: Backend, config: Config) {
    let engine = config.engine;
    run_ranks(b, 3, config, move |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        // Thread ranks on one GPU reserve the reductions' scratch before any collective
        // (docs/design.md, "Reductions").
        c.reserve_reduce_scratch().unwrap();
        let streams = [new_stream(&dev), new_stream(&dev)];
        let mut rng = Rng(2026 + engine as u64);
        // (op number, the call, its output buffer, what it must hold)
        let mut checks: Vec<(u64, Buf, Vec<u8>)> = Vec::new();
        for k in 0..OPS {
            let call = draw(&mut rng, n);
            let (dt, count, s) = (call.dtype, call.count, streams[call.stream]);
            let len = count * dt.size();
            let fold = |inputs: &[Vec<u8>], at: usize, l: usize| {
                let srcs: Vec<&[u8]> = inputs.iter().map(|v| &v[at..at + l]).collect();
                let mut out = vec![0u8; l];
                reduce_into(dt, call.op, &mut out, &srcs).unwrap();
                out
            };
            match call.kind {
                0 => {
                    let send = Buf::new(&dev, len, 0, 1);
                    let recv = Buf::new(&dev, n * len, 0, 2);
                    dev.copy_from_host(send.ptr, &input(k, r, len)).unwrap();
                    c.all_gather(send.ptr, recv.ptr, count, dt, s).unwrap();
                    let want: Vec<u8> = (0..n).flat_map(|p| input(k, p, len)).collect();
                    checks.push((k, recv, want));
                    drop(send);
                }
                1 => {
                    let buf = Buf::new(&dev, len, 0, 3);
                    dev.copy_from_host(buf.ptr, &input(k, r, len)).unwrap();
                    c.broadcast(buf.ptr, buf.ptr, count, dt, call.root, s).unwrap();
                    checks.push((k, buf, input(k, call.root, len)));
                }
                2 => {
                    let send = Buf::new(&dev, n * len, 0, 4);
                    let recv = Buf::new(&dev, n * len, 0, 5);
                    dev.copy_from_host(send.ptr, &input(k, r, n * len)).unwrap();
                    c.all_to_all(send.ptr, recv.ptr, count, dt, s).unwrap();
                    let want: Vec<u8> = (0..n).flat_map(|p| input(k, p, n * len)[r * len..(r + 1) * len].to_vec()).collect();
                    checks.push((k, recv, want));
                    drop(send);
                }
                3 => {
                    let send = Buf::new(&dev, len, 0, 6);
                    let recv = Buf::new(&dev, len, 0, 7);
                    dev.copy_from_host(send.ptr, &input(k, r, len)).unwrap();
                    c.group(|c| {
                        c.send(send.ptr, count, dt, (r + 1) % n, s)?;
                        c.recv(recv.ptr, count, dt, (r + n - 1) % n, s)
                    })
                    .unwrap();
                    checks.push((k, recv, input(k, (r + n - 1) % n, len)));
                    drop(send);
                }
                4 => {
                    let send = Buf::new(&dev, len, 0, 8);
                    let recv = Buf::new(&dev, len, 0, 9);
                    dev.copy_from_host(send.ptr, &input(k, r, len)).unwrap();
                    c.all_reduce(send.ptr, recv.ptr, count, dt, call.op, s).unwrap();
                    let inputs: Vec<Vec<u8>> = (0..n).map(|p| input(k, p, len)).collect();
                    checks.push((k, recv, fold(&inputs, 0, len)));
                    drop(send);
                }
                5 => {
                    let send = Buf::new(&dev, n * len, 0, 10);
                    let recv = Buf::new(&dev, len, 0, 11);
                    dev.copy_from_host(send.ptr, &input(k, r, n * len)).unwrap();
                    c.reduce_scatter(send.ptr, recv.ptr, count, dt, call.op, s).unwrap();
                    let inputs: Vec<Vec<u8>> = (0..n).map(|p| input(k, p, n * len)).collect();
                    checks.push((k, recv, fold(&inputs, r * len, len)));
                    drop(send);
                }
                _ => {
                    let send = Buf::new(&dev, len, 0, 12);
                    let recv = Buf::new(&dev, len, 0, 13);
                    dev.copy_from_host(send.ptr, &input(k, r, len)).unwrap();
                    c.reduce(send.ptr, recv.ptr, count, dt, call.op, call.root, s).unwrap();
                    if r == call.root {
                        let inputs: Vec<Vec<u8>> = (0..n).map(|p| input(k, p, len)).collect();
                        checks.push((k, recv, fold(&inputs, 0, len)));
                    }
                    drop(send);
                }
            }
        }
        for s in streams {
            sync(&dev, s);
        }
        c.wait_idle().unwrap();
        for (k, buf, want) in &checks {
            let got = buf.read_all();
            assert!(got[buf.off..buf.off + buf.len] == want[..], "op {k}: wrong result ({} bytes)", buf.len);
            assert_eq!(buf.guard_damage(&got), 0, "op {k}: guard bands");
        }
    });
}

fn copy_engine(b: Backend) {
    run(b, EngineChoice::CopyEngine);
}

fn compressed(b: Backend) {
    run(b, EngineChoice::Compressed);
}

/// `auto`, with the links slowed down in its model so that it compresses some transfers:
/// bf16 ones from 64 KiB, f32 ones only from about 100 KB (so this test's 70 KB f32 blocks
/// move raw), integers never. A rank that chose differently from its peer would fail the op.
fn auto(b: Backend) {
    let cost_model = CostModel::default().with_overrides("same_gpu_gbps=1,nvlink_gbps=1").unwrap();
    let bf16 = compress_threshold(&cost_model, DataType::BF16, LinkKind::SameGpu);
    let f32 = compress_threshold(&cost_model, DataType::F32, LinkKind::SameGpu).unwrap();
    assert_eq!(bf16, Some(64 << 10));
    assert!(f32 > 70_400 && f32 < 128 << 10, "{f32}");
    run_with(b, Config { engine: EngineChoice::Auto, cost_model, ..test_config() });
}

backend_tests!(copy_engine, compressed, auto);

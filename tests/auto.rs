//! `HOCCL_ENGINE=auto`: the engine each call gets, and calls whose transfers straddle the
//! size from which the model compresses. The model's links are slowed down so that it
//! compresses bf16 transfers from 64 KiB on (ranks here share a GPU, or have NVLink on a
//! multi-GPU machine). The same bodies run on CUDA with `--ignored` on a GPU machine.
mod common;
use common::*;

use hoccl::comm::{Collective, OpDesc};
use hoccl::config::EngineChoice;
use hoccl::cost::{compress_threshold, CostModel, Engine, LinkKind};
use hoccl::device::DevPtr;
use hoccl::{Config, DataType, RedOp};

const SLOW: &str = "same_gpu_gbps=1,nvlink_gbps=1";

fn auto_config() -> Config {
    Config { engine: EngineChoice::Auto, cost_model: CostModel::default().with_overrides(SLOW).unwrap(), ..test_config() }
}

/// The engine of calls of every kind: raw below the threshold and for integers, compressed
/// above it; reductions on `sm` otherwise. Every rank gets the same answers.
fn choices(b: Backend) {
    run_ranks(b, 3, auto_config(), |c| {
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let desc = |coll, count, dtype| OpDesc { coll, send: DevPtr(0), recv: DevPtr(0), count, dtype, stream: s };
        let engine = |coll, count, dtype| c.predicted_engine(&desc(coll, count, dtype)).0;
        let big = 1 << 20;
        assert_eq!(engine(Collective::AllGather, 16, DataType::BF16), Engine::Ce);
        assert_eq!(engine(Collective::AllGather, big, DataType::BF16), Engine::Compressed);
        assert_eq!(engine(Collective::AllGather, big, DataType::I32), Engine::Ce);
        assert_eq!(engine(Collective::Send { peer: (c.rank() + 1) % 3 }, big, DataType::F32), Engine::Compressed);
        assert_eq!(engine(Collective::AllReduce { op: RedOp::Sum }, big, DataType::BF16), Engine::Compressed);
        assert_eq!(engine(Collective::AllReduce { op: RedOp::Max }, big, DataType::I64), Engine::Sm);
        assert_eq!(engine(Collective::ReduceScatter { op: RedOp::Sum }, 100, DataType::F32), Engine::Sm);
        // The engine set, not the model, outside auto.
        let (_, p, link) = c.predicted_engine(&desc(Collective::AllGather, big, DataType::BF16));
        assert!(p.compressed_us.unwrap() < p.raw_us);
        assert!(matches!(link, LinkKind::SameGpu | LinkKind::NvLink), "{link:?}");
    });
    let ce = Config { engine: EngineChoice::CopyEngine, ..auto_config() };
    run_ranks(b, 2, ce, |c| {
        let s = new_stream(c.device());
        let op = OpDesc { coll: Collective::AllGather, send: DevPtr(0), recv: DevPtr(0), count: 1 << 20, dtype: DataType::BF16, stream: s };
        assert_eq!(c.predicted_engine(&op).0, Engine::Ce);
    });
}

/// Rank r's element i toward peer p, as bytes: any bf16 bit pattern (movement is bit-exact).
fn value(r: usize, p: usize, i: usize) -> [u8; 2] {
    (((r * 7 + p * 3) as u16).wrapping_mul(0x1F1) ^ (i as u16).wrapping_mul(0x9E37)).to_le_bytes()
}

/// AlltoAllv whose transfers to different peers fall on both sides of the threshold (and on
/// it): each pair of ranks must agree transfer by transfer.
fn alltoallv_straddles_threshold(b: Backend) {
    let t = compress_threshold(&CostModel::default().with_overrides(SLOW).unwrap(), DataType::BF16, LinkKind::SameGpu).unwrap();
    let t_elems = t / 2;
    // counts[r][p]: elements rank r sends to rank p.
    let sizes = [0, 5, t_elems - 1, t_elems, t_elems + 1, 3 * t_elems + 7];
    let n = 3;
    let counts: Vec<Vec<usize>> = (0..n).map(|r| (0..n).map(|p| sizes[(r * 2 + p * 3 + 1) % sizes.len()]).collect()).collect();
    run_ranks(b, n, auto_config(), move |c| {
        let (r, dev) = (c.rank(), c.device().clone());
        let s = new_stream(&dev);
        let send_counts = counts[r].clone();
        let recv_counts: Vec<usize> = (0..n).map(|p| counts[p][r]).collect();
        let displs = |v: &[usize]| v.iter().scan(0, |acc, &x| Some(std::mem::replace(acc, *acc + x))).collect::<Vec<_>>();
        let (send_displs, recv_displs) = (displs(&send_counts), displs(&recv_counts));
        let send_total: usize = send_counts.iter().sum();
        let recv_total: usize = recv_counts.iter().sum();
        let send = Buf::new(&dev, send_total * 2, 0, 1);
        let recv = Buf::new(&dev, recv_total * 2, 0, 2);
        let mut data = Vec::with_capacity(send_total * 2);
        for (p, &k) in send_counts.iter().enumerate() {
            for i in 0..k {
                data.extend_from_slice(&value(r, p, i));
            }
        }
        dev.copy_from_host(send.ptr, &data).unwrap();
        allocated(c);
        // Two back to back, then the check, so the second reuses the staging of the first.
        for _ in 0..2 {
            c.all_to_allv(send.ptr, &send_counts, &send_displs, recv.ptr, &recv_counts, &recv_displs, DataType::BF16, s).unwrap();
        }
        sync(&dev, s);
        c.wait_idle().unwrap();
        let got = recv.read_all();
        let mut want = Vec::with_capacity(recv_total * 2);
        for (p, &k) in recv_counts.iter().enumerate() {
            for i in 0..k {
                want.extend_from_slice(&value(p, r, i));
            }
        }
        assert!(got[recv.off..recv.off + recv.len] == want[..], "rank {r}: AlltoAllv result differs");
        assert_eq!(recv.guard_damage(&got), 0);
    });
}

/// Ranks whose `HOCCL_COST_MODEL` differ all use rank 0's: here rank 1's own model would
/// compress a 1 MiB bf16 message that rank 0's moves raw, and the transfer would not match.
fn rank0_model_wins(b: Backend) {
    let n = 2;
    let handles: Vec<_> = hoccl::ThreadBootstrap::group_with_timeout(n, std::time::Duration::from_secs(30))
        .into_iter()
        .enumerate()
        .map(|(r, boot)| {
            std::thread::spawn(move || {
                let cfg = if r == 0 { Config { engine: EngineChoice::Auto, ..test_config() } } else { auto_config() };
                let dev = open_device(b, r);
                let c = hoccl::Communicator::with_bootstrap(Box::new(boot), Some(dev.clone()), cfg).expect("communicator");
                let s = new_stream(&dev);
                let count = 1 << 19;
                let op = OpDesc { coll: Collective::Send { peer: 1 - r }, send: DevPtr(0), recv: DevPtr(0), count, dtype: DataType::BF16, stream: s };
                assert_eq!(c.predicted_engine(&op).0, Engine::Ce, "rank {r}");
                let (send, recv) = (Buf::new(&dev, 2 * count, 0, 1), Buf::new(&dev, 2 * count, 0, 2));
                let data: Vec<u8> = (0..2 * count).map(|i| (i * 31 + r * 7) as u8).collect();
                dev.copy_from_host(send.ptr, &data).unwrap();
                c.group(|c| {
                    c.send(send.ptr, count, DataType::BF16, 1 - r, s)?;
                    c.recv(recv.ptr, count, DataType::BF16, 1 - r, s)
                })
                .unwrap();
                sync(&dev, s);
                c.wait_idle().unwrap();
                let got = recv.read_all();
                let want: Vec<u8> = (0..2 * count).map(|i| (i * 31 + (1 - r) * 7) as u8).collect();
                assert!(got[..2 * count] == want[..], "rank {r}: wrong data");
                if c.bootstrap().barrier().is_ok() {
                    free_deferred();
                }
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().is_ok(), "a rank failed");
    }
}

backend_tests!(choices, alltoallv_straddles_threshold, rank0_model_wins);

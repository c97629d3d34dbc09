//! Every operation on the default streams, two ranks in two processes (this test binary
//! re-run with `HOCCL_STREAMS_CHILD` set), one fresh communicator per stream: stream 0 (the
//! legacy default stream on CUDA), and on CUDA also `CU_STREAM_LEGACY` (`cudaStreamLegacy`,
//! handle 1) and `CU_STREAM_PER_THREAD` (`cudaStreamPerThread`, handle 2). These are the
//! streams NCCL programs pass most often without creating one, and they synchronize with
//! every blocking stream: a synchronous copy that hoccl issued while enqueueing a reduction
//! once waited there for the reduction itself (two processes, rank 0's first reduce step).
//!
//! A second body enqueues three collectives back to back on a fresh communicator before it
//! waits (its first reduction then sets up while the AllGather may be pending).
//!
//! The host backend runs stream 0 here; the CUDA bodies run with `--ignored` on a GPU
//! (`scripts/gpu/core.sh` runs every test binary both ways). A child that does not finish
//! within the limit is killed and the test fails: a hang is a failure, not a wait.
mod common;
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::config::BackendChoice;
use hoccl::{Collective, Communicator, Config, DataType, DevPtr, Device, OpDesc, RedOp, StreamHandle};
use std::time::{Duration, Instant};

const N: usize = 2;
/// Counts: 1 gives rank 0 no AllReduce shard, so its first reduce step is the
/// ReduceScatter's (where the hang was); 4099 spans several shards and odd tails.
const COUNTS: [usize; 2] = [1, 4099];
const LIMIT: Duration = Duration::from_secs(90);

/// Rank r's element i (salt s): small integers, exact in every fold below.
fn v(r: usize, i: usize, s: usize) -> i32 {
    ((i * 7 + r * 13 + s * 5) % 11) as i32 - 5
}

fn bytes(x: &[i32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn ints(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

struct Rank {
    comm: Communicator,
    s: StreamHandle,
    send: DevPtr,
    recv: DevPtr,
    me: usize,
}

impl Rank {
    fn dev(&self) -> &std::sync::Arc<dyn Device> {
        self.comm.device()
    }

    /// Upload `send`, poison `recv`, run `op` on the stream, wait for it, read `len` ints of recv.
    fn run(&self, what: &str, data: &[i32], coll: Collective<'static>, count: usize, len: usize) -> Vec<i32> {
        self.dev().copy_from_host(self.send, &bytes(data)).expect("upload");
        self.dev().copy_from_host(self.recv, &bytes(&vec![i32::MIN; len.max(1)])).expect("poison");
        let d = OpDesc { coll, send: self.send, recv: self.recv, count, dtype: DataType::I32, stream: self.s };
        self.comm.enqueue(&d).unwrap_or_else(|e| panic!("rank {}: {what}: {e}", self.me));
        self.dev().synchronize(self.s).unwrap_or_else(|e| panic!("rank {}: {what}: synchronize: {e}", self.me));
        let mut out = vec![0u8; len * 4];
        self.dev().copy_to_host(&mut out, self.recv).expect("download");
        ints(&out)
    }
}

/// One rank: a communicator over `id`, every operation on stream `s`, each result checked.
fn every_op(id: &UniqueId, me: usize, backend: BackendChoice, s: StreamHandle) {
    let cfg = Config { backend, timeout: Duration::from_secs(30), ..Config::from_env().expect("HOCCL_* settings") };
    let comm = Communicator::from_unique_id(id, N, me, cfg).expect("communicator");
    let cap = COUNTS.iter().max().unwrap() * N * 4;
    let (send, recv) = (comm.device().alloc(cap).expect("alloc"), comm.device().alloc(cap).expect("alloc"));
    let r = Rank { comm, s, send, recv, me };
    for c in COUNTS {
        let at = |what: &str| format!("rank {me}: stream {:#x}: {what} count {c}", s.0);
        let mine = |salt| (0..N * c).map(|i| v(me, i, salt)).collect::<Vec<_>>();
        let sum = |i, salt| (0..N).map(|p| v(p, i, salt)).sum::<i32>();

        let got = r.run("AllReduce", &mine(1), Collective::AllReduce { op: RedOp::Sum }, c, c);
        assert!(got.iter().enumerate().all(|(i, x)| *x == sum(i, 1)), "{}", at("AllReduce"));

        let got = r.run("ReduceScatter", &mine(2), Collective::ReduceScatter { op: RedOp::Sum }, c, c);
        assert!(got.iter().enumerate().all(|(i, x)| *x == sum(me * c + i, 2)), "{}", at("ReduceScatter"));

        let got = r.run("Reduce", &mine(3), Collective::Reduce { op: RedOp::Max, root: 1 }, c, c);
        if me == 1 {
            assert!(got.iter().enumerate().all(|(i, x)| *x == (0..N).map(|p| v(p, i, 3)).max().unwrap()), "{}", at("Reduce"));
        }

        let got = r.run("AllGather", &mine(4), Collective::AllGather, c, N * c);
        assert!(got.iter().enumerate().all(|(i, x)| *x == v(i / c, i % c, 4)), "{}", at("AllGather"));

        let got = r.run("Broadcast", &mine(5), Collective::Broadcast { root: 1 }, c, c);
        assert!(got.iter().enumerate().all(|(i, x)| *x == v(1, i, 5)), "{}", at("Broadcast"));

        let got = r.run("AllToAll", &mine(6), Collective::AllToAll, c, N * c);
        assert!(got.iter().enumerate().all(|(i, x)| *x == v(i / c, me * c + i % c, 6)), "{}", at("AllToAll"));

        let got = r.run("Gather", &mine(7), Collective::Gather { root: 0 }, c, N * c);
        if me == 0 {
            assert!(got.iter().enumerate().all(|(i, x)| *x == v(i / c, i % c, 7)), "{}", at("Gather"));
        }

        let got = r.run("Scatter", &mine(8), Collective::Scatter { root: 1 }, c, c);
        assert!(got.iter().enumerate().all(|(i, x)| *x == v(1, me * c + i, 8)), "{}", at("Scatter"));

        // Send and Recv to the other rank in one group.
        r.dev().copy_from_host(r.send, &bytes(&mine(9))).expect("upload");
        let other = 1 - me;
        r.comm.group_start().expect("group_start");
        let op = |coll| OpDesc { coll, send: r.send, recv: r.recv, count: c, dtype: DataType::I32, stream: s };
        r.comm.enqueue(&op(Collective::Send { peer: other })).expect("send");
        r.comm.enqueue(&op(Collective::Recv { peer: other })).expect("recv");
        r.comm.group_end().expect("group_end");
        r.dev().synchronize(s).expect("synchronize");
        let mut out = vec![0u8; c * 4];
        r.dev().copy_to_host(&mut out, r.recv).expect("download");
        assert!(ints(&out).iter().enumerate().all(|(i, x)| *x == v(other, i, 9)), "{}", at("Send/Recv"));
    }
    r.comm.wait_idle().expect("idle");
    r.dev().free(r.send).expect("free");
    r.dev().free(r.recv).expect("free");
    println!("rank {me}: every op on stream {:#x}: ok", s.0);
}

/// One rank, a fresh communicator: an AllGather, an AllReduce and a ReduceScatter enqueued
/// back to back on stream `s`, waited for once, then checked. The AllReduce is the
/// communicator's first reduction, so it sets up its scratch and the kernel's constants while
/// the AllGather may still be pending on the stream (a program that never synchronizes
/// between collectives, as most do).
fn pipelined(id: &UniqueId, me: usize, backend: BackendChoice, s: StreamHandle) {
    let cfg = Config { backend, timeout: Duration::from_secs(30), ..Config::from_env().expect("HOCCL_* settings") };
    let comm = Communicator::from_unique_id(id, N, me, cfg).expect("communicator");
    let dev = comm.device().clone();
    let c = 4099;
    let bufs: Vec<DevPtr> = (0..6).map(|_| dev.alloc(N * c * 4).expect("alloc")).collect();
    let mine = |salt| (0..N * c).map(|i| v(me, i, salt)).collect::<Vec<_>>();
    for (k, salt) in [(0, 21), (2, 22), (4, 23)] {
        dev.copy_from_host(bufs[k], &bytes(&mine(salt))).expect("upload");
    }
    let op = |coll, k: usize, count| OpDesc { coll, send: bufs[k], recv: bufs[k + 1], count, dtype: DataType::I32, stream: s };
    comm.enqueue(&op(Collective::AllGather, 0, c)).expect("AllGather");
    comm.enqueue(&op(Collective::AllReduce { op: RedOp::Sum }, 2, c)).expect("AllReduce");
    comm.enqueue(&op(Collective::ReduceScatter { op: RedOp::Sum }, 4, c)).expect("ReduceScatter");
    dev.synchronize(s).expect("synchronize");
    let read = |k: usize, n: usize| {
        let mut out = vec![0u8; n * 4];
        dev.copy_to_host(&mut out, bufs[k]).expect("download");
        ints(&out)
    };
    let sum = |i, salt| (0..N).map(|p| v(p, i, salt)).sum::<i32>();
    assert!(read(1, N * c).iter().enumerate().all(|(i, x)| *x == v(i / c, i % c, 21)), "rank {me}: pipelined AllGather");
    assert!(read(3, c).iter().enumerate().all(|(i, x)| *x == sum(i, 22)), "rank {me}: pipelined AllReduce");
    assert!(read(5, c).iter().enumerate().all(|(i, x)| *x == sum(me * c + i, 23)), "rank {me}: pipelined ReduceScatter");
    comm.wait_idle().expect("idle");
    for b in bufs {
        dev.free(b).expect("free");
    }
    println!("rank {me}: pipelined ops on stream {:#x}: ok", s.0);
}

/// The child side: does nothing unless `HOCCL_STREAMS_CHILD` (`<hex id> <rank> <host|cuda>
/// <stream> <every|pipelined>`) is set.
#[test]
fn child_rank() {
    let Ok(v) = std::env::var("HOCCL_STREAMS_CHILD") else { return };
    let a: Vec<&str> = v.split_whitespace().collect();
    let id = UniqueId::from_hex(a[0]).expect("id parses");
    let me: usize = a[1].parse().expect("rank");
    let backend = if a[2] == "cuda" { BackendChoice::Cuda } else { BackendChoice::Host };
    let s = StreamHandle(a[3].parse().expect("stream"));
    match a[4] {
        "every" => every_op(&id, me, backend, s),
        _ => pipelined(&id, me, backend, s),
    }
}

/// Two child processes per stream, each bounded by LIMIT; `mode` is the child's body.
fn two_processes(backend: &str, streams: &[u64], mode: &str) {
    common::logs::capture();
    let exe = std::env::current_exe().expect("test binary");
    for &s in streams {
        let id = Communicator::unique_id(&Config::from_env().expect("HOCCL_* settings")).expect("unique id");
        let mut kids: Vec<_> = (0..N)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(["--exact", "child_rank", "--nocapture", "--test-threads=1", "--include-ignored"])
                    .env("HOCCL_STREAMS_CHILD", format!("{} {r} {backend} {s} {mode}", id.to_hex()))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawn child rank")
            })
            .collect();
        let t0 = Instant::now();
        while kids.iter_mut().any(|k| k.try_wait().expect("wait").is_none()) {
            if t0.elapsed() > LIMIT {
                for k in &mut kids {
                    let _ = k.kill();
                }
                let logs: Vec<String> = kids.into_iter().map(|k| k.wait_with_output().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default()).collect();
                panic!("{backend} stream {s:#x}: the ranks did not finish within {LIMIT:?} (hung)\n{}", logs.join("\n---\n"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for (r, k) in kids.into_iter().enumerate() {
            let out = k.wait_with_output().expect("child");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains(if mode == "every" { "every op on stream" } else { "pipelined ops on stream" }),
                "{backend} stream {s:#x} rank {r}: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn every_op_on_the_default_stream_host() {
    two_processes("host", &[0], "every");
}

#[test]
fn pipelined_ops_on_the_default_stream_host() {
    two_processes("host", &[0], "pipelined");
}

/// Stream 0, `cudaStreamLegacy` and `cudaStreamPerThread`.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn every_op_on_the_default_streams_cuda() {
    two_processes("cuda", &[0, 1, 2], "every");
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn pipelined_ops_on_the_default_streams_cuda() {
    two_processes("cuda", &[0, 1, 2], "pipelined");
}

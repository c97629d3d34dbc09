#!/usr/bin/env python3
"""torch.distributed's "nccl" backend on whatever libnccl.so.2 the dynamic loader found,
every result compared with the same computation on a gloo process group over CPU copies of
the inputs. Run with torchrun:

    torchrun --nproc-per-node N tests/nccl/torch_check.py [--expect-lib PATH] [--steps 200]

Ranks use GPU (LOCAL_RANK mod the GPU count), so several ranks share a GPU when there are
fewer GPUs than ranks (hoccl allows that; NCCL itself refuses it).

Checks, in order: all_reduce (sum, product, max, min on float32 and int64; avg against gloo's
sum / N), all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (equal and
uneven splits), broadcast from every root, batch_isend_irecv (a ring both ways), barrier,
new_group (the even ranks, and a one-rank group per rank); a short DDP run (a small MLP,
fixed seed) whose per-step losses must match a gloo DDP run of the same model (the tolerance
is printed: the models run the same kernels on the same GPU when gloo accepts CUDA tensors;
otherwise gloo's model runs on the CPU and the tolerance is wider); then collectives captured
in a CUDA graph (torch.cuda.graph) and replayed several times with fresh inputs: an
all_reduce on each one-rank group and on the whole group, then all_reduce,
all_gather_into_tensor and reduce_scatter_tensor on the whole group in one graph, with an
eager all_reduce between replays, every replay compared with gloo; destroy_process_group.

--expect-lib PATH: also require that the process's global symbol lookup (the one torch's
NCCL calls bind to) finds NCCL's entry points in PATH (dladdr, after resolving links); the
libnccl files mapped (/proc/self/maps) are printed beside it, since torch may map NVIDIA's
copy privately by its path.
Every integer-valued input makes each reduction exact in any order, so results must be equal,
not close. A rank that hangs is stopped by a watchdog (--timeout) with a traceback.
Exit status 0 only when every rank passed."""
import argparse
import ctypes
import datetime
import faulthandler
import os
import sys
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

failures = []
RANK = int(os.environ.get("RANK", "0"))


def say(msg):
    print(f"torch_check: rank {RANK}: {msg}", flush=True)


def expect(ok, what):
    if not ok:
        failures.append(what)
        print(f"torch_check: rank {RANK}: FAILED: {what}", file=sys.stderr, flush=True)
    return ok


def data(rank, n, dtype, salt):
    """Small integers (-3..3), so sums, products, max/min of up to 8 ranks are exact."""
    x = (torch.arange(n, dtype=torch.int64) * 7 + rank * 13 + salt * 5) % 7 - 3
    return x.to(dtype)


def mapped_nccl_libraries():
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "libnccl.so" in os.path.basename(parts[5]):
                paths.add(parts[5])
    return sorted(paths)


class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def serving_library(symbol):
    """The file whose `symbol` the process's global lookup finds: the definition torch's
    references to NCCL bind to (LD_PRELOAD comes first in that order). torch may also map
    NVIDIA's libnccl by its path (a private copy, its symbols not in the global scope), so
    what is mapped does not say what serves the calls."""
    addr = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
    info = DlInfo()
    libdl = ctypes.CDLL("libdl.so.2")
    libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not addr or libdl.dladdr(addr, ctypes.byref(info)) == 0 or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


NCCL_CALLS = ["ncclCommInitRankConfig", "ncclAllReduce", "ncclAllGather", "ncclReduceScatter",
              "ncclBroadcast", "ncclSend", "ncclRecv", "ncclGroupEnd"]


def check_library(expect_lib):
    libs = mapped_nccl_libraries()
    served = {serving_library(f) for f in NCCL_CALLS}
    say(f"libnccl mapped: {libs or 'none'}; NCCL calls served by {sorted(map(str, served))}; "
        f"torch.cuda.nccl.version() = {torch.cuda.nccl.version()}")
    if expect_lib:
        want = os.path.realpath(expect_lib)
        expect(served == {want}, f"NCCL calls are served by {sorted(map(str, served))}, not only by {want}")


class Ctx:
    def __init__(self, dev, world, gloo):
        self.dev, self.world, self.gloo = dev, world, gloo
        self.rank, self.size = dist.get_rank(), dist.get_world_size()


def compare(name, got_cuda, want_cpu):
    got = got_cuda.cpu()
    ok = got.dtype == want_cpu.dtype and got.shape == want_cpu.shape and torch.equal(got, want_cpu)
    bad = "" if ok or got.shape != want_cpu.shape else f": {int((got != want_cpu).sum())} wrong elements"
    return expect(ok, f"{name}{bad}")


def check_all_reduce(c):
    ops = [("sum", dist.ReduceOp.SUM), ("product", dist.ReduceOp.PRODUCT), ("max", dist.ReduceOp.MAX),
           ("min", dist.ReduceOp.MIN)]
    for dtype in (torch.float32, torch.int64):
        for i, (name, op) in enumerate(ops):
            x = data(c.rank, 10007, dtype, i)
            a = x.to(c.dev)
            dist.all_reduce(a, op=op)
            b = x.clone()
            dist.all_reduce(b, op=op, group=c.gloo)
            compare(f"all_reduce {name} {dtype}", a, b)
    x = data(c.rank, 4099, torch.float32, 9)
    a = x.to(c.dev)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    b = x.clone()
    dist.all_reduce(b, group=c.gloo)
    expect(torch.allclose(a.cpu(), b / c.size, rtol=1e-6, atol=0), "all_reduce avg float32 (gloo sum / N)")


def check_all_gather(c):
    x = data(c.rank, 5003, torch.float32, 20)
    out = torch.empty(5003 * c.size, device=c.dev)
    dist.all_gather_into_tensor(out, x.to(c.dev))
    parts = [torch.empty_like(x) for _ in range(c.size)]
    dist.all_gather(parts, x, group=c.gloo)
    compare("all_gather_into_tensor", out, torch.cat(parts))


def check_reduce_scatter(c):
    n = 3001
    x = data(c.rank, n * c.size, torch.float32, 30)
    out = torch.empty(n, device=c.dev)
    dist.reduce_scatter_tensor(out, x.to(c.dev))
    # gloo has no reduce_scatter: the same sum as an all_reduce, then this rank's block.
    ref = x.clone()
    dist.all_reduce(ref, group=c.gloo)
    compare("reduce_scatter_tensor", out, ref[c.rank * n:(c.rank + 1) * n])


def gloo_all_to_all(c, x, in_splits, out_splits):
    """all_to_all_single on gloo, or (if this gloo lacks it) gathered and sliced here."""
    out = torch.empty(sum(out_splits), dtype=x.dtype)
    try:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=c.gloo)
        return out
    except RuntimeError:
        parts = [None] * c.size
        dist.all_gather_object(parts, (x, in_splits), group=c.gloo)
        blocks = []
        for p, (xp, sp) in enumerate(parts):
            at = sum(sp[:c.rank])
            blocks.append(xp[at:at + sp[c.rank]])
        return torch.cat(blocks)


def check_all_to_all(c):
    n = 1000
    x = data(c.rank, n * c.size, torch.int64, 40)
    out = torch.empty_like(x, device=c.dev)
    dist.all_to_all_single(out, x.to(c.dev))
    compare("all_to_all_single equal splits", out, gloo_all_to_all(c, x, [n] * c.size, [n] * c.size))
    # Uneven: rank r sends r + p + 1 elements to rank p.
    ins = [c.rank + p + 1 for p in range(c.size)]
    outs = [p + c.rank + 1 for p in range(c.size)]
    x = data(c.rank, sum(ins), torch.int64, 41)
    out = torch.empty(sum(outs), dtype=torch.int64, device=c.dev)
    dist.all_to_all_single(out, x.to(c.dev), outs, ins)
    compare("all_to_all_single uneven splits", out, gloo_all_to_all(c, x, ins, outs))


def check_broadcast(c):
    for root in range(c.size):
        x = data(c.rank, 7001, torch.float32, 50 + root)
        a = x.to(c.dev)
        dist.broadcast(a, src=root)
        b = x.clone()
        dist.broadcast(b, src=root, group=c.gloo)
        compare(f"broadcast from {root}", a, b)


def check_p2p(c):
    if c.size == 1:
        return
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    x = data(c.rank, 4097, torch.float32, 60).to(c.dev)
    y = data(c.rank, 2049, torch.int64, 61).to(c.dev)
    from_prev = torch.zeros(4097, device=c.dev)
    from_next = torch.zeros(2049, dtype=torch.int64, device=c.dev)
    ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, from_prev, prv),
           dist.P2POp(dist.isend, y, prv), dist.P2POp(dist.irecv, from_next, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize(c.dev)
    # The reference over gloo: the same ring with CPU tensors.
    gx, gy = torch.zeros(4097), torch.zeros(2049, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, x.cpu(), nxt, group=c.gloo), dist.P2POp(dist.irecv, gx, prv, group=c.gloo),
           dist.P2POp(dist.isend, y.cpu(), prv, group=c.gloo), dist.P2POp(dist.irecv, gy, nxt, group=c.gloo)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    compare("batch_isend_irecv from the previous rank", from_prev, gx)
    compare("batch_isend_irecv from the next rank", from_next, gy)


def check_barrier(c):
    dist.barrier()
    torch.cuda.synchronize(c.dev)


def check_new_group(c):
    evens = list(range(0, c.size, 2))
    g = dist.new_group(evens)
    gg = dist.new_group(evens, backend="gloo")
    if c.rank in evens:
        x = data(c.rank, 3000, torch.float32, 70)
        a = x.to(c.dev)
        dist.all_reduce(a, group=g)
        b = x.clone()
        dist.all_reduce(b, group=gg)
        compare(f"new_group {evens}: all_reduce", a, b)
        dist.barrier(group=g)


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def ddp_losses(c, group, device, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = mlp(1234).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + c.rank)
    losses = []
    for _ in range(steps):
        xb = torch.randn(64, 32, generator=gen)
        yb = xb[:, :4].sum(1, keepdim=True).sin()
        xb, yb = xb.to(device), yb.to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_ddp(c, steps):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours = ddp_losses(c, c.world, c.dev, steps)
    try:
        ref, where, rtol = ddp_losses(c, c.gloo, c.dev, steps), "gloo on the same GPU", 1e-5
    except RuntimeError as e:
        say(f"gloo DDP on CUDA tensors refused ({str(e).splitlines()[0]}); gloo DDP on the CPU instead")
        ref, where, rtol = ddp_losses(c, c.gloo, torch.device("cpu"), steps), "gloo on the CPU", 1e-3
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ref))
    same = sum(a == b for a, b in zip(ours, ref))
    say(f"DDP {steps} steps: loss {ours[0]:.6f} -> {ours[-1]:.6f}; reference {where}: worst relative "
        f"difference {worst:.3g} (tolerance {rtol:g}), {same}/{steps} steps bit-identical")
    expect(worst <= rtol, f"DDP losses differ from {where} by {worst:.3g} > {rtol:g}")
    head, tail = sum(ours[:10]) / 10, sum(ours[-10:]) / 10
    expect(tail < head, f"DDP loss did not decrease (first 10 steps {head:.4f}, last 10 {tail:.4f})")


def capture_all_reduce(c, group, n, replays, name):
    """Capture one all_reduce on `group` in a CUDA graph and replay it with fresh inputs,
    each replay checked against the sum over the group's ranks.
    Returns 'works', or 'refused: ...' when the capture itself failed."""
    x = torch.zeros(n, device=c.dev)
    stream = torch.cuda.Stream(device=c.dev)
    # Warm up outside capture (the process group makes its communicator here).
    torch.cuda.synchronize(c.dev)
    with torch.cuda.stream(stream):
        dist.all_reduce(x, group=group)
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=stream):
            dist.all_reduce(x, group=group)
    except Exception as e:  # a refusal surfaces as a RuntimeError subclass from torch
        torch.cuda.synchronize(c.dev)
        return "refused: " + str(e).splitlines()[0][:200]
    members = dist.get_process_group_ranks(group)
    for k in range(replays):
        fresh = data(c.rank, n, torch.float32, 80 + k)
        x.copy_(fresh.to(c.dev))
        torch.cuda.synchronize(c.dev)
        g.replay()
        torch.cuda.synchronize(c.dev)
        want = sum(data(r, n, torch.float32, 80 + k) for r in members)
        compare(f"CUDA graph {name}: replay {k}", x, want)
    return "works"


def check_graph_world(c, replays=5):
    """all_reduce, all_gather_into_tensor and reduce_scatter_tensor on the whole group,
    captured in one CUDA graph (torch.cuda.graph) and replayed with new inputs written into
    the captured tensors before each replay, with an eager all_reduce between replays; every
    replay's results compared with gloo on the same inputs."""
    n, size = 6007, c.size
    ar = torch.zeros(n, device=c.dev)
    ag_in, ag_out = torch.zeros(n, device=c.dev), torch.zeros(n * size, device=c.dev)
    rs_in, rs_out = torch.zeros(n * size, device=c.dev), torch.zeros(n, device=c.dev)
    stream = torch.cuda.Stream(device=c.dev)
    torch.cuda.synchronize(c.dev)
    with torch.cuda.stream(stream):  # warm-up outside capture
        dist.all_reduce(ar)
        dist.all_gather_into_tensor(ag_out, ag_in)
        dist.reduce_scatter_tensor(rs_out, rs_in)
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        dist.all_reduce(ar)
        dist.all_gather_into_tensor(ag_out, ag_in)
        dist.reduce_scatter_tensor(rs_out, rs_in)
    for k in range(replays):
        x, y, z = data(c.rank, n, torch.float32, 90 + k), data(c.rank, n, torch.float32, 95 + k), \
            data(c.rank, n * size, torch.float32, 100 + k)
        ar.copy_(x.to(c.dev))
        ag_in.copy_(y.to(c.dev))
        rs_in.copy_(z.to(c.dev))
        g.replay()
        if k % 2 == 1:  # an eager call between replays, on the current stream
            e = data(c.rank, 1001, torch.float32, 7).to(c.dev)
            dist.all_reduce(e)
        torch.cuda.synchronize(c.dev)
        ref = x.clone()
        dist.all_reduce(ref, group=c.gloo)
        compare(f"CUDA graph all_reduce: replay {k}", ar, ref)
        parts = [torch.empty_like(y) for _ in range(size)]
        dist.all_gather(parts, y, group=c.gloo)
        compare(f"CUDA graph all_gather_into_tensor: replay {k}", ag_out, torch.cat(parts))
        ref = z.clone()
        dist.all_reduce(ref, group=c.gloo)
        compare(f"CUDA graph reduce_scatter_tensor: replay {k}", rs_out, ref[c.rank * n:(c.rank + 1) * n])
        if k % 2 == 1:
            ref = data(c.rank, 1001, torch.float32, 7)
            dist.all_reduce(ref, group=c.gloo)
            compare(f"eager all_reduce between replays {k}", e, ref)
    del g
    torch.cuda.synchronize(c.dev)


def check_graphs(c):
    singles = [dist.new_group([r]) for r in range(c.size)]
    verdict = capture_all_reduce(c, singles[c.rank], 8192, 3, f"one-rank group [{c.rank}]")
    say(f"CUDA graph, one-rank group: {verdict}")
    expect(verdict == "works", f"CUDA graph capture on a one-rank group: {verdict}")
    if c.size > 1:
        verdict = capture_all_reduce(c, c.world, 8192, 3, f"{c.size}-rank group")
        say(f"CUDA graph, {c.size}-rank group: {verdict}")
        expect(verdict == "works", f"CUDA graph capture on the {c.size}-rank group: {verdict}")
        check_graph_world(c)
        say("CUDA graph, all_reduce + all_gather + reduce_scatter replayed against gloo: done")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--expect-lib", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=480, help="seconds before the watchdog stops a hung rank")
    ap.add_argument("--skip-graphs", action="store_true")
    ap.add_argument("--skip", default="", help="checks to leave out, comma-separated names "
                    "(all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, p2p, barrier, new_group, ddp, graphs)")
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.timeout, exit=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    ngpu = torch.cuda.device_count()
    if ngpu == 0:
        print("torch_check: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", local % ngpu)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    c = Ctx(dev, dist.group.WORLD, gloo)
    say(f"{c.size} ranks, GPU {dev} of {ngpu}, torch {torch.__version__}")
    checks = [check_all_reduce, check_all_gather, check_reduce_scatter, check_all_to_all, check_broadcast,
              check_p2p, check_barrier, check_new_group, lambda c: check_ddp(c, a.steps), check_graphs]
    names = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p", "barrier", "new_group",
             "ddp", "graphs"]
    skip = {x for x in a.skip.split(",") if x} | ({"graphs"} if a.skip_graphs else set())
    unknown = skip - set(names)
    if unknown:
        print(f"torch_check: unknown checks in --skip: {sorted(unknown)}", file=sys.stderr)
        return 2
    seen = mapped_nccl_libraries()
    say(f"libnccl mapped after init_process_group: {seen or 'none'}")
    for name, f in zip(names, checks):
        if name in skip:
            say(f"{name}: skipped (--skip)")
            continue
        try:
            f(c)
        except Exception:
            expect(False, f"{name} raised:\n{traceback.format_exc()}")
        now = mapped_nccl_libraries()
        if now != seen:
            # Which section made another libnccl appear (the library check at the end only
            # says that one did).
            say(f"libnccl mapped after {name}: {sorted(set(now) - set(seen))} appeared")
            seen = now
    check_library(a.expect_lib)
    bad = torch.tensor([len(failures)])
    dist.all_reduce(bad, group=gloo)
    total = int(bad.item())
    dist.destroy_process_group()
    if c.rank == 0:
        print(f"torch_check: {'OK' if total == 0 else 'FAILED'} ({total} failures over {c.size} ranks)", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""NCCL's C API through ctypes, loaded the way vLLM's pynccl binding loads it: ctypes.CDLL on
a path, every function given its argtypes and restype, the 128-byte ncclUniqueId passed by
value, torch tensors' data pointers as buffers and torch streams' handles as cudaStream_t.

Runs NRANKS processes (multiprocessing, spawn): rank 0 calls ncclGetUniqueId and hands the
id's bytes to the others through queues; every rank calls ncclCommInitRank, then AllReduce,
AllGather, ReduceScatter, Broadcast (every root), a Send/Recv ring inside
ncclGroupStart/ncclGroupEnd, and ncclCommDestroy. Each result is compared exactly with a
reference computed here with torch on the CPU (integer-valued data, so every reduction is
exact in any order). Ranks share the GPUs round robin (several ranks on one GPU when there
are fewer GPUs than ranks).

    python3 tests/nccl/ctypes_check.py [--lib PATH] [--nranks N] [--timeout S]

--lib defaults to $VLLM_NCCL_SO_PATH, else libnccl.so.2 (the dynamic loader's search).
Exit status 0 when every check passed on every rank."""
import argparse
import ctypes
import multiprocessing as mp
import os
import sys
import time
import traceback

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


# ncclDataType_t and ncclRedOp_t values (nccl.h).
INT8, INT32, INT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = 0, 2, 4, 6, 7, 8, 9
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4

# (name, restype, argtypes) of every function used, as nccl.h declares them.
PROTOTYPES = [
    ("ncclGetErrorString", ctypes.c_char_p, [ncclResult_t]),
    ("ncclGetLastError", ctypes.c_char_p, [ncclComm_t]),
    ("ncclGetVersion", ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    ("ncclGetUniqueId", ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    ("ncclCommInitRank", ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    ("ncclCommCount", ncclResult_t, [ncclComm_t, ctypes.POINTER(ctypes.c_int)]),
    ("ncclCommUserRank", ncclResult_t, [ncclComm_t, ctypes.POINTER(ctypes.c_int)]),
    ("ncclAllReduce", ncclResult_t,
     [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t]),
    ("ncclAllGather", ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t]),
    ("ncclReduceScatter", ncclResult_t,
     [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t]),
    ("ncclBroadcast", ncclResult_t,
     [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    ("ncclSend", ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    ("ncclRecv", ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    ("ncclGroupStart", ncclResult_t, []),
    ("ncclGroupEnd", ncclResult_t, []),
    ("ncclCommDestroy", ncclResult_t, [ncclComm_t]),
]


class Library:
    """The library at `path` with every prototype applied (a missing symbol is an error)."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.f = {}
        for name, restype, argtypes in PROTOTYPES:
            fn = getattr(self.lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            self.f[name] = fn

    def check(self, name, *args):
        rc = self.f[name](*args)
        if rc != 0:
            msg = self.f["ncclGetErrorString"](rc).decode(errors="replace")
            last = self.f["ncclGetLastError"](None)
            last = last.decode(errors="replace") if last else ""
            raise RuntimeError(f"{name} returned {rc} ({msg}): {last}")


def ptr(t):
    return buffer_type(t.data_ptr())


def rank_main(rank, nranks, lib_path, queues, results):
    import torch

    failures = []

    def expect(ok, what):
        if not ok:
            failures.append(what)
            print(f"ctypes_check: rank {rank}: FAILED: {what}", file=sys.stderr, flush=True)

    try:
        ngpu = torch.cuda.device_count()
        if ngpu == 0:
            raise RuntimeError("no CUDA device visible to torch")
        dev = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(dev)
        # The library takes the GPU of the CUDA context current on the calling thread (as
        # NCCL does): make torch create it now.
        torch.zeros(1, device=dev)
        nccl = Library(lib_path)
        v = ctypes.c_int()
        nccl.check("ncclGetVersion", ctypes.byref(v))
        expect(v.value >= 22800, f"ncclGetVersion {v.value} >= 22800 (2.28)")
        expect(nccl.f["ncclGetErrorString"](0).decode() != "", "ncclGetErrorString(ncclSuccess) is a message")

        if rank == 0:
            uid = ncclUniqueId()
            nccl.check("ncclGetUniqueId", ctypes.byref(uid))
            raw = bytes(bytearray(uid.internal))
            for q in queues[1:]:
                q.put(raw)
        else:
            raw = queues[rank].get(timeout=120)
            uid = ncclUniqueId()
            ctypes.memmove(ctypes.byref(uid), raw, 128)
        comm = ncclComm_t()
        nccl.check("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        n, me = ctypes.c_int(), ctypes.c_int()
        nccl.check("ncclCommCount", comm, ctypes.byref(n))
        nccl.check("ncclCommUserRank", comm, ctypes.byref(me))
        expect((n.value, me.value) == (nranks, rank), f"count/rank {(n.value, me.value)}")

        stream = torch.cuda.Stream(device=dev)
        s = cudaStream_t(stream.cuda_stream)

        def data(r, count, dtype, salt):
            # Integer values small enough that sums, products, means of nranks ranks are exact.
            x = (torch.arange(count, dtype=torch.int64) * 7 + r * 13 + salt) % 5 - 2
            return x.to(dtype)

        count = 65537
        for dtype, code in [(torch.float32, FLOAT32), (torch.int32, INT32), (torch.bfloat16, BFLOAT16), (torch.float16, FLOAT16)]:
            for op, name in [(SUM, "sum"), (PROD, "prod"), (MAX, "max"), (MIN, "min"), (AVG, "avg")]:
                if op == AVG and not dtype.is_floating_point:
                    continue
                inputs = [data(r, count, dtype, op) for r in range(nranks)]
                stack = torch.stack([x.to(torch.float64) for x in inputs])
                want = {SUM: stack.sum(0), PROD: stack.prod(0), MAX: stack.max(0).values, MIN: stack.min(0).values,
                        AVG: stack.sum(0) / nranks}[op]
                send = inputs[rank].to(dev)
                recv = torch.empty_like(send)
                torch.cuda.synchronize(dev)
                with torch.cuda.stream(stream):
                    nccl.check("ncclAllReduce", ptr(send), ptr(recv), count, code, op, comm, s)
                stream.synchronize()
                got = recv.cpu().to(torch.float64)
                if op == AVG:
                    # hoccl (and NCCL) compute the sum in the type, then divide: allow one
                    # rounding of the quotient in the type.
                    ok = torch.allclose(got, want.to(dtype).to(torch.float64), rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=0)
                else:
                    ok = torch.equal(got, want)
                expect(ok, f"AllReduce {name} {dtype}: {int((got != want).sum())} wrong elements")

        # AllGather, out of place and in place.
        inputs = [data(r, count, torch.float32, 100) for r in range(nranks)]
        want = torch.cat(inputs)
        send = inputs[rank].to(dev)
        recv = torch.full((count * nranks,), -99.0, device=dev)
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(stream):
            nccl.check("ncclAllGather", ptr(send), ptr(recv), count, FLOAT32, comm, s)
        stream.synchronize()
        expect(torch.equal(recv.cpu(), want), "AllGather out of place")
        inplace = torch.full((count * nranks,), -99.0, device=dev)
        inplace[rank * count:(rank + 1) * count] = send
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(stream):
            nccl.check("ncclAllGather", ptr(inplace[rank * count:]), ptr(inplace), count, FLOAT32, comm, s)
        stream.synchronize()
        expect(torch.equal(inplace.cpu(), want), "AllGather in place")

        # ReduceScatter (sum) on int64.
        inputs = [data(r, count * nranks, torch.int64, 200) for r in range(nranks)]
        want = torch.stack(inputs).sum(0)[rank * count:(rank + 1) * count]
        send = inputs[rank].to(dev)
        recv = torch.zeros(count, dtype=torch.int64, device=dev)
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(stream):
            nccl.check("ncclReduceScatter", ptr(send), ptr(recv), count, INT64, SUM, comm, s)
        stream.synchronize()
        expect(torch.equal(recv.cpu(), want), "ReduceScatter sum int64")

        # Broadcast from every root, out of place and in place.
        for root in range(nranks):
            src = data(root, count, torch.float64, 300 + root)
            buf = (src if rank == root else torch.zeros(count, dtype=torch.float64)).to(dev)
            out = torch.zeros(count, dtype=torch.float64, device=dev)
            torch.cuda.synchronize(dev)
            with torch.cuda.stream(stream):
                nccl.check("ncclBroadcast", ptr(buf), ptr(out), count, FLOAT64, root, comm, s)
                nccl.check("ncclBroadcast", ptr(buf), ptr(buf), count, FLOAT64, root, comm, s)
            stream.synchronize()
            expect(torch.equal(out.cpu(), src), f"Broadcast root {root} out of place")
            expect(torch.equal(buf.cpu(), src), f"Broadcast root {root} in place")

        # A ring inside a group: send to the next rank, receive from the previous one.
        nxt, prv = (rank + 1) % nranks, (rank - 1) % nranks
        send = data(rank, count, torch.int8, 400).to(dev)
        recv = torch.zeros(count, dtype=torch.int8, device=dev)
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(stream):
            nccl.check("ncclGroupStart")
            nccl.check("ncclSend", ptr(send), count, INT8, nxt, comm, s)
            nccl.check("ncclRecv", ptr(recv), count, INT8, prv, comm, s)
            nccl.check("ncclGroupEnd")
        stream.synchronize()
        expect(torch.equal(recv.cpu(), data(prv, count, torch.int8, 400)), "Send/Recv ring in a group")

        # An error path: a data type out of range is refused with a message.
        rc = nccl.f["ncclAllReduce"](ptr(send), ptr(recv), 1, 42, SUM, comm, s)
        last = nccl.f["ncclGetLastError"](comm) or b""
        expect(rc != 0 and last != b"", f"data type 42: rc {rc}, last error {last!r}")

        nccl.check("ncclCommDestroy", comm)
    except Exception:
        failures.append(traceback.format_exc())
        print(f"ctypes_check: rank {rank}: {traceback.format_exc()}", file=sys.stderr, flush=True)
    results.put((rank, failures))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("VLLM_NCCL_SO_PATH") or "libnccl.so.2")
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(a.nranks)]
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, a.nranks, a.lib, queues, results)) for r in range(a.nranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + a.timeout
    got = {}
    while len(got) < a.nranks and time.monotonic() < deadline:
        try:
            r, f = results.get(timeout=1)
            got[r] = f
        except Exception:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    ok = len(got) == a.nranks and all(not f for f in got.values()) and all(p.exitcode == 0 for p in procs)
    missing = sorted(set(range(a.nranks)) - set(got))
    print(f"ctypes_check: {'OK' if ok else 'FAILED'}: {a.nranks} ranks, library {a.lib}"
          + (f", no result from ranks {missing} (hang or crash)" if missing else "")
          + "".join(f"\n  rank {r}: {len(f)} failures" for r, f in sorted(got.items()) if f))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

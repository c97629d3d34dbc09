#!/usr/bin/env bash
# Everything a GPU machine checks and measures, in one command, from the repository root:
#   bash scripts/gpu/all.sh [core] [codec] [reduce] [bench] [latency] [compressed] [sanitize]
#                           [internode] [nccl] [driverlock]   (default: core codec bench)
# With Rust installed (and HOCCL_BIN_DIR unset) it first builds the binaries here
# (scripts/gpu/build.sh into build/gpu-bin); otherwise it runs those in HOCCL_BIN_DIR, a
# folder that build.sh made on another machine. Then each part:
#   core   the tests that need a GPU: every test executable on the host and CUDA backends,
#          the C and C++ checks, the self-checking examples (scripts/gpu/core.sh)
#   codec  the codec's GPU tests and codec_bench (scripts/gpu/codec.sh)
#   reduce the CopyReduce and fused codec+reduce kernels' tests and benchmark
#          -> reduce_kernels.json (scripts/gpu/reduce.sh)
#   bench  the collective benchmarks against NCCL (scripts/gpu/bench.sh)
#   latency  per-op latency on one GPU: one rank beside NCCL, handshake probe, D2D copies,
#          2-4 processes under MPS -> latency.json (scripts/gpu/latency.sh)
#   compressed  the compressed engine against the copy-engine engine on real bf16 weights
#          (scripts/gpu/compressed.sh)
#   sanitize  the CUDA kernels' GPU tests under compute-sanitizer memcheck, racecheck and
#          synccheck (scripts/gpu/sanitize.sh)
#   internode  ranks on 2-4 virtual nodes of this host, the socket transport through
#          pinned staging, threads and processes under MPS, the staged path's tests, and
#          the direct-against-staged measurement (scripts/gpu/internode.sh)
#   nccl   hoccl's libnccl.so.2 in place of NCCL: the ctest/nccl C programs on CUDA, the
#          ctypes (vLLM-style) check, torch_check.py under torchrun with the library found
#          through LD_LIBRARY_PATH and LD_PRELOAD, torch's nccl symbols (scripts/gpu/nccl.sh)
#   driverlock  which CUDA driver calls block while another thread of the process waits for
#          the GPU inside the driver -> driver-lock.txt (scripts/gpu/driverlock.sh)
# Results go to docs/results/<machine>/ (e.g. h200-1gpu; HOCCL_MACHINE names it), each with
# a .cmd file saying which command made it; full logs to build/gpu-logs/. Prints one line
# per part and the end of its output; exits non-zero if any part failed.
#   LIMIT_<part>  seconds for that part (default: core 900, codec 300, reduce 300, bench 600,
#                 latency 600, nccl 1800)
set -u
cd "$(dirname "$0")/../.."
[ -x "${HOME:-/root}/.cargo/bin/cargo" ] && export PATH="${HOME:-/root}/.cargo/bin:$PATH"
export NCCL_NVLS_ENABLE=0   # see scripts/gpu/common.sh
if [ -z "${HOCCL_BIN_DIR:-}" ]; then
  if command -v cargo >/dev/null; then
    bash scripts/gpu/build.sh || exit 1
  fi
  export HOCCL_BIN_DIR="$PWD/build/gpu-bin"
fi
logs="${HOCCL_GPU_LOGS:-$PWD/build/gpu-logs}"
mkdir -p "$logs"
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(core codec bench)
status=0
for p in "${parts[@]}"; do
  case "$p" in core|codec|reduce|bench|latency|compressed|sanitize|internode|nccl|driverlock) ;; *) echo "all.sh: unknown part '$p' (core, codec, reduce, bench, latency, compressed, sanitize, internode, nccl, driverlock)" >&2; exit 2 ;; esac
  t0=$SECONDS
  limit_var="LIMIT_$p"
  case "$p" in core) limit=900 ;; codec|reduce) limit=300 ;; nccl) limit=1800 ;; *) limit=600 ;; esac
  timeout "${!limit_var:-$limit}" bash "scripts/gpu/$p.sh" > "$logs/$p.console.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  echo "=== $p: exit $rc after $((SECONDS - t0)) s ($logs/$p.console.log)"
  tail -n "${TAIL:-25}" "$logs/$p.console.log"
done
exit $status

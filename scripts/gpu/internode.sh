#!/usr/bin/env bash
# Ranks on several virtual nodes of this host on CUDA (scripts/gpu/common.sh: binaries,
# folders): the ranks of one virtual node talk through the same-host transport, those of
# different nodes only through the socket transport, whose data passes through pinned host
# staging filled and drained by the copy queues.
#   1. tests/internode's CUDA bodies (--ignored): thread ranks on 2-4 virtual nodes x 1-4
#      ranks, every op under ce, compressed and auto
#   2. tests/internode_staged's CUDA bodies (--ignored): the planner's stages through the
#      forwarding peers' device staging, 2 and 4 virtual nodes x 2-8 thread ranks, even and
#      uneven, identity, paired and many-to-one forwarding, ce and compressed, and the
#      direct path
#   3. tests/reductions' across_nodes_forwarded* CUDA bodies (--ignored): the hierarchical
#      reductions with forwarding peers 0,0 / 0,0,2 / 1,1 on 2x2, 2x3, 3x2 thread ranks,
#      pieces and hops between nodes on the forwarding peers only, ce and compressed
#   4. with one GPU, under MPS (nvidia-cuda-mps-control -d, stopped when the script exits):
#      the internode binary's process cases, 2 virtual nodes x 1 and x 2 ranks, every op,
#      ce and compressed (cuda_processes_every_op), and a rank SIGKILLed while its
#      AllGather crosses the sockets: the survivors fail within the timeout
#      (cuda_peer_killed_mid_transfer)
#   5. the measurement, direct against staged, and the hierarchical AllReduce with every
#      rank or local rank 0 owning its pieces (scripts/net-bench.sh with the CUDA backend,
#      2-4 processes on this GPU with virtual nodes, NIC limited to NET_BENCH_GBPS, 1 by
#      default, NET_BENCH_SIZES 4M,16M, within NET_BENCH_LIMIT seconds, 900):
#      docs/results/<machine>/internode.json and internode.txt
# One line per command -> internode-summary.txt; full logs in build/gpu-logs/internode/.
set -u
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
t="$bin/tests/internode"
[ -x "$t" ] || { echo "internode.sh: $t not built" >&2; exit 2; }
log_dir="$logs/internode"
rm -rf "$log_dir" && mkdir -p "$log_dir"
summary="$results/internode-summary.txt"
: > "$summary"
record "$summary" "bash scripts/gpu/internode.sh"
export HOCCL_LOG="${HOCCL_LOG:-warn}"
status=0
check() {
  local name=$1 rc
  shift
  echo "\$ $*" > "$log_dir/$name.log"
  timeout --kill-after=15 "${TEST_LIMIT:-300}" "$@" >> "$log_dir/$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  echo "$([ $rc = 0 ] && echo "ok  " || echo "FAIL") $name$([ $rc = 0 ] || echo " (exit $rc)") $(grep -E '^test result' "$log_dir/$name.log" | tail -n1)" | tee -a "$summary"
  [ $rc = 0 ] || grep -E "^test .*FAILED|panicked at" "$log_dir/$name.log" | head -n 4 | tee -a "$summary"
}
check threads "$t" cuda:: --ignored --test-threads=1
staged="$bin/tests/internode_staged"
[ -x "$staged" ] || { echo "internode.sh: $staged not built" >&2; exit 2; }
check staged "$staged" cuda:: --ignored --test-threads=1
reductions="$bin/tests/reductions"
[ -x "$reductions" ] || { echo "internode.sh: $reductions not built" >&2; exit 2; }
check reductions-forwarded "$reductions" cuda::across_nodes_forwarded --ignored --test-threads=1
if [ "$ngpu" -le 1 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  mps_dir=$(mktemp -d "${TMPDIR:-/tmp}/hoccl-mps.XXXXXX")
  export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; rm -rf "$mps_dir"' EXIT
  trap 'exit 143' TERM INT HUP
  # Four client processes with 32 hardware queues each fail to start under MPS
  # (cuDevicePrimaryCtxRetain: out of memory); with 16 they run.
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-16}"
  nvidia-cuda-mps-control -d || { echo "internode.sh: MPS did not start" | tee -a "$summary"; exit 1; }
  echo "# processes under MPS" | tee -a "$summary"
fi
check processes "$t" cuda_processes_every_op --exact --ignored --nocapture --test-threads=1
check peer-killed "$t" cuda_peer_killed_mid_transfer --exact --ignored --nocapture --test-threads=1
# The measurement's thirteen runs take longer than one test binary: a limit of their own.
TEST_LIMIT="${NET_BENCH_LIMIT:-900}" check net-bench env NET_BENCH_BIN="$bin/net_bench" NET_BENCH_BACKEND=cuda \
  NET_BENCH_MACHINE="$machine" NET_BENCH_GBPS="${NET_BENCH_GBPS:-1}" NET_BENCH_SIZES="${NET_BENCH_SIZES:-4M,16M}" bash scripts/net-bench.sh
exit $status

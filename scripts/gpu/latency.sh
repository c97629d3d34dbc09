#!/usr/bin/env bash
# The per-operation latency on one GPU, in one command (scripts/gpu/common.sh: binaries,
# folders). examples/bench --latency under mpirun, on GPU 0 whatever the machine has:
#   1. one rank: every op 4K..1G end to end, beside NCCL's one-rank communicator on the
#      same buffers and stream; the stream handshake probe (cuStreamWriteValue64 start flag
#      -> host thread -> finish flag -> cuStreamWaitValue64); device-to-device copies
#      (memcpy_async) of the same sizes; the launch cost                -> latency.json
#   2. under MPS (nvidia-cuda-mps-control -d, stopped when the script exits, whatever
#      happened): 2, 3 and 4 processes on the GPU, sendrecv 4K..1G, the handshake probe and
#      the copies of every process at once, appended to the same file (mps: true); the
#      2-process rows again on the gated path (HOCCL_GATED=1, off by default) and on the
#      staged path (HOCCL_STAGED_BYTES=1M, off by default in the native API)
#   3. under MPS, 2 processes, sendrecv 4K and 2M with HOCCL_TRACE_OPS: the proxies'
#      per-step timelines of four ops in the middle of the timed loop   -> latency_timeline.log
#   and every run's output                                              -> latency.log
# The last run prints the targets over every record of latency.json (PASS/FAIL lines,
# informational). The records' fields: examples/bench/latency.rs. ~3 minutes.
#   LATENCY_MPS_NP   process counts under MPS (default "2 3 4"; "" leaves MPS out)
#   HOCCL_NCCL_LIB   libnccl.so.2 (default: the bench searches python3's pip packages,
#                    then /usr/local/cuda/lib64, /usr/lib/x86_64-linux-gnu, /usr/local/lib)
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
need bench
BIN="$bin/bench"
export HOCCL_LOG="${HOCCL_LOG:-warn}"
# Every process on one GPU: the one-rank figures and the MPS runs share it.
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
json="$results/latency.json"
log="$results/latency.log"
rm -f "$json"
: > "$log"
status=0
cmds=()

# run LIMIT [VAR=VALUE...] -- ARGS...: one mpirun of the bench with a time limit, logged.
run() {
  local limit=$1 t0=$SECONDS rc
  shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local cmd=(env "${envs[@]}" "${HOCCL_MPIRUN[@]}" --bind-to none "$@")
  cmds+=("${cmd[*]}")
  echo "=== ${cmd[*]}" | tee -a "$log"
  timeout --signal=TERM --kill-after=15 "$limit" "${cmd[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "=== exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

echo "latency.sh: $(date -u +%FT%TZ), GPU $CUDA_VISIBLE_DEVICES of $ngpu, NCCL ${HOCCL_NCCL_LIB:-<searched by the bench>}" | tee -a "$log"
run 300 NCCL_NVLS_ENABLE=0 -- -np 1 "$BIN" --latency --json "$json"

mps_np=${LATENCY_MPS_NP-2 3 4}
if [ -n "$mps_np" ]; then
  if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "latency.sh: nvidia-cuda-mps-control not found: no MPS runs" | tee -a "$log"
    status=1
  else
    mps_dir=$(mktemp -d "${TMPDIR:-/tmp}/hoccl-mps.XXXXXX")
    export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    stop_mps() {
      echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
      rm -rf "$mps_dir"
    }
    trap stop_mps EXIT
    # A time limit's TERM (all.sh) still stops the daemon: exit, which runs the EXIT trap.
    trap 'exit 143' TERM INT HUP
    if nvidia-cuda-mps-control -d; then
      cmds+=("nvidia-cuda-mps-control -d")
      for np in $mps_np; do
        # Three or more processes: fewer hardware queues per context, so that the waiting
        # streams of all of them fit (README, "Hardware queues").
        conn=()
        [ "$np" -ge 3 ] && conn=(CUDA_DEVICE_MAX_CONNECTIONS=16)
        run 180 NCCL_NVLS_ENABLE=0 "${conn[@]}" -- -np "$np" "$BIN" --latency --mps --ops sendrecv --json "$json" --append
      done
      # The same 2-process rows on the gated path, beside the handshake's (records: path).
      run 180 NCCL_NVLS_ENABLE=0 HOCCL_GATED=1 -- -np 2 "$BIN" --latency --mps --ops sendrecv --json "$json" --append
      # And on the staged path (records: path): hundreds of back-to-back ops run into each
      # staged queue's budget.
      run 180 NCCL_NVLS_ENABLE=0 HOCCL_STAGED_BYTES=1M -- -np 2 "$BIN" --latency --mps --ops sendrecv --json "$json" --append
      tl="$results/latency_timeline.log"
      : > "$tl"
      for size in 4K 2M; do
        n0=$(wc -l < "$log")
        run 120 NCCL_NVLS_ENABLE=0 HOCCL_LOG=hoccl=info HOCCL_TRACE_OPS=300-303 -- -np 2 "$BIN" --ops sendrecv --min $size --max $size
        { echo "# ${cmds[-1]}"; tail -n +"$((n0 + 1))" "$log" | grep -E 'hoccl trace|^  sendrecv'; } >> "$tl"
      done
      record "$tl" "bash scripts/gpu/latency.sh (under MPS: ${cmds[-2]}; ${cmds[-1]})"
      cmds+=("echo quit | nvidia-cuda-mps-control")
      sed 's/^/# MPS log: /' "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null | tail -n 5 >> "$log"
    else
      echo "latency.sh: nvidia-cuda-mps-control -d failed: no MPS runs" | tee -a "$log"
      status=1
    fi
  fi
fi

joined=$(printf '%s; ' "${cmds[@]}")
[ -s "$json" ] && record "$json" "${joined%; }"
record "$log" "bash scripts/gpu/latency.sh (${joined%; })"
echo "latency.sh: done in $SECONDS s, status $status; results in $json"
exit $status

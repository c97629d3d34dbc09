#!/usr/bin/env bash
# The tests that need a GPU, on a GPU machine (scripts/gpu/common.sh: binaries, folders):
#   1. hoccl-info: what hoccl sees of the machine                 -> hoccl-info.txt
#   2. every test executable but the codec's (scripts/gpu/codec.sh) and the CLI tests (they
#      run the build tree's programs; CPU only): first as built (host backend, CPU tests;
#      not fused_drc, whose CPU tests are the kernels under the emulator, as CI runs them),
#      then with --ignored (the same bodies on CUDA), one test at a time; with several
#      GPUs, device_conformance's CUDA part again on the last GPU; the collectives' CUDA
#      bodies again under HOCCL_ENGINE=compressed
#   3. the C and C++ checks and the C++ example under mpirun with 2 and 4 ranks, and one
#      rank per GPU when there are more than 4 (ranks share a GPU when there are fewer)
#   4. streams_check: many streams waiting on collectives at once, one rank per process
#   5. the demo under mpirun, 4 ranks (one per GPU when there are 2 or more) -> demo.log
# One line per command                                             -> core-summary.txt
# Results go to docs/results/<machine>/ (each with a .cmd file: the command that made it),
# every command's full log to build/gpu-logs/core/. Exit status: 0 when everything passed.
#   CORE_SKIP   test executables to leave out ("name ...")
#   TEST_LIMIT  seconds per test executable and mode (default 150)
#   CORE_MODES  which of the two modes run ("host cuda", the default; "cuda" leaves out the
#               host-backend pass, which CI runs anyway)
set -u
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
log_dir="$logs/core"
rm -rf "$log_dir" && mkdir -p "$log_dir"
summary="$results/core-summary.txt"
: > "$summary"
record "$summary" "bash scripts/gpu/core.sh"
status=0
note() { echo "$*" | tee -a "$summary"; }
# check NAME LIMIT CMD...: run CMD under a time limit into $log_dir/NAME.log; one line.
check() {
  local name=$1 limit=$2 rc
  shift 2
  echo "\$ $*" > "$log_dir/$name.log"
  timeout --kill-after=15 "$limit" "$@" >> "$log_dir/$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  note "$([ $rc = 0 ] && echo "ok  " || echo "FAIL") $name$([ $rc = 0 ] || echo " (exit $rc)") $(grep -E '^test result' "$log_dir/$name.log" | tail -n1)"
  [ $rc = 0 ] || grep -E "^test .*FAILED|panicked at" "$log_dir/$name.log" | head -n 4 | tee -a "$summary"
}

note "# $ngpu GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"
if [ -x "$bin/hoccl-info" ]; then
  "$bin/hoccl-info" > "$results/hoccl-info.txt" 2>&1
  record "$results/hoccl-info.txt" "$bin/hoccl-info"
fi

export HOCCL_LOG="${HOCCL_LOG:-warn}"
for t in "$bin"/tests/*; do
  n=$(basename "$t")
  case "$n" in
    codec_*|plan_cli|zip_cli) continue ;;
  esac
  case " ${CORE_SKIP:-} " in *" $n "*) note "skip $n (CORE_SKIP)"; continue ;; esac
  # fused_drc's host tests are the drc kernels under the CPU emulator (minutes; CI runs them)
  case " ${CORE_MODES:-host cuda} " in *" host "*) [ "$n" = fused_drc ] || check "test-$n-host" "${TEST_LIMIT:-150}" "$t" --test-threads=1 ;; esac
  case " ${CORE_MODES:-host cuda} " in *" cuda "*) check "test-$n-cuda" "${TEST_LIMIT:-150}" "$t" --ignored --test-threads=1 ;; esac
done
# The collectives' bodies again with the compressed engine (their data is mostly random:
# this checks the machinery; tests/compressed.rs checks real tensors).
if [ -x "$bin/tests/collectives" ]; then
  HOCCL_ENGINE=compressed check "test-collectives-cuda-compressed" "${TEST_LIMIT:-150}" "$bin/tests/collectives" --ignored --test-threads=1
fi
if [ "$ngpu" -gt 1 ] && [ -x "$bin/tests/device_conformance" ]; then
  HOCCL_TEST_DEVICE=$((ngpu - 1)) check "test-device_conformance-gpu$((ngpu - 1))" "${TEST_LIMIT:-150}" \
    "$bin/tests/device_conformance" cuda_conformance --exact --ignored --test-threads=1
fi

nps=(2 4)
[ "$ngpu" -gt 4 ] && nps+=("$ngpu")
for t in "$bin"/cpp/*_check "$bin"/cpp/allgather_demo; do
  [ -x "$t" ] || continue
  for np in "${nps[@]}"; do
    HOCCL_TIMEOUT_MS=30000 check "cpp-$(basename "$t")-np$np" 120 "${HOCCL_MPIRUN[@]}" --bind-to none -np "$np" "$t"
  done
done
if [ -x "$bin/streams_check" ]; then
  for np in 2 4; do
    check "streams_check-np$np" 150 "${HOCCL_MPIRUN[@]}" --bind-to none -np "$np" "$bin/streams_check" --streams 1,4,16,32,64
  done
fi
if [ -x "$bin/demo" ]; then
  np=4; [ "$ngpu" -ge 2 ] && np=$ngpu
  check "demo-np$np" 200 "${HOCCL_MPIRUN[@]}" --bind-to none -np "$np" "$bin/demo"
  cp "$log_dir/demo-np$np.log" "$results/demo.log"
  record "$results/demo.log" "mpirun --oversubscribe --bind-to none -np $np $bin/demo"
else
  note "FAIL demo: $bin/demo missing"; status=1
fi
note "core: $([ $status = 0 ] && echo "all passed" || echo FAILED); logs in $log_dir"
exit $status

#!/usr/bin/env bash
# The CUDA kernels under compute-sanitizer (scripts/gpu/common.sh: binaries, folders):
# memcheck (out-of-bounds and misaligned accesses, leaks of device allocations), racecheck
# (shared-memory hazards) and synccheck (invalid barrier use) over the GPU tests that cover
# each kernel family with small and odd sizes, misaligned offsets and corrupt input:
#   CopyReduce          tests/reduce_kernels  every_dtype_op_and_count_bit_exact, argument_errors
#   fused decompress+reduce                   fused::fused_reduce_random_sizes_alignments_and_raw_blocks,
#                                             fused::fused_reduce_reports_corrupt_inputs
#   codec               tests/codec_cuda      cuda_sizes, cuda_block_sizes, cuda_rejects_corrupt_streams
#   fused decompress+reduce+compress          tests/fused_drc cuda_alignments_in_place_tiers_and_eight_streams,
#                                             cuda_corrupt_inputs_reported, cuda_stream_across_launches
# Each run has its own time limit (a sanitized kernel runs 10-100x slower); a run that
# reaches it is reported as such, not as clean. -> sanitize.log (one line per run + errors)
#   SANITIZE_LIMIT  seconds per run (default 45)
#   SANITIZE_RACE_LIMIT  seconds per racecheck run (default 240)
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
need tests/reduce_kernels tests/codec_cuda tests/fused_drc
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$san" ] || { echo "sanitize.sh: compute-sanitizer not found" >&2; exit 2; }
log="$results/sanitize.log"
log_dir="$logs/sanitize"
rm -rf "$log_dir" && mkdir -p "$log_dir"
limit=${SANITIZE_LIMIT:-45}
# racecheck of the fused kernels' random test needs about 135 s on one H200
race_limit=${SANITIZE_RACE_LIMIT:-240}
: > "$log"
record "$log" "bash scripts/gpu/sanitize.sh (compute-sanitizer --tool TOOL --error-exitcode 86 \$HOCCL_BIN_DIR/tests/BIN --ignored --exact TEST --test-threads=1, per run ${limit} s, racecheck ${race_limit} s)"
status=0
runs=(
  "memcheck reduce_kernels every_dtype_op_and_count_bit_exact"
  "memcheck reduce_kernels argument_errors"
  "memcheck reduce_kernels fused::fused_reduce_random_sizes_alignments_and_raw_blocks"
  "memcheck reduce_kernels fused::fused_reduce_reports_corrupt_inputs"
  "memcheck codec_cuda cuda_sizes"
  "memcheck codec_cuda cuda_rejects_corrupt_streams"
  "racecheck reduce_kernels fused::fused_reduce_random_sizes_alignments_and_raw_blocks"
  "racecheck codec_cuda cuda_sizes"
  "racecheck codec_cuda cuda_block_sizes"
  "synccheck reduce_kernels fused::fused_reduce_random_sizes_alignments_and_raw_blocks"
  "synccheck codec_cuda cuda_sizes"
  "memcheck fused_drc cuda_alignments_in_place_tiers_and_eight_streams"
  "memcheck fused_drc cuda_corrupt_inputs_reported"
  "racecheck fused_drc cuda_alignments_in_place_tiers_and_eight_streams"
  "racecheck fused_drc cuda_stream_across_launches"
  "synccheck fused_drc cuda_alignments_in_place_tiers_and_eight_streams"
)
echo "# tool      binary          test                                                   result (seconds)" | tee -a "$log"
for r in "${runs[@]}"; do
  read -r tool b t <<< "$r"
  out="$log_dir/$tool-$b-${t//:/_}.log"
  t0=$SECONDS
  l=$limit; [ "$tool" = racecheck ] && l=$race_limit
  timeout --kill-after=10 "$l" "$san" --tool "$tool" --error-exitcode 86 --print-limit 20 \
    "$bin/tests/$b" --ignored --exact "$t" --test-threads=1 > "$out" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out" | tail -n1)
  ran=$(grep -cE "^test .* ok$" "$out")
  case $rc in
    0) res="clean, ${summary:-no summary} ($ran test ok)" ;;
    86) res="ERRORS: $summary"; status=1 ;;
    124|137) res="TIME LIMIT (not checked to the end)" ;;
    *) res="FAILED (exit $rc)"; status=1 ;;
  esac
  printf '%-10s %-15s %-54s %s (%d s)\n' "$tool" "$b" "$t" "$res" $((SECONDS - t0)) | tee -a "$log"
  [ "$rc" = 86 ] && grep -m 20 -E "^=========" "$out" | tee -a "$log"
done
echo "sanitize.sh: status $status" | tee -a "$log"
exit $status

#!/usr/bin/env bash
# The reduction kernels on a GPU machine (scripts/gpu/common.sh: binaries, folders):
#   1. tests/reduce_kernels.rs: CopyReduce (every dtype x op x source count x count x
#      alignment) and the fused BFX1 decompress+reduce kernels, bit for bit against a host
#      reference of src/reduce.rs                                -> reduce-tests.log
#      tests/fused_drc.rs on CUDA: the decompress+reduce+compress kernels, dst bit for bit
#      and the output stream byte for byte the compressor's      -> fused-drc-tests.log
#   2. tests/compressed.rs `reductions` on CUDA: AllReduce, ReduceScatter and Reduce under
#      the compressed engine (their reduce step the fused kernel; AllReduce's also codes the
#      shard for the AllGather), bit for bit against reduce_into on bf16/f16/f32, 2-4
#      thread ranks                                               -> compressed-reductions.log
#   3. reduce_bench: CopyReduce of 4 bf16 inputs of 256 MiB vs the device-to-device copy at
#      the default CTA count and a sweep, the fused kernels vs the standalone codec and vs
#      the two passes they replace, the AllReduce step in one kernel (decompress + reduce +
#      compress) vs standalone compress    -> reduce_kernels.json / reduce_kernels.txt
#   4. codec_bench bf16 at 256 MiB (the standalone codec, re-measured) -> reduce-codec-check.txt
# Results go to docs/results/<machine>/ (each with a .cmd file). Exit status: nonzero if a
# test failed (the benchmark still runs).
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
log_dir="$logs/reduce"
rm -rf "$log_dir" && mkdir -p "$log_dir"
need tests/reduce_kernels tests/fused_drc tests/compressed reduce_bench codec_bench
fail=0

echo "== GPU tests (tests/reduce_kernels.rs)"
record "$results/reduce-tests.log" "$bin/tests/reduce_kernels --include-ignored --test-threads=1"
timeout 150 "$bin/tests/reduce_kernels" --include-ignored --test-threads=1 > "$log_dir/reduce_kernels.log" 2>&1 || fail=1
cp "$log_dir/reduce_kernels.log" "$results/reduce-tests.log"
grep -E "^test |test result|panicked|cases" "$log_dir/reduce_kernels.log" | head -n 40

echo "== GPU tests (tests/fused_drc.rs)"
record "$results/fused-drc-tests.log" "$bin/tests/fused_drc --ignored --test-threads=1"
timeout 150 "$bin/tests/fused_drc" --ignored --test-threads=1 > "$log_dir/fused_drc.log" 2>&1 || fail=1
cp "$log_dir/fused_drc.log" "$results/fused-drc-tests.log"
grep -E "^test |test result|panicked" "$log_dir/fused_drc.log" | head -n 20

echo "== compressed reductions (tests/compressed.rs cuda::reductions)"
record "$results/compressed-reductions.log" "$bin/tests/compressed --ignored cuda::reductions --test-threads=1"
timeout 120 "$bin/tests/compressed" --ignored cuda::reductions --test-threads=1 > "$log_dir/compressed_reductions.log" 2>&1 || fail=1
cp "$log_dir/compressed_reductions.log" "$results/compressed-reductions.log"
grep -E "^test |test result|panicked" "$log_dir/compressed_reductions.log" | head -n 20

echo "== benchmark"
out="$results/reduce_kernels"
record "$out.json" "$bin/reduce_bench --json-out $out.json"
cp "$out.json.cmd" "$out.txt.cmd"
timeout 90 "$bin/reduce_bench" --json-out "$out.json" > "$out.txt" 2>> "$log_dir/reduce_bench.log" || fail=1
cat "$out.txt"
tail -n 5 "$log_dir/reduce_bench.log"

echo "== standalone codec (bf16, 256 MiB)"
record "$results/reduce-codec-check.txt" "$bin/codec_bench --min-size 256M --max-size 256M"
timeout 40 "$bin/codec_bench" --min-size 256M --max-size 256M > "$results/reduce-codec-check.txt" 2>> "$log_dir/codec_bench.log"
cat "$results/reduce-codec-check.txt"
echo "tests: $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail

#!/usr/bin/env bash
# The codec on a GPU machine (scripts/gpu/common.sh: binaries, folders):
#   1. its GPU tests (tests/codec_cuda.rs: GPU bytes == CPU bytes) and the CPU reference
#      tests (tests/codec_cpu.rs)
#   2. hoccl-zip round trips of the fixtures in tests/data      -> codec-zip.log
#   3. codec_bench: bf16 with two tiers (table and JSON), bf16 with one tier, fp16, fp32,
#      and a MiniLM fixture tiled                                -> codec-bench-*.json/.txt
#   4. the summary (tests, table)                                -> codec-summary.txt
#      and the kernels' registers and spills from the build    -> codec-ptxas.log
# Results go to docs/results/<machine>/ (each with a .cmd file: the command that made it),
# full logs to build/gpu-logs/codec/. Takes ~90 s on one H200 (each sweep moves ~4 GiB per
# point). Exit status: nonzero if a test failed (the benchmark still runs).
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
log_dir="$logs/codec"
rm -rf "$log_dir" && mkdir -p "$log_dir"
need tests/codec_cuda tests/codec_cpu hoccl-zip codec_bench
fail=0
[ -f "$bin/ptxas.log" ] && cp "$bin/ptxas.log" "$results/codec-ptxas.log" && record "$results/codec-ptxas.log" "bash scripts/gpu/build.sh (ptxas.log of the kernels' build, copied)"

echo "== GPU tests (tests/codec_cuda.rs)"
timeout 45 "$bin/tests/codec_cuda" --ignored --test-threads=1 > "$log_dir/codec_cuda.log" 2>&1 || fail=1
tail -n 3 "$log_dir/codec_cuda.log"
echo "== CPU reference tests (tests/codec_cpu.rs)"
timeout 15 "$bin/tests/codec_cpu" > "$log_dir/codec_cpu.log" 2>&1 || fail=1
tail -n 3 "$log_dir/codec_cpu.log"

echo "== hoccl-zip on the fixtures"
zip_log="$results/codec-zip.log"
: > "$zip_log"
record "$zip_log" "for f in tests/data/minilm-*.{bf16,f16,f32}: hoccl-zip compress --dtype EXT f f.z; hoccl-zip decompress f.z f.d; cmp f f.d; hoccl-zip stats --summary f.z"
for f in tests/data/minilm-*.*16 tests/data/minilm-*.f32; do
  dt=${f##*.} tmp=$log_dir/zip.tmp
  if "$bin/hoccl-zip" compress --dtype "$dt" "$f" "$tmp.z" && "$bin/hoccl-zip" decompress "$tmp.z" "$tmp.d" && cmp -s "$f" "$tmp.d"; then
    echo "$(basename "$f"): $("$bin/hoccl-zip" stats --summary "$tmp.z" | grep -o 'ratio [0-9.]*')" >> "$zip_log"
  else
    echo "$(basename "$f"): FAILED" >> "$zip_log"
    fail=1
  fi
  rm -f "$tmp.z" "$tmp.d"
done
cat "$zip_log"

echo "== benchmark"
# bench FILE LIMIT ARGS...: codec_bench ARGS with its stdout into $results/FILE.
bench() {
  local out=$results/$1 limit=$2
  shift 2
  record "$out" "$bin/codec_bench $*"
  timeout "$limit" "$bin/codec_bench" "$@" > "$out" 2>> "$log_dir/codec_bench.log"
}
# One bf16 sweep gives both the table and the JSON.
bench codec-bench-bf16.txt 40 --json-out "$results/codec-bench-bf16.json"
record "$results/codec-bench-bf16.json" "$bin/codec_bench --json-out $results/codec-bench-bf16.json"
cat "$results/codec-bench-bf16.txt"
bench codec-bench-bf16-1tier.json 15 --json --tiers 1 --min-size 1M
bench codec-bench-f16.json 15 --json --dtype f16 --min-size 1M --max-size 256M
bench codec-bench-f32.json 15 --json --dtype f32 --min-size 1M --max-size 256M
bench codec-bench-fixture.json 10 --json --fixture tests/data/minilm-weight-l3-ffn-in.bf16 --min-size 1M --max-size 256M

summary="$results/codec-summary.txt"
{
  echo "tests: $([ $fail = 0 ] && echo passed || echo FAILED)"
  grep -h "test result" "$log_dir/codec_cuda.log" "$log_dir/codec_cpu.log"
  echo "bench (bf16, two tiers):"
  cat "$results/codec-bench-bf16.txt"
} > "$summary"
record "$summary" "bash scripts/gpu/codec.sh"
exit $fail

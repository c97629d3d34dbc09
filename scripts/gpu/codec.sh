#!/usr/bin/env bash
# The codec on a GPU machine, from binaries built on the build machine (the GPU machine has
# no Rust). Two steps:
#
#   bash scripts/gpu/codec.sh prepare      # build machine: release build, fill carry/
#   bash scripts/gpu/codec.sh run          # GPU machine, repository root: tests + bench
#
# carry/ then holds: codec_cuda (the test executable of tests/codec_cuda.rs, from
# `cargo test --release --no-run`), codec_cpu (the CPU reference tests, as a sanity check
# of the carried binaries), hoccl-zip, codec_bench (examples/codec_bench.rs) and
# ptxas.log (registers and spills of every kernel, from the build). `run` needs carry/ and
# tests/data/ (the fixtures; the test binaries find them through HOCCL_TEST_DATA) and
# writes to $OUT (default ./codec-out): nvidia-smi.txt, ptxas.log, codec_cuda.log,
# codec_cpu.log, zip.log, bench-bf16.txt/.json, bench-bf16-1tier.json, bench-f16.json,
# bench-f32.json, bench-fixture.json, summary.txt. Exit status: nonzero if any test
# failed (the benchmark still runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

prepare() {
    set -e
    mkdir -p carry
    local log
    log=$(cargo test --release --no-run --test codec_cuda --test codec_cpu 2>&1)
    echo "$log" | tail -3
    for t in codec_cuda codec_cpu; do
        local exe
        exe=$(echo "$log" | sed -n "s|.*Executable tests/$t.rs (\(.*\))|\1|p" | tail -1)
        [ -n "$exe" ] || { echo "codec.sh: no executable for $t in cargo's output" >&2; exit 1; }
        cp "$exe" "carry/$t"
    done
    cargo build --release --bin hoccl-zip --example codec_bench
    cp target/release/hoccl-zip target/release/examples/codec_bench carry/
    local ptx
    ptx=$(ls -t target/release/build/hoccl-*/out/ptxas.log 2>/dev/null | head -1)
    [ -n "$ptx" ] && cp "$ptx" carry/ptxas.log
    ls -l carry/
}

run() {
    local out=${OUT:-$root/codec-out}
    mkdir -p "$out"
    export HOCCL_TEST_DATA=$root/tests/data
    local fail=0
    for f in codec_cuda codec_cpu hoccl-zip codec_bench; do
        [ -x "carry/$f" ] || { echo "codec.sh: carry/$f missing: run 'codec.sh prepare' on the build machine" >&2; exit 2; }
    done
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
    [ -f carry/ptxas.log ] && cp carry/ptxas.log "$out/"

    # Time limits: the whole run stays within ~90 s on one H200 (tests ~15 s, each sweep
    # ~10 s: reps are capped so that every size moves ~4 GiB per measurement).
    echo "== GPU tests (tests/codec_cuda.rs)"
    timeout 45 carry/codec_cuda --ignored --test-threads=1 > "$out/codec_cuda.log" 2>&1 || fail=1
    tail -3 "$out/codec_cuda.log"
    echo "== CPU reference tests (sanity of the carried binaries)"
    timeout 15 carry/codec_cpu --nocapture > "$out/codec_cpu.log" 2>&1 || fail=1
    tail -3 "$out/codec_cpu.log"

    echo "== hoccl-zip on the fixtures"
    : > "$out/zip.log"
    for f in tests/data/minilm-*.*16 tests/data/minilm-*.f32; do
        local dt=${f##*.} tmp=$out/zip.tmp
        if carry/hoccl-zip compress --dtype "$dt" "$f" "$tmp.z" && carry/hoccl-zip decompress "$tmp.z" "$tmp.d" && cmp -s "$f" "$tmp.d"; then
            echo "$(basename "$f"): $(carry/hoccl-zip stats --summary "$tmp.z" | grep -o 'ratio [0-9.]*')" >> "$out/zip.log"
        else
            echo "$(basename "$f"): FAILED" >> "$out/zip.log"
            fail=1
        fi
        rm -f "$tmp.z" "$tmp.d"
    done
    cat "$out/zip.log"

    echo "== benchmark"
    # One bf16 sweep gives both the table and the JSON.
    timeout 40 carry/codec_bench --json-out "$out/bench-bf16.json" | tee "$out/bench-bf16.txt"
    timeout 15 carry/codec_bench --json --tiers 1 --min-size 1M > "$out/bench-bf16-1tier.json" || true
    timeout 15 carry/codec_bench --json --dtype f16 --min-size 1M --max-size 256M > "$out/bench-f16.json" || true
    timeout 15 carry/codec_bench --json --dtype f32 --min-size 1M --max-size 256M > "$out/bench-f32.json" || true
    timeout 10 carry/codec_bench --json --fixture tests/data/minilm-weight-l3-ffn-in.bf16 --min-size 1M --max-size 256M > "$out/bench-fixture.json" || true

    {
        echo "tests: $([ $fail = 0 ] && echo passed || echo FAILED)"
        grep -h "test result" "$out/codec_cuda.log" "$out/codec_cpu.log"
        echo "bench (bf16, two tiers):"
        cat "$out/bench-bf16.txt"
    } > "$out/summary.txt"
    cat "$out/summary.txt"
    return $fail
}

case "${1:-run}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac

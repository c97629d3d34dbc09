#!/usr/bin/env bash
# Device-backend checks on a GPU machine, from prebuilt binaries (the GPU machine has no
# Rust). Two steps:
#
#   build machine:  bash scripts/gpu/device.sh stage
#       builds `hoccl-info` and the `device_conformance` test executable in release mode
#       into carry/ (git-ignored) with the layout of scripts/gpu/pack.sh, which produces a
#       compatible carry/ too: carry/hoccl-info, carry/tests/device_conformance, and this
#       script as carry/device.sh
#   GPU machine:    bash scripts/gpu/device.sh [run]   or   bash carry/device.sh [run]
#       runs hoccl-info (text and --json) and the conformance tests with
#       `--ignored --test-threads=1` on GPU 0 (and `cuda_conformance` on the last GPU when
#       there are several); logs go to $OUT (default ./out). Exit status 0 only if every
#       test passed.
#
# Binaries are found as <carry>/<name>, <carry>/tests/<name>, else the newest
# <carry>/**/<name>-<hash> (what `cargo test --no-run` names them).
# Environment: HOCCL_CARRY (the carry folder), OUT, HOCCL_TEST_TIMEOUT (seconds per
# command, default 300), HOCCL_LOG (default hoccl=info).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -n "${HOCCL_CARRY:-}" ]; then
    carry="$(cd "$HOCCL_CARRY" && pwd)"
elif [ -e "$here/hoccl-info" ] || [ -d "$here/tests" ]; then
    carry="$here" # this script was packed into carry/
else
    carry="$(cd "$here/../.." && pwd)/carry"
fi
limit="${HOCCL_TEST_TIMEOUT:-300}"

stage() {
    set -e
    cd "$here/../.."
    mkdir -p "$carry/tests"
    cargo build --release --bin hoccl-info
    cp -f target/release/hoccl-info "$carry/hoccl-info"
    local exe
    exe=$(cargo test --release --no-run --test device_conformance --message-format=json \
        | grep -o '"executable":"[^"]*device_conformance-[^"]*"' | tail -n1 | cut -d'"' -f4)
    [ -n "$exe" ] || { echo "device.sh: could not find the device_conformance executable" >&2; exit 1; }
    cp -f "$exe" "$carry/tests/device_conformance"
    cp -f scripts/gpu/device.sh "$carry/device.sh"
    echo "staged into $carry/:"
    ls -l "$carry/hoccl-info" "$carry/tests/device_conformance" "$carry/device.sh"
}

# find_bin NAME: <carry>/NAME, <carry>/tests/NAME, else the newest <carry>/**/NAME-<hash>.
find_bin() {
    local f
    for f in "$carry/$1" "$carry/tests/$1"; do
        [ -f "$f" ] && { echo "$f"; return; }
    done
    find "$carry" -type f -name "$1-*" ! -name '*.d' -printf '%T@ %p\n' 2>/dev/null | sort -nr | head -n1 | cut -d' ' -f2-
}

run() {
    local out="${OUT:-$PWD/out}"
    mkdir -p "$out"
    export RUST_BACKTRACE=1 HOCCL_LOG="${HOCCL_LOG:-hoccl=info}"
    local summary="$out/summary.txt" status=0
    : >"$summary"
    note() { echo "$*" | tee -a "$summary"; }

    local info conf
    info=$(find_bin hoccl-info)
    conf=$(find_bin device_conformance)
    [ -n "$info" ] && chmod +x "$info"
    [ -n "$conf" ] && chmod +x "$conf"
    note "host: $(uname -n) $(uname -r); $(date -u +%FT%TZ)"

    { nvidia-smi -L; nvidia-smi topo -m; nvidia-smi; } >"$out/nvidia-smi.txt" 2>&1 \
        || note "nvidia-smi failed (see nvidia-smi.txt)"
    local ngpu
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    note "nvidia-smi sees ${ngpu:-0} GPU(s)"

    if [ -z "$info" ]; then
        note "FAIL hoccl-info: not found under $carry/ (run 'bash scripts/gpu/device.sh stage' or scripts/gpu/pack.sh first)"
        status=1
    else
        timeout "$limit" "$info" 2>&1 | tee "$out/hoccl-info.txt"
        local rc=${PIPESTATUS[0]}
        timeout "$limit" "$info" --json >"$out/hoccl-info.json" 2>>"$out/hoccl-info.txt"
        [ "$rc" = 0 ] && note "ok   hoccl-info" || { note "FAIL hoccl-info (exit $rc)"; status=1; }
        grep -q '^CUDA: no GPU' "$out/hoccl-info.txt" && note "WARN hoccl-info reports no GPU"
    fi

    if [ -z "$conf" ]; then
        note "FAIL device_conformance: not found under $carry/"
        status=1
    else
        local log="$out/device_conformance.log"
        echo "== $conf --ignored --test-threads=1 (GPU 0)" >"$log"
        HOCCL_TEST_DEVICE=0 timeout "$limit" "$conf" --ignored --test-threads=1 >>"$log" 2>&1
        local rc=$?
        [ "$rc" = 0 ] && note "ok   device_conformance --ignored (GPU 0)" \
            || { note "FAIL device_conformance --ignored (GPU 0, exit $rc)"; status=1; }
        if [ "${ngpu:-0}" -gt 1 ]; then
            local last=$((ngpu - 1))
            echo "== $conf cuda_conformance --ignored --exact (GPU $last)" >>"$log"
            HOCCL_TEST_DEVICE=$last timeout "$limit" "$conf" cuda_conformance --exact --ignored --test-threads=1 >>"$log" 2>&1
            rc=$?
            [ "$rc" = 0 ] && note "ok   cuda_conformance (GPU $last)" \
                || { note "FAIL cuda_conformance (GPU $last, exit $rc)"; status=1; }
        fi
        grep -E '^test |test result' "$log" | tee -a "$summary"
    fi
    note "result: $([ "$status" = 0 ] && echo PASS || echo FAIL)"
    return "$status"
}

case "${1:-run}" in
    stage) stage ;;
    run) run ;;
    -h | --help) sed -n '2,21p' "$0" ;;
    *) echo "usage: $0 [stage|run]" >&2; exit 2 ;;
esac

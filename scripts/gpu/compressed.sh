#!/usr/bin/env bash
# The compressed engine against the copy-engine engine on real bf16 weights
# (scripts/gpu/common.sh: binaries, folders). examples/bench --data tests/data/<weights>
# (tiled over every send buffer), sendrecv and AllGather 1M..256M, every point checked:
#   with several GPUs: one rank per GPU; with one GPU: 2 processes under MPS
#   (nvidia-cuda-mps-control -d, stopped when the script exits), where both engines are
#   bound by the one GPU's memory: the ratio is then a cost figure, not the link gain.
#   HOCCL_ENGINE=ce, then HOCCL_ENGINE=compressed unpipelined (HOCCL_CODEC_SEGMENTS=1:
#   coded before the op, decoded after), then pipelined by segment (the default, 8)
#                                                               -> compressed.log, compressed.json
# Then the GEMM interference of a background AllReduce (bench --interference --bg-op
# allreduce, 64 MiB on the real weights) under HOCCL_ENGINE=sm and =compressed, with NCCL
# beside it when there are several GPUs                       -> interference-allreduce-*.json
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
need bench
BIN="$bin/bench"
export HOCCL_LOG="${HOCCL_LOG:-warn}" NCCL_NVLS_ENABLE=0
data="$root/tests/data/minilm-weight-l3-ffn-in.bf16"
log="$results/compressed.log"
json="$results/compressed.json"
: > "$log"
status=0
cmds=()
if [ "$ngpu" -ge 2 ]; then
  np=$ngpu
else
  np=2
  mps_dir=$(mktemp -d "${TMPDIR:-/tmp}/hoccl-mps.XXXXXX")
  export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; rm -rf "$mps_dir"' EXIT
  trap 'exit 143' TERM INT HUP
  nvidia-cuda-mps-control -d || { echo "compressed.sh: MPS did not start" | tee -a "$log"; exit 1; }
  cmds+=("nvidia-cuda-mps-control -d")
fi
echo "compressed.sh: $(date -u +%FT%TZ), $ngpu GPU(s), $np ranks, data $(basename "$data")" | tee -a "$log"
parts=()
for variant in ce whole compressed; do
  out="$results/compressed-$variant.json"
  case $variant in
    ce) settings=(HOCCL_ENGINE=ce HOCCL_CODEC_SEGMENTS=8) ;;
    whole) settings=(HOCCL_ENGINE=compressed HOCCL_CODEC_SEGMENTS=1) ;;
    compressed) settings=(HOCCL_ENGINE=compressed HOCCL_CODEC_SEGMENTS=8) ;;
  esac
  cmd=(env "${settings[@]}" "${HOCCL_MPIRUN[@]}" --bind-to none -x HOCCL_ENGINE -x HOCCL_CODEC_SEGMENTS -np "$np" "$BIN" --ops sendrecv,allgather --min 1M --max 256M --data "$data" --json "$out")
  cmds+=("${cmd[*]}")
  echo "=== ${cmd[*]}" | tee -a "$log"
  timeout --kill-after=15 240 "${cmd[@]}" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  parts+=("$out")
done
python3 - "$json" "${parts[@]}" <<'PY' 2>&1 | tee -a "$log"
import json, os, sys
out, ce, cw, cz = sys.argv[1:5]
def pts(f):
    if not os.path.exists(f):
        return {}
    d = json.load(open(f))
    return {(p["op"], int(p["bytes"])): p for p in d.get("points", []) if p.get("impl") == "hoccl"}
a, w, b = pts(ce), pts(cw), pts(cz)
rows = []
print("# op          size      ce GB/s   unpipelined GB/s   pipelined GB/s   unpipelined/ce   pipelined/ce   pipelined/unpipelined")
for k in sorted(a, key=lambda k: (k[0], k[1])):
    if k in b and k in w:
        x, u, y = a[k]["algbw"], w[k]["algbw"], b[k]["algbw"]
        q = lambda p, r: p / r if r else 0.0
        rows.append({"op": k[0], "bytes": k[1], "ce_algbw_gbs": x, "unpipelined_algbw_gbs": u, "compressed_algbw_gbs": y,
                     "ratio": q(y, x), "unpipelined_ratio": q(u, x), "pipelining_gain": q(y, u), "wrong": [a[k]["wrong"], w[k]["wrong"], b[k]["wrong"]]})
        print(f"  {k[0]:<10} {k[1]:>10}  {x:9.1f}  {u:17.1f}  {y:15.1f}   {q(u, x):14.2f}   {q(y, x):12.2f}   {q(y, u):21.2f}")
json.dump({"what": "compressed engine, unpipelined (HOCCL_CODEC_SEGMENTS=1) and pipelined (8), vs copy-engine engine, real bf16 weights, algbw", "rows": rows}, open(out, "w"), indent=1)
PY
for engine in sm compressed; do
  out="$results/interference-allreduce-$engine.json"
  nccl=(); [ "$ngpu" -ge 2 ] && nccl=(--compare nccl)
  cmd=(env HOCCL_ENGINE=$engine "${HOCCL_MPIRUN[@]}" --bind-to none -x HOCCL_ENGINE -np "$np" "$BIN" --no-table --interference --bg-op allreduce --bg-size 64M --data "$data" --no-check "${nccl[@]}" --json "$out")
  record "$out" "${cmd[*]}"
  echo "=== ${cmd[*]}" | tee -a "$log"
  timeout --kill-after=15 150 "${cmd[@]}" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
joined=$(printf '%s; ' "${cmds[@]}")
[ -s "$json" ] && record "$json" "${joined%; }"
record "$log" "bash scripts/gpu/compressed.sh (${joined%; })"
exit $status

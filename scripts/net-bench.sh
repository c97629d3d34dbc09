#!/usr/bin/env bash
# The inter-node measurement on one host (examples/net_bench.rs): virtual nodes
# (HOCCL_VIRTUAL_NODES) whose ranks talk through the socket transport, each rank's NIC
# limited by the transport's token bucket (HOCCL_NET_GBPS, GB/s per rank and direction), so
# the NIC is the bottleneck as in a cluster. Host backend by default. The matrix:
#   1. AllGather, AlltoAll, AlltoAllv uniform and Zipf (S=1.2, seed 7), pattern data, on
#      2 virtual nodes x 2 ranks and 4 x 1 (4 ranks), 2 x 1 (2 ranks), each on the direct
#      path (HOCCL_FORWARDING=0) and the staged one (the planner's stages, the default),
#      and 2 x 2 staged with local ranks 0 and 1 forwarding through each other
#      (HOCCL_FORWARDING_PEERS=1,0);
#   2. AllGather and AlltoAll on real bf16 weights (tests/data), HOCCL_ENGINE=ce and
#      HOCCL_ENGINE=compressed, 2 x 2;
#   3. AlltoAll and AllGather without a limit, 2 x 1, 16M and 64M: what the transport moves
#      and the proxy's CPU per GB when nothing throttles it;
#   4. AllReduce hierarchical (Sum) and flat (Avg) on 2 x 2, every rank owning a piece of
#      the hierarchical plan (identity map) and the pieces on local rank 0 of each node
#      (HOCCL_FORWARDING_PEERS=0,0);
#   5. AlltoAll, AlltoAllv uniform and Zipf on 4 virtual nodes x 2 ranks (8 ranks), direct
#      and staged, at NET_BENCH_GBPS_4X2: eight ranks and their proxy threads on a 2-core
#      host move about 0.4 GB/s per direction in all, so 0.25 per rank would not bind.
#   relay (NET_BENCH_PARTS=relay alone): point-to-point sends between 2 virtual nodes x 2
#      ranks, each rank to its local peer on the other node, direct (HOCCL_FORWARDING=0) and
#      relayed through the node peer (HOCCL_FORWARDING_PEERS=1,0), at NET_BENCH_GBPS and
#      without a limit.
# Every run's records (measured median, the simulator's direct and planned predictions) go
# to docs/results/<machine>/internode.json (NET_BENCH_PARTS=4x2: internode-4x2.json), its
# table to internode.txt (internode-4x2.txt); each run starts with the exact command.
#   NET_BENCH_MACHINE  folder under docs/results (default: host-<cores>core)
#   NET_BENCH_GBPS     the NIC limit (default 0.25: the unlimited loopback transport moves
#                      about 1 GB/s per rank on a 2-core host, so 1 GB/s would not bind)
#   NET_BENCH_GBPS_4X2 the NIC limit of part 5 (default 0.05)
#   NET_BENCH_PARTS    all (default: parts 1-5 into internode.{txt,json}), 4x2 (part 5
#                      alone into internode-4x2.{txt,json}) or relay (internode-relay.*)
#   NET_BENCH_SIZES    bytes per rank (default 1M,4M,16M)
#   NET_BENCH_ITERS    timed iterations (default 5)
#   NET_BENCH_BACKEND  host (default) or cuda: on a GPU machine the ranks share its GPUs
#                      and the socket transport stages through pinned host memory
#   NET_BENCH_BIN      a net_bench built elsewhere (e.g. by scripts/gpu/build.sh); without
#                      it the script builds one (HOCCL_NO_CUDA=1 for the host backend)
# On the GPU machine: NET_BENCH_BACKEND=cuda NET_BENCH_MACHINE=h200-1gpu NET_BENCH_GBPS=1 \
#   NET_BENCH_SIZES=4M,16M,64M bash scripts/net-bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=mpi-env.sh
source scripts/mpi-env.sh
machine="${NET_BENCH_MACHINE:-host-$(nproc)core}"
gbps="${NET_BENCH_GBPS:-0.25}"
gbps8="${NET_BENCH_GBPS_4X2:-0.05}"
parts="${NET_BENCH_PARTS:-all}"
case "$parts" in all) name=internode ;; 4x2) name=internode-4x2 ;; relay) name=internode-relay ;; *) echo "net-bench: NET_BENCH_PARTS=$parts: want all, 4x2 or relay" >&2; exit 2 ;; esac
sizes="${NET_BENCH_SIZES:-1M,4M,16M}"
iters="${NET_BENCH_ITERS:-5}"
data=tests/data/minilm-weight-word-emb.bf16
out="docs/results/$machine"
mkdir -p "$out"
backend="${NET_BENCH_BACKEND:-host}"
case "$backend" in host | cuda) ;; *) echo "net-bench: NET_BENCH_BACKEND=$backend: want host or cuda" >&2; exit 2 ;; esac
export HOCCL_LOG="${HOCCL_LOG:-warn}"
if [ -n "${NET_BENCH_BIN:-}" ]; then
  bin="$NET_BENCH_BIN"
else
  [ "$backend" = host ] && export HOCCL_NO_CUDA="${HOCCL_NO_CUDA:-1}"
  cargo build --release --example net_bench || exit 1
  bin="${CARGO_TARGET_DIR:-target}/release/examples/net_bench"
fi
[ -x "$bin" ] || { echo "net-bench: no program at $bin" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
status=0
n=0
run() { # run NODES NP ENGINE ARGS... (the limit: $limit, else $gbps; the path: $fwd, else 1; $peers)
  local nodes=$1 np=$2 engine=$3
  shift 3
  n=$((n + 1))
  local cmd=(env HOCCL_VIRTUAL_NODES="$nodes" HOCCL_NET_GBPS="${limit:-$gbps}" HOCCL_ENGINE="$engine" HOCCL_BACKEND="$backend"
    HOCCL_FORWARDING="${fwd:-1}" HOCCL_FORWARDING_PEERS="${peers:-}"
    "${HOCCL_MPIRUN[@]}" -np "$np" "$bin" --iters "$iters" "$@" --json "$tmp/$n.json")
  echo "\$ ${cmd[*]/$tmp\/$n.json/PART.json}" | tee -a "$tmp/table.txt"
  if ! timeout 600 "${cmd[@]}" 2>&1 | tee -a "$tmp/table.txt"; then
    status=1
    echo "net-bench: run $n failed" | tee -a "$tmp/table.txt"
  fi
  echo | tee -a "$tmp/table.txt"
}
if [ "$parts" = all ]; then
  all=(--ops allgather,alltoall,alltoallv,zipf --sizes "$sizes")
  for f in 0 1; do
    fwd=$f run 2 4 ce "${all[@]}"
    fwd=$f run 4 4 ce "${all[@]}"
    fwd=$f run 2 2 ce "${all[@]}"
  done
  peers=1,0 run 2 4 ce "${all[@]}"
  run 2 4 ce --ops allgather,alltoall --sizes "$sizes" --data "$data"
  run 2 4 compressed --ops allgather,alltoall --sizes "$sizes" --data "$data"
  limit=0 run 2 2 ce --ops alltoall,allgather --sizes 16M,64M
  run 2 4 ce --ops allreduce,allreduce-flat --sizes "$sizes"
  peers=0,0 run 2 4 ce --ops allreduce,allreduce-flat --sizes "$sizes"
fi
if [ "$parts" = relay ]; then
  for l in "$gbps" 0; do
    limit=$l fwd=0 peers=1,0 run 2 4 ce --ops sendrecv --sizes "$sizes"
    limit=$l peers=1,0 run 2 4 ce --ops sendrecv --sizes "$sizes"
  done
else
  for f in 0 1; do
    limit=$gbps8 fwd=$f run 4 8 ce --ops alltoall,alltoallv,zipf --sizes "$sizes"
  done
fi
{
  echo "# scripts/net-bench.sh on $(hostname) ($(nproc) cores), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD)"
  echo "# NET_BENCH_BACKEND=$backend NET_BENCH_PARTS=$parts NET_BENCH_GBPS=$gbps NET_BENCH_GBPS_4X2=$gbps8 NET_BENCH_SIZES=$sizes NET_BENCH_ITERS=$iters"
  cat "$tmp/table.txt"
} > "$out/$name.txt"
top_gbps=$gbps
[ "$parts" = 4x2 ] && top_gbps=$gbps8
python3 - "$out/$name.json" "$tmp" "$n" "$top_gbps" "$backend" <<'EOF'
import json, sys, os, subprocess, socket, datetime
path, tmp, n, gbps, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
runs = []
for i in range(1, n + 1):
    p = os.path.join(tmp, f"{i}.json")
    if os.path.exists(p):
        runs.append(json.load(open(p)))
doc = {
    "script": "scripts/net-bench.sh",
    "host": socket.gethostname(),
    "cores": os.cpu_count(),
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "backend": backend,
    "gbps_limit": float(gbps),
    "rate_limiter": "token bucket in the socket transport (HOCCL_NET_GBPS), per rank and direction",
    "runs": runs,
}
json.dump(doc, open(path, "w"), indent=1)
EOF
echo "net-bench: wrote $out/$name.json and $out/$name.txt (exit $status)"
exit $status

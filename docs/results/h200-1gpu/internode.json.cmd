# 2026-12-02T16:01Z, binaries of commit 536c2c0, 1 GPU (h200-1gpu), ranks on virtual nodes of one host (processes, no MPS)
NET_BENCH_BIN=$HOCCL_BIN_DIR/net_bench NET_BENCH_BACKEND=cuda NET_BENCH_MACHINE=h200-1gpu NET_BENCH_GBPS=1 NET_BENCH_SIZES=16M NET_BENCH_ITERS=3 bash scripts/net-bench.sh

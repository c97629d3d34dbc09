# 2026-12-04T09:44Z, binaries of commit 2cf71ad, 1 GPU (h200-1gpu), 2 virtual nodes x 2 ranks as processes under MPS (nvidia-cuda-mps-control -d, CUDA_DEVICE_MAX_CONNECTIONS=8)
NET_BENCH_BIN=$HOCCL_BIN_DIR/net_bench NET_BENCH_BACKEND=cuda NET_BENCH_MACHINE=h200-1gpu NET_BENCH_GBPS=1 NET_BENCH_PARTS=relay NET_BENCH_SIZES=4M,16M,64M NET_BENCH_ITERS=5 bash scripts/net-bench.sh

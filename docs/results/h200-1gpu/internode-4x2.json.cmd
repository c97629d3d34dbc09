# 2026-12-04T06:06Z, binaries of commit 3e59c20, 1 GPU (h200-1gpu), 4 virtual nodes x 2 processes under MPS (nvidia-cuda-mps-control -d, CUDA_DEVICE_MAX_CONNECTIONS=8)
NET_BENCH_PARTS=4x2 NET_BENCH_BIN=$HOCCL_BIN_DIR/net_bench NET_BENCH_BACKEND=cuda NET_BENCH_MACHINE=h200-1gpu NET_BENCH_GBPS=1 NET_BENCH_GBPS_4X2=0.25 NET_BENCH_SIZES=16M,64M NET_BENCH_ITERS=3 bash scripts/net-bench.sh

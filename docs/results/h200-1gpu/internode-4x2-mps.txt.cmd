# 2026-12-04T02:44Z, binaries of commit a74f996, 1 GPU(s) (h200-1gpu), under MPS (nvidia-cuda-mps-control -d)
env CUDA_DEVICE_MAX_CONNECTIONS=8 HOCCL_VIRTUAL_NODES=4 HOCCL_NET_GBPS=0.25 HOCCL_ENGINE=ce HOCCL_FORWARDING=0 mpirun --oversubscribe --bind-to none -np 8 $HOCCL_BIN_DIR/net_bench --iters 3 --ops zipf,alltoall --sizes 16M,64M
env CUDA_DEVICE_MAX_CONNECTIONS=8 HOCCL_VIRTUAL_NODES=4 HOCCL_NET_GBPS=0.25 HOCCL_ENGINE=ce HOCCL_FORWARDING=1 mpirun --oversubscribe --bind-to none -np 8 $HOCCL_BIN_DIR/net_bench --iters 3 --ops zipf,alltoall --sizes 16M,64M

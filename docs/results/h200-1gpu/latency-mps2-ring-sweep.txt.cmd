# 2026-12-02T20:05Z, binaries of commit 2c8b401, 1 GPU (h200-1gpu), under MPS (nvidia-cuda-mps-control -d), CUDA_DEVICE_MAX_CONNECTIONS=16
for ring in 8x256K 4x512K 4x1M; do HOCCL_STAGED_BYTES=4M HOCCL_STAGED_RING=$ring mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --max 4M; done
mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --max 4M

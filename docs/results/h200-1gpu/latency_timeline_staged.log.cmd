# 2026-12-02T19:43Z, binaries of commit 2c8b401, 1 GPU (h200-1gpu), 2 processes under MPS (nvidia-cuda-mps-control -d), CUDA_DEVICE_MAX_CONNECTIONS=16
HOCCL_STAGED_BYTES=1M HOCCL_LOG=hoccl=info HOCCL_TRACE_OPS=300-303 mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --ops sendrecv --min 4K --max 4K

# 2026-12-02T13:05Z, binaries of commit 0146afe, 1 GPU(s) (h200-1gpu), 2 processes under MPS
LD_PRELOAD=$HOCCL_BIN_DIR/nccl/libnccl.so.2 HOCCL_STAGED_BYTES=1M HOCCL_TIMEOUT_MS=15000 torchrun --nproc-per-node 2 tests/nccl/torch_check.py --expect-lib $HOCCL_BIN_DIR/nccl/libnccl.so.2 --timeout 140

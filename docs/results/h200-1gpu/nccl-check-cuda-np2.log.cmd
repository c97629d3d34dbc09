# 2026-12-02T13:42Z, binaries of commit fdb601e, 1 GPU(s) (h200-1gpu)
HOCCL_BACKEND=cuda nccl_check 2   (ctest/nccl/nccl_check.c, linked against $HOCCL_BIN_DIR/nccl/libnccl.so.2; revoke section included)

# 2026-12-02T06:52:53Z, binaries of commit 93210a5, 1 GPU(s) (h200-1gpu)
env LD_PRELOAD=$HOCCL_BIN_DIR/nccl/libnccl.so.2 NCCL_DEBUG=VERSION /opt/torch/.venv/bin/torchrun --nproc-per-node 2 tests/nccl/torch_check.py --expect-lib $HOCCL_BIN_DIR/nccl/libnccl.so.2 --timeout 270

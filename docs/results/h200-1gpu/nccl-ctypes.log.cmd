# 2026-12-02T04:04:29Z, binaries of commit 6fac19e, 1 GPU(s) (h200-1gpu)
/opt/torch/.venv/bin/python tests/nccl/ctypes_check.py --lib $HOCCL_BIN_DIR/nccl/libnccl.so.2 --nranks 2 --timeout 240 (under MPS)

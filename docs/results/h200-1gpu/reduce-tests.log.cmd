# 2026-12-02T03:34:03Z, binaries of commit 73df9ff+changes, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/tests/reduce_kernels --include-ignored --test-threads=1

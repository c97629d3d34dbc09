# 2026-12-02T02:56:52Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/tests/reduce_kernels --include-ignored --test-threads=1

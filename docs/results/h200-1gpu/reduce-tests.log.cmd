# 2026-12-02T00:22:15Z, binaries of commit 4cb0f45, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/tests/reduce_kernels --include-ignored --test-threads=1

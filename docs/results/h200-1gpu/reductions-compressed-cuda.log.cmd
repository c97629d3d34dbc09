# 2026-12-02T13:42Z, binaries of commit fdb601e, 1 GPU(s) (h200-1gpu)
HOCCL_TEST_DATA=$PWD/tests/data $HOCCL_BIN_DIR/tests/compressed --ignored cuda::reductions; $HOCCL_BIN_DIR/tests/reduce_kernels --ignored fused::

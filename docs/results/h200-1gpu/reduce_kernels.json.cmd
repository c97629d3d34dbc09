# 2026-12-02T13:42Z, binaries of commit fdb601e, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/reduce_bench --json-out reduce_kernels.json

# 2026-12-02T03:34:38Z, binaries of commit 73df9ff+changes, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/reduce_bench --json-out /root/out/results/reduce_kernels.json

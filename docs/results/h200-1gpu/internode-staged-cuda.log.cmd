# 2026-12-02T13:55Z, binaries of commit e604575, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/tests/internode_staged cuda:: --ignored --test-threads=1

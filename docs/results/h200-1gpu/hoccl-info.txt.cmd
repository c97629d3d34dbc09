# 2026-12-01T22:55:44Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/hoccl-info

# 2026-12-02T06:55:49Z, binaries of commit 93210a5, 1 GPU(s) (h200-1gpu)
$HOCCL_BIN_DIR/hoccl-info

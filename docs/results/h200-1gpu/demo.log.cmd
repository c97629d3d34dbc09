# 2026-12-02T01:11:33Z, binaries of commit cdc0e54, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/demo

# 2026-12-01T22:59:34Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/demo

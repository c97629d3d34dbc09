# 2026-12-01T22:14:59Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/demo

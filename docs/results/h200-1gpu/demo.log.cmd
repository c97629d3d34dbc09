# 2026-12-02T09:14:14Z, binaries of commit fcea19c, 1 GPU(s) (h200-1gpu)
mpirun --oversubscribe --bind-to none -np 4 $HOCCL_BIN_DIR/demo

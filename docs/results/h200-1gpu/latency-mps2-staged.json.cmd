# 2026-12-02T13:42Z, binaries of commit fdb601e, 1 GPU(s) (h200-1gpu), 2 processes under MPS
HOCCL_STAGED_BYTES=1M mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --max 4M --json latency-mps2-staged.json

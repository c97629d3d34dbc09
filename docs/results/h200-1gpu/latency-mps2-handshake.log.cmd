# 2026-12-02T15:58Z, binaries of commit 536c2c0, 1 GPU (h200-1gpu), 2 processes under MPS
mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --max 4M --json latency-mps2-handshake.json
mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --max 1M --iters 10

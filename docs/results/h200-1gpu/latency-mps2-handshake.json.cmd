# 2026-12-02T17:12Z, binaries of commit 8acdf75, 1 GPU (h200-1gpu), 2 processes under MPS, run right after latency-mps2-staged on the same machine
mpirun --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --max 4M --json latency-mps2-handshake.json

# 2026-12-02 (the run of 10:02-10:09 UTC), binaries of commit 72905d6 (+ the results README commit), 1 GPU(s) (h200-1gpu), under MPS (nvidia-cuda-mps-control -d)
HOCCL_GATED=0 mpirun --oversubscribe --bind-to none -np 2 $HOCCL_BIN_DIR/bench --latency --mps --ops sendrecv --json latency-mps2.json

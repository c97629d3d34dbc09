# 2026-12-02T00:19Z, binaries of commit 88bdb64, 1 GPU(s) (h200-1gpu)
nvidia-cuda-mps-control -d; for q in 1 2 3; do HOCCL_COPY_QUEUES=$q mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 -x HOCCL_COPY_QUEUES $HOCCL_BIN_DIR/bench --ops sendrecv --min 4K --max 256M; done; echo quit | nvidia-cuda-mps-control

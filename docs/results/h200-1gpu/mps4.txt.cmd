# 2026-12-02T12:10Z, binaries of commit adc1f0f, 1 GPU(s) (h200-1gpu), MPS daemon running (hoccl then asks for 16 hardware queues per process)
mpirun --bind-to none -np 4 $HOCCL_BIN_DIR/bench --ops sendrecv,allgather --min 4K --max 1M

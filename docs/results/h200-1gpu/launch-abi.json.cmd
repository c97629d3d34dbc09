# 2026-12-02T17:12Z, binaries of commit 8acdf75, 1 GPU (h200-1gpu), one rank; the 'nccl' rows are hoccl's own libnccl.so.2 loaded through the NCCL ABI (HOCCL_NCCL_LIB)
HOCCL_NCCL_LIB=$HOCCL_BIN_DIR/nccl/libnccl.so.2 mpirun -np 1 $HOCCL_BIN_DIR/bench --no-table --launch-cost --compare nccl --no-check --ops sendrecv,allgather,broadcast,alltoall --json launch-abi.json

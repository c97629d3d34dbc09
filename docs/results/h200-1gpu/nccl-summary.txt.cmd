# 2026-12-02T04:04:29Z, binaries of commit 6fac19e, 1 GPU(s) (h200-1gpu)
env HOCCL_MACHINE=h200-1gpu NCCL_STEP_LIMIT=55 bash scripts/gpu/nccl.sh (torch run with LD_LIBRARY_PATH and LD_PRELOAD, C programs after; the run's device time ended during nccl_check np2)

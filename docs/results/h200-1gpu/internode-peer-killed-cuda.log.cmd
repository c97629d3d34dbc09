# 2026-12-04T02:55Z, test binary of commit 3bcf9e5, 1 GPU (h200-1gpu); the process cases under MPS (CUDA_DEVICE_MAX_CONNECTIONS=16)
tests/internode cuda:: --ignored --test-threads=1
tests/internode cuda_processes_every_op --exact --ignored --nocapture --test-threads=1
tests/internode cuda_peer_killed_mid_transfer --exact --ignored --nocapture --test-threads=1   # three times

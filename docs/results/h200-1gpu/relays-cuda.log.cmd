# 2026-12-04T09:44Z, binaries of commit 2cf71ad, 1 GPU (h200-1gpu): thread ranks (and the CUDA thread bodies in internode-cuda.log), then processes under MPS (CUDA_DEVICE_MAX_CONNECTIONS=8)
internode --ignored --exact cuda::relays --nocapture
internode --ignored --exact cuda_processes_relay --nocapture
internode --ignored --exact cuda_processes_every_op --nocapture
internode --ignored --exact cuda_peer_killed_mid_transfer --nocapture

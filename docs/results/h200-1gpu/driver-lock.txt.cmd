# 2026-12-02T19:41:58Z, binaries of commit 2c8b401, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/driverlock.sh (driver_lock_probe MODE [ctx2] for each mode, without and with MPS)

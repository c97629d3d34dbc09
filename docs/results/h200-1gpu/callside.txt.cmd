# 2026-12-02T19:42:42Z, binaries of commit 2c8b401, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/driverlock.sh (under MPS: callside_probe staged|direct BYTES N 4)

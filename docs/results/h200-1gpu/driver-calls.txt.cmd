# 2026-12-02T19:42:20Z, binaries of commit 2c8b401, 1 GPU(s) (h200-1gpu)
bash scripts/gpu/driverlock.sh (callside_probe calls 0 5000, without MPS, then under MPS)

# 2026-12-02, binaries of commit 5cd5740, 1 GPU (h200-1gpu)
TEST_LIMIT=60 bash scripts/gpu/all.sh internode

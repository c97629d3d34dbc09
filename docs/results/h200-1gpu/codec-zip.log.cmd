# 2026-12-02T02:56:23Z, binaries of commit 6f9ac7d, 1 GPU(s) (h200-1gpu)
for f in tests/data/minilm-*.{bf16,f16,f32}: hoccl-zip compress --dtype EXT f f.z; hoccl-zip decompress f.z f.d; cmp f f.d; hoccl-zip stats --summary f.z

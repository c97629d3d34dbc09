# 2026-12-01T22:15:39Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu), from /work/main
/work/main/carry/codec_bench --json --tiers 1 --min-size 1M

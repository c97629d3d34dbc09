# 2026-12-01T22:16:28Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu)
python3 scripts/plot_bench.py docs/results/h200-1gpu/bench.json -o docs/results/h200-1gpu/bench.png

# 2026-12-01T23:00:34Z, binaries of commit fcf094d, 1 GPU(s) (h200-1gpu)
python3 scripts/plot_bench.py docs/results/h200-1gpu/bench.json -o docs/results/h200-1gpu/bench.png

# 2026-12-01T22:16:28Z, binaries of commit d901ad6, 1 GPU(s) (h200-1gpu), from /work/main
python3 scripts/plot_bench.py /work/main/docs/results/h200-1gpu/bench.json -o /work/main/docs/results/h200-1gpu/bench.png

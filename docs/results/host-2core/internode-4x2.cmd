# load average 3.45 2.98 1.91 before the run, 5.15 3.41 2.07 after (2 cores, another helper building)
NET_BENCH_PARTS=4x2 NET_BENCH_SIZES=4M,16M NET_BENCH_ITERS=3 bash scripts/net-bench.sh

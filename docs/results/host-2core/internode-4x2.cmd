# load average 2.86 1.30 1.16 before the run, 7.87 3.06 1.78 after (2 cores, a helper building beside it); binaries of commit a185476
NET_BENCH_PARTS=4x2 NET_BENCH_SIZES=16M,64M NET_BENCH_ITERS=3 bash scripts/net-bench.sh

# load average 0.00 before the run, 5.65 after (2 cores, nothing else running); commit 3e59c20
NET_BENCH_PARTS=4x2 NET_BENCH_SIZES=16M,64M NET_BENCH_ITERS=3 bash scripts/net-bench.sh

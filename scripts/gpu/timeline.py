#!/usr/bin/env python3
"""Summarise the per-CTA timelines that `codec_bench --timeline DIR` writes (kernels built
with -DBFX_TIMELINE): where a codec kernel's time goes between its first CTA's start and
its last CTA's end: the ramp (until the first CTA ends), the steady part, and the tail (after
the last CTA starts), and how many CTAs were resident along the way.

    python3 scripts/gpu/timeline.py DIR/enc-268435456.txt [more files]
"""
import statistics
import sys


def load(path):
    rows = []
    for line in open(path):
        t0, t1, t2, sm = (int(x) for x in line.split())
        if t2 >= t0 > 0:  # decoder CTAs without blocks write nothing (zeros)
            rows.append((t0, t1, t2, sm))
    return rows


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(path):
    rows = load(path)
    if not rows:
        print(f"{path}: no CTAs")
        return
    base = min(r[0] for r in rows)
    end = max(r[2] for r in rows)
    span = (end - base) / 1e3
    dur = [(r[2] - r[0]) / 1e3 for r in rows]
    mid = [(r[1] - r[0]) / 1e3 for r in rows]
    first_end = (min(r[2] for r in rows) - base) / 1e3
    last_start = (max(r[0] for r in rows) - base) / 1e3
    # resident CTAs per 0.5 us bin
    nbin = int(span / 0.5) + 1
    act = [0.0] * nbin
    for r in rows:
        a, b = (r[0] - base) / 500.0, (r[2] - base) / 500.0
        i = int(a)
        while i < nbin and i < b:
            act[i] += min(b, i + 1) - max(a, i)
            i += 1
    peak = max(act)
    print(f"{path}: {len(rows)} CTAs, span {span:.1f} us (first start to last end)")
    print(f"  CTA duration us: mean {statistics.mean(dur):.1f}  p10 {pct(dur, .1):.1f}  p50 {pct(dur, .5):.1f}"
          f"  p90 {pct(dur, .9):.1f}  max {max(dur):.1f}")
    print(f"  start to mid point us: mean {statistics.mean(mid):.1f}  p50 {pct(mid, .5):.1f}  p90 {pct(mid, .9):.1f}")
    print(f"  first CTA ends at {first_end:.1f} us; last CTA starts at {last_start:.1f} us, tail {span - last_start:.1f} us")
    lo = sum(0.5 for a in act if a < 0.5 * peak)
    # the span if every slot had been busy all along with the same CTA durations
    print(f"  sum of CTA durations / peak resident: {sum(dur) / peak:.1f} us ({100 * (1 - sum(dur) / peak / span):.0f} % of"
          f" the span lost to the ramp, the tail and idle slots)")
    print(f"  resident CTAs: peak {peak:.0f}; time with fewer than half of that {lo:.1f} us"
          f" ({sum(0.5 for a in act[: nbin // 2] if a < 0.5 * peak):.1f} in the first half)")
    # resident CTAs over the whole span in ~20 coarse bins
    step = max(1, nbin // 20)
    prof = " ".join(f"{sum(act[i:i + step]) / step:.0f}" for i in range(0, nbin, step))
    print(f"  resident over time ({step * 0.5:.1f} us bins): {prof}")


for p in sys.argv[1:]:
    summary(p)

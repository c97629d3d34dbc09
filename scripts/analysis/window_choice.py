#!/usr/bin/env python3
"""Would a cheaper encoder choice cost ratio? (bf16, B = 16384; the tenth session's question)

Compares, block by block, the exact coded size of the shipped choice (src/compress/select.rs:
rank the symbols of a strided 1/8 sample by count, pick (k1, k2) by the estimated cost) with
a "window" choice that needs no ranking and whose codes are a subtraction: tier 1 = the T1
consecutive exponents with the largest sampled count, tiers 1 + 2 = the T1 + T2 consecutive
exponents around tier 1 with the largest sampled count, (k1, k2) by the same cost. Also
counts the blocks whose ranked tier-1 set is a run of consecutive exponents (where a kernel
could code by subtraction with the same bytes' sizes). Pure Python, no dependencies:

    python3 scripts/analysis/window_choice.py tests/data/*.bf16    # plus synthetic cases
"""
import random
import struct
import sys

B = 16384


def tier(k):
    return (1 << k) - 1 if k else 0


CANDS = [(k1, k2) for k1 in range(1, 6) for k2 in range(0, 8) if tier(k1) + tier(k2) <= 31]


def pad4(x):
    return (x + 3) & ~3


def exact(exps, set1, set12, k1, k2):
    """Exact block size (format.rs), with the raw fallback."""
    nb = len(exps)
    n_esc1 = sum(1 for e in exps if e not in set1)
    n_raw = sum(1 for e in exps if e not in set12)
    g = (nb + 31) // 32
    s = 8 + pad4(tier(k1) + tier(k2)) + 4 * g * k1 + 4 * ((n_esc1 + 31) // 32) * k2 + pad4(n_raw) + pad4(nb)
    return min(s, 8 + pad4(2 * nb))


def sample_hist(exps):
    h = [0] * 256
    for e in exps[::8]:
        h[e] += 1
    return h, (len(exps) + 7) // 8


def ranked(exps, tiers):
    h, S = sample_hist(exps)
    order = sorted(range(256), key=lambda s: (-h[s], s))
    cum = [0]
    for t in range(31):
        cum.append(cum[-1] + h[order[t]])
    best = None
    for k1, k2 in CANDS:
        if tiers == 1 and k2:
            continue
        t1, t2 = tier(k1), tier(k2)
        cost = S * k1 + (S - cum[t1]) * k2 + 8 * (S - cum[t1 + t2])
        if best is None or cost < best[0]:
            best = (cost, k1, k2)
    _, k1, k2 = best
    t1, t2 = tier(k1), tier(k2)
    s1, s12 = set(order[:t1]), set(order[:t1 + t2])
    return exact(exps, s1, s12, k1, k2), max(s1) - min(s1) == t1 - 1


def windowed(exps, tiers):
    h, S = sample_hist(exps)
    P = [0]
    for s in range(256):
        P.append(P[-1] + h[s])

    def win(T, lo=0, hi=256):  # the first window of T symbols inside [lo, hi) with the most samples
        best = (-1, 0)
        for a in range(max(lo, 0), min(hi, 256) - T + 1):
            c = P[a + T] - P[a]
            if c > best[0]:
                best = (c, a)
        return best

    best = None
    for k1, k2 in CANDS:
        if tiers == 1 and k2:
            continue
        t1, t2 = tier(k1), tier(k2)
        c1, a = win(t1)
        c12, b = win(t1 + t2, a - t2, a + t1 + t2) if t2 else (c1, a)
        cost = S * k1 + (S - c1) * k2 + 8 * (S - max(c12, 0))
        if best is None or cost < best[0]:
            best = (cost, k1, k2, a, b)
    _, k1, k2, a, b = best
    t1, t2 = tier(k1), tier(k2)
    s1 = set(range(a, a + t1))
    s12 = set(range(b, b + t1 + t2)) if t2 else s1
    return exact(exps, s1, s12, k1, k2)


def bf16_exps_of_floats(xs):
    return [(struct.unpack("<I", struct.pack("<f", x))[0] >> 23) & 0xFF for x in xs]


def file_exps(path):
    d = open(path, "rb").read()
    return [(v >> 7) & 0xFF for v in struct.unpack("<%dH" % (len(d) // 2), d)]


def synthetic():
    r = random.Random(2)
    n = 2 * B
    yield "N(0,0.02)", bf16_exps_of_floats([r.gauss(0, 0.02) for _ in range(n)])
    yield "N(0,0.02), 2 % zeros", bf16_exps_of_floats([0.0 if r.random() < 0.02 else r.gauss(0, 0.02) for _ in range(n)])
    yield "N(0,0.02), 10 % zeros", bf16_exps_of_floats([0.0 if r.random() < 0.1 else r.gauss(0, 0.02) for _ in range(n)])
    yield "relu(N(0,1)), 50 % zeros", bf16_exps_of_floats([max(0.0, r.gauss(0, 1)) for _ in range(n)])
    yield "uniform(-1,1)", bf16_exps_of_floats([r.uniform(-1, 1) for _ in range(n)])


def main():
    cases = [(p.split("/")[-1], file_exps(p)) for p in sys.argv[1:]] + list(synthetic())
    print(f"{'data':30s} tiers   ranked   window   change  ranked tier-1 consecutive")
    for name, ex in cases:
        for tiers in (1, 2):
            tr = tw = ti = cont = nblk = 0
            for j in range(0, len(ex), B):
                blk = ex[j:j + B]
                r, c = ranked(blk, tiers)
                tr += r
                tw += windowed(blk, tiers)
                ti += 2 * len(blk)
                cont += c
                nblk += 1
            print(f"{name:30s} {tiers:5d}   {tr / ti:.4f}   {tw / ti:.4f}  {(tw / tr - 1) * 100:+6.2f} %  {cont}/{nblk} blocks")


if __name__ == "__main__":
    main()

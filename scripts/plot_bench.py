#!/usr/bin/env python3
"""Plot the bus bandwidth of every operation against size from the JSON that
`bench --json FILE` writes: one panel per operation, hoccl against each NCCL variant.

usage: python3 scripts/plot_bench.py bench.json [-o bench.png]
"""
import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The project's targets (busbw GB/s), stated for 4 GPUs with one rank each.
TARGETS = {
    "sendrecv": [(1 << 30, 390.0), (2 << 20, 120.0)],
    "allgather": [(512 << 20, 380.0)],
    "alltoall": [(512 << 20, 360.0)],
}


def human(n):
    n = int(n)  # JSON numbers may arrive as floats (1048576.0)
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


VARIANT_COLORS = ["tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:gray", "tab:olive"]


def style(impl, index):
    if impl == "hoccl":
        return dict(color="tab:red", marker="o", linewidth=2.2, zorder=5)
    if impl == "nccl":
        return dict(color="tab:blue", marker="s", linewidth=1.8)
    return dict(color=VARIANT_COLORS[index % len(VARIANT_COLORS)], marker=".", linestyle="--", linewidth=1.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--output", default="bench.png")
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    pts = data.get("points") or []
    if not pts:
        print(f"plot_bench: {args.json} has no points (was the table skipped?)", file=sys.stderr)
        return 1
    meta = data.get("meta", {})
    ops = list(dict.fromkeys(p["op"] for p in pts))
    cols = min(2, len(ops))
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.6 * rows), squeeze=False)
    four_gpus = int(meta.get("gpus") or 0) == 4 and int(meta.get("nranks") or 0) == 4
    for ax, op in zip(axes.flat, ops):
        mine = [p for p in pts if p["op"] == op]
        impls = list(dict.fromkeys(p["impl"] for p in mine))
        for i, impl in enumerate(impls):
            xs = sorted((p["bytes"], p["busbw"]) for p in mine if p["impl"] == impl)
            ax.plot([x for x, _ in xs], [y for _, y in xs], label=impl, **style(impl, i))
        sizes = sorted({p["bytes"] for p in mine})
        if four_gpus:
            shown = [t for t in TARGETS.get(op, []) if sizes[0] <= t[0] <= sizes[-1]]
            for i, (size, want) in enumerate(shown):
                ax.plot([size], [want], marker="*", markersize=14, color="gold",
                        markeredgecolor="black", linestyle="none", label="target" if i == 0 else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([human(s) for s in sizes], rotation=45)
        ax.set_xlabel("size (bytes, nccl-tests definition)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_ylim(bottom=0)
        wrong = sum(p.get("wrong") or 0 for p in mine)
        ax.set_title(f"{op}  (wrong elements: {wrong})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(
        f"hoccl vs NCCL {meta.get('nccl_version') or '(not run)'}: {int(meta.get('nranks') or 0)} ranks, "
        f"{int(meta.get('gpus') or 0)} GPU(s), {meta.get('device')}, {meta.get('dtype')}"
    )
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot_bench: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

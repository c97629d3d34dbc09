#!/usr/bin/env python3
"""Per-source-line view of a kernel's Nsight Compute source counters (build machine).

`PROFILE_SOURCE=carry/kernels/NAME.fatbin bash scripts/gpu/profile.sh` (GPU machine, a
`-lineinfo` build: `scripts/gpu/variants.sh build NAME "-lineinfo"`) writes one CSV row per
SASS instruction (address, executed warp instructions, stall samples by reason). This maps
the rows back to source lines with the disassembly of the same fatbin (`nvdisasm -g`) and
prints the lines and opcodes with the most instructions, the stall reasons and the shared
memory's bank-conflict wavefronts; --sass FILE writes the whole annotated listing.

    scripts/gpu/srcprof.py carry/kernels/NAME.fatbin hoccl_bfx_compress_bf16_8 \\
        OUT/src-compress_bf16_8-2tier.csv [--src cuda] [--top 40]

cuobjdump and nvdisasm come from PATH or --bin (the pip packages nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, e.g. `pip install --target DIR ...`, put them in DIR/nvidia/cu13/bin).
The source text shown is read from --src (default: the checkout's cuda/), so profile the
build of the checked-out sources, or point --src at the tree it was built from.
"""
import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile


def sass_lines(fatbin, kernel, bindir):
    """Offset -> ((file, line), instruction text) for `kernel`'s sm_90 SASS."""
    tool = lambda name: os.path.join(bindir, name) if bindir else name
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(fatbin)], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        cubins = [f for f in os.listdir(tmp) if f.endswith(".cubin") and "sm_90" in f]
        if not cubins:
            sys.exit("srcprof: no sm_90 cubin in %s" % fatbin)
        text = subprocess.run([tool("nvdisasm"), "-g", "-c", os.path.join(tmp, cubins[0])], check=True,
                              capture_output=True, text=True).stdout
    lines = text.split("\n")
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == ".text.%s:" % kernel)
    except StopIteration:
        sys.exit("srcprof: kernel %s not in %s" % (kernel, fatbin))
    where, out = ("?", 0), {}
    for l in lines[start + 1:]:
        if l.startswith("//----"):
            break
        a = re.match(r'\s*//## File "([^"]+)", line (\d+)', l)
        if a:
            where = (os.path.basename(a.group(1)), int(a.group(2)))
            continue
        b = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*);", l)
        if b:
            out[int(b.group(1), 16)] = (where, b.group(2).strip())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fatbin")
    ap.add_argument("kernel")
    ap.add_argument("csv")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cuda"))
    ap.add_argument("--bin", default=os.environ.get("HOCCL_CUDA_TOOLS", ""))
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sass", metavar="FILE", help="also write every SASS instruction (offset, source line, text, "
                    "executed warp instructions, stall samples and their two main reasons, shared-memory "
                    "wavefronts / ideal) to FILE, in program order: sum a phase by its offset range")
    args = ap.parse_args()

    sass = sass_lines(args.fatbin, args.kernel, args.bin)
    rows = list(csv.reader(open(args.csv)))
    hdr = next(r for r in rows if "Address" in r)
    data = rows[rows.index(hdr) + 1:]
    ia, ie = hdr.index("Address"), hdr.index("Instructions Executed")
    iss = hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda v: int(v.replace(",", "") or 0)
    base = int(data[0][ia], 16)
    col = lambda name: hdr.index(name) if name in hdr else None
    iwf, iwi = col("L1 Wavefronts Shared"), col("L1 Wavefronts Shared Ideal")
    wf_total = wf_excess = 0
    listing = []
    by_line = collections.defaultdict(lambda: [0, 0])
    by_op = collections.defaultdict(lambda: [0, 0])
    stalls = collections.Counter()
    total = [0, 0]
    for r in data:
        where, ins = sass.get(int(r[ia], 16) - base, (("?", 0), r[1].strip()))
        ex, st = num(r[ie]), num(r[iss])
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] if ins else "?"
        for acc in (by_line[where], by_op[op], total):
            acc[0] += ex
            acc[1] += st
        row_stalls = [(num(r[i]), name) for i, name in reasons]
        for n, name in row_stalls:
            stalls[name] += n
        wf = num(r[iwf]) if iwf is not None else 0
        wi = num(r[iwi]) if iwi is not None else 0
        wf_total += wf
        wf_excess += max(0, wf - wi)
        if args.sass:
            top2 = ",".join("%s %d" % (name, n) for n, name in sorted(row_stalls, reverse=True)[:2] if n)
            listing.append("%05x %s:%-5d %-58s ex %9d  st %5d  wf %d/%d  %s" % (
                int(r[ia], 16) - base, where[0], where[1], ins[:58], ex, st, wf, wi, top2))

    cache = {}

    def text(where):
        f, n = where
        if f not in cache:
            p = os.path.join(args.src, f)
            cache[f] = open(p).read().split("\n") if os.path.exists(p) else []
        return cache[f][n - 1].strip()[:90] if 0 < n <= len(cache[f]) else ""

    pct = lambda v, t: 100.0 * v / max(t, 1)
    print("%s: %d warp instructions, %d stall samples" % (args.kernel, total[0], total[1]))
    print("--- by source line: % of instructions, % of stall samples")
    for where, (ex, st) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print("%5.1f %5.1f  %s:%d  %s" % (pct(ex, total[0]), pct(st, total[1]), where[0], where[1], text(where)))
    print("--- by opcode")
    for op, (ex, st) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:25]:
        print("%5.1f %5.1f  %s" % (pct(ex, total[0]), pct(st, total[1]), op))
    print("--- stall reasons (samples)")
    print("  " + "  ".join("%s %d" % kv for kv in stalls.most_common(14)))
    if iwf is not None:
        print("--- shared-memory wavefronts: %d, of which %d past the ideal (bank conflicts)" % (wf_total, wf_excess))
    if args.sass:
        with open(args.sass, "w") as f:
            f.write("\n".join(listing) + "\n")


if __name__ == "__main__":
    main()

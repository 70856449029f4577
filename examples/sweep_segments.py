"""Sweep the segment size k from 1 to L on a chain: extra compute and peak memory of
checkpointing every k-th layer boundary, the knee of the curve, and a plot.

    python examples/sweep_segments.py [--layers 32] [--quick] [--out /tmp/sweep_segments.png]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from solver.plans import forward_stages, sequence_from_keep
from solver.simulate import simulate
from solver.synthetic import training_chain


def sweep(n: int) -> list[dict]:
    g = training_chain(n, fwd_bytes=100, fwd_time=1.0)
    stages = forward_stages(g)
    base = simulate(g, g.order)
    rows = []
    for k in range(1, n + 1):
        keep = {s.boundary for i, s in enumerate(stages) if (i + 1) % k == 0}
        r = simulate(g, sequence_from_keep(g, keep))
        rows.append({"k": k, "peak": r.peak_bytes / base.peak_bytes, "extra": r.cost / base.cost - 1})
    return rows


def knee(rows: list[dict]) -> dict:
    """The k with the smallest peak (ties: least extra compute)."""
    return min(rows, key=lambda r: (round(r["peak"], 9), r["extra"]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "sweep_segments.png"))
    a = ap.parse_args(argv)
    n = 12 if a.quick else a.layers
    rows = sweep(n)
    best = knee(rows)
    print(f"chain of {n} layers; peak and extra compute relative to store-all")
    print(f"{'k':>4} {'peak':>8} {'extra %':>9}")
    for r in rows:
        mark = "  <- knee" if r is best else ""
        print(f"{r['k']:>4} {r['peak']:>8.3f} {100 * r['extra']:>9.2f}{mark}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["k"] for r in rows], [r["peak"] for r in rows], "o-", label="peak (x store-all)")
    ax2 = ax.twinx()
    ax2.plot([r["k"] for r in rows], [100 * r["extra"] for r in rows], "s--", color="C1", label="extra compute %")
    ax.axvline(best["k"], color="grey", ls=":")
    ax.set_xlabel("segment size k")
    ax.set_ylabel("peak memory (x store-all)")
    ax2.set_ylabel("extra compute (%)")
    ax.set_title(f"checkpoint every k layers, chain of {n} (knee k={best['k']})")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"knee: k={best['k']} (sqrt(L)={n ** 0.5:.1f}); plot written to {a.out}")


if __name__ == "__main__":
    main()

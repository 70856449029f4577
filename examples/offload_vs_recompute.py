"""Offload vs recompute: the break-even host bandwidth of one layer's activation, and how
the solver's choice flips from recomputing to offloading as the bandwidth grows.

    python examples/offload_vs_recompute.py [--quick] [--out /tmp/offload_vs_recompute.png]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from solver.methods.offload import breakeven_bandwidth
from solver.solving import solve
from solver.simulate import simulate
from solver.synthetic import training_chain


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "offload_vs_recompute.png"))
    a = ap.parse_args(argv)
    n = 6 if a.quick else a.layers
    g = training_chain(n, fwd_bytes=100, fwd_time=1.0)
    node = "f1"
    be = breakeven_bandwidth(g, node)
    print(f"chain of {n} layers, 100 B and 1 time unit per layer; break-even bandwidth of {node}: {be:.1f} B/unit")
    peak = simulate(g, g.order).peak_bytes
    budget = int(0.85 * peak)
    bws = np.geomspace(max(be / 20, 1e-3), be * 20, 7 if a.quick else 13)
    rows = []
    for bw in bws:
        s = solve(g, budget, method="offload", bandwidth=float(bw))
        rows.append({"bandwidth": float(bw), "offloads": len(s.offloads), "recomputed": s.recomputations
                     if hasattr(s, "recomputations") else sum(c - 1 for c in s.counts().values() if c > 1),
                     "extra": s.overhead})
    print(f"budget {budget} B (0.85x store-all)")
    print(f"{'bandwidth':>10} {'offloads':>9} {'recomputed':>11} {'extra %':>9}")
    for r in rows:
        print(f"{r['bandwidth']:>10.2f} {r['offloads']:>9} {r['recomputed']:>11} {100 * r['extra']:>9.2f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogx([r["bandwidth"] for r in rows], [100 * r["extra"] for r in rows], "o-", label="extra time %")
    ax.semilogx([r["bandwidth"] for r in rows], [r["offloads"] for r in rows], "s--", label="offloaded values")
    ax.semilogx([r["bandwidth"] for r in rows], [r["recomputed"] for r in rows], "^:", label="recomputed values")
    ax.axvline(be, color="grey", ls=":", label=f"break-even of {node}")
    ax.set_xlabel("host bandwidth (bytes per time unit)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"plot written to {a.out}")


if __name__ == "__main__":
    main()

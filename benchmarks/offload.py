"""Offload vs recompute-only: extra cost over store-all as the host bandwidth varies.

For a heterogeneous training chain and one public benchmark graph, at 0.5x-0.9x of the
store-all peak, runs the ``offload`` method (store / recompute / offload) and its
recompute-only ablation (``mode="recompute"``) and prints the extra compute of each.
The benchmark graphs' time unit is arbitrary, so the bandwidth is given relative to the
graph's own ratio ``R = total bytes / total time`` (at ``1x R`` moving every value once
takes as long as the whole step). Every schedule is graded by ``solver.simulate``.

Run: ``python benchmarks/offload.py [--graph NAME] [--quick]``; writes
``benchmarks/results/offload.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from graphs import ComputeGraph
from solver import InfeasibleBudget, NoScheduleFound, simulate, solve
from solver.synthetic import training_chain

ROOT = pathlib.Path(__file__).resolve().parent
GRAPHS = pathlib.Path(os.environ.get("REMAT_BENCHMARK_GRAPHS", ROOT.parent.parent / "shared" / "benchmarks" / "graphs"))
FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9)
RELATIVE_BW = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def _chain() -> ComputeGraph:
    n = 24
    g = training_chain(
        n,
        fwd_bytes=[(1 + (7 * i) % 5) * 2**20 for i in range(n)],
        fwd_time=[1.0 + (3 * i) % 4 for i in range(n)],
    )
    g.name = "training_chain24"
    return g


def _run(g, budget, **kw):
    t0 = time.perf_counter()
    try:
        s = solve(g, budget, time_limit=20, **kw)
    except (NoScheduleFound, InfeasibleBudget) as exc:
        return {"status": type(exc).__name__, "seconds": time.perf_counter() - t0}
    return {
        "status": "ok",
        "overhead": s.overhead,
        "offloads": len(s.offloads),
        "offloaded_bytes": s.info.get("offloaded_bytes", 0),
        "recomputations": simulate(g, s).recomputations,
        "seconds": time.perf_counter() - t0,
    }


def _fmt(r):
    return f"{100 * r['overhead']:7.2f}%" if r["status"] == "ok" else f"{'n/a':>8}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="MobileNet_512_224_224_3_train", help="benchmark graph file stem")
    parser.add_argument("--quick", action="store_true", help="three bandwidths, three budgets")
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # the solvers themselves never need torch
        pass
    fractions = (0.5, 0.7, 0.9) if args.quick else FRACTIONS
    rel_bws = (0.01, 0.3, 3.0) if args.quick else RELATIVE_BW
    graphs = [_chain(), ComputeGraph.load(GRAPHS / f"{args.graph}.json")]
    rows = []
    for g in graphs:
        peak = simulate(g, g.order).peak_bytes
        ratio = g.total("bytes") / g.total("time")
        print(f"\n{g.name}: {len(g.ops)} ops, store-all peak {peak} B, R = {ratio:.4g} B per time unit")
        print(f"{'budget':>7} {'recompute':>10} " + " ".join(f"{f'{m:g}x R':>9}" for m in rel_bws)
              + "   (extra compute over store-all)")
        for f in fractions:
            budget = int(f * peak)
            rec = _run(g, budget, method="offload", bandwidth=ratio, mode="recompute")
            cells = []
            for m in rel_bws:
                r = _run(g, budget, method="offload", bandwidth=m * ratio)
                cells.append(r)
                rows.append({"graph": g.name, "fraction": f, "budget_bytes": budget, "relative_bandwidth": m,
                             "bandwidth": m * ratio, "offload": r, "recompute_only": rec})
            print(f"{f:>6.1f}x {_fmt(rec):>10} " + " ".join(f"{_fmt(c):>9}" for c in cells))
        print("solve seconds (max): " + f"{max(r['offload']['seconds'] for r in rows if r['graph'] == g.name):.2f}")
    out = ROOT / "results" / "offload.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "fractions": fractions, "relative_bandwidths": rel_bws}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

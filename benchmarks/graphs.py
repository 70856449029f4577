"""Every registered method on every public benchmark graph at 0.9x and 0.8x the topo peak,
and on the captured zoo (GPT, HF GPT-2, Llama, ResNet, U-Net) at 0.7x, 0.5x and 0.3x.

For each graph, budget and method: extra compute over store-all, peak / budget, solve
time, lower bound and gap (on the extra compute), whether the method keeps the reference
order (fixed) or may reorder (free), and the Moccasin reference figure from the
benchmarks README. Every schedule is graded by ``solver.simulate`` inside ``solver.solve``.
The zoo's graphs are captured on this machine (random weights, times measured on its
CPU), so their figures are this machine's; their random ops (dropout) are replayed, as
``solver.optimize`` plans them (``--zoo-masks-held``: each mask computed once and held,
as ``capture`` alone gives). Where ``auto`` leaves a zoo cell above a proven gap of
10 % with the zoo's time limit, it runs again with ``--zoo-long-limit`` seconds
(default 60), a row of its own.

Run: ``python benchmarks/graphs.py [--graphs DIR] [--time-limit S] [--large-time-limit S]
[--methods a,b] [--only SUBSTR] [--zoo] [--zoo-only] [--zoo-methods a,b]
[--zoo-time-limit S] [--zoo-long-limit S] [--zoo-masks-held]``; writes
``benchmarks/results/graphs.json`` and ``graphs.md`` (and ``zoo.json``, ``zoo.md``).
``--zoo-large`` runs only the 32-layer zoo (HF GPT-2 and Llama, 5,000-7,000 ops) and
writes ``zoo_large.json`` and ``zoo_large.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

# run as a script, this file's folder comes first on sys.path and its name would shadow
# the ``graphs`` package: put the repository root first instead
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import solver  # noqa: E402
from graphs import ComputeGraph  # noqa: E402
from solver import InfeasibleBudget, NoScheduleFound, simulate, solve

ROOT = pathlib.Path(__file__).resolve().parent
DEFAULT_GRAPHS = ROOT.parent.parent / "shared" / "benchmarks" / "graphs"
FRACTIONS = (0.9, 0.8)
#: Exact methods build O(n^2) models: skipped above this size (their build alone takes
#: minutes and gigabytes there).
EXACT_MAX_OPS = 400

# Moccasin's figures from the benchmarks README (extra compute; None: no answer)
MOCCASIN = {
    ("VGG16", 0.9): "+1.97 % (4.6 s)",
    ("VGG16", 0.8): "infeasible (≈0.83x)",
    ("fcn_8", 0.9): "+0.03 % (79 s)",
    ("fcn_8", 0.8): "+0.14 % (69 s)",
    ("ResNet50", 0.9): "none in 600 s",
    ("ResNet50", 0.8): "none in 600 s",
    ("MobileNet", 0.9): "+0.16 % (279 s)",
    ("MobileNet", 0.8): "none in 700 s",
    ("vgg_unet", 0.9): "+1.13 % (54 s)",
    ("vgg_unet", 0.8): "+1.98 % (68 s)",
    ("random_layered_n100_", 0.9): "+0.79 % (148 s)",
    ("random_layered_n100_", 0.8): "+2.30 % (142 s)",
    ("random_layered_n250_", 0.9): "none in 700 s",
    ("random_layered_n250_", 0.8): "none in 700 s",
}


def _reference(name: str, frac: float) -> str:
    for (key, f), text in MOCCASIN.items():
        if name.startswith(key) and f == frac:
            return text
    return "—"


def _limit_for(name: str, n_ops: int, base: float, large: float) -> float:
    """Seconds for one cell: ``base``; ``large`` for auto and order search on graphs over
    300 ops (the goals allow 60 s there)."""
    return max(base, large) if n_ops > 300 and name in ("auto", "order_search") else base


def run(graphs_dir: pathlib.Path, *, time_limit: float, only: str | None, method_names: list[str] | None,
        large_limit: float = 60.0) -> list[dict]:
    log = logging.getLogger("benchmarks.graphs")
    registry = solver.methods()
    names = method_names or list(registry)
    rows: list[dict] = []
    for path in sorted(graphs_dir.glob("*.json")):
        if only and only not in path.name:
            continue
        g = ComputeGraph.load(path)
        topo = simulate(g, g.order).peak_bytes
        for frac in FRACTIONS:
            budget = int(frac * topo)
            for name in names + ([] if "auto" in names else ["auto"]):
                order = registry[name].order if name in registry else "free"
                limit = _limit_for(name, len(g.ops), time_limit, large_limit)
                row = {"graph": g.name, "ops": len(g.ops), "fraction": frac, "budget": budget,
                       "method": name, "order": order, "moccasin": _reference(g.name, frac)}
                if registry.get(name) is not None and registry[name].family == "exact" and len(g.ops) > EXACT_MAX_OPS:
                    row.update(status="skipped", message=f"exact model too large over {EXACT_MAX_OPS} ops",
                               seconds=0.0)
                    rows.append(row)
                    print(_line(row), flush=True)
                    continue
                t0 = time.perf_counter()
                try:
                    s = solve(g, budget, method=name, time_limit=limit)
                    row.update(status="ok", extra_pct=100 * s.overhead, peak_over_budget=s.peak_bytes / budget,
                               lower_bound=s.lower_bound, gap=s.gap, picked=s.method,
                               bound_scope=s.info.get("bound_scope"),
                               fixed_order_lower_bound=s.info.get("fixed_order_lower_bound"),
                               first_schedule_s=s.info.get("auto", {}).get("winner_seconds"))
                except InfeasibleBudget as exc:
                    row.update(_failure(exc, topo))
                except NoScheduleFound as exc:
                    row.update(status="no schedule", message=str(exc)[:300])
                except Exception as exc:  # a method still being written must not stop the table
                    row.update(status="error", message=f"{type(exc).__name__}: {exc}"[:300])
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
                print(_line(row), flush=True)
    return rows


#: The captured zoo: name -> (builder in ``examples.models``, its options).
ZOO = {
    "GPT 4L d128 seq128 b8": ("gpt", dict(n_layer=4, d=128, n_head=4, seq=128, batch=8)),
    "HF GPT-2 4L d128 seq128 b8": ("hf_gpt2", dict(n_layer=4, d=128, n_head=4, seq=128, batch=8)),
    "Llama 4L d128 seq128 b8": ("hf_llama", dict(n_layer=4, d=128, n_head=4, seq=128, batch=8)),
    "ResNet w16 64px b16 3 blocks": ("resnet", dict(batch=16, width=16, size=64, blocks=3)),
    "U-Net w16 64px b8 depth 3": ("unet", dict(batch=8, width=16, size=64, depth=3)),
}
ZOO_FRACTIONS = (0.7, 0.5, 0.3)
ZOO_METHODS = ("auto", "eviction", "lp_eviction", "cover", "lns", "stage_milp", "hierarchical", "chain_dp", "block_dp",
               "checkmate_milp", "cpsat")
#: The 32-layer zoo (``--zoo-large``: graphs of 5,000-7,000 ops), and its methods (the
#: exact ones find nothing at that size in seconds).
ZOO_LARGE = {
    "HF GPT-2 32L d64 seq64 b4": ("hf_gpt2", dict(n_layer=32, d=64, n_head=4, seq=64, batch=4)),
    "Llama 32L d64 seq64 b4": ("hf_llama", dict(n_layer=32, d=64, n_head=4, seq=64, batch=4)),
}
ZOO_LARGE_METHODS = ("auto", "eviction", "lp_eviction", "cover", "lns", "stage_milp", "block_dp")


def _capture_file(folder: pathlib.Path, name: str) -> pathlib.Path:
    return folder / (name.replace(" ", "_") + ".json")


def zoo_graphs(only: str | None = None, zoo: dict | None = None, *, replay: bool = True,
               save: pathlib.Path | None = None, load: pathlib.Path | None = None):
    """Capture each model of ``zoo`` (default :data:`ZOO`) as its training step (yields
    name, ComputeGraph).

    With ``replay`` (default), random ops (dropout) may run again, their generator
    states kept (:func:`graphs.rewrite.replay_random_ops`): the graph ``solver.optimize``
    plans. Without it, each dropout mask is computed once and held for its backward, as
    ``capture`` alone gives. ``save``: a folder where each graph is written
    (``<name>.json``, spaces as underscores); ``load``: a folder of graphs so written,
    read instead of capturing (op times are measured at capture, so a graph read back
    gives the same cells again)."""
    import torch

    from examples import models
    from graphs import capture
    from graphs.rewrite import replay_random_ops

    for name, (builder, kwargs) in (ZOO if zoo is None else zoo).items():
        if only and only not in name:
            continue
        if load is not None:
            g = ComputeGraph.load(_capture_file(load, name))
        else:
            torch.manual_seed(0)
            model, inputs = getattr(models, builder)(**kwargs)
            g = capture(model, inputs, backward="outputs")
            if replay:
                replay_random_ops(g)
        g.name = name
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            g.save(_capture_file(save, name))
        yield name, g


#: The proven gap the zoo's ``auto`` is held to; a cell whose ``auto`` stays above it
#: with the zoo's time limit is solved again with ``long_limit`` seconds.
GOAL_GAP = 0.10


def _open(row: dict) -> bool:
    """Whether a row of ``auto`` leaves the goal open: a schedule without a proven gap
    within :data:`GOAL_GAP`, or no schedule where one may exist."""
    if row["status"] == "ok":
        return row.get("gap") is None or row["gap"] > GOAL_GAP
    return row["status"] != "infeasible"


def run_zoo(*, time_limit: float, only: str | None, method_names: list[str] | None,
            large: bool = False, long_limit: float = 0.0, replay: bool = True,
            save: pathlib.Path | None = None, load: pathlib.Path | None = None) -> list[dict]:
    """Every zoo graph (with ``large``, of :data:`ZOO_LARGE`) at :data:`ZOO_FRACTIONS` of
    its store-all peak, each method with ``time_limit`` seconds; where ``auto`` leaves
    the goal open (:func:`_open`) and ``long_limit`` is longer, ``auto`` again with
    ``long_limit`` seconds (a row of its own). ``replay``, ``save``, ``load``: as for
    :func:`zoo_graphs`."""
    rows: list[dict] = []
    default = ZOO_LARGE_METHODS if large else ZOO_METHODS
    for name, g in zoo_graphs(only, ZOO_LARGE if large else None, replay=replay, save=save, load=load):
        topo = simulate(g, g.order).peak_bytes
        for frac in ZOO_FRACTIONS:
            budget = int(frac * topo)
            for method in method_names or default:
                row = _zoo_row(g, name, frac, budget, topo, method, time_limit)
                rows.append(row)
                print(_line(row), flush=True)
                if method == "auto" and long_limit > time_limit and _open(row):
                    row = {**_zoo_row(g, name, frac, budget, topo, method, long_limit), "long": True}
                    rows.append(row)
                    print(_line(row), flush=True)
    return rows


def _zoo_row(g: ComputeGraph, name: str, frac: float, budget: int, topo: int, method: str,
             time_limit: float) -> dict:
    """One zoo cell solved by one method: the row of its figures."""
    row = {"graph": name, "ops": len(g.ops), "fraction": frac, "budget": budget, "method": method,
           "order": solver.methods()[method].order, "moccasin": "—", "time_limit": time_limit}
    t0 = time.perf_counter()
    try:
        s = solve(g, budget, method=method, time_limit=time_limit)
        row.update(status="ok", extra_pct=100 * s.overhead, peak_over_budget=s.peak_bytes / budget,
                   lower_bound=s.lower_bound, gap=s.gap, picked=s.method, bound_scope=s.info.get("bound_scope"))
    except InfeasibleBudget as exc:
        row.update(_failure(exc, topo))
    except NoScheduleFound as exc:
        row.update(status="no schedule", message=str(exc)[:300])
    row["seconds"] = time.perf_counter() - t0
    return row


def _failure(exc: InfeasibleBudget, topo: int) -> dict:
    """A row's figures for a budget that no schedule reached: "infeasible" where the
    budget is below the proven lower bound on the peak, "not reached" where it lies
    between that bound and the smallest peak reached (both as fractions of ``topo``)."""
    proven = exc.budget_bytes < exc.lower_bound_bytes
    return dict(status="infeasible" if proven else "not reached",
                smallest_feasible=exc.smallest_feasible_bytes / topo,
                peak_lower_bound=exc.lower_bound_bytes / topo, message=str(exc)[:300])


def _failed(r: dict) -> str:
    """How a row without a schedule reads in the tables."""
    reached = f"{r['smallest_feasible']:.3f}x reached"
    if r["status"] == "infeasible":
        return f"infeasible (< {r['peak_lower_bound']:.3f}x; {reached})"
    return f"not reached ({reached}; ≥ {r['peak_lower_bound']:.3f}x)"


def _line(r: dict) -> str:
    if r["status"] == "ok":
        gap = "—" if r.get("gap") is None else f"{100 * r['gap']:.1f} %"
        what = f"+{r['extra_pct']:.3f} %  peak/budget {r['peak_over_budget']:.3f}  gap {gap}"
    elif "smallest_feasible" in r:
        what = _failed(r) + " of topo"
    else:
        what = r["status"] + ": " + r.get("message", "")[:60]
    return (f"{r['graph'][:28]:<28} {r['fraction']:.1f}x {_method(r):<15} {r['order']:<5} "
            f"{r['seconds']:7.2f} s  {what}   [Moccasin {r['moccasin']}]")


def _long(r: dict) -> str:
    """The label's `` (60 s)`` for a row solved again with the longer limit (see :func:`run_zoo`)."""
    return f" ({r['time_limit']:g} s)" if r.get("long") else ""


def _method(r: dict) -> str:
    return r["method"] + _long(r)


def markdown(rows: list[dict]) -> str:
    out = ["| graph | budget | method | order | extra compute | peak/budget | time (s) | first schedule (s) "
           "| lower bound gap | Moccasin |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "ok":
            extra = f"+{r['extra_pct']:.3f} %"
            pb = f"{r['peak_over_budget']:.3f}"
            gap = "—" if r.get("gap") is None else f"{100 * r['gap']:.1f} %"
        elif "smallest_feasible" in r:
            extra, pb, gap = _failed(r), "—", "—"
        else:
            extra, pb, gap = r["status"], "—", "—"
        method = _method(r) if r["method"] != "auto" or "picked" not in r else r["picked"] + _long(r)
        first = "—" if r.get("first_schedule_s") is None else f"{r['first_schedule_s']:.2f}"
        if r.get("bound_scope") in ("fixed order", "free order") and gap != "—":
            gap += f" ({r['bound_scope']})"
        out.append(f"| {r['graph'][:30]} | {r['fraction']:.1f}x | {method} | {r['order']} | {extra} | {pb} | "
                   f"{r['seconds']:.2f} | {first} | {gap} | {r['moccasin']} |")
    return "\n".join(out) + "\n"


def _cell(r: dict | None, *, gap: bool = False, picked: bool = False) -> str:
    """One method's figure in :func:`zoo_table`: extra compute (with its proven gap, or
    the method ``auto`` picked), "none" without a schedule, "infeasible" where it
    proved that none exists."""
    if r is None:
        return ""
    if r["status"] != "ok":
        return "infeasible" if r["status"] == "infeasible" else "none"
    out = f"+{r['extra_pct']:.2f} %"
    if picked and r.get("picked", "").startswith("auto:"):
        out += f" ({r['picked'][5:]})"
    if gap and r.get("gap") is not None:
        out += f" ({100 * r['gap']:.1f} %)"
    return out


def zoo_table(rows: list[dict]) -> str:
    """The zoo's rows as the README's table: a line per graph and budget, ``auto`` (with
    its proven gap and time, and its row with the longer limit where it ran again), then
    every other method's extra compute."""
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "auto"]
    gapped = {"lp_eviction", "stage_milp"}
    head = (["graph (ops) @ budget", "auto", "proven gap", "auto time", "auto, longer limit (gap, time)"]
            + [f"{m} (gap)" if m in gapped else m for m in methods])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["graph"], r["ops"], r["fraction"]), {})[_method(r)] = r
    for (graph, ops, frac), by in cells.items():
        auto = by.get("auto")
        long = next((r for k, r in by.items() if k.startswith("auto (")), None)
        line = [f"{graph} ({ops:,}) @{frac:g}"]
        if auto is not None and auto["status"] == "ok":
            scope = f" ({auto['bound_scope']})" if auto.get("bound_scope") in ("fixed order", "free order") else ""
            line += [_cell(auto, picked=True), "—" if auto.get("gap") is None else f"{100 * auto['gap']:.1f} %{scope}",
                     f"{auto['seconds']:.1f} s"]
        elif auto is not None:
            line += [_failed(auto) if "smallest_feasible" in auto else auto["status"], "—", f"{auto['seconds']:.1f} s"]
        else:
            line += ["", "", ""]
        if long is not None and long["status"] == "ok":
            line.append(f"{_cell(long, gap=True)}, {long['seconds']:.1f} s")
        elif long is not None:
            line.append(f"{_failed(long) if 'smallest_feasible' in long else long['status']}, {long['seconds']:.1f} s")
        else:
            line.append("")
        unsolved = auto is not None and auto["status"] != "ok" and "smallest_feasible" in auto
        line += ["" if unsolved else _cell(by.get(m), gap=m in gapped) for m in methods]
        out.append("| " + " | ".join(line) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=pathlib.Path, default=DEFAULT_GRAPHS)
    ap.add_argument("--time-limit", type=float, default=4.0, help="seconds per method and cell")
    ap.add_argument("--large-time-limit", type=float, default=60.0,
                    help="seconds for auto and order_search on graphs over 300 ops")
    ap.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    ap.add_argument("--only", default=None, help="only graphs whose file name contains this")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "results")
    ap.add_argument("--zoo", action="store_true", help="also run the captured zoo")
    ap.add_argument("--zoo-only", action="store_true", help="run only the captured zoo")
    ap.add_argument("--zoo-large", action="store_true", help="run only the 32-layer zoo (zoo_large.json, .md)")
    ap.add_argument("--zoo-time-limit", type=float, default=10.0, help="seconds per method and zoo cell")
    ap.add_argument("--zoo-long-limit", type=float, default=60.0,
                    help="seconds for auto again on a zoo cell it leaves above the goal gap (0: not again)")
    ap.add_argument("--zoo-masks-held", action="store_true",
                    help="capture the zoo as capture() gives it: each dropout mask computed once and held "
                         "(default: random ops replayed, as solver.optimize plans)")
    ap.add_argument("--zoo-save", type=pathlib.Path, default=None,
                    help="write each zoo capture to this folder (<name>.json)")
    ap.add_argument("--zoo-load", type=pathlib.Path, default=None,
                    help="read the zoo's graphs from a folder --zoo-save wrote, instead of capturing")
    ap.add_argument("--zoo-methods", default=None, help="comma-separated methods for the zoo "
                    f"(default: {','.join(ZOO_METHODS)})")
    args = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.zoo_large:
        zoo = run_zoo(time_limit=args.zoo_time_limit, only=args.only, large=True, long_limit=args.zoo_long_limit,
                      replay=not args.zoo_masks_held, save=args.zoo_save, load=args.zoo_load,
                      method_names=args.zoo_methods.split(",") if args.zoo_methods else None)
        (args.out / "zoo_large.json").write_text(json.dumps(zoo, indent=1, default=str))
        (args.out / "zoo_large.md").write_text(markdown(zoo))
        print(f"wrote {args.out / 'zoo_large.json'} and {args.out / 'zoo_large.md'}")
        return
    if args.zoo or args.zoo_only:
        zoo = run_zoo(time_limit=args.zoo_time_limit, only=args.only, long_limit=args.zoo_long_limit,
                      replay=not args.zoo_masks_held, save=args.zoo_save, load=args.zoo_load, method_names=args.zoo_methods.split(",") if args.zoo_methods else None)
        (args.out / "zoo.json").write_text(json.dumps(zoo, indent=1, default=str))
        (args.out / "zoo.md").write_text(markdown(zoo) + "\n" + zoo_table(zoo))
        print(f"wrote {args.out / 'zoo.json'} and {args.out / 'zoo.md'}")
        if args.zoo_only:
            return
    rows = run(args.graphs, time_limit=args.time_limit, only=args.only,
               method_names=args.methods.split(",") if args.methods else None,
               large_limit=args.large_time_limit)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graphs.json").write_text(json.dumps(rows, indent=1, default=str))
    (args.out / "graphs.md").write_text(markdown(rows))
    print(f"wrote {args.out / 'graphs.json'} and {args.out / 'graphs.md'}")


if __name__ == "__main__":
    main()

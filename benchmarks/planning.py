"""Where ``solver.optimize`` spends its planning time, as the model grows.

For a tiny Hugging Face Llama (``LlamaConfig``, hidden 64, 4 heads, seq 128, batch 4,
vocab 256, random weights, built from the config) with 4, 8, 16 and 32 layers, each in a
fresh process with ``torch.set_num_threads(1)``: ``solver.optimize(model, budget,
batch, mode=mode)`` at half the store-all peak of its captured step (a fixed fraction: a
budget from the timed lowest-peak search would move with the machine's load), in graph
mode (the default) and in module mode (a plan per layer). In both modes a model of
more than five alike layers is captured and measured on four of them; graph mode writes
the whole step's joint graph from theirs (``graphs.repeated.stitch_joint``). Timed in
process CPU time (the report's notes go to the JSON rows) and split into

* capture: the training step traced and cost-annotated (``graphs.capture``, its
  fixed charges and the store-all simulation);
* measure: op times and workspaces measured on the batch, in schedules that fit the
  budget (``planning.measure_within``);
* solve: the schedule searched (``solver.solve``; module mode: the per-layer search,
  ``solver.module_plan.plan_modules``);
* check: the rest: the rewrite built (graph mode cuts the step's joint graph for the
  schedule), its gradients checked against the model's, the peaks of real steps
  measured, the report (the second table splits it).

The store-all peak that sets the budget comes from a capture in the same process
before the timed call; the timed call captures again from scratch. The budget is half
of it wherever the schedules that the smallest-peak search tries reach it without a
deadline, else the smallest peak that search finds in 60 s: a
search cut short by a timer would make the budget, and so every figure of the row,
move with the machine's load.

Run: ``python benchmarks/planning.py [--layers 4 8 16 32] [--modes graph module]``. Prints
a Markdown table and writes ``benchmarks/results/planning.json``. Goal: 32 layers in
10 s, checks included.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "planning.json"
GOAL_S = 10.0
CONFIG = dict(d=64, n_head=4, seq=128, batch=4, vocab=256)


class _Clock:
    """Process CPU time spent inside wrapped functions, by bucket (outermost call only)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._inside: str | None = None

    def wrap(self, bucket: str, fn):
        def timed(*args, **kwargs):
            if self._inside is not None:
                return fn(*args, **kwargs)
            self._inside = bucket
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[bucket] = self.spent.get(bucket, 0.0) + time.process_time() - t0
                self._inside = None
        return timed


def _run(layers: int, mode: str, queue) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    import solver
    import solver.join.checks as checks
    import solver.join.planning as planning
    from graphs.graph_mode import ScheduledStep
    from examples.models import hf_llama
    from graphs import capture
    from graphs.units import GiB
    from solver.indexed import IndexedGraph
    from solver.methods.minpeak import min_peak_sequence, smallest_feasible_peak

    torch.set_num_threads(1)
    model, batch = hf_llama(n_layer=layers, **CONFIG)
    graph = capture(model, batch, backward="outputs")
    store_all = solver.simulate(graph, graph.order).peak_bytes
    half = store_all // 2
    smallest = None if min_peak_sequence(IndexedGraph.of(graph), half) is not None else \
        smallest_feasible_peak(graph, time_limit=60)[0]
    budget = max(half, smallest or 0)
    nodes = len(graph)
    del graph

    clock = _Clock()
    planning.capture_step = clock.wrap("capture", planning.capture_step)
    planning.solve = clock.wrap("solve", planning.solve)
    planning.plan_modules = clock.wrap("solve", planning.plan_modules)  # module mode's search
    planning.measure_within = clock.wrap("measure", planning.measure_within)
    # parts of the check: the rewrite (graph mode compiles the capture's joint export),
    # the gradient self-check, the measured peaks of real steps
    ScheduledStep.__init__ = clock.wrap("rewrite", ScheduledStep.__init__)
    planning.self_check = clock.wrap("self_check", planning.self_check)
    checks.measured_peak = clock.wrap("measured_peak", checks.measured_peak)
    planning.measured_peak = clock.wrap("measured_peak", planning.measured_peak)
    t0 = time.process_time()
    fast = solver.optimize(model, budget / GiB, batch, mode=mode)
    total = time.process_time() - t0
    report = getattr(fast, "report", None)
    cap, sol, meas = (clock.spent.get(k, 0.0) for k in ("capture", "solve", "measure"))
    queue.put(dict(model=f"hf-llama d{CONFIG['d']}", mode=mode, layers=layers, nodes=nodes, budget_bytes=int(budget),
                   store_all_bytes=int(store_all), smallest_feasible_bytes=smallest, capture_s=round(cap, 2), solve_s=round(sol, 2),
                   measure_s=round(meas, 2), check_s=round(total - cap - sol - meas, 2), total_s=round(total, 2),
                   check_parts={k: round(clock.spent.get(k, 0.0), 2) for k in ("rewrite", "self_check",
                                                                                 "measured_peak")},
                   method=getattr(report, "method", None), overhead=getattr(report, "predicted_overhead", None),
                   notes=list(getattr(report, "notes", [])), torch=torch.__version__))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--modes", nargs="+", default=["graph", "module"], choices=["graph", "module"])
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for mode in args.modes:
        for layers in args.layers:
            queue = ctx.Queue()
            proc = ctx.Process(target=_run, args=(layers, mode, queue))
            proc.start()
            rows.append(queue.get())
            proc.join()
            print(f"{mode} mode, {layers} layers: {rows[-1]['total_s']} s", file=sys.stderr)
    print("| model | mode | layers | capture s | measure s | solve s | check s | total s | extra compute |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = "" if r["overhead"] is None else f"+{100 * r['overhead']:.2f} %"
        print(f"| {r['model']} | {r['mode']} | {r['layers']} | {r['capture_s']:.2f} | {r['measure_s']:.2f} "
              f"| {r['solve_s']:.2f} | {r['check_s']:.2f} | {r['total_s']:.2f} | {extra} |")
    print()
    print("| mode | layers | check: rewrite s | self-check s | measured peaks s | rest s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        parts = r["check_parts"]
        rest = r["check_s"] - sum(parts.values())
        print(f"| {r['mode']} | {r['layers']} | {parts['rewrite']:.2f} | {parts['self_check']:.2f} "
              f"| {parts['measured_peak']:.2f} | {rest:.2f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(goal_s=GOAL_S, config=CONFIG, clock="process CPU time, 1 thread",
                                       rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The ``remat`` command line.

``remat methods``
    list the solver methods.
``remat estimate MODEL --gpu-gb G``
    will one training step fit: no remat, every layer checkpointed, the best policy.
``remat plan MODEL --gpu-gb G [--format hf|megatron|deepspeed|torchtitan|sac|json]``
    the per-layer policy (none / selective / full / offload), and its export.
``remat solve GRAPH.json --budget B``
    any method on a saved or benchmark graph; prints the schedule and its decisions.
``remat sweep GRAPH.json``
    budgets from the smallest feasible peak to store-all: the Pareto front of memory vs
    extra compute for chosen methods, as CSV/JSON and a PNG plot.
``remat show GRAPH.json --budget B --out schedule.png``
    a schedule as a picture: steps x values, computed / kept / freed / offloaded.

Budgets are bytes (``1.5e9``), units (``800MiB``, ``2GB``) or a fraction of the
store-all peak (``0.8x``). ``--json`` prints machine-readable output; errors are one line
on stderr and a non-zero exit status.

MODEL is an HF config name shipped with transformers (``gpt2``, ``llama``, ``mistral``...;
built from the config class defaults, nothing is downloaded) with overrides such as
``--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 --seq 4096
--micro-batch 1 --dtype bf16``, planned with the analytic model (``--captured`` builds the
model on the meta device and plans on its captured step instead); or
``path/to/file.py:factory``, a function returning a model or ``(model, example_inputs)``,
planned on its captured training step.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from typing import Sequence

__all__ = ["main", "parse_budget"]

_UNITS = {
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


class CLIError(Exception):
    """An error shown to the user as one line."""


def parse_budget(text: str, *, store_all_peak: float | None = None) -> int:
    """Parse ``1.5e9``, ``800MiB``, ``2GB`` or ``0.8x`` (a fraction of the store-all peak).

    Examples
    --------
    >>> parse_budget("2KiB")
    2048
    >>> parse_budget("0.5x", store_all_peak=1000)
    500
    """
    s = text.strip().lower().replace(" ", "")
    unreadable = f"cannot read budget {text!r}: use bytes, a unit (800MiB, 2GB) or a fraction like 0.8x"
    if s.endswith("x"):
        if store_all_peak is None:
            raise CLIError(f"budget {text!r} is relative but no store-all peak is known")
        if not re.fullmatch(r"[0-9.eE+-]+", s[:-1]):
            raise CLIError(unreadable)
        fraction = _finite(s[:-1], text, unreadable)
        if not fraction > 0:
            raise CLIError(f"budget {text!r}: give a fraction of the store-all peak above 0, like 0.8x")
        return int(fraction * store_all_peak)
    m = re.fullmatch(r"([0-9.eE+-]+)([a-z]*)", s)
    if not m or (m.group(2) and m.group(2) not in _UNITS):
        raise CLIError(unreadable)
    value = _finite(m.group(1), text, unreadable) * _UNITS.get(m.group(2) or "b", 1)
    if not math.isfinite(value):
        raise CLIError(f"budget {text!r} is too large: give a finite number of bytes")
    if not m.group(2) and 0 < value < 1:
        raise CLIError(f"budget {text!r} reads as {value:g} bytes: for a fraction of the store-all peak write "
                       f"{m.group(1)}x, for bytes a unit (800MiB, 2GB)")
    if not value > 0:
        raise CLIError(f"budget {text!r}: give a positive number of bytes, a unit (800MiB, 2GB) or a fraction "
                       f"like 0.8x")
    return int(value)


def _finite(number: str, text: str, unreadable: str) -> float:
    """``number`` as a finite float, or a :class:`CLIError` that quotes ``text``."""
    try:
        value = float(number)
    except ValueError:
        raise CLIError(unreadable) from None
    if not math.isfinite(value):
        raise CLIError(f"budget {text!r} is not finite: give bytes, a unit (800MiB, 2GB) or a fraction like 0.8x")
    return value


class Progress:
    """A minimal progress bar on stderr (silent when stderr is not a terminal or --json)."""

    def __init__(self, total: int, label: str, *, enabled: bool = True) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 28
        fill = int(width * self.done / max(1, self.total))
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(
            f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
            f"{elapsed:5.1f}s {note[:30]:<30}"
        )
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _load_graph(path: str):
    from graphs import ComputeGraph

    try:
        return ComputeGraph.load(path)
    except FileNotFoundError:
        raise CLIError(f"no such graph file: {path}") from None


def _store_all_peak(graph) -> int:
    from solver.simulate import simulate

    return simulate(graph, graph.order).peak_bytes


_OVERRIDES = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
              "ffn": "ffn_size", "vocab": "vocab_size"}
_HF_OVERRIDES = {"layers": ("num_hidden_layers", "n_layer", "num_layers"),
                 "hidden": ("hidden_size", "n_embd", "d_model"),
                 "heads": ("num_attention_heads", "n_head"),
                 "kv_heads": ("num_key_value_heads",),
                 "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
                 "vocab": ("vocab_size",)}


def _hf_config(name: str, args):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise CLIError("model names need transformers: pip install transformers") from None
    try:
        conf = AutoConfig.for_model(name)
    except (ValueError, KeyError):
        raise CLIError(f"unknown model {name!r}: use an HF config name shipped with transformers (gpt2, llama, "
                       "mistral, ...) or path/to/file.py:factory") from None
    for opt, attrs in _HF_OVERRIDES.items():
        val = getattr(args, opt, None)
        if val is None:
            continue
        hit = [a for a in attrs if hasattr(conf, a)]
        for a in hit or attrs[:1]:
            setattr(conf, a, int(val))
    if args.seq is not None:
        for a in ("max_position_embeddings", "n_positions"):
            if hasattr(conf, a) and (getattr(conf, a) or 0) < args.seq:
                setattr(conf, a, int(args.seq))
    conf.use_cache = False
    return conf


def _load_factory(spec: str):
    import importlib.util
    import os

    path, _, fn_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise CLIError(f"no such file: {path}")
    mod_spec = importlib.util.spec_from_file_location(f"_remat_user_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:
        raise CLIError(f"cannot import {path}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise CLIError(f"{path} has no function {fn_name!r}")
    try:
        got = fn()
    except Exception as exc:  # the user's code: its error, in one line
        raise CLIError(f"{spec} raised {type(exc).__name__}: {exc}") from None
    if isinstance(got, tuple) and len(got) == 2:
        return got
    return got, None


def _model_target(args) -> tuple:
    """(model_or_config, keyword arguments for policy/estimate)."""
    kw: dict = {"optimizer": args.optimizer}
    if args.hardware:
        kw["hardware"] = args.hardware
    if ":" in args.model and (args.model.split(":")[0].endswith(".py") or "/" in args.model):
        bar = Progress(1, "capture", enabled=not args.json)
        model, inputs = _load_factory(args.model)
        if inputs is None:
            kw.update(seq_len=args.seq, micro_batch=args.micro_batch)
        else:
            kw["example_inputs"] = inputs
        kw["_progress"] = bar
        return model, kw
    conf = _hf_config(args.model, args)
    if args.captured:
        from solver.join.models import META_DTYPES, meta_model

        if args.dtype is not None and args.dtype not in META_DTYPES:
            raise CLIError(f"--dtype {args.dtype!r}: use {', '.join(META_DTYPES)}")
        model = meta_model(conf, dtype=args.dtype)
        kw.update(seq_len=args.seq or 1024, micro_batch=args.micro_batch or 1)
        kw["_progress"] = Progress(1, "capture", enabled=not args.json)
        return model, kw
    from solver.analytic import as_config

    cfg = as_config(conf, seq_len=args.seq, micro_batch=args.micro_batch, dtype=args.dtype)
    over = {f: getattr(args, o) for o, f in _OVERRIDES.items() if getattr(args, o, None) is not None}
    if over:
        cfg = cfg.replace(**over)
    kw.update(tensor_parallel=args.tp if args.tp != 1 else None, pipeline_parallel=args.pp)
    return cfg, kw


def _gpu_gb(text: str) -> float:
    try:
        gb = float(str(text).lower().removesuffix("gib").removesuffix("gb"))
    except ValueError:
        raise CLIError(f"cannot read --gpu-gb {text!r}: give GiB of device memory, e.g. 80") from None
    if not gb > 0:
        raise CLIError(f"--gpu-gb must be positive, got {text!r}")
    return gb


def cmd_estimate(args) -> dict:
    from solver.estimate import estimate

    target, kw = _model_target(args)
    bar = kw.pop("_progress", None)
    est = estimate(target, _gpu_gb(args.gpu_gb), **kw)
    if bar is not None:
        bar.step("captured")
    if not args.json:
        print(est)
    return est.to_dict()


_EXPORTERS = {"hf": "to_hf", "megatron": "to_megatron", "deepspeed": "to_deepspeed", "torchtitan": "to_torchtitan",
              "sac": "to_torch_sac"}


def cmd_plan(args) -> dict:
    from solver import exporters
    from solver.policy import policy

    target, kw = _model_target(args)
    bar = kw.pop("_progress", None)
    pol = policy(target, _gpu_gb(args.gpu_gb), **kw)
    if bar is not None:
        bar.step("planned")
    out = {"policy": pol.to_dict()}
    exp = None
    if args.format and args.format != "json":
        exp = getattr(exporters, _EXPORTERS[args.format])(pol)
        cfg = exp.config
        if args.format == "sac":
            cfg = {k: v for k, v in cfg.items() if not callable(v)}
        out["export"] = {"target": exp.target, "config": cfg, "warnings": list(exp.warnings),
                         "expressed_peak_bytes": exp.expressed.peak_bytes, "fits": exp.fits}
    if not args.json:
        if args.format == "json":
            print(json.dumps(out, indent=2, default=str))
        else:
            print(pol)
            if exp is not None:
                if args.format == "torchtitan" and "toml" in exp.config:
                    print(exp.config["toml"])
                else:
                    print(json.dumps(out["export"]["config"], indent=2, default=str))
                for w in exp.warnings:
                    print(f"warning: {w}")
    return out


def cmd_methods(args) -> dict:
    from solver.solving import methods

    rows = [
        {"name": m.name, "family": m.family, "exact": m.exact, "order": m.order, "description": m.description}
        for m in methods().values()
    ]
    if not args.json:
        print(f"{'method':<18} {'family':<10} {'exact':<6} {'order':<6} description")
        for r in rows:
            print(f"{r['name']:<18} {r['family']:<10} {str(r['exact']):<6} {r['order']:<6} {r['description']}")
    return {"methods": rows}


def cmd_solve(args) -> dict:
    from solver.solving import solve

    graph = _load_graph(args.graph)
    peak = _store_all_peak(graph)
    budget = parse_budget(args.budget, store_all_peak=peak)
    options = {}
    if args.bandwidth is not None:
        options["bandwidth"] = args.bandwidth
    schedule = solve(graph, budget, method=args.method, time_limit=args.time_limit, **options)
    out = schedule.to_dict()
    out.update(graph=graph.name, store_all_peak=peak, overhead=schedule.overhead)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, default=str)
    if not args.json:
        print(schedule)
        print(f"store-all peak {peak} B; budget {budget} B ({budget / peak:.3f}x)")
        print(schedule.table(graph, limit=args.limit))
    return out


def cmd_sweep(args) -> dict:
    from solver.errors import InfeasibleBudget, NoScheduleFound, SolverError
    from solver.methods.minpeak import smallest_feasible_peak
    from solver.solving import get_method, solve

    methods = args.methods.split(",")
    for m in methods:
        get_method(m)  # an unknown name ends the command before any work, not as rows of errors
    graph = _load_graph(args.graph)
    peak = _store_all_peak(graph)
    low, _, _ = smallest_feasible_peak(graph)
    n = max(2, args.points)
    budgets = [int(low + (peak - low) * i / (n - 1)) for i in range(n)]
    bar = Progress(len(budgets) * len(methods), "sweep", enabled=not args.json)
    rows = []
    for m in methods:
        for b in budgets:
            row = {"method": m, "budget_bytes": b, "budget_fraction": b / peak}
            try:
                s = solve(graph, b, method=m, time_limit=args.time_limit)
                row.update(peak_bytes=s.peak_bytes, overhead=s.overhead, cost=s.cost,
                           gap=s.gap, solve_seconds=s.solve_seconds, status="ok")
            except (InfeasibleBudget, NoScheduleFound, SolverError) as exc:
                row.update(status=type(exc).__name__, error=str(exc).splitlines()[0])
            rows.append(row)
            bar.step(f"{m} {b / peak:.2f}x")
    result = {"graph": graph.name, "store_all_peak": peak, "smallest_feasible": low, "rows": rows}
    if args.csv:
        import csv

        keys = ["method", "budget_bytes", "budget_fraction", "status", "peak_bytes", "overhead", "gap", "solve_seconds"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, default=str)
    if args.png:
        _plot_sweep(result, args.png)
    if not args.json:
        print(f"{graph.name}: store-all peak {peak} B, smallest feasible {low} B ({low / peak:.3f}x)")
        print(f"{'method':<16} {'budget':>8} {'peak':>8} {'extra %':>9} {'gap':>8} {'time s':>8}")
        for r in rows:
            if r["status"] == "ok":
                gap = "-" if r["gap"] is None else f"{100 * r['gap']:.1f}%"
                print(f"{r['method']:<16} {r['budget_fraction']:>7.3f}x {r['peak_bytes'] / peak:>7.3f}x "
                      f"{100 * r['overhead']:>9.3f} {gap:>8} {r['solve_seconds']:>8.3f}")
            else:
                print(f"{r['method']:<16} {r['budget_fraction']:>7.3f}x {r['status']}")
    return result


def _plot_sweep(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    peak = result["store_all_peak"]
    for m in sorted({r["method"] for r in result["rows"]}):
        pts = [(r["peak_bytes"] / peak, 100 * r["overhead"]) for r in result["rows"]
               if r["method"] == m and r["status"] == "ok"]
        if pts:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.axvline(result["smallest_feasible"] / peak, color="grey", ls=":", label="smallest feasible")
    ax.set_xlabel("peak memory (x store-all)")
    ax.set_ylabel("extra compute (% of store-all)")
    ax.set_title(result["graph"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError('plots need matplotlib: pip install "remat[plot]"') from None
    return plt


def cmd_show(args) -> dict:
    from solver.solving import solve
    from solver.simulate import simulate

    graph = _load_graph(args.graph)
    peak = _store_all_peak(graph)
    budget = parse_budget(args.budget, store_all_peak=peak)
    schedule = solve(graph, budget, method=args.method, time_limit=args.time_limit)
    grid = schedule_grid(graph, schedule)
    sim = simulate(graph, schedule)
    if args.out:
        plt = _pyplot()
        import numpy as np

        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), gridspec_kw={"height_ratios": [4, 1]}, sharex=True)
        colors = np.array([[1, 1, 1], [0.85, 0.2, 0.2], [0.35, 0.55, 0.9], [0.95, 0.75, 0.2]])
        img = colors[np.array(grid["cells"], dtype=int).T]
        ax.imshow(img, aspect="auto", interpolation="nearest")
        ax.set_ylabel("value (reference order)")
        ax.set_title(f"{graph.name}: {schedule.method}, +{100 * schedule.overhead:.2f} % compute")
        ax2.plot(sim.memory_curve / peak)
        ax2.axhline(budget / peak, color="k", ls="--", lw=1)
        ax2.set_ylabel("memory (x store-all)")
        ax2.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)
        plt.close(fig)
    if not args.json:
        print(schedule)
        print("legend: # computed, | kept, o offloaded, . free")
        chars = ".#|o"
        for j, v in enumerate(grid["nodes"][: args.limit]):
            print(f"{str(v)[:16]:<16} " + "".join(chars[row[j]] for row in grid["cells"]))
    return {"schedule": schedule.to_dict(), "grid": grid, "png": args.out}


def schedule_grid(graph, schedule) -> dict:
    """Steps x values: 1 = computed at this step, 2 = kept (resident), 3 = offloaded, 0 = free."""
    nodes = list(graph.order)
    index = {v: j for j, v in enumerate(nodes)}
    seq = schedule.sequence
    ops = graph.ops_set
    last_use: dict[int, int] = {}
    current: dict = {}
    starts = []
    for t, v in enumerate(seq):
        for u in graph.nx.predecessors(v):
            if u in ops and u in current:
                last_use[current[u]] = t
        current[v] = len(starts)
        starts.append((t, v))
        last_use.setdefault(current[v], t)
    for v, k in current.items():
        if graph[v]["output"]:
            last_use[k] = len(seq) - 1
    cells = [[0] * len(nodes) for _ in seq]
    for k, (t0, v) in enumerate(starts):
        for t in range(t0, last_use[k] + 1):
            cells[t][index[v]] = 1 if t == t0 else max(cells[t][index[v]], 2)
    for off in schedule.offloads:
        for t in range(off.after + 2, off.before - 1):
            if cells[t][index[off.node]] == 2:
                cells[t][index[off.node]] = 3
    return {"nodes": [str(v) for v in nodes], "cells": cells}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat", description="Store, recompute or offload: training-step schedules under a memory budget.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, *, graph=True, budget=True):
        if graph:
            sp.add_argument("graph", help="a graph saved by remat or a public benchmark graph (JSON)")
        if budget:
            sp.add_argument("--budget", required=True, help="bytes, units (800MiB, 2GB) or a fraction of the store-all peak (0.8x)")
        sp.add_argument("--method", default="auto", help="solver method (see `remat methods`)")
        sp.add_argument("--time-limit", type=float, default=None, help="seconds for exact methods")
        sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    sp = sub.add_parser("methods", help="list the solver methods")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_methods)

    sp = sub.add_parser("solve", help="solve a graph under a budget")
    common(sp)
    sp.add_argument("--bandwidth", type=float, default=None, help="host link bytes per time unit (offload)")
    sp.add_argument("--out", help="write the schedule as JSON")
    sp.add_argument("--limit", type=int, default=30, help="rows of the decision table")
    sp.set_defaults(fn=cmd_solve)

    sp = sub.add_parser("sweep", help="Pareto front of memory vs extra compute")
    common(sp, budget=False)
    sp.add_argument("--methods", default="eviction,chen_sqrt,chain_dp", help="comma-separated methods")
    sp.add_argument("--points", type=int, default=8, help="budgets from the smallest feasible to store-all")
    sp.add_argument("--csv", help="write rows as CSV")
    sp.add_argument("--out", help="write JSON")
    sp.add_argument("--png", help="write a plot")
    sp.set_defaults(fn=cmd_sweep)

    sp = sub.add_parser("show", help="a schedule as a picture")
    common(sp)
    sp.add_argument("--out", help="PNG file to write")
    sp.add_argument("--limit", type=int, default=60, help="rows in the text view")
    sp.set_defaults(fn=cmd_show)

    def model_args(sp):
        sp.add_argument("model", help="HF config name (gpt2, llama, ...) or path/to/file.py:factory")
        sp.add_argument("--gpu-gb", required=True, help="device memory in GiB")
        for opt in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
            sp.add_argument(f"--{opt}", type=int, default=None, help=f"override the config's {opt}")
        sp.add_argument("--seq", type=int, default=None, help="sequence length")
        sp.add_argument("--micro-batch", type=int, default=None, help="micro-batch size")
        sp.add_argument("--dtype", default=None, help="bf16, fp16 or fp32")
        sp.add_argument("--tp", type=int, default=1, help="tensor parallel size (config models)")
        sp.add_argument("--pp", type=int, default=1, help="pipeline parallel size (config models)")
        sp.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, sgd_momentum or none")
        sp.add_argument("--hardware", default=None, help="a graphs.hardware preset (enables offload)")
        sp.add_argument("--captured", action="store_true",
                        help="HF name: build the model on the meta device and plan on its captured step")
        sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    sp = sub.add_parser("estimate", help="will a training step fit (no remat / full / best policy)")
    model_args(sp)
    sp.set_defaults(fn=cmd_estimate)

    sp = sub.add_parser("plan", help="per-layer policy and its export for a trainer")
    model_args(sp)
    sp.add_argument("--format", choices=["hf", "megatron", "deepspeed", "torchtitan", "sac", "json"], default=None,
                    help="export the policy for a trainer")
    sp.set_defaults(fn=cmd_plan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``remat`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from graphs.errors import RematError
    from solver.errors import InfeasibleBudget

    as_json = getattr(args, "json", False)
    try:
        try:
            if as_json:
                # stdout carries the JSON alone: whatever else writes to it (a native
                # library included) goes to stderr while the command runs
                from solver.lp_backend import stdout_to_stderr

                with stdout_to_stderr():
                    result = args.fn(args)
            else:
                result = args.fn(args)
        except (CLIError, RematError, ValueError, OSError, ImportError, TypeError, OverflowError) as exc:
            if isinstance(exc, BrokenPipeError):
                raise
            msg = " ".join(str(exc).split())
            if isinstance(exc, InfeasibleBudget) and _plain_number(getattr(args, "budget", None)):
                msg += f" (--budget {args.budget} is bytes; a fraction of the store-all peak is written {args.budget}x)"
            if as_json:
                print(json.dumps({"error": msg, "type": type(exc).__name__}))
            print(f"remat: error: {msg}", file=sys.stderr)
            return 2 if isinstance(exc, CLIError) else 1
        if as_json:
            print(json.dumps(result, default=str))
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader left (``remat sweep ... | head``): end quietly, as Unix tools do
        # when a write finds the pipe closed (killed by SIGPIPE: status 128 + 13), with
        # stdout pointed at nothing so that the flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13
    return 0


def _plain_number(text: str | None) -> bool:
    """Whether a ``--budget`` is a small number without a unit (a fraction meant as ``0.9x``?)."""
    try:
        return text is not None and 0 < float(text) <= 100
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())

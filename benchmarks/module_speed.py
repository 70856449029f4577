"""Module mode's step against checkpointing every block, at equal budget, on CPU.

For HF Llama and GPT-2 from configs (random weights), with labels (the model's own loss),
it measures side by side: the plain step, non-reentrant ``torch.utils.checkpoint`` around
every layer block (:func:`graphs.module_mode.layer_blocks`), and ``solver.optimize(...,
mode="module")`` at ``--fraction`` (default 0.7) of the plain step's allocator peak:

* the allocator's peak of one step (:func:`graphs.memory.measure_peak`, the CPU profiler);
* process CPU time of one training step (forward, loss, backward) on one thread, the
  median of ``--repeats`` after ``--warmup`` steps, the variants taking turns so that a
  change in the machine's load touches all of them alike;
* module mode's plan (an action per block) and the seconds it took, as ``optimize``
  plans it (priced with one block's measured seconds under each action:
  :func:`solver.join.planning.measure_blocks`) and priced from the graph alone (that
  measurement left out), with the seconds the measurement took.

Usage::

    python benchmarks/module_speed.py             # both models
    python benchmarks/module_speed.py --tiny      # a dry run of the script

Prints a table and writes ``benchmarks/results/module_speed.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _zoo(tiny: bool) -> dict:
    from examples import models

    if tiny:
        return {"hf_llama": lambda: models.hf_llama(n_layer=2, d=32, seq=16, batch=2),
                "hf_gpt2": lambda: models.hf_gpt2(n_layer=2, d=32, seq=16, batch=2)}
    # small layers, where Python's per-op overhead weighs most, and larger ones
    return {"hf_llama_d64": lambda: models.hf_llama(n_layer=4, d=64, seq=64, batch=4),
            "hf_gpt2_d64": lambda: models.hf_gpt2(n_layer=4, d=64, seq=64, batch=4),
            "hf_llama_d256": lambda: models.hf_llama(n_layer=4, d=256, n_head=4, seq=128, batch=4, vocab=1024),
            "hf_gpt2_d256": lambda: models.hf_gpt2(n_layer=4, d=256, n_head=4, seq=128, batch=4, vocab=1024)}


def _step(model: nn.Module, inputs: dict) -> None:
    model(**inputs).loss.backward()


def _peak(model: nn.Module, inputs: dict) -> int:
    from graphs.memory import measure_peak

    model.zero_grad(set_to_none=True)
    peak = measure_peak(_step, model, inputs, roots=[model]).peak_bytes
    model.zero_grad(set_to_none=True)
    return int(peak)


def _per_block_checkpoint(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with non-reentrant ``torch.utils.checkpoint`` on every block."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cuda_check import _per_block_checkpoint as wrap

    return wrap(model)


def _times(variants: dict, inputs: dict, *, warmup: int, repeats: int) -> dict:
    """Median process CPU seconds of one step per variant, taking turns."""
    for model in variants.values():
        for _ in range(warmup):
            _step(model, inputs)
            model.zero_grad(set_to_none=True)
    got: dict = {k: [] for k in variants}
    for _ in range(repeats):
        for name, model in variants.items():
            t = time.process_time()
            _step(model, inputs)
            got[name].append(time.process_time() - t)
            model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in got.items()}


def run(name: str, make, *, fraction: float, warmup: int, repeats: int) -> dict:
    import solver
    from graphs.units import GiB

    torch.manual_seed(0)
    model, inputs = make()
    model.train()
    plain = copy.deepcopy(model)
    per_block = _per_block_checkpoint(model)
    plain_peak = _peak(plain, inputs)
    budget = int(fraction * plain_peak)
    row = {"model": name, "fraction": fraction, "budget_bytes": budget, "plain_peak_bytes": plain_peak,
           "per_block_peak_bytes": _peak(per_block, inputs)}
    variants = {"plain": plain, "per_block": per_block}
    for variant, measuring in (("module_graph_priced", False), ("module", True)):
        t0 = time.perf_counter()
        try:
            with _block_seconds(measuring) as spent:
                fast = solver.optimize(copy.deepcopy(model), budget / GiB, inputs, mode="module")
                _step(fast, inputs)  # plans on its first step
            fast.zero_grad(set_to_none=True)
        except solver.InfeasibleBudget as exc:
            row.update(status="infeasible", smallest_feasible_bytes=exc.smallest_feasible_bytes)
            return row
        rep = fast.report
        if measuring:
            row["measure_blocks_seconds"] = sum(spent)
            row["measured_block_seconds"] = rep.schedule.info.get("measured")
        row.update({f"{variant}_plan_seconds": time.perf_counter() - t0,
                    f"{variant}_peak_bytes": _peak(fast, inputs),
                    f"{variant}_predicted_peak_bytes": rep.predicted_peak_bytes,
                    f"{variant}_actions": dict(getattr(fast.remat_steps[next(iter(fast.remat_steps))], "actions",
                                                       {}) or {})})
        variants[variant] = fast
    row["status"] = "planned"
    times = _times(variants, inputs, warmup=warmup, repeats=repeats)
    row.update({f"{k}_seconds": v for k, v in times.items()})
    for variant in ("module", "module_graph_priced"):
        row[f"{variant}_vs_per_block"] = times[variant] / times["per_block"]
    return row


class _block_seconds:
    """Inside, planning measures one block under each action as ``optimize`` does
    (``measuring``; the seconds each measurement took are appended to the list the
    block yields), or not at all (plans priced from the graph alone)."""

    def __init__(self, measuring: bool) -> None:
        self.measuring, self.spent = measuring, []

    def __enter__(self) -> list:
        import solver.join.planning as planning

        self.planning, self.real = planning, planning.measure_blocks

        def timed(*a, **k):
            if not self.measuring:
                return k["cap"]
            t0 = time.perf_counter()
            try:
                return self.real(*a, **k)
            finally:
                self.spent.append(time.perf_counter() - t0)

        planning.measure_blocks = timed
        return self.spent

    def __exit__(self, *exc) -> None:
        self.planning.measure_blocks = self.real


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fraction", type=float, default=0.7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="small shapes: a dry run of the script")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "module_speed.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, make in _zoo(args.tiny).items():
        row = run(name, make, fraction=args.fraction, warmup=args.warmup, repeats=args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    mib = 2**20
    head = "".join(f"{k:>16}" for k in ("plain", "per-block", "module", "graph-priced"))
    print(f"\n{'model':<14} {'budget':>8} {head}   module/per-block  (graph-priced)  plans")
    for r in rows:
        if r["status"] != "planned":
            print(f"{r['model']:<14} {r['budget_bytes'] / mib:7.1f}M  {r['status']}")
            continue
        cells = "".join(f"{r[k + '_peak_bytes'] / mib:7.1f}M {r[k + '_seconds']:6.3f}s"
                        for k in ("plain", "per_block", "module", "module_graph_priced"))
        plans = " | ".join(",".join(r[f"{v}_actions"].values()) for v in ("module", "module_graph_priced"))
        print(f"{r['model']:<14} {r['budget_bytes'] / mib:7.1f}M {cells}   {r['module_vs_per_block']:10.3f}x "
              f"{r['module_graph_priced_vs_per_block']:10.3f}x  {plans}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"fraction": args.fraction, "threads": 1, "clock": "process CPU time, median",
                   "repeats": args.repeats, "warmup": args.warmup, "tiny": args.tiny, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

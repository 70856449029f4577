"""Module mode's step against checkpointing every block, at equal budget, on CPU.

For HF Llama and GPT-2 from configs (random weights), with labels (the model's own loss),
it measures side by side: the plain step, non-reentrant ``torch.utils.checkpoint`` around
every layer block (:func:`graphs.module_mode.layer_blocks`), and ``solver.optimize(...,
mode="module")`` at ``--fraction`` (default 0.7) of the plain step's allocator peak:

* the allocator's peak of one step (:func:`graphs.memory.measure_peak`, the CPU profiler);
* process CPU time of one training step (forward, loss, backward) on one thread, the
  median of ``--repeats`` after ``--warmup`` steps, the variants taking turns so that a
  change in the machine's load touches all of them alike;
* module mode's plan (an action per block) and the seconds it took, priced from the
  graph alone and priced with one block's measured seconds under each action
  (:func:`graphs.module_mode.measure_block_actions` handed to
  :func:`solver.module_plan.plan_modules` as ``measured=``).

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
    for variant, measured in (("module", None), ("module_measured", _measured(model, inputs))):
        t0 = time.perf_counter()
        try:
            with _priced(measured):
                fast = solver.optimize(copy.deepcopy(model), budget / GiB, inputs, mode="module")
                _step(fast, inputs)  # plans on its first step
            fast.zero_grad(set_to_none=True)
        except solver.InfeasibleBudget as exc:
            row.update(status="infeasible", smallest_feasible_bytes=exc.smallest_feasible_bytes)
            return row
        rep = fast.report
        row.update({f"{variant}_plan_seconds": time.perf_counter() - t0,
                    f"{variant}_peak_bytes": _peak(fast, inputs),
                    f"{variant}_predicted_peak_bytes": rep.predicted_peak_bytes,
                    f"{variant}_actions": dict(getattr(fast.remat_steps[next(iter(fast.remat_steps))], "actions",
                                                       {}) or {})})
        variants[variant] = fast
    row["status"], row["measured_block_seconds"] = "planned", _measured(model, inputs)
    times = _times(variants, inputs, warmup=warmup, repeats=repeats)
    row.update({f"{k}_seconds": v for k, v in times.items()})
    for variant in ("module", "module_measured"):
        row[f"{variant}_vs_per_block"] = times[variant] / times["per_block"]
    return row


_MEASURED: dict = {}


def _measured(model: nn.Module, inputs: dict) -> dict:
    """Seconds of one middle block under each action (:func:`measure_block_actions`)."""
    from graphs.module_mode import layer_blocks, measure_block_actions

    key = id(model)
    if key not in _MEASURED:
        blocks = layer_blocks(model)
        _MEASURED[key] = measure_block_actions(model, (), inputs, block=blocks[len(blocks) // 2],
                                               actions=("none", "full", "save_matmuls"), repeats=5)
    return _MEASURED[key]


class _priced:
    """Module mode's plans priced with ``measured`` block seconds (``plan_modules``'s
    ``measured=``) for the length of the block; nothing with None."""

    def __init__(self, measured: dict | None) -> None:
        self.measured = measured

    def __enter__(self):
        import solver.planning as planning

        self.planning, self.real = planning, planning.plan_modules
        if self.measured is not None:
            planning.plan_modules = lambda *a, **k: self.real(*a, measured=self.measured, **k)

    def __exit__(self, *exc):
        self.planning.plan_modules = self.real


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
    head = "".join(f"{k:>16}" for k in ("plain", "per-block", "module", "module+measured"))
    print(f"\n{'model':<14} {'budget':>8} {head}   module/per-block  (+measured)  plans")
    for r in rows:
        if r["status"] != "planned":
            print(f"{r['model']:<14} {r['budget_bytes'] / mib:7.1f}M  {r['status']}")
            continue
        cells = "".join(f"{r[k + '_peak_bytes'] / mib:7.1f}M {r[k + '_seconds']:6.3f}s"
                        for k in ("plain", "per_block", "module", "module_measured"))
        plans = " | ".join(",".join(r[f"{v}_actions"].values()) for v in ("module", "module_measured"))
        print(f"{r['model']:<14} {r['budget_bytes'] / mib:7.1f}M {cells}   {r['module_vs_per_block']:10.3f}x "
              f"{r['module_measured_vs_per_block']:10.3f}x  {plans}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"fraction": args.fraction, "threads": 1, "clock": "process CPU time, median",
                   "repeats": args.repeats, "warmup": args.warmup, "tiny": args.tiny, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""remat's step against checkpointing every block, at budgets just above what that reaches.

On the per-block zoo (``tests/solver/test_per_block_zoo.py``: a GPT with cross-entropy
outside, a ``TransformerEncoderLayer`` stack with dropout, HF GPT-2 and Llama, a
torchvision-style ResNet18 and ``VisionTransformer``, a U-Net; random weights), for graph
and module mode, with CUDA's dispatch of dropout and attention emulated on the CPU and
without (``tests/emulation.py``, on the models it reaches), at 1.02x and 1.10x the
allocator's peak of one step with non-reentrant ``torch.utils.checkpoint`` around every
layer block, and for module mode also at 0.7 of the plain step's peak (``--plain-fractions``),
it measures side by side:

* the allocator's peak of one step of the plan (the returned module's own report, its
  first step) against the budget, the prediction and its error, and whether a plan
  was made again (by planning after a measured step, or by the watch after a real one);
* process CPU time of one training step (forward, loss, backward) on one thread, the
  median of ``--repeats`` after ``--warmup`` steps, the plain model, per-block
  checkpointing and remat's module taking turns so that a change in the machine's load
  touches all alike.

Usage::

    python benchmarks/per_block_speed.py                 # the whole zoo
    python benchmarks/per_block_speed.py --models hf_gpt2,resnet18 --modes module --emulation off
    python benchmarks/per_block_speed.py --tiny          # a dry run of the script

Prints a table and writes ``benchmarks/results/per_block_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def _zoo() -> dict:
    from tests.solver.test_per_block_zoo import ZOO

    return ZOO


def _loss(out, loss_fn):
    return out.loss if loss_fn is None else loss_fn(out)


def _step(model, args, kwargs, loss_fn) -> None:
    out = model(*args, **kwargs)
    _loss(out, loss_fn).backward()
    del out


def _plain_peak(model, args, kwargs, loss_fn) -> int:
    from graphs.memory import AllocatorPeak

    model.zero_grad(set_to_none=True)
    with AllocatorPeak(model, args, kwargs) as judge:
        _step(model, args, kwargs, loss_fn)
    model.zero_grad(set_to_none=True)
    return int(judge.peak_bytes)


def _times(variants: dict, args, kwargs, loss_fn, *, warmup: int, repeats: int) -> dict:
    """Median process CPU seconds of one step per variant, taking turns."""
    for model in variants.values():
        for _ in range(warmup):
            _step(model, args, kwargs, loss_fn)
            model.zero_grad(set_to_none=True)
    got: dict = {k: [] for k in variants}
    for _ in range(repeats):
        for name, model in variants.items():
            t = time.process_time()
            _step(model, args, kwargs, loss_fn)
            got[name].append(time.process_time() - t)
            model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in got.items()}


def run(name: str, mode: str, fraction: float, *, of: str = "per_block", emulate: bool = False, warmup: int,
        repeats: int) -> dict:
    """One case: ``fraction`` of the per-block (``of="per_block"``) or the plain step's
    (``of="plain"``) allocator peak as the budget, planned, its first step measured, then
    the plain model, per-block checkpointing and remat's module timed in turns."""
    from tests.emulation import cuda_dispatch

    with cuda_dispatch(emulate):
        return _run(name, mode, fraction, of=of, emulate=emulate, warmup=warmup, repeats=repeats)


def _run(name: str, mode: str, fraction: float, *, of: str, emulate: bool, warmup: int, repeats: int) -> dict:
    import copy

    import solver
    from graphs.units import GiB
    from tests.solver.test_per_block_zoo import planned_again_note, per_block_peak

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cuda_check import PEERS

    model, args, kwargs, loss_fn = _zoo()[name]()
    floor = per_block_peak(model, args, kwargs, loss_fn)
    plain_peak = _plain_peak(model, args, kwargs, loss_fn)
    budget = int(fraction * (floor if of == "per_block" else plain_peak))
    row = {"model": name, "mode": mode, "emulated": emulate, "of": of, "fraction": fraction, "budget_bytes": budget,
           "per_block_peak_bytes": floor, "plain_peak_bytes": plain_peak,
           # a budget below this peak is one checkpointing every block does not meet either
           "per_block_meets_budget": floor <= budget}
    plain, per_block = copy.deepcopy(model), PEERS["per_block"](model)
    t0 = time.perf_counter()
    try:
        fast = solver.optimize(model, budget / GiB, kwargs or args, mode=mode, loss_fn=loss_fn, measure_time=True)
    except solver.RematError as exc:
        row.update(status=type(exc).__name__, error=str(exc)[:300])
        return row
    row["plan_seconds"] = time.perf_counter() - t0
    opt = torch.optim.SGD(fast.parameters(), lr=0.0)
    _step(fast, args, kwargs, loss_fn)
    opt.step()  # ends the measurement of the first step
    opt.zero_grad(set_to_none=True)
    rep = fast.report
    row.update(status="planned", method=rep.method, predicted_peak_bytes=rep.predicted_peak_bytes,
               step_peak_bytes=rep.step_peak_bytes,
               fits=rep.step_peak_bytes is not None and rep.step_peak_bytes <= budget,
               prediction_error=(None if not rep.step_peak_bytes else
                                 (rep.predicted_peak_bytes - rep.step_peak_bytes) / rep.step_peak_bytes),
               # a plan made again: by the watch after a real step, or by planning after a measured one
               planned_again=any(planned_again_note(n) for n in rep.notes),
               notes=list(rep.notes))
    if mode == "module":
        row["module_plan"] = {k: str(v) for k, v in (getattr(fast, "remat_plan", None) or {}).items()}
    times = _times({"plain": plain, "per_block": per_block, "remat": fast}, args, kwargs, loss_fn,
                   warmup=warmup, repeats=repeats)
    row.update({f"{k}_seconds": v for k, v in times.items()})
    row["remat_vs_per_block"] = times["remat"] / times["per_block"]
    return row


def _cases(names, modes, fractions, plain_fractions, emulation):
    from tests.solver.test_per_block_zoo import EMULATED

    for name in names:
        for emulate in emulation:
            if emulate and name not in EMULATED:
                continue  # CUDA's dispatch changes none of its ops
            for mode in modes:
                for fraction in fractions:
                    yield name, mode, fraction, "per_block", emulate
            if "module" in modes:
                for fraction in plain_fractions:
                    yield name, "module", fraction, "plain", emulate


def _table(rows: list) -> str:
    kib = 1024
    lines = [f"{'model':<18} {'emul':<4} {'mode':<7} {'x':>9} {'budget':>9} {'step':>9} {'pred err':>8} "
             f"{'again':>5} {'plain s':>8} {'per-blk s':>9} {'remat s':>8} {'remat/pb':>8}"]
    for r in rows:
        x = f"{r['fraction']:.2f} {'pb' if r['of'] == 'per_block' else 'pl'}"
        head = (f"{r['model']:<18} {'on' if r['emulated'] else 'off':<4} {r['mode']:<7} {x:>9} "
                f"{r['budget_bytes'] / kib:8.1f}K")
        if r["status"] != "planned":
            meets = "meets" if r["per_block_meets_budget"] else "does not meet"
            lines.append(f"{head} {r['status']} (per-block checkpointing {meets} it): {r['error'][:60]}")
            continue
        err = "-" if r["prediction_error"] is None else f"{100 * r['prediction_error']:7.2f}%"
        lines.append(f"{head} {(r['step_peak_bytes'] or 0) / kib:8.1f}K {err:>8} "
                     f"{'yes' if r['planned_again'] else 'no':>5} {r['plain_seconds']:8.4f} "
                     f"{r['per_block_seconds']:9.4f} {r['remat_seconds']:8.4f} {r['remat_vs_per_block']:7.3f}x")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="comma-separated names of the zoo (default: all)")
    ap.add_argument("--modes", default="graph,module")
    ap.add_argument("--fractions", default="1.02,1.10", help="of per-block checkpointing's allocator peak")
    ap.add_argument("--plain-fractions", default="0.7", help="of the plain step's allocator peak (module mode only)")
    ap.add_argument("--emulation", default="off,on", help="CUDA's dispatch emulated: off, on or both")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tiny", action="store_true", help="one model, one mode, few steps: a dry run of the script")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "per_block_speed.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.models.split(",") if args.models else list(_zoo())
    modes, fractions = args.modes.split(","), [float(f) for f in args.fractions.split(",") if f]
    plain_fractions = [float(f) for f in args.plain_fractions.split(",") if f]
    emulation = [e == "on" for e in args.emulation.split(",")]
    if args.tiny:
        names, modes, fractions, plain_fractions, emulation = names[:1], modes[:1], fractions[:1], [], emulation[:1]
        args.warmup, args.repeats = 1, 3
    rows = []
    for name, mode, fraction, of, emulate in _cases(names, modes, fractions, plain_fractions, emulation):
        row = run(name, mode, fraction, of=of, emulate=emulate, warmup=args.warmup, repeats=args.repeats)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "notes"}), flush=True)
    print()
    print(_table(rows))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"threads": 1, "clock": "process CPU time, median", "repeats": args.repeats, "warmup": args.warmup,
                   "tiny": args.tiny, "device": "cpu", "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

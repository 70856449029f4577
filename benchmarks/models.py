"""Side by side on real models: remat against PyTorch's own ways of saving memory.

For a GPT-style model (8 layers, d=256, seq 256, batch 8), a ResNet-style CNN and a
U-Net-style model, at budgets of 100 %, 70 %, 50 % and 30 % of the store-all peak, every
variant is run in a fresh process and measured:

* step time: process CPU time of forward+backward with one thread, with glibc's default
  allocator settings (freed memory is reused, as a device's caching allocator does).
  The variant's process also builds a fresh copy of the plain model and steps the two in
  turn, 7 pairs after 2 warm-ups each: the ratio is the variant's median over the plain
  model's median, both measured under the same load of the shared machine (the ``eager``
  row is two copies of the plain model, so its ratio shows the noise). The same process
  reports the live-tensor tracker's peak (``graphs.memory.MemoryTracker``) for every
  variant whose tensors it sees.
* predicted (remat): the plan's peak, and its step-time ratio: the plain model's measured
  step plus the recomputation the plan predicts from capture's op timings,
  ``Report.predicted_step_ratio``. For ``remat_graph_inductor`` this is the eager
  plan's ratio; what inductor's fusion saves is not predicted.
* peak: measured in a second process, with glibc's mmap threshold fixed at 64 KiB so
  that freed tensors leave resident memory (which makes every allocation a page-fault
  cost, hence not the process that times): bytes of parameters, buffers and inputs
  (before the step) plus the growth of the peak resident memory during one step
  (``VmHWM`` reset through ``/proc/self/clear_refs``); this covers compiled code too.
  remat plans again in that process, so its plan can differ slightly from the timed one.
* planning time: capture + solve (remat) or compile (torch.compile).

Variants: ``eager`` (no checkpointing); ``ckpt_blocks`` (non-reentrant
``torch.utils.checkpoint`` on every block) eager and under ``torch.compile``;
``ckpt_sequential`` (``checkpoint_sequential`` with sqrt(L) segments, where the model is
a sequence of blocks); ``compile_budget`` (``torch.compile`` with
``torch._functorch.config.activation_memory_budget`` set to the budget's fraction);
``remat_graph`` and ``remat_module``; ``remat_graph_inductor`` (``solver.optimize(...,
compiler="inductor")``: the graph-mode plan, its forward and backward graphs compiled by
inductor in segments that keep to the budget). "fits" is judged by the allocator: the
peak of torch's CPU allocator during one step, from the profiler's allocation events
(``graphs.memory.AllocatorPeak``), plus parameters, buffers and inputs; it sees op
workspaces and compiled code alike. The live-tensor tracker's figure is given beside it
where it sees every tensor, for attribution.

Usage::

    python benchmarks/models.py                 # everything (compiles take minutes each)
    python benchmarks/models.py --quick         # no torch.compile variants
    python benchmarks/models.py --models gpt --fractions 0.5

Writes ``benchmarks/results/models.json`` and ``benchmarks/results/models.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {
    "gpt": "gpt(n_layer=8, d=256, n_head=8, seq=256, batch=8)",
    "resnet": "resnet(batch=16, width=32, size=64, blocks=4)",
    "unet": "unet(batch=8, width=16, size=128, depth=3)",
}
VARIANTS = ["eager", "ckpt_blocks", "ckpt_blocks_compile", "ckpt_sequential", "compile_budget",
            "remat_graph", "remat_graph_inductor", "remat_module"]
COMPILED = {"ckpt_blocks_compile", "compile_budget", "remat_graph_inductor"}
PER_BUDGET = {"compile_budget", "remat_graph", "remat_graph_inductor", "remat_module"}
#: timed steps of the variant, each next to one of the plain model
PAIRS = 7
#: compiled variants whose tensors the live-tensor tracker does not see
TRACKER_BLIND = {"ckpt_blocks_compile", "compile_budget"}


# ----------------------------------------------------------------------------- one run
def _rss_hwm() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _blocks(name, model):
    if name == "gpt":
        return list(model.blocks)
    if name == "resnet":
        return list(model.layers)
    return list(model.down) + [model.mid] + list(model.up)


def _wrap_checkpoint(blocks):
    import functools

    from torch.utils.checkpoint import checkpoint

    for b in blocks:
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)


def _sequential(name, model):
    import math as _m

    import torch
    from torch.utils.checkpoint import checkpoint_sequential

    class Seq(torch.nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.seq = torch.nn.Sequential(*blocks)

        def forward(self, x):
            return checkpoint_sequential(self.seq, max(1, round(_m.sqrt(len(self.seq)))), x, use_reentrant=False)

    if name == "gpt":
        model.blocks = torch.nn.ModuleList([Seq(list(model.blocks))])
        return True
    if name == "resnet":
        model.layers = Seq(list(model.layers))
        return True
    return False  # the U-Net's long skips make it no sequence of blocks


def run_one(model_name: str, variant: str, fraction: float | None, store_all: int | None,
            part: str = "time") -> dict:
    import torch

    torch.set_num_threads(1)
    from examples import models as zoo  # noqa: F401  (used by eval)
    from graphs.memory import AllocatorPeak, MemoryTracker
    from graphs.units import GiB

    model, inputs = eval(f"zoo.{MODELS[model_name]}")
    out: dict = {"model": model_name, "variant": variant, "fraction": fraction}
    t0 = time.perf_counter()
    step_model = model
    if variant == "eager":
        pass
    elif variant in ("ckpt_blocks", "ckpt_blocks_compile"):
        _wrap_checkpoint(_blocks(model_name, model))
        if variant == "ckpt_blocks_compile":
            step_model = torch.compile(model)
    elif variant == "ckpt_sequential":
        if not _sequential(model_name, model):
            return {**out, "status": "n/a"}
    elif variant == "compile_budget":
        from graphs.torch_internals import functorch_config

        functorch_config().activation_memory_budget = fraction
        step_model = torch.compile(model)
    elif variant.startswith("remat"):
        import solver

        mode = "module" if variant == "remat_module" else "graph"
        compiler = "inductor" if variant == "remat_graph_inductor" else "eager"
        try:
            step_model = solver.optimize(model, fraction * store_all / GiB, inputs, mode=mode, compiler=compiler)
        except solver.InfeasibleBudget as exc:
            return {**out, "status": "infeasible", "smallest_feasible": exc.smallest_feasible_bytes}
        rep = step_model.report
        out.update(predicted_peak=rep.predicted_peak_bytes, predicted_overhead=rep.predicted_overhead,
                   store_all_peak=rep.store_all_peak_bytes,
                   predicted_extra_s=rep.predicted_extra_seconds, method=rep.method, budget=rep.budget_bytes,
                   notes=list(rep.notes))

    from graphs.capture import default_loss

    def step():
        loss = default_loss(step_model(*inputs))
        loss.backward()
        for p in model.parameters():
            p.grad = None

    step()  # compiles / plans lazily where needed
    out["planning_s"] = time.perf_counter() - t0
    step()
    if part == "memory":  # baseline tensors + growth of the resident peak during one step
        with MemoryTracker(model, inputs) as tracker:
            pass
        baseline = tracker.baseline_bytes
        rss0, _ = _rss_hwm()
        _reset_hwm()
        loss = default_loss(step_model(*inputs))
        loss.backward()
        del loss
        _, hwm = _rss_hwm()
        out["peak"] = baseline + max(0, hwm - rss0)
        out["status"] = "ok"
        return out
    # side by side: a fresh copy of the plain model, stepped in turn with the variant, so
    # that both medians see the same state of the (shared) machine
    ref_model, ref_inputs = eval(f"zoo.{MODELS[model_name]}")

    def ref_step():
        default_loss(ref_model(*ref_inputs)).backward()
        for p in ref_model.parameters():
            p.grad = None

    for _ in range(2):
        ref_step()
    times, ref_times = [], []
    for _ in range(PAIRS):
        for fn, acc in ((ref_step, ref_times), (step, times)):
            c0 = time.process_time()
            fn()
            acc.append(time.process_time() - c0)
    del ref_model
    out["step_cpu_s"] = statistics.median(times)
    out["eager_step_cpu_s"] = statistics.median(ref_times)
    out["step_ratio"] = out["step_cpu_s"] / out["eager_step_cpu_s"]
    if out.get("predicted_extra_s") is not None:
        out["predicted_ratio"] = 1 + out["predicted_extra_s"] / out["eager_step_cpu_s"]
    with AllocatorPeak(model, inputs) as judge:  # the judge: every alloc and free of the allocator
        default_loss(step_model(*inputs)).backward()
    out["allocator_peak"] = judge.peak_bytes
    for p in model.parameters():
        p.grad = None
    if variant not in TRACKER_BLIND:
        with MemoryTracker(model, inputs) as tracker:
            default_loss(step_model(*inputs)).backward()
        out["tracker_peak"] = tracker.peak_bytes
        for p in model.parameters():
            p.grad = None
    out["status"] = "ok"
    return out


def store_all_peak(model_name: str) -> int:
    """The store-all peak as remat counts it (graph mode's ``report.store_all_peak_bytes``:
    the captured step plus the loss gradient's seed), so that the 100 % budget is one at
    which remat needs no recomputation."""
    import torch

    torch.set_num_threads(1)
    from examples import models as zoo  # noqa: F401  (used by eval)
    import solver

    model, inputs = eval(f"zoo.{MODELS[model_name]}")
    return solver.optimize(model, 1e6, inputs, measure_time=False).report.store_all_peak_bytes


# ----------------------------------------------------------------------------- driver
def _child(model_name, variant, fraction, store_all, timeout) -> dict:
    """One variant: timed in one fresh process, its resident peak measured in another."""
    out = {}
    for part in ("time", "memory"):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        if part == "memory":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        cmd = [sys.executable, __file__, "--one", model_name, variant, str(fraction), str(store_all), part]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"model": model_name, "variant": variant, "fraction": fraction, "status": "timeout"}
        row = next((json.loads(line) for line in reversed(res.stdout.splitlines()) if line.startswith("{")), None)
        if row is None:
            err = (res.stderr.strip().splitlines() or ["no output"])[-1]
            return {"model": model_name, "variant": variant, "fraction": fraction, "status": "error",
                    "error": err[:200]}
        if row.get("status") != "ok":
            return row
        if part == "time":
            out = row
        else:
            out["peak"] = row["peak"]
            if "predicted_peak" in row:
                out["memory_run_predicted_peak"] = row["predicted_peak"]
    return out


def _fmt(rows: list[dict], store: dict) -> str:
    lines = ["| model | budget | variant | allocator peak MiB | fits | resident MiB | step time vs eager | predicted "
             "| planning s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        frac = r.get("fraction")
        budget = None if frac is None else frac * store[r["model"]]
        if r.get("status") != "ok":
            note = r.get("status")
            if note == "infeasible":
                note += f" (smallest {r['smallest_feasible'] / 2**20:.1f} MiB)"
            lines.append(f"| {r['model']} | {'-' if frac is None else f'{frac:.0%}'} | {r['variant']} | {note} | | | | | |")
            continue
        measured = r["allocator_peak"]
        fits = "-" if budget is None else ("yes" if measured <= budget else "no")
        pred = ""
        if "predicted_peak" in r:
            pred = f"{r['predicted_peak'] / 2**20:.1f} MiB, {r.get('predicted_ratio', math.nan):.2f}x"
        lines.append(
            f"| {r['model']} | {'-' if frac is None else f'{frac:.0%}'} | {r['variant']} | "
            f"{r['allocator_peak'] / 2**20:.1f}"
            + (f" (tracker {r['tracker_peak'] / 2**20:.1f})" if "tracker_peak" in r else "")
            + f" | {fits} | {r['peak'] / 2**20:.1f} | {r['step_ratio']:.2f}x | {pred} | {r['planning_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=5, metavar=("MODEL", "VARIANT", "FRACTION", "STORE_ALL", "PART"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--fractions", default="1.0,0.7,0.5,0.3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "models"))
    args = ap.parse_args(argv)
    if args.one:
        m, v, f, s, part = args.one
        print(json.dumps(run_one(m, v, None if f == "None" else float(f), int(s), part)))
        return 0
    variants = [v for v in args.variants.split(",") if not (args.quick and v in COMPILED)]
    fractions = [float(x) for x in args.fractions.split(",")]
    rows, store = [], {}
    for m in args.models.split(","):
        store[m] = store_all_peak(m)
        print(f"{m}: store-all peak {store[m] / 2**20:.1f} MiB", flush=True)
        for v in variants:
            for f in (fractions if v in PER_BUDGET else [None]):
                r = _child(m, v, f, store[m], args.timeout)
                rows.append(r)
                print(f"  {v:<22} {'' if f is None else f'{f:.0%}':>4} {r.get('status')}"
                      + (f"  peak {r['peak'] / 2**20:.1f} MiB  step {r['step_cpu_s'] * 1e3:.0f} ms"
                         f"  plan {r['planning_s']:.1f} s" if r.get("status") == "ok" else ""), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump({"store_all_peak": store, "rows": rows}, fh, indent=1)
    table = _fmt(rows, store)
    with open(args.out + ".md", "w") as fh:
        fh.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

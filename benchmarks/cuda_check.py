"""On one CUDA GPU: does the real training step fit the budget, as the allocator counts it?

For a zoo of models trained as people train them (a CNN with BatchNorm and a transposed
convolution; a GPT-style LM and HF Llama with cross-entropy written outside the model; a
stack of torch's ``TransformerEncoderLayer`` with dropout; HF GPT-2 with labels), at 0.7,
0.5 and 0.3 of the plain step's allocator peak, in graph and module mode, it measures:

* ``torch.cuda.max_memory_allocated`` of one real step (forward, the user's loss,
  backward), after a reset, on the first and on the second step of the returned module
  (the first one plans when no example batch was given), next to the budget and the
  plan's prediction;
* the peak that ``optimize`` itself reached while planning;
* step time (CUDA events, median of 10 after 3 warm-ups) against the plain model and
  against non-reentrant ``torch.utils.checkpoint`` on every block.

Usage::

    python benchmarks/cuda_check.py              # the whole zoo (a few minutes on one GPU)
    python benchmarks/cuda_check.py --quick      # one model, 0.5 only

Prints a table and writes ``benchmarks/results/cuda_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

FRACTIONS = (0.7, 0.5, 0.3)
MODES = ("graph", "module")


def _zoo(device: str) -> dict:
    """name -> () -> (model, inputs, loss_of(output))."""
    from examples import models

    def cnn():
        model, inputs = models.unet(batch=32, width=32, size=128, depth=3)
        return model, inputs, lambda out: out.float().square().mean()

    def gpt_outside():
        model, (idx, targets) = models.gpt(n_layer=8, d=512, seq=512, batch=8, vocab=8192)
        head = model.head

        class Logits(nn.Module):  # the same model, returning logits: the loss is the caller's
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, idx):
                m = self.m
                pos = torch.arange(idx.shape[1], device=idx.device)
                x = m.drop(m.wte(idx) + m.wpe(pos))
                for block in m.blocks:
                    x = block(x)
                return head(m.ln(x))

        return Logits(), (idx,), lambda out: F.cross_entropy(out.flatten(0, 1), targets.to(out.device).flatten())

    def encoder():
        model, inputs = models.encoder_stack(layers=6, d=512, heads=8, seq=512, batch=16)
        return model, inputs, lambda out: out.float().square().mean()

    def hf_gpt2():
        model, inputs = models.hf_gpt2(n_layer=6, d=512, seq=512, batch=8)
        return model, inputs, lambda out: out.loss

    def llama_outside():
        model, inputs = models.hf_llama(n_layer=6, d=512, seq=512, batch=8)
        labels = inputs["labels"]
        return model, {"input_ids": inputs["input_ids"]}, \
            lambda out: F.cross_entropy(out.logits.float().flatten(0, 1), labels.to(out.logits.device).flatten())

    return {"cnn": cnn, "gpt_ce_outside": gpt_outside, "encoder": encoder, "hf_gpt2": hf_gpt2,
            "llama_ce_outside": llama_outside}


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _step(model, inputs, loss_of):
    loss = loss_of(_call(model, inputs))
    loss.backward()
    return loss


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _time(model, inputs, loss_of, *, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        _step(model, inputs, loss_of)
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(model, inputs, loss_of)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _per_block_checkpoint(model: nn.Module) -> nn.Module:
    from torch.utils.checkpoint import checkpoint

    from graphs.module_mode import layer_blocks

    wrapped = copy.deepcopy(model)
    for name in layer_blocks(wrapped):
        block = wrapped.get_submodule(name)
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    return wrapped


def run_case(name: str, make, frac: float, mode: str, device: str) -> dict:
    import solver
    from graphs.units import GiB

    torch.manual_seed(0)
    model, inputs, loss_of = make()
    model, inputs = model.to(device).train(), _to(inputs, device)
    base = copy.deepcopy(model)
    plain_peak = _peak(lambda: _step(base, inputs, loss_of))
    base.zero_grad(set_to_none=True)
    budget = int(frac * plain_peak)
    row = {"model": name, "fraction": frac, "mode": mode, "budget_bytes": budget, "plain_peak_bytes": plain_peak}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        fast = solver.optimize(model, budget / GiB, inputs, mode=mode, loss_fn=loss_of)
    except solver.InfeasibleBudget as exc:
        return {**row, "status": "infeasible", "smallest_feasible_bytes": exc.smallest_feasible_bytes}
    except Exception as exc:  # a failure is a finding: record it and go on
        return {**row, "status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    # planning's runs are each judged by the allocator's statistics, which every judge
    # resets: the highest of them is the report's (the copy kept for the baselines is
    # not in it)
    row["planning_peak_bytes"] = fast.report.planning_peak_bytes or torch.cuda.max_memory_allocated()
    row["predicted_peak_bytes"] = fast.report.predicted_peak_bytes
    row["first_step_peak_bytes"] = _peak(lambda: _step(fast, inputs, loss_of))
    fast.zero_grad(set_to_none=True)
    row["second_step_peak_bytes"] = _peak(lambda: _step(fast, inputs, loss_of))
    fast.zero_grad(set_to_none=True)
    plain_ms = _time(base, inputs, loss_of)
    ckpt = _per_block_checkpoint(base)
    row["ckpt_blocks_peak_bytes"] = _peak(lambda: _step(ckpt, inputs, loss_of))
    ckpt.zero_grad(set_to_none=True)
    row.update(step_ms=_time(fast, inputs, loss_of), plain_ms=plain_ms, ckpt_blocks_ms=_time(ckpt, inputs, loss_of))
    row["fits"] = max(row["first_step_peak_bytes"], row["second_step_peak_bytes"], row["planning_peak_bytes"]) <= budget
    row["status"] = "ok"
    return row


def _mib(b):
    return "" if b is None else f"{b / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | budget | mode | budget MiB | predicted | step 1 | step 2 | planning | fits | "
             "step vs plain | per-block ckpt (MiB, time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['fraction']:.0%} | {r['mode']} | {_mib(r['budget_bytes'])} | "
                         f"{r['status']} {_mib(r.get('smallest_feasible_bytes'))} | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['fraction']:.0%} | {r['mode']} | {_mib(r['budget_bytes'])} | "
            f"{_mib(r['predicted_peak_bytes'])} | {_mib(r['first_step_peak_bytes'])} | "
            f"{_mib(r['second_step_peak_bytes'])} | {_mib(r['planning_peak_bytes'])} | "
            f"{'yes' if r['fits'] else 'NO'} | {r['step_ms'] / r['plain_ms']:.2f}x | "
            f"{_mib(r['ckpt_blocks_peak_bytes'])}, {r['ckpt_blocks_ms'] / r['plain_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one model at 0.5, both modes")
    parser.add_argument("--models", default=None, help="comma-separated subset of the zoo")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cuda_check"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_check needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    zoo = _zoo("cuda")
    names = args.models.split(",") if args.models else (["encoder"] if args.quick else list(zoo))
    fractions = (0.5,) if args.quick else FRACTIONS
    rows = []
    for name in names:
        for frac in fractions:
            for mode in MODES:
                try:
                    row = run_case(name, zoo[name], frac, mode, "cuda")
                except Exception as exc:
                    traceback.print_exc()
                    row = {"model": name, "fraction": frac, "mode": mode, "budget_bytes": 0,
                           "status": f"error: {type(exc).__name__}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    md = f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + table(rows)
    print(md)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

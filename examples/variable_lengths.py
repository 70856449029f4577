"""Train an HF causal LM on batches whose sequence length varies, within a memory budget.

Builds a small Qwen2 from its config (random weights), measures the plain step's peak at
the longest length, and trains it with ``solver.optimize(model, budget)`` at half of that
peak, planned lazily on the first training call, while the lengths cycle as an unpadded
dataloader gives them. Each ``dynamic`` setting (as ``torch.compile``'s) trains a fresh
copy side by side with the plain model, and the table says how many plans were made and
how many of them captured the step, the time of the first step at each length (where
planning happens), the highest step peak the allocator measured against the budget, and
whether every loss equalled the plain model's.

Run: ``python examples/variable_lengths.py`` (about a minute on a laptop CPU);
``--quick`` trains fewer steps.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import solver  # noqa: E402
from graphs.memory import measure_peak, settle_open_judges  # noqa: E402
from graphs.units import GiB, format_bytes  # noqa: E402

LENGTHS = (96, 64, 128, 80, 112)


def qwen2():
    """A 4-layer Qwen2 with hidden size 128, random weights."""
    import transformers

    config = transformers.Qwen2Config(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                                      max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def batch(length: int, size: int = 8) -> dict:
    ids = torch.randint(0, 512, (size, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def train(dynamic, steps: int, budget: int) -> dict:
    """``steps`` steps of a fresh model planned with ``dynamic``, beside the plain model."""
    model = qwen2()
    plain = copy.deepcopy(model)
    fast = solver.optimize(model, budget / GiB, dynamic=dynamic)
    firsts, equal = {}, True
    for i in range(steps):
        length = LENGTHS[i % len(LENGTHS)]
        t = time.process_time()
        loss = fast(**batch(length)).loss
        loss.backward()
        firsts.setdefault(length, time.process_time() - t)
        want = plain(**batch(length)).loss
        want.backward()
        equal = equal and torch.equal(loss, want)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    settle_open_judges()  # the last step's measurement closes here
    steps_run = list(fast.remat_steps.values())
    reports = {id(s.report): s.report for s in steps_run}.values()  # sizes that share a plan share its report
    return dict(plans=len(reports), captures=sum(r.capture_seconds > 0 for r in reports),
                firsts=[round(firsts[n], 2) for n in LENGTHS if n in firsts],
                peak=max(p for s in steps_run for p in s.step_peaks), equal=equal)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one pass over the lengths")
    args = ap.parse_args(argv)
    steps = len(LENGTHS) if args.quick else args.steps
    torch.set_num_threads(1)
    model = qwen2()
    peak = measure_peak(lambda: model(**batch(max(LENGTHS))).loss.backward(), roots=[model]).peak_bytes
    budget = peak // 2
    print(f"plain step at length {max(LENGTHS)}: {format_bytes(peak)}; budget {format_bytes(budget)}; "
          f"{steps} steps over lengths {', '.join(map(str, LENGTHS))}\n")
    print("| dynamic | plans (captures) | first step at each length s | highest step peak / budget | losses equal |")
    print("|---|---|---|---|---|")
    for dynamic in (None, True, False):
        r = train(dynamic, steps, budget)
        print(f"| {dynamic} | {r['plans']} ({r['captures']}) | {', '.join(map(str, r['firsts']))} | "
              f"{r['peak'] / budget:.2f} | {r['equal']} |")


if __name__ == "__main__":
    main()

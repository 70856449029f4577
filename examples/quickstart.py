"""Fit a small GPT's training step into half of its memory.

Builds a GPT-style model from a config (random weights), captures one training step as a
cost-annotated DAG, asks remat for a budget of half its store-all peak, trains a few
steps with the rewritten module next to the original, and prints the plan with the
predicted and measured peak and the step time.

Run: ``python examples/quickstart.py`` (about a minute on a laptop CPU).
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import solver  # noqa: E402
from examples.models import gpt  # noqa: E402
from graphs import capture  # noqa: E402
from graphs.units import GiB, format_bytes  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model, batch = gpt(n_layer=4, d=128, n_head=4, seq=128, batch=8)  # forward returns the loss
    original = copy.deepcopy(model)

    graph = capture(model, batch, backward="outputs")
    print(graph.summary())
    store_all = solver.simulate(graph, graph.order).peak_bytes
    budget = store_all // 2
    print(f"\nstore-all peak of one step: {format_bytes(store_all)}; asking for {format_bytes(budget)}\n")

    fast = solver.optimize(model, budget / GiB, batch)
    report = solver.verify(fast, batch, original=original)

    opt_fast = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(original.parameters(), lr=1e-3)
    for step in range(3):
        torch.manual_seed(step)
        loss = fast(*batch)
        loss.backward()
        torch.manual_seed(step)
        ref = original(*batch)
        ref.backward()
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), original.parameters()))
        print(f"step {step}: loss {loss.item():.6f} (original {ref.item():.6f}), gradients identical: {same}")
        for opt in (opt_fast, opt_ref):
            opt.step()
            opt.zero_grad()
    print()
    print(report)


if __name__ == "__main__":
    main()

"""Gradients the parameters hold when a step starts (accumulation over micro-batches, or
``zero_grad(set_to_none=False)``) are memory of the step: a plan made while they are held
keeps room for them, and its measured step needs no second plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import solver
from examples import models
from graphs.memory import AllocatorPeak
from graphs.units import GiB


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "module"])
def test_a_plan_made_while_gradients_are_held_keeps_room_for_them(mode):
    model, (idx, targets) = models.gpt(n_layer=4, d=64, n_head=4, seq=64, batch=8, vocab=128)

    def loss_fn(out):
        return F.cross_entropy(out.flatten(0, 1), targets.flatten())

    with AllocatorPeak(model, (idx,)) as judge:  # the first step: no gradients yet
        loss_fn(model(idx)).backward()
    held = [p.grad.clone() for p in model.parameters()]  # a micro-batch's gradients, kept
    budget = 0.5 * judge.peak_bytes
    fast = solver.optimize(model, budget / GiB, (idx,), mode=mode, loss_fn=loss_fn)
    report = fast.report
    assert any("of gradients when planned" in n for n in report.notes), report.notes
    assert not any("more than its prediction" in n for n in report.notes), report.notes  # one plan fitted
    assert report.planning_peak_bytes <= budget, (report.planning_peak_bytes, budget)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), held))  # left as found
    loss_fn(fast(idx)).backward()  # the next micro-batch accumulates into them
    torch.optim.SGD(fast.parameters(), lr=0.0).step()  # ends the measured step
    assert fast.report.step_peak_bytes <= budget, (fast.report.step_peak_bytes, budget)
    assert not any("planned again" in n for n in fast.report.notes), fast.report.notes

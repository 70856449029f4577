"""The smallest feasible peak an infeasible budget names is one a training step
reaches: never above what one step of the plain model, or of the model with every
layer block under non-reentrant ``torch.utils.checkpoint``, measures by the allocator;
a call for that figure plans within it (planning's own runs included) and its real
step fits it.

Both are measured on CPU, whose allocator reports the bytes asked for (no rounding):
planning's measurement of a step and this file's measurement of the same step agree to
the byte, so the figures are compared exactly. Garbage of earlier steps is collected
before each measurement (its tensors freed inside a measured step would lower that
step's figure)."""

from __future__ import annotations

import gc

import pytest
import torch

import solver
from examples import models
from graphs.memory import AllocatorPeak
from graphs.units import GiB
from solver.errors import InfeasibleBudget
from tests.solver.test_per_block_zoo import ZOO, _loss, per_block_peak


def _tiny_llama():
    """An HF Llama so small that the plain step is its smallest peak (its parameters
    outweigh its activations), with buffers the step leaves alone (the rotary
    embedding's frequencies)."""
    model, inputs = models.hf_llama(n_layer=2, d=16, n_head=2, seq=8, batch=1, vocab=64)
    return model, (), inputs, None


CASES = {"hf_llama_tiny": _tiny_llama, "hf_llama": ZOO["hf_llama"], "hf_gpt2": ZOO["hf_gpt2"]}


def plain_peak(model, args, kwargs, loss_fn) -> int:
    """The allocator's peak of one training step of the model as it is, the loss
    included; the model is left as found."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    with AllocatorPeak(model, args, kwargs) as judge:
        out = model(*args, **kwargs)
        _loss(out, loss_fn).backward()
        del out
    model.zero_grad(set_to_none=True)
    return judge.peak_bytes


def _named(model, args, kwargs, loss_fn, mode) -> int:
    """The figure the refusal of a budget below every step names (a refusal before
    capture names what every step holds: asked for, the next refusal names a peak)."""
    budget = 1024
    for _ in range(3):
        try:
            solver.optimize(model, budget / GiB, kwargs or args, mode=mode, loss_fn=loss_fn, measure_time=False)
        except InfeasibleBudget as exc:
            if not isinstance(exc, solver.budget.BelowResident):
                return exc.smallest_feasible_bytes
            budget = exc.smallest_feasible_bytes
    raise AssertionError("no refusal named a smallest feasible peak")


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [("hf_llama_tiny", "graph"), ("hf_llama_tiny", "module"),
                                       ("hf_llama", "module"), ("hf_gpt2", "module")])
def test_the_smallest_peak_named_is_no_floors_and_planning_there_holds_it(name, mode):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = CASES[name]()
    plain = plain_peak(model, args, kwargs, loss_fn)
    gc.collect()
    floor = per_block_peak(model, args, kwargs, loss_fn)
    named = _named(model, args, kwargs, loss_fn, mode)
    assert named <= min(plain, floor), (named, plain, floor)
    fast = solver.optimize(model, named / GiB, kwargs or args, mode=mode, loss_fn=loss_fn, measure_time=False)
    assert fast.report.planning_peak_bytes <= named, (fast.report.planning_peak_bytes, named, fast.report.notes)
    opt = torch.optim.SGD(fast.parameters(), lr=0.0)
    out = fast(*args, **kwargs)
    _loss(out, loss_fn).backward()
    del out
    opt.step()  # ends the measurement of the step
    assert fast.report.step_peak_bytes <= named, (fast.report.step_peak_bytes, named)


@pytest.mark.parametrize("mode,kind", [("module", "floor"), ("graph", "smallest")])
def test_a_figure_named_is_met_by_the_plan_that_measured_it(monkeypatch, mode, kind):
    """Planning for a figure a refusal named runs that plan first: no plan that would
    measure over it runs (a module-mode plan with selective checkpointing can measure
    over its prediction; the timed search of graph mode, on a loaded machine, can find
    another schedule whose step measures a little over its simulation)."""
    import solver.join.checks as checks

    model, args, kwargs, loss_fn = _tiny_llama()
    named = _named(model, args, kwargs, loss_fn, mode)
    made = []
    real = checks._recipe_plan
    monkeypatch.setattr(checks, "_recipe_plan", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    fast = solver.optimize(model, named / GiB, kwargs, mode=mode, measure_time=False)
    assert made and made[0][0] == kind, made
    assert any("the plan that measured it" in n for n in fast.report.notes), fast.report.notes
    assert fast.report.checked_peak_bytes <= named
    assert fast.report.planning_peak_bytes <= named

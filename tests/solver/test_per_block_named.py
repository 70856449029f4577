"""The smallest feasible peak an infeasible budget names is one a training step reaches:
never above what one step of the plain model, or of the model with every layer block
under non-reentrant ``torch.utils.checkpoint``, measures by the allocator, and a call
for that figure plans a step that fits it.

Both are measured on CPU, whose allocator reports the bytes asked for (no rounding):
planning's measurement of a step and this file's measurement of the same step agree to
the byte, so the figures are compared exactly."""

from __future__ import annotations

import pytest

import solver
from examples import models
from graphs.memory import AllocatorPeak
from graphs.units import GiB
from solver.errors import InfeasibleBudget
from tests.solver.test_per_block_zoo import ZOO, _loss, first_step_report, per_block_peak


def _tiny_hf(make):
    """An HF model so small that the plain step is its smallest peak (its parameters
    outweigh its activations): where the plan of the smallest peak predicted measures
    above the plain step."""
    def build():
        model, inputs = make(n_layer=2, d=16, n_head=2, seq=8, batch=1, vocab=64)
        return model, (), inputs, None
    return build


CASES = {
    "hf_gpt2": ZOO["hf_gpt2"],
    "hf_llama": ZOO["hf_llama"],
    "hf_gpt2_tiny": _tiny_hf(models.hf_gpt2),
    "hf_llama_tiny": _tiny_hf(models.hf_llama),
    "resnet18": ZOO["resnet18"],
}


def plain_peak(model, args, kwargs, loss_fn) -> int:
    """The allocator's peak of one training step of the model as it is, the loss
    included; the model is left as found."""
    model.zero_grad(set_to_none=True)
    with AllocatorPeak(model, args, kwargs) as judge:
        out = model(*args, **kwargs)
        _loss(out, loss_fn).backward()
        del out
    model.zero_grad(set_to_none=True)
    return judge.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["graph", "module"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_smallest_peak_named_is_reached_by_a_step_and_planned(name, mode):
    model, args, kwargs, loss_fn = CASES[name]()
    plain = plain_peak(model, args, kwargs, loss_fn)
    floor = per_block_peak(model, args, kwargs, loss_fn)
    with pytest.raises(InfeasibleBudget) as info:
        solver.optimize(model, 1024 / GiB, kwargs or args, mode=mode, loss_fn=loss_fn, measure_time=False)
    named = info.value.smallest_feasible_bytes
    assert named <= min(plain, floor), (named, plain, floor, str(info.value))
    # the figure named is a budget that plans, and the real step fits it
    fast = solver.optimize(model, named / GiB, kwargs or args, mode=mode, loss_fn=loss_fn, measure_time=False)
    report = first_step_report(fast, args, kwargs, loss_fn)
    assert report.step_peak_bytes is not None
    assert report.step_peak_bytes <= named, (report.step_peak_bytes, named, report.notes)

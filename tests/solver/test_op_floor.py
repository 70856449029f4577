"""The largest op's footprint as a floor found before capture: a budget below what holds
while the forward's largest op runs is refused without capturing anything, and the
floor is sound: no real step, planned or plain, measures below it by the allocator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import solver
from examples import models
from graphs.capture import default_loss
from graphs.memory import measure_peak
from graphs.units import GiB
from solver.budget import OP_PART, BelowResident
from solver.join import planning
from solver.join.optimize_model import refuse_below_resident, resident_floor, step_floor


class Wide(nn.Module):
    """Few parameters, wide activations: the ReLU's input and output outweigh the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().mean()


def _step_peak(run, inputs) -> int:
    def step():
        out = run(**inputs) if isinstance(inputs, dict) else run(*inputs)
        default_loss(out).backward()

    peak = measure_peak(step, roots=[run, inputs]).peak_bytes
    for p in run.parameters():
        p.grad = None
    return int(peak)


def test_a_budget_below_the_largest_op_is_refused_before_capture(monkeypatch):
    started = []
    real = planning.capture_step
    monkeypatch.setattr(planning, "capture_step", lambda *a, **k: started.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(4096, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x_before, version = x.clone(), x._version
    floor, what = step_floor(model, (x,))
    assert floor > resident_floor(model, (x,))[0]
    with pytest.raises(BelowResident) as caught:
        solver.optimize(model, (floor - 1024) / GiB, (x,), measure_time=False)
    assert started == [] and "while that op runs" in str(caught.value) and caught.value.lower_bound_bytes == floor
    name, op_bytes = caught.value.parts[-1]
    assert name.startswith(OP_PART) and "aten.relu" in name and name in what
    assert op_bytes == 2 * 4096 * 64 * 4  # the ReLU's input and output
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(x, x_before) and x._version == version and model.training
    # a fusing compiler may never materialize the op's output: not refused on it
    refuse_below_resident(model, floor - 1024, (x,), eager_ops=False)
    # at the floor the capture runs
    try:
        solver.optimize(model, floor / GiB, (x,), measure_time=False)
    except solver.InfeasibleBudget as later:
        assert not isinstance(later, BelowResident) and later.smallest_feasible_bytes >= floor
    assert started


def _gpt():
    return models.gpt(n_layer=2, d=32, n_head=2, seq=64, batch=4, vocab=2048, dropout=0.0)


def _hf_gpt2():
    model, inputs = models.hf_gpt2(n_layer=2, d=32, n_head=2, seq=64, batch=4, vocab=2048)
    return model.train(), inputs


@pytest.mark.parametrize("make", [lambda: (Wide(), (torch.randn(4096, 16),)), _gpt,
                                  pytest.param(_hf_gpt2, marks=pytest.mark.slow)],
                         ids=["wide", "gpt", "hf_gpt2"])
def test_no_real_step_measures_below_the_op_floor(make):
    """The plain step and the lowest-memory plan remat makes, measured by the allocator,
    both at or above the floor named before capture."""
    torch.manual_seed(0)
    model, inputs = make()
    floor, what = step_floor(model, inputs)
    assert OP_PART in what  # the op's footprint outweighs the gradients in all three
    assert _step_peak(model, inputs) >= floor
    try:
        fast = solver.optimize(model, floor / GiB, inputs, measure_time=False, watch="off")
    except solver.InfeasibleBudget as refused:
        assert refused.smallest_feasible_bytes >= floor
        fast = solver.optimize(model, refused.smallest_feasible_bytes / GiB, inputs, measure_time=False,
                               watch="off")
    assert _step_peak(fast, inputs) >= floor


def test_a_model_holding_a_plain_tensor_attribute_is_not_copied_for_the_floor():
    """Copying such a model for its fake forward would allocate the tensor again: no op
    floor then, and the refusal falls back to what every step holds at its end."""
    from graphs.footprint import forward_footprint

    model, x = Wide(), torch.randn(4096, 16)
    model.scale = torch.ones(64)  # neither parameter nor buffer
    assert forward_footprint(model, (x,), {}) is None
    floor, what = step_floor(model, (x,))
    assert floor == resident_floor(model, (x,))[0] and OP_PART not in what
    del model.scale
    assert forward_footprint(model, (x,), {}) is not None


def test_the_floor_is_that_of_a_training_forward_and_leaves_the_model_as_found():
    from graphs.footprint import forward_footprint

    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    x = torch.randn(512, 16)
    model.eval()
    state = torch.get_rng_state()
    fp = forward_footprint(model, (x,), {})
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(state, torch.get_rng_state())  # no number drawn
    model.train()
    assert fp == forward_footprint(model, (x,), {})  # the dropout's ops counted in eval() too
    assert fp.largest_op_bytes >= 2 * 512 * 64 * 4


def test_without_a_fake_forward_the_real_one_runs_only_where_it_decides_the_refusal():
    class Counting(Wide):
        calls = 0

        def forward(self, x):
            type(self).calls += 1
            return super().forward(x)

    model, x = Counting(), torch.randn(64, 16)
    model.scale = torch.ones(4)  # no fake forward for this model
    refuse_below_resident(model, 1 << 30, (x,), eager_ops=True)
    assert Counting.calls == 0
    with pytest.raises(BelowResident):
        refuse_below_resident(model, resident_floor(model, (x,))[0] - 1, (x,), eager_ops=True)
    assert Counting.calls >= 1


@pytest.mark.parametrize("make", [lambda: (Wide(), (torch.randn(4096, 16),)), _hf_gpt2], ids=["wide", "hf_gpt2"])
def test_the_fake_forward_allocates_nothing_but_a_generator_state(make):
    """By the allocator: the floor's forward holds no activation of the model (its random
    generator is put back from a saved state, one CPU generator state of 5056 bytes, and
    a few bytes of bookkeeping: 5080 measured)."""
    from graphs.footprint import forward_footprint

    model, inputs = make()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    before = measure_peak(lambda: None, roots=[model, inputs]).peak_bytes
    fp = None

    def run():
        nonlocal fp
        fp = forward_footprint(model, args, kwargs)

    peak = measure_peak(run, roots=[model, inputs]).peak_bytes
    assert fp is not None and peak - before <= 8192 < fp.largest_op_bytes

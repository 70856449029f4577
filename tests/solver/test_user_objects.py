"""``optimize`` leaves the user's objects as it found them, whether it returns or raises:
the example inputs (values, ``.grad``, ``requires_grad``, version counter) and the model;
it refuses compiled modules and bad options before any work; and an infeasible budget is
explained by what is really held."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import solver
from graphs.units import GiB
from solver.errors import OptionError
from solver.join.optimize_model import step_floor


class Scaling(nn.Module):
    """Writes into its input in place before its layers."""

    def __init__(self, d: int = 32, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        x.mul_(2)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


class Plain(nn.Module):
    def __init__(self, d: int = 32, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _budget(model, x, tight):
    """A tight budget (a little over the smallest one an error names), or a roomy one."""
    if not tight:
        return 1.0 * GiB
    with pytest.raises(solver.InfeasibleBudget) as caught:
        solver.optimize(copy.deepcopy(model), _infeasible(model, x), (x.detach().clone(),), measure_time=False)
    return 1.02 * caught.value.smallest_feasible_bytes


def _infeasible(model, x):
    """A budget in GiB that planning finds infeasible after capturing the step: that of
    what every step holds whatever its schedule (below it, refused before capture)."""
    return step_floor(model, (x.detach().clone(),))[0] / GiB


def _state(x):
    return x.detach().clone(), x.grad, x.requires_grad, x._version


def _model_state(model):
    return [(name, sorted(m.__dict__), m.training, len(m._forward_hooks), len(m._forward_pre_hooks),
             len(m._backward_hooks)) for name, m in model.named_modules()]


def _same(x, state):
    values, grad, requires_grad, version = state
    return torch.equal(x.detach(), values) and x.grad is grad and x.requires_grad == requires_grad \
        and x._version == version


@pytest.mark.parametrize("tight", [True, False])
def test_an_input_the_model_writes_into_is_left_as_found(tight):
    torch.manual_seed(0)
    model, x = Scaling(), torch.randn(64, 32)
    model.layers[1].eval()
    model.register_forward_hook(lambda m, a, out: None)
    budget, low = _budget(model, x, tight), _infeasible(model, x)
    state, before = _state(x), _model_state(model)
    fast = solver.optimize(model, budget / GiB, (x,), measure_time=False)
    assert _same(x, state) and _model_state(model) == before
    with pytest.raises(solver.InfeasibleBudget):
        solver.optimize(model, low, (x,), measure_time=False)
    assert _same(x, state) and _model_state(model) == before
    # the real step still writes into its input, as the model does
    fast(x).backward()
    assert torch.equal(x, 2 * state[0])


@pytest.mark.parametrize("tight", [True, False])
def test_an_input_that_requires_a_gradient_gets_none_from_planning(tight):
    torch.manual_seed(0)
    model, x = Plain(), torch.randn(64, 32)
    budget, low = _budget(model, x, tight), _infeasible(model, x)
    x.requires_grad_()
    state = _state(x)
    solver.optimize(model, budget / GiB, (x,), measure_time=False)
    assert _same(x, state)
    with pytest.raises(solver.InfeasibleBudget):
        solver.optimize(model, low, (x,), measure_time=False)
    assert _same(x, state)


def test_a_compiled_module_is_refused_untouched():
    torch.manual_seed(0)
    model, x = Plain(), torch.randn(8, 32)
    compiled = torch.compile(model)
    before, before_compiled = _model_state(model), sorted(compiled.__dict__)
    with pytest.raises(OptionError, match="uncompiled model"):
        solver.optimize(compiled, 1.0, (x,), measure_time=False)
    assert _model_state(model) == before and sorted(compiled.__dict__) == before_compiled
    copy.deepcopy(model)  # a module optimize left alone copies
    fast = solver.optimize(model, 1.0, (x,), measure_time=False)  # and is not taken for one optimized already
    assert fast.report is not None


@pytest.mark.parametrize("options,match", [
    (dict(budget_gb="1.0"), "budget_gb"),
    (dict(budget_gb=True), "budget_gb"),
    (dict(budget_gb=math.nan), "budget_gb"),
    (dict(time_limit=-1.0), "time_limit"),
    (dict(time_limit=math.nan), "time_limit"),
    (dict(time_limit="5"), "time_limit"),
    (dict(gap_tolerance=1.5), "gap_tolerance"),
    (dict(blocks=["nonexistent"]), "nonexistent.*layers.0"),
    (dict(method="no_such_method"), "unknown method"),
    (dict(method="checkpoint_all", mode="module"), "mode='module'"),
    (dict(optimizer="adam"), "optimizer"),
    (dict(verify=True, example_inputs=None), "example_inputs"),
])
def test_bad_options_are_refused_before_any_work(monkeypatch, options, match):
    import solver.join.planning

    def no_work(*args, **kwargs):
        raise AssertionError("planning started")

    monkeypatch.setattr(solver.join.planning, "capture_step", no_work)
    monkeypatch.setattr(solver.join.planning, "plan_step", no_work)
    torch.manual_seed(0)
    model, x = Plain(), torch.randn(8, 32)
    args = dict(budget_gb=1.0, example_inputs=(x,), measure_time=False)
    args.update(options)
    with pytest.raises(OptionError, match=match):
        solver.optimize(model, **args)


def test_an_infeasible_budget_names_what_a_model_without_random_ops_holds():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from graphs.capture import capture

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, use_cache=False)
    model = Qwen2ForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 32))
    cg = capture(model, (), example_kwargs={"input_ids": ids, "labels": ids}, backward="outputs",
                 measure_time=False, measure_workspace=False)
    store_all = solver.simulate(cg, cg.order).peak_bytes
    with pytest.raises(solver.InfeasibleBudget) as caught:
        solver.solve(cg, int(0.1 * store_all), time_limit=5)
    message = str(caught.value)
    assert caught.value.held_bytes > 0, message  # the bound that holds values for later readers
    assert "dropout" not in message and "random op" not in message, message
    assert "the model's outputs, which the caller holds" in message, message

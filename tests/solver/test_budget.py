"""The budget of :func:`solver.optimize`: one :class:`solver.budget.Budget` read from the
options, a budget below what every step holds refused before anything is captured, and
``mode="auto"`` as the default's name."""

import dataclasses
import inspect
from collections import Counter

import pytest
import torch
from torch import nn

import solver
from graphs.units import GiB
from solver.join import planning
from solver.budget import BelowResident, Budget
from solver.errors import OptionError
from solver.join.optimize_model import resident_floor


#: forward calls per model (a count kept outside the model, which planning checks for changes)
CALLS: Counter = Counter()


class Counted(nn.Module):
    """Three linear layers that count their forward calls in :data:`CALLS`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))

    @property
    def calls(self) -> int:
        return CALLS[id(self)]

    def forward(self, x):
        CALLS[id(self)] += 1
        return self.net(x).square().mean()


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture
def no_capture(monkeypatch):
    """Every capture that planning starts, recorded (and run as it would be)."""
    started = []
    real = planning.capture_step

    def recorded(*args, **kwargs):
        started.append(kwargs.get("request"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "capture_step", recorded)
    return started


def _state(model, x):
    return ({k: v.clone() for k, v in model.state_dict().items()}, [p.grad for p in model.parameters()],
            sorted(model.__dict__), x.clone(), x._version)


def _same(before, after):
    (sd, grads, keys, x, version), (sd2, grads2, keys2, x2, version2) = before, after
    return (sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
            and all(g is None for g in grads + grads2) and keys == keys2 and torch.equal(x, x2) and version == version2)


def test_a_budget_below_parameters_and_inputs_is_refused_before_any_capture_or_forward(no_capture):
    torch.manual_seed(0)
    model, x = Counted(), torch.randn(16, 256)
    params = _bytes(model.parameters())
    before = _state(model, x)
    budget = params  # the parameters alone: the inputs and the gradients do not fit beside them
    with pytest.raises(solver.InfeasibleBudget) as caught:
        solver.optimize(model, budget / GiB, (x,), measure_time=False)
    assert isinstance(caught.value, BelowResident)
    assert no_capture == [] and model.calls == 0
    assert _same(before, _state(model, x))
    resident = params + _bytes([x])
    assert caught.value.lower_bound_bytes == resident and not caught.value.proven
    assert caught.value.parts == (("parameters and buffers", params), ("inputs", _bytes([x])))
    assert f"({resident} B)" in str(caught.value) and "checked before capture" in str(caught.value)


def test_a_budget_below_parameters_and_gradients_is_refused_before_capture_naming_the_figure(no_capture):
    torch.manual_seed(0)
    model, x = Counted(), torch.randn(16, 256)
    opt = torch.optim.Adam(model.parameters())
    floor, what = resident_floor(model, (x,), optimizer_bytes=solver.optimizer_state_bytes(opt, model))
    params = _bytes(model.parameters())
    assert floor == 4 * params + _bytes([x])  # parameters, their gradients, Adam's two moments
    before, CALLS[id(model)] = _state(model, x), 0
    with pytest.raises(solver.InfeasibleBudget) as caught:
        solver.optimize(model, (floor - 4096) / GiB, (x,), measure_time=False, optimizer=opt)
    assert no_capture == [] and model.calls <= 1  # at most one forward without gradients, finding what is read
    assert _same(before, _state(model, x))
    exc = caught.value
    assert exc.lower_bound_bytes == exc.smallest_feasible_bytes == floor
    message = str(exc)
    # the smallest budget that could work, in bytes and as budget_gb, and what it consists of
    assert f"({floor} B)" in message and f"budget_gb > {floor / GiB:.6g}" in message
    for name, part in exc.parts:
        assert name in message and part > 0
    assert [name for name, _ in exc.parts] == ["parameters and buffers", "optimizer state", "inputs",
                                               "the gradients of the parameters the forward reads"]
    assert "activation_budget=True" in message
    # the floor is a bound, not a peak: at the floor the capture names the smallest feasible peak above it
    with pytest.raises(solver.InfeasibleBudget) as caught:
        solver.optimize(model, floor / GiB, (x,), measure_time=False, optimizer=opt)
    assert not isinstance(caught.value, BelowResident) and caught.value.smallest_feasible_bytes > floor
    assert len(no_capture) == 1
    # an activation budget counts none of what every step holds
    fast = solver.optimize(model, 4 * floor / GiB, (x,), measure_time=False, activation_budget=True)
    assert len(no_capture) == 2 and no_capture[-1].activation_budget
    assert fast.report.activation_budget_bytes == int(4 * floor / GiB * GiB)


def test_a_budget_below_the_parameters_is_refused_at_optimize_without_example_inputs(no_capture):
    model = Counted()
    with pytest.raises(BelowResident, match="parameters and buffers"):
        solver.optimize(model, _bytes(model.parameters()) / 2 / GiB, measure_time=False)
    assert no_capture == [] and model.calls == 0


# ---------------------------------------------------------------- Budget


def test_budget_resolves_gib_and_is_frozen():
    b = Budget.from_gb(1.5, activation_only=True)
    assert (b.total_bytes, b.activation_only, b.held_back, b.available_bytes) == (3 * GiB // 2, True, 0, 3 * GiB // 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.total_bytes = 1
    held = b.holding_back(1000)
    assert held.available_bytes == b.total_bytes - 1000 and b.held_back == 0


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "1", True, None, 1e-12])
def test_budget_refuses_what_is_not_a_positive_number_of_gib(bad):
    with pytest.raises(OptionError, match="budget_gb must be a positive, finite number of GiB"):
        Budget.from_gb(bad)


@pytest.mark.parametrize("fields", [dict(total_bytes=10, held_back=10), dict(total_bytes=10, held_back=-1),
                                    dict(total_bytes=0), dict(total_bytes=2.5), dict(total_bytes=10,
                                                                                     activation_only=1)])
def test_budget_checks_its_fields(fields):
    with pytest.raises(OptionError):
        Budget(**fields)


def test_activation_budget_must_be_a_bool_in_optimize():
    with pytest.raises(OptionError, match="activation_budget must be True or False"):
        solver.optimize(Counted(), 1.0, measure_time=False, activation_budget="yes")


def test_refuse_below_compares_what_the_budget_covers():
    parts = [("parameters and buffers", 600), ("gradients", 600)]
    Budget(1200).refuse_below(parts)
    Budget(1, activation_only=True).refuse_below(parts)  # counts none of it
    with pytest.raises(BelowResident) as caught:
        Budget(1300, held_back=200).refuse_below(parts)  # what is held back is not for planning
    assert caught.value.budget_bytes == 1100 and caught.value.lower_bound_bytes == 1200


# ---------------------------------------------------------------- mode="auto"


def test_auto_is_the_default_mode_and_none_still_means_it():
    assert inspect.signature(solver.optimize).parameters["mode"].default == "auto"
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    for mode in ("auto", None):
        model = Counted()
        model.net[0].register_forward_hook(lambda m, args, out: None)  # graph mode would not run it
        fast = solver.optimize(model, 1.0, (x,), measure_time=False, mode=mode)
        assert fast.report.mode == "module"
        assert any("planned in module mode" in note for note in fast.report.notes)
    fast = solver.optimize(Counted(), 1.0, (x,), measure_time=False, mode="auto")
    assert fast.report.mode == "graph"


def test_an_unknown_mode_names_the_three():
    with pytest.raises(OptionError, match="mode must be one of 'auto', 'graph', 'module', got 'layer'"):
        solver.optimize(Counted(), 1.0, measure_time=False, mode="layer")


def test_offload_under_pinned_module_mode_suggests_auto():
    with pytest.raises(OptionError, match="mode='auto'"):
        solver.optimize(Counted(), 1.0, (torch.randn(4, 256),), measure_time=False, mode="module", offload=True)

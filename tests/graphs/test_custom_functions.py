"""Custom ``torch.autograd.Function``s: a trace of the forward keeps their forward's ops,
not their backward, so a planned step must run the model's own forward (module mode) or
refuse; its gradients are the plain model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import solver
from graphs import CaptureError
from graphs.capture import capture
from graphs.units import GiB
from solver.join.checks import measured_peak


class Times10(torch.autograd.Function):
    """Identity forward, gradient times ten."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 10


class StraightThrough(torch.autograd.Function):
    """Rounding forward, identity backward (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class GatedSaved(torch.autograd.Function):
    """``x * sigmoid(x)`` whose backward reads the saved gate only (drops its derivative)."""

    @staticmethod
    def forward(ctx, x):
        gate = torch.sigmoid(x)
        ctx.save_for_backward(gate)
        return x * gate

    @staticmethod
    def backward(ctx, g):
        (gate,) = ctx.saved_tensors
        return g * gate


FUNCTIONS = {"times10": Times10, "straight_through": StraightThrough, "save_for_backward": GatedSaved}


class Block(nn.Module):
    def __init__(self, width: int, fn: type | None):
        super().__init__()
        self.a, self.b, self.fn = nn.Linear(width, width), nn.Linear(width, width), fn

    def forward(self, h):
        z = torch.tanh(self.a(h))
        if self.fn is not None:
            z = self.fn.apply(z)
        return h + torch.tanh(self.b(z))


class Net(nn.Module):
    def __init__(self, fn: type | None, *, width: int = 64, depth: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, fn) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _model(fn: type | None) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Net(fn), (torch.randn(512, 64),)


def _grads(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(*inputs).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_capture_names_the_custom_functions_its_forward_calls():
    model, inputs = _model(Times10)
    cg = capture(model, inputs, backward="outputs", measure_time=False, measure_workspace=False)
    assert cg.capture_info.custom_functions == ("Times10",)
    assert cg.meta["custom_functions"] == ["Times10"]
    plain, inputs = _model(None)
    assert capture(plain, inputs, measure_time=False, measure_workspace=False).capture_info.custom_functions == ()


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_tight_plan_gives_the_gradients_of_the_functions_own_backward(name):
    model, inputs = _model(FUNCTIONS[name])
    expected = _grads(model, inputs)
    plain_peak = measured_peak(model, lambda: model(*inputs), inputs, {})
    fast = solver.optimize(model, 0.5 * plain_peak / GiB, inputs, measure_time=False)
    report = fast.report
    assert report.mode == "module", str(report)
    assert any(FUNCTIONS[name].__name__ in note and "custom autograd Functions" in note for note in report.notes)
    loss = fast(*inputs)
    loss.backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_graph_mode_pinned_refuses_a_step_it_would_differentiate_wrongly():
    model, inputs = _model(Times10)
    plain_peak = measured_peak(model, lambda: model(*inputs), inputs, {})
    with pytest.raises(CaptureError, match="Times10.*mode='module'"):
        solver.optimize(model, 0.5 * plain_peak / GiB, inputs, mode="graph", measure_time=False)
    assert all(p.grad is None for p in model.parameters())


def test_a_budget_that_fits_the_plain_step_runs_it_in_graph_mode():
    model, inputs = _model(Times10)
    expected = _grads(model, inputs)
    fast = solver.optimize(model, 1.0, inputs, mode="graph", measure_time=False)
    assert fast.report.mode == "graph"
    fast(*inputs).backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


class Flat(nn.Module):
    """No layer blocks: checkpointing them cannot make the gradient check's reference fit."""

    def __init__(self, fn: type, width: int = 256):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(64, width), nn.Linear(width, width), nn.Linear(width, width),
                                          nn.Linear(width, 1))
        self.fn = fn

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.d(torch.tanh(self.c(self.fn.apply(h)))).square().mean()


def test_the_self_check_compares_with_the_models_own_step_where_checkpointing_does_not_fit(monkeypatch):
    import contextlib

    import graphs.capture
    from solver.errors import SolverError

    # a capture that does not see the Function: the self-check alone stands between the
    # captured backward and the user
    monkeypatch.setattr(graphs.capture, "custom_functions_called", lambda model, found: contextlib.nullcontext())
    torch.manual_seed(0)
    model, inputs = Flat(Times10), (torch.randn(512, 64),)
    plain_peak = measured_peak(model, lambda: model(*inputs), inputs, {})
    with pytest.raises(SolverError, match="did not reproduce the model's loss and gradients"):
        solver.optimize(model, 0.8 * plain_peak / GiB, inputs, mode="graph", measure_time=False)


def test_the_offloaded_reference_gives_eager_gradients_in_less_memory():
    from solver.join.checks import reference_step

    torch.manual_seed(0)
    model, inputs = Flat(GatedSaved), (torch.randn(512, 64),)
    expected = _grads(model, inputs)
    plain_peak = measured_peak(model, lambda: model(*inputs), inputs, {})
    step = reference_step(model, offload=True)
    peak = measured_peak(model, lambda: step(model, inputs, {}), inputs, {})
    assert peak < 0.8 * plain_peak
    step(model, inputs, {}).backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)

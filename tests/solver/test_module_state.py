"""State a forward reads besides tensors (plain attributes, submodules), set on the
returned module after planning: its steps use the new state, never the captured one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import solver
from graphs.units import GiB
from solver.join.checks import measured_peak


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin, self.act = nn.Linear(width, width), nn.ReLU()

    def forward(self, x):
        return x + self.act(self.lin(x))


class Scaled(nn.Module):
    def __init__(self, width: int = 64, depth: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.scale = 2.0

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (x * self.scale).square().mean()


def _planned() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(512, 64)
    peak = measured_peak(model, lambda: model(x), (x,), {})
    fast = solver.optimize(model, 0.8 * peak / GiB, (x,), mode="graph", measure_time=False)
    assert fast.report.recomputed > 0, str(fast.report)  # the step runs a captured graph
    return model, fast, x


def _loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _check(fast: nn.Module, expected: nn.Module, x: torch.Tensor) -> None:
    with pytest.warns(UserWarning, match="changed since its step was captured"):
        loss, grads = _loss_and_grads(fast, x)
    want, want_grads = _loss_and_grads(expected, x)
    torch.testing.assert_close(loss, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_an_attribute_set_on_the_returned_module_is_read_by_its_steps(recwarn):
    model, fast, x = _planned()
    _loss_and_grads(fast, x)  # unchanged: the plan runs, without a word
    assert not [w for w in recwarn if "changed since" in str(w.message)]
    fast.scale = 3.0
    expected = copy.deepcopy(model)
    expected.scale = 3.0
    _check(fast, expected, x)


def test_a_submodule_swapped_after_planning_is_called_by_its_steps():
    model, fast, x = _planned()
    fast.blocks[3].act = nn.GELU()
    expected = copy.deepcopy(model)  # the swap is in the shared block, so the model has it too
    assert isinstance(expected.blocks[3].act, nn.GELU)
    _check(fast, expected, x)

"""Selective checkpointing replays random draws only in blocks that draw: a block without
random ops runs with torch's selective-checkpoint mode alone after its first step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphs.module_mode as module_mode
from graphs.module_mode import apply_module_plan


def _counted(monkeypatch) -> list:
    made = []
    real = module_mode._DrawReplay.mode

    def mode(self, *, recompute):
        made.append(recompute)
        return real(self, recompute=recompute)

    monkeypatch.setattr(module_mode._DrawReplay, "mode", mode)
    return made


def _step(model, x, seed):
    torch.manual_seed(seed)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def _modes_per_step(made: list, block, action: str) -> list[int]:
    """Replay modes made in each of three steps, the steps checked against eager."""
    torch.manual_seed(0)
    ref = nn.Sequential(block(), block(), nn.Linear(8, 1))
    net = copy.deepcopy(ref)
    wrapped = apply_module_plan(net, {"0": action, "1": action})
    x = torch.randn(4, 8)
    counts = []
    for step in range(3):
        before = len(made)
        assert torch.equal(_step(wrapped, x, step), _step(ref, x, step))
        for a, b in zip(net.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None
        counts.append(len(made) - before)
    return counts


@pytest.mark.parametrize("action", ["save_matmuls", "selective"])
def test_the_replay_runs_only_in_blocks_that_draw(monkeypatch, action):
    made = _counted(monkeypatch)
    plain = _modes_per_step(made, lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU()), action)
    assert plain[0] > 0 and plain[1:] == [0, 0]  # looked for on the first step only
    drawing = _modes_per_step(made, lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)),
                              action)
    assert all(n > 0 for n in drawing)  # installed on every step, and the draws are eager's



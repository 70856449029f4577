"""Module mode prices selective policies from a measured run of one block: a policy that
measures slower than checkpointing the block whole is not chosen over it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.models import gpt
from graphs.capture import capture
from graphs.module_mode import layer_blocks, measure_block_actions
from solver import simulate
from solver.module_plan import plan_modules


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model, args = gpt(n_layer=4, d=64, n_head=4, seq=64, batch=4)
    cg = capture(model, args, measure_time=False)
    return layer_blocks(model), cg


def test_measured_prices_choose_between_a_policy_and_the_whole_block(captured):
    blocks, cg = captured
    budget = int(0.95 * simulate(cg, cg.order).peak_bytes)
    graph_only = plan_modules(cg, budget, blocks=blocks)
    assert "save_matmuls" in graph_only.actions.values()  # the graph's op times alone favour it here
    slow = plan_modules(cg, budget, blocks=blocks, measured={"none": 1.0, "full": 2.0, "save_matmuls": 3.0})
    assert "save_matmuls" not in slow.actions.values()
    assert slow.schedule.peak_bytes <= budget
    cheap = plan_modules(cg, budget, blocks=blocks, measured={"none": 1.0, "full": 2.0, "save_matmuls": 1.1})
    assert cheap.actions == graph_only.actions
    assert cheap.schedule.info["priced_cost"] <= cheap.schedule.cost


def test_measure_block_actions_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU()), nn.Linear(8, 1))
    net.train()
    x = torch.randn(16, 8)
    stats = [b.clone() for b in net.buffers()]
    times = measure_block_actions(net, (x,), block="0", actions=("none", "full", "selective"), repeats=2)
    assert set(times) == {"none", "full", "selective"} and all(t > 0 for t in times.values())
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(stats, net.buffers()))
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(ValueError, match="did not run"):
        measure_block_actions(Skips(), (x,), block="unused")

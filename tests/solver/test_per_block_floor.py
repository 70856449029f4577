"""Checkpointing every layer block is a floor: the search starts from its schedule, and no
error names a smallest feasible peak above it (or above the plain step's)."""

from __future__ import annotations

import pytest
import torch

from solver.methods import minpeak
from solver import solving
from examples.models import gpt
from graphs.capture import capture
from graphs.module_mode import layer_blocks
from solver import simulate, solve
from solver.errors import InfeasibleBudget
from solver.feasibility import peak_lower_bound
from solver.methods.blocks import per_block_schedule
from solver.synthetic import training_chain


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model, args = gpt(n_layer=4, d=32, n_head=2, seq=16, batch=2)
    cg = capture(model, args, measure_time=False)
    return model, cg


def test_per_block_schedule_checkpoints_the_models_layers(captured):
    model, cg = captured
    sched = per_block_schedule(cg)
    assert sched.info["blocks"] == layer_blocks(model)
    r = simulate(cg, sched)
    assert r.valid and r.peak_bytes == sched.peak_bytes
    assert sched.peak_bytes < simulate(cg, cg.order).peak_bytes
    assert r.cost > r.base_cost  # the blocks' forwards run again


def test_auto_starts_from_per_block_and_meets_its_budget(captured):
    _, cg = captured
    floor = per_block_schedule(cg)
    s = solve(cg, floor.peak_bytes, method="auto", time_limit=2.0)
    assert s.peak_bytes <= floor.peak_bytes
    assert s.cost <= floor.cost + 1e-9
    assert s.info["auto"]["tried"]["per_block"] == pytest.approx(floor.cost)


def test_auto_takes_given_starts():
    g = training_chain(6, fwd_bytes=10)
    start = solve(g, 10**6, method="checkpoint_all")
    start.method = "mine"
    budget = start.peak_bytes
    s = solve(g, budget, method="auto", starts=[start], time_limit=1.0)
    assert "mine" in s.info["auto"]["tried"] and s.cost <= start.cost


@pytest.fixture
def slow_search(monkeypatch):
    """The figures' searches as a machine too slow to run them gets them: the low-memory
    orders' peak, no bisection; no chain segments."""
    real = minpeak.smallest_feasible_peak

    def weak(graph, *, time_limit=0.8):
        return real(graph, time_limit=0.0)

    monkeypatch.setattr(minpeak, "smallest_feasible_peak", weak)
    monkeypatch.setattr(solving, "CHAIN_SECONDS", 0.0)


def test_an_infeasible_budget_names_no_figure_above_per_block(captured, slow_search):
    _, cg = captured
    floor = min(per_block_schedule(cg).peak_bytes, simulate(cg, cg.order).peak_bytes)
    assert minpeak.smallest_feasible_peak(cg)[0] > floor  # the slow search alone names more
    lb = peak_lower_bound(cg)[0]
    with pytest.raises(InfeasibleBudget) as info:
        solve(cg, lb - 1, method="auto")
    assert lb <= info.value.smallest_feasible_bytes <= floor
    # a method that finds nothing between the bounds: the figure is a floor too
    with pytest.raises(InfeasibleBudget) as info:
        solve(cg, floor - 1, method="store_all")
    assert info.value.smallest_feasible_bytes <= floor

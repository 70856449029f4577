"""lp_eviction: valid, within the budget, in the reference order, and its bound holds."""

import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from solver import InfeasibleBudget, NoScheduleFound, simulate
from solver.bounds import stage_lp_bound, worst_step
from solver.indexed import IndexedGraph
from solver.methods.auto import _reorders
from solver.solving import get_method, solve
from solver.synthetic import budget_between, random_training_graph
from tests.solver.test_auto import captured_model


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 30), seed=st.integers(0, 10_000), frac=st.floats(0.2, 1))
def test_valid_within_budget_in_the_reference_order(n, seed, frac):
    g = random_training_graph(n, seed=seed)
    budget = budget_between(g, frac)
    try:
        s = solve(g, budget, method="lp_eviction", time_limit=5)
    except (NoScheduleFound, InfeasibleBudget):  # (none found, or proven not to exist)
        return
    r = simulate(g, s)
    assert r.valid and r.peak_bytes <= budget
    assert not _reorders(IndexedGraph.of(g), s.sequence)
    if s.lower_bound is not None:
        assert g.total("time") <= s.lower_bound <= r.cost * (1 + 1e-9)


def test_on_a_captured_gpt_it_is_no_worse_than_plain_eviction_and_carries_the_lp_bound():
    g = captured_model("gpt", n_layer=2, d=32, seq=16, batch=4)
    top = simulate(g, g.order).peak_bytes
    budget = int(0.85 * top)
    guided = solve(g, budget, method="lp_eviction", time_limit=20)
    plain = solve(g, budget, method="eviction")
    assert guided.cost <= plain.cost * (1 + 1e-9)
    assert guided.lower_bound == pytest.approx(stage_lp_bound(g, budget, boundaries=[worst_step(g, budget)]))


def test_keeps_its_time_limit():
    g = random_training_graph(400, seed=1)
    budget = budget_between(g, 0.4)
    t = time.perf_counter()
    try:
        get_method("lp_eviction").fn(g, budget, time_limit=1.0)
    except NoScheduleFound:
        pass
    assert time.perf_counter() - t <= 2.0

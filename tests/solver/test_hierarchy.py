"""Tests of coarsening and the hierarchical method."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.methods.bruteforce import brute_force
from solver.methods.hierarchy import coarsen, expand
from solver.synthetic import random_dag, training_chain


def _with_pointwise_runs():
    # a -> relu -> scale -> b, with b and a also read later: the middle run fuses
    g = ComputeGraph()
    for v, b in [("a", 8), ("relu", 8), ("scale", 8), ("b", 4), ("c", 2)]:
        g.add_node(v, bytes=b, time=1.0)
    for u, v in [("a", "relu"), ("relu", "scale"), ("scale", "b"), ("b", "c"), ("a", "c")]:
        g.add_edge(u, v)
    return g


def test_coarsen_fuses_linear_runs_and_expands_back():
    g = _with_pointwise_runs()
    c = coarsen(g)
    assert c.fused == 2
    assert c.members["b"] == ["relu", "scale", "b"]
    seq = expand(c, c.graph.order)
    assert sorted(seq) == sorted(g.order)
    r = solver.simulate(g, seq)
    assert r.valid
    # the coarse schedule never charges less than its expansion
    assert r.peak_bytes <= solver.simulate(c.graph, c.graph.order).peak_bytes
    assert r.cost == solver.simulate(c.graph, c.graph.order).cost


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 9), seed=st.integers(0, 10_000), p=st.floats(0.05, 0.5), frac=st.floats(0, 1))
def test_hierarchical_valid_within_budget(n, seed, p, frac):
    g = random_dag(n, seed=seed, p=p)
    c = coarsen(g)
    assert solver.simulate(g, expand(c, c.graph.order)).valid
    lb = solver.peak_lower_bound(g)[0]
    top = solver.simulate(g, g.order).peak_bytes
    budget = int(lb + frac * (top - lb))
    try:
        s = solver.solve(g, budget, method="hierarchical", time_limit=1)
    except (NoScheduleFound, InfeasibleBudget):  # (none found, or proven not to exist)
        return
    r = solver.simulate(g, s)
    assert r.valid and r.peak_bytes <= budget


@pytest.mark.parametrize("n,frac", [(3, 0.0), (3, 0.5), (4, 0.3), (4, 0.7)])
def test_optimal_on_small_training_chains(n, frac):
    g = training_chain(n, fwd_bytes=[3, 5, 2, 4][:n], fwd_time=[1.0, 3.0, 2.0, 1.0][:n])
    lb = solver.peak_lower_bound(g)[0]
    top = solver.simulate(g, g.order).peak_bytes
    budget = int(lb + frac * (top - lb))
    exact = brute_force(g, budget)
    s = solver.solve(g, budget, method="hierarchical", time_limit=5)
    assert s.cost == pytest.approx(solver.simulate(g, exact).cost)

"""Tests of the smallest feasible peak and of InfeasibleBudget."""


import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from graphs import ComputeGraph
from solver.methods.bruteforce import brute_force_min_peak
from solver.indexed import IndexedGraph
from solver.methods.minpeak import min_peak_sequence, smallest_feasible_peak
from tests.paths import BENCHMARK_GRAPHS, needs_benchmark_graphs
from solver.synthetic import random_training_graph, training_chain

BENCH = BENCHMARK_GRAPHS


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_found_is_reachable_and_bounded(n, seed):
    g = random_training_graph(n, seed=seed)
    found, lb, culprit = smallest_feasible_peak(g)
    assert lb == solver.peak_lower_bound(g)[0]
    assert lb <= found <= solver.simulate(g, g.order).peak_bytes
    best, _ = brute_force_min_peak(g)
    assert best <= found  # exhaustive search is the true minimum
    seq = min_peak_sequence(IndexedGraph.of(g), found)
    assert seq is not None


def test_below_bound_raises_with_achievable_smallest():
    g = training_chain(6, fwd_bytes=5)
    lb = solver.peak_lower_bound(g)[0]
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, lb - 1)
    exc = info.value
    assert exc.smallest_feasible_bytes >= lb
    assert str(exc.smallest_feasible_bytes) in str(exc)
    s = solver.solve(g, exc.smallest_feasible_bytes)
    assert s.peak_bytes <= exc.smallest_feasible_bytes


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_infeasible_budget_reports_achievable_budget(n, seed):
    g = random_training_graph(n, seed=seed)
    lb = solver.peak_lower_bound(g)[0]
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, lb - 1, time_limit=2)
    s = solver.solve(g, info.value.smallest_feasible_bytes, time_limit=2)
    assert solver.simulate(g, s).peak_bytes <= info.value.smallest_feasible_bytes


@needs_benchmark_graphs
def test_vgg16_smallest_peak_and_culprit():
    g = ComputeGraph.load(BENCH / "VGG16_256_224_224_3_train.json")
    top = solver.simulate(g, g.order).peak_bytes
    found, lb, culprit = smallest_feasible_peak(g)
    assert found == lb  # the footprint bound is reached
    assert 0.82 < found / top < 0.84
    assert culprit is not None
    inputs = sum(g[u]["bytes"] for u in g.op_preds(culprit))
    assert inputs + g[culprit]["bytes"] == lb - g.fixed_bytes
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, int(0.8 * top))
    assert info.value.smallest_feasible_bytes == found


def test_measuring_schedule_does_not_depend_on_the_search_time(monkeypatch):
    """The schedule planning measures a step in (``planning.lowest_peak_sequence``) stays
    within the margin of its target, or else within the target, when the timed
    lowest-peak search is cut short, as on a loaded machine: a search cut at once stops
    at the orders' own peak."""
    from solver.methods import minpeak
    from solver.planning import MEASURE_MARGIN, lowest_peak_sequence

    g = training_chain(24)
    store_all = solver.simulate(g, g.order).peak_bytes
    found = smallest_feasible_peak(g, time_limit=5.0)[0]
    cut = minpeak.smallest_feasible_peak
    monkeypatch.setattr(minpeak, "smallest_feasible_peak", lambda graph, **kw: cut(graph, time_limit=0.0))
    assert cut(g, time_limit=0.0)[0] > (found + store_all) // 2  # the cut search alone would not do
    roomy = int((found + store_all) / 2 / MEASURE_MARGIN)
    assert solver.simulate(g, lowest_peak_sequence(g, target=roomy)).peak_bytes <= MEASURE_MARGIN * roomy
    # at the smallest figure found, with no room for the margin: within the target itself
    assert solver.simulate(g, lowest_peak_sequence(g, target=found)).peak_bytes <= found


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000))
def test_the_relaxed_peak_bound_never_exceeds_the_smallest_peak(kind, size, seed):
    from solver.bounds import relaxed_peak_bound
    from solver.synthetic import small_graph

    g = small_graph(kind, size, seed)
    lb = solver.peak_lower_bound(g)[0]
    best, _ = brute_force_min_peak(g)
    upper = solver.simulate(g, g.order).peak_bytes
    assert lb <= relaxed_peak_bound(g, lower=lb, upper=upper, time_limit=5) <= best


def test_a_budget_the_relaxation_rules_out_is_proven_infeasible():
    # a graph where every op's own footprint allows 34 B, but no schedule in any order
    # peaks below 39 B: the order-free stage relaxation proves it, so asking for 38 B is
    # infeasible (not merely unreached), and the figures are exact
    from solver.bounds import relaxed_peak_bound
    from solver.errors import BudgetNotReached
    from solver.synthetic import small_graph

    g = small_graph(1, 6, 37)
    lb = solver.peak_lower_bound(g)[0]
    best, _ = brute_force_min_peak(g)
    assert lb < 38 < best == 39
    assert relaxed_peak_bound(g, lower=lb, upper=best) == best
    for method in ("auto", "eviction"):
        with pytest.raises(solver.InfeasibleBudget) as info:
            solver.solve(g, 38, method=method)
        exc = info.value
        assert not isinstance(exc, BudgetNotReached)
        assert exc.proven and exc.lower_bound_bytes == exc.smallest_feasible_bytes == best

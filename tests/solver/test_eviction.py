"""Tests of the eviction heuristic and the memory-aware order search."""


import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.methods.eviction import (
    SCORES,
    IndexedGraph,
    beam_order,
    evict_sequence,
    min_memory_order,
    order_peak,
)
from tests.paths import BENCHMARK_GRAPHS, needs_benchmark_graphs
from solver.synthetic import random_dag, random_training_graph, training_chain

BENCH = BENCHMARK_GRAPHS


def _budget(g, frac):
    lb = solver.peak_lower_bound(g)[0]
    top = solver.simulate(g, g.order).peak_bytes
    return int(lb + frac * (top - lb))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 7), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0), p=st.floats(0.1, 0.6))
def test_schedules_valid_and_within_budget(n, seed, frac, p):
    g = random_training_graph(n, seed=seed, p=p)
    budget = _budget(g, frac)
    for method in ("eviction", "order_search"):
        try:
            s = solver.solve(g, budget, method=method, time_limit=0.5)
        except (NoScheduleFound, InfeasibleBudget):  # (none found, or proven not to exist)
            continue
        r = solver.simulate(g, s)
        assert r.valid, r.error
        assert r.peak_bytes <= budget
        assert r.cost >= r.base_cost


@pytest.mark.parametrize("score", SCORES)
def test_every_score_fits_training_chain(score):
    g = training_chain(8, fwd_bytes=4)
    ix = IndexedGraph.of(g)
    budget = _budget(g, 0.3)
    seq = evict_sequence(ix, range(ix.n), budget, score=score)
    assert seq is not None
    r = solver.simulate(g, [ix.ids[i] for i in seq])
    assert r.valid and r.peak_bytes <= budget
    assert r.recomputations > 0  # 30 % of the way from the bound cannot store everything


def test_engine_gives_up_below_footprint():
    g = training_chain(5, fwd_bytes=4)
    ix = IndexedGraph.of(g)
    lb = solver.peak_lower_bound(g)[0]
    assert evict_sequence(ix, range(ix.n), lb - 1) is None


def test_order_peak_matches_simulator():
    for seed in range(10):
        g = random_dag(15, seed=seed)
        ix = IndexedGraph.of(g)
        for order in (list(range(ix.n)), min_memory_order(ix), beam_order(ix, width=8)):
            assert sorted(order) == list(range(ix.n))
            assert order_peak(ix, order) + ix.fixed == solver.simulate(g, [ix.ids[i] for i in order]).peak_bytes


def test_order_search_removes_recomputation_by_reordering():
    # two independent branches: running them one after the other halves the peak
    g = ComputeGraph()
    for b in "ab":
        g.add_node(f"{b}0", bytes=10, time=1.0)
        g.add_node(f"{b}1", bytes=1, time=1.0)
        g.add_edge(f"{b}0", f"{b}1")
    g.add_node("join", bytes=1, time=1.0)
    g.add_edge("a1", "join"); g.add_edge("b1", "join")
    g.order = ["a0", "b0", "a1", "b1", "join"]
    top = solver.simulate(g, g.order).peak_bytes
    s = solver.solve(g, top - 1, method="order_search", time_limit=1)
    assert s.cost == s.base_cost
    assert s.info["reordered"]


def test_order_search_no_worse_than_fixed_eviction():
    for seed in range(5):
        g = random_training_graph(8, seed=seed)
        budget = _budget(g, 0.4)
        try:
            fixed = solver.solve(g, budget, method="eviction")
        except NoScheduleFound:
            continue
        free = solver.solve(g, budget, method="order_search", time_limit=1)
        assert free.cost <= fixed.cost + 1e-9


def test_no_schedule_raises():
    g = training_chain(4, fwd_bytes=4)
    lb = solver.peak_lower_bound(g)[0]
    # between the footprint bound and nothing feasible for this engine: either fits or says so
    try:
        s = solver.solve(g, lb, method="eviction")
        assert s.peak_bytes <= lb
    except NoScheduleFound as exc:
        assert "order_search" in str(exc)


@needs_benchmark_graphs
def test_vgg16_at_090_within_budget():
    g = ComputeGraph.load(BENCH / "VGG16_256_224_224_3_train.json")
    budget = int(0.9 * solver.simulate(g, g.order).peak_bytes)
    s = solver.solve(g, budget, method="eviction")
    assert s.peak_bytes <= budget
    assert s.cost > s.base_cost  # the reference order alone does not fit
    assert s.info["order"] == "fixed"


def test_eviction_says_when_its_time_limit_cut_its_passes_short():
    from solver.methods.eviction import eviction

    g = training_chain(6)
    top = solver.simulate(g, g.order).peak_bytes
    assert eviction(g, top).info["complete"] is True
    # with no time at all only the first score's pass runs (it needs no eviction here)
    cut = eviction(g, top, time_limit=0)
    assert cut.info["complete"] is False
    assert solver.simulate(g, cut).peak_bytes <= top

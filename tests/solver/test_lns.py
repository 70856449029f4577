"""Tests of the large neighbourhood search over recomputations."""

import importlib
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.indexed import IndexedGraph
from solver.methods.bruteforce import brute_force
from solver.methods.eviction import eviction, min_memory_order
from solver.methods.lns import improve_sequence, lns, lp_starts
from solver.methods.staged import StagedPlan, relieve, staged_sequence
from solver.synthetic import budget_between, random_dag, random_training_graph, training_chain
from tests.solver.test_staged import _first_runs


@pytest.fixture(scope="module")
def monkeypatch_drift():
    """The search may take neighbours up to twice the cheapest schedule's extra compute."""
    module = importlib.import_module("solver.methods.lns")
    mp = pytest.MonkeyPatch()
    mp.setattr(module, "DRIFT", 1.0)
    yield
    mp.undo()


def _graph(n, seed, training):
    return random_training_graph(max(2, n // 2), seed=seed) if training else random_dag(n, seed=seed)


def _case(n, seed, frac, training, score):
    """A random graph, a budget and its eviction schedule with one score (None when
    eviction does not fit)."""
    g = _graph(n, seed, training)
    budget = budget_between(g, frac)
    try:
        return g, budget, eviction(g, budget, scores=(score,)).sequence
    except NoScheduleFound:
        return g, budget, None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 16), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0), training=st.booleans())
def test_the_search_keeps_a_schedule_valid_within_the_budget_and_never_costlier(n, seed, frac, training):
    _search_and_check(n, seed, frac, training)


def _search_and_check(n, seed, frac, training):
    """The search from LRU eviction's schedule: valid, within the budget, no costlier
    than its start, with the reference order of first runs."""
    g, budget, start = _case(n, seed, frac, training, "lru")
    if start is None:
        return
    out = improve_sequence(g, start, budget, deadline=time.perf_counter() + 0.05, seed=seed)
    r = solver.simulate(g, out)
    assert r.valid, r.error
    assert r.peak_bytes <= budget
    assert r.cost <= solver.simulate(g, start).cost * (1 + 1e-9)
    assert _first_runs(out) == list(g.order)  # the reference order of first runs is kept


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 8), seed=st.integers(0, 10_000), frac=st.floats(0.0, 0.9), training=st.booleans())
def test_lns_never_beats_the_exhaustive_optimum(n, seed, frac, training):
    g = _graph(n, seed, training)
    budget = budget_between(g, frac)
    try:
        s = lns(g, budget, time_limit=0.2, seed=seed)
    except NoScheduleFound:
        return
    r = solver.simulate(g, s)
    assert r.valid and r.peak_bytes <= budget
    try:
        best = solver.simulate(g, brute_force(g, budget).sequence).cost
    except InfeasibleBudget:
        raise AssertionError("lns fits a budget the exhaustive search calls infeasible")
    assert r.cost >= best * (1 - 1e-9)
    if s.lower_bound is not None:
        assert s.lower_bound <= r.cost * (1 + 1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(6, 16), seed=st.integers(0, 10_000), frac=st.floats(0.0, 0.8))
def test_a_search_that_drifts_far_still_returns_the_cheapest_schedule_it_saw(n, seed, frac, monkeypatch_drift):
    _search_and_check(n, seed, frac, True)


def test_the_search_finds_a_cheaper_schedule_than_its_start():
    # LRU eviction on a training chain recomputes more than the budget needs
    g = training_chain(10)
    budget = budget_between(g, 0.3)
    start = eviction(g, budget, scores=("lru",)).sequence
    out = improve_sequence(g, start, budget, deadline=time.perf_counter() + 1.0)
    assert solver.simulate(g, out).cost < solver.simulate(g, start).cost


def test_a_schedule_the_search_cannot_read_comes_back_as_it_is():
    g = training_chain(4)
    seq = list(g.order)
    over = improve_sequence(g, seq[:3] + seq[:3] + seq[3:], 1, deadline=time.perf_counter() + 1)
    assert over == seq[:3] + seq[:3] + seq[3:]  # over the budget: not a start
    invalid = seq[1:]
    assert improve_sequence(g, invalid, 10**9, deadline=time.perf_counter() + 1) == invalid


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 14), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0), training=st.booleans())
def test_a_plan_read_from_a_schedule_runs_it_again_at_no_more_than_its_memory(n, seed, frac, training):
    g, budget, seq = _case(n, seed, frac, training, "dtr")
    if seq is None:
        return
    ix = IndexedGraph.of(g)
    index = {v: i for i, v in enumerate(ix.ids)}
    plan = StagedPlan.of_sequence(ix, range(ix.n), [index[v] for v in seq])
    again = [ix.ids[i] for i in plan.sequence()]
    r, r0 = solver.simulate(g, again), solver.simulate(g, seq)
    assert r.valid, r.error
    assert r.cost <= r0.cost * (1 + 1e-9)  # one run per stage at most
    assert r.peak_bytes - ix.fixed <= int(plan.memory.max())  # the plan is conservative
    # relieving it to the budget keeps it valid and within the budget
    if relieve(plan, budget - ix.fixed):
        r2 = solver.simulate(g, [ix.ids[i] for i in plan.sequence()])
        assert r2.valid and r2.peak_bytes <= budget


def test_the_stage_lp_starts_fit_the_budget():
    for seed in range(4):
        g = random_training_graph(8, seed=seed)
        budget = budget_between(g, 0.5)
        found = list(lp_starts(g, budget, deadline=time.perf_counter() + 5))
        assert found
        for seq in found:
            r = solver.simulate(g, seq)
            assert r.valid and r.peak_bytes <= budget
            assert _first_runs(seq) == list(g.order)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 16), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0))
def test_the_search_keeps_another_order_of_first_runs(n, seed, frac):
    g = random_dag(n, seed=seed)
    budget = budget_between(g, frac)
    ix = IndexedGraph.of(g)
    order = min_memory_order(ix, tie="depth")
    seq = staged_sequence(ix, order, budget)
    if seq is None:
        return
    start = [ix.ids[i] for i in seq]
    out = improve_sequence(g, start, budget, deadline=time.perf_counter() + 0.05, seed=seed, ix=ix)
    r = solver.simulate(g, out)
    assert r.valid and r.peak_bytes <= budget
    assert r.cost <= solver.simulate(g, start).cost * (1 + 1e-9)
    assert _first_runs(out) == [ix.ids[i] for i in order]


def test_lns_keeps_its_time_limit():
    g = random_training_graph(150, seed=3)
    budget = int(0.9 * solver.simulate(g, g.order).peak_bytes)
    t0 = time.perf_counter()
    try:
        s = lns(g, budget, time_limit=1.0)
    except NoScheduleFound:  # a loaded machine may leave the starts too little time
        s = None
    assert time.perf_counter() - t0 <= 2.0  # the limit, with a second of slack
    if s is not None:
        r = solver.simulate(g, s)
        assert r.valid and r.peak_bytes <= budget

"""Tests of the covering MILP that picks what the backward keeps."""

from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.methods.bruteforce import brute_force
from solver.methods.cover import cover, cover_keep
from solver.plans import sequence_from_keep
from solver.synthetic import budget_between, random_training_graph, training_chain
from tests.solver.test_staged import _first_runs


def _saved(g):
    return {v for v in g.ops if g[v]["phase"] == "forward"
            and any(g[w]["phase"] == "backward" for w in g.op_succs(v))}


def test_keeps_everything_the_backward_reads_when_store_all_fits():
    g = training_chain(6)
    budget = solver.simulate(g, g.order).peak_bytes
    assert cover_keep(g, budget) == _saved(g)
    assert cover(g, budget).sequence == list(g.order)


def test_frees_the_values_whose_gaps_cover_the_excess():
    # store-all peaks at 8 B at the first backward op; 1 B over a budget of 7 B
    g = training_chain(6)
    keep = cover_keep(g, 7)
    assert keep < _saved(g)  # something goes
    r = solver.simulate(g, sequence_from_keep(g, keep))
    assert r.valid and r.peak_bytes <= 7
    assert r.cost - r.base_cost == 1.0  # one value of 1 s computed again covers it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 7), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0))
def test_a_cover_schedule_is_valid_within_the_budget_and_keeps_the_order(layers, seed, frac):
    g = random_training_graph(layers, seed=seed)
    budget = budget_between(g, frac)
    keep = cover_keep(g, budget)
    assert keep is None or keep <= _saved(g)
    try:
        s = cover(g, budget)
    except NoScheduleFound:
        return
    r = solver.simulate(g, s)
    assert r.valid, r.error
    assert r.peak_bytes <= budget
    assert _first_runs(s.sequence) == list(g.order)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 4), seed=st.integers(0, 10_000), frac=st.floats(0.0, 0.9))
def test_cover_never_beats_the_exhaustive_optimum(layers, seed, frac):
    g = random_training_graph(layers, seed=seed)
    if len(g.ops) > 9:
        return
    budget = budget_between(g, frac)
    try:
        s = cover(g, budget)
    except NoScheduleFound:
        return
    try:
        best = solver.simulate(g, brute_force(g, budget).sequence).cost
    except InfeasibleBudget:
        raise AssertionError("cover fits a budget the exhaustive search calls infeasible")
    assert solver.simulate(g, s).cost >= best * (1 - 1e-9)

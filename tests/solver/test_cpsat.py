"""CP-SAT with retention intervals against exhaustive search of the stage space."""

from __future__ import annotations


import pytest
from hypothesis import given, settings, strategies as st

from solver import NoScheduleFound, simulate, solve
from solver.feasibility import peak_lower_bound
from solver.methods.bruteforce import brute_force_fixed
from solver.methods.cpsat import cpsat
from solver.synthetic import budget_between, small_graph, training_chain


@settings(max_examples=40, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_cpsat_equals_brute_force_of_the_stage_space(kind, size, seed, frac):
    g = small_graph(kind, size, seed, inputs=False)
    budget = budget_between(g, frac)
    try:
        expected = brute_force_fixed(g, budget)
    except NoScheduleFound:
        with pytest.raises(NoScheduleFound):
            cpsat(g, budget)
        return
    s = solve(g, budget, method="cpsat")
    assert s.peak_bytes <= budget
    assert s.info["status"] == "optimal"
    assert s.cost == pytest.approx(simulate(g, expected.sequence).cost)
    assert s.gap == 0.0


@settings(max_examples=15, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(4, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_copy_limits_only_restrict_and_auto_growth_stays_valid(kind, size, seed, frac):
    g = small_graph(kind, size, seed, inputs=False)
    budget = budget_between(g, frac)
    try:
        full = cpsat(g, budget, copies=None)
    except NoScheduleFound:
        return
    full_cost = simulate(g, full.sequence).cost
    try:
        one = cpsat(g, budget, copies=1)
    except NoScheduleFound:
        one = None
    if one is not None:
        r = simulate(g, one.sequence)
        assert r.valid and r.peak_bytes <= budget and r.cost >= full_cost - 1e-9
        assert max(one.counts().values()) <= max(1, max(s for s in full.counts().values()))
    try:
        two = cpsat(g, budget, copies=2)
    except NoScheduleFound as exc:  # two copies of an op may not be enough at this budget
        assert "at most 2 computations" in str(exc)
        return
    r2 = simulate(g, two.sequence)
    assert r2.valid and r2.peak_bytes <= budget and r2.cost >= full_cost - 1e-9
    assert two.lower_bound <= full_cost + 1e-6


def test_a_node_recomputed_three_times_needs_more_than_two_copies():
    # a 4-layer chain with a tight budget: f0 must be recomputed for several backward steps
    g = training_chain(4, fwd_bytes=[1, 6, 6, 6], fwd_time=[1.0, 1.0, 1.0, 1.0])
    budget = peak_lower_bound(g)[0]
    exact = brute_force_fixed(g, budget)
    auto = solve(g, budget, method="cpsat")
    assert auto.cost == pytest.approx(simulate(g, exact.sequence).cost)
    capped = cpsat(g, budget, copies=2)
    assert simulate(g, capped.sequence).cost >= auto.cost - 1e-9

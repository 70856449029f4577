"""The Checkmate MILP against exhaustive search of the same (stage) space."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from solver import InfeasibleBudget, NoScheduleFound, simulate, solve
from solver.feasibility import peak_lower_bound
from solver.methods.bruteforce import brute_force_fixed
from solver.methods.milp import checkmate_milp, lower_bound, lp_lower_bound, stage_form
from solver.synthetic import budget_between, random_training_graph, small_graph, training_chain


@settings(max_examples=40, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_milp_equals_brute_force_of_the_stage_space(kind, size, seed, frac):
    g = small_graph(kind, size, seed)
    budget = budget_between(g, frac)
    try:
        expected = brute_force_fixed(g, budget)
    except NoScheduleFound:
        with pytest.raises(NoScheduleFound):
            checkmate_milp(g, budget)
        return
    s = solve(g, budget, method="checkmate_milp")  # graded by the simulator
    assert s.peak_bytes <= budget
    assert s.info["status"] == "optimal"
    assert s.cost == pytest.approx(simulate(g, expected.sequence).cost)
    assert s.cost == pytest.approx(s.info["objective"])  # the model's memory and cost are exact
    assert s.gap == 0.0
    assert stage_form(g, s.sequence) is not None
    lp = lp_lower_bound(g, budget)
    assert lp is not None and lp <= s.cost + 1e-6
    assert lower_bound(g, budget) <= s.cost + 1e-6


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 3), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_milp_equals_brute_force_on_heterogeneous_chains(n, seed, frac):
    rng = random.Random(seed)
    g = training_chain(n, fwd_bytes=[rng.randint(1, 20) for _ in range(n)],
                       fwd_time=[float(rng.randint(1, 9)) for _ in range(n)],
                       bwd_bytes=[rng.randint(1, 20) for _ in range(n)])
    budget = budget_between(g, frac)
    try:
        expected = brute_force_fixed(g, budget).lower_bound
    except NoScheduleFound:
        return
    assert checkmate_milp(g, budget).lower_bound == pytest.approx(expected)


def test_warm_start_and_time_limit_return_a_graded_schedule_with_a_bound():
    g = random_training_graph(6, seed=3)
    budget = budget_between(g, 0.5)
    hint = brute_force_fixed(g, budget).sequence if len(g.ops) <= 12 else None
    s = solve(g, budget, method="checkmate_milp", time_limit=5, hint=hint)
    assert s.peak_bytes <= budget
    assert s.lower_bound is not None and s.base_cost <= s.lower_bound <= s.cost + 1e-9


def test_stage_form_rejects_other_orders():
    g = training_chain(2)
    assert stage_form(g, ["f0", "f1", "loss", "b1", "b0"]) == [[0], [1], [2], [3], [4]]
    assert stage_form(g, ["f1", "f0", "loss", "b1", "b0"]) is None
    assert stage_form(g, ["f0", "f1", "loss", "f1", "f0", "b1", "b0"]) is None


def test_lp_bound_rises_under_a_tight_budget():
    g = training_chain(4, fwd_bytes=[5, 3, 8, 2])
    lo = peak_lower_bound(g)[0]
    assert lp_lower_bound(g, 10**6) == pytest.approx(g.total("time"))
    tight = lp_lower_bound(g, lo)
    assert tight is not None and tight > g.total("time")
    assert tight <= simulate(g, checkmate_milp(g, lo).sequence).cost + 1e-6


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 5), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_milp_and_chain_dp_agree_on_chains(n, seed, frac):
    rng = random.Random(seed)
    g = training_chain(n, fwd_bytes=[rng.randint(1, 20) for _ in range(n)],
                       fwd_time=[float(rng.randint(1, 9)) for _ in range(n)],
                       bwd_bytes=[rng.randint(1, 20) for _ in range(n)])
    budget = budget_between(g, frac)
    try:
        milp = solve(g, budget, method="checkmate_milp")
    except (NoScheduleFound, InfeasibleBudget):  # nothing in the stage space fits: the DP must agree
        with pytest.raises((NoScheduleFound, InfeasibleBudget)):
            solve(g, budget, method="chain_dp")
        return
    dp = solve(g, budget, method="chain_dp")
    assert milp.cost == pytest.approx(dp.cost)


def _run_graph():
    """``a`` feeds the two projections of one op; their reader ``c`` reads both. The
    second projection needs 10 B of workspace alone, none when it continues the run."""
    from graphs import ComputeGraph

    g = ComputeGraph()
    g.add_node("a", bytes=1, time=1.0)
    for k in range(2):
        g.add_node(f"p{k}", bytes=1, time=1.0, group="op", group_index=k, group_time=2.0,
                   workspace=10 * k, run_workspace=0)
        g.add_edge("a", f"p{k}")
    g.add_node("c", bytes=1, time=1.0)
    g.add_edge("p0", "c")
    g.add_edge("p1", "c")
    return g


def test_bounds_charge_a_projection_the_workspace_of_the_run_it_continues():
    from solver.methods.milp import stage_end_lower_bound

    g = _run_graph()
    r = simulate(g, g.order)  # p1 continues p0's run: no workspace
    assert r.valid and r.peak_bytes == 3
    assert stage_end_lower_bound(g, r.peak_bytes) <= r.cost
    assert lp_lower_bound(g, r.peak_bytes) <= r.cost

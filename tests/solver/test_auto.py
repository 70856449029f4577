"""Tests of method="auto"."""

from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from solver.errors import NoScheduleFound
from solver.synthetic import random_training_graph, training_chain


def test_store_all_when_it_fits():
    g = training_chain(5)
    top = solver.simulate(g, g.order).peak_bytes
    s = solver.solve(g, top)
    assert s.method == "auto:store_all"
    assert s.cost == s.base_cost
    assert s.gap == 0.0
    assert "fits" in s.info["auto"]["why"]


def test_records_choice_and_candidates():
    g = training_chain(8, fwd_bytes=4)
    lb = solver.peak_lower_bound(g)[0]
    top = solver.simulate(g, g.order).peak_bytes
    s = solver.solve(g, (lb + top) // 2, time_limit=3)
    rec = s.info["auto"]
    assert s.method == f"auto:{rec['picked']}"
    assert rec["picked"] in rec["tried"]
    costs = [c for c in rec["tried"].values() if isinstance(c, float)]
    assert s.cost == min(costs)  # the cheapest candidate wins
    assert s.peak_bytes <= (lb + top) // 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 6), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0))
def test_auto_valid_within_budget(n, seed, frac):
    g = random_training_graph(n, seed=seed)
    lb = solver.peak_lower_bound(g)[0]
    top = solver.simulate(g, g.order).peak_bytes
    budget = int(lb + frac * (top - lb))
    try:
        s = solver.solve(g, budget, time_limit=1)
    except NoScheduleFound:
        from solver.methods.bruteforce import brute_force_min_peak

        assert brute_force_min_peak(g)[0] > budget  # only when nothing fits
        return
    r = solver.simulate(g, s)
    assert r.valid and r.peak_bytes <= budget

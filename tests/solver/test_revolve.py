"""Griewank's binomial checkpointing against an independent brute force."""

from __future__ import annotations

import math
from functools import lru_cache

import pytest

from solver import NoScheduleFound, simulate, solve
from solver.feasibility import peak_lower_bound
from solver.methods.revolve import beta, forward_steps, repetition_number, revolve_actions
from solver.synthetic import training_chain


@lru_cache(maxsize=None)
def brute(l: int, c: int) -> float:
    """Least forward steps to reverse l uniform steps with c slots: try every first snapshot."""
    if l == 1:
        return 0
    if c == 0:
        return math.inf
    if c == 1:
        return (l - 1) + brute(l - 1, 1)
    return min(j + brute(l - j, c - 1) + brute(j, c) for j in range(1, l))


@pytest.mark.parametrize("c", range(1, 6))
def test_closed_form_matches_brute_force(c):
    for l in range(1, 40):
        assert forward_steps(l, c) == brute(l, c), (l, c)


def test_closed_form_matches_the_paper_formula():
    # t(l, c) = r l - beta(c + 1, r - 1) with beta(c, r - 1) < l <= beta(c, r)
    for c in range(1, 5):
        for l in range(2, 60):
            r = repetition_number(l, c)
            assert beta(c, r - 1) < l <= beta(c, r)
            assert forward_steps(l, c) == r * l - math.comb(c + r, c + 1)
    assert forward_steps(5, 1) == 10  # one slot: 4 + 3 + 2 + 1


@pytest.mark.parametrize("l,c", [(1, 1), (2, 1), (7, 2), (10, 3), (20, 3), (33, 4)])
def test_actions_reach_the_optimum_and_reverse_every_step(l, c):
    steps, actions = revolve_actions(l, c)
    assert steps == forward_steps(l, c)
    reversed_steps = [a[1] for a in actions if a[0] == "reverse"]
    assert reversed_steps == list(reversed(range(l)))
    # replay: slot use never exceeds c, states are advanced from something stored
    stored = {0}
    state = 0
    for a in actions:
        if a[0] == "advance":
            assert a[1] == state or a[1] in stored
            state = a[2]
        elif a[0] == "snapshot":
            stored.add(a[1])
            assert len(stored) <= c
        elif a[0] == "free":
            stored.discard(a[1])
        elif a[0] == "reverse":
            assert a[1] == state or a[1] in stored
            state = a[1]


def test_revolve_method_is_valid_and_fits():
    g = training_chain(12)
    lo = peak_lower_bound(g)[0]
    hi = simulate(g, g.order).peak_bytes
    last = math.inf
    for b in range(lo, hi + 1):
        try:
            s = solve(g, b, method="revolve")
        except NoScheduleFound:
            continue
        assert s.peak_bytes <= b
        assert s.cost <= last + 1e-9
        last = s.cost
    assert last < math.inf


def test_revolve_uses_griewank_count_on_uniform_chain():
    g = training_chain(8, fwd_time=1.0, bwd_time=2.0)
    s = solve(g, 10**6, method="revolve", slots=2)
    # 8 forward stages (f0..f6, then f7+loss); every stage also runs once when reversed
    fwd_runs = sum(1 for v in s.sequence if v.startswith("f"))
    assert s.info["forward_steps"] == forward_steps(8, 2)
    assert fwd_runs == forward_steps(8, 2) + 8

"""Exhaustive search against plain enumeration of sequences graded by the simulator."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from graphs import ComputeGraph
from solver import InfeasibleBudget, NoScheduleFound, SolverError, simulate
from solver.feasibility import peak_lower_bound
from solver.methods.bruteforce import brute_force, brute_force_fixed, brute_force_min_peak
from solver.synthetic import budget_between, random_dag, small_graph, training_chain


def stage_sequences(g: ComputeGraph):
    """Every sequence of the Checkmate stage space (all subsets of earlier ops per stage)."""
    ops = g.order
    choices = [list(itertools.product((0, 1), repeat=t)) for t in range(len(ops))]
    for picks in itertools.product(*choices):
        seq = []
        for t, pick in enumerate(picks):
            seq += [ops[i] for i in range(t) if pick[i]]
            seq.append(ops[t])
        yield seq


def best_of(g, seqs, budget):
    best = None
    for seq in seqs:
        r = simulate(g, seq)
        if r.valid and r.peak_bytes <= budget and (best is None or r.cost < best):
            best = r.cost
    return best


@settings(max_examples=40, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(2, 5), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_fixed_matches_enumeration_of_the_stage_space(kind, size, seed, frac):
    g = small_graph(kind, size, seed, outputs=False, inputs=False)
    budget = budget_between(g, frac)
    expected = best_of(g, stage_sequences(g), budget)
    if expected is None:
        with pytest.raises(NoScheduleFound):
            brute_force_fixed(g, budget)
        return
    s = brute_force_fixed(g, budget)
    r = simulate(g, s.sequence)
    assert r.valid and r.peak_bytes <= budget
    assert r.cost == pytest.approx(expected) == pytest.approx(s.lower_bound)


@settings(max_examples=25, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(2, 4), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_free_order_matches_enumeration_of_short_sequences(kind, size, seed, frac):
    g = small_graph(kind, size, seed, outputs=False, inputs=False)
    budget = budget_between(g, frac)
    ops = g.order
    extra = 2
    seqs = (list(p) for L in range(len(ops), len(ops) + extra + 1) for p in itertools.product(ops, repeat=L))
    enumerated = best_of(g, seqs, budget)
    try:
        s = brute_force(g, budget)
    except InfeasibleBudget as exc:
        assert enumerated is None
        assert exc.smallest_feasible_bytes > budget
        return
    r = simulate(g, s.sequence)
    assert r.valid and r.peak_bytes <= budget
    assert r.cost == pytest.approx(s.lower_bound)
    if enumerated is not None:
        assert r.cost <= enumerated + 1e-9
    if len(s.sequence) <= len(ops) + extra:
        assert enumerated is not None and r.cost == pytest.approx(enumerated)


@settings(max_examples=30, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_free_order_is_never_worse_than_fixed(kind, size, seed, frac):
    g = small_graph(kind, size, seed, outputs=False, inputs=False)
    budget = budget_between(g, frac)
    try:
        fixed = brute_force_fixed(g, budget)
    except NoScheduleFound:
        return
    free = brute_force(g, budget)
    assert simulate(g, free.sequence).cost <= simulate(g, fixed.sequence).cost + 1e-9


@settings(max_examples=25, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(2, 7), seed=st.integers(0, 10_000))
def test_min_peak_is_reached_and_nothing_fits_below_it(kind, size, seed):
    g = small_graph(kind, size, seed, outputs=False, inputs=False)
    for fixed in (False, True):
        peak, seq = brute_force_min_peak(g, fixed_order=fixed)
        r = simulate(g, seq)
        assert r.valid and r.peak_bytes <= peak
        assert peak >= peak_lower_bound(g)[0]
        search = brute_force_fixed if fixed else brute_force
        with pytest.raises((InfeasibleBudget, NoScheduleFound)):
            search(g, peak - 1)


def test_chain_recomputes_under_a_tight_budget():
    # f0, f1 of 4 bytes: keeping f0 and f1 until b1 needs 4+4+1+4 = 13; b0 needs f0, b1, b0
    g = training_chain(3, fwd_bytes=[4, 4, 4])
    lo = peak_lower_bound(g)[0]
    store_all = simulate(g, g.order)
    s = brute_force(g, lo)
    r = simulate(g, s.sequence)
    assert r.peak_bytes <= lo < store_all.peak_bytes
    assert r.cost > store_all.cost  # something had to be recomputed


def test_refuses_large_graphs():
    with pytest.raises(SolverError, match="max_ops"):
        brute_force(random_dag(14, seed=0), 10**9)

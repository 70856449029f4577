"""The offload method: store / recompute / offload under a budget with a bandwidth model."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphs.hardware import get_hardware
from solver import NoScheduleFound, Offload, Schedule, simulate, solve
from solver.feasibility import peak_lower_bound
from solver.methods.offload import (
    breakeven_bandwidth,
    offload_windows,
    plan_offloads,
    resolve_bandwidth,
)
from solver.synthetic import random_training_graph, training_chain


def _chain(n=8):
    return training_chain(
        n,
        fwd_bytes=[10 + (7 * i) % 13 for i in range(n)],
        fwd_time=[1.0 + (3 * i) % 5 for i in range(n)],
    )


def _ratio(g):
    """Bytes per time unit at which moving every value once takes the whole step."""
    return g.total("bytes") / g.total("time")


def _recompute_sequence(n, recomputed):
    """Reference order of ``training_chain(n)`` where the forward values ``f{i}`` with
    ``i in recomputed`` are dropped after forward and recomputed (once) before backward
    first needs them, from the closest value still available."""
    seq = [f"f{i}" for i in range(n)] + ["loss"]
    again = set()

    def ensure(i):
        if i < 0 or i not in recomputed or i in again:
            return
        ensure(i - 1)
        seq.append(f"f{i}")
        again.add(i)

    for i in reversed(range(n)):
        ensure(i - 1)
        ensure(i)
        seq.append(f"b{i}")
    return seq


def _every_k(n, k):
    """Checkpoint every k-th forward value, recompute the others (Chen et al. 2016)."""
    kept = {i for i in range(n) if (i + 1) % k == 0} | {n - 1}
    return _recompute_sequence(n, set(range(n)) - kept)


def _best_recompute_only(g, n, budget):
    best = math.inf
    for k in range(1, n + 1):
        r = simulate(g, _every_k(n, k))
        assert r.valid, r.error
        if r.peak_bytes <= budget:
            best = min(best, r.cost)
    return best


# ------------------------------------------------------------------ bandwidth inputs
def test_resolve_bandwidth_presets_and_units():
    assert resolve_bandwidth(bandwidth=123.0) == 123.0
    assert resolve_bandwidth(hardware="pcie5") == get_hardware("pcie5").host_bandwidth
    assert resolve_bandwidth(hardware="nvlink-c2c") > resolve_bandwidth(hardware="pcie5") > resolve_bandwidth(
        hardware="pcie4")
    # a graph timed in milliseconds moves 1000x fewer bytes per time unit
    assert resolve_bandwidth(hardware="pcie4", time_unit_seconds=1e-3) == pytest.approx(
        get_hardware("pcie4").host_bandwidth / 1000)
    for bad in ({}, {"bandwidth": 1.0, "hardware": "pcie4"}, {"bandwidth": 0.0}, {"bandwidth": float("nan")}):
        with pytest.raises(ValueError):
            resolve_bandwidth(**bad)


def test_hardware_option_matches_bandwidth_option():
    g = _chain(8)
    budget = int(0.8 * simulate(g, g.order).peak_bytes)
    unit = 1e-9  # tiny time units make the PCIe link slow relative to compute
    a = solve(g, budget, method="offload", hardware="pcie4", time_unit_seconds=unit)
    b = solve(g, budget, method="offload", bandwidth=get_hardware("pcie4").host_bandwidth * unit)
    assert a.bandwidth == pytest.approx(b.bandwidth)
    assert a.cost == pytest.approx(b.cost)


# ------------------------------------------------------------------ huge / tiny bandwidth
@pytest.mark.parametrize("fraction", [0.8, 0.85, 0.9])
def test_huge_bandwidth_offloads_at_no_extra_cost(fraction):
    n = 8
    g = _chain(n)
    budget = int(fraction * simulate(g, g.order).peak_bytes)
    s = solve(g, budget, method="offload", bandwidth=1e6 * _ratio(g))
    r = simulate(g, s)
    assert r.valid and r.peak_bytes <= budget
    assert s.offloads and r.recomputations == 0
    assert s.overhead < 1e-6
    # recomputation alone pays for the same budget
    assert _best_recompute_only(g, n, budget) > s.cost + 1e-9


def test_offload_goes_below_what_recomputation_can_reach():
    n = 8
    g = _chain(n)
    for v in g.forward_nodes():
        g[v]["recomputable"] = False  # e.g. dropout masks: computing them twice is wrong
    peak = simulate(g, g.order).peak_bytes
    budget = int(0.8 * peak)
    with pytest.raises(NoScheduleFound):
        solve(g, budget, method="offload", bandwidth=1e6 * _ratio(g), mode="recompute")
    s = solve(g, budget, method="offload", bandwidth=1e6 * _ratio(g))
    assert simulate(g, s).peak_bytes <= budget and s.overhead < 1e-6


@pytest.mark.parametrize("fraction", [0.5, 0.7, 0.9])
def test_tiny_bandwidth_recomputes_instead(fraction):
    n = 10
    g = _chain(n)
    budget = int(fraction * simulate(g, g.order).peak_bytes)
    s = solve(g, budget, method="offload", bandwidth=1e-6 * _ratio(g))
    assert s.offloads == []
    assert s.cost <= _best_recompute_only(g, n, budget) + 1e-9


def test_cost_falls_as_bandwidth_grows():
    g = _chain(10)
    budget = int(0.7 * simulate(g, g.order).peak_bytes)
    costs = [solve(g, budget, method="offload", bandwidth=m * _ratio(g)).cost for m in (1e-4, 1e-1, 1, 1e4)]
    assert costs[-1] == pytest.approx(g.total("time"))
    assert costs[0] > costs[-1]
    # more bandwidth never hurts by more than rounding (a plan for less bandwidth stays valid)
    for lo, hi in zip(costs, costs[1:]):
        assert hi <= lo * (1 + 1e-9)


# ------------------------------------------------------------------ validity (hypothesis)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 6),
    seed=st.integers(0, 10_000),
    fraction=st.floats(0.3, 1.0),
    log_bw=st.floats(-4, 4),
)
def test_every_schedule_valid_and_within_budget(n, seed, fraction, log_bw):
    g = random_training_graph(n, seed=seed)
    peak = simulate(g, g.order).peak_bytes
    lb, _ = peak_lower_bound(g)
    budget = max(lb, int(fraction * peak))
    bw = 10.0**log_bw * _ratio(g)
    try:
        s = solve(g, budget, method="offload", bandwidth=bw, time_limit=5)
    except NoScheduleFound:
        assert budget < peak  # store-all always fits its own peak
        return
    r = simulate(g, s)
    assert r.valid, r.error
    assert r.peak_bytes <= budget
    assert r.cost == pytest.approx(s.cost)
    assert r.cost >= r.base_cost - 1e-9
    if budget >= peak:
        assert s.cost == pytest.approx(r.base_cost) and not s.offloads
    for o in s.offloads:  # the copy must never be read while on the host
        for t in range(o.after + 2, o.before):
            assert o.node not in g.nx.predecessors(s.sequence[t]) or any(
                s.sequence[u] == o.node for u in range(o.after + 1, t))


# ------------------------------------------------------------------ exhaustive search
def _all_window_plans(g, seq):
    """Every choice of at most one placed offload per window."""
    options = []
    for w in offload_windows(g, seq):
        opts = [None]
        for s_out in range(w.out_first, w.in_last + 1):
            for s_in in range(s_out + 2, w.in_last + 1):
                opts.append(Offload(w.node, s_out - 1, s_in + 1))
        options.append(opts)
    for combo in itertools.product(*options):
        yield [o for o in combo if o is not None]


def _exhaustive(g, seqs, budget, bw):
    best = math.inf
    for seq in seqs:
        for offs in _all_window_plans(g, seq):
            r = simulate(g, Schedule(list(seq), offloads=offs, bandwidth=bw))
            if r.valid and r.peak_bytes <= budget:
                best = min(best, r.cost)
    return best


def _tiny():
    return training_chain(4, fwd_bytes=[8, 5, 9, 6], fwd_time=[1.0, 3.0, 1.0, 2.0])


@pytest.mark.parametrize("fraction", [0.75, 0.85, 0.95])
@pytest.mark.parametrize("rel_bw", [0.05, 0.3, 1.0, 5.0])
def test_exact_windows_match_exhaustive_search(fraction, rel_bw):
    g = _tiny()
    peak = simulate(g, g.order).peak_bytes
    budget = int(fraction * peak)
    bw = rel_bw * _ratio(g)
    ref = _exhaustive(g, [g.order], budget, bw)
    offs = plan_offloads(g, g.order, budget, bandwidth=bw, exact=True)
    if ref == math.inf:
        assert offs is None
        return
    assert offs is not None
    got = simulate(g, Schedule(list(g.order), offloads=offs, bandwidth=bw))
    assert got.peak_bytes <= budget
    assert got.cost == pytest.approx(ref)
    # the greedy planner is never better than the optimum
    greedy = plan_offloads(g, g.order, budget, bandwidth=bw, exact=False)
    if greedy is not None:
        assert simulate(g, Schedule(list(g.order), offloads=greedy, bandwidth=bw)).cost >= ref - 1e-9


@pytest.mark.parametrize("fraction", [0.6, 0.75, 0.9])
@pytest.mark.parametrize("rel_bw", [0.05, 0.5, 5.0])
def test_store_recompute_offload_against_exhaustive_search(fraction, rel_bw):
    n = 4
    g = _tiny()
    peak = simulate(g, g.order).peak_bytes
    budget = max(peak_lower_bound(g)[0], int(fraction * peak))
    bw = rel_bw * _ratio(g)
    seqs = [_recompute_sequence(n, set(c)) for r in range(n) for c in itertools.combinations(range(n - 1), r)]
    ref = _exhaustive(g, seqs, budget, bw)
    try:
        s = solve(g, budget, method="offload", bandwidth=bw, exact=True)
    except NoScheduleFound:
        assert ref == math.inf
        return
    assert simulate(g, s).peak_bytes <= budget
    assert s.cost <= ref + 1e-9


# ------------------------------------------------------------------ break-even bandwidth
@pytest.mark.parametrize("node", ["f0", "f1", "f2"])
def test_breakeven_bandwidth_equalises_offload_and_recompute(node):
    g = training_chain(5, fwd_bytes=[8, 5, 9, 6, 7], fwd_time=[1.0, 3.0, 1.5, 2.0, 1.0])
    seq = list(g.order)
    bw = breakeven_bandwidth(g, node)
    assert 0 < bw < math.inf
    w = max((w for w in offload_windows(g, seq) if w.node == node), key=lambda w: w.in_last - w.out_first)
    off = w.offload(w.out_first, w.in_last)
    base = simulate(g, seq).cost

    def extra(b):
        return simulate(g, Schedule(seq, offloads=[off], bandwidth=b)).cost - base

    assert extra(bw) == pytest.approx(g[node]["time"])
    assert extra(bw * 1.01) < g[node]["time"] < extra(bw * 0.99)


def test_breakeven_bandwidth_edge_cases():
    # f0 is sent during f1 (time 3) and fetched during b2 (time 2): a free recomputation
    # is matched only when both transfers hide, from bytes / 2 on
    g = training_chain(4, fwd_bytes=10, fwd_time=[1.0, 3.0, 1.0, 1.0])
    assert breakeven_bandwidth(g, "f0", recompute_cost=0.0) == pytest.approx(10 / 2)
    g = training_chain(4, fwd_bytes=10, fwd_time=[1.0, 0.0, 1.0, 1.0])
    assert breakeven_bandwidth(g, "f0", recompute_cost=0.0) == math.inf
    with pytest.raises(ValueError):
        breakeven_bandwidth(g, "loss")  # read right after it is made: no window
    with pytest.raises(ValueError):
        breakeven_bandwidth(g, "nope")

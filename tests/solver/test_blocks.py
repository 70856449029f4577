"""Tests of ``block_dp``: the chain of layer blocks, each block's exact front, the DP
over the chain, and the schedules the simulator grades."""

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphs import ComputeGraph
from solver import simulate
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.methods.blocks import _repeats, block_chain, block_dp, block_options
from solver.methods.bruteforce import brute_force_fixed
from solver.plans import sequence_from_keep, stage_regions
from solver.synthetic import budget_between, chain, random_dag, training_chain


def layered(layers: int, ops: int, seed: int) -> ComputeGraph:
    """A training graph of ``layers`` identical layers of ``ops`` forward ops each (a
    chain with skips inside the layer), with the backward autograd builds: the backward
    of ``v`` reads ``v``, ``v``'s inputs and the gradients of ``v``'s readers."""
    rng = random.Random(seed)
    shape = [(rng.randint(1, 6), float(rng.randint(1, 4)), j >= 2 and rng.random() < 0.5) for j in range(ops)]
    g = ComputeGraph(name=f"layered{layers}x{ops}")
    preds, fwd, prev = {}, [], None
    for layer in range(layers):
        for j, (nb, t, skip) in enumerate(shape):
            v = f"f{layer}_{j}"
            g.add_node(v, bytes=nb, time=t, op=f"op{j}", phase="forward")
            preds[v] = ([prev] if prev else []) + ([f"f{layer}_{j - 2}"] if skip else [])
            for u in preds[v]:
                g.add_edge(u, v)
            fwd.append(v)
            prev = v
    readers = {v: [w for w in fwd if v in preds[w]] for v in fwd}
    for v in reversed(fwd):
        b = "b" + v[1:]
        g.add_node(b, bytes=g[v]["bytes"], time=2 * g[v]["time"], op="bwd", phase="backward",
                   output=v == fwd[0])
        for u in [v] + preds[v] + ["b" + w[1:] for w in readers[v]]:
            g.add_edge(u, b)
    return g


def test_the_chain_of_a_training_chain():
    c = block_chain(training_chain(4), layers=False)
    assert [b.stage.forward for b in c.blocks] == [["f0"], ["f1"], ["f2"], ["f3", "loss"]]
    assert c.distinct == 3  # the middle layers share one structure; the first and the last differ
    assert c.grad[-1] == 0 and len(c.grad) == 5


def _repeats_by_definition(ids: list) -> list:
    """The runs of ``_repeats`` found by comparing slices (quadratic): the period and
    start whose consecutive copies cover the most stages, the shorter period and the
    earlier start on ties; the parts before and after cut the same way."""
    n = len(ids)
    best = None
    for p in range(1, min(64, n // 2) + 1):
        for start in range(n - 2 * p + 1):
            copies = 1
            while ids[start + copies * p:start + (copies + 1) * p] == ids[start:start + p]:
                copies += 1
            if copies >= 2 and (best is None or (p * copies, -p) > best[:2]):
                best = (p * copies, -p, start, p, copies)
    if best is None:
        return [(i, 1) for i in range(n)]
    _, _, start, p, copies = best
    tail = [(start + p * copies + a, b) for a, b in _repeats_by_definition(ids[start + p * copies:])]
    return _repeats_by_definition(ids[:start]) + [(start + j * p, p) for j in range(copies)] + tail


@settings(max_examples=300, deadline=None)
@given(head=st.lists(st.integers(0, 3), max_size=6), period=st.lists(st.integers(0, 3), min_size=1, max_size=5),
       copies=st.integers(0, 8), tail=st.lists(st.integers(0, 3), max_size=6))
def test_repeated_periods_are_the_ones_that_slices_find(head, period, copies, tail):
    ids = head + period * copies + tail
    assert _repeats(ids) == _repeats_by_definition(ids)


def test_a_chain_of_thousands_of_alike_stages_is_cut_into_them():
    # the period search is linear in the stages for each period (it compared slices of
    # every start and period: 3.2 s at 1,500 stages)
    c = block_chain(training_chain(1500), layers=True)
    assert len(c.blocks) >= 1499 and sum(len(b.stage.forward) for b in c.blocks) == 1501


def test_repeated_layers_become_blocks_solved_once():
    g = layered(4, 3, seed=1)
    c = block_chain(g)
    sizes = [len(b.stage.forward) for b in c.blocks]
    assert sum(sizes) == 12
    assert max(sizes) == 3  # one block per layer (cut wherever the period starts)
    assert c.distinct < len(c.blocks)
    block_options(g, c)
    assert all(b.options for b in c.blocks)
    assert all(b.exact for b in c.blocks)


def test_values_every_layer_reads_are_set_aside():
    # a mask-like value read by every layer hides every cut; set aside, the layers appear
    g = layered(4, 2, seed=3)
    g.add_node("mask", bytes=1, time=1.0, op="mask", phase="forward")
    g.add_edge("f0_0", "mask")
    for layer in range(1, 4):
        g.add_edge("mask", f"f{layer}_1")
    g.order = ["f0_0", "mask"] + [v for v in g.order if v not in ("f0_0", "mask")]
    c = block_chain(g)
    assert "mask" in c.shared
    assert len(c.blocks) >= 4


def test_graphs_without_a_chain_are_refused():
    with pytest.raises(NoScheduleFound, match="no backward"):
        block_dp(chain(4), 3)
    g = random_dag(6, seed=0)
    for v in g.ops:
        g[v]["phase"] = "backward"
    with pytest.raises(NoScheduleFound):
        block_dp(g, 10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(2, 4), ops=st.integers(1, 4), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_schedules_are_valid_within_the_budget_and_never_below_the_optimum(layers, ops, seed, frac):
    g = layered(layers, ops, seed)
    budget = budget_between(g, frac)
    try:
        s = block_dp(g, budget)
    except NoScheduleFound:
        return
    r = simulate(g, s)
    assert r.valid, r.error
    assert r.peak_bytes <= budget
    assert r.cost >= g.total("time")
    if len(g.ops) <= 12:
        try:
            best = brute_force_fixed(g, budget)
        except (NoScheduleFound, InfeasibleBudget):
            pytest.fail("block_dp fits a budget that brute force calls infeasible")
        assert r.cost >= simulate(g, best.sequence).cost - 1e-9


def _family_optimum(g, budget, c):
    """The least simulated cost over every keep set in which each block keeps its
    output: the schedules of block_dp's family, enumerated."""
    regions = stage_regions(g, c.stages)
    fwd = [v for v in g.order if g[v]["phase"] == "forward"]
    outputs = {b.stage.boundary for b in c.blocks}
    best = None
    for bits in itertools.product((0, 1), repeat=len(fwd)):
        keep = {v for v, b in zip(fwd, bits) if b}
        if not outputs <= keep:
            continue
        r = simulate(g, sequence_from_keep(g, keep, regions=regions))
        if r.valid and r.peak_bytes <= budget and (best is None or r.cost < best):
            best = r.cost
    return best


@pytest.mark.parametrize("seed", range(24))
def test_matches_the_exact_optimum_of_its_family_on_small_chains(seed):
    g = layered(3, 2 + seed % 2, seed)
    c = block_chain(g)
    for frac in (0.2, 0.5, 0.8):
        budget = budget_between(g, frac)
        best = _family_optimum(g, budget, c)
        if best is None:
            continue
        s = block_dp(g, budget)
        assert simulate(g, s).cost <= best + 1e-9


@pytest.mark.parametrize("n", [2, 3, 4])
def test_matches_the_brute_force_optimum_on_training_chains_at_store_all(n):
    g = training_chain(n, fwd_bytes=[2, 3, 1, 2][:n])
    budget = simulate(g, g.order).peak_bytes
    s = block_dp(g, budget)
    assert simulate(g, s).cost == pytest.approx(simulate(g, brute_force_fixed(g, budget).sequence).cost)

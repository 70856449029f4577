"""The block index prices per-block plans as the plain functions do."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from examples.models import hf_llama
from graphs import capture
from graphs.module_mode import layer_blocks
from solver.module_plan import (BlockIndex, checkpoint_sequence, checkpoint_view, keep_for_plan, plan_schedule,
                                sac_view)
from solver.plans import sequence_from_keep


@pytest.fixture(scope="module")
def llama():
    model, batch = hf_llama(n_layer=3, d=32, n_head=2, seq=8, batch=1, vocab=64)
    cg = capture(model, batch, backward="loss", measure_time=False)
    blocks = layer_blocks(model)
    return checkpoint_view(cg, blocks), blocks


PLANS = [("none", "full", "none"), ("full", "full", "full"), ("selective", "none", "full"),
         ("save_matmuls", "selective", "selective"), ("full", "save_matmuls", "none")]


@pytest.mark.parametrize("actions", PLANS)
def test_index_gives_the_plain_schedule(llama, actions):
    graph, blocks = llama
    plan = dict(zip(blocks, actions))
    index = BlockIndex(graph, blocks)
    plain, plain_res = plan_schedule(graph, plan)
    edges = sorted(map(str, graph.nx.edges))
    fast, fast_res = plan_schedule(graph, plan, index=index)
    assert sorted(map(str, graph.nx.edges)) == edges  # what the simulation added is gone
    assert fast.sequence == plain.sequence
    assert (fast_res.peak_bytes, fast_res.peak_step, fast_res.cost, fast_res.base_cost, fast_res.recomputations) == (
        plain_res.peak_bytes, plain_res.peak_step, plain_res.cost, plain_res.base_cost, plain_res.recomputations)
    assert fast_res.memory_curve.tolist() == plain_res.memory_curve.tolist()
    assert len(plain.sequence) > len(graph.ops) or actions == ("none",) * 3


def test_index_pieces_match(llama):
    graph, blocks = llama
    index = BlockIndex(graph, blocks)
    assert not index.nested
    for acts in itertools.product(["none", "full", "selective"], repeat=len(blocks)):
        plan = dict(zip(blocks, acts))
        keep = keep_for_plan(graph, plan)
        assert keep_for_plan(graph, plan, index=index) == keep
        seq = sequence_from_keep(graph, keep)
        assert index.sequence_from_keep(keep) == seq
        assert checkpoint_sequence(graph, seq, plan, index=index) == checkpoint_sequence(graph, seq, plan)
        a, b = sac_view(graph, plan, seq, index=index), sac_view(graph, plan, seq)
        assert sorted(map(str, a.nx.edges)) == sorted(map(str, b.nx.edges))
        fast, plain = plan_schedule(graph, plan, index=index)[1], plan_schedule(graph, plan)[1]
        assert (fast.peak_bytes, fast.peak_step, fast.cost) == (plain.peak_bytes, plain.peak_step, plain.cost)
        assert fast.memory_curve.tolist() == plain.memory_curve.tolist()


def test_nested_blocks_keep_the_plain_order(llama):
    graph, blocks = llama
    nested = [blocks[0], blocks[0] + ".mlp", blocks[1]]
    index = BlockIndex(graph, nested)
    assert index.nested
    plan = {nested[0]: "full", nested[1]: "full", nested[2]: "full"}
    seq = sequence_from_keep(graph, keep_for_plan(graph, plan))
    assert checkpoint_sequence(graph, seq, plan, index=index) == checkpoint_sequence(graph, seq, plan)


def test_eager_autograd_holds_what_a_node_read_until_its_last_op():
    from graphs import ComputeGraph
    from solver import simulate
    from solver.module_plan import NODE_SPAN, hold_node_inputs

    g = ComputeGraph()
    g.add_node("grad", bytes=8, phase="backward")
    g.add_node("saved", bytes=8, phase="forward")
    for v in ("mul_a", "mul_b"):  # one autograd node's two gradients
        g.add_node(v, bytes=8, phase="backward", autograd_node=3, output=True)
    g.add_edge("grad", "mul_a"); g.add_edge("saved", "mul_a"); g.add_edge("grad", "mul_b")
    peak_before = simulate(g, g.order).peak_bytes
    assert hold_node_inputs(g) == 1 and g.nx.has_edge("saved", "mul_b")
    assert simulate(g, g.order).peak_bytes == peak_before + 8  # "saved" lives through mul_b
    # ops numbered alike but far apart in the order (gradient accumulation) are not one node
    h = ComputeGraph()
    h.add_node("x", bytes=8, phase="backward")
    h.add_node("acc_0", bytes=8, phase="backward", autograd_node=9)
    prev = "acc_0"
    h.add_edge("x", prev)
    for i in range(NODE_SPAN + 1):
        h.add_node(f"op_{i}", bytes=8, phase="backward")
        h.add_edge(prev, f"op_{i}")
        prev = f"op_{i}"
    h.add_node("acc_1", bytes=8, phase="backward", autograd_node=9)
    h.add_edge(prev, "acc_1")
    assert hold_node_inputs(h) == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 16), seed=st.integers(0, 10_000))
def test_the_indexed_simulation_is_the_simulators_arithmetic(kind, size, seed):
    """Random sequences of a graph with multi-output runs, workspaces and outputs, some
    reading what is not computed yet, with and without extra edges."""
    import random

    from solver import simulate
    from solver.module_plan import _IndexedSimulation, editable_copy
    from solver.synthetic import small_graph

    g = small_graph(kind, size, seed, groups=True)
    rng = random.Random(seed)
    sim = _IndexedSimulation(g)
    ops = list(g.ops)
    for _ in range(8):
        seq = list(ops)
        for _ in range(rng.randint(0, len(ops))):  # recomputations, in place or anywhere
            v = rng.choice(ops)
            seq.insert(rng.randint(0, len(seq)) if rng.random() < 0.3 else seq.index(v) + rng.randint(1, 4), v)
        edges = [tuple(rng.sample(ops, 2)) for _ in range(rng.randint(0, 2))]
        got = sim.run(seq, edges)
        view = editable_copy(g)
        for u, v in edges:
            view.add_edge(u, v)
        want = simulate(view, seq)
        seen, early = set(), False
        for v in seq:  # a step that reads an op with no copy yet
            early = early or any(u in view.ops_set and u not in seen for u in view.nx.predecessors(v))
            seen.add(v)
        assert (got is None) == early
        assert early <= (not want.valid)
        if got is None:
            continue
        assert (got.peak_bytes, got.peak_step, got.recomputations) == (want.peak_bytes, want.peak_step,
                                                                       want.recomputations)
        assert got.cost == pytest.approx(want.cost, rel=1e-12)
        assert got.memory_curve.tolist() == want.memory_curve.tolist()


def _same_simulation(got, want):
    assert (got.peak_bytes, got.peak_step, got.cost, got.base_cost, got.recomputations) == (
        want.peak_bytes, want.peak_step, want.cost, want.base_cost, want.recomputations)
    assert got.memory_curve.tolist() == want.memory_curve.tolist()


@pytest.mark.parametrize("hold", [False, True], ids=["graph_mode", "eager_lifetimes"])
def test_a_plan_priced_from_its_pieces_is_its_schedules_simulation(llama, hold):
    """Every plan of the three layers, with the actions a plan may take."""
    from solver.module_plan import editable_copy, hold_node_inputs

    graph, blocks = llama
    if hold:  # module mode's graph: eager autograd's lifetimes as extra edges
        graph = editable_copy(graph)
        assert hold_node_inputs(graph) > 0
    index = BlockIndex(graph, blocks)
    priced = 0
    for acts in itertools.product(["none", "full", "selective", "save_matmuls"], repeat=len(blocks)):
        plan = dict(zip(blocks, acts))
        got = index.price(plan)
        assert got is not None  # a transformer's layers compose
        _same_simulation(got, plan_schedule(graph, plan)[1])
        priced += 1
    assert priced == 64


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(3, 16), seed=st.integers(0, 10_000), n_blocks=st.integers(1, 3))
def test_pieces_compose_on_random_graphs_with_random_blocks(kind, size, seed, n_blocks):
    """Random graphs whose ops fall into blocks at random (a block's backward need not
    follow its forward): the price from the pieces is the schedule's simulation."""
    import random

    from solver.synthetic import small_graph

    g = small_graph(kind, size, seed, groups=True)
    rng = random.Random(seed)
    blocks = [f"layers.{k}" for k in range(n_blocks)]
    for v in g.ops:
        if rng.random() < 0.8:
            g[v]["module"] = rng.choice(blocks) + rng.choice(["", ".fc"])
    view = checkpoint_view(g, blocks)
    index = BlockIndex(view, blocks)
    for _ in range(6):
        plan = {b: rng.choice(["none", "full", "selective"]) for b in blocks}
        _same_simulation(index.price(plan), plan_schedule(view, plan)[1])


def test_the_search_on_pieces_picks_what_the_search_on_schedules_picks(monkeypatch):
    from solver.module_plan import plan_modules

    model, batch = hf_llama(n_layer=4, d=32, n_head=2, seq=64, batch=2, vocab=64)
    blocks = layer_blocks(model)
    graph = checkpoint_view(capture(model, batch, backward="loss", measure_time=False), blocks)
    top = plan_schedule(graph, {b: "none" for b in blocks})[0].peak_bytes
    low = plan_schedule(graph, {b: "full" for b in blocks})[0].peak_bytes
    assert low < top
    for frac in (0.9, 0.6, 0.3, 0.0):
        budget = int(low + frac * (top - low))
        priced = []  # what the pieces gave for each plan the search priced
        with monkeypatch.context() as m:
            price = BlockIndex.price
            m.setattr(BlockIndex, "price", lambda self, actions: priced.append(price(self, actions)) or priced[-1])
            fast = plan_modules(graph, budget, blocks=blocks, actions=["none", "save_matmuls", "full"])
        with monkeypatch.context() as m:
            m.setattr(BlockIndex, "price", lambda self, actions: None)
            plain = plan_modules(graph, budget, blocks=blocks, actions=["none", "save_matmuls", "full"])
        assert fast.actions == plain.actions
        assert fast.schedule.sequence == plain.schedule.sequence
        assert (fast.schedule.peak_bytes, fast.schedule.cost) == (plain.schedule.peak_bytes, plain.schedule.cost)
        assert fast.evaluations == plain.evaluations == len(priced)
        assert all(r is not None for r in priced)  # every plan was priced on its pieces

"""The block index prices per-block plans as the plain functions do."""

from __future__ import annotations

import itertools

import pytest
import torch

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

"""Stage chains and the checkpoint-set -> sequence builder."""

from __future__ import annotations

import glob

from hypothesis import given, settings, strategies as st

from graphs import ComputeGraph
from solver import simulate
from solver.plans import forced_keep, forward_stages, sequence_from_keep, stage_regions
from solver.synthetic import random_training_graph, training_chain
from tests.paths import BENCHMARK_GRAPHS, needs_benchmark_graphs


def test_training_chain_stages():
    stages = forward_stages(training_chain(4))
    assert [s.forward for s in stages] == [["f0"], ["f1"], ["f2"], ["f3", "loss"]]
    assert [s.backward for s in stages] == [["b0"], ["b1"], ["b2"], ["b3"]]


def test_store_everything_is_the_reference_order():
    g = training_chain(5)
    assert sequence_from_keep(g, set(g.forward_nodes())) == list(g.order)


def test_unkept_values_are_recomputed_once_and_forward_copy_dies():
    g = training_chain(6)
    seq = sequence_from_keep(g, {"f2"})
    r = simulate(g, seq)
    assert r.valid
    assert seq.count("f2") == 1 and seq.count("f0") == 2 and seq.count("f4") == 2
    assert r.peak_bytes < simulate(g, g.order).peak_bytes
    # no backward op reads a first-pass copy of a recomputed value
    first_b = seq.index("b5")
    for v in ("f3", "f4"):
        assert v in seq[len(g.forward_nodes()):first_b]


def test_forced_values_are_never_recomputed():
    g = training_chain(5)
    g["f1"]["recomputable"] = False
    assert forced_keep(g) == {"f1"}
    seq = sequence_from_keep(g, set())
    assert seq.count("f1") == 1
    assert simulate(g, seq).valid


def test_stage_regions_recompute_per_stage():
    g = training_chain(4)
    seq = sequence_from_keep(g, set(), regions=stage_regions(g, forward_stages(g)))
    assert simulate(g, seq).valid
    # first pass + once for the backward of each of the four stages (all descend from f0)
    assert seq.count("f0") == 5


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 10_000), data=st.data())
def test_any_keep_set_gives_a_valid_sequence(n, seed, data):
    g = random_training_graph(n, seed=seed)
    fwd = g.forward_nodes()
    keep = data.draw(st.sets(st.sampled_from(fwd))) if fwd else set()
    seq = sequence_from_keep(g, keep)
    r = simulate(g, seq)
    assert r.valid, r.error
    # kept values run once
    for v in keep:
        assert seq.count(v) == 1
    # every backward op in the reference order
    assert [v for v in seq if g[v]["phase"] == "backward"] == g.backward_nodes()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_stages_are_consistent(n, seed):
    g = random_training_graph(n, seed=seed)
    stages = forward_stages(g)
    fwd_in_stages = [v for s in stages for v in s.forward]
    assert fwd_in_stages == g.forward_nodes()
    assert sorted(v for s in stages for v in s.backward) == sorted(g.backward_nodes())
    stage_of = {v: s.index for s in stages for v in s.forward}
    boundaries = {s.boundary for s in stages}
    for s in stages:
        # only a boundary is read across stages in forward
        for v in s.forward:
            for w in g.op_succs(v):
                if w in stage_of and stage_of[w] != s.index:
                    assert v in boundaries and stage_of[w] > s.index
        # a stage's backward reads its own values and the previous boundary only
        for b in s.backward:
            for u in g.op_preds(b):
                if u in stage_of:
                    assert stage_of[u] == s.index or (u in boundaries and stage_of[u] == s.index - 1)


@needs_benchmark_graphs
def test_benchmark_graphs_have_stage_chains():
    paths = sorted(glob.glob(str(BENCHMARK_GRAPHS / "*_train.json")))
    assert paths
    for p in paths:
        g = ComputeGraph.load(p)
        stages = forward_stages(g)
        assert len(stages) > 5
        seq = sequence_from_keep(g, {s.boundary for s in stages})
        assert simulate(g, seq).valid


def _unread_views_one_by_one(graph, sequence, out, unread):
    """The definition: each unread view's last run goes back after the same number of
    non-view steps as in ``sequence``, after the views put back there before."""
    from solver.plans import _is_view

    result = list(out)
    back = set()
    for v in unread:
        last = max(i for i, s in enumerate(sequence) if s == v)
        k = sum(1 for s in sequence[:last] if not _is_view(graph, s))
        pos, seen = 0, 0
        while pos < len(result) and seen < k:
            if not _is_view(graph, result[pos]):
                seen += 1
            pos += 1
        while pos < len(result) and result[pos] in back:
            pos += 1
        result.insert(pos, v)
        back.add(v)
    return result


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=40), st.data())
def test_unread_views_go_back_where_the_definition_puts_them(steps, data):
    from solver.plans import _with_unread_views

    g = ComputeGraph()
    for i in range(6):
        g.add_node(f"o{i}", bytes=4)
    for i in range(4):
        g.add_node(f"v{i}", bytes=0, alias_of="o0", op="aten.view.default")
    names = [f"o{i}" for i in range(6)] + [f"v{i}" for i in range(4)]
    sequence = [names[s] for s in steps]
    views = list(dict.fromkeys(v for v in sequence if v.startswith("v")))
    unread = data.draw(st.permutations(views)).copy()[: data.draw(st.integers(0, len(views)))]
    out = [v for v in sequence if not v.startswith("v")]
    placed = data.draw(st.lists(st.sampled_from(views), max_size=3)) if views else []
    for v in placed:
        out.insert(data.draw(st.integers(0, len(out))), v)
    assert _with_unread_views(g, sequence, out, unread) == _unread_views_one_by_one(g, sequence, out, unread)

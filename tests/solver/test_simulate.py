"""solver.simulate against a naive, independent replay of the memory model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from graphs import ComputeGraph
from solver import simulate
from solver.synthetic import random_dag, random_training_graph


def naive_replay(graph: ComputeGraph, seq: list) -> tuple[bool, list[int], float]:
    """Validity, memory per step and cost, straight from the definitions (quadratic)."""
    ops = graph.ops_set
    valid = all(v in ops for v in seq) and set(seq) == set(ops)
    for v in ops:
        if not graph[v]["recomputable"] and seq.count(v) > 1:
            valid = False
    n = len(seq)
    ends = []
    for s, v in enumerate(seq):
        nxt = next((r for r in range(s + 1, n) if seq[r] == v), n)
        end = s
        for r in range(s + 1, nxt):
            if graph.nx.has_edge(v, seq[r]):
                end = r
        if graph[v]["output"] and nxt == n:
            end = n - 1
        ends.append(end)
    for t, v in enumerate(seq):
        for u in graph.op_preds(v):
            if not any(seq[s] == u and s < t <= ends[s] for s in range(t)):
                valid = False
    curve = []
    for t, v in enumerate(seq):
        live = sum(graph[seq[s]]["bytes"] for s in range(n) if s <= t <= ends[s])
        curve.append(graph.fixed_bytes + live + graph[v]["workspace"])
    return valid, curve, float(sum(graph[v]["time"] for v in seq))


def _graph(kind: int, size: int, seed: int) -> ComputeGraph:
    rng = random.Random(seed)
    g = random_dag(size, seed=seed) if kind == 0 else random_training_graph(max(1, size // 2), seed=seed)
    for v in g.ops:
        if rng.random() < 0.2:
            g[v]["workspace"] = rng.randint(1, 5)
        if rng.random() < 0.15:
            g[v]["output"] = True
    if rng.random() < 0.5:
        g.add_node("x", kind="input", bytes=rng.randint(1, 9))
        g.add_edge("x", g.ops[0])
    return g


@settings(max_examples=150, deadline=None)
@given(kind=st.integers(0, 1), size=st.integers(2, 7), seed=st.integers(0, 10_000),
       length=st.integers(1, 14), shuffle=st.booleans())
def test_simulate_matches_naive_replay(kind, size, seed, length, shuffle):
    g = _graph(kind, size, seed)
    rng = random.Random(seed + 1)
    ops = list(g.order)
    if shuffle:  # arbitrary sequences, valid or not
        seq = [rng.choice(ops) for _ in range(length)]
    else:  # the reference order with random recomputations inserted
        seq = []
        for i, v in enumerate(ops):
            seq += [rng.choice(ops[:i]) for _ in range(rng.randint(0, 2)) if i]
            seq.append(v)
    r = simulate(g, seq)
    valid, curve, cost = naive_replay(g, seq)
    assert r.valid == valid, r.error
    assert list(r.memory_curve) == curve
    assert r.peak_bytes == max(curve)
    assert r.cost == pytest.approx(cost)


def test_simulate_frees_after_last_reader_and_keeps_outputs():
    g = ComputeGraph()
    for v, b in (("a", 4), ("b", 2), ("c", 1)):
        g.add_node(v, bytes=b, time=1.0)
    g.add_edge("a", "b"); g.add_edge("b", "c")
    g["c"]["output"] = True
    r = simulate(g, ["a", "b", "c"])
    # a is freed after b reads it; c is live at its own step
    assert list(r.memory_curve) == [4, 6, 3]
    r2 = simulate(g, ["a", "b", "c", "a"])  # a recomputed after c: only itself and c live
    assert list(r2.memory_curve) == [4, 6, 3, 5]


def test_simulate_rejects_non_recomputable_twice():
    g = random_dag(3, seed=0)
    g[g.ops[0]]["recomputable"] = False
    assert not simulate(g, g.ops + [g.ops[0]]).valid


def test_a_random_ops_generator_state_is_held_from_its_first_run_to_its_last():
    from graphs.fixed import REPLAY_KEY, charge

    g = ComputeGraph()
    for v in "abcd":
        g.add_node(v, bytes=10, time=1.0)
    g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d")
    g["d"]["output"] = True
    # two random ops, a and c: fixed bytes charge both states and a replay's swap
    g.meta[REPLAY_KEY] = {"ops": ["a", "c"], "state_bytes": 3 * 7, "per_state": 7}
    charge(g, rng_states=3 * 7)
    once = simulate(g, ["a", "b", "c", "d"])
    assert list(once.memory_curve) == [10, 20, 20, 20]  # no op runs twice: no state kept
    again = simulate(g, ["a", "b", "a", "c", "d"])
    # a's state lives from its first run to its last, and one more while it replays
    assert list(again.memory_curve) == [10 + 7, 20 + 7, 20 + 14, 20, 20]
    # with no per-state figure (a graph file written before it), the whole charge stays
    g.meta[REPLAY_KEY] = {"ops": ["a", "c"], "state_bytes": 21}
    assert list(simulate(g, ["a", "b", "a", "c", "d"]).memory_curve) == [31, 41, 41, 41, 41]

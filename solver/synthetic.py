"""Synthetic graphs for tests and experiments: chains, training chains, random DAGs.

Pure graph math; no torch.
"""

from __future__ import annotations

import random
from typing import Sequence

from graphs import ComputeGraph

__all__ = ["chain", "training_chain", "random_dag", "random_training_graph", "small_graph", "budget_between"]


def chain(n: int, *, bytes: int | Sequence[int] = 1, time: float | Sequence[float] = 1.0) -> ComputeGraph:
    """A plain chain ``0 -> 1 -> ... -> n-1`` (all forward).

    Examples
    --------
    >>> chain(3).ops
    [0, 1, 2]
    """
    bs = [bytes] * n if isinstance(bytes, int) else list(bytes)
    ts = [time] * n if isinstance(time, (int, float)) else list(time)
    g = ComputeGraph(name=f"chain{n}")
    for i in range(n):
        g.add_node(i, bytes=int(bs[i]), time=float(ts[i]), op="f")
        if i:
            g.add_edge(i - 1, i)
    return g


def training_chain(
    n: int,
    *,
    fwd_bytes: int | Sequence[int] = 1,
    fwd_time: float | Sequence[float] = 1.0,
    bwd_bytes: int | Sequence[int] | None = None,
    bwd_time: float | Sequence[float] | None = None,
    loss: bool = True,
) -> ComputeGraph:
    """The training graph of an ``n``-layer chain (Checkmate's linear model).

    Forward ``f0 .. f{n-1}`` (``f{i}`` reads ``f{i-1}``), an optional loss node ``loss``
    reading ``f{n-1}``, and backward ``b{n-1} .. b0``: ``b{i}`` reads the gradient from
    above (``b{i+1}``, or ``loss``/``f{n-1}``), the layer's output ``f{i}`` and its input
    ``f{i-1}``. Backward defaults: bytes like forward, time twice forward.

    Examples
    --------
    >>> g = training_chain(2)
    >>> g.ops
    ['f0', 'f1', 'loss', 'b1', 'b0']
    >>> sorted(g.nx.predecessors('b1'))
    ['f0', 'f1', 'loss']
    """
    fb = [fwd_bytes] * n if isinstance(fwd_bytes, int) else list(fwd_bytes)
    ft = [fwd_time] * n if isinstance(fwd_time, (int, float)) else list(fwd_time)
    bb = fb if bwd_bytes is None else ([bwd_bytes] * n if isinstance(bwd_bytes, int) else list(bwd_bytes))
    bt = [2 * t for t in ft] if bwd_time is None else (
        [bwd_time] * n if isinstance(bwd_time, (int, float)) else list(bwd_time))
    g = ComputeGraph(name=f"training_chain{n}")
    for i in range(n):
        g.add_node(f"f{i}", bytes=int(fb[i]), time=float(ft[i]), op="layer", phase="forward")
        if i:
            g.add_edge(f"f{i-1}", f"f{i}")
    top = f"f{n-1}"
    if loss:
        g.add_node("loss", bytes=1, time=0.0, op="loss", phase="forward")
        g.add_edge(top, "loss")
        top = "loss"
    for i in reversed(range(n)):
        g.add_node(f"b{i}", bytes=int(bb[i]), time=float(bt[i]), op="layer_backward", phase="backward",
                   output=(i == 0))
        g.add_edge(top, f"b{i}")
        if top != f"f{i}":
            g.add_edge(f"f{i}", f"b{i}")
        if i:
            g.add_edge(f"f{i-1}", f"b{i}")
        top = f"b{i}"
    return g


def random_dag(
    n: int, *, p: float = 0.3, max_bytes: int = 10, max_time: int = 10, seed: int | None = None
) -> ComputeGraph:
    """A random DAG on ``0..n-1`` (edges go from lower to higher ids with probability ``p``).

    Examples
    --------
    >>> len(random_dag(6, seed=0))
    6
    """
    rng = random.Random(seed)
    g = ComputeGraph(name=f"random_dag{n}")
    for i in range(n):
        g.add_node(i, bytes=rng.randint(1, max_bytes), time=float(rng.randint(1, max_time)), op="op")
    for j in range(1, n):
        preds = [i for i in range(j) if rng.random() < p]
        if not preds:
            preds = [rng.randrange(j)]
        for i in preds:
            g.add_edge(i, j)
    return g


def random_training_graph(
    n_forward: int, *, p: float = 0.3, max_bytes: int = 10, max_time: int = 10, seed: int | None = None
) -> ComputeGraph:
    """A random forward DAG plus its mirrored backward (``b{i}`` reads ``f{i}``, its
    forward inputs and the gradients of ``f{i}``'s consumers), like autograd builds.

    Examples
    --------
    >>> g = random_training_graph(3, seed=1)
    >>> len(g.forward_nodes()), len(g.backward_nodes())
    (3, 3)
    """
    rng = random.Random(seed)
    g = ComputeGraph(name=f"random_training{n_forward}")
    fwd_preds: dict[int, list[int]] = {}
    for i in range(n_forward):
        g.add_node(f"f{i}", bytes=rng.randint(1, max_bytes), time=float(rng.randint(1, max_time)),
                   op="op", phase="forward")
        if i:
            preds = [j for j in range(i) if rng.random() < p] or [i - 1]
            fwd_preds[i] = preds
            for j in preds:
                g.add_edge(f"f{j}", f"f{i}")
        else:
            fwd_preds[i] = []
    consumers: dict[int, list[int]] = {i: [] for i in range(n_forward)}
    for i, ps in fwd_preds.items():
        for j in ps:
            consumers[j].append(i)
    for i in reversed(range(n_forward)):
        g.add_node(f"b{i}", bytes=rng.randint(1, max_bytes), time=float(rng.randint(1, 2 * max_time)),
                   op="op_backward", phase="backward", output=(i == 0))
        g.add_edge(f"f{i}", f"b{i}")
        for j in fwd_preds[i]:
            g.add_edge(f"f{j}", f"b{i}")
        for c in consumers[i]:
            g.add_edge(f"b{c}", f"b{i}")
    return g


def small_graph(
    kind: int, size: int, seed: int, *, outputs: bool = True, inputs: bool = True, groups: bool = False
) -> ComputeGraph:
    """A small random graph for exhaustive checks, with the awkward features turned on.

    ``kind`` 0: :func:`random_dag`; 1: :func:`random_training_graph`; 2: a heterogeneous
    :func:`training_chain`. Some ops get a workspace, some are not recomputable, some
    (``outputs``) are step outputs, and sometimes (``inputs``) a source input feeds the
    first op. With ``groups``, some pairs of ops next to each other in the order become
    the two projections of one multi-output op (``group``, ``group_time``,
    ``run_workspace``).

    Examples
    --------
    >>> g = small_graph(2, 7, seed=3)
    >>> len(g.ops) >= 3
    True
    """
    rng = random.Random(seed)
    if kind == 0:
        g = random_dag(size, seed=seed)
    elif kind == 1:
        g = random_training_graph(max(1, size // 2), seed=seed)
    else:
        n = max(1, (size - 1) // 2)
        g = training_chain(n, fwd_bytes=[rng.randint(1, 9) for _ in range(n)],
                           fwd_time=[float(rng.randint(1, 5)) for _ in range(n)])
    for v in g.ops:
        if rng.random() < 0.15:
            g[v]["workspace"] = rng.randint(1, 4)
        if rng.random() < 0.1:
            g[v]["recomputable"] = False
        if outputs and rng.random() < 0.1:
            g[v]["output"] = True
    if inputs and rng.random() < 0.3:
        g.add_node("x", kind="input", bytes=rng.randint(1, 5))
        g.add_edge("x", g.ops[0])
    ops = list(g.ops)
    for k in range(0, len(ops) - 1, 3) if groups else ():
        if rng.random() < 0.5:
            pair = ops[k], ops[k + 1]
            total = sum(g[v]["time"] for v in pair)
            for idx, v in enumerate(pair):
                ws = g[v].get("workspace", 0) + rng.randint(0, 4)
                g[v].update(group=f"op{k}", group_index=idx, group_time=total, workspace=ws,
                            run_workspace=rng.randint(0, ws))
    return g


def budget_between(graph: ComputeGraph, fraction: float) -> int:
    """A budget ``fraction`` of the way from the peak lower bound to the store-all peak.

    Examples
    --------
    >>> g = training_chain(3, fwd_bytes=4)
    >>> budget_between(g, 0.0) <= budget_between(g, 1.0)
    True
    """
    from solver.feasibility import peak_lower_bound
    from solver.simulate import simulate

    lo = peak_lower_bound(graph)[0]
    hi = simulate(graph, graph.order).peak_bytes
    return int(lo + fraction * (hi - lo))

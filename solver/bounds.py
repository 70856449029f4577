"""Cheap lower bounds on the compute of a schedule, without a solver.

:func:`forced_recompute_bound` holds for every sequence whose *first* computations follow
the reference order (the fixed-order freedom of ``checkmate_milp``, ``cpsat``,
``eviction`` and ``chain_dp``; it is not a bound when the order is free).

The argument, at the first computation of op ``t``: every value ``i`` computed before
``t`` and read by an op after ``t`` in the reference order (whose first computation is
still to come) is either resident now or computed again later, at a cost of at least its
``time``; a step output counts as read at the end (its last copy stays resident to
the end). Op ``t``'s inputs and values that must not be recomputed cannot take the
second way. So when fixed bytes, op ``t``'s
output and workspace, its inputs and every such value exceed the budget by ``E`` bytes,
values of at least ``E`` bytes in all are recomputed later; the cheapest way to do that,
relaxed to fractions of values (a fractional knapsack), costs at most what any schedule
pays. One recomputation can serve several steps, so the bound is the largest step's
amount, not their sum.

Multi-output groups: a projection that continues a run of its op is charged no time
and its ``run_workspace`` instead of its ``workspace``, so both are taken at their least.
Aliases and in-place results carry 0 bytes, with edges from their base, which the
argument reads as it is. O(ops x values live across an op).
"""

from __future__ import annotations

import math

from graphs import ComputeGraph

__all__ = ["forced_recompute_bound"]


def _least_time(d: dict) -> float:
    """The least time one computation of a node can be charged."""
    if d.get("group") is not None:
        return 0.0  # it may continue a run of its op
    return float(d["time"])


def _least_workspace(d: dict) -> int:
    ws = int(d.get("workspace", 0))
    if d.get("group") is not None:
        ws = min(ws, int(d.get("run_workspace", ws)))
    return ws


def forced_recompute_bound(graph: ComputeGraph, budget_bytes: int) -> float:
    """A lower bound on the cost of any schedule whose first computations follow the
    reference order, from the values that cannot all stay resident (module docstring).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.

    Returns
    -------
    float
        At least the store-all cost; ``math.inf`` when some op's step cannot fit even
        with every value that may go recomputed (no fixed-order schedule fits).

    Examples
    --------
    ``a -> b -> c -> d`` where ``d`` also reads ``a``: at ``c``, ``a`` is still to be
    read, so ``c``, its input ``b`` and ``a`` (1 + 4 + 3 bytes) are resident unless ``a``
    is computed again; ``d`` needs ``a``, ``c`` and itself (7 bytes) in any case.

    >>> g = ComputeGraph()
    >>> for v, b in zip("abcd", [1, 4, 3, 3]): g.add_node(v, bytes=b, time=2.0)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d"); g.add_edge("a", "d")
    >>> forced_recompute_bound(g, 8)  # store-all fits: nothing forced
    8.0
    >>> round(forced_recompute_bound(g, 7), 6)  # a goes at c and is computed again
    10.0
    >>> forced_recompute_bound(g, 6)
    inf
    """
    ops = list(graph.order)
    nodes = graph.nx.nodes
    index = {v: i for i, v in enumerate(ops)}
    base = float(sum(nodes[v]["time"] for v in ops))
    n = len(ops)
    # a step output is read at the end of the step (index n)
    last_read = [n if nodes[v].get("output", False) else max((index[w] for w in graph.op_succs(v)), default=-1)
                 for v in ops]
    size = [int(nodes[v]["bytes"]) for v in ops]
    cost = [_least_time(nodes[v]) for v in ops]
    stays = [not nodes[v].get("recomputable", True) for v in ops]
    room = int(budget_bytes) - graph.fixed_bytes
    live: list[int] = []  # values computed before t and read after t
    worst = 0.0
    for t, v in enumerate(ops):
        inputs = {index[u] for u in graph.op_preds(v)}
        need = size[t] + _least_workspace(nodes[v]) + sum(size[i] for i in inputs)
        droppable = []
        for i in live:
            if i in inputs:
                continue
            need += size[i]
            if not stays[i] and size[i] > 0:
                droppable.append(i)
        excess = need - room
        if excess > 0:
            if sum(size[i] for i in droppable) < excess:
                return math.inf
            amount = 0.0
            for i in sorted(droppable, key=lambda i: cost[i] / size[i]):
                take = min(size[i], excess)
                amount += cost[i] * take / size[i]
                excess -= take
                if excess <= 0:
                    break
            worst = max(worst, amount)
        live = [i for i in live if last_read[i] > t + 1]
        if last_read[t] > t + 1:
            live.append(t)
    # a hair below, so that float rounding never lifts it above a schedule's cost
    return base + max(0.0, worst * (1 - 1e-9))

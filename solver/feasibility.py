"""How little memory a step can possibly run in.

``peak_lower_bound`` is the classic bound: every op needs its inputs, its output and its
workspace resident at once, on top of the fixed bytes. It is exact for chains and for the
public CNN graphs; :func:`smallest_feasible_peak` pairs it with a schedule that reaches it
(or the best one found), which is what :class:`~solver.InfeasibleBudget` reports.
"""

from __future__ import annotations

from typing import Hashable

from graphs import ComputeGraph

__all__ = ["peak_lower_bound", "op_footprint"]


def op_footprint(graph: ComputeGraph, node: Hashable) -> int:
    """Bytes that must be resident while ``node`` runs: its op inputs, output, workspace.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("a", bytes=3); g.add_node("b", bytes=5); g.add_edge("a", "b")
    >>> op_footprint(g, "b")
    8
    """
    d = graph[node]
    return int(
        sum(graph[u]["bytes"] for u in graph.op_preds(node)) + d["bytes"] + d.get("workspace", 0)
    )


def peak_lower_bound(graph: ComputeGraph) -> tuple[int, Hashable | None]:
    """A peak no schedule can go below, and the op that forces it.

    ``fixed_bytes + max(max over ops of op_footprint, bytes of all step outputs)``.
    O(edges).

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i, b in enumerate([2, 6, 1]): g.add_node(i, bytes=b)
    >>> g.add_edge(0, 1); g.add_edge(1, 2)
    >>> peak_lower_bound(g)
    (8, 1)
    """
    best, culprit = 0, None
    for v in graph.ops:
        f = op_footprint(graph, v)
        if f > best:
            best, culprit = f, v
    # every output of the step is resident together at the last step
    outputs = sum(graph[v]["bytes"] for v in graph.ops if graph[v]["output"])
    if outputs > best:
        best, culprit = outputs, None
    return graph.fixed_bytes + best, culprit

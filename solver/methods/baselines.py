"""Baseline schedules: the yardsticks every other method is compared with."""

from __future__ import annotations

from graphs import ComputeGraph
from solver.registry import register
from solver.schedule import Schedule

__all__ = ["store_all"]


@register("store_all", family="baseline", order="fixed")
def store_all(graph: ComputeGraph, budget_bytes: int | None = None, *, time_limit=None, **_) -> Schedule:
    """Run every op once in the reference order and keep each value until its last use.

    Examples
    --------
    >>> g = ComputeGraph(); g.add_node("a"); g.add_node("b"); g.add_edge("a", "b")
    >>> store_all(g).sequence
    ['a', 'b']
    """
    return Schedule(sequence=list(graph.order), method="store_all", lower_bound=graph.total("time"),
                    info={"order": "fixed"})

"""Grades: the checks every schedule passes, whatever method made it.

:func:`grade` fills a schedule's cost and peak from :func:`solver.simulate`, the one
judge, and rejects an invalid one or one over its budget. The budget itself is checked
before any method runs, by :func:`solver.solving.check_budget`.
"""

from __future__ import annotations

from graphs import ComputeGraph
from solver.errors import SolverError
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["grade", "culprit_label"]


def culprit_label(graph: ComputeGraph, culprit) -> str | None:
    """How an :class:`InfeasibleBudget` names the op that forces its bound: its id and
    its module and source line (or op), or None without one.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("mm", bytes=4, time=1.0, op="aten.mm")
    >>> culprit_label(g, "mm"), culprit_label(g, None)
    ("'mm' (aten.mm)", None)
    """
    if culprit is None:
        return None
    name = graph[culprit].get("name") or graph[culprit].get("op")
    return f"{culprit!r} ({name})" if name else None


def grade(graph: ComputeGraph, schedule: Schedule, budget: int | None, *, solve_seconds: float | None = None) -> Schedule:
    """Fill ``cost``/``peak_bytes``/``base_cost`` from the simulator; reject invalid results."""
    result = simulate(graph, schedule)
    if not result.valid:
        raise SolverError(f"method {schedule.method!r} returned an invalid schedule: {result.error}")
    if budget is not None and result.peak_bytes > budget:
        raise SolverError(
            f"method {schedule.method!r} returned a schedule that peaks at {result.peak_bytes} B, "
            f"over the budget of {budget} B (a solver bug; please report it)"
        )
    schedule.cost = result.cost
    schedule.peak_bytes = result.peak_bytes
    schedule.base_cost = result.base_cost
    schedule.budget_bytes = budget
    if schedule.lower_bound is not None and schedule.lower_bound > result.cost * (1 + 1e-9) + 1e-9:
        raise SolverError(
            f"method {schedule.method!r} claims a lower bound {schedule.lower_bound} above the cost "
            f"{result.cost} of its own schedule (a solver bug)"
        )
    if solve_seconds is not None:
        schedule.solve_seconds = solve_seconds
    return schedule

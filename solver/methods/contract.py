"""What the methods share.

Every registered method is called as ``fn(graph, budget_bytes, *, time_limit=None,
...)``, its options keyword-only (:func:`solver.solve` raises
:class:`~solver.errors.OptionError` for one a method does not take), and returns a
:class:`~solver.schedule.Schedule` or raises :class:`~solver.errors.NoScheduleFound`.
This module holds the steps they have in common: the time an exact method runs without
a ``time_limit`` and its deadline, the room a budget leaves beside the fixed bytes, and,
for the methods that plan over the chain of forward stages, the store-all schedule of a
graph that has no backward or no such chain.
"""

from __future__ import annotations

from graphs import ComputeGraph
from solver.deadline import Deadline
from solver.errors import NoScheduleFound
from solver.plans import cheapest_fitting, forward_stages, has_backward
from solver.schedule import Schedule

__all__ = ["DEFAULT_TIME_LIMIT", "time_limit_of", "room_of", "chain_stages", "store_all_candidate",
           "store_all_fallback"]

#: Seconds an exact method (``checkmate_milp``, ``cpsat``, the MILP's bound) runs without a ``time_limit``.
DEFAULT_TIME_LIMIT = 60.0


def time_limit_of(time_limit: float | None, *, default: float = DEFAULT_TIME_LIMIT) -> tuple[float, Deadline]:
    """The seconds a method runs (``default`` without a limit) and their deadline, from now.

    Examples
    --------
    >>> limit, deadline = time_limit_of(None)
    >>> limit, 59 < deadline.left() <= 60
    (60.0, True)
    """
    limit = default if time_limit is None else float(time_limit)
    return limit, Deadline(limit)


def room_of(graph: ComputeGraph, budget_bytes: int, *, method: str, at_least: int = 0) -> int:
    """The bytes ``budget_bytes`` leaves beside the graph's fixed bytes.

    Raises
    ------
    NoScheduleFound
        Fewer than ``at_least`` are left (the fixed bytes alone exceed the budget).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> room_of(training_chain(2), 10, method="cpsat")
    10
    """
    room = int(budget_bytes) - graph.fixed_bytes
    if room < at_least:
        raise NoScheduleFound(f"{method}: the fixed bytes alone ({graph.fixed_bytes} B) exceed the budget of "
                              f"{int(budget_bytes)} B; give a budget above them", best_peak=graph.fixed_bytes)
    return room


def chain_stages(graph: ComputeGraph) -> list | None:
    """The forward stages of a training graph (:func:`solver.plans.forward_stages`);
    None where it has no backward or no stages (store-all is then the only plan of the
    methods that plan over them).

    Examples
    --------
    >>> from solver.synthetic import chain, training_chain
    >>> len(chain_stages(training_chain(3))), chain_stages(chain(3))
    (3, None)
    """
    if not has_backward(graph):
        return None
    return forward_stages(graph) or None


def store_all_candidate(graph: ComputeGraph) -> tuple[list, dict]:
    """The store-all sequence as a candidate of :func:`solver.plans.cheapest_fitting`."""
    return list(graph.order), {"plan": "store_all"}


def store_all_fallback(graph: ComputeGraph, budget_bytes: int, *, method: str,
                       deadline: Deadline | None = None) -> Schedule:
    """The store-all schedule, as ``method``'s answer where :func:`chain_stages` gives no stages.

    Raises
    ------
    NoScheduleFound
        Store-all does not fit the budget.

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> store_all_fallback(chain(3), 10, method="chain_dp").info["plan"]
    'store_all'
    """
    seq, info = cheapest_fitting(graph, [store_all_candidate(graph)], budget_bytes, method=method, deadline=deadline)
    return Schedule(sequence=seq, method=method, info=dict(info, order="fixed"))

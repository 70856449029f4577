"""One call shape for every solver: :func:`solve` and the method table it reads.

:func:`solve` validates the budget, calls the method registered under that name
(``"auto"`` included), and grades the result with :func:`solver.simulate` -- methods
never grade themselves.
"""

from __future__ import annotations

import time

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.grading import check_budget, grade, infeasible
from solver.registry import MethodInfo, registered
from solver.schedule import Schedule

__all__ = ["methods", "get_method", "solve", "check_budget", "grade"]


def _load_all() -> None:
    # importing the method modules fills the registry
    import solver.methods  # noqa: F401  (registers every method)


def methods() -> dict[str, MethodInfo]:
    """The registered methods by name.

    Examples
    --------
    >>> "store_all" in methods()
    True
    """
    _load_all()
    return registered()


def get_method(name: str) -> MethodInfo:
    _load_all()
    try:
        return registered()[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r}; choose one of {', '.join(registered())}"
        ) from None


def solve(
    graph: ComputeGraph,
    budget_bytes: float,
    *,
    method: str = "auto",
    time_limit: float | None = None,
    **options,
) -> Schedule:
    """Find a schedule of ``graph`` whose peak fits ``budget_bytes``.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : float
        Peak device bytes allowed, fixed bytes (parameters, inputs) included.
    method : str
        A name from :func:`methods`; ``"auto"`` picks by graph shape and size and
        records its choice in ``schedule.info["auto"]``.
    time_limit : float, optional
        Seconds; exact methods stop there with the best schedule and its gap.
    **options
        Passed to the method (e.g. ``bandwidth`` for offload, ``k`` for every-k).

    Returns
    -------
    Schedule
        Graded by :func:`solver.simulate`: ``cost``, ``peak_bytes``, ``base_cost``.

    Raises
    ------
    ValueError
        A zero, negative or NaN budget.
    InfeasibleBudget
        No schedule fits; the exception carries the smallest feasible peak.
    NoScheduleFound
        The method found nothing within the budget although one may exist.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(4): g.add_node(i, bytes=10, time=1.0)
    >>> for i in range(3): g.add_edge(i, i + 1)
    >>> solve(g, 100, method="store_all").sequence
    [0, 1, 2, 3]
    """
    budget = check_budget(graph, budget_bytes)
    t0 = time.perf_counter()
    try:
        info = get_method(method)
        schedule = info.fn(graph, budget, time_limit=time_limit, **options)
        schedule.method = schedule.method or method
    except NoScheduleFound:
        # below the smallest peak any schedule is known to reach, say so with that figure
        from solver.methods.minpeak import smallest_feasible_peak

        if budget < smallest_feasible_peak(graph)[0]:
            raise infeasible(graph, budget) from None
        raise
    elapsed = time.perf_counter() - t0
    return grade(graph, schedule, budget, solve_seconds=elapsed)

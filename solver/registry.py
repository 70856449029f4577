"""One call shape for every solver: a registry of named methods and :func:`solve`.

Every method is a function ``fn(graph, budget_bytes, *, time_limit=None, **options) ->
Schedule`` that returns at least ``sequence`` (and ``offloads``, ``lower_bound``,
``info`` where it has them). :func:`solve` validates the budget, calls the method, and
grades the result with :func:`solver.simulate` -- methods never grade themselves.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from graphs import ComputeGraph
from solver.errors import BudgetNotReached, InfeasibleBudget, NoScheduleFound, SolverError
from solver.feasibility import peak_lower_bound
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["MethodInfo", "register", "methods", "get_method", "solve", "check_budget"]

log = logging.getLogger(__name__)

MethodFn = Callable[..., Schedule]


@dataclass(frozen=True)
class MethodInfo:
    """A registered method.

    Attributes
    ----------
    name : str
    fn : callable
    family : str
        ``baseline``, ``heuristic``, ``chain``, ``exact``, ``large`` or ``offload``.
    exact : bool
        Returns a proven optimum (for its order freedom) when it finishes in time.
    order : str
        ``"fixed"`` keeps the graph's reference order and only adds recomputation;
        ``"free"`` may reorder.
    description : str
    """

    name: str
    fn: MethodFn
    family: str
    exact: bool
    order: str
    description: str


_REGISTRY: dict[str, MethodInfo] = {}


def register(
    name: str, *, family: str, exact: bool = False, order: str = "fixed", description: str = ""
) -> Callable[[MethodFn], MethodFn]:
    """Register ``fn`` as the method ``name`` (decorator)."""

    def deco(fn: MethodFn) -> MethodFn:
        known = _REGISTRY.get(name)
        if known is not None and (known.fn.__module__.rsplit(".", 1)[-1], known.fn.__qualname__) != (
            fn.__module__.rsplit(".", 1)[-1], fn.__qualname__
        ):
            raise ValueError(f"method {name!r} is registered twice")
        doc = description or ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        _REGISTRY[name] = MethodInfo(name, fn, family, exact, order, doc)
        return fn

    return deco


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
    return dict(sorted(_REGISTRY.items()))


def get_method(name: str) -> MethodInfo:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r}; choose one of {', '.join(sorted(_REGISTRY))} or 'auto'"
        ) from None


def check_budget(graph: ComputeGraph, budget_bytes: float) -> int:
    """Validate a budget: a plain ValueError for nonsense, InfeasibleBudget below the bound."""
    try:
        b = float(budget_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number of bytes, got {budget_bytes!r}") from None
    if math.isnan(b) or b <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget_bytes!r}")
    if math.isinf(b):
        b = float(2**62)
    budget = int(b)
    lb, culprit = peak_lower_bound(graph)
    if budget < lb:
        raise _infeasible(graph, budget)
    return budget


def _infeasible(graph: ComputeGraph, budget: int) -> InfeasibleBudget:
    from solver.methods.minpeak import smallest_feasible_peak

    found, lb, culprit = smallest_feasible_peak(graph)
    name = graph[culprit].get("name") or graph[culprit].get("op") if culprit is not None else None
    cls = InfeasibleBudget if budget < lb else BudgetNotReached
    return cls(
        budget, found, lower_bound_bytes=lb, culprit=culprit, culprit_name=f"{culprit!r} ({name})" if name else None
    )


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
        A name from :func:`methods`, or ``"auto"`` (picks by graph shape and size and
        records its choice in ``schedule.info["auto"]``).
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
        if method == "auto":
            from solver.methods.auto import solve_auto

            schedule = solve_auto(graph, budget, time_limit=time_limit, **options)
        else:
            info = get_method(method)
            schedule = info.fn(graph, budget, time_limit=time_limit, **options)
            schedule.method = schedule.method or method
    except NoScheduleFound:
        # below the smallest peak any schedule is known to reach, say so with that figure
        from solver.methods.minpeak import smallest_feasible_peak

        if budget < smallest_feasible_peak(graph)[0]:
            raise _infeasible(graph, budget) from None
        raise
    elapsed = time.perf_counter() - t0
    return grade(graph, schedule, budget, solve_seconds=elapsed)


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

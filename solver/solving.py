"""One call shape for every solver: :func:`solve` and the method table it reads.

:func:`solve` validates its arguments before any work (the graph as
:meth:`ComputeGraph.load` does, the budget, the time limit and the method's options),
calls the method registered under that name (``"auto"`` included), and grades the
result with :func:`solver.simulate` -- methods never grade themselves.
"""

from __future__ import annotations

import math
import numbers
import time

from graphs import ComputeGraph
from graphs.compute_graph import validated
from graphs.fixed import states_not_sure
from solver.errors import BudgetNotReached, InfeasibleBudget, NoScheduleFound
from solver.feasibility import peak_lower_bound
from solver.grading import culprit_label, grade
from solver.registry import MethodInfo, OptionError, registered
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["methods", "get_method", "solve", "check_budget", "checked_budget", "checked_time_limit", "grade",
           "infeasible", "reached_floor"]


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
    """The registered method ``name``.

    Raises
    ------
    OptionError
        No method has that name (a :class:`ValueError`); the message lists them.

    Examples
    --------
    >>> get_method("store_all").family
    'baseline'
    """
    _load_all()
    try:
        return registered()[name]
    except (KeyError, TypeError):
        raise OptionError(
            f"unknown method {name!r}; choose one of {', '.join(registered())}"
        ) from None


def checked_time_limit(time_limit) -> float | None:
    """``time_limit`` as seconds: None (no limit) or a number >= 0; infinity reads as None.

    Raises
    ------
    OptionError
        A string, a boolean, NaN or a negative number.

    Examples
    --------
    >>> checked_time_limit(2), checked_time_limit(float("inf"))
    (2.0, None)
    """
    if time_limit is None:
        return None
    if isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real) or not time_limit >= 0:
        raise OptionError(f"time_limit must be seconds >= 0 or None (no limit), got {time_limit!r}")
    return None if math.isinf(time_limit) else float(time_limit)


def _left(t0: float, time_limit: float | None) -> float | None:
    """Seconds left of ``time_limit`` counted from ``t0`` (None: no limit)."""
    return None if time_limit is None else max(0.0, t0 + time_limit - time.perf_counter())


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
        Seconds for everything, the method and the figures of a failure included (to
        within 10 % or a second); exact methods stop there with the best schedule and
        its gap.
    **options
        Passed to the method (e.g. ``bandwidth`` for offload, ``k`` for every-k); one
        that it does not take raises :class:`~solver.errors.OptionError`
        (``methods()[name].options`` lists those it takes).

    Returns
    -------
    Schedule
        Graded by :func:`solver.simulate`: ``cost``, ``peak_bytes``, ``base_cost``.

    Raises
    ------
    GraphFormatError
        ``graph`` is not a :class:`ComputeGraph` (a path, a networkx graph, None: the
        message says how to make one), has no op node, or fails
        :meth:`ComputeGraph.validate` (negative, NaN or non-numeric bytes or times, an
        unknown kind, a cycle, a reference order that is not topological).
    OptionError
        An unknown method, an option the method does not take, or a time limit that is
        not a number >= 0.
    ValueError
        A zero, negative, NaN or non-numeric budget.
    InfeasibleBudget
        No schedule fits; the exception carries the smallest feasible peak. Before an
        exact method (``cpsat``, ``checkmate_milp``, ``stage_milp``), which would spend
        its whole limit on such a budget, a probe of at most 0.1 s (and 2 % of the
        limit) looks for a proof, as after any method that finds nothing.
    BudgetNotReached
        The method found nothing within the budget, which lies between the proven lower
        bound and the smallest peak found (the least of what the method and
        :func:`~solver.methods.minpeak.smallest_feasible_peak` reached).
    NoScheduleFound
        The method found nothing and the time limit left no time to find the figures.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(4): g.add_node(i, bytes=10, time=1.0)
    >>> for i in range(3): g.add_edge(i, i + 1)
    >>> solve(g, 100, method="store_all").sequence
    [0, 1, 2, 3]
    """
    t0 = time.perf_counter()
    info = get_method(method)
    info.check_options(options)
    time_limit = checked_time_limit(time_limit)
    validated(graph, caller="solve")
    if isinstance(budget_bytes, (str, bytes, bool)):
        raise ValueError(f"budget must be a number of bytes, got {budget_bytes!r}")
    budget = checked_budget(graph, budget_bytes, method=method, time_limit=_left(t0, time_limit))
    if info.family == "exact":
        # an exact method spends its whole limit on a budget nothing fits (and leaves no
        # time for the figures): a short probe of the peak bounds first
        ruled = _ruled_out(graph, budget, _left(t0, time_limit))
        if ruled is not None:
            raise ruled
    try:
        # (the checks above count in the limit)
        schedule = info.fn(graph, budget, time_limit=_left(t0, time_limit), **options)
        schedule.method = schedule.method or method
    except NoScheduleFound as exc:
        left = None if time_limit is None else t0 + float(time_limit) - time.perf_counter()
        # (the relaxation's proof counts recomputation only: not for a method that offloads)
        raise _not_reached(graph, budget, exc, left, prove=info.family != "offload") from None
    elapsed = time.perf_counter() - t0
    return grade(graph, schedule, budget, solve_seconds=elapsed)


def check_budget(graph: ComputeGraph, budget_bytes: float) -> int:
    """Validate a budget: a plain ValueError for nonsense, InfeasibleBudget below the
    proven lower bound on the peak (:func:`solver.feasibility.peak_lower_bound`).

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(3): g.add_node(i, bytes=10, time=1.0)
    >>> g.add_edge(0, 1); g.add_edge(1, 2)
    >>> check_budget(g, 20.5), check_budget(g, float("inf")) == 2**62
    (20, True)
    """
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
        raise infeasible(graph, budget)
    return budget


def infeasible(graph: ComputeGraph, budget: int) -> InfeasibleBudget:
    """The error for a ``budget`` no schedule reaches: :class:`InfeasibleBudget` below the
    proven lower bound, else :class:`BudgetNotReached`, naming the smallest peak the
    low-memory search (:func:`solver.methods.minpeak.smallest_feasible_peak`) reaches.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(3): g.add_node(i, bytes=10, time=1.0)
    >>> g.add_edge(0, 1); g.add_edge(1, 2)
    >>> exc = infeasible(g, 5)
    >>> type(exc).__name__, exc.smallest_feasible_bytes
    ('InfeasibleBudget', 20)
    """
    # imported here: importing a method module loads every method, and some import this one
    from solver.methods.minpeak import smallest_feasible_peak

    found, lb, culprit = smallest_feasible_peak(graph)
    lb = _sure(graph, lb)
    cls = InfeasibleBudget if budget < lb else BudgetNotReached
    return cls(budget, found, lower_bound_bytes=lb, culprit=culprit, culprit_name=culprit_label(graph, culprit))


def checked_budget(graph: ComputeGraph, budget_bytes: float, *, method: str = "auto",
                   time_limit: float | None = None) -> int:
    """:func:`check_budget`, whose refusal of a budget below what one op alone needs
    names the higher bound that the peak bounds of recomputing schedules prove (unless
    ``method`` offloads, where they do not hold), found in at most ``time_limit``
    seconds.

    Returns
    -------
    int
        The budget in bytes.

    Raises
    ------
    ValueError
        A zero, negative or NaN budget.
    InfeasibleBudget
        No schedule fits.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(3): g.add_node(i, bytes=10, time=1.0)
    >>> g.add_edge(0, 1); g.add_edge(1, 2)
    >>> checked_budget(g, 20)
    20
    """
    t0 = time.perf_counter()
    try:
        return check_budget(graph, budget_bytes)
    except InfeasibleBudget as exc:
        exc = _floored(graph, exc)
        if get_method(method).family == "offload" or type(exc) is not InfeasibleBudget:
            raise exc from None
        left = None if time_limit is None else float(time_limit) - (time.perf_counter() - t0)
        raise _sharpened(graph, exc, left) from None


def reached_floor(graph: ComputeGraph) -> int:
    """The least peak of two schedules that every step can run, whatever the time the
    searches get: the plain step (the reference order, store-all) and, on a training
    graph of layer blocks, checkpointing every block
    (:func:`solver.methods.blocks.per_block_schedule`). The smallest feasible peak an
    error names is never above it.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=8)
    >>> reached_floor(g) == simulate(g, g.order).peak_bytes
    True
    >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
    >>> reached_floor(g) < simulate(g, g.order).peak_bytes
    True
    """
    from solver.methods.blocks import per_block_schedule

    floor = simulate(graph, list(graph.order)).peak_bytes
    blocks = per_block_schedule(graph)
    if blocks is not None:
        floor = min(floor, blocks.peak_bytes)
    return int(floor)


def _floored(graph: ComputeGraph, exc: InfeasibleBudget) -> InfeasibleBudget:
    """``exc`` naming no smallest feasible peak above :func:`reached_floor`."""
    floor = reached_floor(graph)
    if floor >= exc.smallest_feasible_bytes or floor < exc.lower_bound_bytes:
        return exc
    return type(exc)(exc.budget_bytes, floor, lower_bound_bytes=exc.lower_bound_bytes, culprit=exc.culprit,
                     culprit_name=exc.culprit_name, held_bytes=exc.held_bytes, held_before=exc.held_before)


#: Seconds the figures of a failure may take at most (the search stops early with the best).
FIGURES_SECONDS = 0.8
#: Seconds at most for proving the peak's lower bound higher where the search stops
#: above the budget (:func:`solver.bounds.relaxed_peak_bound`).
PROOF_SECONDS = 1.0
#: Seconds at most for the bound of what run-once ops hold
#: (:func:`solver.feasibility.run_once_peak_bound`), tried first.
ONCE_SECONDS = 1.0
#: Seconds at most for the bound of what making each op's inputs resident needs
#: (:func:`solver.feasibility.last_computed_peak_bound`), tried second.
LAST_SECONDS = 1.0
#: Seconds at most for the chain family's smallest peak on a training graph (Chen's
#: segments: on a chain of thousands of layers the low-memory search's eviction probes
#: do not finish, and the store-all peak would be named where a tenth of it is reached).
CHAIN_SECONDS = 0.5
#: Below this many seconds left, a failure is raised without looking for figures.
FIGURES_MIN_SECONDS = 0.05
#: Seconds at most (and share of the time limit) for the probe that rules a budget out
#: before an exact method starts (:func:`solver.feasibility.last_computed_rules_out`;
#: docs/tuning.md).
EXACT_PROBE_SECONDS = 0.1
EXACT_PROBE_SHARE = 0.02


def _ruled_out(graph: ComputeGraph, budget: int, left: float | None) -> InfeasibleBudget | None:
    """The error for a ``budget`` that what ops that run once hold, or what making some
    op's inputs resident needs, rules out (found within a short slice of the ``left``
    seconds; None: no limit), with its figures; None where neither does in time."""
    from solver.feasibility import last_computed_rules_out, run_once_peak_bound

    t0 = time.perf_counter()
    seconds = EXACT_PROBE_SECONDS if left is None else min(EXACT_PROBE_SECONDS, EXACT_PROBE_SHARE * left)
    if seconds <= 0:
        return None
    if (run_once_peak_bound(graph, time_limit=seconds)[0] <= budget
            and last_computed_rules_out(graph, budget, time_limit=seconds - (time.perf_counter() - t0)) is None):
        return None
    rest = None if left is None else left - (time.perf_counter() - t0)
    exc = _not_reached(graph, budget, NoScheduleFound(f"no schedule fits {budget} B"), rest)
    return exc if type(exc) is InfeasibleBudget else None


def _chain_peak(graph: ComputeGraph, seconds: float) -> int | None:
    """The smallest peak of Chen's sqrt(L) segments on ``graph`` found within
    ``seconds`` (None: none)."""
    from solver.methods.baselines import chen_sqrt

    try:
        # no schedule fits 0 B: it names its least peak (it builds and grades its
        # settings in half its time limit)
        chen_sqrt(graph, 0, time_limit=2 * seconds)
    except NoScheduleFound as exc:
        return None if exc.best_peak is None else int(exc.best_peak)
    return None


def _not_reached(graph: ComputeGraph, budget: int, exc: NoScheduleFound, left: float | None, *,
                 prove: bool = True) -> NoScheduleFound:
    """The error for a method that found nothing: an :class:`InfeasibleBudget` (below the
    proven bound) or :class:`BudgetNotReached` naming the least peak that a schedule is
    known to reach -- the method's own ``best_peak``, the low-memory search's or, on a
    training graph, that of Chen's sqrt(L) segments, whichever is least -- searched for
    in the time that is ``left`` (seconds; None: no limit). With ``prove``, a budget
    between the bounds is tried against what ops that run once hold
    (:func:`solver.feasibility.run_once_peak_bound`), what making each op's inputs
    resident needs (:func:`solver.feasibility.last_computed_peak_bound`) and the
    order-free stage relaxation (:func:`solver.bounds.relaxed_peak_bound`), which may
    raise the proven bound."""
    if isinstance(exc, InfeasibleBudget):
        return exc
    if left is not None and left < FIGURES_MIN_SECONDS:
        return exc
    from solver.methods.minpeak import smallest_feasible_peak

    t0 = time.perf_counter()
    chain = None
    if graph.backward_nodes():
        chain = _chain_peak(graph, CHAIN_SECONDS if left is None else min(CHAIN_SECONDS, 0.5 * left))
    seconds = FIGURES_SECONDS if left is None else min(FIGURES_SECONDS, left - (time.perf_counter() - t0))
    found, lb, culprit = smallest_feasible_peak(graph, time_limit=max(0.0, seconds))
    if exc.best_peak is not None and lb <= exc.best_peak < found:
        found = int(exc.best_peak)
    if chain is not None and lb <= chain < found:
        found = chain
    floor = reached_floor(graph)  # the plain step's and per-block checkpointing's: reached whatever the time
    if lb <= floor < found:
        found = floor
    if budget >= found:
        return exc  # a schedule within the budget exists: the method's own failure
    held, before = 0, False
    if prove and budget >= lb:
        # between the bounds: the bounds of recomputing schedules may prove it infeasible
        lb, culprit, held, before = _raised_bound(graph, lb, culprit, found, budget=budget,
                                                  left=None if left is None else left - (time.perf_counter() - t0))
    lb = _sure(graph, lb)
    cls = InfeasibleBudget if budget < lb else BudgetNotReached
    return cls(budget, found, lower_bound_bytes=lb, culprit=culprit, culprit_name=culprit_label(graph, culprit),
               held_bytes=held, held_before=before, held_what=_held_what(graph, culprit, held))


def _raised_bound(graph: ComputeGraph, lb: int, culprit, found: int, *, budget: int | None,
                  left: float | None) -> tuple[int, object, int, bool]:
    """The proven lower bound on the peak raised from ``lb`` (towards ``found``, a peak
    reached): what ops that run once must hold (dropout masks;
    :func:`solver.feasibility.run_once_peak_bound`), then what making each op's inputs
    resident needs (:func:`solver.feasibility.last_computed_peak_bound`), then the
    order-free stage relaxation (:func:`solver.bounds.relaxed_peak_bound`), each in its
    seconds of the ``left`` (None: no limit). With a ``budget``, the bounds probe it
    first and stop once one proves it infeasible; without, each bisects the whole range.
    Bounds of recomputing schedules, not of those that offload.

    Returns
    -------
    (lower bound, culprit op or None, bytes held beside it, whether it holds before the
    culprit's step): as :class:`~solver.InfeasibleBudget` takes them.
    """
    from solver.bounds import relaxed_peak_bound
    from solver.feasibility import last_computed_peak_bound, run_once_peak_bound

    t0 = time.perf_counter()
    held, before = 0, False

    def rest(most: float) -> float:
        return most if left is None else min(most, left - (time.perf_counter() - t0))

    def open_() -> bool:
        return (budget is None or budget >= lb) and lb < found

    if rest(ONCE_SECONDS) > FIGURES_MIN_SECONDS:
        raised, op, extra = run_once_peak_bound(graph, time_limit=rest(ONCE_SECONDS))
        if raised > lb:
            lb, culprit, held = min(raised, found), op, extra
    if open_() and rest(LAST_SECONDS) > FIGURES_MIN_SECONDS:
        raised, op = last_computed_peak_bound(graph, lower=lb, upper=found, first=budget,
                                              time_limit=rest(LAST_SECONDS))
        if raised > lb:
            lb, culprit, held, before = raised, op, 0, True
    if open_() and rest(PROOF_SECONDS) > FIGURES_MIN_SECONDS:
        raised = relaxed_peak_bound(graph, lower=lb, upper=found, first=budget, time_limit=rest(PROOF_SECONDS))
        if raised > lb:
            lb, culprit, held, before = raised, None, 0, False  # (no single op forces it)
    return lb, culprit, held, before


def _sure(graph: ComputeGraph, bound: int) -> int:
    """A lower bound of the bounds (which charge every generator state a replay may hold)
    made sound for a refusal: less the states a schedule may not hold
    (:func:`graphs.fixed.states_not_sure`)."""
    return max(0, bound - states_not_sure(graph))


def _held_what(graph: ComputeGraph, culprit, held: int) -> str | None:
    """What the ``held`` bytes beside ``culprit`` hold, in words (None: nothing held)."""
    from solver.feasibility import run_once_held

    return run_once_held(graph, culprit) if held > 0 and culprit is not None else None


def _sharpened(graph: ComputeGraph, exc: InfeasibleBudget, left: float | None) -> InfeasibleBudget:
    """``exc`` (a budget below the footprint bound) with its lower bound raised as far as
    the bounds of recomputing schedules take it in the time ``left``, so that the range
    it names for the smallest feasible peak is as narrow as is known."""
    lb, found = exc.lower_bound_bytes, exc.smallest_feasible_bytes
    if exc.proven or (left is not None and left < FIGURES_MIN_SECONDS):
        return exc
    raised, culprit, held, before = _raised_bound(graph, lb, exc.culprit, found, budget=None, left=left)
    raised = _sure(graph, raised)
    if raised <= lb:
        return exc
    return InfeasibleBudget(exc.budget_bytes, found, lower_bound_bytes=raised, culprit=culprit,
                            culprit_name=culprit_label(graph, culprit), held_bytes=held, held_before=before,
                            held_what=_held_what(graph, culprit, held))

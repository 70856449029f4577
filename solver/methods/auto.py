"""``method="auto"``: pick solvers by graph shape and size, keep the best simulated schedule.

The recipe, cheapest first:

1. store-all, when the reference order fits (no extra compute: optimal);
2. ``chain_dp`` when the graph splits into a chain of stages (optimal for chains);
3. ``eviction`` (fixed order) and ``order_search`` (free order), the fast warm starts;
   then the low-memory recipe of :func:`~solver.methods.minpeak.min_peak_sequence`,
   which reaches every budget that :class:`~solver.InfeasibleBudget` reports;
4. an exact method (``cpsat``, ``checkmate_milp``) on small graphs when time is left,
   warm-started from the best schedule so far.

Every candidate is graded by :func:`solver.simulate`; the cheapest valid one within the
budget wins (fewest steps on ties). ``schedule.info["auto"]`` records what was tried,
what won and why; ``schedule.method`` reads ``"auto:<winner>"``.
"""

from __future__ import annotations

import logging
import math
import time as _time

from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound, SolverError
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["solve_auto", "EXACT_MAX_OPS"]

log = logging.getLogger(__name__)

#: Graphs with at most this many ops get an exact method when time is left.
EXACT_MAX_OPS = 60


def _registered(name: str):
    from solver.registry import methods

    info = methods().get(name)
    return info


def _default_limit(n: int) -> float:
    return 10.0 if n <= 300 else 60.0


def solve_auto(graph: ComputeGraph, budget: int, *, time_limit: float | None = None, **options) -> Schedule:
    """Pick methods by graph shape and size; return the best simulated valid schedule.

    Parameters
    ----------
    graph : ComputeGraph
    budget : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds in all (default 10 s up to 300 ops, else 60 s). Fast heuristics always
        run; exact methods and lower bounds only get the time that is left.
    **options
        ``exact=False`` skips the exact methods; ``bound=False`` skips the lower bound.

    Returns
    -------
    Schedule
        ``method == "auto:<winner>"``; ``info["auto"]`` has ``picked``, ``why`` and
        ``tried`` (cost or error of every candidate).

    Raises
    ------
    NoScheduleFound
        No candidate fits (the budget is above the proven lower bound).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(5)
    >>> s = solve_auto(g, 7)
    >>> s.method.startswith("auto:"), s.info["auto"]["picked"] == s.method[5:]
    (True, True)
    """
    from solver.methods.eviction import IndexedGraph, order_peak
    from solver.methods.minpeak import min_peak_sequence

    t0 = _time.perf_counter()
    ix = IndexedGraph.of(graph)
    n = ix.n
    limit = _default_limit(n) if time_limit is None else float(time_limit)
    deadline = t0 + limit
    use_exact = options.pop("exact", True)
    use_bound = options.pop("bound", True)
    tried: dict[str, object] = {}
    best: list = [None, None, None]  # schedule, key, why

    def consider(name: str, sched: Schedule | None, why: str) -> None:
        if sched is None:
            return
        r = simulate(graph, sched)
        if not r.valid or r.peak_bytes > budget:
            tried[name] = f"rejected: {'invalid' if not r.valid else 'over budget'}"
            return
        tried[name] = r.cost
        key = (r.cost, len(sched.sequence))
        if best[1] is None or key < best[1]:
            best[0], best[1], best[2] = sched, key, why

    def run(name: str, why: str, **kw) -> None:
        info = _registered(name)
        if info is None:
            return
        try:
            consider(name, info.fn(graph, budget, **kw), why)
        except (SolverError, InfeasibleBudget, ValueError, NotImplementedError, MemoryError) as exc:
            tried[name] = f"{type(exc).__name__}: {exc}"[:200]

    def left() -> float:
        return deadline - _time.perf_counter()

    # 1. store-all
    if order_peak(ix, range(n)) + ix.fixed <= budget:
        run("store_all", "the reference order fits the budget: no extra compute")
    else:
        # 2. chains
        run("chain_dp", "the graph is a chain of stages: the DP is optimal for chains",
            time_limit=max(0.1, min(2.0, left())))
        # 3. fast heuristics
        run("eviction", "DTR-style eviction on the reference order",
            time_limit=max(0.1, min(2.0, left())))
        run("order_search", "memory-aware reordering removes recomputation",
            time_limit=max(0.5, 0.6 * left()))
        if best[0] is None:
            seq = min_peak_sequence(ix, budget, deadline=t0 + limit)
            if seq is not None:
                consider("min_peak", Schedule(sequence=[ix.ids[i] for i in seq], method="min_peak",
                                              info={"order": "free"}),
                         "the low-memory recipe is the only one that fits")
        # 4. exact methods on small graphs, warm-started
        extra = best[0] is not None and best[1][0] > graph.total("time") * (1 + 1e-12)
        if use_exact and n <= EXACT_MAX_OPS and left() > 1.0 and (best[0] is None or extra):
            hint = best[0] if best[0] is not None and best[0].info.get("order") == "fixed" else None
            for name in ("cpsat", "checkmate_milp"):
                if left() <= 1.0:
                    break
                kw = {"time_limit": max(0.5, 0.5 * left())}
                if hint is not None:
                    kw["hint"] = hint
                run(name, "exact method on a small graph, warm-started from the heuristics", **kw)
    sched, key, why = best
    if sched is None:
        raise NoScheduleFound(
            f"auto found no schedule of {graph.name or 'the graph'} within {budget} B "
            f"(tried {', '.join(tried) or 'nothing'}); give more time or a larger budget"
        )
    picked = sched.method or next(k for k, v in tried.items() if v == key[0])
    base = graph.total("time")
    order_kind = sched.info.get("order", "fixed")
    if sched.lower_bound is None or sched.lower_bound < base:
        sched.lower_bound = base if key[0] <= base * (1 + 1e-12) else sched.lower_bound
    if use_bound and sched.lower_bound is None and order_kind == "fixed" and left() > 1.0:
        try:
            from solver.methods import milp

            lb = milp.lower_bound(graph, budget, time_limit=max(0.5, left()), order="fixed")
            if lb is not None and math.isfinite(lb):
                sched.lower_bound = min(float(lb), key[0])
        except (ImportError, AttributeError, SolverError, ValueError) as exc:
            log.debug("no lower bound for %s: %s", graph.name, exc)
    sched.info = dict(sched.info)
    sched.info["auto"] = {"picked": picked, "why": why, "tried": tried, "ops": n,
                          "time_limit": limit}
    sched.method = f"auto:{picked}"
    return sched

"""``lp_eviction``: eviction on the reference order, guided by the stage LP's relaxed plan.

:func:`solver.bounds.stage_lp_bound` at the step most over the budget tells, in its
relaxed optimum, which values stay live there and which are dropped and computed again.
Eviction (:mod:`solver.methods.eviction`) then runs with every score, the score of each
value the LP drops (live fraction below one half) scaled down by :data:`DROPPED`, so
that those go first; the recomputations each sequence does not need are then removed
(:func:`~solver.methods.auto.drop_recomputations`), cheapest passes first while
time is left. The cheapest sequence wins; the
LP's bound comes with it as ``lower_bound`` (a fixed-order bound, and the sequence
keeps the reference order).
"""

from __future__ import annotations

import math
import time as _time

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.indexed import IndexedGraph
from solver.methods.eviction import SCORES
from solver.registry import register
from solver.schedule import Schedule

__all__ = ["lp_eviction", "DROPPED"]

#: The factor on the eviction score of a value that the LP drops.
DROPPED = 0.02


@register("lp_eviction", family="heuristic", order="fixed")
def lp_eviction(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
                scores: tuple = SCORES, ix: IndexedGraph | None = None) -> Schedule:
    """Eviction on the reference order with scores scaled by the stage LP's plan.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds in all: the LP gets half at most, the eviction passes the rest (one
        always runs).
    scores : tuple of str
        Eviction scores to try, from :data:`~solver.methods.eviction.SCORES`.
    ix : IndexedGraph, optional
        ``IndexedGraph.of(graph)``, when the caller has it (one pass over the edges
        saved: a second on dense graphs of thousands of ops).

    Returns
    -------
    Schedule
        ``info["order"] == "fixed"``, ``info["score"]`` of the winner;
        ``lower_bound`` the LP's bound when it was solved.

    Raises
    ------
    NoScheduleFound
        No pass fits the budget.

    Notes
    -----
    One LP (``ops`` variables, ``edges`` constraints), then one eviction pass and one
    removal pass (a simulation per recomputation) per score, the passes of least cost
    first.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver import simulate
    >>> g = training_chain(6)
    >>> s = lp_eviction(g, 8)
    >>> r = simulate(g, s); r.valid and r.peak_bytes <= 8
    True
    """
    from solver.bounds import reference_facts, stage_lp_bound, worst_step

    t0 = _time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    ix = ix or IndexedGraph.of(graph)
    live: dict = {}
    bound = None
    lp_time = None if time_limit is None else 0.5 * time_limit

    def lp_has_time() -> bool:  # the setup alone may take that on dense graphs
        return deadline is None or _time.perf_counter() < t0 + lp_time

    if lp_has_time():
        reference = reference_facts(graph)  # one pass over the edges for both
        step = worst_step(graph, budget_bytes, reference)
        if step is not None and lp_has_time():
            bound = stage_lp_bound(graph, budget_bytes, boundaries=[step], time_limit=lp_time, kept=live,
                                   reference=reference)
    if bound is not None and math.isinf(bound):
        raise NoScheduleFound(f"no schedule of {graph.name or 'the graph'} that keeps the reference order fits "
                              f"{budget_bytes} B (the stage LP is infeasible); try method='order_search'")
    from solver.methods.drop import drop_recomputations
    from solver.methods.eviction import evict_sequence
    from solver.simulate import simulate

    priority = [DROPPED if live.get(v, 1.0) < 0.5 else 1.0 for v in ix.ids]
    passes = []
    for k, sc in enumerate(scores):
        if k and deadline is not None and _time.perf_counter() > deadline:
            break  # a pass begun now would fail at its first eviction
        seq = evict_sequence(ix, range(ix.n), budget_bytes, score=sc, deadline=deadline, priority=priority)
        if seq is not None:
            passes.append((sum(ix.time[v] for v in seq), len(seq), sc, seq))
    # the removals cost a simulation each: the cheapest passes first, while time is left
    best, best_key, info = None, None, {}
    for _, _, sc, seq in sorted(passes, key=lambda p: p[:2]):
        if best is not None and deadline is not None and _time.perf_counter() > deadline:
            break
        ids = drop_recomputations(graph, [ix.ids[i] for i in seq], budget_bytes, deadline=deadline)
        key = (simulate(graph, ids).cost, len(ids))
        if best_key is None or key < best_key:
            best, best_key, info = ids, key, {"score": sc}
    if best is None:
        raise NoScheduleFound(f"lp_eviction found no schedule of {graph.name or 'the graph'} within "
                              f"{budget_bytes} B in the reference order; try method='order_search' or a "
                              f"larger budget")
    return Schedule(sequence=best, method="lp_eviction",
                    lower_bound=bound, info={"order": "fixed", **info})

"""Which forward values to keep for the backward, as a covering MILP over the steps.

A training step on its reference order, store-all, is over the budget at some steps. A
forward value ``u`` that the backward reads can instead be freed after its last forward
reader ``p(u)`` and computed again just before its first backward reader ``s(u)``
(:func:`solver.plans.sequence_from_keep`): that frees ``bytes(u)`` at every step strictly
between ``p(u)`` and ``s(u)``, for the time of ``u`` and of the inputs that are not
resident at ``s(u)`` (its *closure*). :func:`cover_keep` picks the values to free so that
the bytes freed at each step cover that step's excess over the budget, at the least
time -- a set-multicover problem, solved as a small MILP (SCIP):

* ``x_u`` in {0, 1}: ``u`` is freed; cost: the time of ``u`` and of the other ops of its
  closure (from the values that the store-all run holds at ``s(u)``), each op charged
  once however many closures hold it (the backward's first copy serves the later ones);
* a freed value ``j`` that the closure of a freed ``u`` reads, with ``s(u)`` inside
  ``j``'s gap, is computed again at ``s(u)`` already and stays from there on: ``j``
  frees its bytes from ``s(u)`` on only while no such ``u`` is freed (one variable
  per piece of ``j``'s gap, at most ``x_j`` and ``1 - x_u``);
* at each step ``t`` over the budget by ``e_t`` bytes: the freed pieces that hold ``t``
  add up to ``e_t`` at least, less a slack charged far above any time. Steps that the
  same pieces hold form a run, and only its most over step gets a constraint (the
  others' are implied; a run's shortfall, where the pieces cannot cover it, is charged
  once).

What the cover leaves out -- the memory of the recomputations themselves, closures that
change with what is freed -- is left to the staged relief that follows
(:func:`solver.methods.staged.relieve`). ``margin`` covers the excess over a lower
budget, which leaves room for those. ``cover`` (fixed order) is that schedule, the
recomputations the budget does not need removed.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Hashable

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.indexed import IndexedGraph, peak_profile
from solver.registry import register
from solver.schedule import Schedule

__all__ = ["cover", "cover_keep", "relieved_from_keep", "MARGINS", "MAX_CLOSURE", "KEEP_SHARE"]

log = logging.getLogger(__name__)

#: The margins :func:`cover` tries, of the budget left below it for recomputations.
MARGINS = (0.0, 0.01, 0.02, 0.05)
#: With a time limit, the share of the time left that the MILP of one margin may take
#: (the relief after it takes the rest; docs/tuning.md).
KEEP_SHARE = 0.7
#: A closure may hold at most this many ops (past it the value is not a candidate).
MAX_CLOSURE = 64


def _closure(ix: IndexedGraph, u: int, s: int, resident) -> tuple[list[int], set[int]] | None:
    """The ops that computing ``u`` again just before step ``s`` runs (``u`` first), from
    the inputs that are ``resident(j, s)``, and those inputs; None past
    :data:`MAX_CLOSURE` ops or at an op that cannot run twice."""
    members = [u]
    seen = {u}
    inputs = set()
    k = 0
    while k < len(members):
        x = members[k]
        k += 1
        if not ix.recomputable[x] or len(members) > MAX_CLOSURE:
            return None
        for j in ix.preds[x]:
            if j in seen or j in inputs:
                continue
            if resident(j, s):
                inputs.add(j)
            else:
                seen.add(j)
                members.append(j)
    return members, inputs


def cover_keep(graph: ComputeGraph, budget_bytes: int, *, margin: float = 0.0, time_limit: float | None = None,
               ix: IndexedGraph | None = None) -> set[Hashable] | None:
    """The forward values to keep for the backward: the covering MILP of the module.

    Parameters
    ----------
    graph : ComputeGraph
        A training graph (ops with ``phase`` ``"forward"`` and ``"backward"``).
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    margin : float
        Cover the excess over ``(1 - margin)`` times the budget less the fixed bytes.
    time_limit : float, optional
        Seconds for the MILP; its best answer by then is taken.
    ix : IndexedGraph, optional
        ``IndexedGraph.of(graph)``, when the caller has it.

    Returns
    -------
    set or None
        Node ids of the forward values that the backward reads and that stay resident for
        it, for :func:`~solver.plans.sequence_from_keep` (all of them when no step is over
        the budget or none can go); None when the MILP found nothing.

    Notes
    -----
    One binary variable per forward value read by the backward, one continuous variable
    per piece of its gap, one constraint per step over the budget.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver.plans import sequence_from_keep
    >>> from solver import simulate
    >>> g = training_chain(6)
    >>> keep = cover_keep(g, 7)
    >>> r = simulate(g, sequence_from_keep(g, keep)); r.valid, r.peak_bytes <= 7
    (True, True)
    """
    from solver.deadline import Deadline, OutOfTime

    deadline = Deadline(time_limit)
    ix = ix or IndexedGraph.of(graph)
    n = ix.n
    nodes = graph.nx.nodes
    forward = [nodes[v]["phase"] == "forward" for v in ix.ids]
    room = (1.0 - margin) * (int(budget_bytes) - ix.fixed)
    profile = peak_profile(ix, range(n))
    over = {t: x - room for t, x in enumerate(profile) if x > room}
    saved = {v for v in range(n) if forward[v] and any(not forward[s] for s in ix.succs[v])}
    if not over:
        return {ix.ids[v] for v in saved}
    steps = sorted(over)
    last = [n if ix.output[v] else max(ix.succs[v], default=v) for v in range(n)]
    gap: dict[int, tuple[int, int]] = {}  # candidate -> (last forward reader, first backward reader)
    for u in range(n):
        if not forward[u] or ix.pinned[u] or not ix.nbytes[u]:
            continue
        back = [s for s in ix.succs[u] if not forward[s]]
        if not back:
            continue
        s = min(back)
        p = max((r for r in ix.succs[u] if r < s), default=u)
        i = bisect.bisect_right(steps, p)
        if s - p > 1 and i < len(steps) and steps[i] < s:  # a step over the budget in the gap
            gap[u] = (p, s)

    def resident(j: int, s: int) -> bool:
        """Resident at ``s`` in the store-all run."""
        return j < s <= last[j]

    closure: dict[int, list[int]] = {}
    pulls: dict[int, dict[int, list[int]]] = {}  # j -> step -> the values computed again there from j
    for u, (p, s) in gap.items():
        got = _closure(ix, u, s, resident)
        if got is None:
            continue
        closure[u], inputs = got
        for j in inputs:
            if j in gap and gap[j][0] < s < gap[j][1]:
                pulls.setdefault(j, {}).setdefault(s, []).append(u)
    if not closure:
        return {ix.ids[v] for v in saved}
    try:
        freed = _cover_program(ix, closure, pulls, gap, over, steps, deadline)
    except OutOfTime:
        return None
    if freed is None:
        return None
    log.debug("cover_keep: %d of %d candidates freed", len(freed), len(closure))
    return {ix.ids[v] for v in saved - freed}


def _cover_program(ix: IndexedGraph, closure: dict, pulls: dict, gap: dict, over: dict, steps: list,
                   deadline) -> set[int] | None:
    """The covering MILP of :func:`cover_keep`, solved within ``deadline``: the values
    freed, or None when SCIP found nothing (:class:`~solver.deadline.OutOfTime` while
    it is built)."""
    from solver.lp_backend import create_solver, solve_quietly

    lp = create_solver("SCIP")
    x = {u: lp.IntVar(0.0, 1.0, "") for u in closure}
    objective = lp.Objective()
    # the time of each op computed again, once however many closures run it (the copy
    # made for the first serves the later ones)
    again: dict[int, object] = {}
    for u, members in closure.items():
        objective.SetCoefficient(x[u], ix.time[u])
        for m in members[1:]:
            r = again.get(m)
            if r is None:
                r = again[m] = lp.NumVar(0.0, 1.0, "")
                objective.SetCoefficient(r, ix.time[m])
            k = lp.Constraint(0.0, lp.infinity())
            k.SetCoefficient(r, 1.0)
            k.SetCoefficient(x[u], -1.0)
    # the bytes each freed value frees at each step: its gap, cut where a freed value
    # whose closure reads it computes it again earlier (it stays from there on); a piece
    # (first step, step after its last, variable, bytes)
    pieces = []
    for j, var in x.items():
        deadline.check("building the cover")
        p, s = gap[j]
        pullers = pulls.get(j, {})
        start, prev = p + 1, var
        for c in sorted(pullers) + [s]:
            pieces.append((start, c, prev, ix.nbytes[j]))
            if c == s:
                break
            z = lp.NumVar(0.0, 1.0, "")
            k = lp.Constraint(-lp.infinity(), 0.0)
            k.SetCoefficient(z, 1.0)
            k.SetCoefficient(prev, -1.0)
            for u in pullers[c]:
                k2 = lp.Constraint(-lp.infinity(), 1.0)
                k2.SetCoefficient(z, 1.0)
                k2.SetCoefficient(x[u], 1.0)
            start, prev = c, z
    # the steps over the budget, in runs that the same pieces hold: one constraint per
    # run, at its most over step (on a 32-layer capture, where thousands of steps are
    # over the budget, one per step, each listing every piece that holds it, took tens
    # of seconds to build; on 120 random training graphs the schedules are those of the
    # program with one per step, or cheaper)
    spans = []
    cuts = {0}
    for start, end, var, nbytes in pieces:
        a, b = bisect.bisect_left(steps, start), bisect.bisect_left(steps, end)
        if a < b:
            spans.append((a, b, var, nbytes))
            cuts.update((a, b))
    cuts = sorted(c for c in cuts if c < len(steps))
    run = {c: i for i, c in enumerate(cuts)}
    enter: list[list] = [[] for _ in cuts]
    leave: list[list] = [[] for _ in cuts]
    for a, b, var, nbytes in spans:
        enter[run[a]].append((var, nbytes))
        if b < len(steps):
            leave[run[b]].append((var, nbytes))
    big = 10.0 * (sum(ix.time) + 1.0)
    scale = 1.0 / max(1.0, max(over.values()))
    active: dict = {}  # the pieces that hold the run: variable -> bytes
    for i, c in enumerate(cuts):
        deadline.check("building the cover")
        for var, _ in leave[i]:
            del active[var]
        active.update(enter[i])
        end = cuts[i + 1] if i + 1 < len(cuts) else len(steps)
        slack = lp.NumVar(0.0, lp.infinity(), "")
        objective.SetCoefficient(slack, big)
        k = lp.Constraint(max(over[t] for t in steps[c:end]) * scale, lp.infinity())
        k.SetCoefficient(slack, 1.0)
        for var, nbytes in active.items():
            k.SetCoefficient(var, nbytes * scale)
    objective.SetMinimization()
    deadline.check("building the cover")
    left = deadline.left()
    if left != float("inf"):
        lp.SetTimeLimit(max(1, int(1000 * left)))
    status = solve_quietly(lp)
    if status not in (lp.OPTIMAL, lp.FEASIBLE):
        return None
    return {u for u, var in x.items() if var.solution_value() > 0.5}


def relieved_from_keep(graph: ComputeGraph, keep, budget_bytes: int, *, deadline: float | None = None,
                       ix: IndexedGraph | None = None) -> tuple[list | None, list]:
    """The schedule that keeps ``keep`` for the backward
    (:func:`~solver.plans.sequence_from_keep`), its stages still over the budget relieved
    (:func:`solver.methods.staged.relieve`) and the recomputations the budget does not
    need removed (:func:`~solver.methods.drop.drop_recomputations`).

    Returns
    -------
    (list or None, list)
        The schedule (None when the relief fails or it does not fit) and the plain
        :func:`~solver.plans.sequence_from_keep` sequence.
    """
    from solver.methods.drop import drop_recomputations
    from solver.methods.staged import StagedPlan, relieve
    from solver.plans import sequence_from_keep
    from solver.simulate import simulate

    ix = ix or IndexedGraph.of(graph)
    try:
        seq = sequence_from_keep(graph, keep)
    except NoScheduleFound:
        return None, []
    index = {v: i for i, v in enumerate(ix.ids)}
    plan = StagedPlan.of_sequence(ix, range(ix.n), [index[v] for v in seq])
    if not relieve(plan, int(budget_bytes) - ix.fixed, deadline=deadline):
        return None, seq
    ids = drop_recomputations(graph, [ix.ids[i] for i in plan.sequence()], budget_bytes, deadline=deadline)
    r = simulate(graph, ids)
    return (ids if r.valid and r.peak_bytes <= budget_bytes else None), seq


@register("cover", family="heuristic", order="fixed")
def cover(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
          margins: tuple = MARGINS, ix: IndexedGraph | None = None) -> Schedule:
    """Keep for the backward what the covering MILP keeps (:func:`cover_keep`), relieve
    what is still over the budget, drop what the budget does not need; the cheapest over
    ``margins``.

    Parameters
    ----------
    graph : ComputeGraph
        A training graph.
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds in all (one margin always runs).
    margins : tuple of float
        The ``margin`` of each :func:`cover_keep`.
    ix : IndexedGraph, optional
        ``IndexedGraph.of(graph)``, when the caller has it (one pass over the edges
        saved: a second on dense graphs of thousands of ops).

    Returns
    -------
    Schedule
        ``info["order"] == "fixed"``, ``info["margin"]`` of the winner.

    Raises
    ------
    NoScheduleFound
        No margin gives a schedule within the budget.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver import simulate
    >>> g = training_chain(6)
    >>> r = simulate(g, cover(g, 7)); r.valid and r.peak_bytes <= 7
    True
    """
    from solver.simulate import simulate

    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    ix = ix or IndexedGraph.of(graph)
    best, best_key, info = None, None, {}
    longest = 0.0  # seconds of the longest margin so far, its relief included
    for k, margin in enumerate(margins):
        started = time.perf_counter()
        if k and deadline is not None and deadline - started < longest:
            break  # another margin would not end in time
        left = None if deadline is None else max(0.0, deadline - started)
        keep = cover_keep(graph, budget_bytes, margin=margin, time_limit=None if left is None else KEEP_SHARE * left,
                          ix=ix)
        longest = max(longest, time.perf_counter() - started)
        if keep is None:
            continue
        ids, _ = relieved_from_keep(graph, keep, budget_bytes, deadline=deadline, ix=ix)
        key = None if ids is None else (simulate(graph, ids).cost, len(ids))
        longest = max(longest, time.perf_counter() - started)
        if key is None:
            continue
        if best_key is None or key < best_key:
            best, best_key, info = ids, key, {"margin": margin}
    if best is None:
        raise NoScheduleFound(f"cover found no schedule of {graph.name or 'the graph'} within {budget_bytes} B "
                              f"in the reference order; try method='lns' or 'staged' recomputation in auto")
    return Schedule(sequence=best, method="cover", info={"order": "fixed", **info})

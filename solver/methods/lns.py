"""Large neighbourhood search over the recomputations of a fixed-order schedule.

A schedule from a constructive heuristic (eviction, staged recomputation) fixes its
recomputations one at a time and never takes one back. :func:`improve_sequence` takes
some back and plans again: each round *ruins* the current sequence -- removes every
repeat of one value, a random share of the repeats, or every repeat in a window of
stages -- so that the values stay resident and some stages go over the budget, then *repairs* it with the relief rule of
staged recomputation (:func:`solver.methods.staged.relieve`: recompute, at its next
read, the value held across the fullest stage that frees the most bytes per second of
compute), with the removed value kept out of the choice and the candidates' ratios
perturbed, and drops the repeats the budget does not need
(:func:`~solver.methods.drop.drop_recomputations`). The simulator grades every
repaired sequence; one that costs no more than the current one, or little more than
the cheapest seen (:data:`DRIFT`; record-to-record travel, Dueck 1993), replaces the
current one (so the search can leave a local optimum), and the cheapest seen is
returned; the order of first runs stays the start's, so a fixed-order bound still holds
for the result. Shaw, "Using Constraint Programming and Local Search Methods to Solve
Vehicle Routing Problems" (CP 1998) and Ropke and Pisinger (2006) describe the scheme.

The staged plan charges a value held into a stage for the whole stage, so it may see a
stage over the budget that the simulator does not; the repair holds each stage only to
the larger of the budget and the memory the plan of the current sequence gives it, so
that such stages are left as they are.

``lns`` (fixed order) builds several schedules (``lp_eviction``, staged recomputation,
``cover``, :func:`lp_starts`) and searches from the cheapest ones.
"""

from __future__ import annotations

import logging
import random
import time as _time
from typing import Hashable, Sequence

import numpy as np

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.indexed import IndexedGraph
from solver.methods.drop import drop_recomputations, dropped_and_graded
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["improve_sequence", "lns", "lp_starts", "CANDIDATES", "DRIFT", "NOISE", "START_SHARE", "COVER_SHARE", "STARTS",
           "WINDOW"]

log = logging.getLogger(__name__)

# Each constant says what it controls; the runs that set them are in docs/tuning.md,
# under their names.

#: Stages in a window ruin, as a fraction of the ops (at least 4 stages).
WINDOW = 0.02
#: Share of ``lns``'s time for its starts (past it, a start still runs while none fits).
START_SHARE = 0.4
#: Of that, the share ``cover`` may take (the other starts follow).
COVER_SHARE = 0.5
#: How many of the cheapest starts ``lns`` takes turns on.
STARTS = 3
#: How much the repair may scale the candidates' ratios (one drawn per round).
NOISE = (0.3, 1.0, 3.0)
#: How many candidates the repair weighs per step (one drawn per round).
CANDIDATES = (8, 16, 32)
#: A repaired sequence replaces the current one when it costs no more than it, or than
#: the cheapest found plus this share of that one's extra compute (record-to-record travel).
DRIFT = 0.01
#: Costs this close (relative) are equal.
_ULPS = 1e-12


def _ruin(seq: list[int], rng: random.Random, time: list[float], n: int) -> tuple[list[int], frozenset]:
    """The sequence with some repeats removed, and the values to keep out of the repair."""
    seen: set = set()
    repeats = []  # (step, value, stage)
    stage = 0
    for i, v in enumerate(seq):
        if v in seen:
            repeats.append((i, v, stage))
        else:
            seen.add(v)
            stage += 1
    if not repeats:
        return seq, frozenset()
    kind = rng.random()
    if kind < 0.2:
        # every repeat of one value, chosen by its recomputation time
        weights = [time[v] + 1e-12 for _, v, _ in repeats]
        _, u, _ = rng.choices(repeats, weights=weights)[0]
        gone = {i for i, v, _ in repeats if v == u}
        avoid = frozenset({u})
    elif kind < 0.4:
        # a random share of the repeats
        share = rng.uniform(0.1, 0.4)
        gone = {i for i, _, _ in repeats if rng.random() < share}
        avoid = frozenset()
    else:
        # every repeat in a window of stages around one of them
        _, _, s = rng.choice(repeats)
        w = max(4, int(rng.uniform(0.5, 4) * WINDOW * n))
        lo = s - rng.randint(0, w)
        gone = {i for i, _, t in repeats if lo <= t <= lo + w}
        avoid = frozenset()
    return [v for i, v in enumerate(seq) if i not in gone], avoid


def improve_sequence(graph: ComputeGraph, sequence: Sequence[Hashable], budget_bytes: int, *,
                     deadline: float, seed: int = 0, ix: IndexedGraph | None = None,
                     more: Sequence[Sequence[Hashable]] = (), stop=None) -> list[Hashable]:
    """A cheaper schedule of the same first-run order as ``sequence``, by large
    neighbourhood search (see the module), or ``sequence`` itself.

    Parameters
    ----------
    graph : ComputeGraph
    sequence : sequence of node ids
        A valid schedule within the budget; its order of first runs is kept.
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    deadline : float
        ``time.perf_counter()`` value at which the search stops.
    seed : int
        Seed of the ruins and the perturbed ratios.
    ix : IndexedGraph, optional
        ``IndexedGraph.of(graph)``, when the caller has it.
    more : sequence of sequences, optional
        Other starts with the same order of first runs (the others are left out): every
        other round goes to the cheapest current schedule, the others take turns.
    stop : callable, optional
        Checked before each round: the search ends once it returns True (a bound
        computed beside it has closed the gap).

    Returns
    -------
    list
        The cheapest schedule found, graded by :func:`solver.simulate` (valid, within the
        budget, costing no more than the cheapest start); ``sequence`` when no start is a
        valid fixed-order schedule within the budget.

    Notes
    -----
    Each round: one plan of the ruined sequence (``ops^2`` booleans), the relief steps of
    the repair, one removal pass and one simulation.

    Examples
    --------
    >>> import time
    >>> from solver.synthetic import training_chain
    >>> from solver.methods.eviction import eviction
    >>> g = training_chain(8)
    >>> seq = eviction(g, 10, scores=("lru",)).sequence
    >>> better = improve_sequence(g, seq, 10, deadline=time.perf_counter() + 0.5)
    >>> simulate(g, better).cost <= simulate(g, seq).cost
    True
    """
    from solver.methods.staged import StagedPlan, relieve

    ix = ix or IndexedGraph.of(graph)
    n = ix.n
    index = {v: i for i, v in enumerate(ix.ids)}
    seen: set = set()
    order = [index[v] for v in sequence if v in index and not (v in seen or seen.add(v))]
    cap = int(budget_bytes) - ix.fixed
    best, best_cost = list(sequence), None
    states = []  # [current sequence (indices), its cost, the per-stage caps of its repairs]
    for seq in [sequence, *more]:
        r = simulate(graph, seq)
        if not r.valid or r.peak_bytes > budget_bytes:
            continue
        if best_cost is None or r.cost < best_cost * (1 - _ULPS):
            best, best_cost = list(seq), r.cost
        cur = [index[v] for v in seq]
        seen: set = set()
        if r.recomputations and [v for v in cur if not (v in seen or seen.add(v))] == order:
            states.append([cur, r.cost, np.maximum(cap, StagedPlan.of_sequence(ix, order, cur).memory)])
    rng = random.Random(seed)
    rounds = 0
    while states and _time.perf_counter() < deadline and not (stop is not None and stop()):
        # every other round goes to the cheapest state, the others take turns
        state = min(states, key=lambda x: x[1]) if rounds % 2 else states[(rounds // 2) % len(states)]
        rounds += 1
        ruined, avoid = _ruin(state[0], rng, ix.time, n)
        if len(ruined) == len(state[0]):
            continue
        plan = StagedPlan.of_sequence(ix, order, ruined)
        if not relieve(plan, state[2], deadline=deadline, avoid=avoid, rng=rng, noise=rng.choice(NOISE),
                       max_candidates=rng.choice(CANDIDATES)):
            continue
        ids, r = dropped_and_graded(graph, [ix.ids[i] for i in plan.sequence()], budget_bytes, deadline=deadline)
        if not r.valid or r.peak_bytes > budget_bytes or r.cost > max(state[1] * (1 + _ULPS),
                                                                      best_cost + DRIFT * (best_cost - r.base_cost)):
            continue
        cur = [index[v] for v in ids]
        state[:] = [cur, r.cost, np.maximum(cap, StagedPlan.of_sequence(ix, order, cur).memory)]
        if r.cost < best_cost * (1 - _ULPS) or (r.cost <= best_cost * (1 + _ULPS) and len(ids) < len(best)):
            best, best_cost = ids, r.cost
    log.debug("lns: %d rounds from %d starts, cost %s", rounds, len(states), best_cost)
    return best


def lp_starts(graph: ComputeGraph, budget_bytes: int, *, deadline: float, rounds: int = 6,
              ix: IndexedGraph | None = None):
    """Schedules of the reference order built from the stage LP's plan, two per round.

    Round 1 solves :func:`solver.bounds.stage_lp_bound` at the step most over the budget;
    the forward values read by the backward that the LP keeps live there (fraction at
    least one half) are kept and the others computed again for the backward
    (:func:`solver.plans.sequence_from_keep`) -- and, for a second schedule, every forward
    value it keeps live, those that only the forward reads included; staged relief
    (:func:`solver.methods.staged.relieve`) brings the stages still over the budget
    under it and :func:`~solver.methods.drop.drop_recomputations` removes what the
    budget does not need. Each next round adds, as a boundary of the LP, the later step
    that the previous round's second kept set left most over the budget (row
    generation).

    Yields
    ------
    list
        Valid sequences within the budget (node ids), until ``deadline`` or ``rounds``.
    """
    from solver.bounds import stage_lp_bound, worst_step
    from solver.methods.cover import relieved_from_keep

    ix = ix or IndexedGraph.of(graph)
    worst = worst_step(graph, budget_bytes)
    if worst is None:
        return
    nodes = graph.nx.nodes
    index = {v: i for i, v in enumerate(ix.ids)}
    forward = {v for v in graph.ops if nodes[v]["phase"] == "forward"}
    saved = {v for v in forward if any(nodes[w]["phase"] != "forward" for w in graph.op_succs(v))}
    marks = [index[worst]]
    for _ in range(rounds):
        if _time.perf_counter() > deadline:
            return
        live: dict = {}
        bound = stage_lp_bound(graph, budget_bytes, boundaries=[ix.ids[t] for t in marks], kept=live,
                               time_limit=max(0.0, deadline - _time.perf_counter()))
        if bound is None or not np.isfinite(bound) or not live:
            return
        # what the backward reads, and everything the LP holds (a value that a closure
        # reads then stays instead of being computed again: more memory, less time)
        for values in (saved, forward):
            ids, seq = relieved_from_keep(graph, {v for v in values if live.get(v, 1.0) >= 0.5}, budget_bytes,
                                          deadline=deadline, ix=ix)
            if not seq:
                return
            if ids is not None:
                yield ids
        raw = simulate(graph, seq)
        # the next boundary: the later first run whose stage the kept set leaves most over
        seen: set = set()
        stage, worst_over = -1, None
        for i, v in enumerate(seq):
            if v not in seen:
                seen.add(v)
                stage = index[v]
            over = int(raw.memory_curve[i]) - int(budget_bytes)
            if (over > 0 and stage > marks[0] and stage not in marks and nodes[ix.ids[stage]].get("group") is None
                    and (worst_over is None or over > worst_over[0])):
                worst_over = (over, stage)
        if worst_over is None:
            return
        marks = sorted(marks + [worst_over[1]])


@register("lns", family="search", order="fixed")
def lns(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None, seed: int = 0) -> Schedule:
    """Large neighbourhood search from the cheapest of ``cover``, ``lp_eviction``,
    staged recomputation and the stage LP's plans (:func:`lp_starts`) on the reference
    order, built in that order while their share of the time lasts.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds in all (default 10): the starts get :data:`START_SHARE` of them (more
        while none fits), the search the rest.
    seed : int
        Seed of the search.

    Returns
    -------
    Schedule
        ``info["order"] == "fixed"``; ``info["start"]`` the method it started from and
        ``info["start_cost"]`` that schedule's cost.

    Raises
    ------
    NoScheduleFound
        No start fits the budget.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(6)
    >>> s = lns(g, 8, time_limit=1)
    >>> r = simulate(g, s); r.valid and r.peak_bytes <= 8
    True
    """
    from solver.methods.cover import cover
    from solver.methods.guided import lp_eviction
    from solver.methods.staged import staged_sequence

    t0 = _time.perf_counter()
    limit = 10.0 if time_limit is None else float(time_limit)
    ix = IndexedGraph.of(graph)
    phase = t0 + START_SHARE * limit  # the starts stop here once one is found
    starts = []
    bound = None

    def left() -> float:
        return max(0.0, phase - _time.perf_counter())

    if graph.backward_nodes():
        try:
            s = cover(graph, budget_bytes, time_limit=COVER_SHARE * left(), ix=ix)
            starts.append((simulate(graph, s).cost, "cover", s.sequence))
        except NoScheduleFound:
            pass
    if not starts or left() > 0:
        try:
            s = lp_eviction(graph, budget_bytes, time_limit=left() if starts else max(left(), 0.5 * limit), ix=ix)
            starts.append((simulate(graph, s).cost, "lp_eviction", s.sequence))
            bound = s.lower_bound
        except NoScheduleFound:
            pass
    if not starts or left() > 0:
        end = _time.perf_counter() + (left() if starts else max(left(), 0.25 * limit))
        seq = staged_sequence(ix, range(ix.n), budget_bytes, deadline=end)
        if seq is not None:
            ids = drop_recomputations(graph, [ix.ids[i] for i in seq], budget_bytes, deadline=end)
            starts.append((simulate(graph, ids).cost, "staged", ids))
    if graph.backward_nodes() and left() > 0:
        for ids in lp_starts(graph, budget_bytes, deadline=phase, ix=ix):
            starts.append((simulate(graph, ids).cost, "stage_lp", ids))
    if not starts:
        raise NoScheduleFound(f"lns found no start within {budget_bytes} B for {graph.name or 'the graph'} in "
                              f"the reference order; try method='order_search' or a larger budget")
    starts.sort(key=lambda x: (x[0], len(x[2])))
    cost, name, start = starts[0]
    others, seen = [], {tuple(start)}
    for _, _, seq in starts[1:]:
        if tuple(seq) not in seen:
            seen.add(tuple(seq))
            others.append(seq)
    best = improve_sequence(graph, start, budget_bytes, deadline=t0 + limit, seed=seed, ix=ix,
                            more=others[:STARTS - 1])
    return Schedule(sequence=best, method="lns", lower_bound=bound,
                    info={"order": "fixed", "start": name, "start_cost": cost})

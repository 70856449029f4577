"""Baseline schedules: the yardsticks every other method is compared with.

All but :func:`store_all` checkpoint at the stage boundaries of
:func:`solver.plans.forward_stages` (the cut vertices of the forward graph, as in Chen
et al. 2016, "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174) and turn
the checkpoint set into a sequence with :func:`solver.plans.sequence_from_keep`. Each
searches its own knob for the cheapest setting whose simulated peak fits the budget and
raises :class:`~solver.errors.NoScheduleFound` when none does. Graphs without backward
ops have nothing to checkpoint: these methods then return the reference order when it
fits.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from graphs import ComputeGraph
from solver.methods.contract import chain_stages, store_all_candidate, store_all_fallback
from solver.plans import cheapest_fitting, sequence_from_keep, stage_regions
from solver.deadline import Deadline
from solver.errors import NoScheduleFound
from solver.registry import register
from solver.simulate import simulate
from solver.schedule import Schedule

__all__ = ["store_all", "checkpoint_all", "every_k", "chen_sqrt", "chen_greedy"]


@register("store_all", family="baseline", order="fixed")
def store_all(graph: ComputeGraph, budget_bytes: int | None = None, *, time_limit=None) -> Schedule:
    """Run every op once in the reference order and keep each value until its last use.

    Examples
    --------
    >>> g = ComputeGraph(); g.add_node("a"); g.add_node("b"); g.add_edge("a", "b")
    >>> store_all(g).sequence
    ['a', 'b']
    """
    sequence = list(graph.order)
    if budget_bytes is not None:
        peak = simulate(graph, sequence).peak_bytes
        if peak > budget_bytes:
            raise NoScheduleFound(f"store_all peaks at {peak} B, over the budget of {int(budget_bytes)} B; "
                                  "use a method that recomputes (e.g. method='auto')", best_peak=peak)
    return Schedule(sequence=sequence, method="store_all", lower_bound=graph.total("time"),
                    info={"order": "fixed"})


#: Share of ``time_limit`` in which a baseline builds and grades its settings: the judge
#: grades the one returned again (as long as that setting's own replay, at most).
WORK_SHARE = 0.5


def work_deadline(time_limit) -> Deadline | None:
    """The deadline of a baseline's settings (None without a time limit).

    >>> work_deadline(None) is None
    True
    """
    return None if time_limit is None else Deadline(WORK_SHARE * float(time_limit))


def _schedule(name: str, seq: list, info: dict) -> Schedule:
    info = dict(info)
    info.setdefault("order", "fixed")
    return Schedule(sequence=seq, method=name, info=info)


def _keep_every(stages, k: int) -> set:
    return {st.boundary for st in stages if st.index % k == k - 1}


@register("checkpoint_all", family="baseline", order="fixed")
def checkpoint_all(graph: ComputeGraph, budget_bytes: int, *, time_limit=None) -> Schedule:
    """Keep no forward value beyond what is forced; recompute everything for each stage.

    The memory-lean end of Chen et al.'s family: only non-recomputable values and step
    outputs are kept; before the backward of each stage, the forward values it reads are
    recomputed from the parameters and inputs (O(n^2) compute for a chain of n stages).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds; half of them for building and grading its one sequence, which on a
        long chain is long (O(S^2) steps for S stages).

    Returns
    -------
    Schedule

    Raises
    ------
    NoScheduleFound
        Its one schedule does not fit, or could not be built and graded in the time.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> checkpoint_all(training_chain(3), 100).sequence.count("f0")
    4
    """
    work = work_deadline(time_limit)
    stages = chain_stages(graph)
    if stages is None:
        return store_all_fallback(graph, budget_bytes, method="checkpoint_all", deadline=work)

    def one():
        yield (sequence_from_keep(graph, set(), regions=stage_regions(graph, stages), deadline=work),
               {"plan": "checkpoint_all", "stages": len(stages)})

    seq, info = cheapest_fitting(graph, one(), budget_bytes, method="checkpoint_all", deadline=work)
    return _schedule("checkpoint_all", seq, info)


def _every_k_candidates(graph, stages, ks, deadline=None) -> Iterator[tuple[list, dict]]:
    for k in ks:
        keep = _keep_every(stages, k)
        yield sequence_from_keep(graph, keep, deadline=deadline), {"plan": "every_k", "k": k,
                                                                    "checkpoints": len(keep),
                                                                    "stages": len(stages)}


def _outward(count: int) -> list[int]:
    """1..count, starting at Chen's segment length for ``count`` stages and going
    outward (the settings most likely to fit a tight budget first).

    >>> _outward(9)
    [3, 2, 4, 1, 5, 6, 7, 8, 9]
    """
    c = math.ceil(count / math.ceil(math.sqrt(count)))
    out = [c]
    for d in range(1, count):
        out += [k for k in (c - d, c + d) if 1 <= k <= count]
    return out


@register("every_k", family="baseline", order="fixed")
def every_k(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, k: int | None = None) -> Schedule:
    """Checkpoint the boundary of every ``k``-th stage; recompute each segment once.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds; the settings are built and graded in half of them, from Chen's
        ``k`` (about the square root of the number of stages) outward, and the cheapest
        that fits among those tried is the answer (``info["complete"]`` is False when
        the time ran out first).
    k : int, optional
        Stages per segment. Default: try every ``k`` from 1 to the number of stages and
        return the cheapest schedule that fits.

    Returns
    -------
    Schedule
        ``info["k"]`` is the setting used.

    Raises
    ------
    NoScheduleFound
        No ``k`` fits.
    ValueError
        ``k`` < 1.

    Notes
    -----
    O(S) simulations for S stages when ``k`` is not given (O(S^2 x stage size) in all).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> every_k(training_chain(6), 100, k=2).info["k"]
    2
    """
    if k is not None and int(k) < 1:
        raise ValueError(f"every_k needs k >= 1, got {k!r}")
    work = work_deadline(time_limit)
    stages = chain_stages(graph)
    if stages is None:
        return store_all_fallback(graph, budget_bytes, method="every_k", deadline=work)
    if k is not None:
        ks = [int(k)]
    else:
        ks = range(1, len(stages) + 1) if work is None else _outward(len(stages))
    cands = _every_k_candidates(graph, stages, ks, deadline=work)
    seq, info = cheapest_fitting(graph, cands, budget_bytes, method="every_k", deadline=work)
    return _schedule("every_k", seq, info)


@register("chen_sqrt", family="baseline", order="fixed")
def chen_sqrt(graph: ComputeGraph, budget_bytes: int, *, time_limit=None) -> Schedule:
    """Chen et al.'s sqrt(n) plan: about sqrt(S) equal segments of the S-stage chain.

    Store-all when it fits the budget (no recomputation needed), else checkpoint the
    boundaries of ``ceil(sqrt(S))`` segments of ``ceil(S / ceil(sqrt(S)))`` stages each
    and recompute each segment once during backward (Chen et al. 2016, section 4.1).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds; its two settings are built and graded in half of them, the sqrt plan
        first.

    Returns
    -------
    Schedule

    Raises
    ------
    NoScheduleFound
        Neither store-all nor the sqrt plan fits (in the time).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> s = chen_sqrt(training_chain(9), 8)
    >>> s.info["plan"], s.info["k"]
    ('chen_sqrt', 3)
    """
    work = work_deadline(time_limit)
    stages = chain_stages(graph)

    def cands():
        # the plan first: when time is short, it is the one that reaches low budgets
        if stages is not None:
            n = len(stages)
            k = math.ceil(n / math.ceil(math.sqrt(n)))
            for seq, info in _every_k_candidates(graph, stages, [k], deadline=work):
                yield seq, dict(info, plan="chen_sqrt")
        yield store_all_candidate(graph)

    seq, info = cheapest_fitting(graph, cands(), budget_bytes, method="chen_sqrt", deadline=work)
    return _schedule("chen_sqrt", seq, info)


def _greedy_keep(stages, sizes: list[int], threshold: float) -> set:
    """The boundaries Chen's greedy keeps at ``threshold`` (``sizes``: each stage's
    :func:`_stage_bytes`)."""
    keep = set()
    temp = 0
    for st, size in zip(stages, sizes):
        temp += size
        if temp > threshold:
            keep.add(st.boundary)
            temp = 0
    return keep


def _stage_bytes(graph, st) -> int:
    bwd = set(st.backward)
    return sum(
        int(graph[v]["bytes"]) for v in st.forward
        if v == st.boundary or any(w in bwd for w in graph.op_succs(v))
    ) or int(graph[st.boundary]["bytes"])


@register("chen_greedy", family="baseline", order="fixed")
def chen_greedy(
    graph: ComputeGraph, budget_bytes: int, *, time_limit=None, thresholds: int = 48
) -> Schedule:
    """Chen et al.'s greedy plan, its per-segment memory threshold searched.

    Walks the stages in order, adding each stage's bytes (the values its backward reads)
    to a running total, and checkpoints a stage's boundary when the total passes the
    threshold, then starts again from zero (Chen et al. 2016, Algorithm 1 with the
    "memory threshold" of section 4.1). The threshold is searched over a geometric grid
    between the smallest stage and the whole forward pass, and the cheapest plan whose
    simulated peak fits the budget wins.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds; the thresholds are built and graded in half of them, the smallest
        first, and the cheapest plan that fits among those tried is the answer
        (``info["complete"]`` is False when the time ran out first).
    thresholds : int
        Grid points of the threshold search.

    Returns
    -------
    Schedule
        ``info["threshold"]`` is the threshold used.

    Raises
    ------
    NoScheduleFound
        No threshold fits.

    Notes
    -----
    O(thresholds) simulations.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> s = chen_greedy(training_chain(8), 15)
    >>> s.info["plan"], s.info["checkpoints"] > 0
    ('chen_greedy', True)
    """
    work = work_deadline(time_limit)
    stages = chain_stages(graph)
    if stages is None:
        return store_all_fallback(graph, budget_bytes, method="chen_greedy", deadline=work)
    sizes = [_stage_bytes(graph, st) for st in stages]
    lo, hi = max(1, min(sizes)), max(1, sum(sizes))
    grid = sorted(set(np.unique(np.geomspace(lo, hi, num=max(2, int(thresholds)))).tolist()) | {0.0})

    def cands():
        seen = set()
        for b in grid:
            keep = frozenset(_greedy_keep(stages, sizes, b))
            if keep in seen:
                continue
            seen.add(keep)
            yield sequence_from_keep(graph, keep, deadline=work), {"plan": "chen_greedy", "threshold": b,
                                                                   "checkpoints": len(keep), "stages": len(stages)}

    seq, info = cheapest_fitting(graph, cands(), budget_bytes, method="chen_greedy", deadline=work)
    return _schedule("chen_greedy", seq, info)

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
from solver.plans import (
    cheapest_fitting,
    forward_stages,
    has_backward,
    sequence_from_keep,
    stage_regions,
)
from solver.errors import NoScheduleFound
from solver.registry import register
from solver.simulate import simulate
from solver.schedule import Schedule

__all__ = ["store_all", "checkpoint_all", "every_k", "chen_sqrt", "chen_greedy"]


@register("store_all", family="baseline", order="fixed")
def store_all(graph: ComputeGraph, budget_bytes: int | None = None, *, time_limit=None, **_) -> Schedule:
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


def _store_all_candidate(graph: ComputeGraph) -> tuple[list, dict]:
    return list(graph.order), {"plan": "store_all"}


def _stages_or_none(graph: ComputeGraph):
    if not has_backward(graph):
        return None
    stages = forward_stages(graph)
    return stages or None


def _schedule(name: str, seq: list, info: dict) -> Schedule:
    info = dict(info)
    info.setdefault("order", "fixed")
    return Schedule(sequence=seq, method=name, info=info)


def _keep_every(stages, k: int) -> set:
    return {st.boundary for st in stages if st.index % k == k - 1}


@register("checkpoint_all", family="baseline", order="fixed")
def checkpoint_all(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, **_) -> Schedule:
    """Keep no forward value beyond what is forced; recompute everything for each stage.

    The memory-lean end of Chen et al.'s family: only non-recomputable values and step
    outputs are kept; before the backward of each stage, the forward values it reads are
    recomputed from the parameters and inputs (O(n^2) compute for a chain of n stages).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Unused (the method answers at once).

    Returns
    -------
    Schedule

    Raises
    ------
    NoScheduleFound
        Its one schedule does not fit.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> checkpoint_all(training_chain(3), 100).sequence.count("f0")
    4
    """
    stages = _stages_or_none(graph)
    if stages is None:
        cands = [_store_all_candidate(graph)]
    else:
        seq = sequence_from_keep(graph, set(), regions=stage_regions(graph, stages))
        cands = [(seq, {"plan": "checkpoint_all", "stages": len(stages)})]
    seq, info = cheapest_fitting(graph, cands, budget_bytes, method="checkpoint_all")
    return _schedule("checkpoint_all", seq, info)


def _every_k_candidates(graph, stages, ks) -> Iterator[tuple[list, dict]]:
    for k in ks:
        keep = _keep_every(stages, k)
        yield sequence_from_keep(graph, keep), {"plan": "every_k", "k": k, "checkpoints": len(keep),
                                                 "stages": len(stages)}


@register("every_k", family="baseline", order="fixed")
def every_k(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, k: int | None = None, **_) -> Schedule:
    """Checkpoint the boundary of every ``k``-th stage; recompute each segment once.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Unused.
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
    O(S) simulations for S stages when ``k`` is not given.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> every_k(training_chain(6), 100, k=2).info["k"]
    2
    """
    if k is not None and int(k) < 1:
        raise ValueError(f"every_k needs k >= 1, got {k!r}")
    stages = _stages_or_none(graph)
    if stages is None:
        cands = [_store_all_candidate(graph)]
    else:
        ks = [int(k)] if k is not None else range(1, len(stages) + 1)
        cands = _every_k_candidates(graph, stages, ks)
    seq, info = cheapest_fitting(graph, cands, budget_bytes, method="every_k")
    return _schedule("every_k", seq, info)


@register("chen_sqrt", family="baseline", order="fixed")
def chen_sqrt(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, **_) -> Schedule:
    """Chen et al.'s sqrt(n) plan: about sqrt(S) equal segments of the S-stage chain.

    Store-all when it fits the budget (no recomputation needed), else checkpoint the
    boundaries of ``ceil(sqrt(S))`` segments of ``ceil(S / ceil(sqrt(S)))`` stages each
    and recompute each segment once during backward (Chen et al. 2016, section 4.1).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Unused.

    Returns
    -------
    Schedule

    Raises
    ------
    NoScheduleFound
        Neither store-all nor the sqrt plan fits.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> s = chen_sqrt(training_chain(9), 8)
    >>> s.info["plan"], s.info["k"]
    ('chen_sqrt', 3)
    """
    stages = _stages_or_none(graph)
    cands = [_store_all_candidate(graph)]
    if stages is not None:
        n = len(stages)
        k = math.ceil(n / math.ceil(math.sqrt(n)))
        cands += [(seq, dict(info, plan="chen_sqrt")) for seq, info in _every_k_candidates(graph, stages, [k])]
    seq, info = cheapest_fitting(graph, cands, budget_bytes, method="chen_sqrt")
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
    graph: ComputeGraph, budget_bytes: int, *, time_limit=None, thresholds: int = 48, **_
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
        Unused.
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
    stages = _stages_or_none(graph)
    if stages is None:
        seq, info = cheapest_fitting(graph, [_store_all_candidate(graph)], budget_bytes, method="chen_greedy")
        return _schedule("chen_greedy", seq, info)
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
            yield sequence_from_keep(graph, keep), {"plan": "chen_greedy", "threshold": b,
                                                    "checkpoints": len(keep), "stages": len(stages)}

    seq, info = cheapest_fitting(graph, cands(), budget_bytes, method="chen_greedy")
    return _schedule("chen_greedy", seq, info)

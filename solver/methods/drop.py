"""Dropping the recomputations a schedule does not need.

The heuristics plan with a conservative memory model and run some values again that
the budget would let stay resident. :func:`drop_recomputations` removes such later runs
one at a time, the costliest first, each only where :func:`solver.simulate` would grade
the schedule without it valid, within the budget and no costlier.

It does not call the simulator once per candidate: :class:`_Replay` holds the
simulator's bookkeeping of the current sequence (the live interval of every copy, the
memory curve, the compute per step), and a removal changes that curve only in a few
intervals, so each candidate is graded from those intervals in time linear in their
length, and a removal kept updates the replay in place. The result is graded by
:func:`solver.simulate` at the end, which stays the judge.
"""

from __future__ import annotations

import logging
import time as _time
from typing import Hashable, Sequence

import numpy as np

from graphs import ComputeGraph
from solver.simulate import SimulationResult, simulate, step_continues, step_time, step_workspace

__all__ = ["drop_recomputations", "dropped_and_graded"]

log = logging.getLogger(__name__)

_MASKED = np.iinfo(np.int64).min // 4  # the curve at a removed step: never the peak
#: Costs this close (relative) are equal: sums over other steps round differently.
_ULPS = 1e-12


class _Node:
    __slots__ = ("preds", "bytes", "output")

    def __init__(self, d: dict, preds: tuple):
        self.preds = preds
        self.bytes = int(d["bytes"])
        self.output = bool(d.get("output", False))


class _Replay:
    """The simulator's bookkeeping of ``seq`` (``None`` at removed steps), no offloads."""

    def __init__(self, info: dict, nodes, seq: list, fixed: int):
        n = len(seq)
        self.seq, self.info, self.nodes = seq, info, nodes
        start, end, node, reads, prev, nxt = [], [], [], [], [], []
        step_occ = [-1] * n
        step_reads: list = [()] * n
        before = [-1] * n  # the previous kept step
        after = [n] * n  # the next kept step
        cont = [False] * n
        compute = np.zeros(n)
        work = np.zeros(n, dtype=np.int64)
        current: dict = {}
        last = -1
        for t, v in enumerate(seq):
            if v is None:
                continue
            d = info[v]
            rs = []
            for u in d.preds:
                k = current[u]
                if end[k] < t:
                    end[k] = t
                reads[k].append(t)
                rs.append(k)
            step_reads[t] = rs
            k = len(start)
            start.append(t)
            end.append(t)
            node.append(v)
            reads.append([])
            before_k = current.get(v, -1)
            prev.append(before_k)
            nxt.append(-1)
            if before_k >= 0:
                nxt[before_k] = k
            current[v] = k
            step_occ[t] = k
            c = last >= 0 and step_continues(nodes, seq[last], v)
            cont[t] = c
            compute[t], work[t] = step_time(nodes, v, c), step_workspace(nodes, v, c)
            before[t] = last
            if last >= 0:
                after[last] = t
            last = t
        latest = set()
        for v, k in current.items():
            if info[v].output:
                end[k] = max(n - 1, end[k])
                latest.add(k)
        delta = np.zeros(n + 1, dtype=np.int64)
        b = np.array([info[v].bytes for v in node], dtype=np.int64)
        np.add.at(delta, np.array(start, dtype=np.int64), b)
        np.add.at(delta, np.array(end, dtype=np.int64) + 1, -b)
        curve = np.cumsum(delta[:n]) + fixed + work
        kept = np.array([v is not None for v in seq], dtype=bool)
        curve[~kept] = _MASKED
        self.start, self.end, self.node, self.reads, self.prev, self.next = start, end, node, reads, prev, nxt
        self.kept = kept
        self.step_occ, self.step_reads, self.before, self.after = step_occ, step_reads, before, after
        self.cont, self.compute, self.work, self.curve, self.latest = cont, compute, work, curve, latest
        self.cost = float(compute[kept].sum())
        self.peak = int(curve.max()) if n else int(fixed)
        self.prefix = np.maximum.accumulate(curve) if n else curve
        self.suffix = np.maximum.accumulate(curve[::-1])[::-1] if n else curve

    def without(self, i: int) -> tuple[int, float, tuple]:
        """Peak and cost of the sequence without its later run at step ``i``, and the
        change for :meth:`remove`."""
        seq, info = self.seq, self.info
        k = self.step_occ[i]
        p = self.prev[k]
        d = info[seq[i]]
        segments = []  # (first step, last step, bytes added)
        # the removed copy's readers read the previous copy, which stays resident for them
        rs = self.reads[k]
        p_end = max(self.end[p], rs[-1] if rs else -1, len(seq) - 1 if k in self.latest else -1)
        if d.bytes:
            segments.append((i, self.end[k], -d.bytes))
            if p_end > self.end[p]:
                segments.append((self.end[p] + 1, p_end, d.bytes))
        # a copy whose last reader was the removed run is freed earlier
        freed = []
        for q in self.step_reads[i]:
            if self.end[q] != i or q in self.latest:
                continue
            rq = self.reads[q]
            q_end = rq[-2] if len(rq) >= 2 else self.start[q]
            freed.append((q, q_end))
            b = info[self.node[q]].bytes
            if b:
                segments.append((q_end + 1, i, -b))
        # the next step may start or continue a multi-output run differently
        dcost = 0.0
        rerun = None
        j = self.after[i]
        if j < len(seq):
            h = self.before[i]
            c = h >= 0 and step_continues(self.nodes, seq[h], seq[j])
            if c != self.cont[j]:
                t, w = step_time(self.nodes, seq[j], c), step_workspace(self.nodes, seq[j], c)
                dcost = t - self.compute[j]
                rerun = (c, t, w)
                if w != self.work[j]:
                    segments.append((j, j, int(w - self.work[j])))
        lo = min([i] + [s[0] for s in segments])
        hi = max([i] + [s[1] for s in segments])
        part = self.curve[lo:hi + 1].copy()
        for a, b, x in segments:
            part[a - lo:b - lo + 1] += x
        part[i - lo] = _MASKED
        peak = int(part.max())
        if lo > 0:
            peak = max(peak, int(self.prefix[lo - 1]))
        if hi + 1 < len(seq):
            peak = max(peak, int(self.suffix[hi + 1]))
        return peak, self.cost - float(self.compute[i]) + dcost, (lo, part, p_end, freed, rerun)

    def remove(self, i: int, change: tuple) -> None:
        """Drop step ``i`` with the ``change`` :meth:`without` returned for it."""
        lo, part, p_end, freed, rerun = change
        k = self.step_occ[i]
        p = self.prev[k]
        # the previous copy takes over the removed one's readers, later copies and role
        self.end[p] = p_end
        self.reads[p].extend(self.reads[k])
        for t in self.reads[k]:
            self.step_reads[t] = [p if q == k else q for q in self.step_reads[t]]
        nk = self.next[k]
        self.next[p] = nk
        if nk >= 0:
            self.prev[nk] = p
        if k in self.latest:
            self.latest.discard(k)
            self.latest.add(p)
        for q in self.step_reads[i]:
            self.reads[q].remove(i)
        for q, q_end in freed:
            self.end[q] = q_end
        h, j = self.before[i], self.after[i]
        if h >= 0:
            self.after[h] = j
        if j < len(self.seq):
            self.before[j] = h
            if rerun is not None:
                self.cont[j], self.compute[j], self.work[j] = rerun
        self.seq[i] = None
        self.step_occ[i], self.step_reads[i] = -1, ()
        self.compute[i], self.work[i] = 0.0, 0
        self.kept[i] = False
        self.curve[lo:lo + len(part)] = part
        self.cost = float(self.compute[self.kept].sum())
        self.prefix = np.maximum.accumulate(self.curve)
        self.suffix = np.maximum.accumulate(self.curve[::-1])[::-1]


def drop_recomputations(graph: ComputeGraph, sequence: Sequence[Hashable], budget: int, *,
                        deadline: float | None = None) -> list[Hashable]:
    """Remove recomputations from a schedule while it stays within ``budget``.

    Each later run of a value, the costliest first, is removed if the schedule without it
    is valid, peaks at most at ``budget`` (the value then stays resident from its previous
    run) and costs no more, all as :func:`solver.simulate` grades it.

    Parameters
    ----------
    graph : ComputeGraph
    sequence : sequence of node ids
        A schedule; a repeated id is a recomputation. An invalid one comes back as it is.
    budget : int
        Peak bytes allowed, fixed bytes included.
    deadline : float, optional
        ``time.perf_counter()`` value after which no more removals are tried.

    Returns
    -------
    list
        The schedule with the removable recomputations gone.

    Notes
    -----
    One replay of the sequence, then per candidate a pass over the steps where its
    removal changes the memory curve (see the module's notes); the simulator grades the
    input and the result once each.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4)
    >>> seq = list(g.order)
    >>> drop_recomputations(g, seq[:3] + seq[:3] + seq[3:], 10**9) == seq
    True
    """
    return dropped_and_graded(graph, sequence, budget, deadline=deadline)[0]


def dropped_and_graded(graph: ComputeGraph, sequence: Sequence[Hashable], budget: int, *,
                       deadline: float | None = None) -> tuple[list[Hashable], SimulationResult]:
    """:func:`drop_recomputations`, with :func:`solver.simulate`'s grade of the result.

    The removals are graded by the simulator at the end anyway; a caller that grades
    what it gets (a search that compares many repaired schedules) takes that grade
    rather than replaying the schedule once more.

    Parameters
    ----------
    graph, sequence, budget, deadline
        As for :func:`drop_recomputations`.

    Returns
    -------
    (list, SimulationResult)
        The schedule :func:`drop_recomputations` returns, and ``simulate(graph, it)``.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4)
    >>> seq = list(g.order)
    >>> out, grade = dropped_and_graded(g, seq[:3] + seq[:3] + seq[3:], 10**9)
    >>> out == seq, grade.cost == simulate(g, seq).cost, grade.recomputations
    (True, True, 0)
    """
    seq = list(sequence)
    first = simulate(graph, seq)
    if not first.valid:
        return seq, first
    nodes = graph.node_data
    pred = graph.pred_map
    ops = graph.ops_set
    info = {v: _Node(nodes[v], tuple(u for u in pred[v] if u in ops)) for v in set(seq)}
    seen: set = set()
    later = []
    for i, v in enumerate(seq):
        if v in seen:
            later.append(i)
        seen.add(v)
    if not later:
        return seq, first
    later.sort(key=lambda i: -nodes[seq[i]].get("time", 0.0))
    replay = _Replay(info, nodes, seq, graph.fixed_bytes)
    dropped = 0
    for i in later:
        if deadline is not None and _time.perf_counter() > deadline:
            break
        peak, cost, change = replay.without(i)
        if peak <= budget and cost <= replay.cost + _ULPS * abs(replay.cost):
            replay.remove(i, change)
            dropped += 1
    out = [v for v in replay.seq if v is not None]
    if dropped:
        r = simulate(graph, out)
        if not (r.valid and r.peak_bytes <= budget and r.cost <= first.cost * (1 + _ULPS)):
            log.warning("drop_recomputations: the simulator grades the result %s (peak %d B, budget %d B); "
                        "the schedule is kept as it was", r.error or "over the budget", r.peak_bytes, budget)
            return list(sequence), first
        return out, r
    return out, first

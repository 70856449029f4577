"""Staged recomputation on a fixed order: relieve the fullest stage, one value at a time.

The schedule is a sequence of stages, one per op of a topological order (Checkmate's
form: Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020). Stage ``t`` recomputes a set of earlier values, then
runs ``order[t]``. :func:`staged_sequence` starts from store-all and, while some stage
is over the budget, takes a value held across the fullest stage and recomputes it at
its next use instead: the copy is freed after its previous use, and the inputs of the
recomputation that are not held at that stage are recomputed there too (recursively).
Of the candidates, the one with the least recomputation time per byte of overage removed
wins. Each step frees at least one stage of one value and holds nothing longer, so the
search ends; it fails when no candidate lowers the fullest stage.

Unlike on-demand eviction (:func:`solver.methods.eviction.evict_sequence`), which
decides online and can thrash on graphs with many long-lived values (each eviction
forces the recomputation of an ancestor cone that was itself evicted), the plan sees the
whole memory curve and never evicts what a planned recomputation reads.

The plan charges a stage every value held into it for the whole stage, and a value
recomputed in a stage from its run until its last reader there, so
:func:`solver.simulate` never charges more than planned.
"""

from __future__ import annotations

import bisect
import logging
import time as _time
from typing import Sequence

import numpy as np

from solver.indexed import IndexedGraph, order_peak

__all__ = ["staged_sequence", "relieve"]

log = logging.getLogger(__name__)

#: A candidate's recomputation may run at most this many ops.
MAX_CLOSURE = 400


class StagedPlan:
    """The stages of ``order`` with their recomputations and memory (see the module)."""

    def __init__(self, ix: IndexedGraph, order: Sequence[int]):
        n = ix.n
        self.ix = ix
        self.order = list(order)
        pos = [0] * n
        for t, v in enumerate(self.order):
            pos[v] = t
        self.pos = pos
        nb = np.asarray(ix.nbytes, dtype=np.int64)
        self.nb = nb
        self.held = np.zeros((n, n + 1), dtype=bool)  # held[u, t]: u is held into stage t
        self.uses: list[list[int]] = []
        self.comps: list[list[int]] = [[pos[u]] for u in range(n)]
        diff = np.zeros(n + 1, dtype=np.int64)
        for u in range(n):
            us = sorted({pos[s] for s in ix.succs[u]})
            if ix.output[u]:
                us = sorted(set(us) | {n - 1})
            self.uses.append(us)
            if us and us[-1] > pos[u]:
                self.held[u, pos[u] + 1:us[-1] + 1] = True
                diff[pos[u] + 1] += nb[u]
                diff[us[-1] + 1] -= nb[u]
        # Summed from the intervals: the (n, n) product of ``held`` and the bytes costs
        # gigabytes and seconds on graphs of thousands of ops.
        self.held_bytes = np.cumsum(diff)[:n]
        self.recompute: list[set[int]] = [set() for _ in range(n)]
        self.transient = np.array([ix.nbytes[v] + ix.workspace[v] for v in self.order], dtype=np.int64)
        self._room_of, self._room = None, {}

    @classmethod
    def of_sequence(cls, ix: IndexedGraph, order: Sequence[int], sequence: Sequence[int]) -> "StagedPlan":
        """The plan of ``sequence``, whose first runs follow ``order``: a repeat belongs to
        the stage of the next first run (one run per stage; repeats after the last first
        run, which nothing reads, are left out). A copy is held from its stage until its
        last read before the value's next run."""
        plan = cls(ix, order)
        n = ix.n
        pos, preds = plan.pos, ix.preds
        comps: list[list[int]] = [[] for _ in range(n)]
        uses: list[set[int]] = [set() for _ in range(n)]
        t = 0
        seen = [False] * n
        for v in sequence:
            if t >= n:
                break
            if not seen[v]:
                seen[v] = True
                s = pos[v]
                t = s + 1
            else:
                s = t
                plan.recompute[s].add(v)
            if not comps[v] or comps[v][-1] != s:
                comps[v].append(s)
            for q in preds[v]:
                uses[q].add(s)
        held = plan.held
        held[:] = False
        diff = np.zeros(n + 1, dtype=np.int64)
        for u in range(n):
            us = sorted(uses[u] | ({n - 1} if ix.output[u] else set()))
            plan.uses[u] = us
            cs = comps[u]
            plan.comps[u] = cs
            for k, c in enumerate(cs):
                nxt = cs[k + 1] if k + 1 < len(cs) else n
                i = bisect.bisect_left(us, nxt)
                if i and us[i - 1] > c:
                    held[u, c + 1:us[i - 1] + 1] = True
                    diff[c + 1] += plan.nb[u]
                    diff[us[i - 1] + 1] -= plan.nb[u]
        plan.held_bytes = np.cumsum(diff)[:n]
        for s in range(n):
            if plan.recompute[s]:
                plan.transient[s] = plan.stage_peak(s)
        return plan

    @property
    def memory(self) -> np.ndarray:
        return self.held_bytes + self.transient

    def closure(self, u: int, s: int, limit: float, slack: np.ndarray | None = None):
        """The values to recompute at stage ``s`` so that ``u`` runs there (``u`` first),
        with their time, and the inputs to hold until ``s`` instead (``(value, first
        stage)``: where ``slack``, the bytes each stage has left under the budget,
        takes them); None when one cannot run again, or past ``limit`` seconds of
        compute or :data:`MAX_CLOSURE` ops."""
        ix, held, here = self.ix, self.held, self.recompute[s]
        tm, preds, recomputable, nb = ix.time, ix.preds, ix.recomputable, ix.nbytes
        out = [u]
        kept: list[tuple[int, int]] = []
        seen = {u}
        cost = tm[u]
        room = None if slack is None else self.room_until(slack, s)
        taken = 0
        k = 0
        while k < len(out):
            x = out[k]
            k += 1
            for q in preds[x]:
                if q in seen or held[q, s] or q in here:
                    continue
                seen.add(q)
                if room is not None:
                    a = self.last_event(q, s) + 1
                    # (a copy recomputed in stage a - 1 would outlive the plan of that stage)
                    if room[a] >= taken + nb[q] and (a == 0 or q not in self.recompute[a - 1]):
                        taken += nb[q]
                        kept.append((q, a))
                        continue
                if not recomputable[q] or len(out) >= MAX_CLOSURE:
                    return None
                out.append(q)
                cost += tm[q]
                if cost > limit:
                    return None
        return out, cost, kept

    def room_until(self, slack: np.ndarray, s: int) -> list:
        """``room[a]``: the least of ``slack`` over the stages ``a..s`` (cached per ``slack``)."""
        if self._room_of is not slack:
            self._room_of, self._room = slack, {}
        got = self._room.get(s)
        if got is None:
            got = np.minimum.accumulate(slack[s::-1])[::-1].tolist()
            self._room[s] = got
        return got

    def last_event(self, q: int, s: int) -> int:
        """The last stage before ``s`` that computes or reads ``q``."""
        us, cs = self.uses[q], self.comps[q]
        i, j = bisect.bisect_left(us, s), bisect.bisect_left(cs, s)
        return max(us[i - 1] if i else -1, cs[j - 1] if j else -1)

    def stage_peak(self, s: int, extra: Sequence[int] = ()) -> int:
        """Transient bytes of stage ``s`` at its fullest step, with ``extra`` recomputed
        there too: each value run in the stage lives until its last reader in the stage
        (to the end when it is held into the next one)."""
        ix = self.ix
        steps = sorted(self.recompute[s].union(extra))
        steps.append(self.order[s])
        at = {x: k for k, x in enumerate(steps)}
        end = list(range(len(steps)))
        nxt = s + 1
        last = len(steps) - 1
        for k, x in enumerate(steps):
            if nxt <= ix.n - 1 and self.held[x, nxt]:
                end[k] = last
            for q in ix.preds[x]:
                j = at.get(q)
                if j is not None and end[j] < k:
                    end[j] = k
        delta = [0] * (len(steps) + 1)
        for k, x in enumerate(steps):
            delta[k] += ix.nbytes[x]
            delta[end[k] + 1] -= ix.nbytes[x]
        peak, cur = 0, 0
        for k, x in enumerate(steps):
            cur += delta[k]
            m = cur + ix.workspace[x]
            if m > peak:
                peak = m
        return peak

    def apply(self, u: int, p: int, s: int, members: list[int], kept: list[tuple[int, int]],
              transient: int) -> None:
        """Recompute ``members`` (``u`` first) at stage ``s``, holding the ``kept`` inputs
        until then; ``u`` leaves after stage ``p``."""
        ix = self.ix
        self.held[u, p + 1:s + 1] = False
        self.held_bytes[p + 1:s + 1] -= self.nb[u]
        for q, a in kept:
            self.held[q, a:s + 1] = True
            self.held_bytes[a:s + 1] += self.nb[q]
        here = self.recompute[s]
        for x in members:
            here.add(x)
            bisect.insort(self.comps[x], s)
            for q in ix.preds[x]:
                us = self.uses[q]
                i = bisect.bisect_left(us, s)
                if i == len(us) or us[i] != s:
                    us.insert(i, s)
        self.transient[s] = transient

    def sequence(self) -> list[int]:
        seq: list[int] = []
        for t, v in enumerate(self.order):
            seq.extend(sorted(self.recompute[t]))
            seq.append(v)
        return seq


def staged_sequence(
    ix: IndexedGraph,
    order: Sequence[int],
    budget_bytes: int,
    *,
    deadline: float | None = None,
    max_candidates: int = 8,
    hold: bool = True,
) -> list[int] | None:
    """A sequence of ``order`` with recomputations that fits ``budget_bytes``, or None.

    Parameters
    ----------
    ix : IndexedGraph
    order : sequence of int
        A topological order of all indices: the stages.
    budget_bytes : int
        Peak allowed, fixed bytes included.
    deadline : float, optional
        Give up at this :func:`time.perf_counter` value.
    max_candidates : int
        Per step, how many of the cheapest candidates are checked against the budget at
        the stage of their recomputation before the step gives up on the strict rule
        (that stage may not go over the budget, or past its own memory when it already
        is) and takes the cheapest that stays below the fullest stage.
    hold : bool
        Let a recomputation read an input that is no longer held by holding it longer,
        where every stage on the way has the room, instead of recomputing it too.

    Returns
    -------
    list of int or None
        Indices in run order (a repeat is a recomputation).

    Notes
    -----
    Each step scans the values held across the fullest stage and grows the recomputation
    of the most promising ones (pruned by the best ratio so far): O(held x closure) per
    step, at most ``n^2`` steps (each frees a value from at least one stage).

    Examples
    --------
    Value 1 (4 B) is read again by op 4; recomputing it there (from 0, recomputed too)
    lowers the peak from 8 B to 7 B:

    >>> from solver.synthetic import chain
    >>> g = chain(5, bytes=[1, 4, 2, 2, 1])
    >>> g.add_edge(1, 4)
    >>> ix = IndexedGraph.of(g)
    >>> order_peak(ix, range(5))
    8
    >>> staged_sequence(ix, range(5), 7)
    [0, 1, 2, 3, 0, 1, 4]
    """
    cap = int(budget_bytes) - ix.fixed
    n = ix.n
    if n == 0:
        return []
    if order_peak(ix, order) <= cap:
        return list(order)
    if ix.footprint_bound() > cap:
        return None
    plan = StagedPlan(ix, order)
    return plan.sequence() if relieve(plan, cap, deadline=deadline, max_candidates=max_candidates,
                                      hold=hold) else None


def relieve(plan: StagedPlan, cap, *, deadline: float | None = None, max_candidates: int = 8, hold: bool = True,
            avoid: frozenset = frozenset(), rng=None, noise: float = 0.3) -> bool:
    """Add recomputations to ``plan`` until every stage fits ``cap`` (bytes, or bytes per
    stage); True when it does, False when no candidate lowers the stage most over it or
    past ``deadline``. ``avoid``: values not to free (they may still be recomputed as the
    input of another); ``rng``: a :class:`random.Random` that scales the candidates'
    ratios by up to ``1 + noise`` (for restarts). See :func:`staged_sequence` for the rule."""
    ix = plan.ix
    n = ix.n
    caps = np.broadcast_to(np.asarray(cap, dtype=np.int64), (n,))
    nb, tm = ix.nbytes, ix.time
    eps = 1e-9 * (sum(tm) / n or 1.0)
    pinned = ix.pinned
    for _ in range(n * n):
        if deadline is not None and _time.perf_counter() > deadline:
            return False
        mem = plan.memory
        over = mem - caps
        t_star = int(np.argmax(over))
        worst = int(over[t_star])
        if worst <= 0:
            return True
        over = np.maximum(over, 0)
        slack = np.maximum(caps - mem, 0) if hold else None
        cands = []
        for u in np.flatnonzero(plan.held[:, t_star]).tolist():
            if pinned[u] or not nb[u] or u in avoid:
                continue
            us = plan.uses[u]
            i = bisect.bisect_right(us, t_star)
            if i == len(us) or (i and us[i - 1] == t_star):
                continue
            s = us[i]
            prev_use = us[i - 1] if i else -1
            cs = plan.comps[u]
            prev_comp = cs[bisect.bisect_left(cs, t_star) - 1]
            p = max(prev_use, prev_comp)
            gain = int(np.minimum(over[p + 1:s], nb[u]).sum())
            if gain <= 0:
                continue
            cands.append(((tm[u] + eps) / gain, u, p, s, gain))
        cands.sort()
        scored = []
        best_ratio = float("inf")
        for lb_ratio, u, p, s, gain in cands:
            if lb_ratio >= best_ratio and len(scored) >= max_candidates:
                break
            limit = best_ratio * gain if len(scored) >= max_candidates else float("inf")
            got = plan.closure(u, s, limit, slack)
            if got is None:
                continue
            members, cost, kept = got
            ratio = (cost + eps * len(members)) / gain
            if rng is not None:
                ratio *= 1.0 + noise * rng.random()
            scored.append((ratio, u, p, s, members, kept))
            scored.sort(key=lambda c: c[0])
            del scored[max_candidates:]
            if len(scored) >= max_candidates:
                best_ratio = scored[-1][0]
        chosen = None
        fallback = None
        for ratio, u, p, s, members, kept in scored:
            trans = plan.stage_peak(s, members)
            new_s = int(plan.held_bytes[s]) - nb[u] + sum(nb[q] for q, _ in kept) + trans
            if new_s <= max(int(caps[s]), int(mem[s])):
                chosen = (u, p, s, members, kept, trans)
                break
            if fallback is None and new_s - int(caps[s]) < worst:
                fallback = (u, p, s, members, kept, trans)
        chosen = chosen or fallback
        if chosen is None:
            log.debug("staged recomputation: no value relieves stage %d (%d B over)", t_star, worst)
            return False
        plan.apply(*chosen)
    return False

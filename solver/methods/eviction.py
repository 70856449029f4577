"""Fast heuristics: budget-driven eviction with on-demand recomputation, and order search.

Two registered methods share one engine:

``eviction`` (fixed order)
    Run the reference order. Before an op would push memory over the budget, evict
    resident values chosen by a score in the spirit of Dynamic Tensor Rematerialization
    (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021): cheap to recompute,
    big and long unused values go first. An evicted value that is read again is
    recomputed on demand, recursively (its own evicted inputs first). Several scores are
    tried and the best simulated schedule is kept.
``order_search`` (free order)
    A memory-aware topological order (greedy choice of the next ready op that keeps the
    live bytes lowest, with randomised restarts and a local search that moves ops, in the
    spirit of OLLA, Steiner et al. 2022, and MODeL, Steiner et al. ICML 2023), then the
    eviction pass on the best orders found.

The engine mirrors the memory model of :mod:`solver.simulate` conservatively: a value is
charged from its computation until it is evicted or has no pending reader, so the
simulator never charges more than the engine planned for. Every schedule is still graded
by the simulator in :func:`solver.solve`.
"""

from __future__ import annotations

import logging
import random
import time as _time
from typing import Sequence

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.indexed import IndexedGraph, order_peak, peak_profile
from solver.registry import register
from solver.schedule import Schedule

__all__ = [
    "IndexedGraph",
    "SCORES",
    "evict_sequence",
    "eviction",
    "min_memory_order",
    "order_peak",
    "order_search",
]

log = logging.getLogger(__name__)

#: Eviction scores tried by :func:`eviction` (see :func:`evict_sequence`).
SCORES = ("dtr", "dtr_eq", "dtr_ahead", "belady", "belady_eq", "belady_ahead", "size", "lru")


class _Fail(Exception):
    pass


class _Evictor:
    """One run of the eviction engine (see :func:`evict_sequence`)."""

    def __init__(self, ix: IndexedGraph, order: Sequence[int], cap: int, score: str, max_steps: int,
                 deadline: float | None = None, priority: Sequence[float] | None = None):
        self.deadline = deadline
        self.priority = priority
        self.ix = ix
        self.order = list(order)
        self.cap = cap
        self.score = score
        self.max_steps = max_steps
        n = ix.n
        self.pending = [len(s) for s in ix.succs]
        self.resident = [False] * n
        self.locks = [0] * n
        self.last = [0] * n
        self.computed = [False] * n
        self.pos = [0] * n
        for i, v in enumerate(self.order):
            self.pos[v] = i
        self.next_sorted = [sorted(s, key=self.pos.__getitem__) for s in ix.succs]
        self.last_pos = [
            (len(self.order) + 1 if ix.output[v] else max((self.pos[s] for s in ix.succs[v]), default=-1))
            for v in range(n)
        ]
        self.next_ptr = [0] * n
        self.res: set[int] = set()
        self.lost = [False] * n      # evicted and impossible to recompute
        self.held: set[int] = set()  # dead values kept because a needed one depends on them
        self.mem = 0
        self.seq: list[int] = []
        self.clock = 0
        self.now = 0
        mean = sum(ix.time) / n if n else 1.0
        self.eps = 1e-6 * (mean or 1.0)

    # -- bookkeeping
    def _free(self, u: int) -> None:
        self.resident[u] = False
        self.res.discard(u)
        self.mem -= self.ix.nbytes[u]

    def _stays_recoverable(self, u: int) -> bool:
        """Whether ``u`` could be recomputed after leaving memory (it may run twice and
        none of its inputs is lost)."""
        if not self.ix.recomputable[u]:
            return False
        lost = self.lost
        for p in self.ix.preds[u]:
            if lost[p]:
                return False
        return True

    def _lost_below(self, u: int) -> list[int] | None:
        """Computed, evicted descendants of ``u`` that only ``u`` keeps recoverable, or None
        when one of them (or ``u`` itself) is still needed, so that ``u`` must stay."""
        ix, pending, out = self.ix, self.pending, self.ix.output
        if pending[u] or out[u]:
            return None
        resident, computed, lost = self.resident, self.computed, self.lost
        seen = {u}
        todo = [u]
        below = []
        while todo:
            x = todo.pop()
            for s in ix.succs[x]:
                if s in seen or resident[s] or lost[s] or not computed[s]:
                    continue
                if pending[s] or out[s]:
                    return None
                seen.add(s)
                below.append(s)
                todo.append(s)
        return below

    def _release(self, u: int) -> bool:
        """Let ``u`` leave memory unless that would make a needed value unrecoverable."""
        if self._stays_recoverable(u):
            self._free(u)
            return True
        below = self._lost_below(u)
        if below is None:
            return False
        self._free(u)
        self.lost[u] = True
        for s in below:
            self.lost[s] = True
        return True

    def _free_if_dead(self, u: int) -> None:
        if self.resident[u] and self.locks[u] == 0 and self.pending[u] == 0 and not self.ix.output[u]:
            if self._release(u):
                self.held.discard(u)
            else:
                self.held.add(u)

    def _next_use(self, u: int) -> int:
        lst, k = self.next_sorted[u], self.next_ptr[u]
        while k < len(lst) and self.computed[lst[k]]:
            k += 1
        self.next_ptr[u] = k
        return self.pos[lst[k]] if k < len(lst) else len(self.order) + 1

    def _rc(self, u: int, memo: dict, depth: int = 0) -> float:
        """Cost of bringing ``u`` back: its time plus its evicted ancestors' (approx.)."""
        got = memo.get(u)
        if got is not None:
            return got
        c = self.ix.time[u] + self.eps
        if depth < 8:
            for p in self.ix.preds[u]:
                if not self.resident[p]:
                    c += self._rc(p, memo, depth + 1)
        memo[u] = c
        return c

    def _rc_at(self, u: int, t: int) -> float:
        """Cost of recomputing ``u`` at position ``t`` of the order: its time plus that of
        every ancestor that will not be resident by then (at most 64 ancestors visited;
        past that the cost is extrapolated)."""
        tm, preds, resident, last_pos = self.ix.time, self.ix.preds, self.resident, self.last_pos
        seen = {u}
        todo = [u]
        c = 0.0
        while todo:
            x = todo.pop()
            c += tm[x] + self.eps
            if len(seen) > 64:
                c += 4 * len(todo) * (tm[x] + self.eps)
                break
            for p in preds[x]:
                if p in seen or (resident[p] and last_pos[p] >= t):
                    continue
                seen.add(p)
                todo.append(p)
        return c

    def _victim(self) -> int:
        ix, sc = self.ix, self.score
        nb, tm, locks, pinned = ix.nbytes, ix.time, self.locks, ix.pinned
        best, best_s = -1, 0.0
        memo: dict = {}
        for u in self.res:
            if locks[u] or pinned[u] or nb[u] == 0 or not self._stays_recoverable(u):
                continue
            if sc == "dtr":
                s = (tm[u] + self.eps) / (nb[u] * (self.clock - self.last[u] + 1))
            elif sc == "dtr_eq":
                s = self._rc(u, memo) / (nb[u] * (self.clock - self.last[u] + 1))
            elif sc == "belady":
                s = (tm[u] + self.eps) / (nb[u] * (self._next_use(u) - self.now + 1))
            elif sc == "belady_eq":
                s = self._rc(u, memo) / (nb[u] * (self._next_use(u) - self.now + 1))
            elif sc == "dtr_ahead":
                s = self._rc_at(u, self._next_use(u)) / (nb[u] * (self.clock - self.last[u] + 1))
            elif sc == "belady_ahead":
                nu = self._next_use(u)
                s = self._rc_at(u, nu) / (nb[u] * (nu - self.now + 1))
            elif sc == "size":
                s = (tm[u] + self.eps) / nb[u]
            elif sc == "lru":
                s = 1.0 / (self.clock - self.last[u] + 1)
            else:
                raise ValueError(f"unknown eviction score {sc!r}; choose one of {', '.join(SCORES)}")
            if self.priority is not None:
                s *= self.priority[u]
            if best < 0 or s < best_s:
                best, best_s = u, s
        return best

    def _make_room(self, need: int) -> None:
        if self.mem + need > self.cap and self.deadline is not None and _time.perf_counter() > self.deadline:
            raise _Fail
        if self.held and self.mem + need > self.cap:
            for u in list(self.held):
                if self.locks[u] == 0 and self._release(u):
                    self.held.discard(u)
        while self.mem + need > self.cap:
            u = self._victim()
            if u < 0:
                raise _Fail
            self._free(u)

    # -- the engine
    def _compute(self, target: int, first: bool) -> None:
        ix = self.ix
        preds, nb, ws = ix.preds, ix.nbytes, ix.workspace
        locks, resident = self.locks, self.resident
        stack: list[list] = []

        def push(x: int) -> None:
            held = []
            for p in preds[x]:
                if resident[p]:
                    locks[p] += 1
                    held.append(p)
            stack.append([x, 0, set(held)])

        push(target)
        while stack:
            frame = stack[-1]
            x, i, held = frame
            ps = preds[x]
            while i < len(ps):
                p = ps[i]
                if p in held:
                    i += 1
                elif resident[p]:
                    locks[p] += 1
                    held.add(p)
                    i += 1
                else:
                    break
            frame[1] = i
            if i < len(ps):
                if len(self.seq) >= self.max_steps or self.lost[ps[i]] or not ix.recomputable[ps[i]]:
                    raise _Fail
                if self.deadline is not None and len(self.seq) % 64 == 0 and _time.perf_counter() > self.deadline:
                    raise _Fail
                push(ps[i])
                continue
            self._make_room(nb[x] + ws[x])
            self.seq.append(x)
            self.clock += 1
            resident[x] = True
            self.res.add(x)
            self.mem += nb[x]
            self.last[x] = self.clock
            for p in ps:
                self.last[p] = self.clock
            stack.pop()
            is_first = first and not stack
            if is_first:
                self.computed[x] = True
            for p in ps:
                locks[p] -= 1
                if is_first:
                    self.pending[p] -= 1
                self._free_if_dead(p)
            if stack:
                parent = stack[-1]
                locks[x] += 1
                parent[2].add(x)
            else:
                self._free_if_dead(x)

    def run(self) -> list[int] | None:
        try:
            for i, v in enumerate(self.order):
                self.now = i
                self._compute(v, True)
        except _Fail:
            return None
        return self.seq


def evict_sequence(
    ix: IndexedGraph,
    order: Sequence[int],
    budget_bytes: int,
    *,
    score: str = "dtr",
    max_steps: int | None = None,
    deadline: float | None = None,
    priority: Sequence[float] | None = None,
) -> list[int] | None:
    """Run ``order`` under ``budget_bytes``, evicting and recomputing on demand.

    Parameters
    ----------
    ix : IndexedGraph
    order : sequence of int
        A topological order of all indices.
    budget_bytes : int
        Peak allowed, fixed bytes included.
    score : str
        Which resident value to evict first (lowest score first): ``"dtr"`` recompute
        time / (bytes x staleness) as in DTR; ``"belady"`` uses the distance to the next
        use in ``order`` instead of staleness; ``"*_eq"`` adds the time of evicted
        ancestors to the recompute time (DTR's evicted neighbourhood); ``"size"``
        recompute time / bytes; ``"lru"`` least recently used.
    max_steps : int, optional
        Give up when the sequence grows past this (default ``10 n``).
    deadline : float, optional
        Give up at this :func:`time.perf_counter` value.
    priority : sequence of float, optional
        A positive factor per index on its score: values with a small one go first.

    Returns
    -------
    list of int or None
        The sequence of indices (repeats are recomputations), or None when the engine
        cannot fit the budget.

    Notes
    -----
    Each step evicts at most the resident set: O(len(sequence) x resident) time.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4)
    >>> ix = IndexedGraph.of(g)
    >>> seq = evict_sequence(ix, range(ix.n), 6)
    >>> [ix.ids[i] for i in seq].count("f0") >= 1
    True
    """
    if max_steps is None:
        max_steps = 10 * max(1, ix.n)
    cap = int(budget_bytes) - ix.fixed
    return _Evictor(ix, order, cap, score, max_steps, deadline, priority).run()


def _seq_cost(ix: IndexedGraph, seq: Sequence[int]) -> float:
    tm = ix.time
    return sum(tm[v] for v in seq)


def best_eviction(
    ix: IndexedGraph,
    order: Sequence[int],
    budget_bytes: int,
    *,
    scores: Sequence[str] = SCORES,
    deadline: float | None = None,
    passes: list | None = None,
) -> tuple[list[int] | None, str | None]:
    """The cheapest sequence over ``scores`` (fewest recomputations on ties); ``passes``,
    when given, gets the scores whose pass ran to its end (fitting or not) before
    ``deadline``."""
    best, best_key, best_score = None, None, None
    for k, sc in enumerate(scores):
        if k and deadline is not None and _time.perf_counter() > deadline:
            break  # a pass begun now would fail at its first eviction
        seq = evict_sequence(ix, order, budget_bytes, score=sc, deadline=deadline)
        if passes is not None and (seq is not None or deadline is None or _time.perf_counter() <= deadline):
            passes.append(sc)
        if seq is None:
            continue
        key = (_seq_cost(ix, seq), len(seq))
        if best_key is None or key < best_key:
            best, best_key, best_score = seq, key, sc
    return best, best_score


def _schedule(ix: IndexedGraph, seq: Sequence[int], method: str, info: dict) -> Schedule:
    return Schedule(sequence=[ix.ids[i] for i in seq], method=method, info=info)


@register("eviction", family="heuristic", order="fixed")
def eviction(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit: float | None = None,
    scores: Sequence[str] = SCORES,
    ix: IndexedGraph | None = None,
) -> Schedule:
    """DTR-style eviction with on-demand recomputation on the reference order.

    Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021: keep the reference
    order; when an op would exceed the budget, evict the resident value with the lowest
    score and recompute evicted values when they are read again. Every score of
    ``scores`` is tried; the cheapest schedule wins.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Stop trying further scores after this many seconds (one always runs).
    scores : sequence of str
        Scores to try, from :data:`SCORES`.
    ix : IndexedGraph, optional
        ``IndexedGraph.of(graph)``, when the caller has it (one pass over the edges
        saved: a second on dense graphs of thousands of ops).

    Returns
    -------
    Schedule
        ``info["score"]`` names the winning score; ``info["order"] == "fixed"``;
        ``info["complete"]`` is False when the time limit cut some score's pass short
        (the answer is the cheapest of those that finished).

    Raises
    ------
    NoScheduleFound
        No score fits the budget.

    Notes
    -----
    O(len(scores) x len(sequence) x resident values).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver import simulate
    >>> g = training_chain(6)
    >>> s = eviction(g, 8)
    >>> r = simulate(g, s); r.valid and r.peak_bytes <= 8
    True
    """
    t0 = _time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    ix = ix or IndexedGraph.of(graph)
    passes: list = []
    seq, sc = best_eviction(ix, range(ix.n), budget_bytes, scores=scores, deadline=deadline, passes=passes)
    if seq is None:
        raise NoScheduleFound(
            f"eviction found no schedule of {graph.name or 'the graph'} within {budget_bytes} B "
            f"in the reference order; try method='order_search' (free order) or a larger budget"
        )
    return _schedule(ix, seq, "eviction", {"order": "fixed", "score": sc, "complete": len(passes) == len(scores)})


# ---------------------------------------------------------------------------- orders
def min_memory_order(
    ix: IndexedGraph,
    *,
    rng: random.Random | None = None,
    noise: float = 0.0,
    tie: str = "ref",
) -> list[int]:
    """A topological order that greedily keeps the live bytes low.

    At each step, among the ready ops, run the one whose step (live bytes + its output)
    is smallest, then whose net change of live bytes (its output minus the inputs it
    frees) is smallest; ties go to the reference order (``tie="ref"``) or to the most
    recently readied op (``tie="depth"``). ``noise`` > 0 perturbs the keys for restarts.
    O((nodes + edges) x ready ops).

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> min_memory_order(IndexedGraph.of(chain(4)))
    [0, 1, 2, 3]
    """
    n = ix.n
    nb, preds, succs, out = ix.nbytes, ix.preds, ix.succs, ix.output
    indeg = [len(ix.order_preds(v)) for v in range(n)]
    pending = [len(s) for s in succs]
    ready = [v for v in range(n) if indeg[v] == 0]
    readied_at = [0] * n
    mem = 0
    order: list[int] = []
    clock = 0
    while ready:
        best, best_key = -1, None
        for v in ready:
            freed = 0
            for p in preds[v]:
                if pending[p] == 1 and not out[p]:
                    freed += nb[p]
            keep = 0 if (not succs[v] and not out[v]) else nb[v]
            step = mem + nb[v] + ix.workspace[v]
            net = keep - freed
            if noise and rng is not None:
                f = 1.0 + noise * (rng.random() - 0.5)
                step *= f
                net = net * f if net > 0 else net / f
            tb = v if tie == "ref" else -readied_at[v]
            key = (max(step, 0), net, tb)
            if best_key is None or key < best_key:
                best, best_key = v, key
        ready.remove(best)
        order.append(best)
        clock += 1
        mem += nb[best]
        for p in preds[best]:
            pending[p] -= 1
            if pending[p] == 0 and not out[p]:
                mem -= nb[p]
        if pending[best] == 0 and not out[best]:
            mem -= nb[best]
        for s in ix.order_succs(best):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
                readied_at[s] = clock
    return order


def beam_order(
    ix: IndexedGraph,
    *,
    width: int = 32,
    target: int = 0,
    rng: random.Random | None = None,
    deadline: float | None = None,
) -> list[int] | None:
    """Beam search over topological orders for a low store-all peak.

    A state is the set of ops run so far; its children run one more ready op. The
    ``width`` states with the lowest ``(max(peak, target), live bytes, peak)`` survive
    each step (ties broken at random), so partial orders that stay under ``target`` are
    ranked by how little they keep live. Duplicate sets are merged. O(n x width x ready x
    in-degree) big-integer operations. Returns None past ``deadline``.

    Examples
    --------
    >>> from solver.synthetic import random_dag
    >>> ix = IndexedGraph.of(random_dag(10, seed=1))
    >>> o = beam_order(ix, width=4)
    >>> sorted(o) == list(range(10)) and order_peak(ix, o) <= order_peak(ix, range(10))
    True
    """
    n = ix.n
    rng = rng or random.Random(0)
    nb, preds, succs, out, ws = ix.nbytes, ix.preds, ix.succs, ix.output, ix.workspace
    smask = [0] * n
    pmask = [0] * n
    for v in range(n):
        for s_ in succs[v]:
            smask[v] |= 1 << s_
        for p in ix.order_preds(v):
            pmask[v] |= 1 << p
    osuccs = [ix.order_succs(v) for v in range(n)]
    keeps = [0 if (not succs[v] and not out[v]) else nb[v] for v in range(n)]
    start_ready = tuple(v for v in range(n) if not pmask[v])
    # state: (done mask, ready tuple, live bytes, peak, chain)
    beam = [(0, start_ready, 0, 0, None)]
    for _ in range(n):
        if deadline is not None and _time.perf_counter() > deadline:
            return None
        children = []
        for done, ready, mem, peak, chain in beam:
            for v in ready:
                bv = 1 << v
                d2 = done | bv
                freed = 0
                for p in preds[v]:
                    if not out[p] and d2 & smask[p] == smask[p]:
                        freed += nb[p]
                step = mem + nb[v] + ws[v]
                pk = peak if peak > step else step
                m2 = mem + keeps[v] - freed
                children.append(((pk if pk > target else target, m2, pk, rng.random()),
                                 d2, v, ready, m2, pk, chain))
        children.sort(key=lambda c: c[0])
        nxt = []
        seen = set()
        for key, d2, v, ready, m2, pk, chain in children:
            if d2 in seen:
                continue
            seen.add(d2)
            r2 = [u for u in ready if u != v]
            for s_ in osuccs[v]:
                if d2 & pmask[s_] == pmask[s_]:
                    r2.append(s_)
            nxt.append((d2, tuple(r2), m2, pk, (v, chain)))
            if len(nxt) >= width:
                break
        beam = nxt
    chain = beam[0][4]
    order = []
    while chain is not None:
        order.append(chain[0])
        chain = chain[1]
    order.reverse()
    return order


def improve_order(
    ix: IndexedGraph, order: list[int], *, deadline: float, rng: random.Random, target: int | None = None,
    max_stall: int | None = None,
) -> list[int]:
    """Local search over topological orders: move one op at a time, keep moves that lower
    the store-all peak (then the sum of the profile above ``target``). Stops at ``deadline``
    or when the peak reaches ``target``."""
    n = ix.n
    if n < 3:
        return order
    preds = [ix.order_preds(v) for v in range(n)]
    succs = [ix.order_succs(v) for v in range(n)]

    def key(o: list[int]) -> tuple:
        prof = peak_profile(ix, o)
        pk = max(prof)
        lim = target if target is not None else pk
        over = sum(x - lim for x in prof if x > lim)
        return (pk, over)

    cur = list(order)
    cur_key = key(cur)
    stall = 0
    max_stall = min(40 * n, 4000) if max_stall is None else max_stall
    while _time.perf_counter() < deadline and stall < max_stall:
        if target is not None and cur_key[0] <= target:
            break
        prof = peak_profile(ix, cur)
        pk = max(prof)
        # pick a step near the peak and an op around it to move
        hot = [i for i, x in enumerate(prof) if x >= pk - (pk >> 4)]
        i = rng.choice(hot)
        j = max(0, min(n - 1, i + rng.randint(-8, 8)))
        v = cur[j]
        pos = {u: k for k, u in enumerate(cur)}
        lo = max((pos[p] for p in preds[v]), default=-1) + 1
        hi = min((pos[s] for s in succs[v]), default=n) - 1
        if hi <= lo:
            stall += 1
            continue
        dest = rng.randint(lo, hi)
        if dest == j:
            stall += 1
            continue
        cand = cur[:j] + cur[j + 1:]
        cand.insert(dest, v)
        k = key(cand)
        if k < cur_key:
            cur, cur_key, stall = cand, k, 0
        else:
            stall += 1
    return cur


def candidate_orders(
    ix: IndexedGraph, *, deadline: float, seed: int = 0, restarts: int = 64
) -> list[list[int]]:
    """The reference order and greedy min-memory orders (deterministic, then randomised),
    best store-all peak first."""
    rng = random.Random(seed)
    seen = set()
    cands = []

    def add(o: list[int]) -> None:
        t = tuple(o)
        if t not in seen:
            seen.add(t)
            cands.append((order_peak(ix, o), len(cands), o))

    add(list(range(ix.n)))
    add(min_memory_order(ix, tie="ref"))
    add(min_memory_order(ix, tie="depth"))
    for r in range(restarts):
        if _time.perf_counter() > deadline:
            break
        add(min_memory_order(ix, rng=rng, noise=0.3, tie="ref" if r % 2 else "depth"))
    cands.sort()
    return [o for _, _, o in cands]


@register("order_search", family="heuristic", order="free")
def order_search(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit: float | None = None,
    seed: int = 0,
    patience: int = 4,
    stall: int | None = None,
) -> Schedule:
    """Memory-aware order search, then eviction: zero recomputation where reordering suffices.

    Greedy min-memory topological orders with randomised restarts and a local search that
    moves ops near the peak (OLLA, Steiner et al. 2022; MODeL, Steiner et al. ICML 2023),
    then :func:`evict_sequence` on the most promising orders when no order fits the budget
    by itself. The reference order is always a candidate, so the result is never worse
    than :func:`eviction`'s.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds for the search (default: 10).
    seed : int
        Seed of the randomised restarts.
    patience : int
        Stop the eviction passes after this many candidate orders in a row that do not
        lower the cost.
    stall : int, optional
        Stop the local search after this many rejected moves in a row (default
        ``min(40 n, 4000)``).

    Returns
    -------
    Schedule
        ``info["order"] == "free"``; ``info["reordered"]`` tells whether it left the
        reference order.

    Raises
    ------
    NoScheduleFound
        No order and eviction fits the budget.

    Notes
    -----
    Each greedy order costs O((nodes + edges) x ready ops); each eviction pass
    O(len(sequence) x resident values).

    Examples
    --------
    >>> from solver.synthetic import random_dag
    >>> from solver import simulate
    >>> g = random_dag(12, seed=3)
    >>> s = order_search(g, simulate(g, g.order).peak_bytes, time_limit=1)
    >>> simulate(g, s).cost == simulate(g, g.order).cost
    True
    """
    t0 = _time.perf_counter()
    limit = 10.0 if time_limit is None else float(time_limit)
    deadline = t0 + limit
    ix = IndexedGraph.of(graph)
    cap = int(budget_bytes) - ix.fixed
    orders = _searched_orders(ix, cap, t0=t0, limit=limit, seed=seed, stall=stall)
    # eviction on the reference order first, then on the orders by store-all peak
    reference = list(range(ix.n))
    orders = [reference] + [o for o in orders if o != reference]
    best, best_info = _evicted_orders(ix, orders, budget_bytes, cap, deadline=deadline, patience=patience)
    if best is None:
        raise NoScheduleFound(
            f"order_search found no schedule of {graph.name or 'the graph'} within {budget_bytes} B; "
            f"the budget may be below the smallest feasible peak"
        )
    best_info["orders_tried"] = len(orders)
    return _schedule(ix, best, "order_search", best_info)


def _searched_orders(ix: IndexedGraph, cap: int, *, t0: float, limit: float, seed: int, stall: int | None) -> list:
    """Phase 1 of :func:`order_search`: greedy low-memory orders, beams of growing width
    while no order fits ``cap`` bytes, then a local search on the best; by store-all peak."""
    rng = random.Random(seed)
    orders = candidate_orders(ix, deadline=t0 + 0.1 * limit, seed=seed)
    # beam search with growing width while no order fits; stop widening once a wider
    # beam no longer lowers the peak
    width = 16
    best_peak = order_peak(ix, orders[0])
    while best_peak > cap and _time.perf_counter() < t0 + 0.5 * limit:
        o = beam_order(ix, width=width, target=cap, rng=rng, deadline=t0 + 0.5 * limit)
        if o is None:
            break
        orders.append(o)
        orders.sort(key=lambda x: order_peak(ix, x))
        peak = order_peak(ix, orders[0])
        if peak >= best_peak and width > 16 and width * ix.n > 20_000:
            break  # wider beams cost more and stopped helping (small graphs keep widening)
        best_peak = min(best_peak, peak)
        width *= 4
    if order_peak(ix, orders[0]) > cap:
        better = improve_order(ix, orders[0], deadline=t0 + 0.6 * limit, rng=rng, target=cap,
                               max_stall=stall)
        if order_peak(ix, better) < order_peak(ix, orders[0]):
            orders.insert(0, better)
    return orders


def _evicted_orders(ix: IndexedGraph, orders: list, budget_bytes: int, cap: int, *, deadline: float,
                    patience: int) -> tuple[list | None, dict | None]:
    """Phase 2 of :func:`order_search`: eviction on ``orders`` (the first always), the
    cheapest result kept; stops after ``patience`` orders in a row that do not improve."""
    best, best_key, best_info = None, None, None
    misses = 0
    for k, o in enumerate(orders):
        if best is not None and misses >= patience:
            break
        if k and _time.perf_counter() > deadline:
            break  # (the reference order is always tried)
        if order_peak(ix, o) <= cap:
            seq, sc = list(o), "none"
        else:
            seq, sc = best_eviction(ix, o, budget_bytes, deadline=deadline)
            if seq is None:
                if k:
                    misses += 1
                continue
        key = (_seq_cost(ix, seq), len(seq))
        if best_key is None or key < best_key:
            if k and best_key is not None and key[0] >= best_key[0] * (1 - 1e-9):
                misses += 1
            else:
                misses = 0 if k else misses
            best, best_key = seq, key
            best_info = {"order": "free", "score": sc, "reordered": k > 0, "candidate": k}
        elif k:
            misses += 1
        if len(seq) == ix.n:
            break  # no recomputation: cannot do better
    return best, best_info

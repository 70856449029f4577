"""Exact enumeration of schedules for tiny graphs: the reference the exact solvers are tested on.

Both searches are Dijkstra over states of the memory model of :mod:`solver.simulate`
(sources always resident, outputs resident until the end, workspace charged during its
op's step, ``recomputable=False`` nodes computed once). A state holds the set of
resident op values; moves are *compute an op* (its op inputs resident; the step is
charged ``fixed + resident + output + workspace`` and must fit the budget) and *free a
resident value* (free of charge). Freeing as soon as a value has no reader before its
next computation is what the simulator does, so the least cost over these paths equals
the least simulated cost over all sequences of the same order freedom.

Two order freedoms:

* :func:`brute_force` -- free order: any valid sequence, any recomputation.
  State: (resident set, set of ops computed at least once). O(3^n) states.
* :func:`brute_force_fixed` -- the Checkmate space (Jain et al., "Checkmate: Breaking the
  Memory Wall with Optimal Tensor Rematerialization", MLSys 2020) that
  :func:`solver.methods.milp.checkmate_milp` and :func:`solver.methods.cpsat.cpsat`
  optimize: the sequence is a series of *stages*, one per op in the reference order;
  stage ``t`` recomputes any subset of the ops before ``t`` (each at most once, in the
  reference order) and then computes ``t`` for the first time. First computations
  therefore follow the reference order. (Sequences that recompute an op twice between
  two first computations, or out of reference order, are outside this space; they are
  inside :func:`brute_force`'s.) State: (stage, last op of the stage, resident set).
  O(n^2 2^n) states.

Neither is registered as a solver method: they refuse graphs of more than ``max_ops``
op nodes (default 12).
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable, Hashable

from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound, SolverError
from solver.schedule import Schedule

__all__ = ["brute_force", "brute_force_fixed", "brute_force_min_peak"]

log = logging.getLogger(__name__)


class _Tables:
    """Bit-indexed view of the graph: op ``i`` is the ``i``-th op of the reference order."""

    def __init__(self, graph: ComputeGraph, max_ops: int) -> None:
        ops = list(graph.order)
        if len(ops) > max_ops:
            raise SolverError(
                f"graph {graph.name!r} has {len(ops)} op nodes; exhaustive search is limited to "
                f"{max_ops} (pass max_ops=... to raise the limit, or use an exact solver such as "
                f"'checkmate_milp' or 'cpsat')"
            )
        index = {v: i for i, v in enumerate(ops)}
        self.ops = ops
        self.n = len(ops)
        self.fixed = graph.fixed_bytes
        self.size = [int(graph[v]["bytes"]) for v in ops]
        self.time = [float(graph[v]["time"]) for v in ops]
        self.ws = [int(graph[v].get("workspace", 0)) for v in ops]
        self.recomputable = [bool(graph[v].get("recomputable", True)) for v in ops]
        self.preds = [sum(1 << index[u] for u in graph.op_preds(v)) for v in ops]
        self.outputs = sum(1 << i for i, v in enumerate(ops) if graph[v].get("output", False))
        self.full = (1 << self.n) - 1

    def resident_bytes(self, mask: int) -> int:
        total, i = 0, 0
        while mask:
            if mask & 1:
                total += self.size[i]
            mask >>= 1
            i += 1
        return total

    def step_bytes(self, resident: int, i: int) -> int:
        return self.fixed + self.resident_bytes(resident) + self.size[i] + self.ws[i]


def _search(
    start: Hashable,
    moves: Callable[[Hashable], list[tuple[Hashable, float, int | None]]],
    is_goal: Callable[[Hashable], bool],
    *,
    combine: Callable[[float, float], float],
):
    """Dijkstra from ``start``; a move is ``(state, weight, computed op or None)``.

    ``combine`` folds a path's value with a move's weight (``+`` for cost, ``max`` for peak).
    Returns ``(value, ops computed along the best path)`` or ``None``.
    """
    best = {start: 0.0}
    parent: dict = {start: None}
    heap = [(0.0, 0, start)]
    tick = 1
    while heap:
        value, _, state = heapq.heappop(heap)
        if value > best[state]:
            continue
        if is_goal(state):
            seq = []
            while parent[state] is not None:
                state, op = parent[state]
                if op is not None:
                    seq.append(op)
            return value, seq[::-1]
        for nxt, weight, op in moves(state):
            nv = combine(value, weight)
            if nv < best.get(nxt, float("inf")):
                best[nxt] = nv
                parent[nxt] = (state, op)
                heapq.heappush(heap, (nv, tick, nxt))
                tick += 1
    return None


def _free_moves(tab: _Tables, budget: int | None):
    def moves(state):
        resident, done = state
        out = []
        for i in range(tab.n):
            bit = 1 << i
            if resident & bit:
                out.append(((resident & ~bit, done), 0.0, None))
                continue
            if done & bit and not tab.recomputable[i]:
                continue
            if tab.preds[i] & ~resident:
                continue
            mem = tab.step_bytes(resident, i)
            if budget is not None and mem > budget:
                continue
            out.append(((resident | bit, done | bit), tab.time[i] if budget is not None else mem, i))
        return out

    return moves


def _fixed_moves(tab: _Tables, budget: int | None):
    def moves(state):
        stage, last, resident = state
        out = []
        for i in range(tab.n):
            bit = 1 << i
            if resident & bit:
                out.append(((stage, last, resident & ~bit), 0.0, None))
        if stage >= tab.n:
            return out
        for i in range(last + 1, stage + 1):
            bit = 1 << i
            if resident & bit or (i < stage and not tab.recomputable[i]):
                continue
            if tab.preds[i] & ~resident:
                continue
            mem = tab.step_bytes(resident, i)
            if budget is not None and mem > budget:
                continue
            nxt = (stage + 1, -1, resident | bit) if i == stage else (stage, i, resident | bit)
            out.append((nxt, tab.time[i] if budget is not None else mem, i))
        return out

    return moves


def _run(graph: ComputeGraph, budget: int | None, fixed_order: bool, max_ops: int):
    tab = _Tables(graph, max_ops)
    if fixed_order:
        start = (0, -1, 0)
        moves = _fixed_moves(tab, budget)
        is_goal = lambda s: s[0] == tab.n and (s[2] & tab.outputs) == tab.outputs  # noqa: E731
    else:
        start = (0, 0)
        moves = _free_moves(tab, budget)
        is_goal = lambda s: s[1] == tab.full and (s[0] & tab.outputs) == tab.outputs  # noqa: E731
    combine = (lambda a, b: a + b) if budget is not None else max
    found = _search(start, moves, is_goal, combine=combine)
    if found is None:
        return tab, None
    value, seq = found
    return tab, (value, [tab.ops[i] for i in seq])


def brute_force_min_peak(graph: ComputeGraph, *, fixed_order: bool = False, max_ops: int = 12) -> tuple[int, list]:
    """The smallest peak of any schedule, by exhaustive search (a bottleneck shortest path).

    Parameters
    ----------
    graph : ComputeGraph
    fixed_order : bool
        Search the stage space of :func:`brute_force_fixed` instead of all orders.
    max_ops : int
        Refuse larger graphs.

    Returns
    -------
    (int, list)
        The smallest peak bytes (fixed bytes included) and a sequence that reaches it.

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> brute_force_min_peak(chain(3, bytes=[1, 5, 2]))[0]
    7
    """
    tab, found = _run(graph, None, fixed_order, max_ops)
    if found is None:  # pragma: no cover - every DAG has a schedule without a budget
        raise SolverError(f"graph {graph.name!r} has no valid schedule")
    peak, seq = found
    return int(max(peak, tab.fixed)), seq


def _result(graph, budget, fixed_order, max_ops, name) -> Schedule:
    tab, found = _run(graph, budget, fixed_order, max_ops)
    if found is None:
        smallest, _ = brute_force_min_peak(graph, fixed_order=fixed_order, max_ops=max_ops)
        if fixed_order:
            raise NoScheduleFound(
                f"no schedule that keeps the reference order of first computations fits "
                f"{budget} B; the smallest such peak is {smallest} B (a free order may fit)",
                best_peak=smallest,
            )
        raise InfeasibleBudget(budget, smallest)
    cost, seq = found
    return Schedule(sequence=seq, method=name, lower_bound=cost,
                    info={"order": "fixed" if fixed_order else "free", "status": "optimal"})


def brute_force(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, max_ops: int = 12) -> Schedule:
    """The cheapest schedule in any order, by exhaustive search (tiny graphs only).

    Dijkstra over (resident set, computed set); O(3^n n) time and memory for ``n`` op
    nodes. See the module docstring for the model.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : None
        Ignored (the search always finishes).
    max_ops : int
        Refuse graphs with more op nodes (``SolverError``).

    Returns
    -------
    Schedule
        An optimal sequence; ``lower_bound`` is its cost (proven optimal).

    Raises
    ------
    InfeasibleBudget
        No sequence fits; carries the smallest feasible peak.
    SolverError
        The graph has more than ``max_ops`` op nodes.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(2, fwd_bytes=4)
    >>> s = brute_force(g, 13)
    >>> s.sequence, s.lower_bound
    (['f0', 'f1', 'loss', 'b1', 'b0'], 6.0)
    """
    return _result(graph, int(budget_bytes), False, max_ops, "brute_force")


def brute_force_fixed(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, max_ops: int = 12) -> Schedule:
    """The cheapest schedule in the Checkmate stage space, by exhaustive search (tiny graphs).

    Stage ``t`` (one per op of the reference order) recomputes a subset of the earlier
    ops in reference order, each at most once, then computes op ``t``; this is exactly
    the space of :func:`solver.methods.milp.checkmate_milp`. Dijkstra over
    (stage, last op of the stage, resident set); O(n^3 2^n) time.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : None
        Ignored.
    max_ops : int
        Refuse graphs with more op nodes (``SolverError``).

    Returns
    -------
    Schedule
        An optimal sequence of the space; ``lower_bound`` is its cost.

    Raises
    ------
    NoScheduleFound
        No sequence of the space fits (``best_peak`` carries the smallest peak in it).
    SolverError
        The graph has more than ``max_ops`` op nodes.

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> g = chain(3, bytes=[1, 5, 2]); g.add_edge(0, 2)
    >>> brute_force_fixed(g, 8).sequence
    [0, 1, 2]
    """
    return _result(graph, int(budget_bytes), True, max_ops, "brute_force_fixed")

"""Lower bounds on the compute of a schedule: a solver-free one, and the stage
relaxations (an LP, and the 0/1 program that an LP or MILP solver bounds).

:func:`fixed_order_bound` and :func:`free_order_bound` are the entry points: the best
bound each finds in a time limit, for schedules that keep the reference order and for
any order. Both try :func:`stage_lp_bound` (:func:`free_stage_lp_bound`) at single
boundaries, then the 0/1 stage program grown from the best of them one boundary at a
time, then at the best few: on captured CNNs, where every heavy op has several outputs,
the peak is at a projection, which may be a boundary. The fixed-order bound also scans
the steps over the budget at a stride for its best single boundary (:data:`SCAN`): the
step where the program bounds best is often among neither the steps most over the
budget nor those most forced. The runs behind the constants are in ``docs/tuning.md``,
under their names.

:func:`forced_recompute_bound` holds for every sequence whose *first* computations follow
the reference order (the fixed-order freedom of ``checkmate_milp``, ``cpsat``,
``eviction`` and ``chain_dp``; it is not a bound when the order is free).

The argument, at the first computation of op ``t``: every value ``i`` computed before
``t`` and read by an op after ``t`` in the reference order (whose first computation is
still to come) is either resident now or computed again later, at a cost of at least its
``time``; a step output counts as read at the end (its last copy stays resident to
the end). Op ``t``'s inputs and values that must not be recomputed cannot take the
second way. So when fixed bytes, op ``t``'s
output and workspace, its inputs and every such value exceed the budget by ``E`` bytes,
values of at least ``E`` bytes in all are recomputed later; the cheapest way to do that,
relaxed to fractions of values (a fractional knapsack), costs at most what any schedule
pays. One recomputation can serve several steps, so the bound is the largest step's
amount, not their sum.

Multi-output groups: a projection that continues a run of its op is charged no time
and its ``run_workspace`` instead of its ``workspace``, so both are taken at their least.
Aliases and in-place results carry 0 bytes, with edges from their base, which the
argument reads as it is. O(ops x values live across an op).
"""

from __future__ import annotations

import itertools
import math
import time as _time
from typing import Hashable, Sequence

from graphs import ComputeGraph

__all__ = ["forced_recompute_bound", "stage_lp_bound", "fixed_order_bound", "worst_step", "free_order_bound",
           "free_stage_lp_bound", "relaxed_peak_bound", "STAGES", "TRIES", "FREE_TRIES", "PROBE_SECONDS",
           "GIVEN_SHARE", "TIGHT_SHARE", "TIGHT_MOST", "tight_boundaries"]


def _least_time(d: dict) -> float:
    """The least time one computation of a node can be charged."""
    if d.get("group") is not None:
        return 0.0  # it may continue a run of its op
    return float(d["time"])


def least_workspace(d: dict) -> int:
    """The least workspace one computation of a node can be charged (a projection that
    continues a run of its op is charged its ``run_workspace``)."""
    ws = int(d.get("workspace", 0))
    if d.get("group") is not None:
        ws = min(ws, int(d.get("run_workspace", ws)))
    return ws


def reference_facts(graph: ComputeGraph) -> tuple[list, dict, list, list]:
    """The reference order, its index, the bytes of each op and the index of its last
    reader (``len(ops)`` for a step output: it is read at the end)."""
    ops = list(graph.order)
    nodes = graph.nx.nodes
    index = {v: i for i, v in enumerate(ops)}
    n = len(ops)
    size = [int(nodes[v]["bytes"]) for v in ops]
    last_read = [n if nodes[v].get("output", False) else max((index[w] for w in graph.op_succs(v)), default=-1)
                 for v in ops]
    return ops, index, size, last_read


def step_excess(graph: ComputeGraph, ops: list, index: dict, size: list, last_read: list, room: int) -> list[int]:
    """Bytes by which each step of the reference order, run store-all, is over ``room``.

    The values live across step ``t`` (computed before, read after) are summed with a
    difference array; the inputs read for the last time at ``t`` are added. O(ops + edges)."""
    nodes = graph.nx.nodes
    n = len(ops)
    delta = [0] * (n + 2)
    for i in range(n):
        if last_read[i] > i + 1:  # live over steps i+1 .. last_read[i]-1
            delta[i + 1] += size[i]
            delta[last_read[i]] -= size[i]
    out = []
    across = 0
    for t, v in enumerate(ops):
        across += delta[t]
        last = sum(size[i] for i in {index[u] for u in graph.op_preds(v)} if last_read[i] <= t)
        out.append(size[t] + least_workspace(nodes[v]) + across + last - room)
    return out


def _forced_amounts(graph: ComputeGraph, budget_bytes: int, reference: tuple | None = None,
                    excess: list | None = None) -> list[float]:
    """The extra compute that the argument of :func:`forced_recompute_bound` forces at
    each step of the reference order (0 where the step fits store-all, ``math.inf``
    where it cannot fit); ``reference`` and ``excess`` as :func:`reference_facts` and
    :func:`step_excess` give them, when the caller has them."""
    import numpy as np

    ops, index, size, last_read = reference or reference_facts(graph)
    nodes = graph.nx.nodes
    room = int(budget_bytes) - graph.fixed_bytes
    if excess is None:
        excess = step_excess(graph, ops, index, size, last_read, room)
    # the values that may go, cheapest per byte first; at each step over the budget the
    # live ones (computed before, read after, not an input) are taken in that order
    free = [i for i, v in enumerate(ops) if nodes[v].get("recomputable", True) and size[i] > 0]
    free.sort(key=lambda i: _least_time(nodes[ops[i]]) / size[i])
    pos = np.array(free, dtype=np.int64)
    read = np.array([last_read[i] for i in free], dtype=np.int64)
    nbytes = np.array([size[i] for i in free], dtype=np.float64)
    times = np.array([_least_time(nodes[ops[i]]) for i in free], dtype=np.float64)
    where = {i: k for k, i in enumerate(free)}
    out = [0.0] * len(ops)
    for t, e in enumerate(excess):
        if e <= 0:
            continue
        mask = (pos < t) & (read > t)
        for u in graph.op_preds(ops[t]):
            k = where.get(index[u])
            if k is not None:
                mask[k] = False
        have = np.cumsum(nbytes[mask])
        if not have.size or have[-1] < e:
            out[t] = math.inf
            continue
        k = int(np.searchsorted(have, e))  # values 0..k-1 go whole, a part of value k
        spent = times[mask]
        before = have[k - 1] if k else 0.0
        out[t] = float(spent[:k].sum()) + float(spent[k]) * (e - before) / float(nbytes[mask][k])
    return out


def forced_recompute_bound(graph: ComputeGraph, budget_bytes: int) -> float:
    """A lower bound on the cost of any schedule whose first computations follow the
    reference order, from the values that cannot all stay resident (module docstring).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.

    Returns
    -------
    float
        At least the store-all cost; ``math.inf`` when some op's step cannot fit even
        with every value that may go recomputed (no fixed-order schedule fits).

    Examples
    --------
    ``a -> b -> c -> d`` where ``d`` also reads ``a``: at ``c``, ``a`` is still to be
    read, so ``c``, its input ``b`` and ``a`` (1 + 4 + 3 bytes) are resident unless ``a``
    is computed again; ``d`` needs ``a``, ``c`` and itself (7 bytes) in any case.

    >>> g = ComputeGraph()
    >>> for v, b in zip("abcd", [1, 4, 3, 3]): g.add_node(v, bytes=b, time=2.0)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d"); g.add_edge("a", "d")
    >>> forced_recompute_bound(g, 8)  # store-all fits: nothing forced
    8.0
    >>> round(forced_recompute_bound(g, 7), 6)  # a goes at c and is computed again
    10.0
    >>> forced_recompute_bound(g, 6)
    inf
    """
    return _forced_bound(graph, _forced_amounts(graph, budget_bytes))


def _forced_bound(graph: ComputeGraph, amounts: list[float]) -> float:
    """:func:`forced_recompute_bound` from :func:`_forced_amounts`."""
    nodes = graph.nx.nodes
    base = float(sum(nodes[v]["time"] for v in graph.order))
    worst = max(amounts, default=0.0)
    # a hair below, so that float rounding never lifts it above a schedule's cost
    return base + max(0.0, worst * (1 - 1e-9))


# ---------------------------------------------------------------------------- stage LP
#: Boundaries (steps of the reference order) of :func:`stage_lp_bound` by default. One
#: is often the strongest: with more, a value kept in part at one boundary supports a
#: part of a recomputation in each later interval, which the relaxation exploits.
STAGES = 1


def _groups(graph: ComputeGraph, ops: list) -> dict:
    """Multi-output groups whose projections are charged ``group_time`` per run:
    group -> (indices of its projections, group_time)."""
    nodes = graph.nx.nodes
    out: dict = {}
    for i, v in enumerate(ops):
        d = nodes[v]
        if d.get("group") is not None and "group_time" in d:
            members, gt = out.get(d["group"], ([], float(d["group_time"])))
            members.append(i)
            out[d["group"]] = (members, min(gt, float(d["group_time"])))
    return out


def _pick_boundaries(excess: list[float], allowed: list[bool], stages: int) -> list[int]:
    """Up to ``stages`` steps where the reference order is over the budget: the worst one
    and others spread evenly over the over-budget steps, in order."""
    over = [t for t, e in enumerate(excess) if e > 0 and allowed[t]]
    if not over:
        return []
    picks = {max(over, key=lambda t: excess[t])}
    if stages > 1:
        for j in range(stages - 1):
            picks.add(over[round(j * (len(over) - 1) / max(1, stages - 2))])
    return sorted(picks)[:max(1, stages)] if len(picks) > stages else sorted(picks)


def stage_lp_bound(graph: ComputeGraph, budget_bytes: int, *, stages: int = STAGES,
                   boundaries: list | None = None, time_limit: float | None = None,
                   kept: dict | None = None, integral: bool = False,
                   solution: dict | None = None, hold: dict | None = None,
                   hint: dict | None = None, reference: tuple | None = None,
                   gap: float | None = None) -> float | None:
    """A lower bound on the cost of any schedule whose first computations follow the
    reference order: the linear relaxation of the schedule at a few steps (stages).

    At the first computation of each boundary op ``t_k`` (the over-budget steps of the
    reference order, by default the worst one and others spread over them), the values
    live then must fit the budget beside op ``t_k``'s inputs, output and workspace. A
    value that a later op reads and that is not live then is computed again before that
    read, in the interval up to the next boundary or a later one; a value live at a
    boundary was live at the previous one or was computed in between; and a
    recomputation in an interval needs each input live at the interval's start or
    computed again in it. With 0/1 variables "live at boundary k" and "computed again
    in interval k" every fixed-order schedule satisfies these constraints, and its extra
    compute is at least the time of what it computes again; the LP relaxation of that
    (GLOP) gives the bound, or with ``integral`` the 0/1 program itself (SCIP), whose
    proven bound holds even when the solver stops early. More boundaries give a tighter
    bound and a larger program.

    Multi-output groups with ``group_time``: an interval in which a projection is
    computed again, none first runs and whose boundary is none of them holds one more
    run of the op, which costs ``group_time`` (a run that straddles a boundary holds
    the boundary's first computation). A boundary may be a projection: its step holds
    its output, its inputs (those of the op) and the least of its two workspaces.
    Values of 0 bytes (aliases) stay live for free. Values that must not be recomputed
    are never computed again.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    stages : int
        How many boundaries to pick (ignored when ``boundaries`` is given).
    boundaries : list of node ids, optional
        The boundary ops.
    time_limit : float, optional
        Seconds for building and solving the LP; past them the answer is None.
    kept : dict, optional
        Filled, when the LP is solved, with node id -> the LP's fraction of that value
        live at the first boundary (the values it may drop; a guide for heuristics).
    integral : bool
        Solve the 0/1 program (SCIP) rather than its LP relaxation: as tight or tighter,
        slower; past ``time_limit`` the solver's proven bound is the answer.
    solution : dict, optional
        Filled, when the solver found a solution, with ``"boundaries"`` (the boundary
        ops in order), ``"redo"`` (node id -> the intervals in which the solution
        computes it again, interval ``k`` following boundary ``k``) and ``"value"``
        (the solution's extra compute); with ``integral``, a schedule to build
        (:mod:`solver.methods.stage_milp`).
    hold : dict, optional
        Intervals whose recomputations are held as given: ``(first boundary, next
        boundary or None) -> node ids computed again in that interval``; an interval
        between those two boundaries computes again some of them, and nothing else. A program with held intervals is a
        restriction, not a relaxation: its value bounds nothing, and serves to build a
        schedule (:mod:`solver.methods.stage_milp`).
    hint : dict, optional
        With ``integral``, a solution at the same boundaries to start from, as
        ``solution["redo"]`` gives it (node id -> intervals).
    gap : float, optional
        With ``integral``, the solver may stop once its solution costs at most this
        share above its proven bound (which holds all the same): for programs whose
        solution serves to build a schedule.

    Returns
    -------
    float or None
        At least the store-all cost; ``math.inf`` when the LP proves that no fixed-order
        schedule fits (with ``hold``: none that holds those intervals); None when the LP
        did not finish in time (or, with ``integral``, proved nothing in it).

    Raises
    ------
    ValueError
        A boundary is not an op of the graph.

    Notes
    -----
    ``stages x ops`` variables and ``stages x edges`` constraints.

    Examples
    --------
    The graph of :func:`forced_recompute_bound`'s example: at ``c``, ``a`` goes and is
    computed again for ``d``.

    >>> g = ComputeGraph()
    >>> for v, b in zip("abcd", [1, 4, 3, 3]): g.add_node(v, bytes=b, time=2.0)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d"); g.add_edge("a", "d")
    >>> round(stage_lp_bound(g, 7), 3), round(stage_lp_bound(g, 7, integral=True), 3)
    (10.0, 10.0)
    """
    from solver.deadline import Deadline

    deadline = Deadline(time_limit)
    ops, index, size, last_read = reference or reference_facts(graph)
    nodes = graph.nx.nodes
    n = len(ops)
    base = float(sum(nodes[v]["time"] for v in ops))
    if n == 0:
        return base
    readers = [sorted(index[w] for w in graph.op_succs(v)) for v in ops]
    room = int(budget_bytes) - graph.fixed_bytes
    if boundaries is None:
        excess = step_excess(graph, ops, index, size, last_read, room)
        marks = _pick_boundaries(excess, [True] * n, stages)
    else:
        marks = sorted(set(_boundary_indices(graph, boundaries, index)))
    if not marks:
        return base
    rule = _fixed_order_rule(marks, readers, last_read)
    return _relaxation(graph, budget_bytes, ops, index, size, marks, rule, deadline, kept, integral, solution,
                       hold, hint, gap)


class _Rule:
    """What one order freedom lets the stage relaxation assume, per boundary ``k``:

    * ``candidates(k)``: the values that are surely computed before boundary ``k``;
    * ``before(i, k)``: value ``i`` is surely computed before boundary ``k``;
    * ``required(i, k)``: None, or the last interval in which a copy of ``i`` (surely
      computed before boundary ``k``) must be made, when not live at ``k``, because an
      op whose first computation surely comes after ``k`` reads it by then;
    * ``may_first(i, k)``: the first computation of ``i`` may fall in interval ``k``.
    """

    def __init__(self, *, candidates, before, required, may_first):
        self.candidates = candidates
        self.before = before
        self.required = required
        self.may_first = may_first


def _fixed_order_rule(marks: list, readers: list, last_read: list) -> _Rule:
    """What the reference order of first computations tells the stage relaxation at the
    boundaries ``marks``: value ``i`` is first computed at step ``i``."""
    n, m = len(readers), len(marks)

    def interval(r: int) -> int:
        """The interval ``k`` (``t_k < r <= t_{k+1}``) of the first computation of ``r``
        (``m - 1`` for the end of the step)."""
        lo, hi = 0, m - 1
        while lo < hi:  # the last k with marks[k] < r
            mid = (lo + hi + 1) // 2
            if marks[mid] < r:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def required(i: int, k: int):
        t = marks[k]
        if last_read[i] <= t:
            return None
        r = next((w for w in readers[i] if w > t), n)
        return interval(r) if r < n else m - 1

    return _Rule(candidates=lambda k: range(marks[k]), before=lambda i, k: i < marks[k], required=required,
                 may_first=lambda i, k: i > marks[0] and interval(i) == k)


def _boundary_indices(graph: ComputeGraph, boundaries, index: dict) -> list[int]:
    out = []
    for v in boundaries:
        if v not in index:
            raise ValueError(f"boundary {v!r} is not an op of {graph.name or 'the graph'}")
        out.append(index[v])
    return out


def _relaxation(graph: ComputeGraph, budget_bytes: int, ops: list, index: dict, size: list, marks: list,
                rule: _Rule, deadline, kept: dict | None, integral: bool = False,
                solution: dict | None = None, hold: dict | None = None, hint: dict | None = None,
                gap: float | None = None) -> float | None:
    """The LP of :func:`stage_lp_bound` at the boundaries ``marks`` (op indices, in the
    order of their first computations), with what the order freedom allows from ``rule``."""
    from solver.deadline import OutOfTime

    try:
        program = _StageProgram(graph, budget_bytes, ops, index, size, marks, rule, deadline, integral)
        program.needs()
        if not program.fits():
            return math.inf
        program.set_objective()
        if hold:
            program.hold(hold)
        if hint is not None and integral:
            program.hint(hint)
        status = program.solve(gap)
    except OutOfTime:
        return None
    return program.answer(status, solution, kept)


class _StageProgram:
    """The stage program of :func:`_relaxation`, built in phases: the reads each boundary
    must serve (:meth:`needs`, with what those variables imply), the memory at each
    boundary (:meth:`fits`), the objective, the held intervals and the hint; then solved
    and read (:meth:`answer`). Variables are made on first use: ``keep[(i, k)]``, a copy
    of ``i`` is live at boundary ``k``; ``redo[(i, k)]``, ``i`` is computed again in
    interval ``k``."""

    def __init__(self, graph: ComputeGraph, budget_bytes: int, ops: list, index: dict, size: list, marks: list,
                 rule: _Rule, deadline, integral: bool) -> None:
        from solver.lp_backend import create_solver

        nodes = graph.nx.nodes
        self.graph, self.nodes, self.ops, self.index, self.size = graph, nodes, ops, index, size
        self.marks, self.m, self.rule, self.deadline, self.integral = marks, len(marks), rule, deadline, integral
        self.base = float(sum(nodes[v]["time"] for v in ops))
        self.cost = [float(nodes[v]["time"]) for v in ops]
        self.can_redo = [bool(nodes[v].get("recomputable", True)) for v in ops]
        self.preds = [sorted({index[u] for u in graph.op_preds(v)}) for v in ops]
        self.room = int(budget_bytes) - graph.fixed_bytes
        self.groups = _groups(graph, ops)
        self.group_of = {i: g for g, (members, _) in self.groups.items() for i in members}
        self.inputs = [set(self.preds[t]) for t in marks]
        self.lp = lp = create_solver("SCIP" if integral else "GLOP")
        self.new_var = (lambda: lp.IntVar(0.0, 1.0, "")) if integral else (lambda: lp.NumVar(0.0, 1.0, ""))
        self.scale = 1.0 / max(1, self.room)
        self.per = 1.0 / max([c for c in self.cost if c > 0], default=1.0)  # objective in units of the costliest op
        self.keep: dict = {}
        self.redo: dict = {}
        self.todo: list = []  # variables made, whose implications are still to add
        self.objective = None

    def live(self, i: int, k: int):
        """"i is live at boundary k": a variable, or 1.0 where it is so anyway (an input or
        the output of t_k, a value of 0 bytes)."""
        if self.size[i] == 0 or i == self.marks[k] or i in self.inputs[k]:
            return 1.0
        var = self.keep.get((i, k))
        if var is None:
            var = self.keep[(i, k)] = self.new_var()
            self.todo.append(("keep", i, k))
        return var

    def again(self, i: int, k: int):
        """"i is computed again in interval k": a variable, or None where it cannot be."""
        if not self.can_redo[i] or self.size[i] == 0:
            return None
        var = self.redo.get((i, k))
        if var is None:
            var = self.redo[(i, k)] = self.new_var()
            self.todo.append(("redo", i, k))
        return var

    def at_least(self, terms, rhs: float) -> None:
        """sum(terms) >= rhs; a term is a constant, None (nothing), a variable or a
        (variable, coefficient) pair."""
        const = sum(x for x in terms if isinstance(x, float))
        if const >= rhs and not any(isinstance(x, tuple) and x[1] < 0 for x in terms):
            return  # holds whatever the variables are
        c = self.lp.Constraint(rhs - const, self.lp.infinity())
        for x in terms:
            if isinstance(x, tuple):
                c.SetCoefficient(*x)
            elif x is not None and not isinstance(x, float):
                c.SetCoefficient(x, 1.0)

    def needs(self) -> None:
        """Each value read after boundary ``k`` is live then or computed again before the
        read; then what each variable made implies, until none is left."""
        rule, size, live, again, at_least = self.rule, self.size, self.live, self.again, self.at_least
        for k in range(self.m):
            self.deadline.check("building the stage LP")
            for i in rule.candidates(k):
                if size[i] == 0 or i in self.inputs[k]:
                    continue
                last = rule.required(i, k)
                if last is None:
                    continue
                # needed after t_k: live now, or computed again before that read
                at_least([live(i, k)] + [again(i, k2) for k2 in range(k, last + 1)], 1.0)
        while self.todo:
            self.deadline.check("building the stage LP")
            what, i, k = self.todo.pop()
            if what == "keep":
                # live at t_k: live at t_{k-1} or computed in between (unless maybe first computed then)
                if k == 0 or not rule.before(i, k - 1):
                    continue
                at_least([live(i, k - 1), again(i, k - 1), (self.keep[(i, k)], -1.0)], 0.0)
            else:
                # computed again in interval k: each input live at t_k or computed again in
                # interval k too (an input maybe first computed after t_k needs nothing)
                q = self.redo[(i, k)]
                for j in self.preds[i]:
                    if not rule.before(j, k):
                        continue
                    at_least([live(j, k), again(j, k), (q, -1.0)], 0.0)

    def fits(self) -> bool:
        """The values kept at each boundary fit beside its op's output, workspace and
        inputs; False where those alone do not."""
        lp, size = self.lp, self.size
        for k, t in enumerate(self.marks):
            need = size[t] + least_workspace(self.nodes[self.ops[t]]) + sum(size[i] for i in self.inputs[k])
            if need > self.room:
                return False
            memory = lp.Constraint(-lp.infinity(), (self.room - need) * self.scale)
            for (i, k2), var in self.keep.items():
                if k2 == k:
                    memory.SetCoefficient(var, size[i] * self.scale)
        return True

    def set_objective(self) -> None:
        """The time of what is computed again: a multi-output op once per interval that
        computes some of its projections again (unless it runs there anyway)."""
        lp, groups, per = self.lp, self.groups, self.per
        self.objective = objective = lp.Objective()
        run: dict = {}
        for (i, k), q in self.redo.items():
            g = self.group_of.get(i)
            if g is None:
                objective.SetCoefficient(q, self.cost[i] * per)
                continue
            if self.marks[k] in groups[g][0] or any(self.rule.may_first(j, k) for j in groups[g][0]):
                continue  # a run of the op may happen in this interval anyway
            r = run.get((g, k))
            if r is None:
                r = run[(g, k)] = lp.NumVar(0.0, 1.0, "")
                objective.SetCoefficient(r, groups[g][1] * per)
            c = lp.Constraint(0.0, lp.infinity())
            c.SetCoefficient(r, 1.0)
            c.SetCoefficient(q, -1.0)

    def hold(self, hold: dict) -> None:
        """Held intervals compute again only what ``hold`` names for them."""
        ops, marks, m = self.ops, self.marks, self.m
        held = {}  # interval -> what it computes again
        for k in range(m):
            key = (ops[marks[k]], ops[marks[k + 1]] if k + 1 < m else None)
            if key in hold:
                held[k] = {self.index[v] for v in hold[key] if v in self.index}
        for (i, k), q in self.redo.items():
            if k in held and i not in held[k]:
                q.SetBounds(0.0, 0.0)

    def hint(self, hint: dict) -> None:
        """Start the 0/1 program from ``hint`` (node id -> intervals computing it again)."""
        if self.redo:
            pairs = list(self.redo.items())
            self.lp.SetHint([q for _, q in pairs],
                            [1.0 if k in hint.get(self.ops[i], ()) else 0.0 for (i, k), _ in pairs])

    def solve(self, gap: float | None):
        """Solve within the deadline; with ``gap``, the 0/1 program may stop that close."""
        from solver.lp_backend import solve_quietly

        self.objective.SetMinimization()
        self.deadline.check("building the stage LP")
        left = self.deadline.left()
        if math.isfinite(left):
            self.lp.SetTimeLimit(max(1, int(1000 * left)))
        params = None
        if self.integral and gap is not None:
            from ortools.linear_solver import pywraplp

            params = pywraplp.MPSolverParameters()
            params.SetDoubleParam(params.RELATIVE_MIP_GAP, float(gap))
        return solve_quietly(self.lp, params)

    def answer(self, status, solution: dict | None, kept: dict | None) -> float | None:
        """The bound the solver's ``status`` gives (math.inf: infeasible; None: none);
        ``solution`` and ``kept`` filled as :func:`stage_lp_bound` says."""
        lp, per, ops = self.lp, self.per, self.ops
        if status == lp.INFEASIBLE:
            return math.inf
        if self.integral and status in (lp.OPTIMAL, lp.FEASIBLE, lp.NOT_SOLVED):
            value = lp.Objective().BestBound() / per  # "optimal" means within the solver's gap tolerance
            if not math.isfinite(value):
                return None
        elif status != lp.OPTIMAL:
            return None
        else:
            value = self.objective.Value() / per
        if solution is not None and status in (lp.OPTIMAL, lp.FEASIBLE):
            redone: dict = {}
            for (i, k), q in sorted(self.redo.items(), key=lambda x: x[0][1]):
                if q.solution_value() > 0.5:
                    redone.setdefault(ops[i], []).append(k)
            solution.clear()
            solution.update(boundaries=[ops[t] for t in self.marks], redo=redone, value=self.objective.Value() / per)
        if kept is not None and status in (lp.OPTIMAL, lp.FEASIBLE):
            kept.update({ops[i]: var.solution_value() for (i, k), var in self.keep.items() if k == 0})
        shortfall = sum(min(0.0, gt - sum(self.cost[i] for i in members)) for members, gt in self.groups.values())
        extra = max(0.0, value * (1 - 1e-6) - 1e-12 * self.base) + shortfall
        return max(self.base, self.base + extra)


def over_budget_steps(graph: ComputeGraph, ops: list, excess: list, *, every: bool = False) -> list[int]:
    """The steps over the budget (with ``every``, all steps), most over first, one per
    multi-output op (the projections of one op share their inputs and mostly their
    excess)."""
    nodes = graph.nx.nodes
    seen = set()
    out = []
    for t in sorted((t for t in range(len(ops)) if every or excess[t] > 0), key=lambda t: (-excess[t], t)):
        group = nodes[ops[t]].get("group")
        if group is not None:
            if group in seen:
                continue
            seen.add(group)
        out.append(t)
    return out


#: Single-boundary LPs that :func:`fixed_order_bound` tries by default.
TRIES = 12
#: Boundaries of the 0/1 stage programs that the bounds try after the LPs: the best
#: LP boundary alone, then the best two, then the best four, while time is left.
INTEGRAL_SETS = (1, 2, 4)
#: The last 0/1 stage program has a boundary at each of this many steps, the most over
#: the budget first (one per multi-output op): a step that fits store-all may not fit
#: beside the values computed again for a later one.
EVERY = 64
#: Single-boundary LPs after which the 0/1 program at the best of them runs, before the
#: other LPs (it is the one that most often closes the gap; a short time limit may not
#: reach the rest).
EARLY_LPS = 4
#: Without a time limit, seconds at most for those programs in all.
INTEGRAL_SECONDS = 2.0
#: Steps over the budget at which :func:`fixed_order_bound` tries the LP besides its
#: ``tries``, at an even stride (then beside the best three); the LP changes little from
#: one step to the next.
SCAN = 48
#: Share of the time left that the scan may take; without a time limit, seconds.
SCAN_SHARE = 0.3
SCAN_SECONDS = 1.0
#: Boundaries that the grown 0/1 program tries to add to the best LP's step.
GROW_TRIES = 8


def worst_step(graph: ComputeGraph, budget_bytes: int, reference: tuple | None = None):
    """The op whose first computation is most over ``budget_bytes`` when the reference
    order runs store-all (projections of multi-output ops excluded), or None when every
    step fits (``reference``: :func:`reference_facts`'s figures, when the caller has them)."""
    ops, index, size, last_read = reference or reference_facts(graph)
    excess = step_excess(graph, ops, index, size, last_read, int(budget_bytes) - graph.fixed_bytes)
    over = [t for t in range(len(ops)) if excess[t] > 0 and graph[ops[t]].get("group") is None]
    return ops[max(over, key=lambda t: (excess[t], -t))] if over else None


def _candidates(graph: ComputeGraph, ops: list, excess: list, amounts: list[float]) -> list[int]:
    """Steps to try as single boundaries, best first: the steps most over the budget and
    those where :func:`forced_recompute_bound`'s argument forces the most
    (:func:`_forced_amounts`), by turns (the strongest LP sits at either), one per
    multi-output op."""
    over = over_budget_steps(graph, ops, excess)
    forced = sorted(over, key=lambda t: (-amounts[t], t))
    out, seen = [], set()
    for pair in zip(forced, over):
        for t in pair:
            if t not in seen:
                seen.add(t)
                out.append(t)
    return out


def _near_and_far(ranked: list, pool: list) -> list:
    """``ranked`` (steps, best first) after its first, by turns: the next best, and the
    next best that no better step of ``pool`` is near (within two strides of the scan of
    :func:`_best_of`). A boundary beside the best one and one in
    another layer raise the 0/1 program in different ways: on a captured GPT-2 at 0.3x,
    the grown program gains from the step next to the best and from the next layer's
    best step."""
    where = {t: i for i, t in enumerate(pool)}
    reach = 2 * max(1, len(pool) // SCAN)
    peaks, taken = [], []
    for t in ranked:
        if t in where and all(abs(where[t] - where[u]) > reach for u in taken):
            peaks.append(t)
        if t in where:
            taken.append(t)
    near = [t for t in ranked[1:] if t not in peaks]
    out = []
    for pair in itertools.zip_longest(near, peaks[1:]):
        out += [t for t in pair if t is not None]
    return out


def _best_of(bound_at, marks: list, base: float, best: float, deadline, time_limit, enough: float | None, *,
             arrange=sorted, together: bool = False, every: list = (), pool: list = (),
             known: dict | None = None) -> float:
    """Raise ``best`` with ``bound_at(boundaries, integral, seconds)``, while time is left
    and ``best`` is below ``enough``:

    1. the LP at each of ``marks`` alone (after the first :data:`EARLY_LPS`, the 0/1
       program at the best so far), with ``together`` at ``arrange(marks)`` too;
    2. the LP at ``pool`` (steps in order) at an even stride, :data:`SCAN` of them,
       then beside the best three so far, in :data:`SCAN_SHARE` of the time;
    3. the 0/1 program grown from the best LP's step: the step most over the budget
       (``every[0]``) and the next best LP steps are added one at a time, each kept
       where it raises the bound (:data:`GROW_TRIES` tries);
    4. the 0/1 program at ``arrange`` of the best :data:`INTEGRAL_SETS` LP steps and at
       ``arrange(every)``, until one runs out of its share of the time.

    ``arrange`` puts boundaries in the order the bound takes them and drops those it
    cannot take; ``known`` (step -> its LP bound) holds LPs the caller already solved.
    Each bound holds alone, so the largest holds."""
    done = lambda: math.isinf(best) or (enough is not None and best >= enough)  # noqa: E731
    seconds = lambda: None if time_limit is None else max(0.0, deadline.left())  # noqa: E731
    lps: dict = dict(known or {})  # step -> its LP bound
    programs: dict = {}  # boundaries -> the 0/1 program's bound

    def lp(t: int) -> None:
        nonlocal best
        lb = bound_at([t], False, seconds())
        if lb is not None:
            lps[t] = lb
            best = max(best, lb)

    def program(picked: list, share) -> float | None:
        nonlocal best
        key = tuple(picked)
        if key not in programs:
            programs[key] = bound_at(list(key), True, share)
            if programs[key] is not None:
                best = max(best, programs[key])
        return programs[key]

    def ranked() -> list:
        return sorted(lps, key=lambda t: (-lps[t], t))

    for j, t in enumerate(marks):
        if done() or deadline.expired():
            return best
        if t not in lps:
            lp(t)
        if j + 1 == min(EARLY_LPS, len(marks)) and lps and best > base and not done():
            program(arrange(ranked()[:1]), INTEGRAL_SECONDS if time_limit is None else deadline.left() / 3)
    if together and len(arrange(marks)) > 1 and not done() and not deadline.expired():
        lb = bound_at(arrange(marks), False, seconds())
        best = best if lb is None else max(best, lb)
    if pool and not done() and not deadline.expired():
        until = _time.perf_counter() + (SCAN_SECONDS if time_limit is None else SCAN_SHARE * deadline.left())

        def scan(steps) -> bool:
            """The LP at each of ``steps`` not tried yet; False once the scan's time is up."""
            for t in steps:
                if done() or deadline.expired() or _time.perf_counter() > until:
                    return False
                if t not in lps:
                    lp(t)
            return True

        stride = max(1, len(pool) // SCAN)
        if scan(pool[::stride]) and stride > 1:
            where = {t: i for i, t in enumerate(pool)}
            for t in [t for t in ranked()[:3] if t in where]:
                if not scan(pool[max(0, where[t] - stride + 1):where[t] + stride]):
                    break
    if not lps or best <= base:
        return best
    until = _time.perf_counter() + (INTEGRAL_SECONDS if time_limit is None else deadline.left())
    # the program grown one boundary at a time from the best LP's step
    grown = arrange(ranked()[:1])
    now = program(grown, (until - _time.perf_counter()) / 3)
    now = base if now is None else now
    tries = [t for t in dict.fromkeys(list(every[:1]) + _near_and_far(ranked(), pool)) if t not in grown]
    tries = tries[:GROW_TRIES]
    for j, t in enumerate(tries):
        left = until - _time.perf_counter()
        if done() or left <= 0.05:
            break
        picked = arrange(grown + [t])
        if tuple(picked) in programs or len(picked) <= len(grown):
            continue
        lb = program(picked, left / min(len(tries) - j + 1, 3))
        if lb is not None and lb > now * (1 + 1e-9):
            grown, now = picked, lb
    trials = [arrange(ranked()[:k]) for k in INTEGRAL_SETS if k <= len(lps)]
    if every:
        trials.append(arrange(list(every)))
    trials = [p for p in dict.fromkeys(tuple(p) for p in trials) if p not in programs]
    for j, picked in enumerate(trials):
        left = until - _time.perf_counter()
        if done() or left <= 0.05:
            break
        share = left / (len(trials) - j)
        started = _time.perf_counter()
        program(list(picked), share)
        if _time.perf_counter() - started > 0.9 * share:
            break  # it ran out of time: a larger program would too
    return best


#: Share of :func:`fixed_order_bound`'s time for the 0/1 stage programs at the
#: ``boundaries`` a caller gives.
GIVEN_SHARE = 0.6
#: :func:`tight_boundaries`: runs of first computations at least this share of the
#: budget, and how many of them (the highest first).
TIGHT_SHARE = 0.95
TIGHT_MOST = 6


def tight_boundaries(graph: ComputeGraph, budget_bytes: int, sequence: Sequence[Hashable], *,
                     most: int = TIGHT_MOST) -> list:
    """Where ``sequence`` finds the budget binding: of each run of first computations at
    which its memory is at least :data:`TIGHT_SHARE` of ``budget_bytes``, the one where
    it is highest, the ``most`` highest runs, in the reference order. A schedule close to
    the optimum is close to the budget where every schedule must be, so the 0/1 stage
    program there (:func:`fixed_order_bound`'s ``boundaries``) is a strong bound.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    sequence : sequence of node ids
        A valid schedule whose first computations keep the reference order.
    most : int
        Boundaries at most.

    Returns
    -------
    list
        Node ids, in the reference order (empty when the sequence stays below the share).

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v, nb, t in zip("xyzuw", [1, 3, 2, 1, 1], [10, 1, 1, 1, 1]): g.add_node(v, bytes=nb, time=float(t))
    >>> for e in ["xy", "yz", "zu", "uw", "yw"]: g.add_edge(*e)
    >>> tight_boundaries(g, 5, ["x", "y", "z", "u", "x", "y", "w"])
    ['z', 'w']
    """
    from solver.simulate import simulate

    curve = simulate(graph, list(sequence)).memory_curve
    index = {v: i for i, v in enumerate(graph.order)}
    fixed = graph.fixed_bytes  # (a sum over the graph's sources, each time it is read)
    floor = TIGHT_SHARE * (int(budget_bytes) - fixed)
    runs: list = []  # (memory, op index) of each run's highest first computation
    seen: set = set()
    inside = False
    for pos, v in enumerate(sequence):
        if v in seen:
            continue
        seen.add(v)
        mem = curve[pos] - fixed
        if mem < floor:
            inside = False
            continue
        if not inside:
            runs.append((mem, index[v]))
        elif mem > runs[-1][0]:
            runs[-1] = (mem, index[v])
        inside = True
    picked = sorted(runs, key=lambda r: (-r[0], r[1]))[:max(0, most)]
    return [graph.order[t] for t in sorted(t for _, t in picked)]


def fixed_order_bound(graph: ComputeGraph, budget_bytes: int, *, tries: int = TRIES,
                      time_limit: float | None = None, enough: float | None = None,
                      boundaries: Sequence[Sequence[Hashable]] = ()) -> float:
    """The best fixed-order lower bound found in the time: the largest of
    :func:`forced_recompute_bound`, :func:`stage_lp_bound` at single boundaries (the
    ``tries`` steps of the reference order most over the budget or where the forced
    recomputation is largest, then :data:`SCAN` steps over the budget at an even
    stride and those beside the best three), the 0/1 stage program grown from the best
    single step one boundary at a time (:data:`GROW_TRIES`: the step most over the
    budget, then the next best steps near and far, each kept where it raises the
    bound), and the 0/1 stage program at the best one, two and four steps
    (:data:`INTEGRAL_SETS`) and at the :data:`EVERY` steps most over the budget, each
    after the other while time is left (each bound holds alone, so the largest holds).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    tries : int
        How many single boundaries to try at most.
    time_limit : float, optional
        Seconds in all; an LP that does not finish in them counts for nothing. Without
        one the 0/1 programs get :data:`INTEGRAL_SECONDS`.
    enough : float, optional
        Stop at the first bound at least this high (a cost already close enough).
    boundaries : sequence of sequences of node ids
        Sets of boundaries at which the 0/1 stage program runs first, one after the
        other, in :data:`GIVEN_SHARE` of the time (without a time limit, each in
        :data:`INTEGRAL_SECONDS`): where a schedule or a search found the budget
        binding (:func:`tight_boundaries`, ``stage_milp``'s ``info["boundaries"]``).
        Ids not in the graph's order are left out.

    Returns
    -------
    float
        At least the store-all cost; ``math.inf`` when no fixed-order schedule fits.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v, nb, t in zip("xyzuw", [1, 3, 2, 1, 1], [10, 1, 1, 1, 1]): g.add_node(v, bytes=nb, time=float(t))
    >>> for e in ["xy", "yz", "zu", "uw", "yw"]: g.add_edge(*e)
    >>> round(forced_recompute_bound(g, 5), 3), round(fixed_order_bound(g, 5), 3)
    (14.333, 25.0)
    >>> round(fixed_order_bound(g, 5, tries=0), 3), round(fixed_order_bound(g, 5, tries=0, boundaries=[["z", "u"]]), 3)
    (14.333, 25.0)
    """
    from solver.deadline import Deadline

    deadline = Deadline(time_limit)
    reference = ops, index, size, last_read = reference_facts(graph)
    excess = step_excess(graph, ops, index, size, last_read, int(budget_bytes) - graph.fixed_bytes)
    amounts = _forced_amounts(graph, budget_bytes, reference, excess)
    best = _forced_bound(graph, amounts)

    def bound_at(marks: list, integral: bool, seconds):
        return stage_lp_bound(graph, budget_bytes, boundaries=[ops[t] for t in marks], time_limit=seconds,
                              integral=integral)

    candidates = _candidates(graph, ops, excess, amounts)
    known: dict = {}  # step -> its LP bound, solved for the sets given
    given = [p for p in dict.fromkeys(tuple(sorted({index[v] for v in marks if v in index})) for marks in boundaries)
             if p]
    if given and math.isfinite(best):
        # the 0/1 program only where the LP there beats the LP at the first candidate
        # (milliseconds each; the runs behind this: docs/tuning.md, GIVEN_SHARE)
        seconds = lambda: None if time_limit is None else max(0.0, deadline.left())  # noqa: E731
        lps = [bound_at(list(p), False, seconds()) for p in [candidates[:1]] + given] if candidates else [None]
        first = lps[0] if lps[0] is not None else -math.inf
        best = max([best] + [lb for lb in lps if lb is not None])
        given = [p for p, lb in zip(given, lps[1:]) if lb is not None and lb >= first]
        if lps[0] is not None:
            known[candidates[0]] = lps[0]  # (not solved again below)
    until = None if time_limit is None else _time.perf_counter() + GIVEN_SHARE * deadline.left()
    for j, picked in enumerate(given):
        if not math.isfinite(best) or (enough is not None and best >= enough):
            break
        share = INTEGRAL_SECONDS if until is None else (until - _time.perf_counter()) / (len(given) - j)
        if share <= 0.05:
            break
        lb = bound_at(list(picked), True, share)
        best = best if lb is None else max(best, lb)
    if not math.isfinite(best) or tries <= 0:
        return best

    return _best_of(bound_at, candidates[:tries], graph.total("time"), best,
                    deadline, time_limit, enough, every=over_budget_steps(graph, ops, excess, every=True)[:EVERY],
                    pool=sorted(over_budget_steps(graph, ops, excess)), known=known)


# ------------------------------------------------------------------ free order
#: Boundaries that :func:`free_order_bound` tries by default (single ones, then a chain).
FREE_TRIES = 4
#: Steps of the reference order most over the budget whose op is scored as a boundary.
FREE_CANDIDATES = 32


def _ancestry(graph: ComputeGraph, ops: list, index: dict) -> tuple[list[int], list[int]]:
    """Strict op ancestors and descendants of every op, as bit masks over op indices."""
    from solver.indexed import ancestry_masks

    return ancestry_masks([[index[u] for u in graph.op_preds(v)] for v in ops])


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class _Ancestry:
    """The order-free facts about first computations that :func:`free_stage_lp_bound`
    uses: an op's ancestors run first before it, its descendants after."""

    def __init__(self, graph: ComputeGraph):
        self.ops, self.index, self.size, _ = reference_facts(graph)
        nodes = graph.nx.nodes
        self.anc, self.desc = _ancestry(graph, self.ops, self.index)
        self.readers = [[self.index[w] for w in graph.op_succs(v)] for v in self.ops]
        self.output = [bool(nodes[v].get("output", False)) for v in self.ops]

    def required(self, c: int) -> list[int]:
        """Values surely computed before ``c`` and surely read after it (or outputs)."""
        d = self.desc[c]
        return [i for i in _bits(self.anc[c])
                if self.output[i] or any((d >> w) & 1 for w in self.readers[i])]

    def rule(self, marks: list[int]) -> _Rule:
        m = len(marks)
        anc, desc = self.anc, self.desc
        cand = [_bits(anc[c]) for c in marks]

        def deadline_of(w: int, k: int) -> int:
            for k2 in range(k, m - 1):
                c = marks[k2 + 1]
                if w == c or (anc[c] >> w) & 1:
                    return k2
            return m - 1

        def required(i: int, k: int):
            if self.output[i]:
                return m - 1
            d = desc[marks[k]]
            last = None
            for w in self.readers[i]:
                if (d >> w) & 1:
                    j = deadline_of(w, k)
                    last = j if last is None else min(last, j)
            return last

        return _Rule(candidates=lambda k: cand[k], before=lambda i, k: bool((anc[marks[k]] >> i) & 1),
                     required=required, may_first=lambda i, k: not (anc[marks[k]] >> i) & 1)


def free_stage_lp_bound(graph: ComputeGraph, budget_bytes: int, *, boundaries: list,
                        time_limit: float | None = None, integral: bool = False,
                        _facts: "_Ancestry | None" = None) -> float | None:
    """A lower bound on the cost of *any* schedule, whatever its order: the relaxation
    of :func:`stage_lp_bound` at boundary ops whose steps are placed by the DAG alone.

    Whatever the order, the first computation of an op comes after those of its
    ancestors and before those of its descendants. So at the first computation of a
    boundary op ``c``, every ancestor of ``c`` that a descendant of ``c`` reads (or that
    is a step output) is live or is computed again before that read; a recomputation
    needs each input live or computed again too; and what is live must fit the budget
    beside ``c``'s inputs, output and workspace. With boundaries ``c_1, c_2, ...``,
    each an ancestor of the next, the intervals between their first computations are
    the same in every order, and a read by an ancestor of ``c_{k+1}`` falls before
    ``c_{k+1}``. Values neither side of a boundary are left out (a relaxation), and a
    multi-output op's run is charged only in an interval where none of its projections
    may run first.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    boundaries : list of node ids
        Ops, each an ancestor of the next.
    time_limit : float, optional
        Seconds for building and solving the LP; past them the answer is None.
    integral : bool
        Solve the 0/1 program rather than its LP relaxation (as in :func:`stage_lp_bound`).

    Returns
    -------
    float or None
        At least the store-all cost; ``math.inf`` when the LP proves that nothing fits;
        None when it did not finish in time.

    Raises
    ------
    ValueError
        A boundary is not an op, or is not an ancestor of the next.

    Examples
    --------
    On :func:`stage_lp_bound`'s example the order is forced (a chain), so the bounds agree.

    >>> g = ComputeGraph()
    >>> for v, b in zip("abcd", [1, 4, 3, 3]): g.add_node(v, bytes=b, time=2.0)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d"); g.add_edge("a", "d")
    >>> round(free_stage_lp_bound(g, 7, boundaries=["c"]), 3)
    10.0
    """
    from solver.deadline import Deadline

    deadline = Deadline(time_limit)
    facts = _facts or _Ancestry(graph)
    base = float(graph.total("time"))
    if not facts.ops:
        return base
    marks = _boundary_indices(graph, boundaries, facts.index)
    for a, b in zip(marks, marks[1:]):
        if not (facts.anc[b] >> a) & 1:
            raise ValueError(f"boundary {facts.ops[a]!r} is not an ancestor of {facts.ops[b]!r}; "
                             "give boundaries along a path of the graph")
    if not marks:
        return base
    return _relaxation(graph, budget_bytes, facts.ops, facts.index, facts.size, marks, facts.rule(marks),
                       deadline, None, integral)


def free_order_bound(graph: ComputeGraph, budget_bytes: int, *, tries: int = FREE_TRIES,
                     time_limit: float | None = None, enough: float | None = None,
                     _facts: "_Ancestry | None" = None) -> float:
    """The best lower bound valid for any order found in the time:
    :func:`free_stage_lp_bound` at the single ops where the values that must be live or
    computed again exceed the budget the most, then along a chain of them, then the 0/1
    program at the best one, two and four of them (:data:`INTEGRAL_SETS`) and at every
    candidate, each kept to a chain.

    Candidates are the ops of the :data:`FREE_CANDIDATES` steps of the reference order
    most over the budget; each is scored by the bytes its order-free argument forces
    (ancestors read by descendants, its inputs, output and workspace) above the budget.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    tries : int
        How many single boundaries to try (the best scored first).
    time_limit : float, optional
        Seconds in all; an LP that does not finish in them counts for nothing. Without
        one the 0/1 programs get :data:`INTEGRAL_SECONDS`.
    enough : float, optional
        Stop at the first bound at least this high (a cost already close enough).

    Returns
    -------
    float
        At least the store-all cost; ``math.inf`` when nothing fits.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4)  # store-all peaks at 6 B
    >>> free_order_bound(g, 6), round(free_order_bound(g, 5), 3)
    (12.0, 13.0)
    """
    from solver.deadline import Deadline

    deadline = Deadline(time_limit)
    base = float(graph.total("time"))
    facts = _Ancestry(graph) if _facts is None else _facts
    ops, index, size = facts.ops, facts.index, facts.size
    if not ops or tries <= 0:
        return base
    _, _, _, last_read = reference_facts(graph)
    nodes = graph.nx.nodes
    room = int(budget_bytes) - graph.fixed_bytes
    excess = step_excess(graph, ops, index, size, last_read, room)
    over = over_budget_steps(graph, ops, excess)
    scored = []
    for t in over[:FREE_CANDIDATES]:
        if deadline.expired():
            break
        inputs = {index[u] for u in graph.op_preds(ops[t])}
        need = size[t] + least_workspace(nodes[ops[t]]) + sum(size[i] for i in inputs)
        need += sum(size[i] for i in facts.required(t) if i not in inputs)
        if need > room:
            scored.append((need - room, t))
    scored.sort(key=lambda x: (-x[0], x[1]))
    picks = [t for _, t in scored[:tries]]

    def chain(marks: list) -> list:
        """The longest run of ``marks`` in the reference order, each an ancestor of the
        next (the reference order is topological: ancestors come first)."""
        out = []
        for t in sorted(marks):
            if all((facts.anc[t] >> a) & 1 for a in out):
                out.append(t)
        return out

    def bound_at(marks: list, integral: bool, seconds):
        return free_stage_lp_bound(graph, budget_bytes, boundaries=[ops[t] for t in marks], _facts=facts,
                                   time_limit=seconds, integral=integral)

    best = _best_of(bound_at, picks, base, base, deadline, time_limit, enough, arrange=chain, together=True,
                    every=[t for _, t in scored[:EVERY]])
    return best


#: Seconds of one probe of :func:`relaxed_peak_bound`.
PROBE_SECONDS = 0.5


def relaxed_peak_bound(graph: ComputeGraph, *, lower: int, upper: int, first: int | None = None,
                       time_limit: float = 1.0) -> int:
    """A peak no schedule goes below, raised from ``lower`` where the order-free stage
    relaxation (:func:`free_order_bound`) proves budgets infeasible.

    A budget at which the relaxation has no solution fits no schedule in any order, so
    every schedule peaks above it. Bisection between ``lower`` (no schedule peaks below
    it) and ``upper`` (a peak that a schedule reaches), to 0.5 % of ``upper``; a probe
    that runs out of its :data:`PROBE_SECONDS` proves nothing.

    Parameters
    ----------
    graph : ComputeGraph
    lower : int
        A proven lower bound on the peak, fixed bytes included
        (:func:`solver.feasibility.peak_lower_bound`).
    upper : int
        A peak that some schedule reaches.
    first : int, optional
        The budget to probe first (one a caller asks about).
    time_limit : float
        Seconds in all.

    Returns
    -------
    int
        At least ``lower``, at most ``upper``: no schedule peaks below it.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver.feasibility import peak_lower_bound
    >>> g = training_chain(4)
    >>> lb = peak_lower_bound(g)[0]
    >>> lb <= relaxed_peak_bound(g, lower=lb, upper=6) <= 6
    True
    """
    from solver.feasibility import bisect_peak_bound

    if int(upper) <= int(lower) or not graph.ops:
        return int(lower)
    facts = _Ancestry(graph)

    def rules_out(budget: int, deadline) -> bool | None:
        bound = free_order_bound(graph, budget, time_limit=max(0.0, deadline.left()), enough=math.inf, _facts=facts)
        return True if math.isinf(bound) else None

    return bisect_peak_bound(rules_out, lower=lower, upper=upper, first=first, time_limit=time_limit,
                             probe_seconds=PROBE_SECONDS, resolution=200)[0]

"""CP-SAT with retention intervals: each computation of an op keeps its value for an interval.

After Bartan et al., "Moccasin: Efficient Tensor Rematerialization for Neural Networks",
ICML 2023: op ``i`` has up to ``C_i`` computations; computation ``c`` is an optional
interval ``[start, end]`` during which its value is resident, and one cumulative
constraint bounds the memory. O(sum C_i) interval variables and O(edges x C^2) booleans
(which copy of an input a computation reads), instead of the O(n^2) of
:mod:`solver.methods.milp`.

Time axis: the steps of the Checkmate stage space (the space of
:func:`solver.methods.bruteforce.brute_force_fixed`): step ``(t, k)``, ``k <= t``, is where
stage ``t`` may run op ``k``; the first computation of op ``i`` is at ``(i, i)``, the others
at ``(t, i)`` for some ``t > i``. An interval charges its op's bytes from its start to its
end; a reader at step ``q`` needs a present copy of each input with ``start < q <= end``;
copies of one op do not overlap (the simulator frees the old copy before the next
computation); the last copy of an output ends at the last step; the workspace is a
one-step interval. Every step's charge is then at least what :func:`solver.simulate`
charges for the extracted sequence (copies sorted by step), and equal when ends are at
the last reads.

When the answer is proven optimal: CP-SAT returns OPTIMAL *and* every op's copy limit
``C_i`` is the most computations the stage space allows it (one per stage from its
own on, 1 for non-recomputable ops): then ``info["status"] == "optimal"`` and
``lower_bound`` equals the cost. With smaller limits an OPTIMAL answer is optimal only
among schedules with at most ``C_i`` computations of op ``i``
(``info["status"] == "optimal_within_copies"``); ``lower_bound`` is then the LP bound of
:func:`solver.methods.milp.lp_lower_bound` when it solves in the time left, else the
store-all cost. ``copies="auto"`` starts at 2 copies (all copies for graphs of at most
12 ops) and gives a node one more copy while the solution uses all of its copies.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Hashable, Sequence

from graphs import ComputeGraph
from solver.deadline import Deadline, OutOfTime
from solver.errors import NoScheduleFound, SolverError
from solver.methods.contract import room_of, time_limit_of
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["cpsat"]

log = logging.getLogger(__name__)

SMALL_GRAPH = 12
#: A model may take this share of the time left to build; the rest is for solving.
BUILD_SHARE = 0.8
#: Seconds CP-SAT takes to take in a model (copy and presolve, which its time limit does
#: not stop), per second spent building it (docs/tuning.md).
LOAD_PER_BUILD = 2.0


def _integer_times(times: list[float]) -> tuple[list[int], int]:
    """Scale times to integers exactly when they are rationals with a small denominator."""
    for scale in (1, 10, 100, 1000, 10**4, 10**6):
        scaled = [t * scale for t in times]
        if all(abs(s - round(s)) < 1e-9 * max(1.0, abs(s)) for s in scaled):
            return [int(round(s)) for s in scaled], scale
    scale = 10**6
    return [int(round(t * scale)) for t in times], scale


class _Problem:
    def __init__(self, graph: ComputeGraph, budget: int) -> None:
        self.graph, self.budget = graph, budget
        self.ops = list(graph.order)
        n = self.n = len(self.ops)
        index = self.index = {v: i for i, v in enumerate(self.ops)}
        self.size = [int(graph[v]["bytes"]) for v in self.ops]
        self.ws = [int(graph[v].get("workspace", 0)) for v in self.ops]
        self.time = [float(graph[v]["time"]) for v in self.ops]
        self.itime, self.tscale = _integer_times(self.time)
        self.output = [bool(graph[v].get("output", False)) for v in self.ops]
        self.pred = [sorted(index[u] for u in graph.op_preds(v)) for v in self.ops]
        self.succ = [sorted(index[w] for w in graph.op_succs(v)) for v in self.ops]
        recomputable = [bool(graph[v].get("recomputable", True)) for v in self.ops]
        self.max_copies = [
            (n - i) if recomputable[i] and (self.succ[i] or self.output[i]) else 1 for i in range(n)
        ]
        self.capacity = budget - graph.fixed_bytes
        self.horizon = n * (n + 1) // 2

    @staticmethod
    def slot(t: int, k: int) -> int:
        return t * (t + 1) // 2 + k


def _hint_copies(p: _Problem, sequence: Sequence[Hashable]) -> list[list[int]] | None:
    """Start slots of every computation of a stage-form sequence, per op."""
    from solver.methods.milp import normalized_stages

    stages = normalized_stages(p.graph, sequence)
    if stages is None:
        return None
    starts: list[list[int]] = [[] for _ in range(p.n)]
    for t, st in enumerate(stages):
        for k in st:
            starts[k].append(p.slot(t, k))
    return starts


def _solve_once(p: _Problem, copies: list[int], hint: list[list[int]] | None, deadline: Deadline,
                workers: int):
    """Build and solve one model; raises :class:`OutOfTime` when the model does not build
    in :data:`BUILD_SHARE` of the time left."""
    from ortools.sat.python import cp_model

    built = time.perf_counter()
    build_by = deadline.within(BUILD_SHARE * deadline.left())
    model = cp_model.CpModel()
    H = p.horizon
    starts, ends, present = [], [], []
    intervals, demands = [], []
    for i in range(p.n):
        build_by.check("building the CP-SAT model")
        s_i, e_i, p_i = [], [], []
        for c in range(copies[i]):
            if c == 0:
                s = model.NewIntVar(p.slot(i, i), p.slot(i, i), f"s{i}_0")
                pr = model.NewBoolVar(f"p{i}_0")
                model.Add(pr == 1)
            else:
                dom = cp_model.Domain.FromValues([p.slot(t, i) for t in range(i + 1, p.n)])
                s = model.NewIntVarFromDomain(dom, f"s{i}_{c}")
                pr = model.NewBoolVar(f"p{i}_{c}")
                model.AddImplication(pr, p_i[-1])
                model.Add(s > e_i[-1]).OnlyEnforceIf(pr)  # after the previous copy dies
            e = model.NewIntVar(0, H - 1, f"e{i}_{c}")
            model.Add(e >= s)
            sz = model.NewIntVar(1, H, f"z{i}_{c}")
            if p.size[i]:
                intervals.append(model.NewOptionalIntervalVar(s, sz, e + 1, pr, f"I{i}_{c}"))
                demands.append(p.size[i])
            else:
                model.Add(sz == e - s + 1)
            if p.ws[i]:
                intervals.append(model.NewOptionalFixedSizeIntervalVar(s, 1, pr, f"W{i}_{c}"))
                demands.append(p.ws[i])
            s_i.append(s)
            e_i.append(e)
            p_i.append(pr)
        starts.append(s_i)
        ends.append(e_i)
        present.append(p_i)
        if p.output[i]:
            for c in range(copies[i]):
                last = [present[i][c]] + ([present[i][c + 1].Not()] if c + 1 < copies[i] else [])
                model.Add(ends[i][c] == H - 1).OnlyEnforceIf(last)
    model.AddCumulative(intervals, demands, p.capacity)
    serve = {}
    for j in range(p.n):
        build_by.check("building the CP-SAT model")
        for d in range(copies[j]):
            for i in p.pred[j]:
                options = []
                for c in range(copies[i]):
                    y = model.NewBoolVar(f"y{i}_{c}_{j}_{d}")
                    model.AddImplication(y, present[i][c])
                    model.Add(starts[i][c] < starts[j][d]).OnlyEnforceIf(y)
                    model.Add(ends[i][c] >= starts[j][d]).OnlyEnforceIf(y)
                    options.append(y)
                    serve[i, c, j, d] = y
                model.AddBoolOr(options).OnlyEnforceIf(present[j][d])
    model.Minimize(sum(p.itime[i] * present[i][c] for i in range(p.n) for c in range(1, copies[i])))
    if hint is not None:
        _add_hint(model, p, copies, hint, starts, ends, present, serve)
    build_by.check("building the CP-SAT model")
    solver = cp_model.CpSolver()
    # CP-SAT copies and presolves the model before its limit is read: a model that it
    # cannot take in within the time left is not handed to it
    solve_for = deadline.left() - LOAD_PER_BUILD * (time.perf_counter() - built)
    if solve_for < 0.05:
        raise OutOfTime("loading the CP-SAT model")
    solver.parameters.max_time_in_seconds = solve_for
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    used = [0] * p.n
    seq = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        events = []
        for i in range(p.n):
            for c in range(copies[i]):
                if solver.Value(present[i][c]):
                    events.append((solver.Value(starts[i][c]), i))
                    used[i] += 1
        events.sort()
        seq = [p.ops[i] for _, i in events]
    bound = solver.BestObjectiveBound() if status != cp_model.INFEASIBLE else math.inf
    return status, seq, used, bound


def _add_hint(model, p: _Problem, copies, hint, starts, ends, present, serve) -> None:
    H = p.horizon
    end_of: dict[tuple[int, int], int] = {}
    for i in range(p.n):
        for c, s in enumerate(hint[i]):
            end_of[i, c] = H - 1 if (p.output[i] and c + 1 == len(hint[i])) else s
    for j in range(p.n):
        for d, q in enumerate(hint[j]):
            for i in p.pred[j]:
                c = max(c for c, s in enumerate(hint[i]) if s < q)
                end_of[i, c] = max(end_of[i, c], q)
                serve_var = serve.get((i, c, j, d))
                if serve_var is not None:
                    for c2 in range(copies[i]):
                        model.AddHint(serve[i, c2, j, d], int(c2 == c))
    for i in range(p.n):
        for c in range(copies[i]):
            if c < len(hint[i]):
                if c:
                    model.AddHint(starts[i][c], hint[i][c])
                    model.AddHint(present[i][c], 1)
                model.AddHint(ends[i][c], end_of[i, c])
            elif c:
                model.AddHint(present[i][c], 0)


@register("cpsat", family="exact", exact=True, order="fixed")
def cpsat(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit: float | None = None,
    hint: Schedule | Sequence[Hashable] | None = None,
    copies: int | str | None = "auto",
    workers: int = 1,
) -> Schedule:
    """CP-SAT with retention intervals (Moccasin-style, Bartan et al., ICML 2023).

    Optimizes the Checkmate stage space (first computations in the reference order);
    see the module docstring for the model and for when the answer is proven optimal.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds for all rounds together, model building included (default 60); the best
        schedule found is returned, or the warm start (``info["status"] == "hint"``) when
        the model does not build in time.
    hint : Schedule or sequence, optional
        Warm start (brought to stage form; used when it fits). Store-all is tried too.
    copies : int, "auto" or None
        Computations allowed per op: an int caps them, ``None`` allows every
        computation the stage space can use (exact, larger model), ``"auto"`` grows the
        cap of a node while an optimal answer uses all of its copies.
    workers : int
        CP-SAT search workers.

    Returns
    -------
    Schedule
        ``info["status"]``: ``"optimal"``, ``"optimal_within_copies"``, ``"feasible"`` or
        ``"hint"``;
        ``info["copies"]``: the largest cap used.

    Raises
    ------
    NoScheduleFound
        Nothing found within the budget and time (or the space is infeasible).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3, fwd_bytes=4)
    >>> s = cpsat(g, 17)
    >>> s.info["status"], simulate(g, s.sequence).peak_bytes <= 17
    ('optimal', True)
    """
    from ortools.sat.python import cp_model

    from solver.methods.milp import candidate_hints, exact_workspaces, lp_lower_bound

    t0 = time.perf_counter()
    budget = int(budget_bytes)
    limit, deadline = time_limit_of(time_limit)
    room_of(graph, budget, method="cpsat")
    p = _Problem(graph, budget)
    cap, grow = _copy_caps(p, copies)
    stages = candidate_hints(graph, budget, hint)
    fallback = [graph.order[i] for st in stages[0] for i in st] if stages else None
    warm, cap = _warm_start(p, stages[0], cap) if stages else (None, cap)
    run = _rounds(p, cap, grow, warm, deadline, workers, t0=t0, limit=limit)
    best_seq, best_cost, status_name, bound, rounds, stopped, status, cap = run
    if best_seq is None and fallback is not None and status != cp_model.INFEASIBLE:
        # out of time before a solution: the warm start (it fits the budget) is all there is
        stopped = stopped or "the solver stopped without a solution"
        best_seq, best_cost, status_name = fallback, simulate(graph, fallback).cost, "hint"
    if best_seq is None:
        if status == cp_model.INFEASIBLE:
            raise NoScheduleFound(f"no schedule with at most {max(cap)} computations of an op fits "
                                  f"{budget} B (proven by CP-SAT); allow more copies (copies='auto')")
        raise NoScheduleFound(f"cpsat found no schedule within {budget} B in {limit:.0f} s; "
                              f"give a longer time_limit or a warm start (hint=)")
    if not exact_workspaces(graph):
        bound = None  # the model over-charges projections that continue a run: not a bound
    if bound is None:
        remaining = deadline.left()
        lp = lp_lower_bound(graph, budget, time_limit=remaining) if remaining > 1 else None
        bound = float(sum(p.time)) if lp is None else lp
    bound = min(bound, best_cost)
    info = {"order": "fixed", "status": status_name, "copies": max(cap), "rounds": rounds}
    if stopped:
        info["stopped"] = stopped
    return Schedule(sequence=best_seq, method="cpsat", lower_bound=bound, info=info)


def _copy_caps(p: "_Problem", copies) -> tuple[list[int], bool]:
    """Computations allowed per op at the start (see :func:`cpsat`'s ``copies``), and
    whether they grow."""
    if copies is None or (copies == "auto" and p.n <= SMALL_GRAPH):
        return list(p.max_copies), False
    if copies == "auto":
        return [min(2, m) for m in p.max_copies], True
    if int(copies) < 1:
        raise ValueError(f"copies must be at least 1, got {copies!r}")
    return [min(int(copies), m) for m in p.max_copies], False


def _warm_start(p: "_Problem", stages: list, cap: list[int]) -> tuple[list | None, list[int]]:
    """The slots of a stage form as the model's hint (None where an op runs more often
    than the model allows), with the caps raised to hold it."""
    warm = [[] for _ in range(p.n)]
    for t, st in enumerate(stages):
        for k in st:
            warm[k].append(p.slot(t, k))
    if any(len(w) > m for w, m in zip(warm, p.max_copies)):
        return None, cap
    return warm, [max(c, len(w)) for c, w in zip(cap, warm)]


def _rounds(p: "_Problem", cap: list[int], grow: bool, warm, deadline, workers: int, *, t0: float, limit: float):
    """The model solved, the caps of the ops whose copies an optimal answer uses up grown
    between rounds; returns ``(best sequence, its cost, status name, bound, rounds,
    why it stopped early, the last CP-SAT status, the caps)``."""
    from ortools.sat.python import cp_model

    best_seq, best_cost, status_name, bound = None, math.inf, "feasible", None
    rounds = 0
    stopped = None
    while True:
        rounds += 1
        try:
            status, seq, used, cp_bound = _solve_once(p, cap, warm, deadline, workers)
        except OutOfTime:
            stopped = f"the model of {p.n} ops could not be built and taken in in time"
            log.info("cpsat: %s (round %d, %.2f s)", stopped, rounds, time.perf_counter() - t0)
            status = cp_model.UNKNOWN
            break
        complete = all(c >= m for c, m in zip(cap, p.max_copies))
        if status == cp_model.INFEASIBLE:
            if complete:
                raise NoScheduleFound(
                    f"no schedule of the stage space (first computations in the reference order) "
                    f"fits {p.budget} B (proven by CP-SAT); a free-order method may still fit"
                )
            if not grow or time.perf_counter() - t0 > 0.9 * limit:
                break
            # infeasible under the caps: every capped op gets one more copy
            cap = [min(c + 1, m) for c, m in zip(cap, p.max_copies)]
            continue
        if seq is not None:
            r = simulate(p.graph, seq)
            if not r.valid or r.peak_bytes > p.budget:
                raise SolverError(f"cpsat extracted a schedule the simulator rejects: "
                                  f"{r.error or r.peak_bytes} (a model bug)")
            if r.cost < best_cost:
                best_seq, best_cost = seq, r.cost
                warm = _hint_copies(p, seq)
        if status == cp_model.OPTIMAL:
            if complete:
                status_name, bound = "optimal", best_cost
                break
            status_name = "optimal_within_copies"
        else:
            status_name = "feasible"
            if complete and cp_bound is not None and math.isfinite(cp_bound):
                bound = float(sum(p.time)) + cp_bound / p.tscale
        saturated = [i for i in range(p.n) if used[i] >= cap[i] < p.max_copies[i]]
        if (not grow or status != cp_model.OPTIMAL or not saturated
                or time.perf_counter() - t0 > 0.9 * limit):
            break
        for i in saturated:
            cap[i] += 1
        log.info("cpsat: round %d used all copies of %d ops; growing their caps", rounds, len(saturated))
    return best_seq, best_cost, status_name, bound, rounds, stopped, status, cap

"""The Checkmate MILP (R, S, FREE, U) on OR-Tools, with exact memory accounting, and its bounds.

Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization",
MLSys 2020. One *stage* per op, in the graph's reference order; stage ``t`` recomputes
a subset of the ops before ``t`` (in reference order) and then computes op ``t``
(the space of :func:`solver.methods.bruteforce.brute_force_fixed`). Variables, with ops
numbered ``0..n-1`` in reference order:

``R[t, i]`` (binary, ``i <= t``, ``R[t, t] = 1``)
    op ``i`` runs in stage ``t``; ``recomputable=False`` ops only in their own stage.
``S[t, i]`` (binary, ``i < t``)
    the value of ``i`` is resident when stage ``t`` starts; ``S[n, o] = 1`` for the step's
    outputs (they stay resident until the end). ``S[t, i]`` is fixed to 0 where no op
    that can still run reads ``i`` (the simulator would have freed it).
``FREE[t, i, k]`` (continuous in [0, 1], ``k = i`` or ``k`` reads ``i``)
    the value of ``i`` is freed right after step ``k`` of stage ``t``. It appears with a
    negative sign in memory, so only its *upper* bounds matter, and they make it exact:
    ``FREE <= R[t, k]``, ``FREE <= 1 - S[t+1, i]``, ``FREE <= 1 - R[t, j]`` for every
    reader ``j > k`` of ``i`` in the stage, and ``sum_k FREE[t, i, k] <= R[t, i] + S[t, i]``
    (a value is freed at most once, and only when it is resident -- the condition that
    Checkmate's own cvxpy linearization misses).
``U[t, k]`` (continuous)
    bytes in use at step ``k`` of stage ``t``: fixed bytes + retained values + values
    computed so far in the stage - values freed so far; ``U[t, k] + workspace_k R[t, k]
    <= budget``.

Constraints: ``R[t, j] <= R[t, i] + S[t, i]`` for every edge ``i -> j`` (inputs resident),
``S[t+1, i] <= S[t, i] + R[t, i]`` (only resident values are kept), ``R[t, i] + S[t, i]
<= 1`` (a resident value is never recomputed; the simulator would have freed the old copy
first, so this loses nothing). Objective: total compute ``sum R[t, i] time_i``.

With ``FREE`` at its upper bound the memory of every step equals what
:func:`solver.simulate` charges for the extracted sequence (stage by stage, the ops with
``R[t, i] = 1`` in reference order); any other solution only over-charges. So the MILP
optimum is the optimum of the stage space under the simulator's model, and the simulator
grades the extracted sequence to the same cost.

Backend: SCIP through ``pywraplp`` (default). On the benchmark graphs SCIP's
LP-based branch and bound closes the gap where CP-SAT on the same model keeps its bound at
the LP value for a long time, because the model is LP-heavy (continuous ``U`` and
``FREE``); ``backend="CP_SAT"`` or ``"CBC"`` can be chosen.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from graphs import ComputeGraph
from solver.bounds import least_workspace
from solver.deadline import Deadline, OutOfTime
from solver.errors import NoScheduleFound, SolverError
from solver.lp_backend import create_solver, solve_quietly
from solver.methods.contract import DEFAULT_TIME_LIMIT, time_limit_of
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["checkmate_milp", "lp_lower_bound", "lower_bound", "stage_end_lower_bound", "stage_form"]

log = logging.getLogger(__name__)

#: Model building may use this share of the time left: handing a model to the backend
#: takes up to about a quarter of its build time again (docs/tuning.md), then it solves.
BUILD_SHARE = 0.7
#: Seconds the backend takes to load a model, per second spent building it.
LOAD_PER_BUILD = {"SCIP": 0.25, "CBC": 0.25, "CP_SAT": 0.25}
LP_LOAD_PER_BUILD = 0.1


class _Zero(int):
    """The constant 0 of a variable that the model fixes to 0 (never created)."""


_ZERO_SENTINEL = _Zero(0)


# --------------------------------------------------------------------------- stage form
def stage_form(graph: ComputeGraph, sequence: Sequence[Hashable]) -> list[list[int]] | None:
    """Split a sequence into Checkmate stages, or ``None`` when it is not of that form.

    Stage ``t`` is the list of op indices (reference order) that run up to and including
    the first computation of op ``t``: earlier ops in increasing order, then ``t``.

    Parameters
    ----------
    graph : ComputeGraph
    sequence : sequence of node ids

    Returns
    -------
    list of list of int, or None

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> stage_form(chain(3), [0, 1, 0, 2])
    [[0], [1], [0, 2]]
    >>> stage_form(chain(3), [0, 1, 1, 0, 2]) is None
    True
    """
    index = {v: i for i, v in enumerate(graph.order)}
    stages: list[list[int]] = []
    current: list[int] = []
    for v in sequence:
        i = index.get(v)
        if i is None:
            return None
        t = len(stages)
        if i == t:
            stages.append(current + [i])
            current = []
        elif i < t and (not current or current[-1] < i):
            current.append(i)
        else:
            return None
    if current or len(stages) != len(index):
        return None
    return stages


def normalized_stages(graph: ComputeGraph, sequence: Sequence[Hashable]) -> list[list[int]] | None:
    """Stage form of a sequence, after sorting and deduplicating each stage's recomputations."""
    index = {v: i for i, v in enumerate(graph.order)}
    stages: list[list[int]] = []
    current: set[int] = set()
    for v in sequence:
        i = index.get(v)
        if i is None:
            return None
        t = len(stages)
        if i == t:
            stages.append(sorted(current) + [i])
            current = set()
        elif i < t:
            current.add(i)
        else:
            return None
    return stages if len(stages) == len(index) else None


# --------------------------------------------------------------------------- the model
@dataclass
class _Model:
    solver: object
    n: int
    ops: list
    R: dict = field(default_factory=dict)
    S: dict = field(default_factory=dict)
    FREE: dict = field(default_factory=dict)
    U: dict = field(default_factory=dict)
    extra_terms: list = field(default_factory=list)
    size: list = field(default_factory=list)
    pred: list = field(default_factory=list)
    scale: float = 1.0


def _add(solver, constraint) -> None:
    """Add a constraint; a comparison of constants is checked instead."""
    if isinstance(constraint, bool):
        if not constraint:
            raise SolverError("checkmate_milp: a constraint between constants fails (a model bug)")
        return
    solver.Add(constraint)


def _build(graph: ComputeGraph, budget: int, backend: str, *, relax: bool,
           deadline: Deadline | None = None) -> _Model:
    """The model; raises :class:`OutOfTime` once ``deadline`` passes while building."""
    check = deadline.check if deadline is not None else (lambda what: None)
    solver = create_solver(backend)
    ops = list(graph.order)
    n = len(ops)
    index = {v: i for i, v in enumerate(ops)}
    succ = [sorted(index[w] for w in graph.op_succs(v)) for v in ops]
    pred = [sorted(index[u] for u in graph.op_preds(v)) for v in ops]
    size = [int(graph[v]["bytes"]) for v in ops]
    # the relaxation charges a projection the workspace of a run it may continue
    ws = [least_workspace(graph[v]) if relax else int(graph[v].get("workspace", 0)) for v in ops]
    tm = [float(graph[v]["time"]) for v in ops]
    recomputable = [bool(graph[v].get("recomputable", True)) for v in ops]
    output = [bool(graph[v].get("output", False)) for v in ops]
    fixed = graph.fixed_bytes
    scale = 1.0 / max(budget, 1)
    cap = (budget - fixed) * scale
    m = _Model(solver, n, ops, size=size, pred=pred, scale=scale)

    def binary(name: str):
        return solver.NumVar(0, 1, name) if relax else solver.BoolVar(name)

    # a value of i is worth keeping into stage t if an op that can still run reads it
    last_reader = [max((j for j in succ[i] if recomputable[j]), default=-1) for i in range(n)]
    keep_until = [n if (output[i] or last_reader[i] >= 0) else max(succ[i], default=-1) for i in range(n)]

    R, S, FREE, U = m.R, m.S, m.FREE, m.U
    for t in range(n):
        check("building the MILP")
        R[t, t] = 1
        for i in range(t):
            if recomputable[i] and (succ[i] or output[i]):
                R[t, i] = binary(f"R_{t}_{i}")
                m.extra_terms.append((R[t, i], tm[i]))
    for t in range(1, n + 1):
        for i in range(t):
            if t == n:
                if output[i]:
                    S[t, i] = 1
            elif keep_until[i] >= t:
                S[t, i] = binary(f"S_{t}_{i}")

    def val(d, key):
        return d.get(key, _ZERO_SENTINEL)

    for t in range(n):
        check("building the MILP")
        # inputs resident
        for j in range(t + 1):
            r = val(R, (t, j))
            if r is _ZERO_SENTINEL:
                continue
            for i in pred[j]:
                _add(solver, r <= val(R, (t, i)) + val(S, (t, i)))
        for i in range(t):
            s, r = val(S, (t, i)), val(R, (t, i))
            if s is not _ZERO_SENTINEL and r is not _ZERO_SENTINEL:
                _add(solver, r + s <= 1)
        for i in range(t + 1):
            nxt = val(S, (t + 1, i))
            if nxt is _ZERO_SENTINEL or isinstance(nxt, int):
                if nxt == 1:
                    _add(solver, val(S, (t, i)) + val(R, (t, i)) >= 1)
                continue
            _add(solver, nxt <= val(S, (t, i)) + val(R, (t, i)))
        # frees
        for i in range(t + 1):
            check("building the MILP")
            exists = val(R, (t, i)), val(S, (t, i))
            if exists[0] is _ZERO_SENTINEL and exists[1] is _ZERO_SENTINEL:
                continue
            nxt = val(S, (t + 1, i))
            if nxt == 1 and isinstance(nxt, int):
                continue
            readers = [j for j in succ[i] if j <= t and val(R, (t, j)) is not _ZERO_SENTINEL]
            total = []
            for k in [i] + readers:
                rk = val(R, (t, k))
                if rk is _ZERO_SENTINEL:
                    continue
                f = solver.NumVar(0, 1, f"F_{t}_{i}_{k}")
                FREE[t, i, k] = f
                total.append(f)
                _add(solver, f <= rk)
                if nxt is not _ZERO_SENTINEL:
                    _add(solver, f <= 1 - nxt)
                for j in readers:
                    if j > k:
                        _add(solver, f <= 1 - R[t, j])
            if total:
                _add(solver, sum(total) <= exists[0] + exists[1])
        # memory
        prev = None
        for k in range(t + 1):
            rk = val(R, (t, k))
            u = solver.NumVar(0, cap, f"U_{t}_{k}")
            U[t, k] = u
            if prev is None:
                base = sum(size[i] * scale * val(S, (t, i)) for i in range(t) if val(S, (t, i)) is not _ZERO_SENTINEL)
                _add(solver, u == base + size[k] * scale * rk)
            else:
                freed = sum(
                    size[i] * scale * FREE[t, i, k - 1]
                    for i in [k - 1] + pred[k - 1]
                    if (t, i, k - 1) in FREE
                )
                _add(solver, u == prev - freed + size[k] * scale * rk)
            if ws[k] and rk is not _ZERO_SENTINEL:
                _add(solver, u + ws[k] * scale * rk <= cap)
            prev = u
    extra = sum(c * v for v, c in m.extra_terms) if m.extra_terms else 0
    solver.Minimize(extra)
    return m


def _hint_values(graph: ComputeGraph, m: _Model, stages: list[list[int]]) -> dict:
    """Values of every model variable for a stage-form sequence with eager frees."""
    n = m.n
    index = {v: i for i, v in enumerate(m.ops)}
    seq = [i for st in stages for i in st]
    stage_of = [t for t, st in enumerate(stages) for _ in st]
    succ = [{index[w] for w in graph.op_succs(v)} for v in m.ops]
    output = [bool(graph[v].get("output", False)) for v in m.ops]
    values: dict = {}
    for var in list(m.S.values()) + list(m.FREE.values()):
        if not isinstance(var, int):
            values[var] = 0.0
    rv = {}
    for (t, i), var in m.R.items():
        rv[t, i] = 1.0 if i in stages[t] else 0.0
        if not isinstance(var, int):
            values[var] = rv[t, i]
    sv: dict = {}
    fv: dict = {}
    for p, i in enumerate(seq):
        t = stage_of[p]
        end = None
        for q in range(p + 1, len(seq)):
            if seq[q] == i:
                break
            if seq[q] in succ[i]:
                end = q
        else:
            if output[i]:
                end = len(seq)
        if end is None:
            fv[t, i, i] = 1.0
            continue
        end_stage = stage_of[end] if end < len(seq) else n
        for s in range(t + 1, end_stage + 1):
            sv[s, i] = 1.0
        if end < len(seq):
            fv[stage_of[end], i, seq[end]] = 1.0
    for key, var in m.S.items():
        if not isinstance(var, int):
            values[var] = sv.get(key, 0.0)
    for key, var in m.FREE.items():
        values[var] = fv.get(key, 0.0)
    for t in range(n):
        u = sum(m.size[i] * m.scale * sv.get((t, i), 0.0) for i in range(t))
        for k in range(t + 1):
            if k:
                u -= sum(m.size[i] * m.scale * fv.get((t, i, k - 1), 0.0) for i in [k - 1] + m.pred[k - 1])
            u += m.size[k] * m.scale * rv.get((t, k), 0.0)
            values[m.U[t, k]] = u
    return values


def _solve_model(m: _Model, *, time_limit: float | None, hint: dict | None, relax: bool):
    from ortools.linear_solver import pywraplp

    solver = m.solver
    if time_limit is not None:
        solver.SetTimeLimit(max(1, int(1000 * time_limit)))
    if hint:
        keys = list(hint)
        solver.SetHint(keys, [hint[k] for k in keys])
    params = pywraplp.MPSolverParameters()
    if not relax:
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
    return solve_quietly(solver, params)


def _extract(m: _Model) -> list:
    seq = []
    for t in range(m.n):
        for i in range(t + 1):
            r = m.R.get((t, i), 0)
            value = r if isinstance(r, int) else r.solution_value()
            if value > 0.5:
                seq.append(m.ops[i])
    return seq


def candidate_hints(graph: ComputeGraph, budget: int, hint) -> list[list[list[int]]]:
    """Stage forms of the given hint and of store-all, those that fit the budget."""
    seqs = []
    if hint is not None:
        seqs.append(hint.sequence if isinstance(hint, Schedule) else list(hint))
    seqs.append(list(graph.order))
    out = []
    for seq in seqs:
        stages = normalized_stages(graph, seq)
        if stages is None:
            continue
        r = simulate(graph, [graph.order[i] for st in stages for i in st])
        if r.valid and r.peak_bytes <= budget:
            out.append((r.cost, stages))
    out.sort(key=lambda x: x[0])
    return [st for _, st in out]


@register("checkmate_milp", family="exact", exact=True, order="fixed")
def checkmate_milp(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit: float | None = None,
    hint: Schedule | Sequence[Hashable] | None = None,
    backend: str = "SCIP",
) -> Schedule:
    """Checkmate's MILP (Jain et al., MLSys 2020) with a correct FREE linearization.

    Optimal over the stage space (first computations in the reference order, each stage
    recomputing earlier ops in reference order); see the module docstring for the model.
    Size: O(n^2) binaries and O(n * edges) continuous variables for ``n`` ops; NP-hard
    in general, so solve time grows quickly past ~100 ops.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds for all of it, model building included (default 60). At the limit, the
        best schedule found is returned with the solver's bound as ``lower_bound``; when
        the model does not build in time, the warm start (``info["status"] == "hint"``,
        ``info["stopped"]`` says why).
    hint : Schedule or sequence, optional
        A warm start. It (or store-all, when that fits) is brought to stage form by
        sorting each stage's recomputations; used when it then fits the budget.
    backend : str
        OR-Tools backend: ``"SCIP"`` (default), ``"CBC"`` or ``"CP_SAT"``.

    Returns
    -------
    Schedule
        ``lower_bound`` is a proven bound on the cost of any stage-space schedule;
        ``info["status"]`` is ``"optimal"`` or ``"feasible"``.

    Raises
    ------
    NoScheduleFound
        No schedule of the stage space was found within the budget and time limit.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3, fwd_bytes=4)
    >>> s = checkmate_milp(g, 17)
    >>> s.info["status"], simulate(g, s.sequence).peak_bytes <= 17
    ('optimal', True)
    """
    from ortools.linear_solver import pywraplp

    t0 = time.perf_counter()
    budget = int(budget_bytes)
    limit, deadline = time_limit_of(time_limit)
    base = float(sum(graph[v]["time"] for v in graph.order))
    candidates = candidate_hints(graph, budget, hint)
    shrink = 0
    why = "the solver stopped without a solution"
    for attempt in range(3):
        built = time.perf_counter()
        try:
            m = _build(graph, budget - shrink, backend, relax=False,
                       deadline=deadline.within(BUILD_SHARE * deadline.left()))
            values = _hint_values(graph, m, candidates[0]) if candidates else None
        except OutOfTime:
            why = f"the model of {len(graph.order)} ops did not build in time"
            break
        remaining = deadline.left() - LOAD_PER_BUILD.get(backend, 0.25) * (time.perf_counter() - built)
        if remaining < 0.05:
            why = "no time was left to solve the model"
            break
        status = _solve_model(m, time_limit=remaining, hint=values, relax=False)
        found = status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
        bound = None
        if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE, pywraplp.Solver.NOT_SOLVED):
            try:
                bound = base + m.solver.Objective().BestBound()
            except Exception:  # pragma: no cover - backend without a bound
                bound = None
        if status == pywraplp.Solver.INFEASIBLE and shrink == 0:
            raise NoScheduleFound(
                f"no schedule of the stage space (first computations in the reference order) fits "
                f"{budget} B: the MILP is infeasible; a free-order method may still fit"
            )
        if not found:
            break
        seq = _extract(m)
        r = simulate(graph, seq)
        if r.valid and r.peak_bytes <= budget:
            optimal = status == pywraplp.Solver.OPTIMAL and shrink == 0
            if bound is not None and not math.isfinite(bound):
                bound = None
            if not exact_workspaces(graph):
                optimal, bound = False, None  # the model over-charges projections that continue a run
            lb = r.cost if optimal else (min(bound, r.cost) if bound is not None and shrink == 0 else None)
            log.info("checkmate_milp: %s, cost %.6g, bound %s, %.2f s", "optimal" if optimal else "feasible",
                     r.cost, lb, time.perf_counter() - t0)
            return Schedule(sequence=seq, method="checkmate_milp", lower_bound=lb,
                            info={"order": "fixed", "status": "optimal" if optimal else "feasible",
                                  "backend": backend, "objective": base + m.solver.Objective().Value()})
        if not r.valid:
            raise SolverError(f"checkmate_milp extracted an invalid sequence: {r.error} (a model bug)")
        # numerical tolerance let a step exceed the budget: tighten and solve again
        shrink += max(1, r.peak_bytes - budget) * 2
        log.info("checkmate_milp: tolerance overshoot of %d B, tightening", r.peak_bytes - budget)
    log.info("checkmate_milp: %s after %.2f s", why, time.perf_counter() - t0)
    if candidates:
        seq = [graph.order[i] for st in candidates[0] for i in st]
        return Schedule(sequence=seq, method="checkmate_milp", lower_bound=None,
                        info={"order": "fixed", "status": "hint", "backend": backend, "stopped": why})
    raise NoScheduleFound(
        f"checkmate_milp found no schedule within {budget} B in {limit:.3g} s ({why}); give a longer "
        f"time_limit or a warm start (hint=)"
    )


def exact_workspaces(graph: ComputeGraph) -> bool:
    """Whether the MILP charges every op's workspace as the simulator does: no projection
    of a multi-output op is charged less when it continues a run (``run_workspace``)."""
    nodes = graph.nx.nodes
    return all(least_workspace(nodes[v]) == int(nodes[v].get("workspace", 0)) for v in graph.order)


def _stage_end_lp(graph: ComputeGraph, budget: int, backend: str, *, deadline: Deadline | None = None):
    """A smaller relaxation: the MILP without FREE/U, memory checked at stage ends only.

    Keeps ``R`` and ``S`` (continuous) where a value can still be read, the input and
    keep constraints, and at the last step of stage ``t``: fixed + workspace + op ``t`` +
    its inputs + every value kept into stage ``t + 1`` <= budget. Every schedule of the
    stage space satisfies these, so the LP optimum is a lower bound. Raises
    :class:`OutOfTime` once ``deadline`` passes while building.
    """
    check = deadline.check if deadline is not None else (lambda what: None)
    solver = create_solver(backend)
    ops = list(graph.order)
    n = len(ops)
    index = {v: i for i, v in enumerate(ops)}
    succ = [sorted(index[w] for w in graph.op_succs(v)) for v in ops]
    pred = [sorted(index[u] for u in graph.op_preds(v)) for v in ops]
    size = [int(graph[v]["bytes"]) for v in ops]
    recomputable = [bool(graph[v].get("recomputable", True)) for v in ops]
    output = [bool(graph[v].get("output", False)) for v in ops]
    scale = 1.0 / max(budget, 1)
    # last stage in which a value can be read (through recomputations of its readers)
    last = [0] * n
    for i in reversed(range(n)):
        last[i] = max([n if output[i] else i] + [last[j] if recomputable[j] else j for j in succ[i]])
    R: dict = {}
    S: dict = {}
    terms = []
    for i in range(n):
        check("building the stage-end LP")
        for t in range(i + 1, min(last[i], n - 1) + 1):
            S[t, i] = solver.NumVar(0, 1, "")
            if recomputable[i]:
                R[t, i] = solver.NumVar(0, 1, "")
                terms.append((R[t, i], float(graph[ops[i]]["time"])))
                solver.Add(R[t, i] + S[t, i] <= 1)
            if t > i + 1:
                solver.Add(S[t, i] <= S[t - 1, i] + R.get((t - 1, i), 0))
        if output[i]:
            t = n - 1
            if t > i:
                solver.Add(S[t, i] + R.get((t, i), 0) >= 1)
    for j in range(n):
        check("building the stage-end LP")
        for t in [j] + [t for t in range(j + 1, n) if (t, j) in R]:
            rj = 1 if t == j else R[t, j]
            for p in pred[j]:
                solver.Add(rj <= S.get((t, p), 0) + R.get((t, p), 0))
    fixed = graph.fixed_bytes
    for t in range(n):
        v = ops[t]
        inputs = set(pred[t])
        need = fixed + size[t] + least_workspace(graph[v]) + sum(size[p] for p in inputs)
        kept = [size[i] * scale * S[t + 1, i] for i in range(t) if i not in inputs and (t + 1, i) in S]
        solver.Add(sum(kept) + need * scale <= budget * scale) if kept else None
    solver.Minimize(sum(c * x for x, c in terms) if terms else 0)
    return solver


def stage_end_lower_bound(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
                          backend: str = "HIGHS") -> float | None:
    """Lower bound from the stage-end relaxation (O(n x lifetime) variables, no FREE/U).

    Weaker than :func:`lp_lower_bound` but much smaller: memory is only checked at the
    last step of every stage. ``None`` when it does not solve in time.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3, fwd_bytes=4)
    >>> stage_end_lower_bound(g, 100) == g.total("time")
    True
    """
    from ortools.linear_solver import pywraplp

    base = float(sum(graph[v]["time"] for v in graph.order))
    deadline = Deadline(time_limit)
    built = time.perf_counter()
    try:
        solver = _stage_end_lp(graph, int(budget_bytes), backend,
                               deadline=deadline.within(BUILD_SHARE * deadline.left()))
    except OutOfTime:
        return None
    if time_limit is not None:
        remaining = deadline.left() - LP_LOAD_PER_BUILD * (time.perf_counter() - built)
        if remaining < 0.05:
            return None
        solver.SetTimeLimit(max(1, int(1000 * remaining)))
    status = solve_quietly(solver)
    if status == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return None
    return base + max(0.0, solver.Objective().Value() * (1 - 1e-7) - 1e-9)


def lp_lower_bound(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
                   backend: str = "GLOP") -> float | None:
    """The LP relaxation of :func:`checkmate_milp`: a lower bound on the stage-space cost.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds, model building included; ``None`` when the LP does not finish in time.
    backend : str
        OR-Tools LP backend (``"GLOP"``, ``"PDLP"``, ``"CLP"``).

    Returns
    -------
    float or None
        A lower bound on the total cost (at least the store-all cost), or ``None`` when
        the LP did not solve (``-inf`` never escapes).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3, fwd_bytes=4)
    >>> lp_lower_bound(g, 100) == g.total("time")
    True
    """
    from ortools.linear_solver import pywraplp

    base = float(sum(graph[v]["time"] for v in graph.order))
    deadline = Deadline(time_limit)
    built = time.perf_counter()
    try:
        m = _build(graph, int(budget_bytes), backend, relax=True,
                   deadline=deadline.within(BUILD_SHARE * deadline.left()))
    except OutOfTime:
        return None
    remaining = None
    if time_limit is not None:
        remaining = deadline.left() - LP_LOAD_PER_BUILD * (time.perf_counter() - built)
        if remaining < 0.05:
            return None
    status = _solve_model(m, time_limit=remaining, hint=None, relax=True)
    if status == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return None
    # LP optimum up to solver tolerance: shave a hair so it stays a bound
    return base + max(0.0, m.solver.Objective().Value() * (1 - 1e-7) - 1e-9)


def lower_bound(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
                order: str = "fixed", enough: float | None = None) -> float:
    """The best proven lower bound on the cost of any schedule within the budget.

    ``order="fixed"``: bound for the stage space (first computations in the reference
    order): the largest of :func:`solver.bounds.forced_recompute_bound` (no solver),
    :func:`stage_end_lower_bound` and, on graphs of at most 150 ops, the LP relaxation
    of :func:`checkmate_milp` (:func:`lp_lower_bound`). ``order="free"``: any
    order; the store-all cost (every op once) unless the graph is tiny enough for
    exhaustive search.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds for the bounds, model building included (default 60).
    order : {"fixed", "free"}
    enough : float, optional
        Stop at the first bound at least this high (a cost already known to be close
        enough): the costlier LP is skipped.

    Returns
    -------
    float
        ``math.inf`` when the budget is proven infeasible for that order freedom.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3, fwd_bytes=4)
    >>> lower_bound(g, 17) >= g.total("time")
    True
    """
    base = float(sum(graph[v]["time"] for v in graph.order))
    if order not in ("fixed", "free"):
        raise ValueError(f"order must be 'fixed' or 'free', got {order!r}")
    limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    if order == "free":
        if len(graph.order) <= 8:
            from solver.errors import InfeasibleBudget
            from solver.methods.bruteforce import brute_force

            try:
                return brute_force(graph, budget_bytes).lower_bound
            except InfeasibleBudget:
                return math.inf
        return base
    t0 = time.perf_counter()
    from solver.bounds import forced_recompute_bound

    best = max(base, forced_recompute_bound(graph, budget_bytes))
    if best == math.inf or (enough is not None and best >= enough):
        return best
    lb = stage_end_lower_bound(graph, budget_bytes, time_limit=limit)
    if lb is not None:
        best = max(best, lb)
    remaining = limit - (time.perf_counter() - t0)
    if enough is not None and best >= enough:
        return best
    if len(graph.order) <= 150 and remaining > 1 and best < math.inf:
        lb = lp_lower_bound(graph, budget_bytes, time_limit=remaining)
        if lb is not None:
            best = max(best, lb)
    return best

"""Store, recompute or offload each value under a memory budget, with a bandwidth model.

The method works on a fixed order (the graph's reference order, plus the recomputations
of a recompute-only schedule). On top of such a sequence it chooses *offload windows*:
a copy of a value goes to host memory after one of its uses and comes back just before
the next one (an :class:`~solver.schedule.Offload`), which frees its bytes in between.
Following the simulator (:mod:`solver.simulate`), a transfer happens during one step and
that step costs ``max(compute, bytes sent / bandwidth, bytes fetched / bandwidth)``: a
transfer is free while it hides behind the compute of its step.

Two planners choose the windows on a given sequence:

* a greedy one (any size): repeatedly take the window whose memory relief over the
  over-budget steps is largest per unit of extra time, its transfers put on the steps
  where they hide best, then drop the windows that the final plan does not need;
* an exact MILP (OR-Tools/SCIP) over every window and every placement of its two
  transfers, used when the model is small; its optimum is exact for the sequence.

The method then searches the combination with recomputation: it plans windows on the
store-all order and on recompute-only schedules solved at budgets between the target and
the store-all peak (its own Belady/DTR-style eviction, plus the fixed-order baseline,
heuristic and chain methods that are registered), and keeps the cheapest schedule as the
simulator grades it. With a huge bandwidth it offloads (transfers hide, no extra cost);
with a tiny one it recomputes.

References
----------
Rhu et al., "vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural
Network Design", MICRO 2016 (offload/prefetch of activations).
Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021 (the eviction score).
Beaumont et al., "Efficient Combination of Rematerialization and Offloading for Training
DNNs", NeurIPS 2021 (a stage costs the max of compute and transfer).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from graphs import ComputeGraph
from graphs.hardware import Hardware, get_hardware
from solver.errors import NoScheduleFound, RematError, SolverError
from solver.registry import registered as _registered_methods
from solver.registry import register
from solver.schedule import Offload, Schedule
from solver.simulate import simulate

__all__ = [
    "OffloadWindow",
    "breakeven_bandwidth",
    "offload",
    "offload_summary",
    "offload_windows",
    "plan_offloads",
    "resolve_bandwidth",
]

log = logging.getLogger(__name__)

#: Largest MILP (number of window placements) that :func:`plan_offloads` solves exactly.
EXACT_MAX_VARIABLES = 4000
_PORTFOLIO_FAMILIES = ("baseline", "heuristic", "chain")


# ---------------------------------------------------------------------------- bandwidth
def resolve_bandwidth(
    *,
    bandwidth: float | None = None,
    hardware: "Hardware | str | None" = None,
    time_unit_seconds: float | None = None,
) -> float:
    """Host-link bytes per time unit of the graph.

    Parameters
    ----------
    bandwidth : float, optional
        Bytes per time unit of the graph, used as given.
    hardware : graphs.hardware.Hardware or str, optional
        A spec or a preset name (``"pcie4"``, ``"pcie5"``, ``"nvlink-c2c"``, ...); its
        ``host_bandwidth`` (bytes/s) is converted to bytes per time unit.
    time_unit_seconds : float, optional
        Seconds per time unit of the graph (default 1: node ``time`` is in seconds).

    Returns
    -------
    float

    Raises
    ------
    ValueError
        Neither or both of ``bandwidth`` and ``hardware``, or a non-positive value.

    Examples
    --------
    >>> resolve_bandwidth(hardware="pcie4")
    25000000000.0
    >>> resolve_bandwidth(hardware="pcie4", time_unit_seconds=1e-3)
    25000000.0
    """
    if (bandwidth is None) == (hardware is None):
        raise ValueError(
            "offload needs exactly one of bandwidth= (bytes per time unit of the graph) or "
            "hardware= (a graphs.Hardware or a preset name such as 'pcie4', 'pcie5', 'nvlink-c2c')"
        )
    if hardware is not None:
        unit = 1.0 if time_unit_seconds is None else float(time_unit_seconds)
        if not unit > 0:
            raise ValueError(f"time_unit_seconds must be positive, got {time_unit_seconds!r}")
        bw = float(get_hardware(hardware).host_bandwidth) * unit
    else:
        bw = float(bandwidth)
    if not bw > 0 or math.isnan(bw):
        raise ValueError(f"bandwidth must be a positive number of bytes per time unit, got {bw!r}")
    return bw


# ---------------------------------------------------------------------------- windows
@dataclass(frozen=True)
class OffloadWindow:
    """A stretch of a copy's life between two uses, during which it may sit on the host.

    The device-to-host transfer may run at any step in ``[out_first, out_last]``, the
    host-to-device one at any step in ``[in_first, in_last]``; the copy is off the device
    strictly between the two transfer steps, and no op reads it from the first of those
    steps up to the fetch step (included).
    """

    node: Hashable
    bytes: int
    out_first: int
    in_last: int

    def offload(self, out_step: int, in_step: int) -> Offload:
        """The :class:`Offload` with its transfers at the given steps."""
        return Offload(self.node, out_step - 1, in_step + 1)


def offload_windows(graph: ComputeGraph, sequence: Sequence[Hashable]) -> list[OffloadWindow]:
    """Every window in which a copy of an op's output could go to the host.

    A copy is used at its own step and at each step that reads it (and at the end of the
    step for outputs); between two consecutive uses ``a < b`` it can leave at step
    ``a + 1`` (at ``a`` itself when ``a`` is a read: the op and the transfer both only
    read the copy) and must be back by step ``b - 1``. Windows too short to free any step
    are left out, and so are values whose memory an offload cannot free: a forward
    output (the caller holds it through the step) and an output gradient (``op`` is
    ``"tangent"``: autograd hands it over). O(len(sequence) x mean in-degree).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3)
    >>> g.order
    ['f0', 'f1', 'f2', 'loss', 'b2', 'b1', 'b0']
    >>> [(w.node, w.out_first, w.in_last) for w in offload_windows(g, g.order)]
    [('f0', 1, 4)]
    """
    nodes = graph.nx.nodes
    ops = graph.ops_set
    current: dict[Hashable, int] = {}
    copies: list[tuple[Hashable, int, list[int]]] = []
    for t, v in enumerate(sequence):
        for u in graph.nx.predecessors(v):
            if u in ops and u in current:
                reads = copies[current[u]][2]
                if not reads or reads[-1] != t:
                    reads.append(t)
        current[v] = len(copies)
        copies.append((v, t, []))
    n = len(sequence)
    out: list[OffloadWindow] = []
    for k, (v, start, reads) in enumerate(copies):
        b = int(nodes[v]["bytes"])
        if b <= 0 or _held_outside(nodes[v]):
            continue
        uses = [start] + reads
        if nodes[v].get("output", False) and current.get(v) == k:
            uses.append(n)
        for a, nxt in zip(uses, uses[1:]):
            first = a + 1 if a == start else a
            last = nxt - 1
            if last - first >= 2:
                out.append(OffloadWindow(v, b, first, last))
    return out


def _held_outside(d: dict) -> bool:
    """Is a value held outside the step's graphs (so offloading it frees nothing)?"""
    return (d.get("output", False) and d.get("phase") == "forward") or d.get("op") == "tangent"


# ---------------------------------------------------------------------------- planning
class _Plan:
    """Transfer loads per step and the memory relief of the chosen windows."""

    def __init__(self, compute: np.ndarray, bandwidth: float) -> None:
        self.c = compute
        self.bw = bandwidth
        self.d2h = np.zeros_like(compute)
        self.h2d = np.zeros_like(compute)

    def step_cost(self, sl: slice | int) -> np.ndarray:
        return np.maximum(self.c[sl], np.maximum(self.d2h[sl], self.h2d[sl]) / self.bw)

    def best_step(self, load: np.ndarray, lo: int, hi: int, nbytes: int, *, latest: bool) -> tuple[int, float]:
        """The step in ``[lo, hi]`` where adding ``nbytes`` to ``load`` costs least."""
        sl = slice(lo, hi + 1)
        other = self.h2d if load is self.d2h else self.d2h
        new = np.maximum(self.c[sl], np.maximum(load[sl] + nbytes, other[sl]) / self.bw)
        marginal = new - self.step_cost(sl)
        if latest:
            i = len(marginal) - 1 - int(np.argmin(marginal[::-1]))
        else:
            i = int(np.argmin(marginal))
        return lo + i, float(marginal[i])


def plan_offloads(
    graph: ComputeGraph,
    sequence: Sequence[Hashable],
    budget_bytes: int,
    *,
    bandwidth: float,
    exact: bool | None = None,
    time_limit: float | None = None,
) -> list[Offload] | None:
    """Offloads that bring ``sequence`` within ``budget_bytes`` at little extra time.

    Parameters
    ----------
    graph : ComputeGraph
    sequence : sequence of node ids
        A valid schedule without offloads (recomputations are repeated ids).
    budget_bytes : int
    bandwidth : float
        Host-link bytes per time unit.
    exact : bool, optional
        Solve the MILP over all windows and transfer placements (the least cost for this
        sequence); default: when it has at most :data:`EXACT_MAX_VARIABLES` variables.
    time_limit : float, optional
        Seconds for the MILP; past it the best of MILP and greedy is returned.

    Returns
    -------
    list of Offload, or None
        None when no choice of windows fits the budget (some step is over the budget with
        every value it does not read already off the device).

    Notes
    -----
    Greedy: O(iterations x windows x len(sequence)) with numpy slices. MILP: one binary
    per (window, d2h step, h2d step), one continuous cost per transfer step.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=10)
    >>> r = simulate(g, g.order)
    >>> offs = plan_offloads(g, g.order, r.peak_bytes - 1, bandwidth=1e3)
    >>> offs
    [Offload(node='f0', after=0, before=7)]
    >>> res = simulate(g, Schedule(list(g.order), offloads=offs, bandwidth=1e3))
    >>> res.valid, res.peak_bytes < r.peak_bytes, res.cost == r.cost
    (True, True, True)
    """
    sequence = list(sequence)
    base = simulate(graph, sequence)
    if not base.valid:
        raise ValueError(f"plan_offloads needs a valid sequence: {base.error}")
    curve = base.memory_curve.astype(np.int64)
    budget = int(budget_bytes)
    if curve.max(initial=0) <= budget:
        return []
    compute = np.array([float(graph[v]["time"]) for v in sequence])
    windows = [w for w in offload_windows(graph, sequence)]
    over = curve > budget
    prefix = np.concatenate([[0], np.cumsum(over)])
    windows = [w for w in windows if prefix[w.in_last] - prefix[w.out_first + 1] > 0]
    greedy = _greedy(windows, curve, compute, budget, bandwidth)
    if greedy is not None and _plan_cost(greedy, compute, bandwidth, graph) <= compute.sum():
        return greedy  # every transfer hides: nothing to improve
    n_vars = sum(_n_placements(w) for w in windows)
    if exact is None:
        exact = n_vars <= EXACT_MAX_VARIABLES
    if not exact:
        return greedy
    milp = _milp(windows, curve, compute, budget, bandwidth, time_limit=time_limit)
    if milp is None:
        return greedy
    if greedy is None:
        return milp
    return min((milp, greedy), key=lambda offs: _plan_cost(offs, compute, bandwidth, graph))


def _plan_cost(offs: list[Offload], compute: np.ndarray, bw: float, graph: ComputeGraph) -> float:
    d2h = np.zeros_like(compute)
    h2d = np.zeros_like(compute)
    for o in offs:
        d2h[o.after + 1] += graph[o.node]["bytes"]
        h2d[o.before - 1] += graph[o.node]["bytes"]
    return float(np.maximum(compute, np.maximum(d2h, h2d) / bw).sum())


def _greedy(windows, curve, compute, budget, bandwidth) -> list[Offload] | None:
    excess = (curve - budget).astype(np.float64)
    plan = _Plan(compute, bandwidth)
    used = [False] * len(windows)
    chosen: list[tuple[OffloadWindow, int, int]] = []
    tiny = 1e-12 * max(1.0, float(compute.sum()))
    while excess.max(initial=0) > 0:
        pos = excess > 0
        prefix = np.concatenate([[0], np.cumsum(pos)])
        best, best_score = None, -1.0
        for i, w in enumerate(windows):
            if used[i] or prefix[w.in_last] - prefix[w.out_first + 1] == 0:
                continue
            hole = excess[w.out_first + 1 : w.in_last]
            positive = np.flatnonzero(hole > 0)
            relief = float(np.minimum(hole[positive], w.bytes).sum())
            first_pos = w.out_first + 1 + int(positive[0])
            last_pos = w.out_first + 1 + int(positive[-1])
            s_out, c_out = plan.best_step(plan.d2h, w.out_first, first_pos - 1, w.bytes, latest=False)
            s_in, c_in = plan.best_step(plan.h2d, last_pos + 1, w.in_last, w.bytes, latest=True)
            score = relief / (c_out + c_in + tiny)
            if score > best_score:
                best, best_score = (i, s_out, s_in), score
        if best is None:
            return None
        i, s_out, s_in = best
        w = windows[i]
        used[i] = True
        plan.d2h[s_out] += w.bytes
        plan.h2d[s_in] += w.bytes
        excess[s_out + 1 : s_in] -= w.bytes
        chosen.append((w, s_out, s_in))
    # drop windows the final plan does not need (latest choices first)
    for j in range(len(chosen) - 1, -1, -1):
        w, s_out, s_in = chosen[j]
        if (excess[s_out + 1 : s_in] + w.bytes).max(initial=0) <= 0:
            excess[s_out + 1 : s_in] += w.bytes
            plan.d2h[s_out] -= w.bytes
            plan.h2d[s_in] -= w.bytes
            chosen[j] = None  # type: ignore[call-overload]
    return [w.offload(s_out, s_in) for w, s_out, s_in in (c for c in chosen if c is not None)]


def _n_placements(w: OffloadWindow) -> int:
    # pairs (s_out, s_in) with out_first <= s_out, s_in <= in_last, s_in - s_out >= 2
    m = w.in_last - w.out_first - 1
    return m * (m + 1) // 2


def _milp(windows, curve, compute, budget, bandwidth, *, time_limit) -> list[Offload] | None:
    from ortools.linear_solver import pywraplp

    from solver.lp_backend import create_solver, solve_quietly

    try:
        solver = create_solver("SCIP")
    except SolverError:  # pragma: no cover - depends on the OR-Tools build
        log.warning("OR-Tools has no SCIP backend; offload windows are planned greedily")
        return None
    if time_limit:
        solver.SetTimeLimit(int(1000 * time_limit))
    scale = float(max(w.bytes for w in windows)) if windows else 1.0
    n = len(curve)
    relief: dict[int, list] = {}
    out_at: dict[int, list] = {}
    in_at: dict[int, list] = {}
    xs = []
    for i, w in enumerate(windows):
        group = []
        b = w.bytes / scale
        for s_out in range(w.out_first, w.in_last - 1):
            for s_in in range(s_out + 2, w.in_last + 1):
                x = solver.BoolVar(f"x{i}_{s_out}_{s_in}")
                group.append(x)
                xs.append((x, w, s_out, s_in))
                out_at.setdefault(s_out, []).append((x, b))
                in_at.setdefault(s_in, []).append((x, b))
                for t in range(s_out + 1, s_in):
                    if curve[t] > budget:
                        relief.setdefault(t, []).append((x, b))
        solver.Add(solver.Sum(group) <= 1)
    for t in range(n):
        if curve[t] > budget:
            terms = relief.get(t, [])
            need = (curve[t] - budget) / scale
            if not terms:
                return None
            solver.Add(solver.Sum([b * x for x, b in terms]) >= need - 1e-9)
    objective = []
    bw = bandwidth / scale
    for t in set(out_at) | set(in_at):
        y = solver.NumVar(float(compute[t]), solver.infinity(), f"y{t}")
        if t in out_at:
            solver.Add(y * bw >= solver.Sum([b * x for x, b in out_at[t]]))
        if t in in_at:
            solver.Add(y * bw >= solver.Sum([b * x for x, b in in_at[t]]))
        objective.append(y - float(compute[t]))
    solver.Minimize(solver.Sum(objective))
    status = solve_quietly(solver)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None
    return [w.offload(s_out, s_in) for x, w, s_out, s_in in xs if x.solution_value() > 0.5]


# ---------------------------------------------------------------------------- recomputation
def _evict_for_budget(graph: ComputeGraph, budget: int) -> list[Hashable] | None:
    """A recompute-only sequence in the reference order: evict on demand, recompute on use.

    Victims minimise ``time / (bytes x distance to next use)`` (Belady's rule weighted by
    the recomputation cost, after DTR). The memory it tracks is an upper bound of what
    the simulator charges. None when it gets stuck. O(len(sequence) x resident values).
    """
    nodes = graph.nx.nodes
    order = graph.order
    preds = {v: graph.op_preds(v) for v in order}
    uses: dict[Hashable, list[int]] = {v: [] for v in order}
    for i, v in enumerate(order):
        for u in preds[v]:
            uses[u].append(i)
    ptr = {v: 0 for v in order}
    size = {v: int(nodes[v]["bytes"]) for v in order}
    resident: dict[Hashable, int] = {}   # value -> step of last access
    mem = graph.fixed_bytes
    seq: list[Hashable] = []
    limit = 20 * len(order) + 100

    def next_use(u: Hashable, i: int) -> float:
        lst, p = uses[u], ptr[u]
        while p < len(lst) and lst[p] < i:
            p += 1
        ptr[u] = p
        return lst[p] if p < len(lst) else math.inf

    def make_room(need: int, protect: set, i: int) -> bool:
        nonlocal mem
        while mem + need > budget:
            victim, score = None, math.inf
            for u, last in resident.items():
                if u in protect or not nodes[u].get("recomputable", True):
                    continue
                nu = next_use(u, i)
                if nu == math.inf and nodes[u].get("output", False):
                    continue
                s = float(nodes[u]["time"]) / (max(size[u], 1) * (nu - i + 1) * (len(seq) - last + 1))
                if s < score:
                    victim, score = u, s
            if victim is None:
                return False
            del resident[victim]
            mem -= size[victim]
        return True

    def run(v: Hashable, protect: set, i: int) -> bool:
        nonlocal mem
        if len(seq) > limit:
            return False
        guard = protect | set(preds[v]) | {v}
        for u in preds[v]:
            if u not in resident and not run(u, guard, i):
                return False
        for u in preds[v]:
            resident[u] = len(seq)
        if not make_room(size[v] + int(nodes[v].get("workspace", 0)), guard, i):
            return False
        seq.append(v)
        if v in resident:
            mem -= size[v]
        resident[v] = len(seq)
        mem += size[v]
        return True

    for i, v in enumerate(order):
        if not run(v, set(), i):
            return None
        for u in preds[v] + [v]:
            if u in resident and next_use(u, i + 1) == math.inf and not nodes[u].get("output", False):
                del resident[u]
                mem -= size[u]
    return seq


def _recompute_sequences(graph: ComputeGraph, budget: int, *, deadline: float) -> list[list[Hashable]]:
    """Recompute-only sequences within ``budget``: own eviction plus registered methods."""
    out = []
    own = _evict_for_budget(graph, budget)
    if own is not None:
        out.append(own)
    for name, info in _registered_methods().items():
        if info.family not in _PORTFOLIO_FAMILIES or info.order != "fixed" or name == "store_all":
            continue
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            s = info.fn(graph, budget, time_limit=left)
        except (RematError, ValueError) as exc:
            log.debug("offload: %s gives no schedule at %d B: %s", name, budget, exc)
            continue
        if not s.offloads:
            out.append(list(s.sequence))
    return out


# ---------------------------------------------------------------------------- the method
@register("offload", family="offload", order="fixed")
def offload(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit: float | None = None,
    bandwidth: float | None = None,
    hardware: "Hardware | str | None" = None,
    time_unit_seconds: float | None = None,
    mode: str = "both",
    exact: bool | None = None,
    levels: int = 4,
    bases: Sequence[Sequence[Hashable]] = (),
) -> Schedule:
    """Store, recompute or offload each value so that the step fits the budget.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds, shared by the recompute portfolio and the MILPs (default 30).
    bandwidth : float, optional
        Host-link bytes per time unit of the graph.
    hardware : graphs.hardware.Hardware or str, optional
        Instead of ``bandwidth``: a spec or preset (``"pcie4"``, ``"pcie5"``,
        ``"nvlink-c2c"``); see :func:`resolve_bandwidth`.
    time_unit_seconds : float, optional
        Seconds per time unit of the graph, with ``hardware`` (default 1).
    mode : {"both", "offload", "recompute"}
        ``"offload"`` plans windows on the store-all order only; ``"recompute"`` returns
        the best recompute-only schedule found (an ablation).
    exact : bool, optional
        Passed to :func:`plan_offloads`.
    levels : int
        Intermediate budgets between ``budget_bytes`` and the store-all peak at which
        recompute-only schedules are combined with offload.
    bases : sequence of sequences, optional
        More recompute-only sequences to combine with offload (another method's
        schedule, e.g. ``auto``'s): the result then costs no more than any of them that
        fits the budget.

    Returns
    -------
    Schedule
        ``offloads`` and ``bandwidth`` set; ``info["recompute_budget"]`` is the budget of
        the recompute-only schedule it builds on (None for the store-all order).

    Raises
    ------
    NoScheduleFound
        No combination found fits the budget.

    Examples
    --------
    >>> from solver import solve
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(6, fwd_bytes=10)
    >>> peak = simulate(g, g.order).peak_bytes
    >>> fast = solve(g, int(0.8 * peak), method="offload", bandwidth=1e6)
    >>> fast.overhead == 0.0 and bool(fast.offloads)
    True
    >>> slow = solve(g, int(0.8 * peak), method="offload", bandwidth=1e-3)
    >>> slow.offloads, slow.overhead > 0
    ([], True)
    """
    if mode not in ("both", "offload", "recompute"):
        raise ValueError(f"mode must be 'both', 'offload' or 'recompute', got {mode!r}")
    bw = resolve_bandwidth(bandwidth=bandwidth, hardware=hardware, time_unit_seconds=time_unit_seconds)
    budget = int(budget_bytes)
    deadline = time.perf_counter() + (30.0 if time_limit is None else float(time_limit))
    given = _base_sequences(graph, budget, mode=mode, levels=levels, bases=bases, deadline=deadline)
    graded = _grade_bases(graph, given)
    best_peak = min((p for *_, p in graded), default=None)
    keeper = _Cheapest(graph, budget, bandwidth=bw, mode=mode)
    _plan_on_bases(graph, graded, keeper, exact=exact, deadline=deadline)
    if keeper.schedule is None:
        raise NoScheduleFound(
            f"offload found no schedule within {budget} B (bandwidth {bw:.4g} B per time unit, "
            f"mode {mode!r}); the smallest peak reached by its base sequences is {best_peak} B. "
            "Try a larger budget, mode='both', or method='auto'",
            best_peak=best_peak,
        )
    schedule = keeper.schedule
    schedule.info["offloaded_bytes"] = int(sum(graph[o.node]["bytes"] for o in schedule.offloads))
    return schedule


def _base_sequences(graph: ComputeGraph, budget: int, *, mode: str, levels: int,
                    bases: Sequence[Sequence[Hashable]], deadline: float
                    ) -> list[tuple[int | None, list[Hashable]]]:
    """The sequences to plan offloads on, each with the recompute budget it was solved at.

    The store-all order (level None) unless ``mode="recompute"``; recompute-only
    sequences at ``levels`` budgets between ``budget`` and the store-all peak (only
    ``budget`` itself for ``mode="recompute"``) unless ``mode="offload"``; then the
    caller's ``bases`` at ``budget``.
    """
    store_all_seq = list(graph.order)
    top = simulate(graph, store_all_seq).peak_bytes
    given: list[tuple[int | None, list[Hashable]]] = []
    if mode != "recompute":
        given.append((None, store_all_seq))
    if mode != "offload" and top > budget:
        grid = [budget] if mode == "recompute" else sorted(
            {int(budget + f * (top - budget)) for f in np.linspace(0, 1, levels + 2)[:-1]}
        )
        for b in grid:
            for seq in _recompute_sequences(graph, b, deadline=deadline):
                given.append((b, seq))
    if mode != "offload":
        given.extend((budget, list(seq)) for seq in bases)
    return given


def _grade_bases(graph: ComputeGraph, given: list[tuple[int | None, list[Hashable]]]
                 ) -> list[tuple[float, int | None, list[Hashable], int]]:
    """``(cost, level, sequence, peak)`` of every distinct valid base, cheapest first.

    Each base is graded once; offloads never make a base cheaper than its compute.
    """
    graded: list[tuple[float, int | None, list[Hashable], int]] = []
    seen: set[tuple] = set()
    for level, seq in given:
        key = tuple(seq)
        if key in seen:
            continue
        seen.add(key)
        r = simulate(graph, seq)
        if not r.valid:
            log.debug("offload: skipping an invalid base sequence: %s", r.error)
            continue
        graded.append((r.cost, level, seq, r.peak_bytes))
    graded.sort(key=lambda x: x[0])
    return graded


class _Cheapest:
    """The cheapest schedule within the budget seen so far, as the simulator grades it."""

    def __init__(self, graph: ComputeGraph, budget: int, *, bandwidth: float, mode: str) -> None:
        self.graph, self.budget, self.bandwidth, self.mode = graph, budget, bandwidth, mode
        self.cost = math.inf
        self.schedule: Schedule | None = None

    def consider(self, level: int | None, seq: list[Hashable], offs: list[Offload]) -> float:
        """Grade ``seq`` with ``offs``; keep it if it fits and is cheaper. Returns its cost."""
        s = Schedule(seq, method="offload", offloads=offs, bandwidth=self.bandwidth,
                     info={"order": "fixed", "recompute_budget": level, "mode": self.mode})
        res = simulate(self.graph, s)
        if not res.valid or res.peak_bytes > self.budget:
            log.debug("offload: discarding a plan the simulator rejects: %s", res.error)
            return math.inf
        if self.schedule is None or res.cost < self.cost - 1e-12 * abs(res.cost):
            self.cost, self.schedule = res.cost, s
        return res.cost


def _plan_on_bases(graph: ComputeGraph, graded: list[tuple[float, int | None, list[Hashable], int]],
                   keeper: _Cheapest, *, exact: bool | None, deadline: float) -> None:
    """Offer ``keeper`` every base that fits as is and every base with planned windows.

    Bases come cheapest first and stop once one costs no less than the best kept; the
    greedy window planner runs on each base over the budget, then the exact window MILP
    on the two most promising ones whose transfers do not all hide.
    """
    budget, bw = keeper.budget, keeper.bandwidth
    refine = []
    for cost, level, seq, peak in graded:
        if keeper.schedule is not None and cost >= keeper.cost:
            break
        if peak <= budget:
            keeper.consider(level, seq, [])
        elif keeper.mode != "recompute":
            offs = plan_offloads(graph, seq, budget, bandwidth=bw, exact=False)
            if offs is not None:
                refine.append((keeper.consider(level, seq, offs), cost, level, seq))
    refine.sort(key=lambda x: x[0])
    for planned, cost, level, seq in refine[:2]:
        left = deadline - time.perf_counter()
        if (exact is False or left <= 0 or planned <= cost or keeper.schedule is None
                or cost >= keeper.cost):
            continue
        offs = plan_offloads(graph, seq, budget, bandwidth=bw, exact=exact, time_limit=min(left, 10.0))
        if offs is not None:
            keeper.consider(level, seq, offs)


# ---------------------------------------------------------------------------- summary
def offload_summary(graph: ComputeGraph, schedule: Schedule, *, bandwidth: float | None = None) -> dict:
    """What a schedule's offloads move and how much of their time hides behind compute,
    as :func:`solver.simulate` charges it.

    Parameters
    ----------
    graph : ComputeGraph
    schedule : Schedule
    bandwidth : float, optional
        Host-link bytes per time unit (default ``schedule.bandwidth``).

    Returns
    -------
    dict
        ``offloads`` (count), ``offloaded_bytes`` (bytes sent, and fetched back),
        ``link_time`` (time units the link is busy: per step the longer of its two
        directions), ``exposed_time`` (what the transfers add to the step's time),
        ``hidden_fraction`` (``1 - exposed / link``; 1.0 when nothing moves).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=10)
    >>> offs = [Offload("f0", 0, 7)]
    >>> offload_summary(g, Schedule(list(g.order), offloads=offs, bandwidth=10.0))["hidden_fraction"]
    1.0
    >>> offload_summary(g, Schedule(list(g.order), offloads=offs, bandwidth=5.0))["exposed_time"]
    1.0
    """
    bw = schedule.bandwidth if bandwidth is None else bandwidth
    seq = schedule.sequence
    n = len(seq)
    d2h, h2d = np.zeros(n), np.zeros(n)
    for o in schedule.offloads:
        d2h[o.after + 1] += graph[o.node]["bytes"]
        h2d[o.before - 1] += graph[o.node]["bytes"]
    moved = int(d2h.sum())
    if not moved or not bw:
        return {"offloads": len(schedule.offloads), "offloaded_bytes": moved, "link_time": 0.0,
                "exposed_time": 0.0, "hidden_fraction": 1.0}
    link = np.maximum(d2h, h2d) / bw
    compute = simulate(graph, list(seq)).cost
    exposed = max(0.0, simulate(graph, schedule, bandwidth=bw).cost - compute)
    total = float(link.sum())
    return {"offloads": len(schedule.offloads), "offloaded_bytes": moved, "link_time": total,
            "exposed_time": exposed, "hidden_fraction": max(0.0, 1.0 - exposed / total) if total else 1.0}


# ---------------------------------------------------------------------------- break-even
def breakeven_bandwidth(
    graph: ComputeGraph,
    node: Hashable,
    *,
    sequence: Sequence[Hashable] | None = None,
    recompute_cost: float | None = None,
) -> float:
    """The least bandwidth at which offloading ``node`` costs no more than recomputing it.

    The offload is the one of the longest window of ``node`` in ``sequence`` (default:
    the reference order; for a forward value read again in backward, from its last
    forward use to its first backward use), sent to the host right after the use that
    opens the window and fetched just in time, one step before the next use. Its extra
    time at bandwidth ``bw`` is ``max(0, B/bw - c_out) + max(0, B/bw - c_in)`` with
    ``c_out`` / ``c_in`` the compute of the two transfer steps (what
    :func:`solver.simulate` charges when no other transfer shares them). Recomputing costs
    ``recompute_cost`` (default: the node's own ``time``, its inputs assumed resident).

    Parameters
    ----------
    graph : ComputeGraph
    node : hashable
        An op node.
    sequence : sequence of node ids, optional
    recompute_cost : float, optional

    Returns
    -------
    float
        Bytes per time unit; ``inf`` when offloading always costs more (a free
        recomputation and a transfer that cannot hide), 0 for a value of 0 bytes.

    Raises
    ------
    ValueError
        ``node`` is not an op or has no window long enough to offload.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3, fwd_bytes=100, fwd_time=1.0)
    >>> breakeven_bandwidth(g, "f0")   # sent during f1 (time 1), fetched during b2 (time 2)
    50.0

    O(len(sequence) x mean in-degree).
    """
    if node not in graph or not graph.is_op(node):
        raise ValueError(f"{node!r} is not an op node of graph {graph.name!r}")
    seq = list(graph.order if sequence is None else sequence)
    wins = [w for w in offload_windows(graph, seq) if w.node == node]
    if not wins:
        if int(graph[node]["bytes"]) == 0:
            return 0.0
        raise ValueError(
            f"{node!r} has no window of at least 3 steps between two uses in the sequence; "
            "nothing to offload"
        )
    w = max(wins, key=lambda w: w.in_last - w.out_first)
    r = float(graph[node]["time"] if recompute_cost is None else recompute_cost)
    c1, c2 = sorted((float(graph[seq[w.out_first]]["time"]), float(graph[seq[w.in_last]]["time"])))
    # extra(x) with x = B / bw is 0 up to c1, x - c1 up to c2, then 2x - c1 - c2
    x = c1 + r if r <= c2 - c1 else (r + c1 + c2) / 2
    if x <= 0:
        return math.inf
    return w.bytes / x

"""The one judge of a schedule: peak memory, cost and validity under the memory model.

Memory model (the same one the public benchmark graphs use):

* Sources (parameters, buffers, inputs) are resident for the whole step
  (:attr:`ComputeGraph.fixed_bytes`).
* Each occurrence of an op node in the sequence makes a new copy of its output. The copy
  is live from its step until after the last consumer that runs before the node's next
  occurrence; a node marked ``output`` stays live until the step ends; a copy nobody
  reads is live during its own step only.
* The memory at step ``t`` is the fixed bytes plus every live copy at ``t`` (the inputs
  of the op at ``t`` and its new output included) plus the op's workspace. The peak is
  the maximum over steps. Projections of one multi-output op (node attribute
  ``group``) that directly follow each other in group order are one run of the op:
  a later one is charged ``run_workspace`` instead of ``workspace``, and no time; the
  projection that starts a run pays the whole op (``group_time``, when given).
* Random ops that a rewrite replays (:func:`graphs.fixed.kept_states`): the fixed bytes
  charge every op's generator state and one more; a step holds an op's state only
  from the op's first run to its last where it runs more than once, and one more
  during a run that replays it: the rest is given back.
* An op is valid only when every op it reads has a live, on-device copy, and the
  nodes listed in ``graph.meta["ordered"]`` (random ops, which draw from one
  generator) first run in that order.
* Offload: an :class:`~solver.schedule.Offload` moves a copy to host memory during step
  ``after + 1`` and brings it back during step ``before - 1``; in between it is not
  charged on the device and cannot be read. A step costs
  ``max(compute, bytes sent to host / bandwidth, bytes fetched / bandwidth)``.

Complexity: O(len(sequence) x mean in-degree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from graphs import ComputeGraph
from graphs.fixed import kept_states
from solver.schedule import Schedule

if TYPE_CHECKING:
    from solver.deadline import Deadline

__all__ = ["SimulationResult", "simulate"]


@dataclass
class SimulationResult:
    """What :func:`simulate` finds.

    Attributes
    ----------
    valid : bool
        Every op's inputs were resident on the device when it ran, every op node ran at
        least once and every output survives to the end.
    error : str or None
        The first violation, for people.
    peak_bytes : int
        Maximum over steps of the device bytes in use (fixed bytes included).
    peak_step : int
        The step at which the peak occurs.
    cost : float
        Total time: compute of every occurrence, transfers folded in as
        ``max(compute, transfer)`` per step.
    base_cost : float
        Compute of every op exactly once (the store-all cost).
    memory_curve : numpy.ndarray
        Device bytes at every step.
    recomputations : int
        Occurrences beyond the first of each node.
    """

    valid: bool
    error: str | None
    peak_bytes: int
    peak_step: int
    cost: float
    base_cost: float
    memory_curve: np.ndarray = field(repr=False)
    recomputations: int = 0

    @property
    def extra_cost(self) -> float:
        return self.cost - self.base_cost

    @property
    def overhead(self) -> float:
        """Extra compute as a fraction of the store-all cost."""
        return self.extra_cost / self.base_cost if self.base_cost else 0.0


def simulate(
    graph: ComputeGraph,
    schedule: Schedule | Sequence[Hashable],
    *,
    bandwidth: float | None = None,
    deadline: "Deadline | None" = None,
) -> SimulationResult:
    """Replay a schedule under the memory model and grade it.

    Parameters
    ----------
    graph : ComputeGraph
    schedule : Schedule or sequence of node ids
        A recomputation is a repeated id.
    bandwidth : float, optional
        Host link bytes per time unit, needed when the schedule offloads (defaults to
        ``schedule.bandwidth``).
    deadline : solver.deadline.Deadline, optional
        Checked every few thousand steps: a method that grades its candidates under a
        time limit stops a long replay with :class:`~solver.deadline.OutOfTime`.

    Returns
    -------
    SimulationResult

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(3): g.add_node(i, bytes=10, time=1.0)
    >>> g.add_edge(0, 1); g.add_edge(1, 2); g.add_edge(0, 2)
    >>> r = simulate(g, [0, 1, 2])
    >>> r.valid, r.peak_bytes, r.cost
    (True, 30, 3.0)
    """
    if isinstance(schedule, Schedule):
        sequence = schedule.sequence
        offloads = schedule.offloads
        if bandwidth is None:
            bandwidth = schedule.bandwidth
    else:
        sequence = list(schedule)
        offloads = []
    nodes = graph.node_data
    n_steps = len(sequence)
    base_cost = float(sum(nodes[v]["time"] for v in graph.ops))

    rep = _replay(graph, sequence, deadline)
    if rep.error is None:
        rep.error = _order_error(graph, sequence, rep.seen)
    # outputs: the latest copy stays live until the end
    for v, k in rep.current.items():
        if nodes[v].get("output", False):
            rep.occ_end[k] = max(n_steps - 1, rep.occ_end[k])
    d2h, h2d, holes = _offload(graph, sequence, offloads, bandwidth, rep)
    if deadline is not None:
        deadline.check("replaying a schedule")
    curve = _device_bytes(graph, n_steps, rep, holes)
    compute, workspace = _steps(nodes, sequence, deadline)
    curve = curve + workspace - _states_not_held(graph, sequence)
    if offloads and bandwidth:
        step_cost = np.maximum(compute, np.maximum(d2h, h2d) / bandwidth)
        cost = float(step_cost.sum())
    else:
        cost = float(compute.sum())
    if n_steps:
        peak_step = int(np.argmax(curve))
        peak = int(curve[peak_step])
    else:
        peak_step, peak = 0, int(graph.fixed_bytes)
    return SimulationResult(
        valid=rep.error is None,
        error=rep.error,
        peak_bytes=peak,
        peak_step=peak_step,
        cost=cost,
        base_cost=base_cost,
        memory_curve=curve,
        recomputations=rep.recomputations,
    )


@dataclass
class _Replay:
    """The copies a sequence makes: occurrence ``k`` of node ``occ_node[k]`` is made at
    step ``occ_start[k]`` and live until ``occ_end[k]``; ``reads_at_step[t]`` are the
    occurrences step ``t`` reads; ``current`` maps each node to its latest occurrence."""

    occ_start: list[int] = field(default_factory=list)
    occ_node: list[Hashable] = field(default_factory=list)
    occ_end: list[int] = field(default_factory=list)
    current: dict[Hashable, int] = field(default_factory=dict)
    reads_at_step: list[list[int]] = field(default_factory=list)
    seen: set = field(default_factory=set)
    recomputations: int = 0
    error: str | None = None  # the first violation


def _replay(graph: ComputeGraph, sequence, deadline) -> _Replay:
    """Phase 1: run the sequence, making a copy per step and extending the live range of
    every copy read; note the first read of a missing value or unknown node."""
    nodes, pred, ops_set = graph.node_data, graph.pred_map, graph.ops_set
    rep = _Replay()
    occ_start, occ_node, occ_end, current = rep.occ_start, rep.occ_node, rep.occ_end, rep.current
    reads_at_step, seen = rep.reads_at_step, rep.seen
    error: str | None = None
    for t, v in enumerate(sequence):
        if deadline is not None and t & 4095 == 4095:
            deadline.check("replaying a schedule")
        if v not in nodes:
            error = error or f"step {t}: unknown node {v!r}"
            reads_at_step.append([])
            continue
        if v not in ops_set:
            error = error or f"step {t}: {v!r} is a {nodes[v]['kind']}, not an op"
        reads = []
        for u in pred[v]:
            if u not in ops_set:
                continue
            k = current.get(u)
            if k is None:
                error = error or f"step {t}: {v!r} reads {u!r}, which has not been computed"
                continue
            if occ_end[k] < t:
                occ_end[k] = t
            reads.append(k)
        reads_at_step.append(reads)
        if v in seen:
            rep.recomputations += 1
            if not nodes[v].get("recomputable", True):
                error = error or (f"step {t}: {v!r} is not recomputable (a random op, or a forward output "
                                  "that the caller holds) but runs twice")
        seen.add(v)
        current[v] = len(occ_start)
        occ_start.append(t)
        occ_node.append(v)
        occ_end.append(t)
    rep.error = error
    return rep


def _order_error(graph: ComputeGraph, sequence, seen: set) -> str | None:
    """Phase 2: the ops of ``graph.meta["ordered"]`` first run in that order, and every
    op runs."""
    ordered = graph.meta.get("ordered")
    if ordered:
        first = {}
        for t, v in enumerate(sequence):
            first.setdefault(v, t)
        pos = [first[v] for v in ordered if v in first]
        for a, b in zip(pos, pos[1:]):
            if b < a:
                return (f"step {a}: {sequence[a]!r} runs after {sequence[b]!r}, against the graph's "
                        "required order (random ops draw in their reference order)")
    missing = [v for v in graph.ops if v not in seen]
    if missing:
        return f"{len(missing)} op nodes never run, e.g. {missing[0]!r}"
    return None


def _offload(graph: ComputeGraph, sequence, offloads, bandwidth, rep: _Replay):
    """Phase 3: the bytes sent to and fetched from the host at each step, and the steps
    ``(occurrence, first, last)`` each offloaded copy spends off the device (the copy's
    interval less ``[after + 2, before - 2]``); an offloaded copy read is an error."""
    nodes, n_steps = graph.node_data, len(sequence)
    d2h = np.zeros(n_steps)
    h2d = np.zeros(n_steps)
    holes: list[tuple[int, int, int]] = []  # (occurrence, first hidden step, last hidden step)
    if not offloads:
        return d2h, h2d, holes
    occ_start, occ_end = rep.occ_start, rep.occ_end
    error = rep.error
    if not bandwidth or bandwidth <= 0:
        error = error or "the schedule offloads but no positive bandwidth was given"
    windows: dict[int, list[tuple[int, int]]] = {}
    occurrences: dict[Hashable, list[int]] = {}
    for k, v in enumerate(rep.occ_node):
        occurrences.setdefault(v, []).append(k)
    for off in offloads:
        k = next((k for k in occurrences.get(off.node, ()) if occ_start[k] <= off.after <= occ_end[k]), None)
        if k is None:
            error = error or f"offload of {off.node!r}: no copy is live at step {off.after}"
            continue
        if not (0 <= off.after and off.after + 1 < off.before <= n_steps):
            error = error or f"offload of {off.node!r}: need 0 <= after < before - 1 < len(sequence)"
            continue
        nbytes = nodes[off.node]["bytes"]
        d2h[off.after + 1] += nbytes
        h2d[off.before - 1] += nbytes
        lo, hi = off.after + 2, off.before - 2
        for a2, b2 in windows.setdefault(k, []):
            if a2 + 1 <= off.before - 1 and off.after + 1 <= b2 - 1:
                error = error or f"offload windows of {off.node!r} overlap"
        windows[k].append((off.after, off.before))
        if lo <= hi:
            holes.append((k, lo, hi))
        # the copy cannot be read from the step after it leaves until it is back
        for t in range(off.after + 2, off.before):
            for r in rep.reads_at_step[t]:
                if r == k:
                    error = error or f"step {t}: {sequence[t]!r} reads {off.node!r} while it is on the host"
    rep.error = error
    return d2h, h2d, holes


def _device_bytes(graph: ComputeGraph, n_steps: int, rep: _Replay, holes) -> np.ndarray:
    """Phase 4: the fixed bytes plus every live on-device copy at each step, swept with a
    difference array."""
    nodes = graph.node_data
    delta = np.zeros(n_steps + 1, dtype=np.int64)
    for k in range(len(rep.occ_start)):
        b = int(nodes[rep.occ_node[k]]["bytes"])
        if b:
            delta[rep.occ_start[k]] += b
            delta[rep.occ_end[k] + 1] -= b
    for k, lo, hi in holes:
        lo2, hi2 = max(lo, rep.occ_start[k]), min(hi, rep.occ_end[k])
        if lo2 <= hi2:
            b = int(nodes[rep.occ_node[k]]["bytes"])
            delta[lo2] -= b
            delta[hi2 + 1] += b
    return np.cumsum(delta[:n_steps]) + graph.fixed_bytes


def _states_not_held(graph: ComputeGraph, sequence) -> np.ndarray | int:
    """Phase 4b: at each step, the bytes of the generator states that the fixed bytes
    charge (:func:`graphs.fixed.kept_states`: one per random op, one for a replay's
    swap) and the schedule does not hold."""
    ops, per = kept_states(graph)
    if not per:
        return 0
    nodes, n = graph.node_data, len(sequence)
    runs: dict = {}
    for t, v in enumerate(sequence):
        if v in ops and not _continues_run(nodes, sequence, t):
            runs.setdefault(ops[v], []).append(t)
    held = np.zeros(n + 1, dtype=np.int64)
    for ts in runs.values():
        if len(ts) > 1:
            held[ts[0]] += 1
            held[ts[-1] + 1] -= 1
            for t in ts[1:]:  # the state swapped out while the replay runs
                held[t] += 1
                held[t + 1] -= 1
    return (len(set(ops.values())) + 1 - np.cumsum(held[:n])) * per


def _steps(nodes, sequence, deadline) -> tuple[np.ndarray, np.ndarray]:
    """Phase 5: each step's compute time and workspace bytes."""
    times: list[float] = []
    spaces: list[int] = []
    for t in range(len(sequence)):
        if deadline is not None and t & 4095 == 4095:
            deadline.check("replaying a schedule")
        run = _continues_run(nodes, sequence, t)
        times.append(step_time(nodes, sequence[t], run))
        spaces.append(step_workspace(nodes, sequence[t], run))
    return np.array(times, dtype=float), np.array(spaces, dtype=np.int64)


def _continues_run(nodes, sequence, t: int) -> bool:
    """Does step ``t`` continue a run of a multi-output op (it follows an earlier
    projection of the same ``group`` directly)?"""
    return t > 0 and step_continues(nodes, sequence[t - 1], sequence[t])


def step_continues(nodes, prev, v) -> bool:
    """Does a step of ``v`` right after a step of ``prev`` continue a run of a
    multi-output op (``prev`` an earlier projection of the same ``group``)?"""
    if v not in nodes or prev not in nodes:
        return False
    d, before = nodes[v], nodes[prev]
    group = d.get("group")
    return group is not None and before.get("group") == group and before.get("group_index", 0) < d.get("group_index", 0)


def step_time(nodes, v, continues: bool) -> float:
    """A projection that starts a run of its op pays the whole op (``group_time``); one
    that continues the run pays nothing more. Other nodes pay their ``time``."""
    if v not in nodes:
        return 0.0
    d = nodes[v]
    if d.get("group") is not None and "group_time" in d:
        return 0.0 if continues else float(d["group_time"])
    return float(d["time"])


def step_workspace(nodes, v, continues: bool) -> int:
    """Workspace of a step: a projection that continues a run is charged only for the
    outputs still to come (``run_workspace``), the earlier ones being live nodes."""
    if v not in nodes:
        return 0
    d = nodes[v]
    if continues:
        return int(d.get("run_workspace", d.get("workspace", 0)))
    return int(d.get("workspace", 0))

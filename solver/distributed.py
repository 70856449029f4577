"""Per-rank memory under data parallelism: what one rank of FSDP2 or DDP holds.

The budget of a distributed step is per rank. A rank runs the step of its local batch,
so its activations are those of the single-process step on that batch (the captured
graph and the simulator give them); what changes is the resident state:

``"ddp"`` (``DistributedDataParallel``)
    every rank holds all parameters, gradients and optimizer state, plus the reducer's
    gradient buckets (one flat copy of the gradients, unless
    ``gradient_as_bucket_view=True``).
``"fsdp"`` (FSDP2 ``fully_shard``, ZeRO-3 style)
    a rank holds ``1/world_size`` of every parameter, gradient and optimizer state
    tensor (dim-0 shards, padded to equal size). A unit's whole parameters exist only
    while the unit computes: from its forward's all-gather to its end (freed after
    forward with ``reshard_after_forward``), and in backward from its prefetch (when the
    next unit in forward order starts its backward) to its end; the root unit stays
    gathered through the step. A unit's whole gradients live until its backward ends;
    then they are copied into a reduce-scatter buffer and leave a shard. A prefetched
    all-gather keeps its input (one shard) until the unit's backward starts.

:func:`rank_peak` replays a schedule with the simulator and re-prices every step with
these rules; :func:`rank_fixed_bytes` and :func:`allgather_bytes` are the closed forms.
:func:`checkpoint_sequence` turns a module plan's sequence into the order in which
``torch.utils.checkpoint`` really recomputes (a whole block at its backward's first
read), which is what a rank measures.

This module does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

from graphs import ComputeGraph
from graphs.actions import LayerAction
from solver.errors import InfeasibleBudget, SolverError
from solver.module_plan import (DEFAULT_ACTIONS, ModulePlan, checkpoint_sequence, checkpoint_view, greedy_block_plan,
                                plan_schedule)
from solver.simulate import simulate

__all__ = ["SHARDINGS", "RankBytes", "RankPeak", "shard_bytes", "rank_fixed_bytes", "allgather_bytes",
           "checkpoint_sequence", "rank_peak", "unit_of", "plan_modules_per_rank"]

#: Data-parallel strategies with a per-rank memory model.
SHARDINGS = ("ddp", "fsdp")


def _check(world_size: int, sharding: str) -> None:
    if int(world_size) < 1:
        raise SolverError(f"world_size must be >= 1, got {world_size!r}")
    if sharding not in SHARDINGS:
        raise SolverError(f"unknown sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")


def shard_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of one rank's shard of a tensor of ``nbytes``: ``ceil(nbytes / world_size)``
    (exact when dim 0 divides evenly; FSDP2 pads the last shard to the same size).

    Examples
    --------
    >>> shard_bytes(1000, 3)
    334
    """
    return -(-int(nbytes) // int(world_size))


@dataclass(frozen=True)
class RankBytes:
    """Resident bytes of one rank between steps (all per rank)."""

    params: int
    grads: int
    optimizer: int
    buckets: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buckets


def rank_fixed_bytes(*, world_size: int, sharding: str, param_bytes: int, grad_bytes: int | None = None,
                     optimizer_bytes: int = 0, unit_param_bytes: Mapping[str, int] | None = None,
                     gradient_as_bucket_view: bool = False) -> RankBytes:
    """What one rank holds between steps.

    Parameters
    ----------
    world_size : int
    sharding : {"ddp", "fsdp"}
    param_bytes : int
        Bytes of all (global) parameters.
    grad_bytes : int, optional
        Bytes of all gradients (default ``param_bytes``).
    optimizer_bytes : int
        Bytes of the whole optimizer state (e.g. 2 x ``param_bytes`` for Adam).
    unit_param_bytes : mapping, optional
        FSDP2: parameter bytes per unit; shards are padded per tensor group, so giving
        them is a little more exact than ``param_bytes`` alone.
    gradient_as_bucket_view : bool
        DDP: gradients are views of the buckets (no extra copy).

    Returns
    -------
    RankBytes

    Examples
    --------
    >>> rank_fixed_bytes(world_size=4, sharding="fsdp", param_bytes=1000, optimizer_bytes=2000).total
    1000
    >>> rank_fixed_bytes(world_size=4, sharding="ddp", param_bytes=1000).total
    3000
    """
    _check(world_size, sharding)
    W = int(world_size)
    g = param_bytes if grad_bytes is None else grad_bytes
    if sharding == "ddp":
        return RankBytes(int(param_bytes), int(g), int(optimizer_bytes), 0 if gradient_as_bucket_view else int(g))
    if unit_param_bytes:
        p = sum(shard_bytes(b, W) for b in unit_param_bytes.values())
    else:
        p = shard_bytes(param_bytes, W)
    return RankBytes(p, shard_bytes(g, W), shard_bytes(optimizer_bytes, W), 0)


def allgather_bytes(unit_param_bytes: Mapping[str, int], *, world_size: int, prefetch: int = 1,
                    root: str = "") -> int:
    """Largest transient of FSDP2's all-gathers on one rank: the root unit (kept
    gathered), the largest unit being computed and ``prefetch`` more, plus the shard
    copied into the all-gather input.

    Examples
    --------
    >>> allgather_bytes({"": 100, "a": 400, "b": 300}, world_size=2)
    1000
    """
    blocks = sorted((b for u, b in unit_param_bytes.items() if u != root), reverse=True)
    held = unit_param_bytes.get(root, 0) + sum(blocks[: 1 + int(prefetch)])
    return int(held + (shard_bytes(blocks[0], world_size) if blocks else 0))


def unit_of(module: str, units: Sequence[str]) -> str:
    """The FSDP2 unit that runs a module path: the longest unit prefix, else the root ``""``.

    Examples
    --------
    >>> unit_of("blocks.1.fc", ["blocks.0", "blocks.1"]), unit_of("head", ["blocks.0"])
    ('blocks.1', '')
    """
    best = ""
    for u in units:
        if (module == u or module.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


@dataclass
class RankPeak:
    """Predicted memory of one rank over one training step.

    Attributes
    ----------
    peak_bytes : int
    peak_step : int
        Index into the sequence.
    curve : numpy.ndarray
        Bytes at every step.
    fixed : RankBytes
        What the rank holds between steps.
    single_peak_bytes : int
        The simulator's peak of the same sequence in one process (whole parameters).
    """

    peak_bytes: int
    peak_step: int
    curve: np.ndarray = field(repr=False)
    fixed: RankBytes
    single_peak_bytes: int


def rank_peak(graph: ComputeGraph, sequence: Sequence[Hashable], *, world_size: int, sharding: str,
              units: Sequence[str] = (), optimizer_bytes: int = 0, prefetch: int = 1,
              gradient_as_bucket_view: bool = False) -> RankPeak:
    """Peak bytes of one rank running ``sequence`` on its local batch.

    ``graph`` is the step of one rank's batch, captured in one process. The simulator
    gives the memory at every step; under DDP the rank adds its gradient buckets; under
    FSDP2 every step is re-priced: whole parameters and gradients out, shards in, the
    gathered units of that step (see the module docstring) in, the whole gradients of
    units whose backward has not ended in, and at the end of a unit's backward its
    reduce-scatter buffers (whole and shard).

    Parameters
    ----------
    graph : ComputeGraph
        Captured on the local batch; parameters are sources of kind ``"param"`` whose
        ``name`` is the module path, op nodes carry ``module``.
    sequence : sequence of node ids
    world_size : int
    sharding : {"ddp", "fsdp"}
    units : sequence of str
        FSDP2 units besides the root (module paths), e.g. the transformer blocks.
    optimizer_bytes : int
        Bytes of the whole (unsharded) optimizer state.
    prefetch : int
        Units FSDP2 gathers ahead in backward (its default: 1).
    gradient_as_bucket_view : bool
        DDP's option.

    Returns
    -------
    RankPeak

    Raises
    ------
    SolverError
        An invalid sequence or an unknown sharding.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3)
    >>> seq = list(g.order)
    >>> single = simulate(g, seq).peak_bytes
    >>> p = rank_peak(g, seq, world_size=2, sharding="ddp")
    >>> p.peak_bytes == single + p.fixed.buckets
    True
    """
    _check(world_size, sharding)
    W = int(world_size)
    r = simulate(graph, sequence)
    if not r.valid:
        raise SolverError(f"invalid sequence: {r.error}")
    curve = np.asarray(r.memory_curve, dtype=np.float64)
    seq = list(sequence)
    units = list(units)
    params = [v for v in graph.sources if graph[v].get("kind") == "param"]
    param_total = sum(graph[v]["bytes"] for v in params)
    grads = [v for v in graph.ops if graph[v]["output"] and graph[v]["phase"] == "backward"]
    grad_total = sum(graph[v]["bytes"] for v in grads)
    unit_bytes = _unit_param_bytes(graph, params, units)
    if sharding == "ddp":
        fixed = rank_fixed_bytes(world_size=W, sharding="ddp", param_bytes=param_total, grad_bytes=grad_total,
                                 optimizer_bytes=optimizer_bytes, gradient_as_bucket_view=gradient_as_bucket_view)
        return _peak_of(curve + fixed.buckets + fixed.optimizer, fixed, r.peak_bytes)

    fixed = rank_fixed_bytes(world_size=W, sharding="fsdp", param_bytes=param_total, grad_bytes=grad_total,
                             optimizer_bytes=optimizer_bytes, unit_param_bytes=unit_bytes)
    spans = _UnitSpans.of(graph, seq, units)
    gathered = _gathered_bytes(spans, unit_bytes)
    whole_grads, keep_grads, grad_bytes_unit = _gradient_bytes(graph, seq, grads, spans)
    extra, shards = _reduce_scatter_bytes(spans, grad_bytes_unit, W)
    out = (curve - param_total - whole_grads + keep_grads + shards + gathered + extra
           + fixed.params + fixed.optimizer)
    return _peak_of(out, fixed, r.peak_bytes)


def _peak_of(out: np.ndarray, fixed: RankBytes, single_peak: int) -> RankPeak:
    """The :class:`RankPeak` of the per-step bytes ``out``."""
    t = int(np.argmax(out)) if len(out) else 0
    return RankPeak(int(math.ceil(out[t])) if len(out) else 0, t, out, fixed, single_peak)


def _unit_param_bytes(graph: ComputeGraph, params: list[Hashable], units: list[str]) -> dict[str, int]:
    """Parameter bytes of each FSDP2 unit; the root is ``""``."""
    unit_bytes = {u: 0 for u in units}
    unit_bytes[""] = 0
    for v in params:
        unit_bytes[unit_of(str(graph[v].get("name", "")), units)] += graph[v]["bytes"]
    return unit_bytes


@dataclass
class _UnitSpans:
    """Where each FSDP2 unit runs in a sequence of ``n`` steps.

    ``fwd`` and ``bwd`` map a unit to the first and last step of its ops before and from
    ``first_bwd`` (the first backward step); ``blocks`` are the units besides the root in
    forward order.
    """

    n: int
    first_bwd: int
    fwd: dict[str, list[int]]
    bwd: dict[str, list[int]]
    blocks: list[str]
    units: list[str]

    @classmethod
    def of(cls, graph: ComputeGraph, seq: list[Hashable], units: list[str]) -> "_UnitSpans":
        n = len(seq)
        unit_at = [unit_of(str(graph[v].get("module") or ""), units) for v in seq]
        first_bwd = next((i for i, v in enumerate(seq) if graph[v]["phase"] == "backward"), n)
        fwd_span: dict[str, list[int]] = {}
        bwd_span: dict[str, list[int]] = {}
        for i, u in enumerate(unit_at):
            span = (fwd_span if i < first_bwd else bwd_span).setdefault(u, [i, i])
            span[1] = i
        # forward order of the block units (the root finishes its forward last)
        blocks = sorted((u for u in units if u in fwd_span), key=lambda u: fwd_span[u][0])
        return cls(n, first_bwd, fwd_span, bwd_span, blocks, units)


def _gathered_bytes(spans: _UnitSpans, unit_bytes: dict[str, int]) -> np.ndarray:
    """Whole parameters gathered at every step: the root always, a block during its
    forward and from the next unit's backward (its prefetch) to the end of its own."""
    fwd_span, bwd_span, blocks = spans.fwd, spans.bwd, spans.blocks
    post_forward = blocks + [""]
    gathered = np.zeros(spans.n)
    gathered += unit_bytes[""]  # the root stays gathered
    # the all-gather input is a view into the all-gather output: no extra shard
    for k, u in enumerate(blocks):
        lo, hi = fwd_span[u]
        gathered[lo:hi + 1] += unit_bytes[u]
        if u in bwd_span:
            nxt = post_forward[k + 1]
            start = bwd_span[nxt][0] if nxt in bwd_span else spans.first_bwd
            end = bwd_span[u][1]
            gathered[min(start, bwd_span[u][0]):end + 1] += unit_bytes[u]
    return gathered


def _gradient_bytes(graph: ComputeGraph, seq: list[Hashable], grads: list[Hashable], spans: _UnitSpans
                    ) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Gradients: whole until their unit's backward ends, then a shard.

    Returns the simulator's (whole) gradients at every step, to take out; the whole
    gradients of units still in backward at every step; and each unit's gradient bytes.
    """
    n, bwd_span = spans.n, spans.bwd
    grad_unit = {v: unit_of(str(graph[v].get("module") or ""), spans.units) for v in grads}
    grad_bytes_unit: dict[str, int] = {}
    for v in grads:
        grad_bytes_unit[grad_unit[v]] = grad_bytes_unit.get(grad_unit[v], 0) + graph[v]["bytes"]
    first_at = {}
    for i, v in enumerate(seq):
        first_at.setdefault(v, i)
    whole_grads = np.zeros(n)
    keep_grads = np.zeros(n)
    for v in grads:
        i = first_at.get(v)
        if i is None:
            continue
        whole_grads[i:] += graph[v]["bytes"]
        u = grad_unit[v]
        end = bwd_span[u][1] if (u in bwd_span and u != "") else n - 1
        keep_grads[i:end + 1] += graph[v]["bytes"]
    return whole_grads, keep_grads, grad_bytes_unit


def _reduce_scatter_bytes(spans: _UnitSpans, grad_bytes_unit: dict[str, int], world_size: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Reduce-scatter input buffers and gradient shards at every step.

    A unit's reduce-scatter input (its whole gradients, flat) is kept until the next
    unit's reduce-scatter (FSDP2's reduce_scatter_max_input_buffers=1), the last until
    the end of backward; the output is the gradient shard.
    """
    n, bwd_span = spans.n, spans.bwd
    extra = np.zeros(n)
    shards = np.zeros(n)
    ends = sorted(bwd_span[u][1] for u in spans.blocks if u in bwd_span)
    for u in spans.blocks:
        if u in bwd_span:
            end = bwd_span[u][1]
            g = grad_bytes_unit.get(u, 0)
            later = [e for e in ends if e > end]
            extra[end:(later[0] if later else n - 1) + 1] += g
            shards[end:] += shard_bytes(g, world_size)
    return extra, shards


def plan_modules_per_rank(graph: ComputeGraph, budget_bytes: int, *, blocks: Sequence[str], world_size: int,
                          sharding: str = "fsdp", units: Sequence[str] | None = None, optimizer_bytes: int = 0,
                          prefetch: int = 1, actions: Sequence[str] = DEFAULT_ACTIONS,
                          time_limit: float | None = None) -> tuple[ModulePlan, RankPeak]:
    """Choose an action per block so that one rank's step fits ``budget_bytes``.

    The search of :func:`solver.module_plan.plan_modules` (greedy: upgrade the block that
    lowers the peak most per unit of extra cost until the step fits, then downgrade what
    the budget no longer needs), with every candidate priced by :func:`rank_peak` on the
    order that ``torch.utils.checkpoint`` runs (:func:`checkpoint_sequence`): under
    FSDP2 a rank holds shards, the gathered parameters of the units in flight and
    whole gradients only until their unit's reduce-scatter, so the single-process peak
    (and its whole-model fixed bytes) would misjudge which plans fit.

    Parameters
    ----------
    graph : ComputeGraph
        One rank's step (its local batch), captured in one process; parameters are
        sources of kind ``"param"`` named by module path. Its ``fixed_bytes`` should not
        hold the optimizer state: pass it as ``optimizer_bytes`` (whole model), which
        :func:`rank_peak` shards.
    budget_bytes : int
        Per rank.
    blocks : sequence of str
        Candidate module paths (not nested).
    world_size : int
    sharding : {"fsdp", "ddp"}
    units : sequence of str, optional
        FSDP2 units besides the root (default ``blocks``).
    optimizer_bytes : int
        Whole-model optimizer state.
    prefetch : int
        Units FSDP2 gathers ahead in backward.
    actions : sequence of str
        Allowed actions in order of strength; offload is not priced per rank.
    time_limit : float, optional
        Seconds for the search.

    Returns
    -------
    (ModulePlan, RankPeak)
        The plan (its schedule's ``peak_bytes`` is the rank's peak, its sequence the
        checkpoint order on :func:`solver.module_plan.checkpoint_view` of ``graph``) and
        the rank's predicted memory.

    Raises
    ------
    InfeasibleBudget
        No plan found fits; carries the smallest rank peak of the uniform plans.
    SolverError
        An offload action, or an unknown sharding.

    Notes
    -----
    O(rounds x blocks x actions) evaluations, each one simulation of the graph plus an
    O(sequence) re-pricing.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=8)
    >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
    >>> plan, peak = plan_modules_per_rank(g, 40, blocks=["layers.0", "layers.1"], world_size=2)
    >>> peak.peak_bytes <= 40 and plan.schedule.peak_bytes == peak.peak_bytes
    True
    """
    _check(world_size, sharding)
    if LayerAction.OFFLOAD in actions:
        raise SolverError("offload is not planned per rank (under FSDP2 save_on_cpu would also move the "
                          "all-gathered parameters); use none / selective / full")
    blocks = list(blocks)
    units = blocks if units is None else list(units)
    graph = checkpoint_view(graph, blocks)

    def price(plan: dict) -> tuple:
        sched, res = plan_schedule(graph, plan)
        rp = rank_peak(graph, sched.sequence, world_size=world_size, sharding=sharding, units=units,
                       optimizer_bytes=optimizer_bytes, prefetch=prefetch)
        sched.peak_bytes = rp.peak_bytes
        return rp.peak_bytes, res.cost, (sched, rp)

    plan, (peak, _, (sched, rp)), smallest, evaluations = greedy_block_plan(
        blocks, actions, budget_bytes, price, time_limit=time_limit)
    if peak > budget_bytes:
        raise InfeasibleBudget(int(budget_bytes), smallest,
                               what=f"peak of one rank ({sharding}, world size {world_size}) with per-block "
                                    "checkpointing")
    sched.budget_bytes = int(budget_bytes)
    sched.info = dict(sched.info, sharding=sharding, world_size=int(world_size), units=list(units))
    return ModulePlan(actions=plan, schedule=sched, evaluations=evaluations, blocks=blocks, graph=graph), rp

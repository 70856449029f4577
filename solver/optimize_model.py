"""``optimize(model, budget_gb)``: a drop-in module whose training step fits the budget.

This is the one place where the solvers meet torch: capture the step
(:func:`graphs.capture`), solve a schedule under the budget (:func:`solver.solve`), and
rewrite the model to run it, at tensor level (``mode="graph"``,
:mod:`graphs.graph_mode`) or at layer level (``mode="module"``,
:mod:`graphs.module_mode`). :func:`verify` runs one real step under the memory tracker
and puts the measured peak and step time next to the prediction.

Data parallelism (``sharding="ddp"`` or ``"fsdp"``): the budget and every figure of
the report are per rank; the plan is made on the rank's own step (its local batch) with
the resident memory of a rank (:mod:`solver.distributed`), and the returned module is
ready to train on that rank (wrapped in ``DistributedDataParallel``, or sharded in place
with FSDP2's ``fully_shard``; :mod:`graphs.distributed`).
"""

from __future__ import annotations

import copy
import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from graphs import CaptureError, ComputeGraph, RematError
from graphs.capture import capture, default_loss
from graphs.compute_graph import BACKWARD_START
from graphs.graph_mode import COMPILERS, ScheduledStep, wrap_graph_mode
from graphs.memory import MemoryTracker
from graphs.module_mode import apply_module_plan, layer_blocks
from graphs.rewrite import replay_random_ops
from graphs.units import GiB, format_bytes
from solver.errors import InfeasibleBudget, SolverError
from solver.module_plan import ModulePlan, plan_modules
from solver.registry import check_budget, solve
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["optimize", "verify", "Report", "optimizer_state_bytes"]

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What a plan predicts, and (after :func:`verify`) what a real step measured.

    All byte figures are peak device bytes of one training step: parameters, buffers,
    inputs, gradients, saved activations and temporaries (plus optimizer state when an
    optimizer was given). With ``sharding`` set they are those of one rank: its local
    batch, its shards (FSDP2) or replicas and gradient buckets (DDP); ``rank_fixed``
    splits what the rank holds between steps (``params``, ``grads``, ``optimizer``,
    ``buckets``), ``untracked_bytes`` is what the prediction charges that a memory
    tracker cannot see during :func:`verify` (optimizer state not yet created, the
    gradient seed) and is added to the measured peak.

    ``checked_peak_bytes`` is the peak of one step of the plan that planning measured on
    the example batch (single process, real inputs). When it was over the budget, the
    plan was made again for the budget less what the step measured beyond its
    prediction (a note says so), and ``predicted_peak_bytes`` is that plan's.
    """

    mode: str
    method: str
    budget_bytes: int
    predicted_peak_bytes: int
    store_all_peak_bytes: int
    smallest_feasible_bytes: int
    predicted_overhead: float
    gap: float | None
    solve_seconds: float
    capture_seconds: float
    decisions: str
    budget_kind: str = "step"
    activation_budget_bytes: int | None = None
    recomputed: int = 0
    measured_peak_bytes: int | None = None
    checked_peak_bytes: int | None = None
    measured_step_seconds: float | None = None
    original_step_seconds: float | None = None
    original_peak_bytes: int | None = None
    predicted_extra_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    sharding: str | None = None
    world_size: int = 1
    rank_fixed: dict | None = None
    untracked_bytes: int | None = None
    graph: ComputeGraph | None = field(default=None, repr=False, compare=False)
    schedule: Schedule | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool | None:
        """Whether the measured peak is within the budget (None before :func:`verify`)."""
        if self.measured_peak_bytes is None:
            return None
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def predicted_step_ratio(self) -> float | None:
        """Predicted step time over the original's: the original's measured step plus the
        recomputation the plan predicts, ``1 + predicted_extra_seconds /
        original_step_seconds``. Known after :func:`verify` with ``original``, when the op
        times were measured on this device (None otherwise).

        ``1 + predicted_overhead`` is the same ratio over the captured ops alone; a real
        step also spends time outside them (the autograd engine, gradient accumulation,
        ops that capture decomposes away), 9 to 16 % of an eager CPU step on the
        benchmark models, which makes that ratio overstate the slowdown.
        """
        if self.predicted_extra_seconds is None or not self.original_step_seconds:
            return None
        return 1 + self.predicted_extra_seconds / self.original_step_seconds

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("graph", "schedule", "decisions")}
        out["fits"] = self.fits
        out["predicted_step_ratio"] = self.predicted_step_ratio
        return out

    def __str__(self) -> str:
        def b(x):
            return "-" if x is None else f"{format_bytes(x)}"

        gap = "unknown" if self.gap is None else f"{100 * self.gap:.1f} % of the extra compute"
        lines = [
            f"remat plan ({self.mode} mode, method {self.method})",
            *([f"  data parallel       {self.sharding}, world size {self.world_size}: budget and peaks are "
               f"per rank" + ("" if not self.rank_fixed else " (between steps a rank holds " + ", ".join(
                   f"{k} {b(v)}" for k, v in self.rank_fixed.items()) + ")")] if self.sharding else []),
            f"  budget              {b(self.budget_bytes)}"
            + (f"  (activations: {b(self.activation_budget_bytes)})" if self.activation_budget_bytes else ""),
            f"  predicted peak      {b(self.predicted_peak_bytes)}",
            f"  store-all peak      {b(self.store_all_peak_bytes)}",
            f"  smallest feasible   {b(self.smallest_feasible_bytes)}",
            f"  extra compute       {100 * self.predicted_overhead:+.2f} % (predicted), gap {gap}",
            f"  planning            capture {self.capture_seconds:.2f} s, solve {self.solve_seconds:.2f} s",
        ]
        if self.measured_peak_bytes is not None:
            ratio = self.measured_peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else math.nan
            lines.append(
                f"  measured peak       {b(self.measured_peak_bytes)} ({ratio:.3f}x predicted; "
                f"{'fits' if self.fits else 'OVER'} the budget)"
            )
        if self.measured_step_seconds is not None:
            rel = ""
            if self.original_step_seconds:
                rel = f" ({self.measured_step_seconds / self.original_step_seconds:.2f}x the original's " \
                      f"{1e3 * self.original_step_seconds:.1f} ms" + (
                          f"; predicted {self.predicted_step_ratio:.2f}x" if self.predicted_step_ratio else "") + ")"
            lines.append(f"  step time           {1e3 * self.measured_step_seconds:.1f} ms{rel}")
        if self.original_peak_bytes is not None:
            lines.append(f"  original peak       {b(self.original_peak_bytes)}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        lines.append("  decisions:")
        lines.extend("    " + line for line in self.decisions.splitlines())
        return "\n".join(lines)


#: bytes charged on top of the graph for the scalars autograd creates outside it (the
#: gradient seed of ``loss.backward()``)
_SEED_RESERVE = 64


def _untracked_bytes(cg: ComputeGraph | None) -> int:
    """Bytes the prediction charges that a live-tensor tracker cannot see in a step of
    the bare model: the optimizer state, not yet created, and under DDP the gradient
    buckets (the tracker sees the loss and its gradient seed)."""
    return 0 if cg is None else cg.meta.get("untracked_bytes", 0)


def _backward_from_loss(cg: ComputeGraph) -> None:
    """When the model returns a scalar loss among its outputs (an HF ``ModelOutput`` with
    ``loss``), training steps call ``loss.backward()``: the other outputs' gradients never
    arrive, so their tangents take no memory. The outputs themselves stay resident (a
    training loop usually holds the output object during backward)."""
    tangents = [v for v in cg.ops if cg[v]["op"] == "tangent"]
    scalar = [t for t in tangents if cg[t].get("grad_of") in cg.nx and cg[cg[t]["grad_of"]]["bytes"] <= 8]
    if scalar and len(scalar) < len(tangents):
        for t in tangents:
            if t not in scalar:
                cg[t]["bytes"] = 0
        cg.meta["backward_from"] = "loss"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> int:
    """Bytes of optimizer state during a step: measured when the state exists, else the
    steady state of the optimizer's kind (Adam/AdamW: two tensors per parameter; SGD
    with momentum: one).

    Examples
    --------
    >>> net = nn.Linear(4, 4)
    >>> optimizer_state_bytes(torch.optim.Adam(net.parameters()), net)
    160
    """
    if optimizer is None:
        return 0
    total = 0
    seen = set()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    if total:
        return total
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return 2 * param_bytes
    if name == "sgd" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return param_bytes
    if "rmsprop" in name or "adagrad" in name:
        return param_bytes
    return 0


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _capture_inputs(args: tuple, kwargs: dict) -> tuple | dict:
    if kwargs and args:
        raise CaptureError("pass the example inputs either as a tuple of positional arguments or "
                           "as a dict of keyword arguments, not both")
    return kwargs if kwargs else args


def optimize(
    model: nn.Module,
    budget_gb: float,
    example_inputs: Any = None,
    *,
    method: str = "auto",
    time_limit: float | None = None,
    mode: str = "graph",
    activation_budget: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    verify: bool = False,
    measure_time: bool | None = None,
    blocks: list[str] | None = None,
    self_check: bool = True,
    world_size: int | None = None,
    mesh: Any = None,
    sharding: str | None = None,
    sharding_options: dict | None = None,
    compiler: str = "eager",
) -> nn.Module:
    """Return a drop-in module whose training step fits ``budget_gb``.

    Parameters
    ----------
    model : torch.nn.Module
        In training mode. Not changed: the returned module shares its parameters and
        buffers (an optimizer built on ``model.parameters()`` keeps working) and has the
        same class, ``state_dict`` keys, forward signature and outputs.
    budget_gb : float
        Peak device memory of one training step in GiB (2**30 bytes): parameters,
        buffers, inputs, gradients, saved activations and temporaries, plus optimizer
        state when ``optimizer`` is given. With ``activation_budget=True`` it counts
        only what the step adds beyond parameters, buffers, inputs, optimizer state and
        gradients (activations and temporaries), for research. On real inputs in one
        process, planning runs one step of the plan under the live-tensor tracker;
        when it measures over the budget (an eager forward's temporaries, buffers a
        compiled segment allocates inside it), the plan is made again with what the
        step measured beyond its prediction held back (``report.checked_peak_bytes``).
    example_inputs : tuple or dict, optional
        Positional or keyword arguments of ``model``. Given: plan now (errors such as
        an infeasible budget are raised here, and the model is left untouched).
        Omitted: plan lazily on the first training call, from the real batch, and again
        whenever input shapes change (like ``torch.compile``).
    method : str
        A solver method (:func:`solver.methods`) or ``"auto"``; graph mode only.
    time_limit : float, optional
        Seconds for the solver.
    mode : {"graph", "module"}
        ``"graph"``: tensor level, exact (the forward keeps exactly the stored tensors,
        backward recomputes the rest). ``"module"``: layer level, wrapping the model's
        own blocks with non-reentrant ``torch.utils.checkpoint`` or selective
        checkpointing (the form trainers, FSDP2 and HF models compose with).
    activation_budget : bool
        Read ``budget_gb`` as an activation-only budget.
    optimizer : torch.optim.Optimizer, optional
        Its state counts in the budget.
    verify : bool
        Run one real training step (forward, loss, backward; gradients are restored
        afterwards) under the memory tracker and add the measured peak and step time to
        ``module.report``. Needs ``example_inputs``.
    measure_time : bool, optional
        Time every op on the real device for the cost model (default: when the inputs
        are real tensors).
    blocks : list of str, optional
        Candidate blocks for module mode (default: the children of the model's longest
        ModuleList/Sequential).
    self_check : bool
        Graph mode: before handing the rewrite out, run one step of it and one of the
        original on the example batch and compare loss and gradients; a schedule that
        fails is replaced by the next method (or an error is raised).
    world_size : int, optional
        Data-parallel ranks (default: the size of ``mesh``, else
        ``torch.distributed.get_world_size()``). Needs ``sharding``.
    mesh : DeviceMesh, optional
        1-D data-parallel mesh (FSDP2's ``mesh``; DDP uses its process group).
    sharding : {None, "ddp", "fsdp"}
        ``None``: one process. ``"ddp"``: every rank holds all parameters, gradients
        and optimizer state plus DDP's gradient buckets (one more copy of the
        gradients, none with ``gradient_as_bucket_view=True``), charged as fixed
        memory; graph and module mode; the module is returned wrapped in
        ``DistributedDataParallel``. ``"fsdp"`` (module mode only): a rank holds
        ``1/world_size`` of parameters, gradients and optimizer state, the whole
        parameters of the units being computed (and the one prefetched) and the whole
        gradients of the unit in backward (:func:`solver.distributed.rank_peak`); the
        plan is searched on that per-rank peak, each layer block becomes a
        ``fully_shard`` unit with its checkpoint inside, and ``model`` itself is
        returned, sharded in place. Both need ``example_inputs`` (the rank's local
        batch) and an initialized process group; the budget is per rank. Graph mode
        under FSDP2 and offload under FSDP2 raise
        :class:`graphs.distributed.DistributedPlanError` before anything is touched;
        ``activation_budget`` is refused under FSDP2. Build the optimizer on the
        returned module's parameters (under FSDP2 they are new ``DTensor``
        parameters); an ``optimizer`` passed here only declares its state, sharded
        under FSDP2. :func:`verify` is then collective (call it on every rank).
    sharding_options : dict, optional
        Keyword arguments of ``DistributedDataParallel`` or ``fully_shard``
        (``gradient_as_bucket_view``, ``bucket_cap_mb``, ``mp_policy``, ...).
    compiler : {"eager", "inductor"}
        Graph mode: how the scheduled forward and backward graphs run. ``"eager"``:
        plain fx code. ``"inductor"``: compiled by torch inductor in segments, cut so
        that inductor's fusion and reordering cannot take the step over the budget (a
        segment is taken to hold all it allocates until it ends, and the measured step
        of the plan checks what inductor allocates beyond that); random ops, and the
        ops where a segment would not fit, run as plain fx code. Compiling takes
        seconds to minutes on CPU and needs a C++ compiler there. Single process only.

    Returns
    -------
    torch.nn.Module
        With ``.report`` (a :class:`Report`) once planned. In ``eval()`` or under
        ``torch.no_grad()`` it runs the original forward: no recomputation.

    Raises
    ------
    InfeasibleBudget
        The budget is below the smallest feasible peak; the message names that peak.
    CaptureError
        Graph mode cannot capture the model; the message names the op or line and
        suggests ``mode="module"``.
    DistributedPlanError
        An unsupported ``(sharding, mode)`` pair (supported:
        :data:`graphs.distributed.SUPPORTED`), offload under FSDP2, or a world size
        that contradicts the mesh or the process group.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    >>> x = torch.randn(512, 64)
    >>> fast = optimize(net, 2.0, (x,), measure_time=False)
    >>> fast.report.predicted_peak_bytes <= fast.report.budget_bytes
    True
    >>> torch.equal(fast(x), net(x))
    True

    Data parallel (run on every rank, after ``init_process_group``; the batch is the
    rank's own)::

        model = optimize(model, 20.0, local_batch, mode="module", sharding="fsdp")
        opt = torch.optim.AdamW(model.parameters())
    """
    if mode not in ("graph", "module"):
        raise ValueError(f"mode must be 'graph' or 'module', got {mode!r}")
    if compiler not in COMPILERS:
        raise ValueError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    if compiler != "eager" and (mode != "graph" or sharding is not None):
        raise ValueError(f"compiler={compiler!r} compiles graph mode's scheduled graphs in one process; "
                         "use mode='graph' without sharding, or compiler='eager'")
    dp = _dist(sharding=sharding, mode=mode, world_size=world_size, mesh=mesh, options=sharding_options)
    if dp is not None:
        if example_inputs is None:
            raise ValueError(f"sharding={sharding!r} needs example_inputs (this rank's local batch): the plan is made "
                             "before the model is wrapped")
        if activation_budget and dp.sharding == "fsdp":
            raise ValueError("activation_budget=True is not available with sharding='fsdp' (a rank's fixed "
                             "memory changes during the step); give the whole per-rank budget")
        dp.require_process_group()
    try:
        budget_bytes = float(budget_gb) * GiB
    except (TypeError, ValueError):
        raise ValueError(f"budget_gb must be a number of GiB, got {budget_gb!r}") from None
    if not budget_bytes > 0 or math.isnan(budget_bytes):
        raise ValueError(f"budget_gb must be a positive number of GiB, got {budget_gb!r}")
    opt_bytes = optimizer_state_bytes(optimizer, model)
    state: dict[str, Any] = {"report": None}

    def plan(m: nn.Module, args: tuple, kwargs: dict):
        t0 = time.perf_counter()
        try:
            cg = capture(m, _capture_inputs(args, kwargs), backward="outputs", measure_time=measure_time,
                         inplace="functional" if mode == "graph" else "alias")
        except CaptureError as exc:
            if mode == "graph" and "mode='module'" not in str(exc):
                raise CaptureError(f"{exc} (graph mode needs one graph of the step; mode='module' "
                                   "plans at layer level instead)") from exc
            raise
        cg.meta["extra_fixed_bytes"] = opt_bytes + _SEED_RESERVE
        cg.meta["untracked_bytes"] = opt_bytes
        if dp is not None:
            dp.charge(cg, opt_bytes, state)
        if mode == "module":  # eager autograd; AOTAutograd's runtime materializes zero tangents
            _backward_from_loss(cg)
        capture_s = time.perf_counter() - t0
        store_all = simulate(cg, cg.order).peak_bytes
        budget = int(budget_bytes)
        act_budget = None
        if activation_budget:
            grads = sum(cg[v]["bytes"] for v in cg.ops if cg[v]["output"] and cg[v]["phase"] == "backward")
            act_budget = budget
            budget = budget + cg.fixed_bytes + grads
        t1 = time.perf_counter()
        if mode == "graph":
            def make(margin: int):
                return _plan_graph_checked(m, args, kwargs, cg, budget, act_budget, store_all, capture_s, t1,
                                           method, time_limit, state, compiler=compiler, self_check=self_check,
                                           margin=margin)

            def run(out):
                return lambda: out(m, args, kwargs)
        else:
            def make(margin: int):
                return _plan_module(m, cg, budget, act_budget, store_all, capture_s, t1, blocks, time_limit, state,
                                    dp=dp, opt_bytes=opt_bytes, margin=margin)

            def run(out):
                return lambda: apply_module_plan(m, out.actions).forward(*args, **kwargs)
        if dp is not None:  # a step runs collectives: verify() measures it on every rank
            out = make(0)
        else:
            out = _fit_measured(m, make, run, args, kwargs, budget, state)
        if dp is not None:
            dp.annotate(state["report"], state)
        if state.get("wrapper") is not None:
            state["wrapper"].report = state["report"]
        log.info("%s", state["report"])
        return out

    if mode == "graph":
        wrapper = wrap_graph_mode(model, lambda m, a, k: plan(m, a, k))
    else:
        wrapper = _LazyModuleMode(model, plan).module
    wrapper.__dict__["_remat_state"] = state
    state["wrapper"] = wrapper
    wrapper.report = None

    if dp is not None:
        args, kwargs = _split_inputs(example_inputs)
        wrapper = dp.plan_and_wrap(model, plan, mode, args, kwargs, blocks, state)
        if verify:
            _verify_into(wrapper, None, example_inputs, state["report"])
        return wrapper
    if example_inputs is not None:
        args, kwargs = _split_inputs(example_inputs)
        if mode == "graph":
            from graphs.graph_mode import input_signature

            step = plan(model, args, kwargs)
            wrapper.remat_steps[input_signature(args, kwargs)] = step
        else:
            wrapper.remat_plan_now(args, kwargs)
        if verify:
            _verify_into(wrapper, model, example_inputs, state["report"])
    elif verify:
        raise ValueError("verify=True needs example_inputs")
    return wrapper


def _dist(*, sharding: str | None, mode: str, world_size: int | None, mesh: Any,
          options: dict | None) -> "_DataParallel | None":
    """Read the data-parallel options of :func:`optimize`; refuse what cannot run before
    anything is captured or wrapped."""
    from graphs.distributed import DistributedPlanError, check_supported

    check_supported(sharding, mode)
    if sharding is None:
        given = [k for k, v in (("world_size", world_size), ("mesh", mesh), ("sharding_options", options))
                 if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without sharding: pass sharding='ddp' or 'fsdp'")
        return None
    if mesh is not None:
        if getattr(mesh, "ndim", 1) != 1:
            raise DistributedPlanError(f"remat plans data parallelism over a 1-D mesh; got a {mesh.ndim}-D mesh "
                                       "(pass the data-parallel sub-mesh, e.g. mesh['dp'])")
        n = int(mesh.size())
        if world_size is not None and int(world_size) != n:
            raise DistributedPlanError(f"world_size={world_size} contradicts the mesh of {n} ranks")
        world_size = n
    if world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedPlanError(f"sharding={sharding!r} needs an initialized process group "
                                       "(torch.distributed.init_process_group) or world_size=/mesh=")
        world_size = dist.get_world_size()
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return _DataParallel(sharding, int(world_size), mesh, dict(options or {}))


class _DataParallel:
    """The data-parallel setting of one :func:`optimize` call: what a rank is charged,
    how the plan is searched, and how the planned module is wrapped."""

    def __init__(self, sharding: str, world_size: int, mesh: Any, options: dict) -> None:
        self.sharding, self.world_size, self.mesh = sharding, world_size, mesh
        self.record_buckets = bool(options.pop("record_buckets", True))
        self.options = options
        self.fixed = None
        self.untracked = 0

    def require_process_group(self) -> None:
        import torch.distributed as dist

        from graphs.distributed import DistributedPlanError

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedPlanError(f"optimize(sharding={self.sharding!r}) wraps the model for this rank: "
                                       "call torch.distributed.init_process_group first")
        group = self.mesh.get_group() if self.mesh is not None else None
        n = dist.get_world_size(group)
        if n != self.world_size:
            raise DistributedPlanError(f"world_size={self.world_size} but the "
                                       f"{'mesh' if self.mesh is not None else 'default process group'} has {n} ranks")

    def charge(self, cg: ComputeGraph, opt_bytes: int, state: dict) -> None:
        """Put what a rank holds besides the captured step into the graph's fixed bytes."""
        from solver.distributed import rank_fixed_bytes, shard_bytes

        params = sum(cg[v]["bytes"] for v in cg.sources if cg[v].get("kind") == "param")
        grads = sum(cg[v]["bytes"] for v in cg.ops if cg[v]["output"] and cg[v]["phase"] == "backward")
        if self.sharding == "ddp":
            self.fixed = rank_fixed_bytes(world_size=self.world_size, sharding="ddp", param_bytes=params,
                                          grad_bytes=grads, optimizer_bytes=opt_bytes,
                                          gradient_as_bucket_view=bool(self.options.get("gradient_as_bucket_view")))
            cg.meta["extra_fixed_bytes"] += self.fixed.buckets
            cg.meta["untracked_bytes"] += self.fixed.buckets  # a planning step of the bare model has none
            # a tracker sees the buckets (recorded by the comm hook), not the optimizer state
            self.untracked = opt_bytes + _SEED_RESERVE + (0 if self.record_buckets else self.fixed.buckets)
        else:  # rank_peak shards parameters, gradients and the optimizer state itself
            cg.meta["extra_fixed_bytes"] = _SEED_RESERVE
            self.untracked = shard_bytes(opt_bytes, self.world_size) + _SEED_RESERVE

    def plan_fsdp(self, cg: ComputeGraph, budget: int, names: list, opt_bytes: int, time_limit):
        from solver.distributed import plan_modules_per_rank

        # selective checkpoint inside a unit measures above the simulator's prediction
        # (one recomputed activation more); plan with none / full until it is modelled
        mp, rp = plan_modules_per_rank(cg, budget, blocks=names, world_size=self.world_size, sharding="fsdp",
                                       units=names, optimizer_bytes=opt_bytes, actions=("none", "full"),
                                       time_limit=time_limit)
        self.fixed = rp.fixed
        return mp, rp

    def rank_store_all(self, view: ComputeGraph, names: list, opt_bytes: int) -> int:
        from solver.distributed import rank_peak
        from solver.module_plan import plan_schedule

        sched, _ = plan_schedule(view, {b: "none" for b in names})
        return rank_peak(view, sched.sequence, world_size=self.world_size, sharding="fsdp", units=names,
                         optimizer_bytes=opt_bytes).peak_bytes

    def annotate(self, report: Report, state: dict) -> None:
        report.sharding, report.world_size = self.sharding, self.world_size
        if self.fixed is not None:
            f = self.fixed
            report.rank_fixed = {"params": f.params, "grads": f.grads, "optimizer": f.optimizer, "buckets": f.buckets}
        report.untracked_bytes = int(self.untracked)

    def plan_and_wrap(self, model: nn.Module, plan: Callable, mode: str, args: tuple, kwargs: dict,
                      blocks: list[str] | None, state: dict) -> nn.Module:
        from graphs.distributed import apply_under_ddp, apply_under_fsdp, check_supported

        if self.sharding == "fsdp":
            mp = plan(model, args, kwargs)
            check_supported("fsdp", "module", mp.actions)
            out = apply_under_fsdp(model, mp.actions, mesh=self.mesh, units=blocks or layer_blocks(model),
                                   **self.options)
        else:
            if mode == "graph":
                from graphs.graph_mode import input_signature

                inner = wrap_graph_mode(model, lambda m, a, k: plan(m, a, k))
                inner.__dict__["_remat_state"] = state
                state["wrapper"] = inner
                inner.remat_steps[input_signature(args, kwargs)] = plan(model, args, kwargs)
            else:
                inner = _LazyModuleMode(model, plan).module
                inner.__dict__["_remat_state"] = state
                state["wrapper"] = inner
                inner.remat_plan_now(args, kwargs)
            inner.report = state["report"]
            opts = dict(self.options)
            if self.mesh is not None:
                opts.setdefault("process_group", self.mesh.get_group())
            out = apply_under_ddp(inner, record_buckets=self.record_buckets, **opts)
        out.__dict__["_remat_state"] = state
        out.report = state["report"]
        log.info("%s", state["report"])
        return out


def _plan_graph_checked(m, args, kwargs, cg, budget, act_budget, store_all, capture_s, t1, method, time_limit,
                        state, *, compiler, self_check, margin):
    """Graph mode's plan, its rewrite checked against the original's gradients."""
    out = _plan_graph(cg, budget, act_budget, store_all, capture_s, t1, method, time_limit, state,
                      compiler=compiler, margin=margin, original_peak=lambda: _measured_peak(
                          m, lambda: type(m).forward(m, *args, **kwargs), args, kwargs))
    if not isinstance(out, ScheduledStep) or not self_check or _checked(m, out, args, kwargs, cg, state):
        return out
    # a rewrite that does not give the model's gradients is never handed out
    first = state["report"].method
    if method == "auto":
        for fallback in ("order_search", "chain_dp", "checkpoint_all"):
            try:
                cand = _plan_graph(cg, budget, act_budget, store_all, capture_s, t1, fallback, time_limit, state,
                                   compiler=compiler, margin=margin)
            except RematError:
                continue
            if not isinstance(cand, ScheduledStep) or _checked(m, cand, args, kwargs, cg, state):
                state["report"].notes.append(f"the {first} schedule failed the gradient self-check; using {fallback}")
                return cand
    raise SolverError(f"the graph-mode rewrite ({first}) does not reproduce the model's gradients on the example "
                      "batch; use mode='module' (please report this)")


def _checked(m, step, args, kwargs, cg, state) -> bool:
    """Whether the rewrite reproduces the model's gradients; its measured peak (the same
    step) goes to the report."""
    same, peak = _reproduces(m, step, args, kwargs)
    if peak is not None:
        state["report"].checked_peak_bytes = peak + _untracked_bytes(cg)
    return same


def _plan_graph(cg, budget, act_budget, store_all, capture_s, t1, method, time_limit, state, *, compiler="eager",
                margin: int = 0, original_peak: Callable[[], int | None] | None = None):
    """Plan for ``budget - margin`` (``margin``: what a step measured beyond its plan);
    ``original_peak`` measures one eager step of the original model."""
    replay_random_ops(cg)  # the rewrite replays the generator state of a random op it runs again
    store_all = simulate(cg, cg.order).peak_bytes  # with the generator states it keeps
    target = budget - margin
    check_budget(cg, target)  # raises InfeasibleBudget naming the smallest feasible peak
    from solver.methods.minpeak import smallest_feasible_peak

    low = smallest_feasible_peak(cg)[0]
    if target >= store_all and method == "auto":
        schedule = solve(cg, target, method="store_all")
    else:
        schedule = solve(cg, target, method=method, time_limit=time_limit)
    eager = schedule.sequence == list(cg.order)  # the original forward runs it as it is
    checked = original_peak() if eager and original_peak is not None else None
    if checked is not None:
        checked += _untracked_bytes(cg)
    over = checked is not None and checked > budget
    eager = eager and not over  # else the captured store-all schedule, whose memory is the plan's
    schedule = _one_run_per_op(cg, schedule, target)  # (moves views: not a reason to rewrite)
    solve_s = time.perf_counter() - t1
    if eager:
        step = _EagerStep()
    else:
        step = ScheduledStep(cg, schedule.sequence, compiler=compiler,
                             headroom=_headroom(cg, schedule, target) if compiler != "eager" else 0)
    report = Report(
        mode="graph", method=schedule.method, budget_bytes=budget, predicted_peak_bytes=schedule.peak_bytes,
        store_all_peak_bytes=store_all, smallest_feasible_bytes=min(low, store_all),
        predicted_overhead=schedule.overhead, predicted_extra_seconds=_extra_seconds(cg, schedule), gap=schedule.gap,
        solve_seconds=solve_s, capture_seconds=capture_s,
        decisions=schedule.table(cg, limit=25), budget_kind="activations" if act_budget else "step",
        activation_budget_bytes=act_budget, recomputed=sum(1 for c in schedule.counts().values() if c > 1),
        graph=cg, schedule=schedule,
    )
    if eager and checked is not None:
        report.checked_peak_bytes = int(checked)
    if eager:
        report.notes.append("the store-all schedule fits: the step runs the original forward, no recomputation")
    elif over:
        report.notes.append("the store-all schedule fits, but the original forward measured over the budget (it "
                            "allocates temporaries the captured graph does not have): the step runs the captured "
                            "graph, no recomputation")
    elif compiler != "eager":
        n = step.inductor_graphs
        report.notes.append(f"{compiler} compiled {n.get('forward', 0)} segments of the forward graph and "
                            f"{n.get('backward', 0)} of the backward; the rest runs as plain fx code")
    state["report"] = report
    return step


def _extra_seconds(cg: ComputeGraph, schedule: Schedule) -> float | None:
    """Seconds of recomputation the schedule adds, when the op times are measured ones."""
    return schedule.extra_cost if cg.meta.get("time_source") == "measured" else None


def _headroom(cg: ComputeGraph, schedule: Schedule, budget: int) -> tuple[int, int]:
    """Bytes a compiler may add to the schedule's peak of the forward graph and of the
    backward graph without going over ``budget``."""
    curve = simulate(cg, schedule).memory_curve
    seq = schedule.sequence
    k = seq.index(BACKWARD_START) if BACKWARD_START in seq else len(seq)
    fw = int(curve[:k].max()) if k else 0
    bw = int(curve[k:].max()) if k < len(seq) else int(curve.max())
    return max(0, budget - max(fw, 0)), max(0, budget - bw)


def _not_real(args: tuple, kwargs: dict) -> bool:
    """Whether the example inputs are meta or fake tensors (nothing can run on them)."""
    flat = [t for t in (list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
    return any(t.device.type == "meta" or type(t).__name__ == "FakeTensor" for t in flat)


@contextlib.contextmanager
def _step_undone(model: nn.Module):
    """Run a training step whose effects are undone afterwards: gradients start as None and
    are put back as found, buffers (BatchNorm statistics) are restored, the RNG forked."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng():
            yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)


def _measured_peak(model: nn.Module, run: Callable[[], Any], args: tuple, kwargs: dict) -> int | None:
    """Peak bytes of one training step ``run()`` (forward, default loss, backward) of
    ``model``, measured by the live-tensor tracker; None for meta or fake inputs.
    Gradients, buffers and the RNG are left as found."""
    if _not_real(args, kwargs):
        return None  # nothing real to run
    with _step_undone(model), MemoryTracker(model, _capture_inputs(args, kwargs)) as tracker:
        out = run()  # held during backward, as verify does
        default_loss(out).backward()
        del out
    return int(tracker.peak_bytes)


def _fit_measured(model: nn.Module, make: Callable[[int], Any], run: Callable[[Any], Callable[[], Any]],
                  args: tuple, kwargs: dict, budget: int, state: dict, *, tries: int = 3) -> Any:
    """Plan, measure one step of the plan, and plan again with a margin while the
    measured peak is over ``budget``.

    The simulator counts the captured graph's values. A real step can allocate more: an
    eager forward's temporaries that capture decomposes away, the buffers a compiled
    segment allocates inside it. The margin is what the step measured beyond its plan.
    """
    out, margin = make(0), 0
    for attempt in range(tries):
        report = state["report"]
        extra = _untracked_bytes(report.graph)
        peak = report.checked_peak_bytes
        if peak is None:
            measured = _measured_peak(model, run(out), args, kwargs)
            if measured is None:
                return out
            peak = report.checked_peak_bytes = measured + extra
        if peak <= budget:
            if margin:
                report.notes.append(f"planned for {format_bytes(budget - margin)}: a step of the plan for the whole "
                                    f"budget measured {format_bytes(margin)} more than its prediction")
            return out
        if attempt == tries - 1:
            break
        margin = max(margin + peak - budget, peak - report.predicted_peak_bytes)
        try:
            out = make(margin)
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(budget, exc.smallest_feasible_bytes + margin,
                                   lower_bound_bytes=exc.lower_bound_bytes + margin, what="measured peak") from exc
    raise SolverError(f"a step of the plan measured {format_bytes(peak)} over the budget {format_bytes(budget)} "
                      f"after {tries} plans with a margin for what the step allocates beyond the captured graph; "
                      "ask for a larger budget")


def _reproduces(model: nn.Module, step: ScheduledStep, args: tuple, kwargs: dict) -> tuple[bool, int | None]:
    """One step of the rewrite against eager on the example batch: whether it gives the
    same loss and gradients (to float tolerance), and the rewrite's peak measured by the
    live-tensor tracker (None for meta or fake inputs). Gradients, buffers and the RNG
    are left as found."""
    if _not_real(args, kwargs):
        return True, None  # nothing real to run
    params = list(model.parameters())
    results = []
    tracker = MemoryTracker(model, _capture_inputs(args, kwargs))
    for run, tracked in ((lambda: step(model, args, kwargs), tracker),
                         (lambda: type(model).forward(model, *args, **kwargs), contextlib.nullcontext())):
        with _step_undone(model):
            torch.manual_seed(1234)
            with tracked:
                out = run()  # held during backward, as verify does
                loss = default_loss(out)
                loss.backward()
                del out
            results.append((loss.detach(), [None if p.grad is None else p.grad.detach().clone() for p in params]))
    (la, ga), (lb, gb) = results
    compiled = getattr(step, "compiler", "eager") != "eager"
    same = _close(la, lb, compiled) and all(_close(x, y, compiled) for x, y in zip(ga, gb))
    return same, int(tracker.peak_bytes)


def _close(x: torch.Tensor | None, y: torch.Tensor | None, compiled: bool) -> bool:
    """Equal to float tolerance. A compiled step reorders float reductions (fused batch
    norms over large batches): it is compared by norm, ``|x - y| <= 1e-2 |y|``, ten times
    the gap torch.compile itself shows against eager on a CNN's gradients."""
    if x is None or y is None:
        return x is None and y is None
    if not compiled:
        return torch.allclose(x, y, rtol=1e-3, atol=1e-5, equal_nan=True)
    diff = torch.linalg.vector_norm((x - y).double())
    return bool(diff <= 1e-2 * torch.linalg.vector_norm(y.double()) + 1e-6)


def _one_run_per_op(cg: ComputeGraph, schedule: Schedule, budget: int) -> Schedule:
    """Compute the outputs of a multi-output op in one run where the budget allows (a
    schedule that splits them would run the op again for each), and take the output
    gradients together where the backward starts and views where they are read, as the
    rewrite runs them."""
    from solver.plans import group_projection_runs, tangents_together, views_just_in_time
    from solver.registry import grade

    together = views_just_in_time(cg, tangents_together(cg, schedule.sequence))
    if together != schedule.sequence:  # never needs more memory at any step
        schedule = grade(cg, Schedule(sequence=together, method=schedule.method, lower_bound=schedule.lower_bound,
                                      info=dict(schedule.info)), budget, solve_seconds=schedule.solve_seconds)
    seq = group_projection_runs(cg, schedule.sequence)
    if seq == schedule.sequence:
        return schedule
    r = simulate(cg, seq)
    if not r.valid or r.peak_bytes > budget:
        return schedule
    regrouped = Schedule(sequence=seq, method=schedule.method, lower_bound=schedule.lower_bound,
                         info=dict(schedule.info, regrouped=True))
    return grade(cg, regrouped, budget, solve_seconds=schedule.solve_seconds)


class _EagerStep:
    """The original forward (the store-all schedule needs no rewrite)."""

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        return type(model).forward(model, *args, **kwargs)


def _plan_module(model, cg, budget, act_budget, store_all, capture_s, t1, blocks, time_limit, state, *,
                 dp=None, opt_bytes=0, margin: int = 0) -> ModulePlan:
    names = blocks or layer_blocks(model)
    if dp is not None and dp.sharding == "fsdp":
        # the whole-model fixed bytes are not what a rank holds: plan on the rank's peak
        mp, rp = dp.plan_fsdp(cg, budget, names, opt_bytes, time_limit)
        sched, cg, predicted = mp.schedule, mp.graph, rp.peak_bytes
        store_all = dp.rank_store_all(cg, names, opt_bytes)
    else:
        check_budget(cg, budget - margin)
        mp = plan_modules(cg, budget - margin, blocks=names, time_limit=time_limit)
        sched = mp.schedule
        cg = mp.graph  # random ops inside the blocks are recomputed there (RNG state restored)
        predicted = simulate(cg, sched).peak_bytes
    sched.budget_bytes = budget
    report = Report(
        mode="module", method="module_plan", budget_bytes=budget, predicted_peak_bytes=predicted,
        store_all_peak_bytes=store_all, smallest_feasible_bytes=min(store_all, predicted),
        predicted_overhead=sched.overhead, predicted_extra_seconds=_extra_seconds(cg, sched), gap=None,
        solve_seconds=time.perf_counter() - t1,
        capture_seconds=capture_s, decisions=mp.table(), budget_kind="activations" if act_budget else "step",
        activation_budget_bytes=act_budget, graph=cg, schedule=sched,
    )
    state["report"] = report
    return mp


class _LazyModuleMode:
    """Module mode with planning on the first training call (per input signature)."""

    def __init__(self, model: nn.Module, plan: Callable) -> None:
        from graphs.graph_mode import input_signature

        self.model, self._plan = model, plan
        self.plans: dict[tuple, dict[str, str]] = {}
        wrapper = copy.copy(model)
        original_forward = type(model).forward
        this = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            if wrapper.training and torch.is_grad_enabled():
                key = input_signature(args, kwargs)
                if key not in this.plans:
                    this.plan_now(args, kwargs, key=key)
                inner = this.wrapped[key]
                return inner.forward(*args, **kwargs)
            return original_forward(wrapper, *args, **kwargs)

        self.wrapped: dict[tuple, nn.Module] = {}
        wrapper.forward = forward
        wrapper.remat_plan_now = self.plan_now
        self.module = wrapper

    def plan_now(self, args: tuple, kwargs: dict, *, key: tuple | None = None) -> None:
        from graphs.graph_mode import input_signature

        key = key or input_signature(args, kwargs)
        mp = self._plan(self.model, args, kwargs)
        self.plans[key] = mp.actions
        self.wrapped[key] = apply_module_plan(self.model, mp.actions)
        self.module.remat_plan = mp.actions


def _call(module: nn.Module, inputs: Any) -> Any:
    args, kwargs = _split_inputs(inputs)
    return module(*args, **kwargs)


def _step_seconds(modules: list[nn.Module], inputs: Any, loss_fn, *, repeats: int = 3) -> list[float]:
    """Median seconds of a training step of each module, the modules stepped in turn so
    that every median sees the same load of the machine."""
    times: list[list[float]] = [[] for _ in modules]
    for _ in range(repeats):
        for module, acc in zip(modules, times):
            for p in module.parameters():
                p.grad = None
            t0 = time.process_time()
            loss_fn(_call(module, inputs)).backward()
            acc.append(time.process_time() - t0)
    return [statistics.median(t) for t in times]


def verify(module: nn.Module, example_inputs: Any, *, loss_fn: Callable | None = None,
           original: nn.Module | None = None, repeats: int = 3) -> Report:
    """Run real training steps of an optimized module and measure them.

    Adds the measured peak (one step, gradients initially None, under
    :class:`graphs.memory.MemoryTracker`; on CUDA also ``max_memory_allocated``; for a
    data-parallel module, :class:`graphs.distributed.RankMemoryTracker` over the rank's
    local tensors, :func:`graphs.distributed.rank_tensors`: call it on every rank) and the
    median step time (process CPU time on CPU) to ``module.report``; with ``original``,
    also the original module's step time (the two stepped in turn) and peak, and
    ``report.predicted_step_ratio``. Gradients present before the call are restored
    afterwards.

    Parameters
    ----------
    module : torch.nn.Module
        Returned by :func:`optimize`.
    example_inputs : tuple or dict
    loss_fn : callable, optional
        Output -> scalar loss (default :func:`graphs.capture.default_loss`).
    original : torch.nn.Module, optional
        The model before optimization, to time side by side.
    repeats : int
        Timed steps (median) after one warm-up.

    Returns
    -------
    Report
    """
    state = module.__dict__.get("_remat_state")
    if state is None:
        raise ValueError("verify() takes a module returned by solver.optimize")
    report = state.get("report")
    if original is not None and report is not None and report.sharding:
        raise ValueError("original= is not available for a data-parallel module (its step runs collectives); "
                         "verify it without original")
    return _verify_into(module, original, example_inputs, state.get("report"), loss_fn=loss_fn, repeats=repeats)


def _verify_into(module, original, example_inputs, report, *, loss_fn=None, repeats: int = 3) -> Report:
    loss_fn = loss_fn or default_loss
    params = list(module.parameters())
    saved_grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    try:
        if report is None:  # lazy plan: the first call plans
            with torch.random.fork_rng():
                loss_fn(_call(module, example_inputs)).backward()
            report = module.__dict__["_remat_state"]["report"]
        for p in params:
            p.grad = None
        loss_fn(_call(module, example_inputs)).backward()  # warm-up
        for p in params:
            p.grad = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if report.sharding:  # local shards and buckets; FSDP2 frees by resizing storages
            from graphs.distributed import RankMemoryTracker, rank_tensors

            a, k = _split_inputs(example_inputs)
            tracker = RankMemoryTracker(rank_tensors(module, extra=list(a) + list(k.values())))
            untracked = report.untracked_bytes or 0
        else:
            tracker = MemoryTracker(module, example_inputs)
            untracked = _untracked_bytes(report.graph)
        with tracker:
            out = _call(module, example_inputs)  # held during backward, as a training loop does
            loss_fn(out).backward()
            del out
        peak = tracker.peak_bytes + untracked
        if tracker.cuda_peak_bytes is not None:
            report.notes.append(f"CUDA max_memory_allocated {format_bytes(tracker.cuda_peak_bytes)}")
        report.measured_peak_bytes = int(peak)
        if original is None:
            (report.measured_step_seconds,) = _step_seconds([module], example_inputs, loss_fn, repeats=repeats)
        else:
            oparams = list(original.parameters())
            osaved = [p.grad for p in oparams]
            obuffers = [(b, b.detach().clone()) for b in original.buffers()]
            for p in params + oparams:
                p.grad = None
            loss_fn(_call(original, example_inputs)).backward()  # warm-up
            report.measured_step_seconds, report.original_step_seconds = _step_seconds(
                [module, original], example_inputs, loss_fn, repeats=repeats)
            for p in params + oparams:
                p.grad = None
            with MemoryTracker(original, example_inputs) as t2:
                out = _call(original, example_inputs)
                loss_fn(out).backward()
                del out
            for p, g in zip(oparams, osaved):
                p.grad = g
            with torch.no_grad():
                for b, saved in obuffers:
                    b.copy_(saved)
            report.original_peak_bytes = int(t2.peak_bytes + _untracked_bytes(report.graph))
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
        torch.set_rng_state(rng)
    if report.measured_peak_bytes > report.budget_bytes:
        log.warning("measured peak %s exceeds the budget %s", report.measured_peak_bytes, report.budget_bytes)
    return report

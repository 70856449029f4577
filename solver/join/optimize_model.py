"""``optimize(model, budget_gb)``: a drop-in module whose training step fits the budget.

This is the one place where the solvers meet torch, read top to bottom:

1. read and check every option (:func:`_read_options`; the budget as one
   :class:`solver.budget.Budget`; data parallelism: :mod:`solver.join.data_parallel`), and
   refuse a budget below what every step holds, before any capture
   (:func:`refuse_below_resident`);
2. wrap the model in the one lazy drop-in module (:func:`graphs.planned.wrap_planned`),
   whose planner (:func:`solver.join.planning.plan_step`) captures the step
   (:func:`graphs.capture`), charges what it holds besides its graph
   (:mod:`solver.join.fixed`), solves a schedule under the budget (:func:`solver.solve`),
   builds the rewrite at tensor level (``mode="graph"``, :mod:`graphs.graph_mode`) or
   layer level (``mode="module"``, :mod:`graphs.module_mode`), checks it on the example
   batch (:mod:`solver.join.checks`: gradients, measured peak, replan) and writes the
   :class:`solver.report.Report`;
3. plan now when example inputs are given, else on the first training call;
4. optionally :func:`solver.join.verification.verify` one real step.

Data parallelism (``sharding="ddp"`` or ``"fsdp"``): the budget and every figure of
the report are per rank; the plan is made on the rank's own step (its local batch) with
the resident memory of a rank (:mod:`solver.distributed`), and the returned module is
ready to train on that rank (wrapped in ``DistributedDataParallel``, or sharded in place
with FSDP2's ``fully_shard``; :mod:`graphs.distributed`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
from torch import nn

from graphs.graph_mode import COMPILERS
from graphs.planned import wrap_planned
from solver.budget import OP_PART, Budget, real_number
from solver.join.checks import PlanningInputs, Session, split_inputs
from solver.join.data_parallel import data_parallel
from solver.errors import OptionError
from solver.join.families import plan_dynamic, resize_step
from solver.join.fixed import optimizer_state_bytes
from solver.join.planning import PLANNING_GAP_STEP_SHARE, PLANNING_GAP_TOLERANCE, Request, plan_step
from solver.report import Report
from solver.join.verification import SESSION, verify, verify_into
from solver.join.watch import WATCH

__all__ = ["optimize", "verify", "Report", "optimizer_state_bytes", "MODES"]

#: what ``optimize(mode=...)`` accepts: ``"auto"`` plans in graph mode and falls back to
#: module mode where graph mode cannot serve the model; the others pin their mode
MODES = ("auto", "graph", "module")


def optimize(
    model: nn.Module,
    budget_gb: float,
    example_inputs: Any = None,
    *,
    method: str = "auto",
    time_limit: float | None = None,
    gap_tolerance: float | None = None,
    mode: str | None = "auto",
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
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    watch: str = "auto",
    dynamic: bool | None = None,
    offload: bool = False,
) -> nn.Module:
    """Return a drop-in module whose training step fits ``budget_gb``.

    Every option is described at length in ``docs/guide.md``.

    Parameters
    ----------
    model : torch.nn.Module
        Not changed: the returned module shares its parameters and buffers and has the
        same class, ``state_dict`` keys, forward signature and outputs.
    budget_gb : float
        Peak device memory of one training step in GiB (2**30 bytes): parameters,
        buffers, inputs, gradients, saved activations and temporaries, plus optimizer
        state when ``optimizer`` is given (:class:`solver.budget.Budget`).
    example_inputs : tuple or dict, optional
        Arguments of ``model``. Given: plan now, on copies of them (errors are raised
        here, model and inputs untouched). Omitted: plan on the first training call.
    method : str
        A solver method (:func:`solver.methods`) or ``"auto"``; graph mode only.
    time_limit : float, optional
        Seconds for the solver.
    gap_tolerance : float, optional
        ``method="auto"`` stops once proven within this share of the least extra compute
        (default: 2 %, or 0.1 % of the step's compute, :mod:`solver.join.planning`).
    mode : {"auto", "graph", "module"}
        ``"graph"``: tensor level, exact. ``"module"``: layer level, the model's own
        blocks checkpointed (what trainers, FSDP2 and HF models compose with).
        ``"auto"`` (default; ``None`` means the same): graph mode, and module mode with a
        report note where graph mode cannot serve the model (submodule hooks, a failed
        self-check); a pinned ``"graph"`` raises there instead.
    activation_budget : bool
        Read ``budget_gb`` as activations and temporaries only, for research.
    optimizer : torch.optim.Optimizer, optional
        Its state counts in the budget.
    verify : bool
        Measure one real step into ``module.report`` (needs ``example_inputs``).
    measure_time : bool, optional
        Time every op on the device (default: when the inputs are real tensors).
    blocks : list of str, optional
        The layer blocks (default: :func:`graphs.module_mode.layer_blocks`).
    self_check : bool
        Graph mode: check the rewrite's loss and gradients against the original's.
    world_size, mesh, sharding, sharding_options
        Data parallelism, per rank (:mod:`solver.join.data_parallel`).
    compiler : {"eager", "inductor"}
        Graph mode: the scheduled graphs as fx code or compiled by inductor in segments.
    loss_fn : callable, optional
        The loss computed outside the model, ``loss_fn(output) -> scalar``.
    watch : {"auto", "first", "every", "off"}
        Which real steps are measured by the allocator (:mod:`solver.join.watch`).
    dynamic : bool, optional
        As ``torch.compile``'s: sizes go symbolic once they vary; ``True``: from the
        first call (graph mode); ``False``: a plan per signature (:mod:`solver.join.families`).
    offload : bool
        Graph mode, ``method="auto"``: values may go to host memory and back.

    Returns
    -------
    torch.nn.Module
        With ``.report`` (a :class:`Report`) once planned. In ``eval()`` or under
        ``torch.no_grad()`` it runs the original forward.

    Raises
    ------
    OptionError
        Before any work: an option of the wrong type or out of its range, a module
        returned by ``optimize`` already, or a ``torch.compile``'d module.
    InfeasibleBudget
        The budget is below the smallest feasible peak, which the message names; below
        what every step holds whatever its schedule, before any capture
        (:func:`refuse_below_resident`).
    CaptureError
        Graph mode cannot capture the model; the message suggests ``mode="module"``.
    DistributedPlanError
        An unsupported ``(sharding, mode)`` pair or world size, or offload under FSDP2.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    >>> x = torch.randn(512, 64)
    >>> fast = optimize(net, 2.0, (x,), measure_time=False)
    >>> fast.report.predicted_peak_bytes <= fast.report.budget_bytes, torch.equal(fast(x), net(x))
    (True, True)
    """
    budget, request = _read_options(
        model, budget_gb, planned_now=example_inputs is not None, method=method, time_limit=time_limit,
        gap_tolerance=gap_tolerance, mode=mode, activation_budget=activation_budget, optimizer=optimizer,
        verify=verify, measure_time=measure_time, blocks=blocks, self_check=self_check, world_size=world_size,
        mesh=mesh, sharding=sharding, sharding_options=sharding_options, compiler=compiler, loss_fn=loss_fn,
        watch=watch, dynamic=dynamic, offload=offload)
    _refuse_below_floor(model, budget, example_inputs, request=request)
    wrapper, session = _wrap(model, example_inputs, request=request, dynamic=dynamic)
    if verify:
        _verify_now(wrapper, example_inputs, session=session, original=None if request.dp else model)
    return wrapper


def _wrap(model: nn.Module, example_inputs: Any, *, request: Request,
          dynamic: bool | None) -> tuple[nn.Module, Session]:
    """The drop-in module with its planning session: planned now on ``example_inputs``
    when given (and, with data parallelism, wrapped for this rank), else lazily."""
    resizer = functools.partial(resize_step, request=request) if dynamic is not False else None
    session = Session(loss_fn=request.loss_fn)
    plan = plan_dynamic if dynamic else plan_step  # True: a family's first call planned with its sizes symbolic
    planner = functools.partial(plan, request=request, session=session)

    def copy_planner(copy: nn.Module) -> Any:  # a deep copy plans again, into its own report
        own = Session(modules=[copy], loss_fn=request.loss_fn)
        copy.report = None
        copy.__dict__[SESSION] = own
        return functools.partial(plan, request=request, session=own)

    if request.dp is not None:  # planned now, on this rank's batch, then wrapped for the rank
        args, kwargs = split_inputs(example_inputs)
        wrapper = request.dp.plan_and_wrap(model, planner=planner, args=args, kwargs=kwargs, blocks=request.blocks,
                                           session=session, copy_planner=copy_planner)
    else:
        wrapper = wrap_planned(model, planner, copy_planner=copy_planner, resizer=resizer)
        session.modules.append(wrapper)
        wrapper.report = None
        if example_inputs is not None:
            wrapper.remat_plan_now(*split_inputs(example_inputs))
    wrapper.__dict__[SESSION] = session
    return wrapper, session


def _verify_now(wrapper: nn.Module, example_inputs: Any, *, session: Session, original: nn.Module | None) -> None:
    """One real step of ``wrapper`` measured into its report, on copies of the inputs
    (as planning: the user's are not written)."""
    copies = PlanningInputs(*split_inputs(example_inputs))
    try:
        verify_into(wrapper, copies.kwargs if isinstance(example_inputs, dict) else copies.args,
                    session=session, original=original)
    finally:
        copies.release()


def _refuse_below_floor(model: nn.Module, budget: Budget, example_inputs: Any, *, request: Request) -> None:
    """Refuse, before any capture, a budget below what every step holds
    (:func:`refuse_below_resident`). Under FSDP2 a rank holds a shard of the
    parameters, not the model's: nothing is refused here."""
    if request.dp is not None and request.dp.sharding == "fsdp":
        return
    refuse_below_resident(model, budget, example_inputs, optimizer_bytes=request.optimizer_bytes,
                          eager_ops=request.compiler == "eager")


def resident_floor(model: nn.Module, example_inputs: Any = None, *, optimizer_bytes: int = 0) -> tuple[int, str]:
    """Bytes that every training step of ``model`` holds at its end, whatever its
    schedule, and what they are: each parameter and buffer (each storage once), the
    optimizer state, the example inputs, and a gradient for each trainable parameter
    that a forward on the example inputs reads (one run without gradients, on copies of
    the inputs; none counted without example inputs, or where that run fails).

    Examples
    --------
    >>> net = nn.Linear(256, 256)
    >>> resident_floor(net, (torch.randn(4, 256),))[0] == 2 * (256 * 256 + 256) * 4 + 4 * 256 * 4
    True
    """
    parts = _floor_parts(model, example_inputs, optimizer_bytes=optimizer_bytes, eager_ops=False)
    return sum(b for _, b in parts), _named(parts)


def step_floor(model: nn.Module, example_inputs: Any = None, *, optimizer_bytes: int = 0,
               eager_ops: bool = True) -> tuple[int, str]:
    """Bytes that every training step of ``model`` holds at some point, whatever its
    schedule, and what they are: :func:`resident_floor` (held at the step's end), or,
    where it is more, what holds while the forward's largest op runs: everything but
    the gradients, and that op's inputs and outputs (with ``eager_ops``: a step that runs
    the forward's ATen ops as they are, not fused by a compiler). Found with one forward
    of fake copies of the model on the example inputs, which allocates nothing
    (:func:`graphs.footprint.forward_footprint`). A budget below it is refused before
    any capture.

    Examples
    --------
    >>> wide = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    >>> x = torch.randn(2048, 256)
    >>> floor, what = step_floor(wide, (x,))
    >>> floor > resident_floor(wide, (x,))[0], what.endswith("(aten.relu.default): its inputs and outputs")
    (True, True)
    """
    parts = _floor_parts(model, example_inputs, optimizer_bytes=optimizer_bytes, eager_ops=eager_ops)
    return sum(b for _, b in parts), _named(parts)


def refuse_below_resident(model: nn.Module, budget: int | Budget, example_inputs: Any = None, *,
                          optimizer_bytes: int = 0, eager_ops: bool = False) -> None:
    """Raise :class:`solver.budget.BelowResident` (an :class:`solver.InfeasibleBudget`)
    before any capture when ``budget`` (bytes, or a :class:`Budget`) is below what every
    step holds whatever its schedule, naming that figure and its parts:
    :func:`resident_floor`, or with ``eager_ops`` :func:`step_floor`. An activation-only
    budget is never refused here. Without ``eager_ops`` the forward that finds which
    parameters get a gradient runs only where that decides the answer.

    Examples
    --------
    >>> net = nn.Linear(256, 256)
    >>> refuse_below_resident(net, 1 << 20, (torch.randn(4, 256),))
    >>> refuse_below_resident(net, 400 << 10, (torch.randn(4, 256),))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    solver.budget.BelowResident: budget 400.0 KiB (409600 B) is infeasible: every training step holds 518.0 KiB ...
    >>> wide = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    >>> refuse_below_resident(wide, 6 << 20, (torch.randn(2048, 256),), eager_ops=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    solver.budget.BelowResident: ... the largest op of the forward (aten.relu.default): its inputs and outputs 4.0 MiB; ...
    """
    budget = budget if isinstance(budget, Budget) else Budget(int(budget))
    if budget.activation_only:
        return
    parts = _resident_parts(model, example_inputs, optimizer_bytes=optimizer_bytes)
    budget.refuse_below(parts)  # nothing has run
    trainable = _nbytes([p for p in model.parameters() if p.requires_grad], set())
    fp = _footprint(model, example_inputs) if eager_ops and example_inputs is not None else None
    if fp is not None:
        budget.refuse_below(_with_footprint(model, parts, fp))
    elif budget.available_bytes < sum(b for _, b in parts) + trainable:  # (only then the forward runs)
        budget.refuse_below(parts + _gradient_part(model, example_inputs))


def _floor_parts(model: nn.Module, example_inputs: Any, *, optimizer_bytes: int,
                 eager_ops: bool) -> list[tuple[str, int]]:
    """:func:`step_floor`'s parts (``eager_ops``) or :func:`resident_floor`'s."""
    parts = _resident_parts(model, example_inputs, optimizer_bytes=optimizer_bytes)
    fp = _footprint(model, example_inputs) if eager_ops and example_inputs is not None else None
    if fp is None:
        return parts + _gradient_part(model, example_inputs)
    return _with_footprint(model, parts, fp)


def _with_footprint(model: nn.Module, parts: list[tuple[str, int]], fp: Any) -> list[tuple[str, int]]:
    """``parts`` and the larger of the gradients of the parameters the forward reads and
    its largest op's inputs and outputs (:class:`graphs.footprint.ForwardFootprint`)."""
    grads = _gradient_bytes(model, fp.parameters_read)
    if fp.largest_op_bytes > grads:
        return parts + [(f"{OP_PART} ({fp.largest_op}): its inputs and outputs", fp.largest_op_bytes)]
    return parts + ([(_GRADIENTS, grads)] if grads else [])


def _named(parts: list[tuple[str, int]]) -> str:
    names = [name for name, _ in parts]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _resident_parts(model: nn.Module, example_inputs: Any, *, optimizer_bytes: int) -> list[tuple[str, int]]:
    """What every step holds besides the gradients, by part: parameters and buffers,
    optimizer state, inputs (each storage once)."""
    from graphs.torch_internals import tree_leaves

    seen: set = set()
    parts = [("parameters and buffers", _nbytes(list(model.parameters()) + list(model.buffers()), seen))]
    if optimizer_bytes:
        parts.append(("optimizer state", int(optimizer_bytes)))
    if example_inputs is not None:
        inputs = [t for t in tree_leaves(split_inputs(example_inputs)) if isinstance(t, torch.Tensor)]
        parts.append(("inputs", _nbytes(inputs, seen)))
    return parts


_GRADIENTS = "the gradients of the parameters the forward reads"


def _gradient_part(model: nn.Module, example_inputs: Any) -> list[tuple[str, int]]:
    """The gradients of the trainable parameters that one forward on copies of
    ``example_inputs`` reads (:func:`graphs.planned.parameters_read`); none without
    inputs or where that forward cannot run."""
    from graphs.planned import parameters_read

    if example_inputs is None:
        return []
    copies = PlanningInputs(*split_inputs(example_inputs))
    try:
        read = parameters_read(model, copies.args, copies.kwargs)
    finally:
        copies.release()
    grads = _gradient_bytes(model, read or ())
    return [(_GRADIENTS, grads)] if grads else []


def _gradient_bytes(model: nn.Module, read: Any) -> int:
    return _nbytes([p for n, p in model.named_parameters() if p.requires_grad and n in read], set())


def _footprint(model: nn.Module, example_inputs: Any) -> Any:
    from graphs.footprint import forward_footprint

    args, kwargs = split_inputs(example_inputs)
    return forward_footprint(model, args, kwargs)


def _nbytes(tensors: list, seen: set) -> int:
    """Bytes of ``tensors``, each storage once (``seen`` carries the storages counted)."""
    total = 0
    for t in tensors:
        key = id(t) if t.device.type == "meta" or type(t).__name__ == "FakeTensor" else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _check_model(model: nn.Module) -> None:
    """Refuse, before any work, a model that no plan can serve."""
    from graphs.torch_internals import is_compiled_module

    if not isinstance(model, nn.Module):
        raise OptionError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_compiled_module(model):
        raise OptionError("the model is a torch.compile'd module: its forward runs Dynamo's compiled frame, which "
                          "a plan cannot rewrite; pass the uncompiled model to optimize and compile the module it "
                          "returns (torch.compile(solver.optimize(model, ...)))")
    if "remat_steps" in model.__dict__:
        raise OptionError("this module was returned by solver.optimize already; call optimize on the original "
                          "model (its plans are made per input signature and autocast state on their own)")
    if not any(p.requires_grad for p in model.parameters()):
        raise OptionError(f"{type(model).__name__} has no parameter that requires a gradient, so its training "
                          "step has no backward to plan; unfreeze parameters, or run it under torch.no_grad()")


def _check_options(model: nn.Module, *, mode: str, pinned: bool, method: Any, time_limit: Any,
                   gap_tolerance: Any, optimizer: Any, blocks: Any, verify: bool, planned_now: bool) -> None:
    """Refuse, before any work, the solver's options of the wrong type or out of range."""
    from solver.solving import methods

    if time_limit is not None and not (real_number(time_limit) and math.isfinite(time_limit) and time_limit > 0):
        raise OptionError(f"time_limit must be a positive, finite number of seconds (or None: the methods' "
                          f"own limits), got {time_limit!r}")
    if gap_tolerance is not None and not (real_number(gap_tolerance) and 0 <= gap_tolerance < 1):
        raise OptionError(f"gap_tolerance must be a fraction of the extra compute in [0, 1), got {gap_tolerance!r}")
    if not isinstance(method, str):
        raise OptionError(f"method must be a method name, got {type(method).__name__}")
    known = methods()
    if method not in known:
        raise OptionError(f"unknown method {method!r}; choose one of {', '.join(known)}")
    if method != "auto" and mode == "module" and pinned:
        raise OptionError(f"method={method!r} picks graph mode's solver; mode='module' plans per layer block "
                          "with its own search: leave method='auto', or use mode='graph'")
    if optimizer is not None and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")):
        raise OptionError(f"optimizer must be a torch.optim.Optimizer (its state counts in the budget), got "
                          f"{type(optimizer).__name__}: build it first, e.g. torch.optim.AdamW(model.parameters())")
    if blocks is not None:
        if isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks):
            raise OptionError(f"blocks must be a list of submodule names, got {blocks!r}")
        names = [n for n, _ in model.named_modules() if n]
        missing = [b for b in blocks if b not in set(names)]
        if missing:
            shown = ", ".join(names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "")
            raise OptionError(f"blocks names no submodule of {type(model).__name__}: {', '.join(missing)}; "
                              f"its submodules are: {shown}")
    if verify and not planned_now:
        raise OptionError("verify=True needs example_inputs (the step it measures)")


def _check_offload(request: Request, *, pinned: bool) -> None:
    """Refuse ``offload=True`` where nothing would offload, saying why."""
    from graphs.distributed import DistributedPlanError

    if request.dp is not None and request.dp.sharding == "fsdp":
        raise DistributedPlanError(
            "offload=True under FSDP2: module mode, the only mode there, checkpoints whole blocks and offloads "
            "nothing they save, and FSDP2's CPUOffloadPolicy moves parameters, not activations; plan without "
            "offload=True (or offload parameters with FSDP2's own policy)")
    if request.mode == "module" and pinned:
        raise OptionError("offload=True offloads graph mode's values; module mode checkpoints whole blocks and "
                          "offloads nothing: use mode='graph' or mode='auto'")
    if request.method != "auto":
        raise OptionError(f"offload=True lets method='auto' choose between offload and recomputation; "
                          f"method={request.method!r} plans as it is (method='offload' offloads without "
                          f"recomputing): drop offload=True or use method='auto'")


def _read_options(model: nn.Module, budget_gb: Any, *, planned_now: bool, method: Any, time_limit: Any,
                  gap_tolerance: Any, mode: Any, activation_budget: Any, optimizer: Any, verify: Any,
                  measure_time: Any, blocks: Any, self_check: Any, world_size: Any, mesh: Any, sharding: Any,
                  sharding_options: Any, compiler: Any, loss_fn: Any, watch: Any, dynamic: Any,
                  offload: Any) -> tuple[Budget, Request]:
    """The options of :func:`optimize`, every one checked here, before anything runs:
    the budget, resolved once, and what every plan is asked for. ``planned_now``:
    example inputs were given."""
    mode, pinned = _resolve_mode(mode)
    _check_model(model)
    budget = Budget.from_gb(budget_gb, activation_only=activation_budget)
    _check_options(model, mode=mode, pinned=pinned, method=method, time_limit=time_limit,
                   gap_tolerance=gap_tolerance, optimizer=optimizer, blocks=blocks, verify=verify,
                   planned_now=planned_now)
    if loss_fn is not None and not callable(loss_fn):
        raise OptionError(f"loss_fn must be a callable output -> scalar loss, got {type(loss_fn).__name__}")
    if watch not in WATCH:
        raise OptionError(f"watch must be one of {WATCH}, got {watch!r}")
    if compiler not in COMPILERS:
        raise OptionError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
    if compiler != "eager" and (mode != "graph" or sharding is not None):
        raise OptionError(f"compiler={compiler!r} compiles graph mode's scheduled graphs in one process; "
                         "use mode='graph' without sharding, or compiler='eager'")
    dp = data_parallel(sharding=sharding, mode=mode, world_size=world_size, mesh=mesh, options=sharding_options)
    if dp is not None:
        if not planned_now:
            raise OptionError(f"sharding={sharding!r} needs example_inputs (this rank's local batch): the plan is made "
                             "before the model is wrapped")
        if budget.activation_only and dp.sharding == "fsdp":
            raise OptionError("activation_budget=True is not available with sharding='fsdp' (a rank's fixed "
                             "memory changes during the step); give the whole per-rank budget")
        dp.require_process_group()
    opt_bytes = optimizer_state_bytes(optimizer, model)
    if dp is not None:
        dp.optimizer_bytes = opt_bytes
    if dynamic is not None and not isinstance(dynamic, bool):
        raise OptionError(f"dynamic must be None, True or False, got {dynamic!r}")
    if not isinstance(offload, bool):
        raise OptionError(f"offload must be True or False, got {offload!r}")
    request = Request(mode=mode, budget=budget.total_bytes, activation_budget=budget.activation_only, method=method,
                      time_limit=time_limit, compiler=compiler, self_check=self_check, blocks=blocks,
                      gap_tolerance=PLANNING_GAP_TOLERANCE if gap_tolerance is None else float(gap_tolerance),
                      gap_step_share=PLANNING_GAP_STEP_SHARE if gap_tolerance is None else 0.0,
                      measure_time=measure_time, optimizer_bytes=opt_bytes, dp=dp, loss_fn=loss_fn,
                      watch=watch, mode_pinned=pinned, offload=offload)
    if offload:
        _check_offload(request, pinned=pinned)
    return budget, request


def _resolve_mode(mode: Any) -> tuple[str, bool]:
    """The mode planned in first and whether it is pinned (no fallback to the other):
    ``"auto"`` (or ``None``, its former spelling) plans in graph mode, falling back."""
    if mode is None:
        mode = "auto"
    if not isinstance(mode, str) or mode not in MODES:
        raise OptionError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return ("graph", False) if mode == "auto" else (mode, True)



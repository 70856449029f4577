"""``optimize(model, budget_gb)``: a drop-in module whose training step fits the budget.

This is the one place where the solvers meet torch, read top to bottom:

1. read the options (:func:`_request`; data parallelism: :mod:`solver.data_parallel`);
2. wrap the model in the one lazy drop-in module (:func:`graphs.planned.wrap_planned`),
   whose planner (:func:`solver.planning.plan_step`) captures the step
   (:func:`graphs.capture`), charges what it holds besides its graph
   (:mod:`solver.fixed`), solves a schedule under the budget (:func:`solver.solve`),
   builds the rewrite at tensor level (``mode="graph"``, :mod:`graphs.graph_mode`) or
   layer level (``mode="module"``, :mod:`graphs.module_mode`), checks it on the example
   batch (:mod:`solver.checks`: gradients, measured peak, replan) and writes the
   :class:`solver.report.Report`;
3. plan now when example inputs are given, else on the first training call;
4. optionally :func:`solver.verification.verify` one real step.

Data parallelism (``sharding="ddp"`` or ``"fsdp"``): the budget and every figure of
the report are per rank; the plan is made on the rank's own step (its local batch) with
the resident memory of a rank (:mod:`solver.distributed`), and the returned module is
ready to train on that rank (wrapped in ``DistributedDataParallel``, or sharded in place
with FSDP2's ``fully_shard``; :mod:`graphs.distributed`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable

import torch
from torch import nn

from graphs.graph_mode import COMPILERS
from graphs.planned import wrap_planned
from graphs.units import GiB
from solver.checks import PlanningInputs, Session, split_inputs
from solver.data_parallel import data_parallel
from solver.errors import OptionError
from solver.families import resize_step
from solver.fixed import optimizer_state_bytes
from solver.planning import PLANNING_GAP_TOLERANCE, Request, plan_step
from solver.report import Report
from solver.verification import SESSION, verify, verify_into
from solver.watch import WATCH

__all__ = ["optimize", "verify", "Report", "optimizer_state_bytes"]


def optimize(
    model: nn.Module,
    budget_gb: float,
    example_inputs: Any = None,
    *,
    method: str = "auto",
    time_limit: float | None = None,
    gap_tolerance: float | None = None,
    mode: str | None = None,
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
    dynamic: bool = True,
    offload: bool = False,
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
        Planning runs on copies of them: the user's tensors keep their values (a model
        that writes into its input in place), ``.grad`` and version counters.
        Omitted: plan lazily on the first training call, from the real batch, and again
        whenever input shapes change (like ``torch.compile``).
    method : str
        A solver method (:func:`solver.methods`) or ``"auto"``; graph mode only.
    time_limit : float, optional
        Seconds for the solver.
    gap_tolerance : float, optional
        ``method="auto"``: it stops searching once its schedule is proven within this
        share of the least extra compute (``report.gap``). Default
        :data:`solver.planning.PLANNING_GAP_TOLERANCE` (2 %), twice
        :func:`solver.solve`'s 1 %: a plan's extra compute is predicted from op timings
        whose error is larger than that (see the constant); 0 searches until it is
        proven optimal or the search is spent.
    mode : {None, "graph", "module"}
        ``"graph"``: tensor level, exact (the forward keeps exactly the stored tensors,
        backward recomputes the rest). ``"module"``: layer level, wrapping the model's
        own blocks with non-reentrant ``torch.utils.checkpoint`` or selective
        checkpointing (the form trainers, FSDP2 and HF models compose with).
        ``None`` (default): graph mode, and module mode where graph mode cannot serve
        the model (a report note says why): a submodule has forward or backward hooks
        (a captured graph does not call submodules, so they would not fire), or no
        graph-mode schedule passes the gradient self-check. ``"graph"`` pins graph mode:
        those cases raise instead. Hooks on the model itself fire on every call in
        both modes; hooks on submodules fire in module mode, and those inside a
        checkpointed block fire again when backward recomputes it (as with
        ``torch.utils.checkpoint``). A graph-mode module refuses a call
        (:class:`graphs.planned.HookNotRun`) once a hook is added to a submodule.
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
        Module paths of the model's layer blocks, which module mode checkpoints and graph
        mode's per-block floor cuts at (default: the repeated layers that
        :func:`graphs.module_mode.layer_blocks` finds by structure, such as a
        transformer's layers or a ResNet's residual blocks).
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
    loss_fn : callable, optional
        The loss the training loop computes from the model's output, ``loss_fn(output)
        -> scalar`` (bind the targets: ``lambda out: F.cross_entropy(out.flatten(0, 1),
        targets.flatten())``). The plan then holds the loss's own memory (what it keeps
        for its backward, the output's gradient), measured on the example batch; the
        module is still called and the loss computed as before. Not needed when the
        model returns its loss (an HF model given ``labels``). Without it, and when the
        output is not a scalar, the report says the loss is outside the plan.
    watch : {"auto", "first", "every", "off"}
        When the returned module measures its real training step by the allocator, from
        its forward to the end of its backward, the loss included (one process):
        ``"auto"`` and ``"first"``, the first step of each plan (on CPU by the
        profiler's allocation events; on an accelerator by the allocator's own
        counters, without a synchronization or a reset of the peak statistics);
        ``"every"``, every step; ``"off"``, none. A step over the budget makes the next
        call plan again with the excess held back, with a warning and a report note
        (``report.step_peak_bytes``); the steps that are not measured run the plan alone.
    dynamic : bool
        One plan for a family of shapes, in the manner of ``torch.compile(dynamic=True)``
        (:mod:`solver.families`): a call whose inputs differ from a planned call's only in
        sizes (another sequence length or batch size), none larger, runs that plan's
        decisions: module mode and a plan that runs the original forward as they are,
        graph mode on the step captured again at the new sizes (nothing timed or
        solved). A call larger in some dimension than every planned call is planned
        once for its bucket: the dimensions that grew rounded up to a power of two, on
        the call's values repeated to those sizes. The first real step at each new size
        is measured by the allocator (``watch``) and planned again for its own sizes
        when it is over the budget. ``False``: a plan per input signature.
    offload : bool
        Graph mode with ``method="auto"``: values may also go to host memory and back
        where that is cheaper than recomputing them, at the host link's bandwidth as a
        few copies measure it (:mod:`solver.offloading`); a report note gives the bytes
        offloaded, the link time and how much of it hides behind compute. On CPU the
        host is emulated outside the allocator (:mod:`graphs.host_pool`).

    Returns
    -------
    torch.nn.Module
        With ``.report`` (a :class:`Report`) once planned. In ``eval()`` or under
        ``torch.no_grad()`` it runs the original forward: no recomputation.

    Raises
    ------
    OptionError
        Before any work: an option of the wrong type or out of its range (``budget_gb``
        not a positive number, a bool included; ``time_limit`` not a positive number of
        seconds; ``blocks`` naming no submodule; an unknown ``method``, or one given with
        ``mode="module"``; ``optimizer`` not an optimizer), a module returned by
        ``optimize`` already, or a ``torch.compile``'d module (pass the uncompiled model
        and compile the module returned).
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
    pinned = mode is not None  # None: graph mode, falling back to module mode
    mode = "graph" if mode is None else mode
    if mode not in ("graph", "module"):
        raise OptionError(f"mode must be None, 'graph' or 'module', got {mode!r}")
    _check_model(model)
    _check_options(model, budget_gb=budget_gb, mode=mode, pinned=pinned, method=method, time_limit=time_limit,
                   gap_tolerance=gap_tolerance, optimizer=optimizer, blocks=blocks, verify=verify,
                   planned_now=example_inputs is not None)

    request = _request(model, budget_gb, mode=mode, method=method, time_limit=time_limit,
                       gap_tolerance=gap_tolerance, compiler=compiler, activation_budget=activation_budget,
                       optimizer=optimizer, self_check=self_check, blocks=blocks, measure_time=measure_time, world_size=world_size, mesh=mesh,
                       sharding=sharding, sharding_options=sharding_options, planned_now=example_inputs is not None,
                       loss_fn=loss_fn, watch=watch)
    for name, value in (("dynamic", dynamic), ("offload", offload)):
        if not isinstance(value, bool):
            raise OptionError(f"{name} must be True or False, got {value!r}")
    if offload:
        _check_offload(request, pinned=pinned)
    request = dataclasses.replace(request, mode_pinned=pinned, offload=offload)
    resizer = functools.partial(resize_step, request=request) if dynamic else None
    session = Session(loss_fn=loss_fn)
    planner = functools.partial(plan_step, request=request, session=session)

    def copy_planner(copy: nn.Module) -> Any:  # a deep copy plans again, into its own report
        own = Session(modules=[copy], loss_fn=loss_fn)
        copy.report = None
        copy.__dict__[SESSION] = own
        return functools.partial(plan_step, request=request, session=own)

    if request.dp is not None:  # planned now, on this rank's batch, then wrapped for the rank
        args, kwargs = split_inputs(example_inputs)
        wrapper = request.dp.plan_and_wrap(model, planner=planner, args=args, kwargs=kwargs, blocks=blocks,
                                           session=session, copy_planner=copy_planner)
    else:
        wrapper = wrap_planned(model, planner, copy_planner=copy_planner, resizer=resizer)
        session.modules.append(wrapper)
        wrapper.report = None
        if example_inputs is not None:
            wrapper.remat_plan_now(*split_inputs(example_inputs))
    wrapper.__dict__[SESSION] = session
    if verify:  # on copies of the inputs, as planning: the user's are not written
        copies = PlanningInputs(*split_inputs(example_inputs))
        try:
            verify_into(wrapper, copies.kwargs if isinstance(example_inputs, dict) else copies.args,
                        session=session, original=None if request.dp else model)
        finally:
            copies.release()
    return wrapper


def resident_floor(model: nn.Module, example_inputs: Any = None, *, optimizer_bytes: int = 0) -> tuple[int, str]:
    """Bytes that every training step of ``model`` holds at its end, whatever its
    schedule, and what they are: each parameter and buffer (each storage once), the
    optimizer state, the example inputs, and a gradient for each trainable parameter
    that a forward on the example inputs reads (one run without gradients; none
    counted without example inputs, or where that run fails).

    Examples
    --------
    >>> net = nn.Linear(256, 256)
    >>> resident_floor(net, (torch.randn(4, 256),))[0] == 2 * (256 * 256 + 256) * 4 + 4 * 256 * 4
    True
    """
    from graphs.planned import parameters_read
    from graphs.torch_internals import tree_leaves

    def nbytes(tensors: Any) -> int:
        seen, total = set(), 0
        for t in tensors:
            key = id(t) if t.device.type == "meta" or type(t).__name__ == "FakeTensor" else t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    held = nbytes(list(model.parameters()) + list(model.buffers()))
    what = ["parameters and buffers"]
    if optimizer_bytes:
        held += optimizer_bytes
        what.append("optimizer state")
    read = None
    if example_inputs is not None:
        args, kwargs = split_inputs(example_inputs)
        held += nbytes([t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
        what.append("inputs")
        read = parameters_read(model, args, kwargs)
    if read:
        held += nbytes([p for n, p in model.named_parameters() if p.requires_grad and n in read])
        what.append("the gradients of the parameters the forward reads")
    return held, ", ".join(what[:-1]) + " and " + what[-1] if len(what) > 1 else what[0]


def refuse_below_resident(model: nn.Module, budget: int, example_inputs: Any = None, *,
                          optimizer_bytes: int = 0) -> None:
    """Raise :class:`solver.InfeasibleBudget` before any capture when ``budget`` bytes
    are below :func:`resident_floor`, naming that figure (no schedule goes below it)."""
    from solver.errors import InfeasibleBudget

    floor, what = resident_floor(model, example_inputs, optimizer_bytes=optimizer_bytes)
    if budget < floor:
        raise InfeasibleBudget(budget, floor, lower_bound_bytes=floor,
                               what=f"peak any schedule could reach (every training step holds its {what} at its "
                                    "end; checked before capture)")


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


def _number(value: Any) -> bool:
    """A real number (a bool is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_options(model: nn.Module, *, budget_gb: Any, mode: str, pinned: bool, method: Any,
                   time_limit: Any, gap_tolerance: Any, optimizer: Any, blocks: Any, verify: bool,
                   planned_now: bool) -> None:
    """Refuse, before any work, options of the wrong type or out of range."""
    from solver.solving import methods

    if not _number(budget_gb) or not math.isfinite(budget_gb) or budget_gb <= 0:
        raise OptionError(f"budget_gb must be a positive, finite number of GiB, got {budget_gb!r}")
    if time_limit is not None and not (_number(time_limit) and math.isfinite(time_limit) and time_limit > 0):
        raise OptionError(f"time_limit must be a positive, finite number of seconds (or None: the methods' "
                          f"own limits), got {time_limit!r}")
    if gap_tolerance is not None and not (_number(gap_tolerance) and 0 <= gap_tolerance < 1):
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
                          "offloads nothing: use mode='graph' or mode=None")
    if request.method != "auto":
        raise OptionError(f"offload=True lets method='auto' choose between offload and recomputation; "
                          f"method={request.method!r} plans as it is (method='offload' offloads without "
                          f"recomputing): drop offload=True or use method='auto'")


def _request(model: nn.Module, budget_gb: float, *, mode: str, method: str, time_limit: float | None,
             gap_tolerance: float | None,
             compiler: str, activation_budget: bool, optimizer: torch.optim.Optimizer | None, self_check: bool,
             blocks: list[str] | None, measure_time: bool | None, world_size: int | None, mesh: Any,
             sharding: str | None, sharding_options: dict | None, planned_now: bool,
             loss_fn: Callable[[Any], torch.Tensor] | None, watch: str) -> Request:
    """The options of :func:`optimize`, read and checked before anything is captured."""
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
        if activation_budget and dp.sharding == "fsdp":
            raise OptionError("activation_budget=True is not available with sharding='fsdp' (a rank's fixed "
                             "memory changes during the step); give the whole per-rank budget")
        dp.require_process_group()
    budget_bytes = float(budget_gb) * GiB
    opt_bytes = optimizer_state_bytes(optimizer, model)
    if dp is not None:
        dp.optimizer_bytes = opt_bytes
    return Request(mode=mode, budget=int(budget_bytes), activation_budget=activation_budget, method=method,
                   time_limit=time_limit, compiler=compiler, self_check=self_check, blocks=blocks,
                   gap_tolerance=PLANNING_GAP_TOLERANCE if gap_tolerance is None else float(gap_tolerance),
                   measure_time=measure_time, optimizer_bytes=opt_bytes, dp=dp, loss_fn=loss_fn,
                   watch=watch)

"""Planning one training step for :func:`solver.optimize`: capture it, charge what it
holds besides its graph, and solve a plan at tensor level (graph mode) or layer level
(module mode), each ending in a :class:`solver.report.Report` and a runnable step.

:func:`plan_step` is the planner the drop-in module calls once per input signature
(:func:`graphs.planned.wrap_planned`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from torch import nn

from graphs import CaptureError, ComputeGraph, RematError
from graphs.capture import capture
from graphs.frames import bound_until_return
from graphs.compute_graph import BACKWARD_START, repeated_note
from graphs.fixed import charge, fixed_charges
from graphs.loss import charge_loss
from graphs.memory import resident_bytes
from graphs.graph_mode import ScheduledStep
from graphs.module_mode import layer_blocks
from graphs.planned import ModuleStep
from graphs.repeated import capture_cut
from graphs.rewrite import replay_random_ops
from graphs.units import format_bytes
from solver.join.checks import (PlanningInputs, Session, fit_measured, inputs_key, loss_tangents, measured_peak,
                                self_check)
from solver.errors import InfeasibleBudget, SolverError
from solver.join.fixed import SEED_RESERVE, untracked_bytes
from solver.module_plan import hold_bound_values, hold_node_inputs, plan_modules
from solver.solving import checked_budget, reached_floor, solve
from solver.report import Report
from solver.schedule import Schedule
from solver.simulate import simulate
from solver.join.watch import WatchedStep

__all__ = ["Captured", "Request", "plan_step", "PLANNING_GAP_TOLERANCE"]

log = logging.getLogger(__name__)

#: ``auto``'s gap tolerance when it plans a model's step (twice :func:`solver.solve`'s; docs/tuning.md).
PLANNING_GAP_TOLERANCE = 0.02

#: ``auto`` also stops once proven within this share of the step's own compute, where the
#: extra compute is so small that 2 % of it is microseconds (docs/tuning.md).
PLANNING_GAP_STEP_SHARE = 0.001

#: graph mode's fallbacks, in order, for an ``auto`` schedule that fails the self-check
FALLBACKS = ("order_search", "chain_dp", "checkpoint_all")


@dataclass(frozen=True)
class Request:
    """What one :func:`solver.optimize` call asks of every plan it makes."""

    mode: str
    budget: int  # step bytes; an activation budget is read as ``activation_budget``
    activation_budget: bool = False
    method: str = "auto"
    time_limit: float | None = None
    gap_tolerance: float = PLANNING_GAP_TOLERANCE  # auto's
    gap_step_share: float = PLANNING_GAP_STEP_SHARE  # auto's; 0 where the caller set gap_tolerance
    compiler: str = "eager"
    self_check: bool = True
    blocks: list[str] | None = None
    measure_time: bool | None = None
    optimizer_bytes: int = 0
    dp: Any = None  # solver.join.data_parallel.DataParallel
    loss_fn: Callable[[Any], Any] | None = None  # the user's loss on the model's output
    watch: str = "auto"  # when the real step is measured (solver.join.watch.WATCH)
    mode_pinned: bool = False  # mode was given (not None): no fallback to the other mode
    offload: bool = False  # graph mode's auto may offload values to host memory (solver.join.offloading)


@dataclass(frozen=True)
class Captured:
    """One captured step, charged, with the budget it is planned for."""

    graph: ComputeGraph
    budget: int
    activation_budget: int | None
    store_all: int
    capture_seconds: float
    solve_start: float
    planning_peak: int | None = None  # the allocator's peak of the measuring run (untracked bytes included)
    measure_seconds: float = 0.0  # measuring op times and workspaces (measure_within)
    measured_with: tuple | None = None  # the schedule the measuring run ran (empty: costs carried, nothing ran)
    cut: Any = None  # graphs.repeated.CutCapture: ``graph`` was written from a capture of four layers
    block_seconds: dict | None = None  # module mode: one block's seconds under each action (measure_blocks)


def plan_step(model: nn.Module, args: tuple, kwargs: dict, *, request: Request, session: Session,
              held_back: int = 0, symbolic_sizes: dict | None = None, captured: ComputeGraph | None = None,
              like: ComputeGraph | None = None) -> Any:
    """Capture, solve and check one step of ``model`` on ``(args, kwargs)`` for the budget
    less ``held_back`` bytes; the step to run (graph mode: a
    :class:`graphs.graph_mode.ScheduledStep` or the eager forward; module mode: a
    :class:`graphs.planned.ModuleStep`), in one process watched on the real training
    step (:class:`solver.join.watch.WatchedStep`), its report in ``session``.

    A training step is planned, whatever mode the model is in now (a model in ``eval()``
    at optimize time trains later): every module is in training mode while planning and
    is put back as it was afterwards. Planning's own runs (capture, measurements, checks)
    are not training steps: the hooks of the model's modules do not fire in them.

    ``symbolic_sizes`` (graph mode): capture with these dimensions symbolic
    (:func:`graphs.capture.capture`), so that the plan's rewrite runs at any size there.
    ``captured``: plan this DAG instead of capturing (a symbolic capture's DAG at the
    call's sizes, :func:`graphs.symbolic.at_sizes`), its op costs carried from ``like``."""
    from graphs.torch_internals import forward_hooks, module_hooks_off

    hooked = forward_hooks(model, root=False)  # seen before planning's own runs turn them off
    # planning runs on copies of the inputs: the user's are never written, whatever the model does to its inputs
    session.inputs = inputs = PlanningInputs(args, kwargs)
    try:
        with training_mode(model) as was_eval, module_hooks_off(model):
            step, held_back = _plan_step(model, inputs.args, inputs.kwargs, request=request, session=session,
                                         held_back=held_back, hooked=hooked, symbolic_sizes=symbolic_sizes,
                                         captured=captured, like=like)
    finally:
        session.inputs = None
        inputs.release()
    if was_eval:
        session.report.notes.append("planned for training: the model was in eval() when planned, and is again")
    if request.dp is not None:  # a step runs collectives: verify() measures it on every rank
        return step

    def replan(more: int) -> WatchedStep:
        return plan_step(model, args, kwargs, request=request, session=session, held_back=more)

    return WatchedStep(step, replan=replan, session=session, watch=request.watch, held_back=held_back)


@contextlib.contextmanager
def training_mode(model: nn.Module) -> Iterator[bool]:
    """Every module of ``model`` in training mode inside the block, each put back as it
    was after it; yields whether any module was in eval mode."""
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield not all(flag for _, flag in flags)
    finally:
        for m, flag in flags:
            m.training = flag


def _plan_step(model: nn.Module, args: tuple, kwargs: dict, *, request: Request, session: Session,
               held_back: int, hooked: list[str], symbolic_sizes: dict | None = None,
               captured: ComputeGraph | None = None, like: ComputeGraph | None = None) -> Any:
    t0 = time.perf_counter()
    # a plan before this one, of the same step at other sizes (a family's bucket) or for
    # another margin, prices this one: its measured op costs are carried, scaled
    if like is None:
        like = session.report.graph if session.report is not None else None
    given = captured is not None
    if given:  # a symbolic capture's DAG at the call's sizes: priced from it, nothing runs
        from graphs.measured import carry_costs

        carry_costs(like, captured, any_source=True)
        captured = given_step(captured, request=request)
    else:
        captured = capture_step(model, args, kwargs, request=request, symbolic_sizes=symbolic_sizes)
    # a real step of an earlier plan (another size) measured what the loss computed
    # outside the model allocates: this plan holds as much back, for its own outputs,
    # and 1 % of the budget, as the watch's replan does
    for_loss = session.held_for_loss(captured.graph)
    for_loss += captured.budget // 100 if for_loss else 0
    held_back = max(held_back, for_loss)
    cap = replace(captured, measured_with=()) if given else measure_within(
        captured, request=request, held_back=held_back, like=like, runs=measuring_runs(model, args, kwargs))
    session.saw(cap.planning_peak)
    if request.mode == "module":
        # the block seconds of an earlier plan whose op costs were carried are carried too
        carried = session.report.schedule.info.get("measured") if (
            cap.measured_with == () and session.report.schedule is not None) else None
        cap = measure_blocks(model, args, kwargs, cap=cap, request=request, carried=carried)
    if request.mode == "graph":
        switched: dict = {}  # once graph mode cannot serve this step, its plans for other margins are module mode's

        def make(margin: int) -> Any:
            return plan_graph_checked(model, args, kwargs, cap=cap, request=request, session=session, margin=margin,
                                      hooked=hooked, switched=switched)
    else:
        planned: list[int] = []  # the margins plans were made for

        def make(margin: int) -> Any:
            # a plan again for a larger margin: a step of the last measured over its
            # prediction; only the actions whose memory is predicted exactly are left
            exact = bool(planned) and margin > max(planned)
            step = plan_module(model, cap=cap, request=request, session=session, margin=margin,
                               actions=EXACT_ACTIONS if exact else None)
            planned.append(margin)
            if exact:
                session.report.notes.append("a step of a plan with selective checkpointing measured over its "
                                            "prediction: the plan checkpoints whole blocks or none")
            return step
    if request.dp is not None:  # a step runs collectives: verify() measures it on every rank
        step = make(0)
        request.dp.annotate(session.report)
    else:
        graph = GRAPH_RESERVE if cap.store_all > cap.budget else 0  # (the store-all step needs no reserve)
        reserve = int((MODULE_RESERVE if request.mode == "module" else graph) * cap.budget)
        # module mode's planner among given actions: the plans a refusal measures (the uniform ones among them)
        floors = ((lambda **given: plan_module(model, cap=cap, request=request, session=session, **given))
                  if request.mode == "module" else None)
        step = fit_measured(model, make=make, run=lambda s: lambda: s(model, args, kwargs), args=args,
                            kwargs=kwargs, budget=cap.budget, session=session, loss_fn=request.loss_fn,
                            held_back=held_back, reserve=reserve, floors=floors)
    report = session.report
    report.check_seconds = max(0.0, time.perf_counter() - t0 - report.capture_seconds - report.measure_seconds
                               - report.solve_seconds)
    loss_note(report, cap.graph, loss_fn=request.loss_fn)
    grads = fixed_charges(cap.graph).grads
    if grads:
        report.notes.append(f"the parameters held {format_bytes(grads)} of gradients when planned: the plan keeps "
                            "them through the step, as gradient accumulation does (call zero_grad(set_to_none=True) "
                            "before optimize() to plan without them)")
    if for_loss and for_loss == held_back:
        report.notes.append(f"planned for {format_bytes(cap.budget - held_back)}: {format_bytes(for_loss)} held back "
                            "for the loss computed outside the model, in proportion to its outputs, as a real step "
                            "of an earlier plan measured it")
    planning_note(report, cap, session)
    session.publish()
    log.info("%s", session.report)
    return step, held_back


def capture_step(model: nn.Module, args: tuple, kwargs: dict, *, request: Request,
                 symbolic_sizes: dict | None = None) -> Captured:
    """The captured step with its fixed charges, and the budget in step bytes. On real
    tensors nothing runs yet: times and workspaces are measured by
    :func:`measure_within`, in a schedule that fits. A model of more than five alike
    layers is captured on four of them (:func:`graphs.repeated.capture_cut`): in module
    mode for the DAG, in graph mode (eager, one process) for the joint graph too, which
    the step then runs."""
    t0 = time.perf_counter()
    options = dict(example_kwargs=kwargs, backward="outputs", measure_time=False, measure_workspace=False,
                   inplace="functional" if request.mode == "graph" else "alias")
    cut = None
    blocks = layer_blocks(model, blocks=request.blocks)
    if symbolic_sizes:  # the whole step, its rewrite run at any size of these dimensions
        options["symbolic_sizes"] = symbolic_sizes
    elif request.mode == "module" and request.dp is None:
        # a layer plan is priced on the DAG alone: alike middle layers are captured once
        cut = capture_cut(model, args, blocks=blocks, capture=capture, **options)
    elif request.dp is None and request.compiler == "eager":
        # graph mode runs the joint graph written from a capture of four alike layers
        cut = capture_cut(model, args, blocks=blocks, capture=capture, runnable=True, **options)
    try:
        cg = cut.whole if cut is not None else capture(model, args, **options)
    except CaptureError as exc:
        if request.mode == "graph" and "mode='module'" not in str(exc):
            raise CaptureError(f"{exc} (graph mode needs one graph of the step; mode='module' "
                               "plans at layer level instead)") from exc
        raise
    # the model's layers: checkpointing each is a schedule every plan is measured against
    # (solver.methods.blocks.per_block_schedule: auto's start, the smallest-feasible floor)
    cg.meta["layer_blocks"] = list(blocks)
    # gradients the model holds now (accumulation over micro-batches) stay through the step
    charge(cg, optimizer=request.optimizer_bytes, seed=SEED_RESERVE, grads=held_gradient_bytes(model))
    if request.loss_fn is not None:
        charge_loss(cg, request.loss_fn, outputs_of=cut.cut if cut is not None else None)
    if request.dp is not None:
        request.dp.charge(cg)
    if request.mode == "module":
        hold_node_inputs(cg)  # eager autograd frees a node's inputs once all its gradients are computed
        # a name in a block's forward holds its value until the forward returns (or its rerun stops)
        for v, module in bound_until_return(cg, model).items():
            cg[v]["held_by"] = module
        hold_bound_values(cg, blocks)
        if request.loss_fn is None:
            backward_from_loss(cg)  # eager autograd; AOTAutograd's runtime materializes zero tangents
    return given_step(cg, request=request, capture_seconds=time.perf_counter() - t0, cut=cut)


def given_step(cg: ComputeGraph, *, request: Request, capture_seconds: float = 0.0, cut: Any = None) -> Captured:
    """A captured and charged step's DAG with the budget in step bytes: what
    :func:`capture_step` gives, or a DAG planned without a capture (a symbolic
    capture's at other sizes, whose charges it carries)."""
    budget, act_budget = int(request.budget), None
    if request.activation_budget:
        act_budget = budget
        budget = budget + cg.fixed_bytes + cg.grad_bytes
    return Captured(graph=cg, budget=budget, activation_budget=act_budget, store_all=simulate(cg, cg.order).peak_bytes,
                    capture_seconds=capture_seconds, solve_start=time.perf_counter(), cut=cut)


#: per model, the schedules that measured its step's op costs, by the inputs' shapes:
#: ``(the allocator's peak of the run, the schedule)``, which :func:`measure_within` runs
#: again where one fits the target (a figure a refusal named is met again by the run
#: that made it, not by another schedule that fits only by the estimates)
_MEASURED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def measuring_runs(model: nn.Module, args: tuple, kwargs: dict) -> list:
    """The schedules that measured op costs of ``model``'s step on inputs of these
    shapes, with their peaks (a list :func:`measure_within` reads and adds to)."""
    return _MEASURED.setdefault(model, {}).setdefault(inputs_key(args, kwargs), [])


def _measured_fit(runs: list, graph: ComputeGraph, target: int) -> list | None:
    """The schedule of ``runs`` with the highest measured peak within ``target`` that is
    still a valid schedule of ``graph``; None where none is."""
    for peak, sequence in sorted(runs, key=lambda r: -r[0]):
        if peak <= target and all(v in graph.nx for v in sequence) and simulate(graph, sequence).valid:
            return list(sequence)
    return None


def measure_within(cap: Captured, *, request: Request, held_back: int = 0,
                   like: ComputeGraph | None = None, runs: list | None = None) -> Captured:
    """Measure the captured step's op workspaces (and times, unless
    ``request.measure_time`` is False) by running schedules of it
    (:func:`graphs.measured.measure_in_schedule`) that do not need the memory the plan
    is to save: the reference order where it fits well within the budget by the
    capture's estimates, otherwise one that does by them (:func:`lowest_peak_sequence`;
    the estimates of the workspaces can be low: the ops whose estimates are least reliable,
    :data:`graphs.measured.PROBED_OPS`, are measured alone first,
    :func:`graphs.measured.probe_workspaces`). One run measures the workspaces, the next the times (an op
    that the schedule runs again, or one like an op timed before, is timed once:
    :func:`graphs.costs.time_ops`). The returned capture carries the
    measured figures and the runs' peak. A DAG written from a capture of four alike
    layers (:func:`graphs.repeated.capture_cut`) is measured on that
    capture, every copy of a layer taking its template's figures, and the runs' peak
    counts the parameters of the layers not captured as resident beside it.
    ``held_back``: bytes of the budget a replan keeps back. Fake or meta tensors: as
    captured (roofline times, estimated workspaces). ``like``: a measured graph of the
    same step at other sizes (an earlier plan's); where every op of the capture is one
    of its ops, its figures are carried, scaled to the new sizes
    (:func:`graphs.measured.carry_costs`), and nothing runs: the plan's memory is
    judged by the allocator on its checked step as any plan's. ``runs``: the schedules
    that measured this step before, with their measured peaks
    (:func:`measuring_runs`): one that fits the target is run again before any schedule
    that fits only by the estimates, and the run made here is added."""
    from dataclasses import replace

    from graphs.measured import carry_costs, measure_in_schedule, probe_workspaces

    cg = cap.graph
    # a DAG written from a capture of four layers is measured on that capture, whose run
    # holds the parameters of four layers: the rest of the model's are resident beside it
    run_on, beside = (cap.cut.cut, cap.cut.resident_gap) if cap.cut is not None else (cg, 0)
    if not run_on.capture_info.real:
        if request.measure_time:
            raise CaptureError("measure_time=True needs real parameters and inputs; the model or inputs are "
                               "fake/meta (use measure_time=False for roofline times)")
        return cap
    t0 = time.perf_counter()
    if like is not None and request.measure_time is not False and carry_costs(like, cg):
        return replace(cap, store_all=simulate(cg, cg.order).peak_bytes, measure_seconds=time.perf_counter() - t0,
                       measured_with=(), solve_start=time.perf_counter())
    target, times = cap.budget - held_back, request.measure_time is not False
    # the cut capture carries none of the step's charges (optimizer state, loss, seed)
    more = beside + (cg.meta.get("extra_fixed_bytes", 0) if cap.cut is not None else 0)
    # the op families whose estimates are least reliable, measured alone first: a run of
    # one op and its inputs beside the resident values, no more than a step that runs it
    probed = probe_workspaces(run_on).peak_bytes
    store_all = simulate(run_on, run_on.order).peak_bytes + more  # by the capture's estimates
    offloads: list = []
    if store_all <= MEASURE_MARGIN * target:
        sequence = list(run_on.order)
    else:  # schedules of a view whose random ops may run again, as the rewrite replays them
        view = replayed_view(run_on)
        sequence = _measured_fit(runs or [], view, target) if cap.cut is None else None
        if sequence is None:
            sequence = lowest_peak_sequence(view, target=int(target - more))
        if request.offload and simulate(view, sequence).peak_bytes > target - more:
            # what no recomputation reaches is measured in a plan that offloads
            planned = offload_only(view, int(target - more), request=request)
            if planned is not None:
                sequence, offloads = planned.sequence, list(planned.offloads)
    peaks = [probed, measure_in_schedule(run_on, sequence, times=times, offloads=offloads).peak_bytes]
    if cap.cut is not None:
        cap.cut.copy_costs()
    judged = [p + untracked_bytes(cg) + beside for p in peaks if p is not None]
    if runs is not None and peaks[1] is not None and cap.cut is None and not offloads:
        runs.append((peaks[1] + untracked_bytes(cg), tuple(sequence)))
    return replace(cap, store_all=simulate(cg, cg.order).peak_bytes, measure_seconds=time.perf_counter() - t0,
                   planning_peak=max(judged) if judged else None,
                   measured_with=tuple(sequence) if cap.cut is None else None, solve_start=time.perf_counter())


def measure_blocks(model: nn.Module, args: tuple, kwargs: dict, *, cap: Captured, request: Request,
                   carried: dict | None = None) -> Captured:
    """``cap`` with the seconds of one forward and backward of the model's middle layer
    block under each of module mode's actions
    (:func:`graphs.module_mode.measure_block_actions`), which
    :func:`solver.module_plan.plan_modules` prices its selective plans from: what torch's
    selective-checkpoint dispatch costs on this machine, which the graph's op times
    leave out. Measured only where a plan is needed (the plain step's estimate is over
    :data:`MEASURE_MARGIN` of the budget), on real tensors, when op times are measured
    (``measure_time`` not False), without data parallelism, and where the model has two
    blocks or more; else ``cap`` as it is. One block's runs: about a step's time of
    a model of a few layers, less for more. ``carried``: the seconds measured for an
    earlier plan of the same step at other sizes, whose op costs were carried
    (:func:`measure_within`'s ``like``): taken as they are, nothing runs (the plan reads
    only their ratios, what a selective action adds to a block against checkpointing it
    whole)."""
    from dataclasses import replace

    from graphs.module_mode import measure_block_actions
    from solver.module_plan import DEFAULT_ACTIONS

    info = (cap.cut.cut if cap.cut is not None else cap.graph).capture_info
    if (request.dp is not None or request.measure_time is False or not getattr(info, "real", False)
            or cap.store_all <= MEASURE_MARGIN * cap.budget):
        return cap
    blocks = layer_blocks(model, blocks=request.blocks)
    if len(blocks) < 2:
        return cap
    if carried and all(a in carried for a in DEFAULT_ACTIONS):
        return replace(cap, block_seconds=dict(carried), solve_start=time.perf_counter())
    t0 = time.perf_counter()
    try:
        seconds = measure_block_actions(model, args, kwargs, block=blocks[len(blocks) // 2],
                                        actions=DEFAULT_ACTIONS, repeats=BLOCK_REPEATS, warmup=1)
    except RematError as exc:  # a block that does not run in the forward: priced from the graph alone
        log.info("module mode priced from the graph alone: %s", exc)
        return cap
    return replace(cap, block_seconds=seconds, measure_seconds=cap.measure_seconds + time.perf_counter() - t0,
                   solve_start=time.perf_counter())


#: runs of one block per action that :func:`measure_blocks` takes the median of
BLOCK_REPEATS = 3


#: module mode plans this fraction of the budget below it, so that the step that checks
#: a plan measures within the budget: its prediction of eager autograd's lifetimes is
#: within about 1 % (docs/tuning.md)
MODULE_RESERVE = 0.01

#: graph mode plans this fraction of the budget below it where a plan leaves room, so that
#: the step that checks a plan measures within it (a captured step measures up to a few
#: KiB over its simulation: the allocations of eager kernels the graph does not show)
GRAPH_RESERVE = 0.005

#: the reference order measures a step when its estimated peak is this far within the
#: budget: the capture's workspaces are estimates until measured
MEASURE_MARGIN = 0.9


def held_gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients the model's parameters hold now (each storage once)."""
    return resident_bytes([p.grad for p in model.parameters() if p.grad is not None])


def offload_only(cg: ComputeGraph, target: int, *, request: Request) -> Schedule | None:
    """With ``offload=True`` in graph mode's ``auto``, the plan that reaches ``target``
    by offloading where no recomputing schedule does
    (:func:`solver.join.offloading.reach_by_offload`); None otherwise."""
    if not (request.offload and request.method == "auto" and request.mode != "module"):
        return None
    from solver.join.offloading import reach_by_offload

    return reach_by_offload(cg, target, time_limit=request.time_limit)


def replayed_view(cg: ComputeGraph) -> ComputeGraph:
    """A copy of ``cg`` whose random ops may run more than once
    (:func:`graphs.rewrite.replay_random_ops`), with its costs as they are now."""
    from solver.module_plan import editable_copy

    view = editable_copy(cg)
    replay_random_ops(view)
    return view


def lowest_peak_sequence(cg: ComputeGraph, *, target: int | None = None) -> list:
    """A schedule of ``cg`` to measure a step in: with a ``target``, the first one
    found within :data:`MEASURE_MARGIN` x ``target`` bytes, else within ``target``, by
    eviction passes that do not stop early (quick ones first); where none is (or
    without a target), the lowest-peak schedule that
    :func:`solver.methods.minpeak.smallest_feasible_peak` finds in its time. Which
    schedule measures a step does not depend on the machine's load where a pass
    reaches the target, and a ``target`` that the search once reached (the figure an
    :class:`InfeasibleBudget` named) is reached again; the timed search runs only where
    no pass does.

    Examples
    --------
    >>> import solver
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(8)
    >>> roomy = solver.simulate(g, g.order).peak_bytes
    >>> lowest_peak_sequence(g, target=2 * roomy) == list(g.order)
    True
    """
    from solver.indexed import IndexedGraph
    from solver.methods.minpeak import min_peak_sequence, smallest_feasible_peak

    ix = IndexedGraph.of(cg)
    seq = None
    if target is not None:
        for aim, quick in ((int(MEASURE_MARGIN * target), True), (int(target), True), (int(target), False)):
            seq = min_peak_sequence(ix, aim, quick=quick)
            if seq is not None:
                break
    if seq is None:
        seq = min_peak_sequence(ix, smallest_feasible_peak(cg)[0])
    return [ix.ids[i] for i in seq] if seq is not None else list(cg.order)


def planning_note(report: Report, cap: Captured, session: Session) -> None:
    """Say in the report when op workspaces are estimates, and when planning's own runs
    peaked over the budget, by the allocator, and which."""
    if cap.cut is not None:
        written = "; the step's joint graph written from them" if cap.cut.template is not None else ""
        report.notes.append(f"{repeated_note(cap.graph)}; op times and workspaces measured on those layers{written}")
    if cap.measured_with == ():
        report.notes.append("op times and workspaces carried from an earlier plan's step at other sizes, scaled "
                            "(graphs.measured.carry_costs): nothing was measured again")
    if cap.graph.meta.get("workspace_source") == "estimated":
        report.notes.append("op workspaces are estimated per op family (fake or meta inputs; "
                            "graphs.costs.WORKSPACE_ESTIMATES): plan on a real batch to measure them")
    peak = session.planning_peak
    if peak is None or peak <= cap.budget:
        return
    if cap.planning_peak is not None and cap.planning_peak > cap.budget:
        why = (f"the run that measures op workspaces peaked at {format_bytes(cap.planning_peak)}: it ran a "
               "schedule that fits by the capture's estimates of the workspaces, which were low")
    else:
        why = "the gradient check or a measured step of a plan went over"
    report.notes.append(f"planning itself peaked at {format_bytes(peak)}, over the budget "
                        f"{format_bytes(cap.budget)}: {why}")


def gradient_reference(model: nn.Module, cap: Captured) -> tuple[Callable | None, str | None]:
    """The step a graph-mode rewrite is checked against within the budget, and a note.

    Always the model's own forward, which runs what a captured graph may not (the
    backward of its custom ``autograd.Function``\\ s): with every layer block
    checkpointed (:func:`solver.join.checks.reference_step`, the default, returned as
    ``None``); where that is predicted over the budget, the plain forward with what it
    saves for backward kept on disk (``reference_step(model, offload=True)``), whose
    device memory is about a forward's without autograd."""
    from solver.join.checks import reference_step
    from solver.module_plan import BlockIndex, checkpoint_view, plan_schedule

    written = cap.cut is not None and cap.cut.template is not None  # the whole step's graph runs
    if cap.measured_with is None and not written:  # nothing to check against but the checkpointed model
        return None, None
    cg = cap.graph
    blocks = layer_blocks(model)
    try:
        if blocks:
            view = checkpoint_view(cg, blocks)  # an index finds every block's nodes in one pass
            need = plan_schedule(view, {b: "full" for b in blocks}, index=BlockIndex(view, blocks))[0].peak_bytes
        else:
            need = cap.store_all
    except RematError:
        need = cap.store_all
    if need <= cap.budget:  # (it holds no gradients: the prediction, which counts them, leaves room)
        return None, None
    return reference_step(model, offload=True), (
        f"the gradient check compared the plan with the model's own step, with the tensors it saves for backward "
        f"kept on disk: the model with its blocks checkpointed needs {format_bytes(need)}, over the budget")


def loss_note(report: Report, cg: ComputeGraph, *, loss_fn: Callable[[Any], Any] | None) -> None:
    """Say in the report what the plan knows of the loss."""
    if loss_fn is not None:
        if cg.meta.get("loss") != "measured":
            report.notes.append(f"the loss's own memory is outside the plan: {cg.meta.get('loss')}")
        return
    if not returns_a_loss(cg):
        report.notes.append("the model returns no scalar loss: the loss computed from its output is outside the "
                            "plan (pass loss_fn= so that the plan holds its memory; the first real step is "
                            "measured and planned again if it does not fit)")


def returns_a_loss(cg: ComputeGraph) -> bool:
    """Whether one of the model's outputs is a scalar (a loss the step backpropagates)."""
    return bool(loss_tangents(cg)[0])


def backward_from_loss(cg: ComputeGraph) -> None:
    """When the model returns a scalar loss among its outputs (an HF ``ModelOutput`` with
    ``loss``), training steps call ``loss.backward()``: the other outputs' gradients never
    arrive, so their tangents take no memory. The outputs themselves stay resident (a
    training loop usually holds the output object during backward)."""
    scalar, tangents = loss_tangents(cg)
    if scalar and len(scalar) < len(tangents):
        for t in tangents:
            if t not in scalar:
                cg[t]["bytes"] = 0
        cg.meta["backward_from"] = "loss"


# ---------------------------------------------------------------- graph mode

def plan_graph_checked(model: nn.Module, args: tuple, kwargs: dict, *, cap: Captured, request: Request,
                       session: Session, margin: int, hooked: list[str] = (), switched: dict | None = None) -> Any:
    """Graph mode's plan, its rewrite checked against the original's gradients.

    Where graph mode cannot serve the model (a submodule carries hooks, which a captured
    graph would not run; no schedule passes the self-check), the plan is module mode's,
    with a note, unless ``request.mode_pinned``: then a :class:`SolverError` (hooks:
    :class:`graphs.planned.HookNotRun`) says what failed and suggests ``mode='module'``.
    ``switched``: kept across the plans of one capture (other margins), so that once
    graph mode has failed, the later plans are module mode's at once, on its capture: a
    refusal then names what module mode reaches, never a graph-mode figure that no
    checked rewrite runs.
    """
    from dataclasses import replace

    from graphs.planned import HookNotRun

    switched = {} if switched is None else switched

    def in_module_mode(why: str) -> Any:
        module_request = replace(request, mode="module")
        if "cap" not in switched:
            module_cap = measure_within(capture_step(model, args, kwargs, request=module_request),  # in-place: aliases
                                        request=module_request, held_back=margin)
            session.saw(module_cap.planning_peak)
            switched["cap"] = measure_blocks(model, args, kwargs, cap=module_cap, request=module_request)
        switched["why"] = why
        step = plan_module(model, cap=switched["cap"], request=module_request, session=session, margin=margin)
        session.report.notes.append(f"planned in module mode: {why} (mode='graph' raises instead)")
        return step

    if "why" in switched:
        return in_module_mode(switched["why"])

    if hooked:
        why = f"graph mode's captured step does not call submodules, so their hooks would not fire ({', '.join(hooked)})"
        if request.mode_pinned:
            raise HookNotRun(f"{why}; remove them, or use mode='module' (its steps call the submodules, and "
                             "their hooks fire)")
        return in_module_mode(why)

    def original_peak() -> int | None:
        peak = measured_peak(model, lambda: type(model).forward(model, *args, **kwargs), args, kwargs,
                             loss_fn=request.loss_fn, inputs=session.inputs)
        session.saw(None if peak is None else peak + untracked_bytes(cap.graph))
        return peak

    out = plan_graph(cap=cap, request=request, session=session, method=request.method, margin=margin,
                     original_peak=original_peak)
    functions = getattr(cap.graph.capture_info, "custom_functions", ())
    if isinstance(out, ScheduledStep) and functions:
        why = (f"the forward calls custom autograd Functions ({', '.join(functions)}): a captured step runs "
               "autograd's derivative of their forward's ops, not their own backward")
        if request.mode_pinned:
            raise CaptureError(f"{why}; use mode='module' (its steps run the model's own forward, and the "
                               "Functions' backward), or a budget that fits the plain step")
        return in_module_mode(why)
    if not isinstance(out, ScheduledStep) or not request.self_check:
        return out
    reference, why = gradient_reference(model, cap)

    def checked(step: Any) -> bool:
        if not isinstance(step, ScheduledStep):
            return True
        ok = self_check(model, step, args=args, kwargs=kwargs, session=session, loss_fn=request.loss_fn,
                        reference=reference)
        if ok and why:
            session.report.notes.append(why)
        return ok

    if checked(out):
        return out
    # a rewrite that does not give the model's gradients is never handed out
    first = session.report.method
    tried = [first]
    if request.method == "auto":
        for fallback in FALLBACKS:
            try:
                cand = plan_graph(cap=cap, request=request, session=session, method=fallback, margin=margin)
            except RematError:
                continue
            tried.append(fallback)
            if checked(cand):
                session.report.notes.append(f"the {first} schedule failed the gradient self-check; using {fallback}")
                return cand
    why = (f"the graph-mode rewrite ({', '.join(tried)}) did not reproduce the model's loss and gradients on the "
           "example batch")
    if request.mode_pinned:
        raise SolverError(f"{why}; use mode='module' (it checkpoints the model's own layer blocks), or "
                          "self_check=False to use the rewrite unchecked")
    return in_module_mode(why)


def plan_graph(*, cap: Captured, request: Request, session: Session, method: str, margin: int = 0,
               original_peak: Callable[[], int | None] | None = None) -> Any:
    """Plan for ``cap.budget - margin`` (``margin``: what a step measured beyond its
    plan) with ``method``; ``original_peak`` measures one eager step of the original
    model. The report goes to ``session``; returns the step."""
    cg = cap.graph
    replay_random_ops(cg)  # the rewrite replays the generator state of a random op it runs again
    store_all = simulate(cg, cg.order).peak_bytes  # with the generator states it keeps
    target = cap.budget - margin
    offload = request.offload and method == "auto"
    try:
        # raises InfeasibleBudget naming the smallest feasible peak and the bound
        checked_budget(cg, target, method=method, time_limit=request.time_limit)
        if target >= store_all and method == "auto":
            schedule = solve(cg, target, method="store_all")
        else:
            tolerance = ({"gap_tolerance": request.gap_tolerance, "gap_step_share": request.gap_step_share}
                         if method == "auto" else {})
            schedule = solve(cg, target, method=method, time_limit=request.time_limit, **tolerance)
    except InfeasibleBudget:
        schedule = offload_only(cg, target, request=request) if offload else None
        if schedule is None:
            raise
    if offload and not schedule.offloads:
        from solver.join.offloading import with_offload
        schedule = with_offload(cg, one_run_per_op(cg, schedule, target), target, time_limit=request.time_limit)
    eager = schedule.sequence == list(cg.order) and not schedule.offloads  # the original forward runs it as it is
    checked = original_peak() if eager and original_peak is not None else None
    if checked is not None:
        checked += untracked_bytes(cg)
    over = checked is not None and checked > cap.budget
    eager = eager and not over  # else the captured store-all schedule, whose memory is the plan's
    if not schedule.offloads:  # (its offloads name steps of its sequence as it is)
        schedule = one_run_per_op(cg, schedule, target)  # (moves views: not a reason to rewrite)
    solve_s = time.perf_counter() - cap.solve_start
    if eager:
        step = EagerStep()
    else:
        step = ScheduledStep(cg, schedule.sequence, compiler=request.compiler, offloads=schedule.offloads,
                             headroom=headroom(cg, schedule, target) if request.compiler != "eager" else 0)
    session.report = _graph_report(cap=cap, schedule=schedule, store_all=store_all, solve_seconds=solve_s)
    if schedule.offloads:
        from solver.join.offloading import offload_note
        session.report.notes.append(offload_note(cg, schedule))
    _graph_notes(session.report, step=step, eager=eager, over=over, checked=checked, compiler=request.compiler)
    return step


def _graph_report(*, cap: Captured, schedule: Schedule, store_all: int, solve_seconds: float) -> Report:
    from solver.methods.minpeak import smallest_feasible_peak

    cg = cap.graph
    # the plain step and checkpointing every block are reached whatever the time the search gets
    reached = min(reached_floor(cg), store_all, schedule.peak_bytes)  # the plan is a schedule too
    report = Report(
        mode="graph", method=schedule.method, budget_bytes=cap.budget, predicted_peak_bytes=schedule.peak_bytes,
        store_all_peak_bytes=store_all,
        smallest_feasible_bytes=reached,
        predicted_overhead=schedule.overhead, predicted_extra_seconds=extra_seconds(cg, schedule), gap=schedule.gap,
        solve_seconds=solve_seconds, capture_seconds=cap.capture_seconds, measure_seconds=cap.measure_seconds,
        decisions=schedule.table(cg, limit=25), budget_kind="activations" if cap.activation_budget else "step",
        activation_budget_bytes=cap.activation_budget,
        recomputed=sum(1 for c in schedule.counts().values() if c > 1), graph=cg, schedule=schedule,
    )
    # the timed search for a lower peak runs when the figure is read, not while planning waits
    report.defer("smallest_feasible_bytes", lambda: min(smallest_feasible_peak(cg)[0], reached))
    return report


def _graph_notes(report: Report, *, step: Any, eager: bool, over: bool, checked: int | None, compiler: str) -> None:
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


def extra_seconds(cg: ComputeGraph, schedule: Schedule) -> float | None:
    """Seconds of recomputation the schedule adds, when the op times are measured ones."""
    return schedule.extra_cost if cg.meta.get("time_source") == "measured" else None


def headroom(cg: ComputeGraph, schedule: Schedule, budget: int) -> tuple[int, int]:
    """Bytes a compiler may add to the schedule's peak of the forward graph and of the
    backward graph without going over ``budget``."""
    curve = simulate(cg, schedule).memory_curve
    seq = schedule.sequence
    k = seq.index(BACKWARD_START) if BACKWARD_START in seq else len(seq)
    fw = int(curve[:k].max()) if k else 0
    bw = int(curve[k:].max()) if k < len(seq) else int(curve.max())
    return max(0, budget - max(fw, 0)), max(0, budget - bw)


def one_run_per_op(cg: ComputeGraph, schedule: Schedule, budget: int) -> Schedule:
    """Compute the outputs of a multi-output op in one run where the budget allows (a
    schedule that splits them would run the op again for each), and take the output
    gradients together where the backward starts and views where they are read, as the
    rewrite runs them."""
    from solver.plans import group_projection_runs, tangents_together, views_just_in_time
    from solver.grading import grade

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


class EagerStep:
    """The original forward (the store-all schedule needs no rewrite)."""

    #: the step calls the model's submodules, so their hooks fire as in eager
    hooks_captured = False

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        return type(model).forward(model, *args, **kwargs)


# ---------------------------------------------------------------- module mode

#: module mode's actions whose memory the plan predicts within about 1 %: a block run as
#: it is, or checkpointed whole (``torch.utils.checkpoint``). What a selective policy
#: saves depends on how torch dispatches the block's ops (docs/tuning.md).
EXACT_ACTIONS = ("none", "full")


def plan_module(model: nn.Module, *, cap: Captured, request: Request, session: Session, margin: int = 0,
                actions: tuple[str, ...] | None = None) -> ModuleStep:
    """Module mode's plan for ``cap.budget - margin``: an action per layer block, among
    ``actions`` (default :data:`solver.module_plan.DEFAULT_ACTIONS`)."""
    from solver.module_plan import DEFAULT_ACTIONS

    names = request.blocks or layer_blocks(model)
    dp = request.dp
    budget, store_all = cap.budget, cap.store_all
    if dp is not None and dp.sharding == "fsdp":
        # the whole-model fixed bytes are not what a rank holds: plan on the rank's peak
        mp, rp = dp.plan_fsdp(cap.graph, budget, names=names, optimizer_bytes=request.optimizer_bytes,
                              time_limit=request.time_limit)
        sched, cg, predicted = mp.schedule, mp.graph, rp.peak_bytes
        store_all = dp.rank_store_all(cg, names=names, optimizer_bytes=request.optimizer_bytes)
    else:
        # no check_budget here: the graph's smallest peak is not a layer plan's, and
        # plan_modules names the smallest layer plan when none fits
        # selective checkpointing only where a block's run under it was measured: its
        # memory and its dispatch's time are not priced exactly from the graph alone
        mp = plan_modules(cap.graph, budget - margin, blocks=names, time_limit=request.time_limit,
                          measured=cap.block_seconds,
                          actions=actions or (DEFAULT_ACTIONS if cap.block_seconds else EXACT_ACTIONS))
        sched = mp.schedule
        cg = mp.graph  # random ops inside the blocks are recomputed there (RNG state restored)
        predicted = simulate(cg, sched).peak_bytes
    sched.budget_bytes = budget
    session.report = Report(
        mode="module", method="module_plan", budget_bytes=budget, predicted_peak_bytes=predicted,
        store_all_peak_bytes=store_all, smallest_feasible_bytes=min(store_all, predicted),
        predicted_overhead=sched.overhead, predicted_extra_seconds=extra_seconds(cg, sched), gap=None,
        solve_seconds=time.perf_counter() - cap.solve_start, capture_seconds=cap.capture_seconds,
        measure_seconds=cap.measure_seconds,
        decisions=mp.table(), budget_kind="activations" if cap.activation_budget else "step",
        activation_budget_bytes=cap.activation_budget, graph=cg, schedule=sched,
    )
    return ModuleStep(model, mp.actions, plan=mp)

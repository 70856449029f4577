"""One plan for a family of shapes: a plan's decisions run on inputs that differ from
its planned call only in sizes, none larger, and graph mode's plans on a capture with
symbolic sizes run larger ones too (:func:`graphs.planned.wrap_planned`'s ``resizer``;
:func:`solver.optimize`'s ``dynamic=True``).

What carries over, per kind of step:

- a module-mode step (an action per layer block) and the original forward (the
  store-all schedule fitted) run at any size as they are: nothing is captured or solved;
- a graph-mode step runs fx graphs specialized to their sizes. The first call of a
  family at new sizes is planned once more on a capture whose differing dimensions are
  symbolic (:func:`graphs.capture.capture`'s ``symbolic_sizes``; a
  :class:`SymbolicFamily`): that plan's rewrite runs at any size there. Every later call
  of the family, smaller or larger, takes the first of the family's symbolic plans whose
  sequence fits the budget at its sizes (the DAG's bytes evaluated there,
  :func:`graphs.symbolic.at_sizes`), or a plan solved at its sizes on that DAG, checked
  against the model's gradients on the call: no capture. Where the symbolic capture
  cannot be made (a model that specializes a size), the step is captured again at the
  new sizes instead (no op timed, nothing solved, no self-check: the schedule's
  decisions are the plan's, checked at its sizes), and the plan's sequence runs on it
  when the new graph has the same ops, named alike and wired alike.

Why the decisions still fit: the memory of the common layers grows with the sizes of
their inputs (every tensor of a smaller call is no larger than its counterpart), so
the plan's peak bounds the smaller call's. That is checked rather than assumed: a
graph-mode sequence is simulated at the call's sizes (on the symbolic capture's DAG
evaluated there, or on the new capture) and must fit the budget, and the
watch (:class:`solver.join.watch.WatchedStep`) measures the first real step at every new
size by the allocator; a step over the budget plans again for its own sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.graph_mode import ScheduledStep
from graphs.planned import ModuleStep, input_signature, size_family
from graphs.symbolic import at_sizes, call_sizes, is_symbolic
from graphs.torch_internals import tree_leaves
from solver.errors import InfeasibleBudget, OptionError
from solver.join.checks import PlanningInputs
from solver.schedule import Schedule
from solver.simulate import simulate
from solver.join.watch import WatchedStep

__all__ = ["plan_dynamic", "resize_step", "same_graph", "SymbolicFamily"]

log = logging.getLogger(__name__)


def same_graph(a: ComputeGraph, b: ComputeGraph) -> bool:
    """Whether two captures of one step hold the same ops, named alike, with the same
    targets and the same inputs: a schedule of one is a schedule of the other.

    Examples
    --------
    >>> from graphs.capture import capture
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> import torch
    >>> g = lambda n: capture(net, (torch.randn(n, 4),), backward="outputs", measure_time=False)
    >>> same_graph(g(2), g(5))
    True
    """
    if set(a.nx.nodes) != set(b.nx.nodes):
        return False
    for v in a.nx.nodes:
        x, y = a[v], b[v]
        if x.get("op") != y.get("op") or x.get("target") != y.get("target"):
            return False
        if set(a.nx.predecessors(v)) != set(b.nx.predecessors(v)):
            return False
    return True


@dataclass
class SymbolicFamily:
    """Graph mode's plans of one size family on a capture with symbolic sizes: the
    capture's DAG (at the sizes it was traced at) and the plans made on it, each
    ``(report, step)``, the step running at any size of the family."""

    graph: ComputeGraph | None = None
    plans: list = field(default_factory=list)
    failed: bool = False  # the symbolic capture could not be made: calls are captured at their sizes


def resize_step(model: nn.Module, step: Any, args: tuple, kwargs: dict, *, request: Any,
                larger: bool = False) -> Any:
    """``step``'s decisions for the call ``(args, kwargs)``, which is no larger than the
    call it was planned for in any dimension; None where they cannot run it (the call
    is then planned).

    Parameters
    ----------
    model : torch.nn.Module
    step : solver.join.watch.WatchedStep
        A plan's step (:func:`solver.join.planning.plan_step`); where the watch planned it
        again, the latest plan is used.
    args, kwargs
        The call.
    request : solver.join.planning.Request
    larger : bool
        The call is larger than every planned call of its family: run only by a
        graph-mode family's symbolic plans (None otherwise, and the caller plans it).

    Returns
    -------
    WatchedStep or None
        Watched as a plan of its own (its first real step is measured by default) and
        planned again, for its own sizes, when the allocator measures it over the
        budget.

    Examples
    --------
    >>> import torch, solver
    >>> net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    >>> fast = solver.optimize(net, 1.0, (torch.randn(32, 8),), measure_time=False)
    >>> _ = fast(torch.randn(16, 8)).sum().backward()
    >>> len(fast.remat_steps), fast.report.notes[-1].startswith("planned again")
    (2, False)
    """
    while isinstance(step, WatchedStep) and step._replaced is not None:
        step = step._replaced
    if not isinstance(step, WatchedStep):
        return None
    inner, report, session = step.step, step.report, step.session
    # graph mode's eager rewrites (the original forward, where the store-all step fits,
    # runs a smaller call as it is)
    rewritten = report is not None and report.mode == "graph" and report.graph is not None and symbolic_allowed(request)
    if rewritten and (larger or isinstance(inner, ScheduledStep)):
        symbolic = _symbolic_step(model, step, args, kwargs, request=request)
        if symbolic is not None or larger:
            return symbolic
    if larger:
        return None
    if isinstance(inner, ScheduledStep):
        inner = _recaptured(model, inner, args, kwargs, report=report, request=request, held_back=step.held_back)
    elif not (isinstance(inner, ModuleStep) or type(inner).__name__ == "EagerStep"):
        return None
    if inner is None:
        return None
    return _watched(model, inner, report, args, kwargs, request=request, session=session, held_back=step.held_back)


def _recaptured(model: nn.Module, inner: ScheduledStep, args: tuple, kwargs: dict, *, report: Any,
                request: Any, held_back: int) -> ScheduledStep | None:
    """The graph-mode step captured at the call's sizes running the plan's sequence, or
    None where the capture differs or the sequence does not fit there."""
    from graphs.rewrite import replay_random_ops
    from graphs.torch_internals import module_hooks_off
    from solver.join.planning import capture_step, headroom, training_mode

    schedule = getattr(report, "schedule", None)
    if report is None or report.graph is None or schedule is None:
        return None
    sequence = list(schedule.sequence)
    if [str(s) for s in sequence if s != BACKWARD_START] != inner.sequence:
        return None  # the report is not this step's plan
    inputs = PlanningInputs(args, kwargs)
    try:
        with training_mode(model), module_hooks_off(model):
            cap = capture_step(model, inputs.args, inputs.kwargs, request=request)
        cg = cap.graph
        replay_random_ops(cg)
        if not same_graph(report.graph, cg):
            log.info("the step captured at new sizes has other ops: planned again")
            return None
        target = cap.budget - held_back
        result = simulate(cg, sequence)
        if not result.valid or result.peak_bytes > target:
            log.info("the plan's sequence needs %s bytes at the new sizes (budget %s): planned again",
                     result.peak_bytes, target)
            return None
        room = (headroom(cg, Schedule(sequence=sequence, method=schedule.method), target)
                if inner.compiler != "eager" else 0)
        return ScheduledStep(cg, sequence, compiler=inner.compiler, headroom=room)
    finally:
        inputs.release()


def _differing_dims(graph: ComputeGraph, args: tuple, kwargs: dict) -> dict[int, tuple[int, ...]]:
    """Per tensor of the call (flattening order), the dimensions whose sizes differ
    from those of the call ``graph`` was captured on."""
    info = graph.capture_info
    if info is None:
        return {}
    flat = list(tree_leaves((args, kwargs)))
    dims: dict[int, tuple[int, ...]] = {}
    for k, shape in enumerate(graph.meta.get("input_shapes", [])):
        i = info.input_indices[k] if k < len(info.input_indices) else k
        t = flat[i] if i < len(flat) else None
        if isinstance(t, torch.Tensor) and shape is not None and t.dim() == len(shape):
            differ = tuple(d for d in range(t.dim()) if int(t.shape[d]) != shape[d])
            if differ:
                dims[i] = differ
    return dims


def _symbolic_step(model: nn.Module, step: WatchedStep, args: tuple, kwargs: dict, *, request: Any
                   ) -> WatchedStep | None:
    """The call's step from its family's plans on a capture with symbolic sizes
    (:class:`SymbolicFamily`), planning the first of them on this call where there is
    none; None where the family has no symbolic capture (it could not be made)."""
    from solver.join.planning import plan_step

    session, held_back = step.session, step.held_back
    family = _family_of(session, args, kwargs)
    if family.failed:
        return None
    if family.graph is None:
        dims = _differing_dims(step.report.graph, args, kwargs)
        if not dims:
            family.failed = True
            return None
        try:
            return _family_planned(model, args, kwargs, dims, family, request=request, session=session,
                                   held_back=held_back)
        except Exception as exc:  # the model specializes a size, or the budget does not take the call
            log.info("no plan with symbolic sizes %s (%s): the call is captured at its sizes", dims, exc)
            family.failed = True
            return None
    values = call_sizes(family.graph, args, kwargs)
    if values is None:
        return None
    try:
        sized = at_sizes(family.graph, values)
    except (TypeError, ValueError) as exc:  # a size the call's do not determine
        log.info("the family's symbolic capture does not size the call %s (%s)", values, exc)
        return None
    for report, inner in family.plans:
        sequence = list(report.schedule.sequence) if report.schedule is not None else sized.order
        result = simulate(sized, sequence)
        # what the plan's checked step measured beyond its prediction, at its own sizes,
        # comes on top of the prediction here too
        beyond = max(0, (report.checked_peak_bytes or report.predicted_peak_bytes) - report.predicted_peak_bytes)
        if result.valid and result.peak_bytes + beyond <= report.budget_bytes - held_back:
            return _watched(model, inner, report, args, kwargs, request=request, session=session,
                            held_back=held_back)
    try:
        made = plan_step(model, args, kwargs, request=request, session=session, held_back=held_back,
                         captured=sized, like=family.graph)
    except Exception as exc:
        log.info("no plan at sizes %s on the family's symbolic capture (%s)", values, exc)
        return None
    if made.report is not None and made.report.graph is not None and is_symbolic(made.report.graph):
        family.plans.append((made.report, made.step))
    return made


def _family_of(session: Any, args: tuple, kwargs: dict) -> SymbolicFamily:
    """The session's record of the call's size family (its signature without sizes)."""
    return session.families.setdefault(size_family(input_signature(args, kwargs)), SymbolicFamily())


def _family_planned(model: nn.Module, args: tuple, kwargs: dict, dims: dict, family: SymbolicFamily, *,
                    request: Any, session: Any, held_back: int) -> WatchedStep:
    """The family's first plan, on a capture of the call with ``dims`` symbolic; the
    family is marked failed where the plan is not a symbolic capture's (module mode
    after a failed check)."""
    from solver.join.planning import plan_step

    made = plan_step(model, args, kwargs, request=request, session=session, held_back=held_back,
                     symbolic_sizes=dims)
    if made.report is None or made.report.graph is None or not is_symbolic(made.report.graph):
        family.failed = True
        return made
    family.graph = made.report.graph
    family.plans.append((made.report, made.step))
    made.report.notes.append("planned on a capture with symbolic sizes: the family's later calls, smaller or "
                             "larger, run its plans without a capture (graphs.symbolic)")
    return made


def symbolic_allowed(request: Any) -> bool:
    """Whether the request's plans may be made on captures with symbolic sizes: graph
    mode (or auto) running its rewrite as fx code, one process, no offload."""
    return request.mode != "module" and request.compiler == "eager" and request.dp is None and not request.offload


def plan_dynamic(model: nn.Module, args: tuple, kwargs: dict, *, request: Any, session: Any) -> WatchedStep:
    """:func:`solver.optimize`'s ``dynamic=True``: the first call of a size family
    planned on a capture with every dimension of its tensors symbolic (those the
    forward ties to a constant stay static), as ``torch.compile(dynamic=True)`` traces,
    so that no later call of the family is captured; planned at its sizes alone where
    that capture cannot be made, or in module mode.

    Examples
    --------
    >>> import torch, solver
    >>> net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    >>> fast = solver.optimize(net, 1.0, measure_time=False, dynamic=True)
    >>> for n in (16, 32, 24):
    ...     fast(torch.randn(n, 8)).sum().backward()
    >>> from graphs.symbolic import is_symbolic
    >>> is_symbolic(fast.report.graph)  # the first call's capture, with its sizes symbolic
    True
    >>> len(fast.remat_steps), len({id(s.report) for s in fast.remat_steps.values()})  # 3 sizes, 1 plan
    (3, 1)
    """
    from solver.join.planning import plan_step

    family = _family_of(session, args, kwargs)
    dims = {i: tuple(range(t.dim())) for i, t in enumerate(tree_leaves((args, kwargs)))
            if isinstance(t, torch.Tensor) and t.dim() > 0}
    if symbolic_allowed(request) and dims and family.graph is None and not family.failed:
        try:
            return _family_planned(model, args, kwargs, dims, family, request=request, session=session, held_back=0)
        except (InfeasibleBudget, OptionError):
            raise
        except Exception as exc:  # the model specializes every size, or the symbolic trace fails
            log.info("no plan with symbolic sizes (%s): the call is planned at its sizes", exc)
            family.failed = True
    return plan_step(model, args, kwargs, request=request, session=session)


def _watched(model: nn.Module, inner: Any, report: Any, args: tuple, kwargs: dict, *, request: Any,
             session: Any, held_back: int) -> WatchedStep:
    """``inner``, a plan's step, watched for the call: measured on its first real step
    and planned again for the call's own sizes when over the budget."""
    from solver.join.planning import plan_step

    def replan(more: int) -> WatchedStep:
        return plan_step(model, args, kwargs, request=request, session=session, held_back=more)

    watched = WatchedStep(inner, replan=replan, session=session, watch=request.watch, held_back=held_back)
    watched.report = report
    return watched

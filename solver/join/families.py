"""One plan for a family of shapes: a plan's decisions run on inputs that differ from
its planned call only in sizes, none larger (:func:`graphs.planned.wrap_planned`'s
``resizer``; :func:`solver.optimize`'s ``dynamic=True``).

What carries over, per kind of step:

- a module-mode step (an action per layer block) and the original forward (the
  store-all schedule fitted) run at any size as they are: nothing is captured or solved;
- a graph-mode step runs fx graphs specialized to their sizes: the step is captured
  again at the new sizes (no op is timed, nothing is solved, no self-check: the
  schedule's decisions are the plan's, checked at its sizes), and the plan's sequence
  runs on it when the new graph has the same ops, named alike and wired alike.

Why the decisions still fit: the memory of the common layers grows with the sizes of
their inputs (every tensor of a smaller call is no larger than its counterpart), so
the plan's peak bounds the smaller call's. That is checked rather than assumed: a
graph-mode sequence is simulated on the new capture and must fit the budget, and the
watch (:class:`solver.join.watch.WatchedStep`) measures the first real step at every new
size by the allocator; a step over the budget plans again for its own sizes.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.graph_mode import ScheduledStep
from graphs.planned import ModuleStep
from solver.join.checks import PlanningInputs
from solver.schedule import Schedule
from solver.simulate import simulate
from solver.join.watch import WatchedStep

__all__ = ["resize_step", "same_graph"]

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


def resize_step(model: nn.Module, step: Any, args: tuple, kwargs: dict, *, request: Any) -> Any:
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
    from solver.join.planning import plan_step

    while isinstance(step, WatchedStep) and step._replaced is not None:
        step = step._replaced
    if not isinstance(step, WatchedStep):
        return None
    inner, report, session = step.step, step.report, step.session
    if isinstance(inner, ScheduledStep):
        inner = _recaptured(model, inner, args, kwargs, report=report, request=request, held_back=step.held_back)
    elif not (isinstance(inner, ModuleStep) or type(inner).__name__ == "EagerStep"):
        return None
    if inner is None:
        return None

    def replan(more: int) -> WatchedStep:
        return plan_step(model, args, kwargs, request=request, session=session, held_back=more)

    watched = WatchedStep(inner, replan=replan, session=session, watch=request.watch, held_back=step.held_back)
    watched.report = report
    return watched


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

"""Measured steps of a plan on the example batch: its peak, whether it reproduces the
model's gradients, and the replan loop when it measures over the budget.

Every step measured here leaves the model as found (:func:`step_undone`): gradients,
buffers (BatchNorm statistics) and the random generators.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from graphs import RematError
from graphs.capture import default_loss
from graphs.memory import AllocatorPeak, judge_available
from graphs.units import format_bytes
from solver.errors import InfeasibleBudget, SolverError
from solver.fixed import untracked_bytes
from solver.report import Report

__all__ = ["Session", "Reproduction", "fit_measured", "measured_peak", "reproduces", "self_check", "step_undone"]


@dataclass
class Session:
    """The planning state of one :func:`solver.optimize` call: the latest plan's report
    and the modules that show it as ``.report``."""

    report: Report | None = None
    modules: list = field(default_factory=list)
    loss_fn: Callable[[Any], Any] | None = None  # the user's loss, when optimize was given one
    planning_peak: int | None = None  # the highest allocator peak of planning's own runs

    def saw(self, peak: int | None) -> None:
        """Count the allocator's peak of one of planning's runs (None: not measured)."""
        if peak is not None:
            self.planning_peak = max(self.planning_peak or 0, int(peak))

    def publish(self) -> None:
        """Show the latest report on every module of the call."""
        if self.report is not None and self.planning_peak is not None:
            self.report.planning_peak_bytes = self.planning_peak
        for m in self.modules:
            m.report = self.report


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Positional and keyword arguments of the example inputs."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def not_real(args: tuple, kwargs: dict) -> bool:
    """Whether the example inputs are meta or fake tensors (nothing can run on them)."""
    flat = [t for t in (list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
    return any(t.device.type == "meta" or type(t).__name__ == "FakeTensor" for t in flat)


@contextlib.contextmanager
def step_undone(model: nn.Module):
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


def measured_peak(model: nn.Module, run: Callable[[], Any], args: tuple, kwargs: dict, *,
                  loss_fn: Callable[[Any], Any] | None = None) -> int | None:
    """Peak bytes of one training step ``run()`` (forward, ``loss_fn`` or the default
    loss, backward) of ``model``, by the allocator (:class:`graphs.memory.AllocatorPeak`,
    parameters, buffers and inputs included); None for meta or fake inputs, and on CPU
    inside another torch profiler. Gradients, buffers and the RNG are left as found."""
    if not_real(args, kwargs) or not judge_available(model, (args, kwargs)):
        return None  # nothing real to run, or no judge
    with step_undone(model), AllocatorPeak(model, (args, kwargs)) as judge:
        out = run()  # held during backward, as verify does
        (loss_fn or default_loss)(out).backward()
        del out
    return int(judge.peak_bytes)


def fit_measured(model: nn.Module, *, make: Callable[[int], Any], run: Callable[[Any], Callable[[], Any]],
                 args: tuple, kwargs: dict, budget: int, session: Session, tries: int = 3,
                 loss_fn: Callable[[Any], Any] | None = None, held_back: int = 0, reserve: int = 0) -> Any:
    """Plan, measure one step of the plan, and plan again with a margin while the
    measured peak is over ``budget``.

    The simulator counts the captured graph's values. A real step can allocate more: an
    eager forward's temporaries that capture decomposes away, the buffers a compiled
    segment allocates inside it. The margin is what the step measured beyond its plan.
    ``make(margin)`` plans for ``budget - margin`` and sets ``session.report``;
    ``run(plan)`` is one step of a plan. ``held_back``: the margin to start from (what a
    real step measured beyond an earlier plan). ``reserve``: bytes more planned below the
    budget from the start, so that the step measured is within it (the prediction's own
    error) where a plan leaves room for it; a step is still judged against the whole
    budget.
    """
    try:
        out, margin = make(held_back + reserve), held_back + reserve
    except InfeasibleBudget:
        reserve = 0  # the reserve is kept where a plan leaves room for it
        try:
            out, margin = make(held_back), held_back
        except InfeasibleBudget as exc:
            raise _measured_smallest(model, exc, make=make, run=run, args=args, kwargs=kwargs, budget=budget,
                                     session=session, loss_fn=loss_fn) from exc
    for attempt in range(tries):
        report = session.report
        extra = untracked_bytes(report.graph)
        peak = report.checked_peak_bytes
        if peak is None:
            measured = measured_peak(model, run(out), args, kwargs, loss_fn=loss_fn)
            if measured is None:
                return out
            peak = report.checked_peak_bytes = measured + extra
            session.saw(peak)
        if peak <= budget:
            if margin > reserve:
                report.notes.append(f"planned for {format_bytes(budget - margin)}: a step of the plan for the whole "
                                    f"budget measured {format_bytes(margin - reserve)} more than its prediction")
            return out
        if attempt == tries - 1:
            break
        margin = max(margin + peak - budget, peak - report.predicted_peak_bytes)
        try:
            out = make(margin)
        except InfeasibleBudget as exc:
            smallest = _smallest_that_fits(model, exc, make=make, run=run, args=args, kwargs=kwargs, budget=budget,
                                           session=session, loss_fn=loss_fn)
            if smallest is not None:
                return smallest
            raise InfeasibleBudget(budget, exc.smallest_feasible_bytes + margin,
                                   lower_bound_bytes=exc.lower_bound_bytes + margin, what="measured peak",
                                   **_why(exc)) from exc
    raise SolverError(f"a step of the plan measured {format_bytes(peak)} over the budget {format_bytes(budget)} "
                      f"after {tries} plans with a margin for what the step allocates beyond the captured graph; "
                      "ask for a larger budget")


def _smallest_plan(model: nn.Module, exc: InfeasibleBudget, *, make: Callable[[int], Any],
                   run: Callable[[Any], Callable[[], Any]], args: tuple, kwargs: dict, budget: int,
                   session: Session, loss_fn: Callable[[Any], Any] | None) -> tuple[Any, int] | None:
    """The plan for the smallest peak ``exc`` names and the allocator's peak of one step
    of it (untracked bytes included), or None where it cannot be made or measured."""
    try:
        plan = make(budget - exc.smallest_feasible_bytes)  # the margin that plans for the smallest peak
    except RematError:
        return None
    measured = measured_peak(model, run(plan), args, kwargs, loss_fn=loss_fn)
    if measured is None:
        return None
    peak = measured + untracked_bytes(session.report.graph)
    session.saw(peak)
    return plan, peak


def _smallest_that_fits(model: nn.Module, exc: InfeasibleBudget, *, budget: int, session: Session,
                        **step: Any) -> Any:
    """The plan for the smallest peak found, where no plan with a margin is feasible and
    a step of it measures within ``budget``; else None. A budget an error once named
    (what :func:`_measured_smallest` measured) is then met by that plan again, even when
    the plan for the whole budget measured over it. ``step``: ``make``, ``run``,
    ``args``, ``kwargs``, ``loss_fn`` as :func:`fit_measured` takes them."""
    smallest = exc.smallest_feasible_bytes
    found = _smallest_plan(model, exc, budget=budget, session=session, **step) if smallest <= budget else None
    if found is None or found[1] > budget:
        return None
    plan, session.report.checked_peak_bytes = found
    session.report.notes.append(f"planned for the smallest peak found, {format_bytes(smallest)}: a step of the plan "
                                "for the whole budget measured over it, and no plan left room for the difference")
    return plan


def _measured_smallest(model: nn.Module, exc: InfeasibleBudget, *, budget: int, session: Session,
                       **step: Any) -> InfeasibleBudget:
    """The error to raise for a budget below the smallest plan: the smallest plan's
    measured peak when a step of it measures more than its prediction, and at least the
    peak of planning's own runs so far (the run that measures op workspaces runs the
    lowest-peak schedule, and runs it again when the figure named is asked for): asking
    for the figure named must succeed."""
    found = _smallest_plan(model, exc, budget=budget, session=session, **step)
    named = max(found[1] if found is not None else 0, session.planning_peak or 0)
    if named <= exc.smallest_feasible_bytes:
        return exc
    return InfeasibleBudget(budget, named, lower_bound_bytes=exc.lower_bound_bytes, what="measured peak", **_why(exc))


def _why(exc: InfeasibleBudget) -> dict:
    """What ``exc`` says forces its lower bound, for an error that names other figures."""
    return dict(culprit=exc.culprit, culprit_name=exc.culprit_name, held_bytes=exc.held_bytes,
                held_before=exc.held_before)


@dataclass(frozen=True)
class Reproduction:
    """What :func:`reproduces` found.

    Attributes
    ----------
    same : bool
        The step gave the reference's loss and gradients (to float tolerance).
    peak_bytes : int or None
        The step's peak by the allocator (None for meta or fake inputs).
    reference_peak_bytes : int or None
        The reference's peak by the allocator.
    """

    same: bool
    peak_bytes: int | None = None
    reference_peak_bytes: int | None = None


def reproduces(model: nn.Module, step: Callable, args: tuple, kwargs: dict, *,
               loss_fn: Callable[[Any], Any] | None = None, reference: Callable | None = None) -> Reproduction:
    """One step of the rewrite against a reference step on the example batch: whether it
    gives the same loss and gradients (to float tolerance), with both peaks by the
    allocator. The reference is :func:`reference_step`'s (eager's loss and gradients)
    unless ``reference`` is given: a step with the same call shape, whose loss is then
    also checked against the model's own forward run without autograd (which saves
    nothing). Gradients, buffers and the RNG are left as found."""
    if not_real(args, kwargs):
        return Reproduction(True)  # nothing real to run
    params = list(model.parameters())
    loss_fn = loss_fn or default_loss
    results, peaks = [], []
    judged = judge_available(model, (args, kwargs))
    steps = [step, reference or reference_step(model)]
    for run in steps:
        with step_undone(model):
            torch.manual_seed(1234)
            with AllocatorPeak(model, (args, kwargs)) if judged else contextlib.nullcontext() as judge:
                out = run(model, args, kwargs)  # held during backward, as verify does
                loss = loss_fn(out)
                loss.backward()
                del out
            peaks.append(None if judge is None else int(judge.peak_bytes))
            results.append((loss.detach(), [None if p.grad is None else p.grad.detach().clone() for p in params]))
    (la, ga), (lb, gb) = results
    compiled = getattr(step, "compiler", "eager") != "eager"
    same = _close(la, lb, compiled) and all(_close(x, y, compiled) for x, y in zip(ga, gb))
    if same and reference is not None:
        with step_undone(model), torch.no_grad():
            torch.manual_seed(1234)
            same = _close(la, loss_fn(type(model).forward(model, *args, **kwargs)).detach(), compiled)
    return Reproduction(same, peaks[0], peaks[1])


def reference_step(model: nn.Module) -> Callable[[nn.Module, tuple, dict], Any]:
    """The step a rewrite's gradients are checked against: the model's own forward with
    every layer block under non-reentrant checkpointing, which gives eager's loss and
    gradients (the recomputation replays the generator state) in a fraction of the
    plain step's memory, so that checking a plan does not need the memory the plan
    saves. A model without a ``ModuleList`` or ``Sequential`` of layers runs its plain
    forward.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> x = torch.randn(2, 4)
    >>> torch.equal(reference_step(net)(net, (x,), {}), net(x))
    True
    """
    from graphs.module_mode import layer_blocks
    from graphs.planned import ModuleStep

    blocks = layer_blocks(model)
    parent = model.get_submodule(blocks[0].rpartition(".")[0]) if blocks else None
    if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
        return lambda m, args, kwargs: type(m).forward(m, *args, **kwargs)
    return ModuleStep(model, {b: "full" for b in blocks})


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


def self_check(model: nn.Module, step: Callable, *, args: tuple, kwargs: dict, session: Session,
               loss_fn: Callable[[Any], Any] | None = None, reference: Callable | None = None) -> bool:
    """Whether the rewrite ``step`` reproduces the model's gradients on the example batch
    (against ``reference``, see :func:`reproduces`); its measured peak (the same step)
    goes to the session's report, both peaks to the session's planning peak.

    A step that raises while it is checked (a compiled segment that rejects its
    inputs, say) fails the check: the caller falls back as for wrong gradients, and
    the report's notes say what was raised."""
    try:
        found = reproduces(model, step, args, kwargs, loss_fn=loss_fn, reference=reference)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        session.report.notes.append(f"the self-check of the rewrite raised {type(exc).__name__}: {first}; "
                                    "the rewrite was not used")
        return False
    extra = untracked_bytes(session.report.graph)
    if found.peak_bytes is not None:
        session.report.checked_peak_bytes = found.peak_bytes + extra
        session.saw(found.peak_bytes + extra)
    if found.reference_peak_bytes is not None:
        session.saw(found.reference_peak_bytes + extra)
    return found.same

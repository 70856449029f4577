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

from graphs.capture import default_loss
from graphs.memory import MemoryTracker
from graphs.units import format_bytes
from solver.errors import InfeasibleBudget, SolverError
from solver.fixed import untracked_bytes
from solver.report import Report

__all__ = ["Session", "fit_measured", "measured_peak", "reproduces", "self_check", "step_undone"]


@dataclass
class Session:
    """The planning state of one :func:`solver.optimize` call: the latest plan's report
    and the modules that show it as ``.report``."""

    report: Report | None = None
    modules: list = field(default_factory=list)

    def publish(self) -> None:
        """Show the latest report on every module of the call."""
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


def measured_peak(model: nn.Module, run: Callable[[], Any], args: tuple, kwargs: dict) -> int | None:
    """Peak bytes of one training step ``run()`` (forward, default loss, backward) of
    ``model``, measured by the live-tensor tracker; None for meta or fake inputs.
    Gradients, buffers and the RNG are left as found."""
    if not_real(args, kwargs):
        return None  # nothing real to run
    with step_undone(model), MemoryTracker(model, (args, kwargs)) as tracker:
        out = run()  # held during backward, as verify does
        default_loss(out).backward()
        del out
    return int(tracker.peak_bytes)


def fit_measured(model: nn.Module, *, make: Callable[[int], Any], run: Callable[[Any], Callable[[], Any]],
                 args: tuple, kwargs: dict, budget: int, session: Session, tries: int = 3) -> Any:
    """Plan, measure one step of the plan, and plan again with a margin while the
    measured peak is over ``budget``.

    The simulator counts the captured graph's values. A real step can allocate more: an
    eager forward's temporaries that capture decomposes away, the buffers a compiled
    segment allocates inside it. The margin is what the step measured beyond its plan.
    ``make(margin)`` plans for ``budget - margin`` and sets ``session.report``;
    ``run(plan)`` is one step of a plan.
    """
    out, margin = make(0), 0
    for attempt in range(tries):
        report = session.report
        extra = untracked_bytes(report.graph)
        peak = report.checked_peak_bytes
        if peak is None:
            measured = measured_peak(model, run(out), args, kwargs)
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


def reproduces(model: nn.Module, step: Callable, args: tuple, kwargs: dict) -> tuple[bool, int | None]:
    """One step of the rewrite against eager on the example batch: whether it gives the
    same loss and gradients (to float tolerance), and the rewrite's peak measured by the
    live-tensor tracker (None for meta or fake inputs). Gradients, buffers and the RNG
    are left as found."""
    if not_real(args, kwargs):
        return True, None  # nothing real to run
    params = list(model.parameters())
    results = []
    tracker = MemoryTracker(model, (args, kwargs))
    for run, tracked in ((lambda: step(model, args, kwargs), tracker),
                         (lambda: type(model).forward(model, *args, **kwargs), contextlib.nullcontext())):
        with step_undone(model):
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


def self_check(model: nn.Module, step: Callable, *, args: tuple, kwargs: dict, session: Session) -> bool:
    """Whether the rewrite ``step`` reproduces the model's gradients on the example batch;
    its measured peak (the same step) goes to the session's report."""
    same, peak = reproduces(model, step, args, kwargs)
    if peak is not None:
        session.report.checked_peak_bytes = peak + untracked_bytes(session.report.graph)
    return same

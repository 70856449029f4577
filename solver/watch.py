"""The closed loop on the real training step: measure it by the allocator, plan again
when it is over the budget.

A plan is checked on the example batch, but the step a training loop runs may differ:
another loss than the one planned (none was given), a batch that allocates more, what
the loop itself holds. :class:`WatchedStep` wraps the step a plan runs and measures, by
the allocator (:class:`graphs.memory.AllocatorPeak`), the real step from the start of
its forward to the end of its backward, the user's loss included: on CUDA and other
accelerators, whose peak statistics cost nothing, every step; on CPU, whose judge is
the profiler, the first step of each plan. When a step is over the budget, the next
call plans again holding back what the step measured beyond the budget (or beyond its
prediction, when the plan had room left) and 1 % of the budget, with a warning and a
note in the report.

The measured span ends when the backward pass ends (the autograd engine's final
callback). A CPU profiler cannot be stopped inside a backward pass, so on CPU the span
is cut there and the profiler stops at the next optimizer step (a global
``torch.optim`` step pre-hook, while a measurement is open) or the next call of the
module, whichever comes first.

On CUDA, measuring resets the allocator's peak statistics at the start of each step's
forward (``torch.cuda.reset_peak_memory_stats``): a peak read after the step is the
step's.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from graphs import RematError
from graphs.memory import AllocatorPeak, settle_open_judges
from graphs.torch_internals import at_backward_end, tree_leaves
from graphs.units import format_bytes
from solver.fixed import untracked_bytes

__all__ = ["WATCH", "WatchedStep"]

log = logging.getLogger(__name__)

#: when the real step is measured: ``"auto"`` (every step on an accelerator, the first
#: step of each plan on CPU), ``"first"``, ``"every"`` or ``"off"``
WATCH = ("auto", "first", "every", "off")


class WatchedStep:
    """A planned step whose real training steps are measured against the budget.

    Parameters
    ----------
    step : callable
        ``step(module, args, kwargs)``, the plan's step.
    replan : callable
        ``replan(held_back) -> WatchedStep``: the plan made again for the budget less
        ``held_back`` bytes.
    session : solver.checks.Session
        Whose report holds the budget and gets the notes.
    watch : {"auto", "first", "every", "off"}
    held_back : int
        What this plan already holds back.

    Attributes
    ----------
    step_peaks : list of int
        The measured peaks of the real steps, in order (what the step does not allocate
        yet, such as optimizer state, added as the prediction charges it).
    """

    def __init__(self, step: Any, *, replan: Callable[[int], "WatchedStep"], session: Any, watch: str = "auto",
                 held_back: int = 0) -> None:
        if watch not in WATCH:
            raise ValueError(f"watch must be one of {WATCH}, got {watch!r}")
        self.step, self.replan, self.session, self.watch = step, replan, session, watch
        self.held_back = held_back
        self.report = session.report
        self.step_peaks: list[int] = []
        self._judge: AllocatorPeak | None = None
        self._excess = 0
        self._replaced: WatchedStep | None = None
        self._optimizer_hook: Any = None

    def __getattr__(self, name: str) -> Any:  # the plan's own attributes (actions, saved, compiler)
        if name.startswith("_") or name in ("step",):
            raise AttributeError(name)
        return getattr(self.step, name)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        settle_open_judges()  # a forward whose backward never came, of this plan or another
        if self._replaced is not None:
            return self._replaced(module, args, kwargs)
        if self._excess > 0:
            self._replaced = self._plan_again()
            return self._replaced(module, args, kwargs)
        if not self._measures(args, kwargs):
            return self.step(module, args, kwargs)
        judge = AllocatorPeak(module, (args, kwargs))
        try:
            judge.__enter__()
        except RematError:  # another profiler is running: not measured
            return self.step(module, args, kwargs)
        self._judge = judge
        judge.close_later(self._abandon)  # until its backward ends: the next judge drops it
        try:
            out = self.step(module, args, kwargs)
        except BaseException:
            self._abandon()
            raise
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            self._abandon()
            return out
        fired = []

        def at_output_grad(grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                at_backward_end(lambda: self._backward_done(judge))

        for t in outputs:
            t.register_hook(at_output_grad)
        return out

    def _measures(self, args: tuple, kwargs: dict) -> bool:
        if self.watch == "off" or self.report is None:
            return False
        if self.watch == "every":
            return True
        accelerator = any(t.device.type not in ("cpu", "meta") for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor))
        if self.watch == "auto" and accelerator:
            return True
        return not self.step_peaks

    def _backward_done(self, judge: AllocatorPeak) -> None:
        if self._judge is not judge:
            return
        judge.cut()
        if judge.device.type != "cpu":
            self._finish()
            return
        judge.close_later(self._finish)
        if self._optimizer_hook is None:
            self._optimizer_hook = register_optimizer_step_pre_hook(
                lambda *_: self._finish())

    def _finish(self) -> None:
        judge, self._judge = self._judge, None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if judge is None:
            return
        judge.__exit__(None, None, None)
        peak = judge.peak_bytes + untracked_bytes(self.report.graph)
        self.step_peaks.append(int(peak))
        budget = self.report.budget_bytes
        if self.report.step_peak_bytes is None:
            self.report.step_peak_bytes = int(peak)
        if peak > budget:
            self._excess = peak - budget
            msg = (f"a real training step measured {format_bytes(peak)} by the allocator, "
                   f"{format_bytes(self._excess)} over the budget {format_bytes(budget)}; the next step plans "
                   "again with that held back")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            self.report.notes.append(msg)
        log.info("real step peak %s (budget %s)", peak, budget)

    def _abandon(self) -> None:
        """Close an open measurement: counted when its backward ended, else dropped (a
        forward whose backward never came)."""
        judge = self._judge
        if judge is not None and judge.is_cut:
            self._finish()
            return
        self._judge = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if judge is not None:
            judge.__exit__(None, None, None)

    def _plan_again(self) -> "WatchedStep":
        # what the step measured beyond the budget, or beyond its prediction when the
        # plan had room left (the unplanned bytes come on top of the new plan's peak
        # too), and a slack of 1 % of the budget: a plan with more recomputation can
        # move its peak to where the unplanned bytes sit
        peak = self.step_peaks[-1]
        held = max(self.held_back + self._excess, peak - self.report.predicted_peak_bytes)
        held += self.report.budget_bytes // 100
        new = self.replan(held)
        before = self.report.budget_bytes - self.held_back
        new.session.report.notes.append(f"planned again for {format_bytes(self.report.budget_bytes - held)}: a real "
                                        f"step of the plan for {format_bytes(before)} measured "
                                        f"{format_bytes(self._excess)} over the budget")
        return new

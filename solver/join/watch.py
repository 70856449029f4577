"""The closed loop on the real training step: measure it by the allocator, plan again
when it is over the budget.

A plan is checked on the example batch, but the step a training loop runs may differ:
another loss than the one planned (none was given), a batch that allocates more, what
the loop itself holds. :class:`WatchedStep` wraps the step a plan runs and measures, by
the allocator, the real step from the start of its forward to the end of its backward,
the user's loss included: by default the first step of each plan (every step with
``watch="every"``). A step that is not measured runs the plan's step alone: no device
synchronization, no hooks, no walk of the parameters. When a step is over the budget,
the next call plans again holding back what the step measured beyond the budget (or
beyond its prediction, when the plan had room left) and 1 % of the budget, with a
warning and a note in the report.

The measured span ends when the backward pass ends (the autograd engine's final
callback). On CPU the judge is the profiler (:class:`graphs.memory.AllocatorPeak`); it
cannot be stopped inside a backward pass, so the span is cut there and the profiler
stops at the next optimizer step (a global ``torch.optim`` step pre-hook, while a
measurement is open) or the next call of the module, whichever comes first.

On CUDA and other accelerators the judge reads the allocator's own counters
(``max_memory_allocated``, ``memory_allocated``), which the host keeps as it allocates:
no synchronization, and no reset of the peak statistics, which are the user's
(:class:`DevicePeak`). A step that raises the device's peak is measured exactly; one
whose peak stays under a peak reached before it is known to be at most that one, which
settles a step within the budget; otherwise the next step is measured again (at most
:data:`UNSEEN_TRIES` steps), and the report says why none was.

A step called from a ``torch.compile``'d frame is not measured on CPU
(:func:`graphs.planned.in_compiled_call`): the report says so once. Measure such a
step from outside the compiled call, e.g. with :class:`graphs.memory.AllocatorPeak`
around the call and its backward.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from graphs import RematError
from graphs.memory import AllocatorPeak, resident_bytes, settle_open_judges
from graphs.planned import in_compiled_call
from graphs.torch_internals import at_backward_end, tree_leaves
from graphs.units import format_bytes
from solver.join.fixed import untracked_bytes

__all__ = ["COMPILED_NOTE", "WATCH", "WatchedStep", "DevicePeak", "step_device", "UNSEEN_TRIES"]

log = logging.getLogger(__name__)

#: when the real step is measured: ``"auto"`` and ``"first"`` (the first step of each
#: plan), ``"every"`` or ``"off"``
WATCH = ("auto", "first", "every", "off")
#: Steps measured at most, on an accelerator, while a peak reached before each hides its own.
UNSEEN_TRIES = 3


def _device_stats(device: torch.device):
    return torch.cuda if device.type == "cuda" else torch.accelerator


def step_device(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """The device a step runs on: that of its first input on an accelerator, else of
    the module's first parameter on one, else CPU."""
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    for p in module.parameters():
        if p.device.type not in ("cpu", "meta"):
            return p.device
        break
    return torch.device("cpu")


class DevicePeak:
    """The peak of a span on an accelerator from the allocator's counters, without
    resetting them: what the roots held on entry (``baseline_bytes``) plus what the span
    allocated above the entry at its highest. The counters are the host's, so neither
    reading them nor this judge synchronizes the device; the user's peak statistics stay
    as they were.

    Where the device peaked higher before the span than the span itself does, the span's
    peak is not seen: ``known`` is False and ``peak_bytes`` is the most it can be.

    Parameters
    ----------
    *roots : modules, tensors or containers of them
        What exists on entry and counts toward the peak.
    device : torch.device

    Examples
    --------
    >>> judge = DevicePeak(torch.nn.Linear(2, 2), device=torch.device("cuda"))
    >>> judge.is_cut, judge.known  # (entered around a step on the device, cut at its end)
    (False, False)
    """

    def __init__(self, *roots: Any, device: torch.device) -> None:
        self._roots, self.device = roots, device
        self.baseline_bytes = self.peak_bytes = 0
        self.known = False
        self._before = self._start = 0
        self._cut = False

    def __enter__(self) -> "DevicePeak":
        stats = _device_stats(self.device)
        self._before = int(stats.max_memory_allocated(self.device))
        self._start = int(stats.memory_allocated(self.device))
        self.baseline_bytes = self.peak_bytes = resident_bytes(*self._roots, device=self.device)
        self._roots = ()
        return self

    def cut(self) -> None:
        """End the span now (the end of a backward pass)."""
        if self._cut:
            return
        self._cut = True
        after = int(_device_stats(self.device).max_memory_allocated(self.device))
        self.known = after > self._before
        self.peak_bytes = self.baseline_bytes + max(0, (after if self.known else self._before) - self._start)

    @property
    def is_cut(self) -> bool:
        return self._cut

    def close_later(self, close: Callable[[], None]) -> None:  # nothing is left running
        pass

    def __exit__(self, *exc: Any) -> None:
        self.cut()


#: the report's note where a step came through a torch.compile'd frame on CPU
COMPILED_NOTE = ("steps called from a torch.compile'd frame are not measured on CPU: a CPU profiler started inside "
                 "a compiled call and left running into the next one made later steps' gradients wrong (torch "
                 "2.15); measure such a step from outside the compiled call (graphs.memory.AllocatorPeak around "
                 "the call and its backward)")


class WatchedStep:
    """A planned step whose real training steps are measured against the budget.

    Parameters
    ----------
    step : callable
        ``step(module, args, kwargs)``, the plan's step.
    replan : callable
        ``replan(held_back) -> WatchedStep``: the plan made again for the budget less
        ``held_back`` bytes.
    session : solver.join.checks.Session
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
        self._unseen = 0  # steps measured on an accelerator whose peak an earlier one hid

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
        if not self._measures():
            return self.step(module, args, kwargs)
        device = step_device(module, args, kwargs)
        if device.type == "cpu" and in_compiled_call():
            if COMPILED_NOTE not in self.report.notes:
                self.report.notes.append(COMPILED_NOTE)
            return self.step(module, args, kwargs)
        judge = (AllocatorPeak(module, (args, kwargs)) if device.type == "cpu"
                 else DevicePeak(module, (args, kwargs), device=device))
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

    def _measures(self) -> bool:
        if self.watch == "off" or self.report is None:
            return False
        if self.watch == "every":
            return True
        return not self.step_peaks and self._unseen < UNSEEN_TRIES

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
        budget = self.report.budget_bytes
        if isinstance(judge, DevicePeak) and not judge.known and peak > budget:
            # a peak reached before the step hides the step's own, and the most it can be
            # is over the budget: not a verdict (the statistics are the user's, not reset)
            self._unseen += 1
            if self._unseen == UNSEEN_TRIES:
                self.report.notes.append(
                    f"the real step was not measured: the device peaked at {format_bytes(peak)} or more before "
                    f"each of {UNSEEN_TRIES} steps, above the step's own peak; call "
                    "torch.cuda.reset_peak_memory_stats() before training to let the watch see it")
            return
        self.step_peaks.append(int(peak))
        self.session.saw_step(int(peak), self.report)
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

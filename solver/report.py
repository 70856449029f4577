"""The report of a plan: what it predicts and, after :func:`solver.verify`, what a real
step measured."""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from graphs import ComputeGraph
from graphs.units import format_bytes
from solver.schedule import Schedule

__all__ = ["Report"]


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
    ``step_peak_bytes`` is the allocator's peak of the first real training step of the
    plan, from its forward to the end of its backward, the user's loss included
    (:mod:`solver.join.watch`). ``capture_seconds`` is the tracing of the step,
    ``measure_seconds`` the runs that measure its op times and workspaces,
    ``solve_seconds`` the schedule's search, and ``check_seconds`` the rest of planning:
    the rewrite built, its gradients checked and its steps measured (and any plan made
    again). ``planning_peak_bytes`` is the allocator's peak of the planning of the
    ``optimize`` call, from its start: its runs on the example batch (the runs that
    measure op times and workspaces, in schedules that fit the budget; the gradient
    check; measured steps of plans), each counted with what planning holds beside it
    (the user's example inputs beside the copies planning runs on, the gradients put
    aside, the buffers' copies, the gradient check's prints of the step's gradients).
    ``verify=True`` steps are not planning: see ``measured_peak_bytes`` and
    ``original_peak_bytes``.
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
    step_peak_bytes: int | None = None
    planning_peak_bytes: int | None = None
    measure_seconds: float = 0.0
    check_seconds: float | None = None
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

    def __post_init__(self) -> None:
        if self.graph is not None and getattr(self.graph, "fx", None) is not None:
            # its fx graph and capture hold AOTAutograd's objects, which do not survive a deep copy
            self.graph.__deepcopy__ = functools.partial(_graph_copy, self.graph)

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

    def defer(self, name: str, compute: Any) -> None:
        """Make the figure ``name`` on its first read, by ``compute()`` (a search that a
        plan need not wait for; a read of the report, :meth:`to_dict` or ``str`` runs it).

        Examples
        --------
        >>> r = Report(mode="graph", method="auto", budget_bytes=10, predicted_peak_bytes=8,
        ...            store_all_peak_bytes=12, smallest_feasible_bytes=8, predicted_overhead=0.0, gap=None,
        ...            solve_seconds=0.0, capture_seconds=0.0, decisions="")
        >>> r.defer("smallest_feasible_bytes", lambda: 6)
        >>> r.smallest_feasible_bytes
        6
        """
        self.__dict__.pop(name, None)
        self.__dict__.setdefault("_deferred", {})[name] = compute

    def __getattr__(self, name: str) -> Any:
        deferred = self.__dict__.get("_deferred")
        if deferred and name in deferred:
            value = self.__dict__[name] = deferred.pop(name)()
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        for name in list(self.__dict__.get("_deferred", ())):
            getattr(self, name)
        out = {k: v for k, v in self.__dict__.items() if k not in ("graph", "schedule", "decisions", "_deferred")}
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
            f"  planning            capture {self.capture_seconds:.2f} s, "
            + (f"measure {self.measure_seconds:.2f} s, " if self.measure_seconds else "")
            + f"solve {self.solve_seconds:.2f} s"
            + ("" if self.check_seconds is None else f", check {self.check_seconds:.2f} s")
            + ("" if self.planning_peak_bytes is None else f", peak {b(self.planning_peak_bytes)} ("
               f"{'OVER' if self.planning_peak_bytes > self.budget_bytes else 'within'} the budget)"),
        ]
        if self.measured_peak_bytes is not None:
            ratio = self.measured_peak_bytes / self.predicted_peak_bytes if self.predicted_peak_bytes else math.nan
            lines.append(
                f"  measured peak       {b(self.measured_peak_bytes)} ({ratio:.3f}x predicted; "
                f"{'fits' if self.fits else 'OVER'} the budget)"
            )
        if self.step_peak_bytes is not None:
            over = self.step_peak_bytes > self.budget_bytes
            lines.append(f"  real step peak      {b(self.step_peak_bytes)} (first training step; "
                         f"{'OVER' if over else 'fits'} the budget)")
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


def _graph_copy(graph: ComputeGraph, memo: dict) -> ComputeGraph:
    """A deep copy of a captured graph without its fx graph and capture (``fx`` and
    ``capture_info`` are None, as in a graph read from a file): costs, order and meta."""
    shallow = copy.copy(graph)
    shallow.__dict__.pop("__deepcopy__", None)
    shallow.fx = shallow.capture_info = None
    out = copy.deepcopy(shallow, memo)
    memo[id(graph)] = out
    return out

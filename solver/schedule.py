"""The one result type of every solver: :class:`Schedule`, and the per-tensor view of it.

A schedule is plain data (node ids, numbers, strings): the rewriter in ``graphs`` reads
it without importing any solver algorithm.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable

from graphs.units import format_bytes

__all__ = ["Action", "Offload", "Schedule", "TensorDecision"]


class Action(str, enum.Enum):
    """What a schedule does with one forward value between its computation and backward.

    The same small enum is used from the solvers to the per-layer policy exporters.
    """

    STORE = "store"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Offload:
    """Move the copy of ``node`` that is live at step ``after`` to host memory during step
    ``after + 1`` and bring it back during step ``before - 1``."""

    node: Hashable
    after: int
    before: int


@dataclass(frozen=True)
class TensorDecision:
    """The readable view of one value in a schedule."""

    node: Hashable
    action: Action
    computations: int
    bytes: int
    phase: str
    op: str

    @property
    def recomputations(self) -> int:
        return max(0, self.computations - 1)


@dataclass
class Schedule:
    """An execution order of one training step, with recomputation and offload.

    Attributes
    ----------
    sequence : list
        Node ids in execution order; a recomputation is a repeated id. A value is freed
        after its last consumer (see :mod:`solver.simulate`).
    method : str
        The solver that produced it.
    offloads : list of Offload
        Device-to-host moves and their prefetches.
    bandwidth : float or None
        Host-link bytes per time unit that the offloads were planned with.
    cost, peak_bytes : float, int
        Total cost and peak device bytes, as graded by :func:`solver.simulate`.
    base_cost : float
        Cost of computing every node once.
    budget_bytes : int or None
        The budget it was solved for.
    lower_bound : float or None
        A proven lower bound on the cost of any schedule within the budget (same order
        freedom as the method), or None when unknown.
    solve_seconds : float
        Wall time of the solve.
    info : dict
        Method-specific details (fixed or free order, status, bound source...).
    """

    sequence: list
    method: str = ""
    offloads: list[Offload] = field(default_factory=list)
    bandwidth: float | None = None
    cost: float = float("nan")
    peak_bytes: int = 0
    base_cost: float = float("nan")
    budget_bytes: int | None = None
    lower_bound: float | None = None
    solve_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def extra_cost(self) -> float:
        return self.cost - self.base_cost

    @property
    def overhead(self) -> float:
        """Extra compute as a fraction of the store-all cost."""
        return self.extra_cost / self.base_cost if self.base_cost else 0.0

    @property
    def gap(self) -> float | None:
        """Optimality gap on the *extra* compute: ``(cost - lb) / (cost - base)``.

        0 when the schedule is proven optimal, None when no bound is known.
        """
        if self.lower_bound is None:
            return None
        extra = self.cost - self.base_cost
        slack = self.cost - max(self.lower_bound, self.base_cost)
        if slack <= 1e-9 * max(1.0, abs(self.cost)):
            return 0.0
        return slack / extra if extra > 0 else 0.0

    def counts(self) -> dict[Hashable, int]:
        out: dict[Hashable, int] = {}
        for v in self.sequence:
            out[v] = out.get(v, 0) + 1
        return out

    def decisions(self, graph) -> list[TensorDecision]:
        """Per forward value: store, recompute (how many times) or offload.

        A forward value that backward reads is *recomputed* when it runs more than once,
        *offloaded* when one of its copies goes to the host, else *stored*.
        """
        counts = self.counts()
        offloaded = {o.node for o in self.offloads}
        out = []
        for v in graph.ops:
            d = graph[v]
            if d["phase"] != "forward":
                continue
            c = counts.get(v, 0)
            if v in offloaded:
                action = Action.OFFLOAD
            elif c > 1:
                action = Action.RECOMPUTE
            else:
                action = Action.STORE
            out.append(TensorDecision(v, action, c, int(d["bytes"]), d["phase"], str(d["op"])))
        return out

    def table(self, graph, *, limit: int | None = 40) -> str:
        """The per-tensor decisions as a readable table (recomputed and offloaded first)."""
        rows = [d for d in self.decisions(graph)]
        rows.sort(key=lambda d: (d.action == Action.STORE, -d.bytes))
        lines = [f"{'node':<28} {'op':<34} {'bytes':>11} {'action':<10} {'runs':>4}"]
        for d in rows[: limit or len(rows)]:
            lines.append(
                f"{str(d.node)[:28]:<28} {d.op[:34]:<34} {format_bytes(d.bytes):>11} "
                f"{d.action.value:<10} {d.computations:>4}"
            )
        if limit and len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        gap = "unknown" if self.gap is None else f"{100 * self.gap:.2f} %"
        return (
            f"Schedule[{self.method}]: {len(self.sequence)} steps, cost {self.cost:.6g} "
            f"(+{100 * self.overhead:.3f} % over store-all), peak {format_bytes(self.peak_bytes)}"
            + (f" / budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "")
            + f", gap {gap}, {self.solve_seconds:.3f} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "sequence": list(self.sequence),
            "method": self.method,
            "offloads": [[o.node, o.after, o.before] for o in self.offloads],
            "bandwidth": self.bandwidth,
            "cost": self.cost,
            "peak_bytes": self.peak_bytes,
            "base_cost": self.base_cost,
            "budget_bytes": self.budget_bytes,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "solve_seconds": self.solve_seconds,
            "info": {k: v for k, v in self.info.items() if _jsonable(v)},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Schedule":
        return cls(
            sequence=list(data["sequence"]),
            method=data.get("method", ""),
            offloads=[Offload(*o) for o in data.get("offloads", [])],
            bandwidth=data.get("bandwidth"),
            cost=data.get("cost", float("nan")),
            peak_bytes=data.get("peak_bytes", 0),
            base_cost=data.get("base_cost", float("nan")),
            budget_bytes=data.get("budget_bytes"),
            lower_bound=data.get("lower_bound"),
            solve_seconds=data.get("solve_seconds", 0.0),
            info=dict(data.get("info", {})),
        )


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None), list, dict))

"""Exception types of the solvers."""

from __future__ import annotations

from graphs.errors import RematError
from graphs.units import format_bytes

__all__ = ["RematError", "SolverError", "InfeasibleBudget", "NoScheduleFound", "BudgetNotReached", "OptionError"]


class SolverError(RematError):
    """A solver failed or produced a schedule that the simulator rejects."""


class NoScheduleFound(SolverError):
    """A method found no schedule within the budget (the budget may still be feasible).

    Attributes
    ----------
    best_peak : int or None
        The smallest peak the method reached, if any.
    lower_bound : float or None
        A lower bound on the cost that the method proved meanwhile, if any, for the
        schedules of its order freedom (``"fixed"``: those that keep the reference order).
    """

    def __init__(self, message: str, *, best_peak: int | None = None, lower_bound: float | None = None) -> None:
        super().__init__(message)
        self.best_peak = best_peak
        self.lower_bound = lower_bound


class InfeasibleBudget(RematError, ValueError):
    """No schedule of the step fits the budget.

    Attributes
    ----------
    budget_bytes : int
    smallest_feasible_bytes : int
        The smallest peak that a schedule reaches (the least budget to ask for).
    proven : bool
        True when ``smallest_feasible_bytes`` is proven optimal, False when it is the
        best found and only ``lower_bound_bytes`` is proven.
    lower_bound_bytes : int
        No schedule peaks below this.
    culprit : hashable or None
        The op whose inputs, output and workspace alone force the lower bound (with
        ``held_bytes`` more beside them).
    culprit_name : str or None
        How messages name the culprit (its id and source line).
    held_bytes : int
        Bytes that, beside the culprit's own, hold values that are not computed again
        (the model's outputs the caller holds, output gradients, random ops' results)
        for later readers while it runs.
    held_what : str or None
        What those bytes hold, in words (:func:`solver.feasibility.run_once_held`).
    held_before : bool
        The lower bound holds at an earlier step than the culprit's own: it is what
        making the culprit's inputs resident needs
        (:func:`solver.feasibility.last_computed_peak_bound`).
    """

    def __init__(
        self,
        budget_bytes: int,
        smallest_feasible_bytes: int,
        *,
        lower_bound_bytes: int | None = None,
        culprit=None,
        culprit_name: str | None = None,
        what: str = "peak",
        held_bytes: int = 0,
        held_before: bool = False,
        held_what: str | None = None,
    ) -> None:
        self.budget_bytes = int(budget_bytes)
        self.smallest_feasible_bytes = int(smallest_feasible_bytes)
        self.lower_bound_bytes = int(lower_bound_bytes if lower_bound_bytes is not None else smallest_feasible_bytes)
        self.proven = self.lower_bound_bytes >= self.smallest_feasible_bytes
        self.culprit = culprit
        self.culprit_name = culprit_name
        self.held_bytes = int(held_bytes)
        self.held_before = bool(held_before)
        self.held_what = held_what
        if self.proven or self.budget_bytes < self.lower_bound_bytes:
            msg = (
                f"budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B) is infeasible: "
                f"the smallest feasible {what}{'' if self.proven else ' found'} is "
                f"{format_bytes(self.smallest_feasible_bytes)} "
                f"({self.smallest_feasible_bytes} B)"
            )
        else:
            msg = (
                f"no schedule found within budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B): "
                f"the smallest feasible {what} found is {format_bytes(self.smallest_feasible_bytes)} "
                f"({self.smallest_feasible_bytes} B)"
            )
        if not self.proven:
            msg += f"; no schedule can go below {format_bytes(self.lower_bound_bytes)} ({self.lower_bound_bytes} B)"
        if culprit is not None and self.held_bytes > 0:
            msg += (f"; while op {culprit_name or repr(culprit)} runs, its inputs + output and "
                    f"{format_bytes(self.held_bytes)} holding values that are not computed again for later "
                    "readers must be resident" + (f": {held_what}" if held_what else ""))
        elif culprit is not None and self.held_before:
            msg += (f"; making the inputs of op {culprit_name or repr(culprit)} resident needs more in every "
                    "order: the one of them computed last runs while the others are held, and so on back "
                    "to the step's inputs")
        elif culprit is not None:
            msg += f"; op {culprit_name or repr(culprit)} alone needs its inputs + output resident"
        msg += ". Ask for at least the smallest feasible budget."
        super().__init__(msg)


class BudgetNotReached(InfeasibleBudget, NoScheduleFound):
    """No method reached the budget, which lies between the proven lower bound and the
    smallest peak found: an :class:`InfeasibleBudget` for users (it names the smallest
    feasible peak found) and a :class:`NoScheduleFound` for solver code."""

    def __init__(self, budget_bytes: int, smallest_feasible_bytes: int, **kwargs) -> None:
        InfeasibleBudget.__init__(self, budget_bytes, smallest_feasible_bytes, **kwargs)
        self.best_peak = int(smallest_feasible_bytes)


class OptionError(RematError, ValueError, TypeError):
    """An option of :func:`solver.optimize` or :func:`solver.solve` of the wrong type or
    out of its range, an option that a method does not take, or a model that
    :func:`solver.optimize` cannot take; raised before any work, the message naming
    the option and what is taken (a ``ValueError`` and a ``TypeError`` for callers
    that catch either)."""

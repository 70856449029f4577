"""The memory budget of one training step, as :func:`solver.optimize` reads it: one small
frozen value resolved once from the options and checked once, before anything is captured.

A :class:`Budget` is a number of bytes and what it covers: the whole step (parameters,
buffers, inputs, gradients, optimizer state, activations and temporaries) or, for
research, the activations and temporaries alone; and the bytes of it held back from
planning (what a measured step went over its plan by). :meth:`Budget.refuse_below` is
the check that needs no capture: a whole-step budget below what every step holds
whatever its schedule cannot be met.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

from graphs.units import GiB, format_bytes
from solver.errors import InfeasibleBudget, OptionError

__all__ = ["Budget", "BelowResident", "real_number"]


class BelowResident(InfeasibleBudget):
    """The budget is below what every training step holds whatever its schedule
    (:meth:`Budget.refuse_below`), found before any capture. That floor is a bound no
    schedule goes below (``lower_bound_bytes``), not a peak a schedule reaches: the
    step's activations come on top, so ``proven`` is False, and a budget of the floor
    is refused again, after capture, naming the smallest feasible peak.

    Attributes
    ----------
    parts : tuple of (str, int)
        What that floor consists of: each part's name and bytes.
    """

    def __init__(self, budget_bytes: int, parts: Sequence[tuple[str, int]]) -> None:
        floor = sum(b for _, b in parts)
        super().__init__(budget_bytes, floor, lower_bound_bytes=floor)
        self.parts = tuple((str(name), int(b)) for name, b in parts)
        self.proven = False
        held = ", ".join(f"{name} {format_bytes(b)}" for name, b in self.parts if b)
        op = any(name.startswith(OP_PART) for name, _ in self.parts)
        self.args = (
            f"budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B) is infeasible: every training step "
            f"holds {format_bytes(floor)} ({floor} B) whatever its schedule, "
            f"{'while that op runs' if op else 'before any activation'} ({held}; checked before capture). Ask for "
            f"more than that (budget_gb > {floor / GiB:.6g}): the step's "
            f"{'other ' if op else ''}activations and temporaries come on top; or pass activation_budget=True to "
            "budget those alone.",)


#: how the name of a :class:`BelowResident` part that is one op's footprint begins
OP_PART = "the largest op of the forward"


@dataclass(frozen=True)
class Budget:
    """The peak memory one training step may reach.

    Attributes
    ----------
    total_bytes : int
        The budget in bytes.
    activation_only : bool
        True: ``total_bytes`` counts only what the step adds beyond parameters, buffers,
        inputs, optimizer state and gradients (activations and temporaries).
    held_back : int
        Bytes of ``total_bytes`` that planning keeps free (a measured step's excess over
        its plan).

    Examples
    --------
    >>> b = Budget.from_gb(0.5)
    >>> b.total_bytes, b.activation_only, b.available_bytes
    (536870912, False, 536870912)
    >>> b.holding_back(1024).available_bytes
    536869888
    """

    total_bytes: int
    activation_only: bool = False
    held_back: int = 0

    def __post_init__(self) -> None:
        if not _integer(self.total_bytes) or self.total_bytes <= 0:
            raise OptionError(f"a budget is a positive number of bytes, got {self.total_bytes!r}")
        if not isinstance(self.activation_only, bool):
            raise OptionError(f"activation_budget must be True or False, got {self.activation_only!r}")
        if not _integer(self.held_back) or not 0 <= self.held_back < self.total_bytes:
            raise OptionError(f"held_back must be a number of bytes in [0, {self.total_bytes}), got "
                              f"{self.held_back!r}")

    @classmethod
    def from_gb(cls, budget_gb: Any, *, activation_only: bool = False) -> Budget:
        """The budget of ``budget_gb`` GiB (2**30 bytes), checked: a positive, finite
        number (a bool is not one), else :class:`solver.OptionError`.

        Examples
        --------
        >>> Budget.from_gb(2, activation_only=True)
        Budget(total_bytes=2147483648, activation_only=True, held_back=0)
        >>> Budget.from_gb(-1)
        Traceback (most recent call last):
        ...
        solver.errors.OptionError: budget_gb must be a positive, finite number of GiB, got -1
        """
        if not real_number(budget_gb) or not math.isfinite(budget_gb) or budget_gb <= 0 or int(budget_gb * GiB) <= 0:
            raise OptionError(f"budget_gb must be a positive, finite number of GiB, got {budget_gb!r}")
        return cls(int(float(budget_gb) * GiB), activation_only)

    @property
    def available_bytes(self) -> int:
        """What planning may use: the budget less what it holds back."""
        return self.total_bytes - self.held_back

    def holding_back(self, more: int) -> Budget:
        """This budget with ``more`` bytes held back (instead of what it held back)."""
        return Budget(self.total_bytes, self.activation_only, int(more))

    def refuse_below(self, parts: Sequence[tuple[str, int]]) -> None:
        """Raise :class:`BelowResident` when a whole-step budget is below the bytes of
        ``parts`` (name, bytes), what every step holds whatever its schedule, naming
        that figure and what it consists of. An activation-only budget counts none of
        it: never refused here.

        Examples
        --------
        >>> Budget(1000).refuse_below([("parameters and buffers", 600), ("gradients", 600)])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        solver.budget.BelowResident: budget 1000 B (1000 B) is infeasible: every training step holds 1.2 KiB (1200 B) whatever its schedule, ...
        >>> Budget(1000, activation_only=True).refuse_below([("parameters and buffers", 600), ("gradients", 600)])
        """
        if self.activation_only:
            return
        if self.available_bytes < sum(b for _, b in parts):
            raise BelowResident(self.available_bytes, parts)


def real_number(value: Any) -> bool:
    """Whether ``value`` is a real number (a bool is not one).

    Examples
    --------
    >>> real_number(0.5), real_number(True), real_number("1")
    (True, False, False)
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    """An integer number of bytes (a bool is not one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)

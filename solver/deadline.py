"""A time limit as a point on the clock, for solvers that build large models.

An exact method's ``time_limit`` covers everything it does: building the model (which
in Python can take longer than solving it), handing it to the backend, solving, and
grading the answer. Model builders check a :class:`Deadline` as they go and raise
:class:`OutOfTime` when it has passed; the method then returns what it has (its warm
start) instead of overrunning.
"""

from __future__ import annotations

import math
import time

from solver.errors import NoScheduleFound

__all__ = ["Deadline", "OutOfTime"]


class OutOfTime(NoScheduleFound):
    """The time limit passed before the work was done (raised by :meth:`Deadline.check`)."""


class Deadline:
    """``seconds`` from now on :func:`time.perf_counter`'s clock; ``None`` never expires.

    Parameters
    ----------
    seconds : float or None
        Time from now; ``None`` for no limit.

    Examples
    --------
    >>> d = Deadline(60.0)
    >>> 59 < d.left() <= 60, d.expired()
    (True, False)
    >>> Deadline(None).left()
    inf
    >>> try:
    ...     Deadline(-1.0).check("building the model")
    ... except OutOfTime as exc:
    ...     print(exc)
    the time limit passed while building the model
    """

    __slots__ = ("at",)

    def __init__(self, seconds: float | None) -> None:
        self.at = math.inf if seconds is None else time.perf_counter() + float(seconds)

    def left(self) -> float:
        """Seconds until the deadline (negative once past, ``inf`` without a limit)."""
        return self.at - time.perf_counter()

    def expired(self) -> bool:
        return time.perf_counter() >= self.at

    def within(self, seconds: float) -> "Deadline":
        """The earlier of this deadline and ``seconds`` from now."""
        d = Deadline(seconds)
        d.at = min(d.at, self.at)
        return d

    def check(self, what: str = "working") -> None:
        """Raise :class:`OutOfTime` once the deadline has passed."""
        if time.perf_counter() >= self.at:
            raise OutOfTime(f"the time limit passed while {what}")

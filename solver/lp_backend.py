"""OR-Tools linear solvers (HiGHS, SCIP, GLOP, ...) created and run without touching stdout.

Some backends write to the process's C-level standard output whatever the wrapper's
output setting says: HiGHS prints its copyright banner on the first solve of the
process even after :meth:`Solver.SuppressOutput`. A program that prints JSON on stdout
(``remat ... --json``) must not get it there, so every linear solver of remat is
created and run through this module: the wrapper's log is off, HiGHS's own
``output_flag`` too (no banner), and while a solver is created or solves, file
descriptor 1 points at file descriptor 2, so that whatever a backend still prints goes
to stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

from solver.errors import SolverError

__all__ = ["create_solver", "solve_quietly", "stdout_to_stderr"]

log = logging.getLogger(__name__)


def _flush_c_stdio() -> None:
    """Flush the C library's stdio buffers (a backend may have written through them)."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # pragma: no cover - no libc symbol table
        pass


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While the block runs, anything written to file descriptor 1 goes to stderr.

    Affects the whole process (every thread) and C libraries as well as Python; nests.
    Where the descriptors cannot be duplicated, the block runs unchanged.

    Examples
    --------
    >>> with stdout_to_stderr():
    ...     _ = os.write(1, b"")  # would land on stderr
    """
    try:
        sys.stdout.flush()
    except (AttributeError, ValueError, OSError):
        pass
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        yield
    finally:
        _flush_c_stdio()
        try:
            sys.stdout.flush()
        except (AttributeError, ValueError, OSError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


def create_solver(backend: str):
    """A ``pywraplp.Solver`` for ``backend`` with its log off; its banner goes nowhere.

    Parameters
    ----------
    backend : str
        An OR-Tools linear solver id: ``"SCIP"``, ``"HIGHS"``, ``"GLOP"``, ``"CBC"``...

    Returns
    -------
    ortools.linear_solver.pywraplp.Solver

    Raises
    ------
    SolverError
        This OR-Tools build has no such backend.

    Examples
    --------
    >>> s = create_solver("GLOP")
    >>> x = s.NumVar(0, 1, "x"); s.Maximize(x)
    >>> solve_quietly(s) == s.OPTIMAL, x.solution_value()
    (True, 1.0)
    """
    from ortools.linear_solver import pywraplp

    with stdout_to_stderr():
        solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise SolverError(f"OR-Tools backend {backend!r} is not available in this build; "
                          f"try 'SCIP', 'HIGHS' or 'CBC'")
    solver.SuppressOutput()
    if backend.upper() == "HIGHS":
        # the wrapper reports False for HiGHS's parameters even when they are applied
        solver.SetSolverSpecificParametersAsString("output_flag=false")
    return solver


def solve_quietly(solver, params=None) -> int:
    """``solver.Solve(params)`` with file descriptor 1 sent to stderr; returns the status.

    See :func:`create_solver` for an example.
    """
    with stdout_to_stderr():
        return solver.Solve() if params is None else solver.Solve(params)

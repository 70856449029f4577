"""The smallest peak a schedule reaches: what :class:`~solver.InfeasibleBudget` reports.

:func:`smallest_feasible_peak` searches with the fast heuristics of
:mod:`solver.methods.eviction`: low-memory topological orders, then a bisection on the
budget with eviction and on-demand recomputation (the smaller the budget, the more gets
evicted). The proven side is :func:`solver.feasibility.peak_lower_bound`. Every budget
it reports as reachable is reached again by :func:`min_peak_sequence`, which
``method="auto"`` tries, so asking for that budget succeeds.
"""

from __future__ import annotations

import logging
import time as _time
from typing import Hashable

from graphs import ComputeGraph
from solver.feasibility import peak_lower_bound
from solver.indexed import IndexedGraph, order_peak
from solver.methods.eviction import SCORES, beam_order, evict_sequence, min_memory_order

__all__ = ["smallest_feasible_peak", "min_peak_sequence"]

log = logging.getLogger(__name__)

_SCORES = ("dtr", "belady")
#: Tried on the reference order after :data:`_SCORES` failed on every order: what
#: ``method="eviction"`` tries, so that a peak eviction reaches is one this search finds.
_REF_SCORES = tuple(s for s in SCORES if s not in _SCORES)


def low_memory_orders(ix: IndexedGraph, *, deadline: float | None = None) -> list[list[int]]:
    """The reference order and deterministic low-memory orders (greedy, and a narrow beam
    search on graphs of at most 600 ops while ``deadline`` is not past), lowest store-all
    peak first."""
    cands = [list(range(ix.n)), min_memory_order(ix, tie="ref"), min_memory_order(ix, tie="depth")]
    if ix.n <= 600 and (deadline is None or _time.perf_counter() < deadline):
        cands.append(beam_order(ix, width=max(4, 3000 // max(1, ix.n))))
    out: list[list[int]] = []
    for o in cands:
        if o not in out:
            out.append(o)
    out.sort(key=lambda o: order_peak(ix, o))
    return out


def min_peak_sequence(
    ix: IndexedGraph,
    budget_bytes: int,
    *,
    deadline: float | None = None,
    orders: list[list[int]] | None = None,
    quick: bool = False,
) -> list[int] | None:
    """A sequence within ``budget_bytes`` from the orders and scores that
    :func:`smallest_feasible_peak` searches with, or None. ``quick``: one eviction pass
    per score on the lowest-peak order only (a failing full probe runs every order and
    score, seconds on graphs of thousands of ops).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> ix = IndexedGraph.of(training_chain(5))
    >>> min_peak_sequence(ix, 10**6) == list(range(ix.n))
    True
    """
    cap = int(budget_bytes) - ix.fixed
    orders = low_memory_orders(ix) if orders is None else orders
    for o in orders:
        if order_peak(ix, o) <= cap:
            return list(o)
    if quick:
        tries = [(orders[0], sc) for sc in _SCORES]
    else:
        tries = [(o, sc) for o in orders for sc in _SCORES] + [(list(range(ix.n)), sc) for sc in _REF_SCORES]
    for o, sc in tries:
        if deadline is not None and _time.perf_counter() >= deadline:
            break
        seq = evict_sequence(ix, o, budget_bytes, score=sc, deadline=deadline)
        if seq is not None:
            return seq
    return None


def smallest_feasible_peak(graph: ComputeGraph, *, time_limit: float = 0.8) -> tuple[int, int, Hashable | None]:
    """The smallest peak found for any schedule of ``graph``, with the proven lower bound.

    Parameters
    ----------
    graph : ComputeGraph
    time_limit : float
        Seconds in all (the search stops early with the best budget reached so far; the
        store-all peak of the orders is always reached).

    Returns
    -------
    found_bytes : int
        A budget that a schedule provably fits (:func:`min_peak_sequence` reaches it).
    lower_bound_bytes : int
        No schedule peaks below this (:func:`solver.feasibility.peak_lower_bound`).
    culprit : hashable or None
        The op whose inputs, output and workspace alone force the lower bound.

    Notes
    -----
    Bisection to 0.1 % of the peak over the budget, twice: first each probe one
    eviction pass per score on the lowest-peak order, then one per order and score
    (O(log(1/0.001) x passes) each).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(6)
    >>> found, lb, culprit = smallest_feasible_peak(g)
    >>> lb <= found
    True
    """
    t0 = _time.perf_counter()
    deadline = t0 + time_limit
    lb, culprit = peak_lower_bound(graph)
    ix = IndexedGraph.of(graph)
    if ix.n == 0:
        return lb, lb, culprit
    orders = low_memory_orders(ix, deadline=deadline)
    hi = min(order_peak(ix, o) for o in orders) + ix.fixed
    hi = max(hi, lb)
    # two rounds: quick probes first (they bring a large graph's figure down in the
    # time a single failing full probe takes), then full probes below what they reached;
    # the bound itself is probed once a round has come within the tolerance of it
    for quick in (True, False):
        lo = lb  # infeasible for the heuristics
        while hi - lo > max(1, hi // 1000) and _time.perf_counter() < deadline:
            mid = (lo + hi) // 2
            if min_peak_sequence(ix, mid, deadline=deadline, orders=orders, quick=quick) is not None:
                hi = mid
            else:
                lo = mid
        if hi != lb and hi - lb <= max(1, hi // 1000) and min_peak_sequence(
                ix, lb, deadline=deadline, orders=orders, quick=quick) is not None:
            hi = lb
        if hi == lb:
            return lb, lb, culprit
    # a probe that ran out of time may have failed spuriously; hi always succeeded
    log.debug("smallest feasible peak of %s: %d B (lower bound %d B) in %.3f s",
              graph.name, hi, lb, _time.perf_counter() - t0)
    return int(hi), int(lb), culprit

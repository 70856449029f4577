"""Binomial checkpointing (revolve) for uniform chains.

Griewank, A. (1992), "Achieving logarithmic growth of temporal and spatial complexity
in reverse automatic differentiation", Optimization Methods and Software 1(1); Griewank,
A. & Walther, A. (2000), "Algorithm 799: revolve", ACM TOMS 26(1).

To reverse a chain of ``l`` steps with ``c`` checkpoint slots (the chain's input
occupies one), the least number of forward steps is

    t(l, c) = r * l - beta(c + 1, r - 1),   beta(c, r) = binomial(c + r, c),

where ``r`` is the repetition number: the unique integer with
``beta(c, r - 1) < l <= beta(c, r)``. Reversing a step includes one forward evaluation
of it that records what its backward needs; ``t`` counts the other forward steps (the
first sweep included).
"""

from __future__ import annotations

import math
from functools import lru_cache

from graphs import ComputeGraph
from solver.deadline import Deadline, OutOfTime
from solver.errors import NoScheduleFound
from solver.methods.baselines import work_deadline
from solver.methods.contract import chain_stages, store_all_fallback
from solver.plans import Stage, cheapest_fitting, forward_stages
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["beta", "repetition_number", "forward_steps", "revolve_actions", "revolve"]


def beta(c: int, r: int) -> int:
    """``binomial(c + r, c)``: the longest chain that ``c`` slots reverse with ``r`` repetitions.

    Examples
    --------
    >>> beta(2, 3)
    10
    """
    if c < 0 or r < 0:
        return 0
    return math.comb(c + r, c)


def repetition_number(l: int, c: int) -> int:
    """The unique ``r`` with ``beta(c, r - 1) < l <= beta(c, r)``.

    Examples
    --------
    >>> repetition_number(10, 2), repetition_number(11, 2)
    (3, 4)
    """
    if l < 1 or c < 1:
        raise ValueError(f"need a chain of length >= 1 and >= 1 slot, got l={l}, c={c}")
    r = 0
    while beta(c, r) < l:
        r += 1
    return r


def forward_steps(l: int, c: int) -> int | float:
    """Least number of forward steps to reverse ``l`` uniform steps with ``c`` slots.

    Griewank's closed form ``t(l, c) = r l - beta(c + 1, r - 1)``; ``inf`` when ``c = 0``
    and ``l > 1``. O(r) time.

    Parameters
    ----------
    l : int
        Chain length (steps), >= 1.
    c : int
        Checkpoint slots, the one that holds the chain's input included.

    Returns
    -------
    int or float

    Examples
    --------
    >>> forward_steps(5, 1)   # one slot: 4 + 3 + 2 + 1 + 0
    10
    >>> forward_steps(10, 2)
    20
    """
    if l <= 1:
        return 0
    if c <= 0:
        return math.inf
    r = repetition_number(l, c)
    return r * l - beta(c + 1, r - 1)


def _split(l: int, c: int) -> int:
    """Steps to advance before the first snapshot, from the closed form (O(l))."""
    if c == 1:
        return l - 1
    best_j, best = 1, math.inf
    for j in range(1, l):
        v = j + forward_steps(l - j, c - 1) + forward_steps(j, c)
        if v < best:
            best_j, best = j, v
    return best_j


def revolve_actions(l: int, c: int, *, deadline: Deadline | None = None) -> tuple[int | float, list[tuple]]:
    """The optimal number of forward steps and a schedule that reaches it.

    Parameters
    ----------
    l : int
        Chain length: steps ``0 .. l - 1``, step ``i`` maps state ``i`` to ``i + 1``.
    c : int
        Checkpoint slots; state 0 is stored in one of them at the start.
    deadline : solver.deadline.Deadline, optional
        Checked at each action (:class:`~solver.deadline.OutOfTime` once past).

    Returns
    -------
    (int, list of tuple)
        ``t(l, c)`` and the actions: ``("advance", a, b)`` runs steps ``a .. b - 1``
        without recording, ``("snapshot", b)`` stores state ``b`` in a free slot,
        ``("reverse", i)`` runs step ``i`` recording and then its backward (state ``i``
        is needed), ``("free", b)`` releases the slot of state ``b``.

    Raises
    ------
    ValueError
        ``c < 1`` or ``l < 1``.

    Notes
    -----
    O(l^2) time with the closed form for each split.

    Examples
    --------
    >>> revolve_actions(3, 2)
    (2, [('advance', 0, 1), ('snapshot', 1), ('advance', 1, 2), ('reverse', 2), ('reverse', 1), ('free', 1), ('reverse', 0)])
    """
    if l < 1 or c < 1:
        raise ValueError(f"revolve needs l >= 1 and c >= 1, got l={l}, c={c}")
    actions: list[tuple] = []
    # explicit stack of (start, length, slots) work items and ("free", b) markers
    stack: list = [("rev", 0, l, c)]
    while stack:
        if deadline is not None:
            deadline.check("planning revolve's actions")
        item = stack.pop()
        if item[0] == "free":
            actions.append(item)
            continue
        _, s, n, k = item
        if n == 1:
            actions.append(("reverse", s))
            continue
        j = _split(n, k)
        actions.append(("advance", s, s + j))
        if k == 1:
            # no slot left: reverse the last step from here, then the rest from state s
            stack.append(("rev", s, j, k))
            stack.append(("rev", s + j, 1, 0))
            continue
        actions.append(("snapshot", s + j))
        stack.append(("rev", s, j, k))
        stack.append(("free", s + j))
        stack.append(("rev", s + j, n - j, k - 1))
    steps = sum(a[2] - a[1] for a in actions if a[0] == "advance")
    return steps, actions


def stage_sequence(stages: list[Stage], actions: list[tuple], *, deadline: Deadline | None = None) -> list:
    """Turn revolve actions over the stage chain into an op sequence.

    ``advance`` runs the stages' forward ops; ``reverse`` runs a stage's forward ops then
    its backward ops; snapshots and frees are implicit (the simulator frees a copy after
    its last reader).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> st = forward_stages(training_chain(2))
    >>> stage_sequence(st, revolve_actions(2, 1)[1])
    ['f0', 'f1', 'loss', 'b1', 'f0', 'b0']
    """
    seq: list = []
    for a in actions:
        if deadline is not None:
            deadline.check("building revolve's sequence")
        if a[0] == "advance":
            for i in range(a[1], a[2]):
                seq.extend(stages[i].forward)
        elif a[0] == "reverse":
            seq.extend(stages[a[1]].forward)
            seq.extend(stages[a[1]].backward)
    return seq


@register("revolve", family="baseline", order="fixed")
def revolve(graph: ComputeGraph, budget_bytes: int, *, time_limit=None, slots: int | None = None) -> Schedule:
    """Griewank's binomial checkpointing on the stage chain, uniform stages assumed.

    The graph's stages (:func:`solver.plans.forward_stages`) are the chain's steps. The
    number of slots is searched (binary search, assuming the peak grows with the slots)
    for the most slots, hence the least recomputation, whose simulated peak fits.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds; the search builds and grades its settings in half of them and returns
        the most slots found to fit (``info["complete"]`` is False when the time ran
        out first).
    slots : int, optional
        Use exactly this many checkpoint slots.

    Returns
    -------
    Schedule
        ``info["slots"]`` and ``info["forward_steps"]`` (Griewank's ``t(l, c)``).

    Raises
    ------
    NoScheduleFound
        No number of slots fits (or the graph has no backward and store-all does not fit).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> s = revolve(training_chain(8), 7)
    >>> s.info["slots"] >= 1
    True
    """
    stages = chain_stages(graph)
    if stages is None:
        return store_all_fallback(graph, budget_bytes, method="revolve")
    n = len(stages)

    work = work_deadline(time_limit)

    @lru_cache(maxsize=None)
    def build(c: int):
        steps, actions = revolve_actions(n, c, deadline=work)
        seq = stage_sequence(stages, actions, deadline=work)
        r = simulate(graph, seq, deadline=work)
        return seq, steps, r

    def info(c, steps):
        return {"plan": "revolve", "slots": c, "forward_steps": steps, "stages": n, "order": "fixed"}

    if slots is not None:
        seq, steps, _ = build(max(1, min(int(slots), n)))
        seq, inf = cheapest_fitting(graph, [(seq, info(int(slots), steps))], budget_bytes, method="revolve")
        return Schedule(sequence=seq, method="revolve", info=inf)

    def fits(c: int) -> bool:
        _, _, r = build(c)
        return r.valid and r.peak_bytes <= budget_bytes

    # binary search on the slots, assuming the peak grows with them; one slot (the
    # longest sequence, O(S^2) steps) is built only when nothing more fits
    lo, hi = 0, n  # fits(lo) (0: none known), not fits(hi)
    complete = True
    try:
        if fits(n):
            lo = n
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
    except OutOfTime:
        complete = False
        if lo == 0:
            raise NoScheduleFound(
                f"revolve: no number of slots it tried before its time limit passed fits {budget_bytes} B "
                f"({hi} slots do not); give a longer time_limit or use a general method such as 'eviction'"
            ) from None
    if lo == 0:
        raise NoScheduleFound(
            f"revolve: even one checkpoint slot peaks at {build(1)[2].peak_bytes} B, over the budget "
            f"of {budget_bytes} B; raise the budget or use a general method such as 'eviction' or 'checkmate_milp'",
            best_peak=min(build(1)[2].peak_bytes, build(n)[2].peak_bytes),
        )
    seq, steps, _ = build(lo)
    out = info(lo, steps)
    if not complete:
        out["complete"] = False
    return Schedule(sequence=seq, method="revolve", info=out)

"""``stage_milp``: the 0/1 stage program, solved, as a schedule and a bound at once.

:func:`solver.bounds.stage_lp_bound` with ``integral=True`` is a relaxation of every
fixed-order schedule: at each boundary (the first computation of an op) the values live
must fit the budget, and what is read later is live or computed again in an interval
between boundaries. Its solution says which values each interval computes again. This
method turns that solution into a sequence -- the reference order, with each value of
interval ``k`` computed again just before its first reader in that interval (with its
inputs of the same interval, and the other projections of its op in one run), or at
the interval's end when only later intervals read it -- and lets the simulator judge
it.

Where the sequence fits the budget, it is a schedule, and the program's proven bound is
a lower bound for every fixed-order schedule: when the solver proved its optimum and the
sequence costs what the program says, the schedule is optimal for its order freedom.
Where it does not fit (the program checks memory only at its boundaries), the first
computations at or after the steps over the budget become boundaries too and the program
is solved again (row generation), and the sequence of each round is repaired with staged
relief (:func:`solver.methods.staged.relieve`) and stripped of the recomputations the
budget does not need (:func:`~solver.methods.drop.drop_recomputations`). The first
boundaries are the steps of the reference order over the budget (one per multi-output
op), the most over first.

On large graphs whose plan goes far over the budget, the whole program grows slow with
each round, so the later rounds are *held*: the intervals that the new boundaries leave
whole may compute again only what the last solution computed there, which SCIP settles
much faster, and one boundary goes to each run of steps over the budget. Held rounds
prove nothing (their programs stop at :data:`HELD_GAP`); once their plan fits, the whole
program at their boundaries, started from that plan, proves what it can in the time
left. With held rounds, the first round's program gets :data:`FIRST_SHARE` of the time,
and while rounds are held, a plan that goes over the budget less than those before it
is repaired at once, briefly. A ``soft_limit`` lets a caller give the rounds more time
only while they close in on the budget. The runs behind the constants are in
``docs/tuning.md``, under their names.
"""

from __future__ import annotations

import math
import time as _time
from typing import Hashable, Iterator, Sequence

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.indexed import IndexedGraph
from solver.methods.drop import drop_recomputations
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["stage_milp", "sequence_from_stages", "FIRST_BOUNDARIES", "MORE_BOUNDARIES", "ROUNDS", "SMALL_OPS",
           "HELD_SHARE", "HELD_SECONDS", "HELD_GAP", "HELD_OVER", "FIRST_SHARE", "REPAIR_SHARE", "ROUND_REPAIR_SHARE",
           "NEAR_OVER", "FIRST_GIVE_UP"]

#: Boundaries of the first round (the steps most over the budget) and the most each later
#: round adds: on graphs up to :data:`SMALL_OPS` ops, and on larger ones.
FIRST_BOUNDARIES = (8, 1)
MORE_BOUNDARIES = (8, 2)
#: Ops up to which a graph gets the first entries of those pairs.
SMALL_OPS = 400
#: Rounds at most.
ROUNDS = 8
#: A held round's share of the time left, and its seconds at least (see ``hold_rounds``).
HELD_SHARE = 0.3
HELD_SECONDS = 2.0
#: A held round's program stops once its solution is within this share of its optimum.
HELD_GAP = 0.05
#: Rounds are held from the first plan that peaks this many times the budget or more.
HELD_OVER = 1.25
#: On graphs past :data:`SMALL_OPS` ops with held rounds, the first round's share of the time.
FIRST_SHARE = 0.35
#: While rounds are held, the share of the time left for repairing a plan that goes over
#: the budget less than those before it.
REPAIR_SHARE = 0.1
#: A whole round's repair gets this share of the time left, unless it is the last round
#: (then the time left: no round after it needs any).
ROUND_REPAIR_SHARE = 0.3
#: Past ``soft_limit``, held rounds go on while their last plan peaks within this times the budget.
NEAR_OVER = 1.1
#: With ``give_up_over``, the rounds also end after a first plan that peaks above
#: ``give_up_over`` times this times the budget.
FIRST_GIVE_UP = 1.24


def sequence_from_stages(graph: ComputeGraph, boundaries: Sequence[Hashable],
                         redo: dict) -> list[Hashable]:
    """The sequence of a stage program's solution.

    Parameters
    ----------
    graph : ComputeGraph
    boundaries : sequence of node ids
        The program's boundaries, in the reference order.
    redo : dict
        Node id -> the intervals in which it is computed again (interval ``k`` runs
        from boundary ``k`` to boundary ``k + 1``, the last one to the end).

    Returns
    -------
    list
        The reference order with the recomputations put in: each value of interval
        ``k`` just before the first op of the interval that reads it, after its inputs
        of the same interval and beside the other projections of its op that the
        interval computes again; those that no op of the interval reads at its end.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v, b in zip("abcd", [1, 4, 3, 3]): g.add_node(v, bytes=b, time=2.0)
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d"); g.add_edge("a", "d")
    >>> sequence_from_stages(g, ["c"], {"a": [0]})
    ['a', 'b', 'c', 'a', 'd']
    """
    nodes = graph.nx.nodes
    ops = list(graph.order)
    index = {v: i for i, v in enumerate(ops)}
    marks = [index[v] for v in boundaries]
    by_interval: dict[int, set] = {}
    for v, ks in redo.items():
        for k in ks:
            by_interval.setdefault(int(k), set()).add(index[v])
    group_of = {i: nodes[ops[i]].get("group") for members in by_interval.values() for i in members}
    runs: dict = {}  # (interval, op group) -> the projections it computes again, in group order
    for k, members in by_interval.items():
        for i in members:
            if group_of[i] is not None:
                runs.setdefault((k, group_of[i]), []).append(i)
    for run in runs.values():
        run.sort(key=lambda j: (nodes[ops[j]].get("group_index", 0), j))
    seq: list[Hashable] = []
    placed: set = set()

    def entry(i: int, k: int) -> tuple[list[int], Iterator[int]]:
        """The run of ``i`` in interval ``k`` (marked placed), and its inputs computed
        again in the same interval."""
        run = [i] if group_of[i] is None else runs[(k, group_of[i])]
        placed.update((j, k) for j in run)
        members = by_interval[k]
        return run, iter([index[u] for j in run for u in graph.op_preds(ops[j]) if index[u] in members])

    def put(i: int, k: int) -> None:
        """Append the run of ``i`` after the runs of its inputs of interval ``k`` (depth
        first, without recursion: a chain may be thousands of ops long)."""
        if (i, k) in placed:
            return
        stack = [entry(i, k)]
        while stack:
            run, todo = stack[-1]
            p = next((p for p in todo if (p, k) not in placed), None)
            if p is None:
                stack.pop()
                seq.extend(ops[j] for j in run)
            else:
                stack.append(entry(p, k))

    def flush(k: int) -> None:
        for i in sorted(by_interval.get(k, ())):
            put(i, k)

    k = -1
    for t, v in enumerate(ops):
        if k + 1 < len(marks) and t == marks[k + 1]:
            if k >= 0:
                flush(k)
            k += 1
        elif k >= 0 and k in by_interval:
            for u in graph.op_preds(v):
                if index[u] in by_interval[k]:
                    put(index[u], k)
        seq.append(v)
    if k >= 0:
        flush(k)
    return seq


def _repaired(graph: ComputeGraph, ix: IndexedGraph, sequence: list, budget: int, deadline: float) -> list | None:
    """``sequence`` brought within ``budget`` by staged relief, its unneeded
    recomputations dropped; None when relief cannot."""
    from solver.methods.staged import StagedPlan, relieve

    index = {v: i for i, v in enumerate(ix.ids)}
    cur = [index[v] for v in sequence]
    seen: set = set()
    order = [i for i in cur if not (i in seen or seen.add(i))]
    plan = StagedPlan.of_sequence(ix, order, cur)
    if not relieve(plan, int(budget) - ix.fixed, deadline=deadline):
        return None
    ids = drop_recomputations(graph, [ix.ids[i] for i in plan.sequence()], budget, deadline=deadline)
    r = simulate(graph, ids)
    return ids if r.valid and r.peak_bytes <= budget else None


@register("stage_milp", family="exact", order="fixed")
def stage_milp(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
               first: int | None = None, more: int | None = None, rounds: int = ROUNDS,
               enough: float | None = None, hold_rounds: bool | None = None,
               soft_limit: float | None = None, give_up_over: float | None = None) -> Schedule:
    """The 0/1 stage program at the steps over the budget, solved, as a schedule, with
    boundaries added where its sequence goes over the budget (see the module).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds in all (default 10); each round's program gets the time left.
    first, more : int, optional
        Boundaries of the first round, and at most added by each later one (default
        by the graph's size: :data:`FIRST_BOUNDARIES`, :data:`MORE_BOUNDARIES`).
    rounds : int
        Rounds at most. The last one's repair gets the time left (``rounds=1``: the
        first program's plan, repaired: on 32-layer captures, schedules within 0.3-5 %
        of its bound in 1-3 s).
    enough : float, optional
        Stop once the proven bound reaches this cost (a schedule known elsewhere costs
        little more than it).
    hold_rounds : bool, optional
        Once a round's plan peaks above :data:`HELD_OVER` times the budget, solve
        each later round's program with the intervals that its new boundaries leave
        whole held to what the last solution computes again there (a restriction:
        faster, and it proves nothing), for at most
        :data:`HELD_SHARE` of the time left (at least :data:`HELD_SECONDS`); where
        its plan fits, the whole program at those boundaries, started from that plan,
        gets the time left. With held rounds, the first round's program gets
        :data:`FIRST_SHARE` of the time (and the same program the time left, where it
        gave no solution in it), and while rounds are held, a plan over the budget by
        less than those before it is repaired for :data:`REPAIR_SHARE` of the time left. Default: on
        graphs of more than :data:`SMALL_OPS` ops.
    soft_limit : float, optional
        Seconds after which no round starts, except a held one whose last plan peaked
        within :data:`NEAR_OVER` times the budget and the whole program after a held
        plan that fits: those may go on to ``time_limit``. Whole rounds before them get
        at most the time left to ``soft_limit``. Default: ``time_limit``.
    give_up_over : float, optional
        End the rounds after a held round whose plan peaks above this times the budget,
        or after the first plan to hold from where it peaks above this times
        :data:`FIRST_GIVE_UP` times the budget (its plan repaired, as every held plan
        closer to the budget than those before it): a caller with other searches to run
        gives them the time. Default: never.

    Returns
    -------
    Schedule
        The cheapest sequence within the budget (first runs in the reference order);
        ``lower_bound`` is the best bound the programs proved, for every fixed-order
        schedule; ``info["optimal"]`` is True when the schedule costs that bound;
        ``info["rounds"]`` says, per round, how many boundaries its program had, the
        bound it proved (None: nothing in its time, or a held round), the cost of its
        sequence where that fitted the budget as it was, its peak, the seconds of the
        program and the simulation, and whether it was held; ``info["boundaries"]``, the
        boundaries of the last program, with those that the next round would add where
        the rounds stopped over the budget (a fixed-order bound there is the one the
        next round would prove: :func:`solver.bounds.fixed_order_bound`'s
        ``boundaries``).

    Raises
    ------
    NoScheduleFound
        No round gave a sequence within the budget, even repaired (its ``lower_bound``
        is the programs' best bound, for every fixed-order schedule).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(6)
    >>> s = stage_milp(g, 9)
    >>> s.info["optimal"], simulate(g, s.sequence).peak_bytes <= 9
    (True, True)
    """
    from solver.bounds import over_budget_steps, reference_facts, step_excess
    from solver.deadline import Deadline

    limit = 10.0 if time_limit is None else float(time_limit)
    deadline = Deadline(limit)
    soft = Deadline(limit if soft_limit is None else min(limit, float(soft_limit)))
    ix = IndexedGraph.of(graph)
    ops, index, size, last_read = reference_facts(graph)
    base = graph.total("time")
    excess = step_excess(graph, ops, index, size, last_read, int(budget_bytes) - graph.fixed_bytes)
    over = over_budget_steps(graph, ops, excess)
    if not over:
        return Schedule(sequence=list(ops), method="stage_milp", lower_bound=base,
                        info={"order": "fixed", "optimal": True, "rounds": 0})
    small = len(ops) <= SMALL_OPS
    hold_rounds = not small if hold_rounds is None else bool(hold_rounds)
    first = FIRST_BOUNDARIES[0 if small else 1] if first is None else first
    search = _Rounds(graph, budget_bytes, ix, ops, index, limit=limit, deadline=deadline, soft=soft,
                     hold_rounds=hold_rounds,
                     more=MORE_BOUNDARIES[0 if small else 1] if more is None else more,
                     enough=enough, give_up_over=give_up_over)
    search.marks = sorted(over[:max(1, first)])
    search.run(max(1, rounds))
    return search.schedule()


class _Rounds:
    """The rounds of :func:`stage_milp`: each solves the program at ``marks``, turns its
    solution into a sequence, keeps or repairs it, and adds boundaries where it goes
    over the budget (:meth:`round`)."""

    def __init__(self, graph: ComputeGraph, budget: int, ix: IndexedGraph, ops: list, index: dict, *, limit: float,
                 deadline, soft, hold_rounds: bool, more: int, enough: float | None,
                 give_up_over: float | None) -> None:
        self.graph, self.budget, self.ix, self.ops, self.index, self.limit = graph, budget, ix, ops, index, limit
        self.deadline, self.soft = deadline, soft  # the time limit, and the soft_limit
        self.base = graph.total("time")
        self.hold_rounds, self.more, self.enough, self.give_up_over = hold_rounds, more, enough, give_up_over
        self.marks: list = []  # the boundaries of the next program, as op indices
        self.bound, self.best, self.best_cost = self.base, None, math.inf
        self.history: list = []
        self.closest = math.inf  # the lowest peak of a held round's plan so far
        self.repair_seconds = 0.0  # the longest repair so far (its setup runs whatever its share)
        self.held = None  # the intervals that a held round keeps as the last solution had them
        self.hint = None  # a held round's solution that fitted: the start of the last round
        self.capped = hold_rounds  # the first round's program gets FIRST_SHARE of the time
        self.last_peak = math.inf  # the peak of the last round's plan
        self.after = 0.0  # the longest a round took after its program (its sequence simulated, repaired)
        self.solved_at = None

    def run(self, rounds: int) -> None:
        """Rounds until one says stop, the time is spent, or ``rounds`` are done."""
        for round_ in range(rounds):
            if self.solved_at is not None:
                self.after = max(self.after, _time.perf_counter() - self.solved_at)
            closing_in = self.hint is not None or (self.held is not None
                                                   and self.last_peak <= NEAR_OVER * self.budget)
            if self.deadline.expired() or (round_ > 0 and self.soft.expired() and not closing_in):
                break
            if not self.round(last=round_ == rounds - 1):
                break

    def program(self, solution: dict) -> float | None:
        """The program at ``marks``, solved in this round's time (held, from a hint, the
        first round's share, or the time left), ``solution`` filled."""
        from solver.bounds import stage_lp_bound

        deadline = self.deadline
        if self.held is not None:
            seconds = min(deadline.left(), max(HELD_SECONDS, HELD_SHARE * deadline.left()))
        elif self.hint is not None:
            seconds = deadline.left()
        else:
            seconds = FIRST_SHARE * self.soft.left() if self.capped else self.soft.left()
        seconds = min(seconds, deadline.left() - self.after)  # what follows the program ends in time too
        return stage_lp_bound(self.graph, self.budget, boundaries=[self.ops[t] for t in self.marks], integral=True,
                              time_limit=max(0.05, seconds), solution=solution, hold=self.held, hint=self.hint,
                              gap=None if self.held is None else HELD_GAP)

    def record(self, started: float, bound: float | None, cost: float | None, peak: int | None) -> None:
        self.history.append({"boundaries": len(self.marks), "bound": bound, "cost": cost, "peak": peak,
                             "seconds": _time.perf_counter() - started, "held": self.held is not None})

    def round(self, *, last: bool) -> bool:
        """One round; whether another may follow."""
        solution: dict = {}
        started = _time.perf_counter()
        lb = self.program(solution)
        self.solved_at = _time.perf_counter()
        self.hint = None
        first_capped, self.capped = self.capped, False
        held = self.held
        if held is not None and (lb is None or math.isinf(lb) or not solution):
            # nothing that holds those intervals, in its time: the whole program instead
            self.record(started, None, None, None)
            self.held = None
            return True
        if held is None and lb is not None:
            self.bound = max(self.bound, lb)  # (a held round's value bounds nothing)
        if math.isinf(self.bound):
            raise NoScheduleFound(f"stage_milp: no fixed-order schedule of {self.graph.name or 'the graph'} fits "
                                  f"{self.budget} B (the stage program is infeasible)")
        if not solution:
            self.record(started, lb, None, None)
            return first_capped  # none in the first round's share: the same program, with the time left
        seq = sequence_from_stages(self.graph, solution["boundaries"], solution["redo"])
        r = simulate(self.graph, seq)
        fits = r.valid and r.peak_bytes <= self.budget
        self.last_peak = r.peak_bytes if r.valid else math.inf
        self.record(started, lb if held is None else None, r.cost if fits else None, r.peak_bytes)
        if fits and r.cost < self.best_cost:
            self.best, self.best_cost = seq, r.cost
        # far over the budget: many rounds to go, and the whole program grows slow with
        # each; hold from now on
        holding = self.hold_rounds and not fits and (held is not None or r.peak_bytes > HELD_OVER * self.budget)
        if fits or not r.valid:
            following = None
        else:
            self.repair(seq, r.peak_bytes, holding=holding, last=last)
            # where the next round puts its boundaries (a caller's bound may use them too)
            following = _next_marks(seq, r.memory_curve, self.marks, self.index, self.budget, one_per_run=holding,
                                    more=self.more)
        return self.next_round(fits, r.valid, r.peak_bytes, holding, following, solution)

    def repair(self, seq: list, peak: int, *, holding: bool, last: bool) -> None:
        """A plan over the budget: repaired, unless rounds are held and it comes no closer
        to the budget than those before it (then briefly)."""
        if not holding:
            # the time left where no round follows (a caller asking for one round: the
            # plan of the first program, repaired)
            self.repair_into(seq, share=1.0 if last else ROUND_REPAIR_SHARE)
        elif peak < self.closest:
            self.closest = peak  # the closest to the budget so far: repaired, briefly
            self.repair_into(seq, share=REPAIR_SHARE)

    def repair_into(self, seq: list, share: float) -> None:
        """``seq`` repaired within ``share`` of the time left; kept where it is the best."""
        if self.deadline.left() < self.repair_seconds:
            return  # it would not end in time
        started = _time.perf_counter()
        fixed = _repaired(self.graph, self.ix, seq, self.budget, started + max(0.0, share * self.deadline.left()))
        if fixed is not None:
            c = simulate(self.graph, fixed).cost
            if c < self.best_cost:
                self.best, self.best_cost = fixed, c
        self.repair_seconds = max(self.repair_seconds, _time.perf_counter() - started)

    def next_round(self, fits: bool, valid: bool, peak: int, holding: bool, following: list | None,
                   solution: dict) -> bool:
        """Whether a round follows, and what it holds and where its boundaries are."""
        held, budget = self.held, self.budget
        if not fits and self.give_up_over is not None and (held is not None or holding):
            # a held plan still far over the budget, or a first plan so far over it that
            # the held rounds would not bring it near: the caller's other searches get the time
            if peak > self.give_up_over * (1.0 if held is not None else FIRST_GIVE_UP) * budget:
                self.marks = following or self.marks
                return False
        if ((self.best is not None and _closed(self.best_cost, self.bound, self.base))
                or (self.enough is not None and self.bound >= self.enough)):
            return False
        if fits and held is not None:
            # the held rounds found boundaries where the program's plan fits: the whole
            # program there, from that plan, proves what it can in the time left
            self.held, self.hint = None, solution["redo"]
            return True
        if fits or not valid:
            return False  # the program's best fits: more boundaries cannot lower its cost
        self.held = _intervals(self.ops, self.index, solution) if holding else None
        if not following:
            return False
        self.marks = following
        return True

    def schedule(self) -> Schedule:
        """The cheapest sequence within the budget, with the programs' best bound."""
        ops, base = self.ops, self.base
        if self.best is None:
            raise NoScheduleFound(f"stage_milp found no schedule of {self.graph.name or 'the graph'} within "
                                  f"{self.budget} B in {self.limit:g} s ({len(self.history)} rounds); "
                                  "give a longer time_limit", lower_bound=self.bound if self.bound > base else None)
        bound = min(self.bound, self.best_cost)
        return Schedule(sequence=list(self.best), method="stage_milp", lower_bound=bound,
                        info={"order": "fixed", "optimal": _closed(self.best_cost, bound, base),
                              "rounds": self.history, "boundaries": [ops[t] for t in self.marks]})


def _next_marks(seq: list, memory_curve, marks: list, index: dict, budget: int, *, one_per_run: bool,
                more: int) -> list | None:
    """``marks`` with the first computations at or after the steps of ``seq`` over
    ``budget`` added (the most over it first, at most ``more``; with ``one_per_run``,
    one per run of steps over the budget, the worst runs first: a plan that goes over in
    several places needs a boundary at each), or None when none is new."""
    seen: set = set()
    first_at = []  # (position in seq, op index) of each first computation
    for pos, v in enumerate(seq):
        if v not in seen:
            seen.add(v)
            first_at.append((pos, index[v]))
    new: dict = {}  # op index -> the most its step is over the budget
    region: dict = {}  # run of steps over the budget -> its op most over it
    j, run, over_before = 0, -1, False
    for pos, mem in enumerate(memory_curve):
        if mem <= budget:
            over_before = False
            continue
        run += 0 if over_before else 1
        over_before = True
        while j < len(first_at) and first_at[j][0] < pos:
            j += 1
        if j < len(first_at):
            t = first_at[j][1]
            if t not in marks:
                new[t] = max(new.get(t, 0), int(mem) - int(budget))
                if run not in region or new[t] > new[region[run]]:
                    region[run] = t
    if not new:
        return None
    pool = region.values() if one_per_run else new
    return sorted(set(marks) | set(sorted(pool, key=lambda t: -new[t])[:max(1, more)]))


def _intervals(ops: list, index: dict, solution: dict) -> dict:
    """A solution's intervals, ``(first boundary, next boundary or None) -> what it
    computes again there``: the ``hold`` of :func:`solver.bounds.stage_lp_bound`."""
    marks = solution["boundaries"]
    out: dict = {(v, marks[k + 1] if k + 1 < len(marks) else None): set() for k, v in enumerate(marks)}
    keys = list(out)
    for v, ks in solution["redo"].items():
        for k in ks:
            out[keys[k]].add(v)
    return out


def _closed(cost: float, bound: float, base: float) -> bool:
    """The cost is the bound, to the programs' tolerance (a millionth of the extra)."""
    return cost - bound <= 1e-5 * (cost - base) + 1e-12 * base

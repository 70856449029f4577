"""``method="auto"``: pick solvers by graph shape and size, keep the best simulated schedule.

The recipe, cheapest first:

1. store-all, when the reference order fits (no extra compute: optimal);
2. ``eviction`` on the reference order (fast, near-optimal on training graphs); where
   it finds nothing, or not all its passes finish, on a training graph past
   ``stage_milp_max_ops`` ops,
   ``chen_sqrt`` and then ``chain_dp`` over the chain of stages; on training
   graphs past ``stage_milp_max_ops`` ops, one round of
   ``stage_milp`` (the first program's plan, repaired) with
   ``stage_milp_one_share`` of the time left, when that comes to
   ``stage_milp_one_seconds`` at least (without a time limit, unless
   ``exact=False``, for at most ``stage_milp_one_unlimited_seconds``);
3. ``chain_dp`` on training graphs (optimal for chains of stages), ``lp_eviction``
   (eviction guided by the stage LP's plan, with its unneeded recomputations removed);
   with a time limit, on training graphs up to ``stage_milp_max_ops`` ops,
   ``stage_milp``: the 0/1 stage program solved and turned into a schedule, which
   comes with the program's proven bound (optimal when the two meet), with
   ``stage_milp_share`` of the time left; it stops once its bound puts the best
   schedule so far within ``gap_tolerance``, and its held rounds end after a plan above
   ``stage_milp_give_up`` times the budget; then ``cover`` (which forward values the
   backward keeps, as a covering MILP over the steps over the budget), then ``block_dp``
   (each distinct layer block solved exactly, the blocks composed by a DP over the
   chain) where one block repeats ``block_dp_min_repeats`` times;
   then staged recomputation (:func:`~solver.methods.staged.staged_sequence`) on the
   reference order, on graphs up to ``staged_max_ops`` ops: it plans the whole
   memory curve;
4. when nothing fits yet, staged recomputation on the low-memory orders (it fits
   budgets where on-demand eviction thrashes); then ``order_search`` (free order) where
   order freedom matters: forward-only graphs, or training graphs whose greedy low-memory
   order lowers the reference peak; then the low-memory recipe of
   :func:`~solver.methods.minpeak.min_peak_sequence`, which reaches every budget that
   :class:`~solver.InfeasibleBudget` reports; and on graphs of at most
   ``brute_force_max_ops`` ops, the exhaustive search over every schedule;
5. an exact method (``cpsat``, ``checkmate_milp``) on small graphs when a time limit
   leaves time, warm-started from the best schedule so far; the next one runs only
   while the proven gap is above ``gap_tolerance``;
6. on the winner, :func:`drop_recomputations`: the heuristics plan with a conservative
   memory model, and the recomputations the simulator shows the budget does not need go.
7. the gap: first the bound valid in any order, :func:`solver.bounds.free_order_bound`
   (the stage LP at ops placed by the DAG alone; with a time limit, not on graphs past
   ``bound_limited_max_ops`` ops whose winner keeps the reference order with
   ``stage_milp``'s bound known, where the search below needs the time); then, when
   the winner keeps the reference order, the fixed-order lower bound of
   :func:`solver.bounds.fixed_order_bound` (forced recomputation; the 0/1 stage
   program first where the best schedule so far comes closest to the budget
   (:func:`solver.bounds.tight_boundaries`) and where ``stage_milp``'s next round would
   put its boundaries, each where its LP beats the LP at the step most over the
   budget; an LP at each of the steps most over the budget, then the 0/1 stage program
   at the best of them),
   then, on small graphs, the MILP's bound. Each stops once its bound closes the gap
   to ``gap_tolerance``. While the stage bounds leave the gap open,
   :func:`solver.methods.lns.improve_sequence`, a large neighbourhood search over the
   winner's recomputations that keeps its order of first runs, takes
   ``lns_share`` of the time left before the MILP's bound (on small graphs, before
   the exact methods of step 5, as candidate ``lns``). With a time limit, on graphs
   past ``bound_limited_max_ops`` ops whose winner keeps the reference order, the
   fixed-order bound runs in a second thread beside the search, the two with
   ``parallel_share`` of the time left (the solvers of the bound release the
   interpreter while they solve), and the search stops once the bound closes the gap.
   With a time limit, on graphs
   past ``stage_milp_max_ops`` ops, a bound does not start with under
   ``min_slice`` seconds left once one is known (its setup alone would run past the
   limit there).

Once a proven bound puts the best schedule within ``gap_tolerance``, the heuristics on
the reference order of step 3 no longer run.

Every candidate is graded by :func:`solver.simulate`; the cheapest valid one within the
budget wins (fewest steps on ties). ``schedule.info["auto"]`` records what was tried,
what won and why; ``schedule.method`` reads ``"auto:<winner>"``.

The sizes and time slices named above in lower case are fields of the module's tuning
record (``_Tuning``, not part of the API); docs/tuning.md has the runs behind them.
"""

from __future__ import annotations

import logging
import math
import threading
import time as _time
from dataclasses import dataclass
from typing import Sequence

from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound, SolverError
from solver.schedule import Schedule
from solver.methods.drop import drop_recomputations
from solver.simulate import simulate

__all__ = ["solve_auto", "drop_recomputations", "GAP_TOLERANCE"]

log = logging.getLogger(__name__)

#: Default ``gap_tolerance``: auto stops proving once the gap on the extra compute is below.
GAP_TOLERANCE = 0.01


@dataclass(frozen=True)
class _Tuning:
    """The sizes and time slices of ``auto``'s recipe. Each field says what it controls;
    the runs that set them are in docs/tuning.md, under their names."""

    #: Graphs with at most this many ops get an exact method when time is left.
    exact_max_ops: int = 120
    #: Seconds at most for proving, where no heuristic fits a small graph, that no
    #: schedule does (:func:`solver.feasibility.last_computed_rules_out`) before the exact
    #: methods are tried with the rest of the limit.
    proof_seconds: float = 0.5
    #: Training graphs with at most this many ops also try ``chain_dp``.
    chain_dp_max_ops: int = 120
    #: Order search runs on a training graph only when a greedy low-memory order lowers the
    #: reference store-all peak by more than this fraction.
    order_gain: float = 0.01
    #: Order search always runs on graphs this small (it is cheap there).
    small_ops: int = 60
    #: Where nothing else fits a graph of at most this many ops, the exhaustive search over
    #: every schedule in any order (:func:`~solver.methods.bruteforce.brute_force`) settles it.
    brute_force_max_ops: int = 12
    #: Without a time limit, the fixed-order lower bound is only attempted up to this size.
    bound_max_ops: int = 100
    #: With a time limit, the bound is attempted up to this size.
    bound_limited_max_ops: int = 400
    #: Without a time limit, seconds at most for ``lp_eviction``.
    lp_eviction_seconds: float = 3.0
    #: Without a time limit, seconds at most for dropping the winner's unneeded recomputations.
    drop_seconds: float = 1.0
    #: Without a time limit, seconds at most for ``block_dp``.
    block_dp_seconds: float = 2.0
    #: ``block_dp`` runs when one block structure repeats at least this often.
    block_dp_min_repeats: int = 8
    #: Without a time limit, seconds at most for the LP bounds at single boundaries.
    lp_bound_seconds: float = 2.0
    #: Share of the time left that each stage bound may take before the exact methods.
    early_bound_share: float = 0.1
    #: Share of the time left for :func:`solver.methods.milp.lower_bound` before the exact
    #: methods (when the stage bounds leave the gap open).
    milp_bound_share: float = 0.6
    #: Seconds left at least, before the stage bounds, for that bound to run before the
    #: exact methods.
    early_milp_seconds: float = 6.0
    #: Seconds below which a step that would start is skipped (it could not finish in time).
    min_slice: float = 0.3
    #: Share of the time left that staged recomputation may take when nothing fits before it.
    staged_share: float = 0.4
    #: Without a time limit, seconds at most for staged recomputation (a budget that nothing
    #: reaches is then reported within seconds).
    staged_seconds: float = 3.0
    #: Without a time limit, seconds at most for ``cover``.
    cover_seconds: float = 1.0
    #: Share of the time left that the search over the winner's recomputations
    #: (:func:`solver.methods.lns.improve_sequence`) may take where the stage bounds leave
    #: the gap open.
    lns_share: float = 0.4
    #: With a time limit, past ``bound_limited_max_ops`` ops, the share of the time left
    #: that the fixed-order bound and the search over the winner's recomputations share,
    #: side by side, after the schedules.
    parallel_share: float = 0.95
    #: Schedules that search takes turns on: the winner and the next cheapest candidates
    #: that keep the reference order.
    lns_starts: int = 3
    #: Without a time limit, seconds at most for that search.
    lns_seconds: float = 1.0
    #: Share of the time left (and seconds at most) for each of the chain-family methods on a
    #: training graph that eviction does not fit.
    chain_rescue_share: float = 0.5
    chain_rescue_seconds: float = 2.0
    #: Training graphs with at most this many ops get ``stage_milp`` when a time limit is
    #: given (its programs grow with the steps over the budget).
    stage_milp_max_ops: int = 1000
    #: Share of the time left for ``stage_milp``, and the share it may take while its held
    #: rounds close in on the budget (its ``soft_limit`` and ``time_limit``).
    stage_milp_share: float = 0.7
    stage_milp_more_share: float = 0.9
    #: ``stage_milp``'s held rounds end, in ``auto``, after one whose plan peaks above this
    #: times the budget (its ``give_up_over``), and the search after them gets the time.
    stage_milp_give_up: float = 1.17
    #: On training graphs past ``stage_milp_max_ops`` ops, the share of the time left for
    #: one round of ``stage_milp`` (the first program's plan, repaired), and the seconds
    #: that share must come to for the round to run.
    stage_milp_one_share: float = 0.8
    stage_milp_one_seconds: float = 1.0
    #: Without a time limit, seconds at most for that round.
    stage_milp_one_unlimited_seconds: float = 3.0
    #: Staged recomputation plans on a stage-by-value table: graphs up to this many ops.
    staged_max_ops: int = 3000
    #: With a time limit, on graphs past ``stage_milp_max_ops`` ops, the share of the
    #: limit (at most ``tail_seconds``) that the search leaves to the winner's last steps
    #: (dropping its unneeded recomputations, simulating the result) and to the setup of
    #: its first bound.
    tail_share: float = 0.25
    tail_seconds: float = 1.0


#: The tuning ``auto`` runs with (tests swap it with :func:`dataclasses.replace`).
_TUNING = _Tuning()


def _registered(name: str):
    from solver.registry import registered as methods

    info = methods().get(name)
    return info


def _default_limit(n: int) -> float:
    return 10.0 if n <= 300 else 60.0


def solve_auto(graph: ComputeGraph, budget: int, *, time_limit: float | None = None, exact: bool | None = None,
               bound: bool = True, drop: bool = True, gap_tolerance: float = GAP_TOLERANCE,
               gap_step_share: float = 0.0, starts: Sequence[Schedule] | None = None) -> Schedule:
    """Pick methods by graph shape and size; return the best simulated valid schedule.

    Parameters
    ----------
    graph : ComputeGraph
    budget : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds in all, kept to within 10 % or a second whatever the graph. Without one,
        auto answers in seconds (2-12 s on graphs of 5,000-10,000 ops): short heuristic
        runs; of the exact methods only one round of ``stage_milp`` on training graphs
        past 1,000 ops (at most 3 s); capped slices for the stage bounds, and the MILP's
        bound only up to 100 ops. With one, fast heuristics run first; exact methods and
        the bound get what is left.
    exact : bool, optional
        False skips the exact methods (default: they run with a time limit).
    bound : bool
        False skips the lower bound.
    drop : bool
        False keeps the winner's recomputations as they are.
    gap_tolerance : float
        Default :data:`GAP_TOLERANCE`, 1 %: once the proven gap on the extra compute
        is at most this, auto stops searching and proving and returns.
    gap_step_share : float
        Auto also stops once the proven gap is at most this share of the store-all
        compute (the step's own), however large a share of a small extra compute it is
        (default 0: the gap on the extra compute alone decides).
    starts : sequence of Schedule, optional
        Schedules to begin from (each is a candidate that keeps its ``method`` name; on
        a training graph the schedule of checkpointing every layer block,
        :func:`~solver.methods.blocks.per_block_schedule`, always is).

    Returns
    -------
    Schedule
        ``method == "auto:<winner>"``; ``info["auto"]`` has ``picked``, ``why`` and
        ``tried`` (cost or error of every candidate). ``lower_bound`` is set only when
        it holds for the schedule's order freedom: a bound valid in any order
        (``info["bound_scope"] == "free order"``), one that holds for every schedule
        that keeps the reference order, as the winner does (``"fixed order"``), or the store-all cost
        when the schedule has no extra compute (``"any order"``); with extra compute
        and no better bound, the store-all cost (``"free order"``: a gap of 100 %).
        When the winner reorders, a fixed-order bound goes to
        ``info["fixed_order_lower_bound"]``.

    Raises
    ------
    NoScheduleFound
        No candidate fits (the budget is above the proven lower bound).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(5)
    >>> s = solve_auto(g, 7)
    >>> s.method.startswith("auto:"), s.info["auto"]["picked"] == s.method[5:]
    (True, True)
    """
    portfolio = _Portfolio(graph, budget, time_limit=time_limit, exact=exact, bound=bound, drop=drop,
                           gap_tolerance=gap_tolerance, gap_step_share=gap_step_share, starts=starts)
    return portfolio.solve()


class _Portfolio:
    """One ``auto`` solve: the clock, the candidates graded so far and the best of them,
    the bounds proven; then the winner and its bound. :meth:`solve` runs the recipe of the
    module docstring, one method per step."""

    def __init__(self, graph: ComputeGraph, budget: int, *, time_limit: float | None, exact: bool | None,
                 bound: bool, drop: bool, gap_tolerance: float, gap_step_share: float,
                 starts: Sequence[Schedule] | None) -> None:
        from solver.indexed import IndexedGraph, order_peak

        self.t0 = _time.perf_counter()
        self.tuning = tuning = _TUNING
        self.graph, self.budget = graph, budget
        self.ix = IndexedGraph.of(graph)
        self.n = n = self.ix.n
        self.unlimited = time_limit is None
        self.limit = _default_limit(n) if self.unlimited else float(time_limit)
        self.deadline = self.t0 + self.limit
        self.asked_exact = exact
        self.use_exact = (not self.unlimited) if exact is None else bool(exact)
        self.use_bound, self.use_drop = bound, drop
        self.given = list(starts or ())
        self.tolerance = float(gap_tolerance)
        if not self.tolerance >= 0:
            raise ValueError(f"gap_tolerance must be a fraction >= 0, got {self.tolerance!r}")
        self.step_share = float(gap_step_share)
        if not self.step_share >= 0:
            raise ValueError(f"gap_step_share must be a fraction >= 0, got {self.step_share!r}")
        self.training = bool(graph.backward_nodes())
        self.tried: dict[str, object] = {}  # the cost, or why not, of every candidate
        self.reorders: dict[str, bool] = {}  # whether each candidate leaves the reference order
        self.best: Schedule | None = None  # the best candidate so far, its key and why it won
        self.best_key: tuple[float, int] | None = None
        self.why = ""
        self.found_at: float | None = None  # seconds until the winning schedule was found
        self.kept: list = []  # (cost, name, sequence) of every valid candidate in the reference order
        self.proven: float | None = None  # the best fixed-order bound an exact candidate proved
        self.binding: list = []  # where stage_milp's programs found the budget binding (its boundaries)
        self.found: dict = {}  # "free", "fixed", "milp": the bounds once computed (None: none in time)
        # the search leaves the tail to the winner's last steps (see tail_share)
        small = self.unlimited or n <= tuning.stage_milp_max_ops
        self.reserve = 0.0 if small else min(tuning.tail_seconds, tuning.tail_share * self.limit)
        self.base = graph.total("time")
        self.ref_peak = order_peak(self.ix, range(n))
        # the winner's, once the search ends: its key, its bound and the bound's scope
        self.key: tuple[float, int] = (math.inf, 0)
        self.bound: float | None = None
        self.scope = "fixed order"
        self.close = False
        self.fixed_scope = False
        self.picked = ""
        self.elapsed = 0.0

    # --- the clock and the candidates -------------------------------------------------

    def left(self) -> float:
        return self.deadline - self.reserve - _time.perf_counter()

    def has_time(self) -> bool:
        """Whether a step with a slice of at least ``min_slice`` may start: on graphs past
        ``stage_milp_max_ops`` ops with a time limit, only while that much is left (there
        its setup alone takes tenths of a second); otherwise always."""
        return self.unlimited or self.n <= self.tuning.stage_milp_max_ops or self.left() > self.tuning.min_slice

    def extra(self) -> bool:
        """Whether the best schedule so far (if any) has extra compute."""
        return self.best is None or self.best_key[0] > self.base * (1 + 1e-12)

    def enough(self) -> float:
        """The bound that puts the best schedule of the search within the gap tolerance."""
        return self.best_key[0] - self.allowed_gap(self.best_key[0])

    def allowed_gap(self, cost: float) -> float:
        """The gap that ends the search for a schedule of ``cost``: the tolerance's
        share of its extra compute, or the step share of the store-all compute."""
        return max(self.tolerance * (cost - self.base), self.step_share * self.base)

    def keeps_order(self) -> bool:
        """Whether the best schedule so far keeps the reference order."""
        return not self.reorders.get(self.best.method, True)

    def close_enough(self) -> bool:
        """A proven bound (fixed-order ones when the best keeps the reference order) puts
        the best schedule within the gap tolerance."""
        if self.best is None:
            return False
        bounds = [self.found.get("free")]
        if self.keeps_order():
            bounds += [self.best.lower_bound, self.proven, self.found.get("fixed"), self.found.get("milp")]
        bounds = [b for b in bounds if b is not None]
        if not bounds:
            return False
        return max(max(bounds), self.base) >= self.enough() - 1e-9

    def consider(self, name: str, sched: Schedule | None, why: str) -> None:
        """Grade ``sched`` with the simulator; keep it if it is the best so far."""
        if sched is None:
            return
        if name == "stage_milp":
            self.binding = sched.info.get("boundaries") or []
        r = simulate(self.graph, sched)
        self.reorders[name] = _reorders(self.ix, sched.sequence)
        if not r.valid or r.peak_bytes > self.budget:
            self.tried[name] = f"rejected: {'invalid' if not r.valid else 'over budget'}"
            log.warning("auto: %s returned %s on %s", name, r.error or "a schedule over the budget",
                        self.graph.name or "the graph")
            return
        self.tried[name] = r.cost
        if not self.reorders[name] and not sched.offloads:
            self.kept.append((r.cost, name, list(sched.sequence)))
        if sched.lower_bound is not None and sched.info.get("order") == "fixed" and math.isfinite(sched.lower_bound):
            self.proven = max(float(sched.lower_bound), self.proven or -math.inf)
        key = (r.cost, len(sched.sequence))
        if self.best_key is None or key < self.best_key:
            self.best, self.best_key, self.why = sched, key, why
            self.found_at = _time.perf_counter() - self.t0

    def run(self, name: str, why: str, **kw) -> None:
        """Run the registered method ``name`` and consider its schedule; record its error."""
        info = _registered(name)
        if info is None:
            return
        try:
            self.consider(name, info.fn(self.graph, self.budget, **kw), why)
        except (SolverError, InfeasibleBudget, ValueError, NotImplementedError, MemoryError) as exc:
            self.tried[name] = f"{type(exc).__name__}: {exc}"[:200]
            lb = getattr(exc, "lower_bound", None)
            if isinstance(exc, NoScheduleFound) and info.order == "fixed" and lb is not None and math.isfinite(lb):
                self.proven = max(float(lb), self.proven or -math.inf)  # what it proved holds without a schedule

    def stage_bound(self, scope: str, seconds: float) -> float | None:
        """The bound of ``scope``, computed once, stopping where it closes the gap of the
        best schedule of the search: "free" and "fixed", the stage bounds of either order
        freedom; "milp", the fixed-order bound of :func:`solver.methods.milp.lower_bound`
        (the LP relaxation of the exact model on small graphs)."""
        if scope in self.found:
            return self.found[scope]
        from solver.bounds import fixed_order_bound, free_order_bound, tight_boundaries
        from solver.methods import milp

        graph, budget, close_at = self.graph, self.budget, self.enough()
        if scope == "milp":
            try:
                lb = milp.lower_bound(graph, budget, time_limit=seconds, order="fixed", enough=close_at)
                self.found[scope] = float(lb) if lb is not None and math.isfinite(lb) else None
            except (SolverError, ValueError) as exc:
                log.debug("no lower bound for %s: %s", graph.name, exc)
                self.found[scope] = None
        elif scope == "free":
            self.found[scope] = free_order_bound(graph, budget, time_limit=seconds, enough=close_at)
        else:
            # first where the best schedule so far, and stage_milp's programs, find the
            # budget binding
            given = [self.binding]
            if self.best is not None and self.keeps_order() and not self.best.offloads:
                given.insert(0, tight_boundaries(graph, budget, self.best.sequence))
            self.found[scope] = fixed_order_bound(graph, budget, time_limit=seconds, enough=close_at,
                                                  boundaries=given)
        return self.found[scope]

    # --- the recipe ---------------------------------------------------------------------

    def solve(self) -> Schedule:
        """Search (steps 1-5), then settle the winner and its bound (steps 6-7)."""
        if self.ref_peak + self.ix.fixed <= self.budget:
            self.run("store_all", "the reference order fits the budget: no extra compute")  # 1.
        else:
            self.offer_starts()
            self.evict_and_rescue()
            self.first_stage_round()
            self.reference_order()
            self.free_order()
            self.exact_methods()
        self.reserve = 0.0  # the tail is the winner's
        self.take_winner()
        self.free_bound()
        self.fixed_bound_and_search()
        self.milp_bound()
        return self.record()

    def offer_starts(self) -> None:
        """1b. The given starting schedules and, on a training graph, checkpointing every
        layer block (the one-line alternative): a floor that every later step improves
        on, and a start of the search over recomputations."""
        if self.training:
            from solver.methods.blocks import per_block_schedule

            self.given.append(per_block_schedule(self.graph))
        for start in (s for s in self.given if s is not None):
            name = start.method or "start"
            if simulate(self.graph, start).peak_bytes > self.budget:
                self.tried[name] = "over budget"
                continue
            self.consider(name, Schedule(sequence=list(start.sequence), offloads=list(start.offloads),
                                         bandwidth=start.bandwidth, method=name, info=dict(start.info)),
                          "checkpointing every layer block" if name == "per_block" else "a given starting schedule")

    def evict_and_rescue(self) -> None:
        """2. Eviction on the reference order: fast, near-optimal on training graphs.
        2a. On a training graph past ``stage_milp_max_ops`` ops (where the steps after it
        take long), where eviction left extra compute: Chen's sqrt(L) segments over the
        chain of stages (cheap where they do not fit), then, where they are the best so
        far, the chain DP: coarse, but they fit long chains at low budgets where the
        op-level heuristics fail or cost far more (also where eviction finished)."""
        t = self.tuning
        self.run("eviction", "DTR-style eviction on the reference order",
                 time_limit=max(0.1, min(1.0 if self.unlimited else 2.0, 0.2 * self.limit)), ix=self.ix)
        if self.training and self.extra() and self.n > t.stage_milp_max_ops:
            # one plan built and graded (cheap), not cut short by what the heuristics
            # before it left: where nothing fits yet, the schedule of last resort
            self.run("chen_sqrt", "Chen's sqrt(L) segments over the chain of stages: cheaper than eviction here",
                     time_limit=None)
            if (self.best is not None and self.best.method == "chen_sqrt" and self.n > t.chain_dp_max_ops
                    and self.has_time()):
                self.run("chain_dp", "the chain family fits where nothing else did: its optimum over the chain",
                         time_limit=max(0.1, min(t.chain_rescue_seconds, t.chain_rescue_share * self.left())))

    def first_stage_round(self) -> None:
        """2b. On training graphs past ``stage_milp_max_ops`` ops: the first stage program's
        plan, repaired (one round of ``stage_milp``: there it comes closer to its bound than
        the heuristics below, in seconds); without a time limit too, unless ``exact=False``,
        for at most ``stage_milp_one_unlimited_seconds``."""
        t = self.tuning
        one_round = self.use_exact or (self.unlimited and self.asked_exact is None)
        if (self.training and self.extra() and one_round and self.n > t.stage_milp_max_ops
                and t.stage_milp_one_share * self.left() >= t.stage_milp_one_seconds
                and "stage_milp" not in self.tried):
            share = t.stage_milp_one_share * self.left()
            self.run("stage_milp", "the first 0/1 stage program's plan, repaired, with the program's proven bound",
                     time_limit=min(t.stage_milp_one_unlimited_seconds, share) if self.unlimited else share, rounds=1)

    def stage_program(self) -> None:
        """3c. ``stage_milp`` once, on training graphs up to ``stage_milp_max_ops`` ops with
        a time limit, where a schedule is known and the gap is open: the 0/1 stage program
        as a schedule and a bound at once (it may prove its schedule optimal where the
        heuristics stop well above the bound; its held rounds need most of a short limit,
        so it comes before the heuristics after it)."""
        t = self.tuning
        if (self.training and self.n <= t.stage_milp_max_ops and "stage_milp" not in self.tried
                and self.best is not None and self.use_exact and self.left() > 1.0 and self.extra()
                and not self.close_enough()):
            self.run("stage_milp", "the 0/1 stage program's solution, as a schedule with its proven bound",
                     time_limit=t.stage_milp_more_share * self.left(), soft_limit=t.stage_milp_share * self.left(),
                     enough=self.enough() if self.keeps_order() else None, give_up_over=t.stage_milp_give_up)

    def open_gap(self) -> bool:
        """Whether the best schedule so far has extra compute that no proven bound closes."""
        return self.extra() and not self.close_enough()

    def reference_order(self) -> None:
        """3. The chain DP on training graphs that split into stages; 3b. eviction guided by
        the stage LP's plan at the step most over the budget; 3c. :meth:`stage_program`;
        3d. which forward values the backward keeps, as a covering MILP over the steps over
        the budget (on GPT-style LMs often cheaper than ``lp_eviction``); 3e. exact layer
        blocks composed over the chain of blocks; 3f. staged recomputation on the reference
        order (it plans the whole memory curve, which eviction decides step by step)."""
        t, unlimited = self.tuning, self.unlimited
        if self.training and self.extra() and self.n <= t.chain_dp_max_ops:
            self.run("chain_dp", "the graph is a chain of stages: the DP is optimal for chains",
                     time_limit=max(0.1, min(0.5, 0.1 * self.limit)))
        if self.training and self.open_gap():
            seconds = min(t.lp_eviction_seconds, 0.5 * self.left()) if unlimited else 0.6 * self.left()
            self.run("lp_eviction", "eviction guided by the stage LP's relaxed plan",
                     time_limit=max(0.3, seconds), ix=self.ix)
        self.stage_program()
        if self.training and self.open_gap() and self.left() > t.min_slice and self.n <= t.staged_max_ops:
            self.run("cover", "the backward keeps what a covering MILP over the steps over the budget keeps",
                     time_limit=max(0.3, min(t.cover_seconds, 0.3 * self.left())), ix=self.ix)
        if self.training and self.open_gap() and self.has_time():
            cap = t.block_dp_seconds if unlimited else 2 * t.block_dp_seconds
            self.run("block_dp", "each distinct layer block solved exactly, composed by a DP over the chain",
                     time_limit=max(0.3, min(cap, 0.3 * self.left())), min_repeats=t.block_dp_min_repeats)
        if self.open_gap() and self.left() > t.min_slice and self.n <= t.staged_max_ops:
            share = 0.5 * t.staged_share * self.left()
            if unlimited:
                share = min(t.staged_seconds, share)
            self.staged(deadline=_time.perf_counter() + share, orders=[list(range(self.n))], name="staged")

    def free_order(self) -> None:
        """4a. Nothing fits yet: staged recomputation on the low-memory orders (where
        on-demand eviction thrashes on many long-lived values); 4. order search where order
        freedom matters: forward-only graphs, or when a low-memory order beats the
        reference peak; the low-memory recipe where nothing fits yet; 4b. nothing fits a
        tiny graph: every schedule in any order, searched exhaustively (what fits there may
        run a forward op again after a backward one, or a gradient op twice, which no
        heuristic does)."""
        from solver.indexed import order_peak
        from solver.methods.eviction import min_memory_order
        from solver.methods.minpeak import min_peak_sequence

        t, ix, n = self.tuning, self.ix, self.n
        if self.best is None and self.left() > t.min_slice and n <= t.staged_max_ops:
            share = t.staged_share * self.left()
            if self.unlimited:
                share = min(t.staged_seconds, share)
            self.staged(deadline=_time.perf_counter() + share, name="staged_free")
        if self.extra() and (self.has_time() or (self.best is None and self.left() > 0)):
            free_peak = min(order_peak(ix, min_memory_order(ix, tie=tie)) for tie in ("ref", "depth"))
            if not self.training or n <= t.small_ops or free_peak < self.ref_peak * (1 - t.order_gain):
                share = 0.6 if not self.training else 0.3
                cap_s = (2.0 if n <= 1000 else 4.0) if self.unlimited else self.limit
                self.run("order_search", "memory-aware reordering removes recomputation",
                         time_limit=max(0.3, min(cap_s, share * self.left())))
            else:
                self.tried["order_search"] = "skipped: reordering does not lower the peak"
        if self.best is None and (self.unlimited or _time.perf_counter() < self.t0 + self.limit):
            seq = min_peak_sequence(ix, self.budget, deadline=self.t0 + self.limit)
            if seq is not None:
                self.consider("min_peak", Schedule(sequence=[ix.ids[i] for i in seq], method="min_peak",
                                                   info={"order": "free"}),
                              "the low-memory recipe is the only one that fits")
        if self.best is None and n <= t.brute_force_max_ops:
            from solver.methods.bruteforce import brute_force

            try:
                self.consider("brute_force", brute_force(self.graph, self.budget, max_ops=t.brute_force_max_ops),
                              "nothing else fits: the exhaustive search over every schedule of a tiny graph")
            except (InfeasibleBudget, SolverError) as exc:
                self.tried["brute_force"] = f"{type(exc).__name__}: {exc}"[:200]

    def exact_methods(self) -> None:
        """5. Exact methods on small graphs, warm-started, while the gap is not closed (also
        when the time is spent and no heuristic fits, with a short slice each: the only
        chance left); the stage bounds and the search over recomputations first."""
        t = self.tuning
        rescue = self.best is None
        self.stage_program()  # (where only the searches after 3c found a schedule)
        if self.n > t.exact_max_ops:
            return
        hopeless = rescue and self.best is None and self.rules_out()
        if (self.use_bound and not rescue and self.use_exact and self.left() > 1.0 and self.extra()):
            self.early_bounds()
        if hopeless or not (rescue or (self.use_exact and self.left() > 1.0 and self.open_gap())):
            return
        hint = self.best if self.best is not None and self.keeps_order() else None
        for k, name in enumerate(("cpsat", "checkmate_milp")):
            if self.best is not None and (self.left() <= 1.0 or self.close_enough()):
                break
            share = 0.5 * self.left() if k == 0 else self.left()
            kw = {"time_limit": max(t.min_slice if self.best is None else 0.5, share)}
            if hint is not None:
                kw["hint"] = hint
            self.run(name, "exact method on a small graph, warm-started from the heuristics", **kw)

    def rules_out(self) -> bool:
        """Whether making some op's inputs resident exceeds the budget in every order: no
        exact method fits then, and the rescue would spend the rest of the limit."""
        from solver.feasibility import last_computed_rules_out

        seconds = self.tuning.proof_seconds
        if not self.unlimited:
            seconds = min(seconds, max(0.0, self.left()))
        culprit = last_computed_rules_out(self.graph, self.budget, time_limit=seconds)
        if culprit is None:
            return False
        self.tried["last_computed_peak_bound"] = f"no schedule fits: the inputs of {culprit!r} do not"
        return True

    def early_bounds(self) -> None:
        """Before the exact methods: the stage bounds (a fraction of a second here; the
        fixed-order one first where the best schedule keeps the reference order: it is the
        stronger), the exact model's LP relaxation (it proves more than the exact methods
        do in the same time where they find nothing better; with less time, they get it),
        then the search over the best schedule's recomputations (the exact methods rarely
        find better in seconds)."""
        from solver.methods.lns import improve_sequence

        t = self.tuning
        scopes = ("fixed", "free") if self.keeps_order() else ("free", "fixed")
        roomy = self.left() >= t.early_milp_seconds
        for scope in scopes:
            if not self.close_enough():
                self.stage_bound(scope, t.early_bound_share * self.left())
        if not self.close_enough() and roomy:
            self.stage_bound("milp", t.milp_bound_share * self.left())
        if not self.close_enough() and not self.best.offloads and self.left() > t.min_slice:
            better = improve_sequence(self.graph, self.best.sequence, self.budget,
                                      deadline=_time.perf_counter() + t.lns_share * self.left(), ix=self.ix)
            self.consider("lns", Schedule(sequence=list(better), method="lns"),
                          "large neighbourhood search over the best schedule's recomputations")

    def staged(self, *, deadline: float, orders: list | None = None, name: str) -> None:
        """Offer the cheapest staged recomputation over ``orders`` (default: the low-memory
        orders), its unneeded recomputations dropped, as ``name``."""
        from solver.methods.minpeak import low_memory_orders
        from solver.methods.staged import staged_sequence

        graph, ix, budget, t = self.graph, self.ix, self.budget, self.tuning
        fixed = orders is not None
        best, best_cost = None, None
        for k, order in enumerate(orders if fixed else low_memory_orders(ix, deadline=deadline)):
            if k and _time.perf_counter() > deadline:
                break
            seq = staged_sequence(ix, order, budget, deadline=deadline)
            if seq is None:
                continue
            ids = [ix.ids[i] for i in seq]
            if self.use_drop:
                slice_s = max(t.min_slice, min(t.drop_seconds, deadline - _time.perf_counter()))
                ids = drop_recomputations(graph, ids, budget, deadline=_time.perf_counter() + slice_s)
            cost = simulate(graph, ids).cost
            if best_cost is None or cost < best_cost:
                best, best_cost = ids, cost
        if best is None:
            self.tried[name] = "NoScheduleFound: no stage plan fits"
            return
        self.consider(name, Schedule(sequence=best, method=name, info={"order": "fixed" if fixed else "free"}),
                      "staged recomputation: planned over the whole memory curve" if fixed else
                      "staged recomputation on a low-memory order: the only plan that relieves every stage "
                      "over the budget")

    # --- the winner and its bound -------------------------------------------------------
    # From here on ``self.key`` is the winner's key (it drops as its recomputations go),
    # while ``self.best_key``, and the bounds' stopping point :meth:`enough`, stay the
    # search's.

    def take_winner(self) -> None:
        """6. On the winner, drop the recomputations that the budget does not need (the
        heuristics plan with a conservative memory model and evict more than they must);
        then the bound it comes with."""
        sched, t = self.best, self.tuning
        if sched is None:
            raise NoScheduleFound(
                f"auto found no schedule of {self.graph.name or 'the graph'} within {self.budget} B "
                f"(tried {', '.join(self.tried) or 'nothing'}); give more time or a larger budget"
            )
        self.key = self.best_key
        if self.use_drop and self.extra() and not sched.offloads:
            slice_s = t.drop_seconds if self.unlimited else max(0.5, 0.1 * self.limit)
            slice_s = min(slice_s, max(t.min_slice, self.left()))
            cheaper = drop_recomputations(self.graph, sched.sequence, self.budget,
                                          deadline=_time.perf_counter() + slice_s)
            cost = simulate(self.graph, cheaper).cost
            if len(cheaper) < len(sched.sequence) and cost <= self.key[0]:
                sched.info = {**sched.info, "dropped_recomputations": len(sched.sequence) - len(cheaper),
                              "cost_before_dropping": self.key[0]}
                sched.sequence, self.key = cheaper, (cost, len(cheaper))
                if sched.lower_bound is not None:
                    sched.lower_bound = min(sched.lower_bound, cost)
        self.picked = sched.method or next(k for k, v in self.tried.items() if v == self.key[0])
        sched.info = dict(sched.info)
        self.fixed_scope = fixed_scope = not _reorders(self.ix, sched.sequence)  # a fixed-order bound holds
        if fixed_scope and self.proven is not None and (sched.lower_bound is None or self.proven > sched.lower_bound):
            sched.lower_bound = min(self.proven, self.key[0])  # an exact candidate's bound holds for the winner
        self.elapsed = _time.perf_counter() - self.t0
        free_scope = sched.info.get("bound_scope") == "free order"
        if not self.extra_after():
            self.bound = self.base  # no extra compute: optimal for any order
        elif sched.lower_bound is not None and sched.lower_bound >= self.base:
            self.bound = float(sched.lower_bound) if fixed_scope or free_scope else None
            if not fixed_scope and self.bound is None:
                sched.info["fixed_order_lower_bound"] = float(sched.lower_bound)
        self.scope = "free order" if self.bound is not None and free_scope else "fixed order"
        self.close = self.closed()

    def extra_after(self) -> bool:
        """Whether the winner has extra compute."""
        return self.key[0] > self.base * (1 + 1e-12)

    def closed(self) -> bool:
        """Whether the winner's bound puts it within the gap tolerance."""
        return self.bound is not None and self.key[0] - self.bound <= self.allowed_gap(self.key[0]) + 1e-9

    def late(self) -> bool:
        """On graphs past ``stage_milp_max_ops`` ops, a bound is known and too little time
        is left for another: each has a setup (0.2-0.5 s on 5,000-7,000 ops) that would run
        past the time limit. (On smaller graphs a bound's setup is short, and a bound begun
        with little time left can still prove more.)"""
        return (not self.unlimited and self.n > self.tuning.stage_milp_max_ops and self.bound is not None
                and self.left() < self.tuning.min_slice)

    def free_bound(self) -> None:
        """7. The bound valid in any order first: the stage LP at ops placed by the DAG
        alone."""
        t, unlimited, n = self.tuning, self.unlimited, self.n
        # on graphs past stage_milp_max_ops ops with a time limit and too little time left
        # for a bound's setup, the winner keeping the reference order: only the fixed-order
        # bound (the stronger there), not both
        hurried = not unlimited and n > t.stage_milp_max_ops and self.fixed_scope and self.left() < t.min_slice
        # with a time limit, on graphs past bound_limited_max_ops ops whose winner keeps the
        # reference order with a fixed-order bound known (stage_milp's): not this bound,
        # which the search after the bounds needs the time of (it proves less there)
        settled = not unlimited and self.fixed_scope and n > t.bound_limited_max_ops and self.bound is not None
        if not self.use_bound or self.close or self.late() or hurried or settled:
            return
        if unlimited:
            f_time = min(0.5 * t.lp_bound_seconds, max(0.3, 0.25 * self.elapsed))
        else:
            f_time = max(0.0, 0.3 * self.left())
            if self.fixed_scope:
                f_time /= 3  # the fixed-order bound after it is the stronger one
        flb = min(self.stage_bound("free", f_time), self.key[0])
        if flb > self.base and (self.bound is None or flb >= self.bound):
            self.bound, self.scope = flb, "free order"
            self.close = self.closed()

    def with_fixed_bound(self, lb: float) -> None:
        """Take a fixed-order bound: the winner's when it keeps the reference order, for
        the record otherwise."""
        lb = min(lb, self.key[0])
        if self.fixed_scope:
            if self.bound is None or lb > self.bound:
                self.bound, self.scope = lb, "fixed order"
            self.close = self.closed()
        elif lb > self.base:
            self.best.info["fixed_order_lower_bound"] = lb

    def searching(self) -> bool:
        """Whether the search over the winner's recomputations has an open gap and time."""
        t = self.tuning
        return (not self.close and self.extra_after() and not self.best.offloads and self.left() > t.min_slice
                and self.n <= t.staged_max_ops)

    def search(self, share: float, stop=None) -> None:
        """6b. The stage bounds leave the gap open: a large neighbourhood search over the
        winner's recomputations, its order of first runs kept (so the bound's scope stays
        the winner's), taking turns with the next cheapest candidates in that order."""
        from solver.methods.lns import improve_sequence

        sched = self.best
        ranked = sorted(self.kept, key=lambda x: x[0])
        others = [seq for _, name, seq in ranked if name != self.picked][:self.tuning.lns_starts - 1]
        better = improve_sequence(self.graph, sched.sequence, self.budget, deadline=_time.perf_counter() + share,
                                  ix=self.ix, more=others, stop=stop)
        cost = simulate(self.graph, better).cost
        self.tried["lns"] = cost
        if cost < self.key[0]:
            sched.info = {**sched.info, "cost_before_lns": self.key[0]}
            sched.sequence, self.key = list(better), (cost, len(better))
            if self.bound is not None:
                self.bound = min(self.bound, cost)
            self.close = self.closed()

    def fixed_bound_and_search(self) -> None:
        """7. The fixed-order bounds: the forced recomputation (milliseconds on thousands
        of ops), small LPs at the steps most over the budget, then the 0/1 stage program
        at the best of them; and the search while the gap stays open. With a time limit,
        on graphs past ``bound_limited_max_ops`` ops whose winner keeps the reference
        order, the two side by side (:meth:`bound_beside_search`)."""
        t, unlimited, n = self.tuning, self.unlimited, self.n
        fixed_next = (self.use_bound and not self.close and "fixed_order_lower_bound" not in self.best.info
                      and not self.late())
        if fixed_next and self.fixed_scope and not unlimited and n > t.bound_limited_max_ops and self.searching():
            self.bound_beside_search(t.parallel_share * self.left())
            return
        if fixed_next:
            if unlimited:
                lp_time = min(t.lp_bound_seconds, max(0.3, 0.25 * self.elapsed))
            else:
                lp_time = max(0.0, 0.5 * self.left())
            if not self.fixed_scope:
                lp_time = min(lp_time, 0.5 * t.lp_bound_seconds)  # for the record only: the winner reorders
            self.with_fixed_bound(self.stage_bound("fixed", lp_time))
        if self.searching():
            # (with a time limit on graphs too large for the MILP's bound after it, the
            # whole time left)
            if unlimited:
                share = min(t.lns_seconds, t.lns_share * self.left())
            else:
                share = (t.lns_share if n <= t.bound_limited_max_ops else 0.95) * self.left()
            self.search(share)

    def bound_beside_search(self, share: float) -> None:
        """The fixed-order bound in a second thread beside the search, each with ``share``
        seconds (SCIP and GLOP release the interpreter while they solve); the search stops
        once the bound closes the gap."""
        closing = self.enough()
        got: dict = {}
        proved = threading.Event()

        def prove() -> None:
            try:
                got["lb"] = self.stage_bound("fixed", share)
                if got["lb"] >= closing - 1e-9:
                    proved.set()
            except BaseException as exc:  # re-raised below, in the caller's thread
                got["error"] = exc

        worker = threading.Thread(target=prove, name="remat-fixed-order-bound", daemon=True)
        worker.start()
        try:
            self.search(share, stop=proved.is_set)
        finally:
            worker.join()  # (the bound keeps its own time limit)
        if "error" in got:
            raise got["error"]
        self.with_fixed_bound(got["lb"])

    def milp_bound(self) -> None:
        """7. Then, on small graphs, the MILP's bound (a small share of the time when no
        limit was given: :func:`solver.optimize` calls auto)."""
        t, n = self.tuning, self.n
        if not self.use_bound or self.close or "fixed_order_lower_bound" in self.best.info:
            return
        b_time = min(2.0, max(0.2, 0.25 * self.elapsed)) if self.unlimited else self.left()
        limited_room = not self.unlimited and b_time >= 5.0 and n <= t.bound_limited_max_ops
        if "milp" not in self.found and not (b_time > 0.1 and (n <= t.bound_max_ops or limited_room)):
            return
        lb = self.stage_bound("milp", b_time)
        if lb is None:
            return
        lb = min(lb, self.key[0])
        if self.fixed_scope:
            if self.bound is None or lb > self.bound:
                self.bound, self.scope = lb, "fixed order"
        else:
            info = self.best.info
            info["fixed_order_lower_bound"] = max(lb, info.get("fixed_order_lower_bound", lb))

    def record(self) -> Schedule:
        """The winner, with its bound, the bound's scope and what was tried."""
        sched = self.best
        if self.bound is None and self.extra_after():
            self.bound, self.scope = self.base, "free order"  # every schedule runs each op at least once
        sched.lower_bound = self.bound
        if self.bound is not None:
            sched.info["bound_scope"] = "any order" if not self.extra_after() else self.scope
        sched.info["auto"] = {"picked": self.picked, "why": self.why, "tried": self.tried, "ops": self.n,
                              "time_limit": self.limit, "schedule_seconds": self.elapsed,
                              "winner_seconds": self.found_at, "reordered": dict(self.reorders)}
        sched.method = f"auto:{self.picked}"
        return sched


def _reorders(ix, sequence) -> bool:
    """Whether ``sequence`` first runs the ops in another order than the reference one."""
    index = {v: i for i, v in enumerate(ix.ids)}
    seen = set()
    expected = 0
    for v in sequence:
        i = index.get(v)
        if i is None or i in seen:
            continue
        if i != expected:
            return True
        seen.add(i)
        expected += 1
    return False

"""``method="auto"``: pick solvers by graph shape and size, keep the best simulated schedule.

The recipe, cheapest first:

1. store-all, when the reference order fits (no extra compute: optimal);
2. ``eviction`` on the reference order (fast, near-optimal on training graphs); where
   it finds nothing, or not all its passes finish, on a training graph past
   :data:`STAGE_MILP_MAX_OPS` ops,
   ``chen_sqrt`` and then ``chain_dp`` over the chain of stages; on training
   graphs past :data:`STAGE_MILP_MAX_OPS` ops, one round of
   ``stage_milp`` (the first program's plan, repaired) with
   :data:`STAGE_MILP_ONE_SHARE` of the time left, when that comes to
   :data:`STAGE_MILP_ONE_SECONDS` at least (without a time limit, unless
   ``exact=False``, for at most :data:`STAGE_MILP_ONE_UNLIMITED_SECONDS`);
3. ``chain_dp`` on training graphs (optimal for chains of stages), ``lp_eviction``
   (eviction guided by the stage LP's plan, with its unneeded recomputations removed);
   with a time limit, on training graphs up to :data:`STAGE_MILP_MAX_OPS` ops,
   ``stage_milp``: the 0/1 stage program solved and turned into a schedule, which
   comes with the program's proven bound (optimal when the two meet), with
   :data:`STAGE_MILP_SHARE` of the time left; it stops once its bound puts the best
   schedule so far within ``gap_tolerance``, and its held rounds end after a plan above
   :data:`STAGE_MILP_GIVE_UP` times the budget; then ``cover`` (which forward values the backward keeps, as a covering MILP over the
   steps over the budget), then ``block_dp`` (each distinct layer block solved exactly, the blocks composed by
   a DP over the chain) where one block repeats :data:`BLOCK_DP_MIN_REPEATS` times;
   then staged recomputation (:func:`~solver.methods.staged.staged_sequence`) on the
   reference order, on graphs up to :data:`STAGED_MAX_OPS` ops: it plans the whole
   memory curve;
4. when nothing fits yet, staged recomputation on the low-memory orders (it fits
   budgets where on-demand eviction thrashes); then ``order_search`` (free order) where
   order freedom matters: forward-only graphs, or training graphs whose greedy low-memory order lowers the reference peak; then the
   low-memory recipe of :func:`~solver.methods.minpeak.min_peak_sequence`, which
   reaches every budget that :class:`~solver.InfeasibleBudget` reports; and on graphs
   of at most :data:`BRUTE_FORCE_MAX_OPS` ops, the exhaustive search over every
   schedule;
5. an exact method (``cpsat``, ``checkmate_milp``) on small graphs when a time limit
   leaves time, warm-started from the best schedule so far; the next one runs only
   while the proven gap is above ``gap_tolerance``;
6. on the winner, :func:`drop_recomputations`: the heuristics plan with a conservative
   memory model, and the recomputations the simulator shows the budget does not need go.
7. the gap: first the bound valid in any order, :func:`solver.bounds.free_order_bound`
   (the stage LP at ops placed by the DAG alone; with a time limit, not on graphs past
   :data:`BOUND_LIMITED_MAX_OPS` ops whose winner keeps the reference order with
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
   :data:`LNS_SHARE` of the time left before the MILP's bound (on small graphs, before
   the exact methods of step 5, as candidate ``lns``). With a time limit, on graphs
   past :data:`BOUND_LIMITED_MAX_OPS` ops whose winner keeps the reference order, the
   fixed-order bound runs in a second thread beside the search, the two with
   :data:`PARALLEL_SHARE` of the time left (the solvers of the bound release the
   interpreter while they solve), and the search stops once the bound closes the gap.
   With a time limit, on graphs
   past :data:`STAGE_MILP_MAX_OPS` ops, a bound does not start with under
   :data:`MIN_SLICE` seconds left once one is known (its setup alone would run past the
   limit there).

Once a proven bound puts the best schedule within ``gap_tolerance``, the heuristics on
the reference order of step 3 no longer run.

Every candidate is graded by :func:`solver.simulate`; the cheapest valid one within the
budget wins (fewest steps on ties). ``schedule.info["auto"]`` records what was tried,
what won and why; ``schedule.method`` reads ``"auto:<winner>"``.
"""

from __future__ import annotations

import logging
import math
import threading
import time as _time
from typing import Sequence

from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound, SolverError
from solver.schedule import Schedule
from solver.methods.drop import drop_recomputations
from solver.simulate import simulate

__all__ = ["solve_auto", "drop_recomputations", "EXACT_MAX_OPS", "CHAIN_DP_MAX_OPS", "ORDER_GAIN", "BOUND_MAX_OPS",
           "BOUND_LIMITED_MAX_OPS", "SMALL_OPS", "BRUTE_FORCE_MAX_OPS", "GAP_TOLERANCE", "LP_BOUND_SECONDS",
           "LP_EVICTION_SECONDS", "EARLY_BOUND_SHARE", "MILP_BOUND_SHARE", "EARLY_MILP_SECONDS", "BLOCK_DP_SECONDS",
           "BLOCK_DP_MIN_REPEATS", "DROP_SECONDS", "STAGED_SHARE", "STAGED_SECONDS", "STAGED_MAX_OPS", "COVER_SECONDS", "LNS_SHARE", "LNS_SECONDS", "PARALLEL_SHARE",
           "STAGE_MILP_MAX_OPS", "STAGE_MILP_SHARE", "STAGE_MILP_MORE_SHARE", "STAGE_MILP_GIVE_UP", "STAGE_MILP_ONE_SHARE", "STAGE_MILP_ONE_SECONDS",
           "STAGE_MILP_ONE_UNLIMITED_SECONDS",
           "LNS_STARTS", "TAIL_SHARE", "TAIL_SECONDS"]

log = logging.getLogger(__name__)

# Each constant says what it controls; the runs that set them are in docs/tuning.md,
# under their names.

#: Graphs with at most this many ops get an exact method when time is left.
EXACT_MAX_OPS = 120
#: Seconds at most for proving, where no heuristic fits a small graph, that no
#: schedule does (:func:`solver.feasibility.last_computed_rules_out`) before the exact
#: methods are tried with the rest of the limit.
PROOF_SECONDS = 0.5
#: Training graphs with at most this many ops also try ``chain_dp``.
CHAIN_DP_MAX_OPS = 120
#: Order search runs on a training graph only when a greedy low-memory order lowers the
#: reference store-all peak by more than this fraction.
ORDER_GAIN = 0.01
#: Order search always runs on graphs this small (it is cheap there).
SMALL_OPS = 60
#: Where nothing else fits a graph of at most this many ops, the exhaustive search over
#: every schedule in any order (:func:`~solver.methods.bruteforce.brute_force`) settles it.
BRUTE_FORCE_MAX_OPS = 12
#: Without a time limit, the fixed-order lower bound is only attempted up to this size.
BOUND_MAX_OPS = 100
#: With a time limit, the bound is attempted up to this size.
BOUND_LIMITED_MAX_OPS = 400
#: Default ``gap_tolerance``: auto stops proving once the gap on the extra compute is below.
GAP_TOLERANCE = 0.01
#: Without a time limit, seconds at most for ``lp_eviction``.
LP_EVICTION_SECONDS = 3.0
#: Without a time limit, seconds at most for dropping the winner's unneeded recomputations.
DROP_SECONDS = 1.0
#: Without a time limit, seconds at most for ``block_dp``.
BLOCK_DP_SECONDS = 2.0
#: ``block_dp`` runs when one block structure repeats at least this often.
BLOCK_DP_MIN_REPEATS = 8
#: Without a time limit, seconds at most for the LP bounds at single boundaries.
LP_BOUND_SECONDS = 2.0
#: Share of the time left that each stage bound may take before the exact methods.
EARLY_BOUND_SHARE = 0.1
#: Share of the time left for :func:`solver.methods.milp.lower_bound` before the exact
#: methods (when the stage bounds leave the gap open).
MILP_BOUND_SHARE = 0.6
#: Seconds left at least, before the stage bounds, for that bound to run before the
#: exact methods.
EARLY_MILP_SECONDS = 6.0
#: Seconds below which a step that would start is skipped (it could not finish in time).
MIN_SLICE = 0.3
#: Share of the time left that staged recomputation may take when nothing fits before it.
STAGED_SHARE = 0.4
#: Without a time limit, seconds at most for staged recomputation (a budget that nothing
#: reaches is then reported within seconds).
STAGED_SECONDS = 3.0
#: Without a time limit, seconds at most for ``cover``.
COVER_SECONDS = 1.0
#: Share of the time left that the search over the winner's recomputations
#: (:func:`solver.methods.lns.improve_sequence`) may take where the stage bounds leave
#: the gap open.
LNS_SHARE = 0.4
#: With a time limit, past :data:`BOUND_LIMITED_MAX_OPS` ops, the share of the time left
#: that the fixed-order bound and the search over the winner's recomputations share,
#: side by side, after the schedules.
PARALLEL_SHARE = 0.95
#: Schedules that search takes turns on: the winner and the next cheapest candidates
#: that keep the reference order.
LNS_STARTS = 3
#: Without a time limit, seconds at most for that search.
LNS_SECONDS = 1.0
#: Share of the time left (and seconds at most) for each of the chain-family methods on a
#: training graph that eviction does not fit.
CHAIN_RESCUE_SHARE = 0.5
CHAIN_RESCUE_SECONDS = 2.0
#: Training graphs with at most this many ops get ``stage_milp`` when a time limit is
#: given (its programs grow with the steps over the budget).
STAGE_MILP_MAX_OPS = 1000
#: Share of the time left for ``stage_milp``, and the share it may take while its held
#: rounds close in on the budget (its ``soft_limit`` and ``time_limit``).
STAGE_MILP_SHARE = 0.7
STAGE_MILP_MORE_SHARE = 0.9
#: ``stage_milp``'s held rounds end, in ``auto``, after one whose plan peaks above this
#: times the budget (its ``give_up_over``), and the search after them gets the time.
STAGE_MILP_GIVE_UP = 1.17
#: On training graphs past :data:`STAGE_MILP_MAX_OPS` ops, the share of the time left
#: for one round of ``stage_milp`` (the first program's plan, repaired), and the seconds
#: that share must come to for the round to run.
STAGE_MILP_ONE_SHARE = 0.8
STAGE_MILP_ONE_SECONDS = 1.0
#: Without a time limit, seconds at most for that round.
STAGE_MILP_ONE_UNLIMITED_SECONDS = 3.0
#: Staged recomputation plans on a stage-by-value table: graphs up to this many ops.
STAGED_MAX_OPS = 3000
#: With a time limit, on graphs past :data:`STAGE_MILP_MAX_OPS` ops, the share of the
#: limit (at most :data:`TAIL_SECONDS`) that the search leaves to the winner's last
#: steps (dropping its unneeded recomputations, simulating the result) and to the setup
#: of its first bound.
TAIL_SHARE = 0.25
TAIL_SECONDS = 1.0


def _registered(name: str):
    from solver.registry import registered as methods

    info = methods().get(name)
    return info


def _default_limit(n: int) -> float:
    return 10.0 if n <= 300 else 60.0


def solve_auto(graph: ComputeGraph, budget: int, *, time_limit: float | None = None, exact: bool | None = None,
               bound: bool = True, drop: bool = True, gap_tolerance: float = GAP_TOLERANCE,
               starts: Sequence[Schedule] | None = None) -> Schedule:
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
        past :data:`STAGE_MILP_MAX_OPS` ops (at most
        :data:`STAGE_MILP_ONE_UNLIMITED_SECONDS`); capped slices for the stage bounds,
        and the MILP's bound only up to :data:`BOUND_MAX_OPS` ops. With one, fast
        heuristics run first; exact methods and the bound get what is left.
    exact : bool, optional
        False skips the exact methods (default: they run with a time limit).
    bound : bool
        False skips the lower bound.
    drop : bool
        False keeps the winner's recomputations as they are.
    gap_tolerance : float
        Default :data:`GAP_TOLERANCE`, 1 %: once the proven gap on the extra compute
        is at most this, auto stops searching and proving and returns.
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
    from solver.indexed import IndexedGraph, order_peak
    from solver.methods.eviction import min_memory_order
    from solver.methods.lns import improve_sequence
    from solver.methods.minpeak import min_peak_sequence

    t0 = _time.perf_counter()
    ix = IndexedGraph.of(graph)
    n = ix.n
    unlimited = time_limit is None
    limit = _default_limit(n) if unlimited else float(time_limit)
    deadline = t0 + limit
    asked_exact = exact
    use_exact = (not unlimited) if asked_exact is None else bool(asked_exact)
    use_bound = bound
    use_drop = drop
    given = list(starts or ())
    tolerance = float(gap_tolerance)
    if not tolerance >= 0:
        raise ValueError(f"gap_tolerance must be a fraction >= 0, got {tolerance!r}")
    training = bool(graph.backward_nodes())
    tried: dict[str, object] = {}
    reorders: dict[str, bool] = {}
    best: list = [None, None, None]  # schedule, key, why
    found_at = [None]  # seconds until the winning schedule was found
    starts: list = []  # (cost, name, sequence) of every valid candidate in the reference order
    proven = [None]  # the best fixed-order bound an exact candidate proved, whoever wins
    binding: list = []  # where stage_milp's programs found the budget binding (its boundaries)

    def consider(name: str, sched: Schedule | None, why: str) -> None:
        if sched is None:
            return
        if name == "stage_milp":
            binding[:] = sched.info.get("boundaries") or []
        r = simulate(graph, sched)
        reorders[name] = _reorders(ix, sched.sequence)
        if not r.valid or r.peak_bytes > budget:
            tried[name] = f"rejected: {'invalid' if not r.valid else 'over budget'}"
            log.warning("auto: %s returned %s on %s", name, r.error or "a schedule over the budget",
                        graph.name or "the graph")
            return
        tried[name] = r.cost
        if not reorders[name] and not sched.offloads:
            starts.append((r.cost, name, list(sched.sequence)))
        if sched.lower_bound is not None and sched.info.get("order") == "fixed" and math.isfinite(sched.lower_bound):
            proven[0] = max(float(sched.lower_bound), proven[0] or -math.inf)
        key = (r.cost, len(sched.sequence))
        if best[1] is None or key < best[1]:
            best[0], best[1], best[2] = sched, key, why
            found_at[0] = _time.perf_counter() - t0

    def run(name: str, why: str, **kw) -> None:
        info = _registered(name)
        if info is None:
            return
        try:
            consider(name, info.fn(graph, budget, **kw), why)
        except (SolverError, InfeasibleBudget, ValueError, NotImplementedError, MemoryError) as exc:
            tried[name] = f"{type(exc).__name__}: {exc}"[:200]
            lb = getattr(exc, "lower_bound", None)
            if isinstance(exc, NoScheduleFound) and info.order == "fixed" and lb is not None and math.isfinite(lb):
                proven[0] = max(float(lb), proven[0] or -math.inf)  # what it proved holds without a schedule

    # the search leaves the tail to the winner's last steps (see TAIL_SHARE)
    reserve = [0.0 if unlimited or n <= STAGE_MILP_MAX_OPS else min(TAIL_SECONDS, TAIL_SHARE * limit)]

    def left() -> float:
        return deadline - reserve[0] - _time.perf_counter()

    def has_time() -> bool:
        """Whether a step with a slice of at least :data:`MIN_SLICE` may start: on graphs
        past :data:`STAGE_MILP_MAX_OPS` ops with a time limit, only while that much is
        left (there its setup alone takes tenths of a second); otherwise always."""
        return unlimited or n <= STAGE_MILP_MAX_OPS or left() > MIN_SLICE

    def extra() -> bool:
        return best[0] is None or best[1][0] > base * (1 + 1e-12)

    def close_enough() -> bool:
        """A proven bound (fixed-order ones when the best keeps the reference order) puts
        the best schedule within the gap tolerance."""
        if best[0] is None:
            return False
        bounds = [found.get("free")]
        if not reorders.get(best[0].method, True):
            bounds += [best[0].lower_bound, proven[0], found.get("fixed"), found.get("milp")]
        bounds = [b for b in bounds if b is not None]
        if not bounds:
            return False
        return max(max(bounds), base) >= enough() - 1e-9

    def enough() -> float:
        """The bound that puts the best schedule so far within the gap tolerance."""
        return best[1][0] - tolerance * (best[1][0] - base)

    found: dict = {}  # "free", "fixed", "milp": the bounds once computed (None: none in time)

    def stage_bound(scope: str, seconds: float) -> float | None:
        """The bound of ``scope``, computed once, stopping where it closes the gap of the
        best schedule so far: "free" and "fixed", the stage bounds of either order
        freedom; "milp", the fixed-order bound of :func:`solver.methods.milp.lower_bound`
        (the LP relaxation of the exact model on small graphs)."""
        if scope not in found:
            from solver.bounds import fixed_order_bound, free_order_bound, tight_boundaries
            from solver.methods import milp

            close_at = enough()
            if scope == "milp":
                try:
                    lb = milp.lower_bound(graph, budget, time_limit=seconds, order="fixed", enough=close_at)
                    found[scope] = float(lb) if lb is not None and math.isfinite(lb) else None
                except (SolverError, ValueError) as exc:
                    log.debug("no lower bound for %s: %s", graph.name, exc)
                    found[scope] = None
            elif scope == "free":
                found[scope] = free_order_bound(graph, budget, time_limit=seconds, enough=close_at)
            else:
                # first where the best schedule so far, and stage_milp's programs, find
                # the budget binding
                given = [binding]
                if best[0] is not None and not reorders.get(best[0].method, True) and not best[0].offloads:
                    given.insert(0, tight_boundaries(graph, budget, best[0].sequence))
                found[scope] = fixed_order_bound(graph, budget, time_limit=seconds, enough=close_at,
                                                 boundaries=given)
        return found[scope]

    def stage_program() -> None:
        """``stage_milp`` once, on training graphs up to :data:`STAGE_MILP_MAX_OPS` ops
        with a time limit, where a schedule is known and the gap is open."""
        if (training and n <= STAGE_MILP_MAX_OPS and "stage_milp" not in tried and best[0] is not None
                and use_exact and left() > 1.0 and extra() and not close_enough()):
            keeps = not reorders.get(best[0].method, True)
            run("stage_milp", "the 0/1 stage program's solution, as a schedule with its proven bound",
                time_limit=STAGE_MILP_MORE_SHARE * left(), soft_limit=STAGE_MILP_SHARE * left(),
                enough=enough() if keeps else None, give_up_over=STAGE_MILP_GIVE_UP)

    base = graph.total("time")
    ref_peak = order_peak(ix, range(n))
    if ref_peak + ix.fixed <= budget:
        # 1. store-all
        run("store_all", "the reference order fits the budget: no extra compute")
    else:
        # 1b. the given starting schedules and, on a training graph, checkpointing every
        #     layer block (the one-line alternative): a floor that every later step
        #     improves on, and a start of the search over recomputations
        if training:
            from solver.methods.blocks import per_block_schedule

            given.append(per_block_schedule(graph))
        for start in (s for s in given if s is not None):
            name = start.method or "start"
            if simulate(graph, start).peak_bytes > budget:
                tried[name] = "over budget"
                continue
            consider(name, Schedule(sequence=list(start.sequence), offloads=list(start.offloads),
                                    bandwidth=start.bandwidth, method=name, info=dict(start.info)),
                     "checkpointing every layer block" if name == "per_block" else "a given starting schedule")
        # 2. eviction on the reference order: fast, near-optimal on training graphs
        run("eviction", "DTR-style eviction on the reference order",
            time_limit=max(0.1, min(1.0 if unlimited else 2.0, 0.2 * limit)), ix=ix)
        # 2a. on a training graph past STAGE_MILP_MAX_OPS ops (where the steps after it
        #     take long), where eviction left extra compute:
        #     Chen's sqrt(L) segments over the chain of stages (cheap where they do not
        #     fit), then, where they are the best so far, the chain DP: coarse, but they
        #     fit long chains at low budgets where the op-level heuristics fail or cost
        #     far more (also where eviction finished; runs in docs/tuning.md)
        if training and extra() and n > STAGE_MILP_MAX_OPS:
            # one plan built and graded (cheap), not cut short by what the heuristics
            # before it left: where nothing fits yet, the schedule of last resort
            run("chen_sqrt", "Chen's sqrt(L) segments over the chain of stages: cheaper than eviction here",
                time_limit=None)
            if best[0] is not None and best[0].method == "chen_sqrt" and n > CHAIN_DP_MAX_OPS and has_time():
                run("chain_dp", "the chain family fits where nothing else did: its optimum over the chain",
                    time_limit=max(0.1, min(CHAIN_RESCUE_SECONDS, CHAIN_RESCUE_SHARE * left())))
        # 2b. on training graphs past STAGE_MILP_MAX_OPS ops: the
        #     first stage program's plan, repaired (one round of stage_milp: there it
        #     comes closer to its bound than the heuristics below, in seconds)
        #     (without a time limit too, unless exact=False, for at most
        #     STAGE_MILP_ONE_UNLIMITED_SECONDS)
        one_round = use_exact or (unlimited and asked_exact is None)
        if (training and extra() and one_round and n > STAGE_MILP_MAX_OPS
                and STAGE_MILP_ONE_SHARE * left() >= STAGE_MILP_ONE_SECONDS and "stage_milp" not in tried):
            run("stage_milp", "the first 0/1 stage program's plan, repaired, with the program's proven bound",
                time_limit=min(STAGE_MILP_ONE_UNLIMITED_SECONDS, STAGE_MILP_ONE_SHARE * left()) if unlimited
                else STAGE_MILP_ONE_SHARE * left(), rounds=1)
        # 3. the chain DP on training graphs that split into stages
        if training and extra() and n <= CHAIN_DP_MAX_OPS:
            run("chain_dp", "the graph is a chain of stages: the DP is optimal for chains",
                time_limit=max(0.1, min(0.5, 0.1 * limit)))
        # 3b. eviction guided by the stage LP's plan at the step most over the budget
        if training and extra() and not close_enough():
            run("lp_eviction", "eviction guided by the stage LP's relaxed plan",
                time_limit=max(0.3, min(LP_EVICTION_SECONDS, 0.5 * left()) if unlimited else 0.6 * left()), ix=ix)
        # 3c. with a time limit, the 0/1 stage program, solved, as a schedule and a bound
        #     at once (it may prove its schedule optimal where the heuristics stop well
        #     above the bound; its held rounds need most of a short limit, so it comes
        #     before the heuristics below)
        stage_program()
        # 3d. which forward values the backward keeps, as a covering MILP over the steps
        #     over the budget (on GPT-style LMs often cheaper than lp_eviction)
        if training and extra() and not close_enough() and left() > MIN_SLICE and n <= STAGED_MAX_OPS:
            run("cover", "the backward keeps what a covering MILP over the steps over the budget keeps",
                time_limit=max(0.3, min(COVER_SECONDS, 0.3 * left())), ix=ix)
        # 3e. exact layer blocks composed over the chain of blocks
        if training and extra() and not close_enough() and has_time():
            run("block_dp", "each distinct layer block solved exactly, composed by a DP over the chain",
                time_limit=max(0.3, min(BLOCK_DP_SECONDS if unlimited else 2 * BLOCK_DP_SECONDS, 0.3 * left())),
                min_repeats=BLOCK_DP_MIN_REPEATS)
        # 3f. staged recomputation on the reference order (it plans the whole memory
        #     curve, which eviction decides step by step)
        if extra() and not close_enough() and left() > MIN_SLICE and n <= STAGED_MAX_OPS:
            share = min(STAGED_SECONDS, 0.5 * STAGED_SHARE * left()) if unlimited else 0.5 * STAGED_SHARE * left()
            _staged(graph, ix, budget, consider, tried, deadline=_time.perf_counter() + share, drop=use_drop,
                    orders=[list(range(n))], name="staged")
        # 4a. nothing fits yet: staged recomputation on the low-memory orders (where
        #     on-demand eviction thrashes on many long-lived values)
        if best[0] is None and left() > MIN_SLICE and n <= STAGED_MAX_OPS:
            share = min(STAGED_SECONDS, STAGED_SHARE * left()) if unlimited else STAGED_SHARE * left()
            _staged(graph, ix, budget, consider, tried, deadline=_time.perf_counter() + share, drop=use_drop,
                    name="staged_free")
        # 4. order search where order freedom matters: forward-only graphs, or when a
        #    low-memory order beats the reference peak
        if extra() and (has_time() or (best[0] is None and left() > 0)):
            free_peak = min(order_peak(ix, min_memory_order(ix, tie=t)) for t in ("ref", "depth"))
            matters = not training or n <= SMALL_OPS or free_peak < ref_peak * (1 - ORDER_GAIN)
            if matters:
                share = 0.6 if not training else 0.3
                cap_s = (2.0 if n <= 1000 else 4.0) if unlimited else limit
                run("order_search", "memory-aware reordering removes recomputation",
                    time_limit=max(0.3, min(cap_s, share * left())))
            else:
                tried["order_search"] = "skipped: reordering does not lower the peak"
        if best[0] is None and (unlimited or _time.perf_counter() < t0 + limit):
            seq = min_peak_sequence(ix, budget, deadline=t0 + limit)
            if seq is not None:
                consider("min_peak", Schedule(sequence=[ix.ids[i] for i in seq], method="min_peak",
                                              info={"order": "free"}),
                         "the low-memory recipe is the only one that fits")
        # 4b. nothing fits a tiny graph: every schedule in any order, searched
        #     exhaustively (what fits there may run a forward op again after a backward
        #     one, or a gradient op twice, which no heuristic does)
        if best[0] is None and n <= BRUTE_FORCE_MAX_OPS:
            from solver.methods.bruteforce import brute_force

            try:
                consider("brute_force", brute_force(graph, budget, max_ops=BRUTE_FORCE_MAX_OPS),
                         "nothing else fits: the exhaustive search over every schedule of a tiny graph")
            except (InfeasibleBudget, SolverError) as exc:
                tried["brute_force"] = f"{type(exc).__name__}: {exc}"[:200]
        # 5. exact methods on small graphs, warm-started, while the gap is not closed
        #    (also when the time is spent and no heuristic fits, with a short slice each:
        #    the only chance left)
        rescue, hopeless = best[0] is None, False
        stage_program()  # (where only the searches after 3c found a schedule)
        if rescue and best[0] is None and n <= EXACT_MAX_OPS:
            # no exact method fits a budget that making some op's inputs resident
            # exceeds in every order: the rescue would spend the rest of the limit
            from solver.feasibility import last_computed_rules_out

            seconds = PROOF_SECONDS if unlimited else min(PROOF_SECONDS, max(0.0, left()))
            culprit = last_computed_rules_out(graph, budget, time_limit=seconds)
            if culprit is not None:
                hopeless = True
                tried["last_computed_peak_bound"] = f"no schedule fits: the inputs of {culprit!r} do not"
        if n <= EXACT_MAX_OPS and use_bound and not rescue and use_exact and left() > 1.0 and extra():
            # the stage bounds first (a fraction of a second here): the exact methods
            # run only while they leave the gap open
            # (the fixed-order one first where the best schedule keeps the reference
            # order: it is the stronger)
            scopes = ("free", "fixed") if reorders.get(best[0].method, True) else ("fixed", "free")
            roomy = left() >= EARLY_MILP_SECONDS
            for scope in scopes:
                if not close_enough():
                    stage_bound(scope, EARLY_BOUND_SHARE * left())
            if not close_enough() and roomy:
                # the exact model's LP relaxation proves more than the exact methods
                # do in the same time where they find nothing better; with less time,
                # they get it
                stage_bound("milp", MILP_BOUND_SHARE * left())
            if not close_enough() and not best[0].offloads and left() > MIN_SLICE:
                # the search over the best schedule's recomputations before the exact
                # methods, which rarely find better in seconds
                better = improve_sequence(graph, best[0].sequence, budget,
                                          deadline=_time.perf_counter() + LNS_SHARE * left(), ix=ix)
                consider("lns", Schedule(sequence=list(better), method="lns"),
                         "large neighbourhood search over the best schedule's recomputations")
        if n <= EXACT_MAX_OPS and not hopeless and (rescue or (use_exact and left() > 1.0 and extra() and not close_enough())):
            hint = best[0] if best[0] is not None and not reorders.get(best[0].method, True) else None
            for k, name in enumerate(("cpsat", "checkmate_milp")):
                if best[0] is not None and (left() <= 1.0 or close_enough()):
                    break
                share = 0.5 * left() if k == 0 else left()
                kw = {"time_limit": max(MIN_SLICE if best[0] is None else 0.5, share)}
                if hint is not None:
                    kw["hint"] = hint
                run(name, "exact method on a small graph, warm-started from the heuristics", **kw)
    reserve[0] = 0.0  # the tail is the winner's
    sched, key, why = best
    if sched is None:
        raise NoScheduleFound(
            f"auto found no schedule of {graph.name or 'the graph'} within {budget} B "
            f"(tried {', '.join(tried) or 'nothing'}); give more time or a larger budget"
        )
    if use_drop and extra() and not sched.offloads:
        # 6. drop the recomputations that the budget does not need (the heuristics plan
        #    with a conservative memory model and evict more than they must)
        slice_s = min(DROP_SECONDS if unlimited else max(0.5, 0.1 * limit), max(MIN_SLICE, left()))
        cheaper = drop_recomputations(graph, sched.sequence, budget,
                                      deadline=_time.perf_counter() + slice_s)
        cost = simulate(graph, cheaper).cost
        if len(cheaper) < len(sched.sequence) and cost <= key[0]:
            sched.info = {**sched.info, "dropped_recomputations": len(sched.sequence) - len(cheaper),
                          "cost_before_dropping": key[0]}
            sched.sequence, key = cheaper, (cost, len(cheaper))
            if sched.lower_bound is not None:
                sched.lower_bound = min(sched.lower_bound, cost)
    picked = sched.method or next(k for k, v in tried.items() if v == key[0])
    sched.info = dict(sched.info)
    fixed_scope = not _reorders(ix, sched.sequence)  # a fixed-order bound holds for the winner
    if fixed_scope and proven[0] is not None and (sched.lower_bound is None or proven[0] > sched.lower_bound):
        sched.lower_bound = min(proven[0], key[0])  # an exact candidate's bound holds for the winner
    elapsed = _time.perf_counter() - t0
    bound = None
    if key[0] <= base * (1 + 1e-12):
        bound = base  # no extra compute: optimal for any order
    elif sched.lower_bound is not None and sched.lower_bound >= base:
        bound = float(sched.lower_bound) if fixed_scope or sched.info.get("bound_scope") == "free order" else None
        if not fixed_scope and bound is None:
            sched.info["fixed_order_lower_bound"] = float(sched.lower_bound)
    scope = "free order" if bound is not None and sched.info.get("bound_scope") == "free order" else "fixed order"
    close = bound is not None and key[0] - bound <= tolerance * (key[0] - base) + 1e-9

    def late() -> bool:
        """On graphs past :data:`STAGE_MILP_MAX_OPS` ops, a bound is known and too little
        time is left for another: each has a setup (0.2-0.5 s on 5,000-7,000 ops) that
        would run past the time limit. (On smaller graphs a bound's setup is short, and
        a bound begun with little time left can still prove more.)"""
        return not unlimited and n > STAGE_MILP_MAX_OPS and bound is not None and left() < MIN_SLICE

    # on graphs past STAGE_MILP_MAX_OPS ops with a time limit and too little time left
    # for a bound's setup, the winner keeping the reference order: only the fixed-order
    # bound (the stronger there), not both
    hurried = not unlimited and n > STAGE_MILP_MAX_OPS and fixed_scope and left() < MIN_SLICE
    # with a time limit, on graphs past BOUND_LIMITED_MAX_OPS ops whose winner keeps the
    # reference order with a fixed-order bound known (stage_milp's): not the bound valid in
    # any order, which the search after the bounds needs the time of (it proves less
    # there: docs/tuning.md, BOUND_LIMITED_MAX_OPS)
    settled = not unlimited and fixed_scope and n > BOUND_LIMITED_MAX_OPS and bound is not None
    if use_bound and not close and not late() and not hurried and not settled:
        # the bound valid in any order first: the stage LP at ops placed by the DAG alone
        f_time = min(0.5 * LP_BOUND_SECONDS, max(0.3, 0.25 * elapsed)) if unlimited else max(0.0, 0.3 * left())
        if fixed_scope and not unlimited:
            f_time /= 3  # the fixed-order bound after it is the stronger one
        flb = min(stage_bound("free", f_time), key[0])
        if flb > base and (bound is None or flb >= bound):
            bound, scope = flb, "free order"
            close = key[0] - bound <= tolerance * (key[0] - base) + 1e-9
    def with_fixed_bound(lb: float) -> None:
        nonlocal bound, scope, close
        lb = min(lb, key[0])
        if fixed_scope:
            if bound is None or lb > bound:
                bound, scope = lb, "fixed order"
            close = key[0] - bound <= tolerance * (key[0] - base) + 1e-9
        elif lb > base:
            sched.info["fixed_order_lower_bound"] = lb

    def searching() -> bool:
        return (not close and key[0] > base * (1 + 1e-12) and not sched.offloads and left() > MIN_SLICE
                and n <= STAGED_MAX_OPS)

    def search(share: float, stop=None) -> None:
        """6b. the stage bounds leave the gap open: a large neighbourhood search over the
        winner's recomputations, its order of first runs kept (so the bound's scope
        stays the winner's)."""
        nonlocal key, bound, close
        others = [seq for _, name, seq in sorted(starts, key=lambda x: x[0]) if name != picked][:LNS_STARTS - 1]
        better = improve_sequence(graph, sched.sequence, budget, deadline=_time.perf_counter() + share, ix=ix,
                                  more=others, stop=stop)
        cost = simulate(graph, better).cost
        tried["lns"] = cost
        if cost < key[0]:
            sched.info = {**sched.info, "cost_before_lns": key[0]}
            sched.sequence, key = list(better), (cost, len(better))
            if bound is not None:
                bound = min(bound, cost)
            close = bound is not None and key[0] - bound <= tolerance * (key[0] - base) + 1e-9

    fixed_next = use_bound and not close and "fixed_order_lower_bound" not in sched.info and not late()
    if fixed_next and fixed_scope and not unlimited and n > BOUND_LIMITED_MAX_OPS and searching():
        # with a time limit, on graphs past BOUND_LIMITED_MAX_OPS ops whose winner keeps
        # the reference order: the fixed-order bound and the search side by side, each
        # with the time left (SCIP and GLOP release the interpreter while they solve);
        # the search stops once the bound closes the gap
        share = PARALLEL_SHARE * left()
        closing = enough()
        got: dict = {}
        proved = threading.Event()

        def prove() -> None:
            try:
                got["lb"] = stage_bound("fixed", share)
                if got["lb"] >= closing - 1e-9:
                    proved.set()
            except BaseException as exc:  # re-raised below, in the caller's thread
                got["error"] = exc

        worker = threading.Thread(target=prove, name="remat-fixed-order-bound", daemon=True)
        worker.start()
        try:
            search(share, stop=proved.is_set)
        finally:
            worker.join()  # (the bound keeps its own time limit)
        if "error" in got:
            raise got["error"]
        with_fixed_bound(got["lb"])
    else:
        if fixed_next:
            # then the fixed-order bounds: the forced recomputation (milliseconds on
            # thousands of ops), small LPs at the steps most over the budget, then the 0/1
            # stage program at the best of them
            lp_time = min(LP_BOUND_SECONDS, max(0.3, 0.25 * elapsed)) if unlimited else max(0.0, 0.5 * left())
            if not fixed_scope:
                lp_time = min(lp_time, 0.5 * LP_BOUND_SECONDS)  # for the record only: the winner reorders
            with_fixed_bound(stage_bound("fixed", lp_time))
        if searching():
            # (with a time limit on graphs too large for the MILP's bound after it, the
            # whole time left)
            if unlimited:
                share = min(LNS_SECONDS, LNS_SHARE * left())
            else:
                share = (LNS_SHARE if n <= BOUND_LIMITED_MAX_OPS else 0.95) * left()
            search(share)
    if use_bound and not close and "fixed_order_lower_bound" not in sched.info:
        # a small share of the time when no limit was given (solver.optimize calls auto)
        b_time = min(2.0, max(0.2, 0.25 * elapsed)) if unlimited else left()
        if "milp" in found or (b_time > 0.1 and (n <= BOUND_MAX_OPS or (not unlimited and b_time >= 5.0
                                                                         and n <= BOUND_LIMITED_MAX_OPS))):
            lb = stage_bound("milp", b_time)
            if lb is not None:
                lb = min(lb, key[0])
                if fixed_scope:
                    if bound is None or lb > bound:
                        bound, scope = lb, "fixed order"
                else:
                    sched.info["fixed_order_lower_bound"] = max(lb, sched.info.get("fixed_order_lower_bound", lb))
    if bound is None and key[0] > base * (1 + 1e-12):
        bound, scope = base, "free order"  # every schedule runs each op at least once
    sched.lower_bound = bound
    if bound is not None:
        sched.info["bound_scope"] = "any order" if key[0] <= base * (1 + 1e-12) else scope
    sched.info["auto"] = {"picked": picked, "why": why, "tried": tried, "ops": n,
                          "time_limit": limit, "schedule_seconds": elapsed,
                          "winner_seconds": found_at[0], "reordered": {k: v for k, v in reorders.items()}}
    sched.method = f"auto:{picked}"
    return sched


def _staged(graph, ix, budget: int, consider, tried: dict, *, deadline: float, drop: bool,
            orders: list | None = None, name: str = "staged") -> None:
    """Offer the cheapest staged recomputation over ``orders`` (default: the low-memory
    orders), its unneeded recomputations dropped, to ``consider`` as ``name``."""
    from solver.methods.minpeak import low_memory_orders
    from solver.methods.staged import staged_sequence

    fixed = orders is not None
    best, best_cost = None, None
    for k, order in enumerate(orders if fixed else low_memory_orders(ix, deadline=deadline)):
        if k and _time.perf_counter() > deadline:
            break
        seq = staged_sequence(ix, order, budget, deadline=deadline)
        if seq is None:
            continue
        ids = [ix.ids[i] for i in seq]
        if drop:
            slice_s = max(MIN_SLICE, min(DROP_SECONDS, deadline - _time.perf_counter()))
            ids = drop_recomputations(graph, ids, budget, deadline=_time.perf_counter() + slice_s)
        cost = simulate(graph, ids).cost
        if best_cost is None or cost < best_cost:
            best, best_cost = ids, cost
    if best is None:
        tried[name] = "NoScheduleFound: no stage plan fits"
        return
    consider(name, Schedule(sequence=best, method=name, info={"order": "fixed" if fixed else "free"}),
             "staged recomputation: planned over the whole memory curve" if fixed else
             "staged recomputation on a low-memory order: the only plan that relieves every stage over the budget")


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

"""The fixed-order lower bounds (forced recomputation, the stage LP) never exceed what a
fixed-order schedule costs: the brute-force optimum on small graphs, every eviction
schedule on larger ones, and every schedule found on captured graphs. The free-order
bounds never exceed what any schedule costs, in any order."""

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphs import ComputeGraph
from solver import InfeasibleBudget, NoScheduleFound, simulate
from solver.bounds import (fixed_order_bound, forced_recompute_bound, free_order_bound, free_stage_lp_bound,
                           stage_lp_bound, tight_boundaries)
from solver.methods import milp
from solver.methods.bruteforce import brute_force, brute_force_fixed
from solver.solving import get_method
from solver.synthetic import budget_between, random_training_graph, small_graph
from tests.paths import BENCHMARK_GRAPHS
from tests.solver.test_auto import captured_model


def _all_bounds(g, budget):
    """Every fixed-order bound: forced recomputation, the stage LP and the 0/1 stage
    program with one boundary, a few, and every op (projections included), and the best
    of them that fixed_order_bound finds, also from sets of boundaries given."""
    every = list(g.order)
    out = [forced_recompute_bound(g, budget), fixed_order_bound(g, budget),
           fixed_order_bound(g, budget, boundaries=[every[::2], every[1::2], every[-3:]])]
    for integral in (False, True):
        # the 0/1 program's bound holds when it stops early too (None: it proved nothing)
        limit = 1.0 if integral else None
        found = [stage_lp_bound(g, budget, stages=1, integral=integral, time_limit=limit),
                 stage_lp_bound(g, budget, stages=3, integral=integral, time_limit=limit),
                 stage_lp_bound(g, budget, boundaries=every, integral=integral, time_limit=limit)]
        out += [b for b in found if b is not None or not integral]
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1),
       outputs=st.booleans(), inputs=st.booleans())
def test_never_above_the_brute_force_optimum(kind, size, seed, frac, outputs, inputs):
    # fixed-order bounds against the fixed-order optimum, free-order ones against the
    # optimum over every order
    g = small_graph(kind, size, seed, outputs=outputs, inputs=inputs)
    assert len(g.ops) <= 8
    budget = budget_between(g, frac)
    for bounds, search in ((_all_bounds(g, budget), brute_force_fixed), (_free_bounds(g, budget), brute_force)):
        assert all(b is not None and b >= g.total("time") for b in bounds)
        try:
            best = search(g, budget)
        except (NoScheduleFound, InfeasibleBudget):
            continue
        cost = simulate(g, best.sequence).cost
        assert max(bounds) <= cost * (1 + 1e-9), (search.__name__, bounds, cost)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(4, 40), seed=st.integers(0, 10_000), frac=st.floats(0.2, 1))
def test_never_above_an_eviction_schedule(n, seed, frac):
    # eviction's sequences lie outside the stage space that brute force enumerates
    g = random_training_graph(n, seed=seed)
    budget = budget_between(g, frac)
    try:
        s = get_method("eviction").fn(g, budget)
    except NoScheduleFound:
        return
    r = simulate(g, s)
    assert r.peak_bytes <= budget
    assert max(_all_bounds(g, budget)) <= r.cost * (1 + 1e-9)


def _tight_chain() -> ComputeGraph:
    g = ComputeGraph()
    for v, b in zip("abcd", [1, 4, 3, 3]):
        g.add_node(v, bytes=b, time=2.0)
    for u, v in ["ab", "bc", "cd", "ad"]:
        g.add_edge(u, v)
    return g


def test_it_rises_above_store_all_and_proves_infeasibility():
    g = _tight_chain()
    assert forced_recompute_bound(g, 8) == 8.0
    assert forced_recompute_bound(g, 7) == pytest.approx(10.0)
    assert brute_force_fixed(g, 7).lower_bound == pytest.approx(10.0)  # and it is tight here
    assert forced_recompute_bound(g, 6) == math.inf
    with pytest.raises((NoScheduleFound, InfeasibleBudget)):
        brute_force_fixed(g, 6)


def test_unrecomputable_values_cannot_go_and_outputs_are_read_at_the_end():
    g = _tight_chain()
    g["a"]["recomputable"] = False
    assert forced_recompute_bound(g, 7) == math.inf
    g = _tight_chain()
    g["a"]["output"] = True  # a may still go at c and be computed again for the end
    assert forced_recompute_bound(g, 7) == pytest.approx(10.0)
    assert brute_force_fixed(g, 7).lower_bound == pytest.approx(10.0)


def test_the_fixed_order_lower_bound_uses_it():
    g = _tight_chain()
    assert milp.lower_bound(g, 7, time_limit=5) >= forced_recompute_bound(g, 7)
    assert milp.lower_bound(g, 6, time_limit=5) == math.inf


@pytest.mark.skipif(not BENCHMARK_GRAPHS.exists(), reason="public benchmark graphs not present")
def test_vgg16_at_90_percent():
    g = ComputeGraph.load(BENCHMARK_GRAPHS / "VGG16_256_224_224_3_train.json")
    budget = int(0.9 * simulate(g, g.order).peak_bytes)
    bound = forced_recompute_bound(g, budget)
    base = g.total("time")
    # the optimum is +1.968 % (checkmate_milp proves it); the bound sits in between
    assert base * 1.005 < bound <= simulate(g, get_method("eviction").fn(g, budget)).cost
    assert forced_recompute_bound(g, int(0.8 * simulate(g, g.order).peak_bytes)) == math.inf


# ------------------------------------------------------------------------- stage LP
def test_stage_lp_is_tight_on_the_small_chain_and_proves_infeasibility():
    g = _tight_chain()
    assert stage_lp_bound(g, 8) == 8.0  # store-all fits: no boundary
    assert stage_lp_bound(g, 7) == pytest.approx(10.0, rel=1e-5)
    assert stage_lp_bound(g, 6) == math.inf
    g["a"]["recomputable"] = False
    assert stage_lp_bound(g, 7) == math.inf


def _skip_chain() -> ComputeGraph:
    g = ComputeGraph()
    for v, nb, tm in zip("xyzuw", [1, 3, 2, 1, 1], [10.0, 1.0, 1.0, 1.0, 1.0]):
        g.add_node(v, bytes=nb, time=tm)
    for u, v in ["xy", "yz", "zu", "uw", "yw"]:
        g.add_edge(u, v)
    return g


def test_stage_lp_sees_that_a_recomputation_needs_its_inputs():
    # x -> y -> z -> u -> w, and w reads y too. At u, y (3 B) cannot stay beside z and u;
    # computing it again for w needs x (1 B, dead by then, costly to run again), which
    # cannot stay beside y and z at z either: x and y run again (+11). The forced bound
    # drops a third of y (a fractional knapsack, +1/3); the LP at u must also keep x or
    # run it again (+1/2 at best, half of x kept), and with z as a boundary too, keeping x is ruled out (+11/3).
    g = _skip_chain()
    base = g.total("time")
    best = simulate(g, brute_force_fixed(g, 5).sequence).cost
    assert best == pytest.approx(base + 11)
    assert forced_recompute_bound(g, 5) == pytest.approx(base + 1 / 3)
    assert stage_lp_bound(g, 5) == pytest.approx(base + 1 / 2, rel=1e-5)
    assert stage_lp_bound(g, 5, boundaries=["z", "u"]) == pytest.approx(base + 11 / 3, rel=1e-5)


def test_stage_lp_refuses_unknown_ops():
    g = _tight_chain()
    with pytest.raises(ValueError, match="not an op"):
        stage_lp_bound(g, 7, boundaries=["zz"])


def test_the_integral_program_closes_what_the_relaxation_leaves_open():
    # the example above: the LP keeps half of x at u (+1/2); with x kept whole or run
    # again, the 0/1 program at u alone sees that y goes and is run again (+1); with z
    # too it is tight
    g = _skip_chain()
    base = g.total("time")
    assert stage_lp_bound(g, 5, boundaries=["u"]) == pytest.approx(base + 1 / 2, rel=1e-5)
    assert stage_lp_bound(g, 5, boundaries=["u"], integral=True) == pytest.approx(base + 1, rel=1e-5)
    assert stage_lp_bound(g, 5, boundaries=["z", "u"], integral=True) == pytest.approx(base + 11, rel=1e-5)
    assert simulate(g, brute_force_fixed(g, 5).sequence).cost == pytest.approx(base + 11)


def _lp_lower_with_more_boundaries():
    """A random training graph where the stage LP at two boundaries is below the LP at
    one of them (found by search: seed 549 of ``random_training_graph``)."""
    g = random_training_graph(7, seed=549)
    return g, 30


def test_the_lp_may_fall_with_a_boundary_added_the_integral_program_may_not():
    # the LP keeps f6 (an input of b6) at a fifth at both boundaries, and that fifth
    # serves a fifth of a recomputation of b6 in each interval: two disjoint parts of a
    # plan lean on one fraction of a value. The 0/1 program cannot, and stays put
    g, budget = _lp_lower_with_more_boundaries()
    one, two = ["b5"], ["b5", "b1"]
    assert stage_lp_bound(g, budget, boundaries=two) < stage_lp_bound(g, budget, boundaries=one) - 0.5
    assert stage_lp_bound(g, budget, boundaries=two, integral=True) >= \
        stage_lp_bound(g, budget, boundaries=one, integral=True) - 1e-6


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(3, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1),
       picks=st.lists(st.integers(0, 7), min_size=2, max_size=4, unique=True))
def test_the_integral_program_never_falls_with_a_boundary_added(kind, size, seed, frac, picks):
    # every 0/1 solution at more boundaries is one at fewer (liveness at a boundary is
    # whole), so stage_milp's rounds, which only add boundaries, prove ever more
    g = small_graph(kind, size, seed)
    budget = budget_between(g, frac)
    ops = list(g.order)
    marks = [ops[p % len(ops)] for p in picks]
    fewer = stage_lp_bound(g, budget, boundaries=marks[:-1], integral=True)
    more = stage_lp_bound(g, budget, boundaries=marks, integral=True)
    if math.isinf(fewer):
        assert math.isinf(more)
    else:
        base = g.total("time")
        assert more >= fewer - 1e-4 * (fewer - base) - 1e-9 * base


def test_the_integral_program_may_stop_at_a_gap_and_its_bound_still_holds(monkeypatch):
    # with gap, SCIP gets it as its relative MIP gap; what it returns is its proven bound
    # (at most the optimum) and a solution within that gap of it
    import solver.lp_backend as lp_backend

    g = random_training_graph(60, seed=1)
    budget = budget_between(g, 0.3)
    base = g.total("time")
    exact = stage_lp_bound(g, budget, stages=4, integral=True)  # (the steps most over the budget)
    gaps = []
    real = lp_backend.solve_quietly

    def record(solver, params=None):
        gaps.append(None if params is None else params.GetDoubleParam(params.RELATIVE_MIP_GAP))
        return real(solver, params)

    monkeypatch.setattr(lp_backend, "solve_quietly", record)
    sol: dict = {}
    loose = stage_lp_bound(g, budget, stages=4, integral=True, gap=0.3, solution=sol)
    assert gaps == [pytest.approx(0.3)]
    assert base < loose <= exact + 1e-6 * (exact - base)
    assert sol and base + sol["value"] >= exact - 1e-6 * (exact - base)
    assert sol["value"] <= 1.3 * (loose - base) * (1 + 1e-4) + 1e-9 * base


def test_stage_lp_out_of_time_is_none():
    g = random_training_graph(150, seed=0)
    budget = budget_between(g, 0.3)
    assert stage_lp_bound(g, budget, stages=64, time_limit=1e-4) is None


# ------------------------------------------------------------------ free order
def _path_boundaries(g):
    """Single boundaries at every op that may be one, and the longest path's ops as a
    chain of boundaries."""
    import networkx as nx

    sub = g.nx.subgraph(g.ops)
    path = nx.dag_longest_path(sub)
    return [[v] for v in g.order] + ([path] if len(path) > 1 else [])


def _free_bounds(g, budget):
    out = [free_order_bound(g, budget)]
    for integral in (False, True):
        out += [free_stage_lp_bound(g, budget, boundaries=b, integral=integral) for b in _path_boundaries(g)]
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_multi_output_groups_keep_the_bounds_below_the_optimum(kind, size, seed, frac):
    # two consecutive ops of the reference order made projections of one op, which one
    # run yields together at ``group_time`` (their times shared out, as capture does)
    g = small_graph(kind, size, seed)
    members = list(g.order)[1:3]
    total = sum(g[v]["time"] for v in members)
    for j, v in enumerate(members):
        g[v].update(group="op", group_index=j, group_time=total)
    budget = budget_between(g, frac)
    # a projection may be a boundary: both order freedoms, each against its optimum
    for bounds, search in ((_all_bounds(g, budget), brute_force_fixed), (_free_bounds(g, budget), brute_force)):
        try:
            best = search(g, budget)
        except (NoScheduleFound, InfeasibleBudget):
            continue
        assert max(bounds) <= simulate(g, best.sequence).cost * (1 + 1e-9), (search.__name__, bounds)


def test_free_bound_holds_where_reordering_beats_the_fixed_order():
    # a forward-only fan: the reference order runs the big branches first; another
    # order frees each one before the next, so the fixed-order bound is no bound here
    g = ComputeGraph()
    g.add_node("x", bytes=1, time=5.0)
    for k in range(3):
        g.add_node(f"a{k}", bytes=4, time=1.0)
        g.add_edge("x", f"a{k}")
    for k in range(3):
        g.add_node(f"s{k}", bytes=1, time=1.0)
        g.add_edge(f"a{k}", f"s{k}")
    g.add_node("out", bytes=1, time=1.0, output=True)
    for k in range(3):
        g.add_edge(f"s{k}", "out")
    g.order = ["x", "a0", "a1", "a2", "s0", "s1", "s2", "out"]
    budget = budget_between(g, 0.3)
    free = brute_force(g, budget)
    free_cost = simulate(g, free.sequence).cost
    assert free_order_bound(g, budget) <= free_cost * (1 + 1e-9)
    assert g.total("time") <= free_order_bound(g, budget)


def test_free_bound_is_tight_on_a_chain_and_proves_infeasibility():
    g = _tight_chain()  # a chain with one skip edge: every order is the reference order
    assert free_order_bound(g, 8) == 8.0
    assert free_order_bound(g, 7) == pytest.approx(10.0, rel=1e-5)
    assert free_order_bound(g, 6) == math.inf


def test_free_bound_refuses_boundaries_off_a_path():
    g = ComputeGraph()
    for v in "abc":
        g.add_node(v, bytes=1, time=1.0)
    g.add_edge("a", "b"); g.add_edge("a", "c")
    with pytest.raises(ValueError, match="ancestor"):
        free_stage_lp_bound(g, 2, boundaries=["b", "c"])


# ------------------------------------------------------------- captured graphs
CAPTURED = {
    "mlp": {"batch": 512, "depth": 3, "hidden": 256},  # activations outweigh the weights
    "gpt": {"n_layer": 1, "d": 16, "seq": 8, "batch": 2, "n_head": 2},  # multi-output groups, views
    "resnet": {"blocks": 1},
}


def _captured(name):
    return captured_model(name, **CAPTURED[name])


def _between(g, fractions):
    from solver.methods.minpeak import smallest_feasible_peak

    found = smallest_feasible_peak(g)[0]
    top = simulate(g, g.order).peak_bytes
    return [int(found + f * (top - found)) for f in fractions]


@pytest.mark.parametrize("name", list(CAPTURED))
def test_fixed_order_bounds_never_above_schedules_of_captured_graphs(name):
    from solver.methods.auto import _reorders
    from solver.indexed import IndexedGraph

    g = _captured(name)
    ix = IndexedGraph.of(g)
    compared = 0
    for budget in _between(g, (0.1, 0.4, 0.8)):
        bound = fixed_order_bound(g, budget, time_limit=2)
        free = free_order_bound(g, budget, time_limit=2)
        assert bound >= g.total("time") and free >= g.total("time")
        costs, any_order = [], []
        for method in ("eviction", "hierarchical", "chain_dp"):
            try:
                s = get_method(method).fn(g, budget, time_limit=2)
            except (NoScheduleFound, InfeasibleBudget):
                continue
            r = simulate(g, s)
            if r.valid and r.peak_bytes <= budget:
                any_order.append(r.cost)
                if not _reorders(ix, s.sequence):
                    costs.append(r.cost)
        if any_order:
            assert free <= min(any_order) * (1 + 1e-9), (name, budget, free, min(any_order))
        if costs:  # near the smallest peak, only a reordering may fit
            compared += 1
            assert bound <= min(costs) * (1 + 1e-9), (name, budget, bound, min(costs))
    assert compared >= 2, f"too few fixed-order schedules of {name} to compare with"


def test_fixed_order_bound_never_above_the_exact_optimum_of_a_captured_mlp():
    g = _captured("mlp")
    (budget,) = _between(g, (0.2,))
    s = get_method("checkmate_milp").fn(g, budget, time_limit=30, hint=get_method("eviction").fn(g, budget))
    assert s.info.get("status") == "optimal", s.info
    optimum, base = simulate(g, s).cost, g.total("time")
    bound = fixed_order_bound(g, budget)
    assert base < bound <= optimum * (1 + 1e-9)
    assert base <= free_order_bound(g, budget) <= optimum * (1 + 1e-9)


# ------------------------------------------------------- which boundaries are tried
def _search(lp: dict, program, *, marks, pool, every, time_limit=5.0):
    """:func:`solver.bounds._best_of` over a made-up relaxation: the LP at one step is
    ``lp[step]``, the 0/1 program at a set of steps is ``program(steps)``."""
    from solver.bounds import _best_of
    from solver.deadline import Deadline

    calls = []

    def bound_at(steps, integral, seconds):
        calls.append((tuple(steps), integral))
        return program(tuple(steps)) if integral else lp.get(steps[0], 100.0)

    best = _best_of(bound_at, marks, 100.0, 100.0, Deadline(time_limit), time_limit, None, every=every, pool=pool)
    return best, calls


def test_the_scan_finds_the_best_single_step_off_the_tries():
    # the LP peaks at step 57, which is neither among the tries nor on the stride
    lp = {t: 100.0 + 10.0 - abs(t - 57) * 0.1 for t in range(200)}
    best, calls = _search(lp, lambda steps: max(lp[t] for t in steps), marks=[0, 1, 2, 3], pool=list(range(200)),
                          every=[150, 0, 1])
    assert best == lp[57]
    assert ((57,), False) in calls and ((57,), True) in calls


def test_the_grown_program_keeps_the_boundaries_that_raise_it():
    # the program gains only from the most-over step (150) and one step far from the best
    # LP step (its neighbours add nothing); it never falls with a boundary added
    lp = {t: 100.0 + (10.0 if t == 40 else 5.0 if t in (41, 42, 120) else 1.0) for t in range(200)}

    def program(steps):
        return 110.0 + 3.0 * (150 in steps) + 2.0 * (120 in steps) if 40 in steps else max(lp[t] for t in steps)

    best, calls = _search(lp, program, marks=[40, 41, 42, 120], pool=list(range(200)), every=[150, 40])
    assert best == 115.0
    assert ((40, 120, 150), True) in calls


def _toy():
    g = ComputeGraph()
    for v, nb, t in zip("xyzuw", [1, 3, 2, 1, 1], [10, 1, 1, 1, 1]):
        g.add_node(v, bytes=nb, time=float(t))
    for e in ["xy", "yz", "zu", "uw", "yw"]:
        g.add_edge(*e)
    return g


def test_given_boundaries_raise_the_bound_to_the_optimum_where_the_reference_ones_do_not():
    # the 0/1 program at two steps where the budget binds proves the optimum (x computed
    # again); without candidates of its own the bound stays at the forced recomputation
    g = _toy()
    optimum = simulate(g, brute_force_fixed(g, 5).sequence).cost
    assert optimum == pytest.approx(25.0)
    forced = forced_recompute_bound(g, 5)
    assert forced < optimum - 1 and fixed_order_bound(g, 5, tries=0) == pytest.approx(forced)
    assert fixed_order_bound(g, 5, tries=0, boundaries=[["z", "u"]]) == pytest.approx(optimum, rel=1e-5)
    # ids not in the graph are left out; empty sets change nothing
    assert fixed_order_bound(g, 5, tries=0, boundaries=[["nope"], []]) == pytest.approx(forced)


def test_the_program_runs_at_given_boundaries_only_where_their_lp_beats_the_first_candidates(monkeypatch):
    # the LP at each given set is checked first (milliseconds); a set whose LP is below
    # the LP at the step most over the budget gets no 0/1 program of its own
    import solver.bounds as bounds

    g = random_training_graph(20, seed=4)
    budget = budget_between(g, 0.4)
    ops = list(g.order)
    programs = []
    real = bounds.stage_lp_bound

    def spy(*args, **kw):
        lb = real(*args, **kw)
        programs.append((tuple(kw["boundaries"]), kw.get("integral", False), lb))
        return lb

    monkeypatch.setattr(bounds, "stage_lp_bound", spy)
    weak, strong = ops[:1], ops  # the first op (nothing is live there) and every op
    lb = fixed_order_bound(g, budget, tries=0, boundaries=[weak, strong])
    first = programs[0]
    assert not first[1] and first[0] not in (tuple(weak), tuple(strong))  # the first candidate's LP
    lps = {marks: lb for marks, integral, lb in programs if not integral}
    assert lps[tuple(weak)] < first[2] < lps[tuple(strong)]
    solved = {marks: lb for marks, integral, lb in programs if integral}
    assert list(solved) == [tuple(strong)] and lb == pytest.approx(solved[tuple(strong)])
    assert lb > lps[tuple(strong)]  # the program proves more than its LP here


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1))
def test_tight_boundaries_are_first_computations_where_a_schedule_is_closest_to_the_budget(kind, size, seed, frac):
    from solver import bounds

    g = small_graph(kind, size, seed)
    budget = budget_between(g, frac)
    try:
        seq = brute_force_fixed(g, budget).sequence
    except (NoScheduleFound, InfeasibleBudget):
        return
    curve = simulate(g, seq).memory_curve
    first = {}
    for pos, v in enumerate(seq):
        first.setdefault(v, pos)
    marks = tight_boundaries(g, budget, seq, most=2)
    ops = list(g.order)
    assert len(marks) <= 2 and marks == sorted(marks, key=ops.index)
    floor = bounds.TIGHT_SHARE * (budget - g.fixed_bytes) + g.fixed_bytes
    assert all(curve[first[v]] >= floor for v in marks)
    top = max((curve[p] for p in first.values()), default=0)
    assert (top >= floor) == bool(marks)
    if marks:
        assert max(curve[first[v]] for v in marks) == top  # the highest run is among them
    # the program at them bounds the fixed-order optimum too
    lb = fixed_order_bound(g, budget, boundaries=[marks])
    assert lb <= simulate(g, seq).cost * (1 + 1e-9)

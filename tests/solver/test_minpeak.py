"""Tests of the smallest feasible peak and of InfeasibleBudget."""


import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from graphs import ComputeGraph
from solver.methods.bruteforce import brute_force_min_peak
from solver.indexed import IndexedGraph
from solver.methods.minpeak import min_peak_sequence, smallest_feasible_peak
from tests.paths import BENCHMARK_GRAPHS, needs_benchmark_graphs
from solver.synthetic import random_training_graph, training_chain

BENCH = BENCHMARK_GRAPHS


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 4), seed=st.integers(0, 10_000))
def test_found_is_reachable_and_bounded(n, seed):
    g = random_training_graph(n, seed=seed)
    found, lb, culprit = smallest_feasible_peak(g)
    assert lb == solver.peak_lower_bound(g)[0]
    assert lb <= found <= solver.simulate(g, g.order).peak_bytes
    best, _ = brute_force_min_peak(g)
    assert best <= found  # exhaustive search is the true minimum
    seq = min_peak_sequence(IndexedGraph.of(g), found)
    assert seq is not None


def test_below_bound_raises_with_achievable_smallest():
    g = training_chain(6, fwd_bytes=5)
    lb = solver.peak_lower_bound(g)[0]
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, lb - 1)
    exc = info.value
    assert exc.smallest_feasible_bytes >= lb
    assert str(exc.smallest_feasible_bytes) in str(exc)
    assert f"op {exc.culprit!r} (" in str(exc)  # the op's id, then its name
    s = solver.solve(g, exc.smallest_feasible_bytes)
    assert s.peak_bytes <= exc.smallest_feasible_bytes


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_infeasible_budget_reports_achievable_budget(n, seed):
    g = random_training_graph(n, seed=seed)
    lb = solver.peak_lower_bound(g)[0]
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, lb - 1, time_limit=2)
    s = solver.solve(g, info.value.smallest_feasible_bytes, time_limit=2)
    assert solver.simulate(g, s).peak_bytes <= info.value.smallest_feasible_bytes


@needs_benchmark_graphs
def test_vgg16_smallest_peak_and_culprit():
    g = ComputeGraph.load(BENCH / "VGG16_256_224_224_3_train.json")
    top = solver.simulate(g, g.order).peak_bytes
    found, lb, culprit = smallest_feasible_peak(g)
    assert found == lb  # the footprint bound is reached
    assert 0.82 < found / top < 0.84
    assert culprit is not None
    inputs = sum(g[u]["bytes"] for u in g.op_preds(culprit))
    assert inputs + g[culprit]["bytes"] == lb - g.fixed_bytes
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, int(0.8 * top))
    assert info.value.smallest_feasible_bytes == found


def test_measuring_schedule_does_not_depend_on_the_search_time(monkeypatch):
    """The schedule planning measures a step in (``planning.lowest_peak_sequence``) stays
    within the margin of its target, or else within the target, when the timed
    lowest-peak search is cut short, as on a loaded machine: a search cut at once stops
    at the orders' own peak."""
    from solver.methods import minpeak
    from solver.join.planning import MEASURE_MARGIN, lowest_peak_sequence

    g = training_chain(24)
    store_all = solver.simulate(g, g.order).peak_bytes
    found = smallest_feasible_peak(g, time_limit=5.0)[0]
    cut = minpeak.smallest_feasible_peak
    monkeypatch.setattr(minpeak, "smallest_feasible_peak", lambda graph, **kw: cut(graph, time_limit=0.0))
    assert cut(g, time_limit=0.0)[0] > (found + store_all) // 2  # the cut search alone would not do
    roomy = int((found + store_all) / 2 / MEASURE_MARGIN)
    assert solver.simulate(g, lowest_peak_sequence(g, target=roomy)).peak_bytes <= MEASURE_MARGIN * roomy
    # at the smallest figure found, with no room for the margin: within the target itself
    assert solver.simulate(g, lowest_peak_sequence(g, target=found)).peak_bytes <= found


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000))
def test_the_relaxed_peak_bound_never_exceeds_the_smallest_peak(kind, size, seed):
    from solver.bounds import relaxed_peak_bound
    from solver.synthetic import small_graph

    g = small_graph(kind, size, seed)
    lb = solver.peak_lower_bound(g)[0]
    best, _ = brute_force_min_peak(g)
    upper = solver.simulate(g, g.order).peak_bytes
    assert lb <= relaxed_peak_bound(g, lower=lb, upper=upper, time_limit=5) <= best


def test_a_budget_the_relaxation_rules_out_is_proven_infeasible():
    # a graph where every op's own footprint allows 34 B, but no schedule in any order
    # peaks below 39 B: the order-free stage relaxation proves it, so asking for 38 B is
    # infeasible (not merely unreached), and the figures are exact
    from solver.bounds import relaxed_peak_bound
    from solver.errors import BudgetNotReached
    from solver.synthetic import small_graph

    g = small_graph(1, 6, 37)
    lb = solver.peak_lower_bound(g)[0]
    best, _ = brute_force_min_peak(g)
    assert lb < 38 < best == 39
    assert relaxed_peak_bound(g, lower=lb, upper=best) == best
    for method in ("auto", "eviction"):
        with pytest.raises(solver.InfeasibleBudget) as info:
            solver.solve(g, 38, method=method)
        exc = info.value
        assert not isinstance(exc, BudgetNotReached)
        assert exc.proven and exc.lower_bound_bytes == exc.smallest_feasible_bytes == best


def _with_run_once_ops(g, seed, share=0.3):
    """``g`` with about ``share`` of its ops marked as run-once (random ops)."""
    import random

    rng = random.Random(seed)
    for v in g.ops:
        if rng.random() < share:
            g[v]["recomputable"] = False
    return g


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), groups=st.booleans())
def test_the_run_once_bound_never_exceeds_the_smallest_peak(kind, size, seed, groups):
    from solver.feasibility import run_once_peak_bound
    from solver.synthetic import small_graph

    g = _with_run_once_ops(small_graph(kind, size, seed, groups=groups), seed)
    bound, culprit, held = run_once_peak_bound(g, time_limit=None)
    best, _ = brute_force_min_peak(g)
    assert solver.peak_lower_bound(g)[0] <= bound <= best
    assert held >= 0 and (culprit is not None or held == 0)


def test_the_run_once_bound_rises_where_a_random_op_is_read_late():
    # among small training graphs with random run-once ops, some have a footprint bound
    # below the true smallest peak: the run-once bound rises on several, and stays at or
    # below the brute-force smallest peak there
    from solver.feasibility import run_once_peak_bound
    from solver.synthetic import small_graph

    raised = 0
    for seed in range(40):
        g = _with_run_once_ops(small_graph(1, 8, seed), seed)
        bound, culprit, held = run_once_peak_bound(g, time_limit=None)
        lb = solver.peak_lower_bound(g)[0]
        if bound > lb:
            raised += 1
            assert held > 0 and culprit in g.ops
            assert bound <= brute_force_min_peak(g)[0]
    assert raised >= 3


def test_a_dropout_gpt_budget_below_what_its_masks_hold_is_proven_infeasible():
    """On a captured GPT with dropout, the masks (random, run once) and what reads them
    later must stay resident beside the largest backward op: the bound rises above the
    footprint bound, stays below the smallest peak reached, and a budget between the two
    bounds is reported infeasible (not merely unreached), naming the held bytes."""
    pytest.importorskip("torch")
    from solver.errors import BudgetNotReached
    from solver.feasibility import run_once_peak_bound
    from tests.solver.test_auto import captured_model

    g = captured_model("gpt", n_layer=2, d=16, seq=32, batch=2, n_head=4, vocab=32)
    assert any(not g[v].get("recomputable", True) for v in g.ops)  # the dropout masks
    lb = solver.peak_lower_bound(g)[0]
    bound, culprit, held = run_once_peak_bound(g, time_limit=None)
    found = smallest_feasible_peak(g, time_limit=5)[0]
    assert lb < bound <= found
    assert held > 0 and g[culprit]["phase"] == "backward"
    budget = (lb + bound) // 2
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, budget, method="eviction")
    exc = info.value
    assert not isinstance(exc, BudgetNotReached)
    assert exc.lower_bound_bytes == bound and exc.held_bytes == held
    assert f"op {culprit!r} (" in str(exc)  # named once, unquoted
    assert "not computed again" in str(exc) and "random ops' results" in str(exc)  # what is held, named
    # offloading moves a mask off the device while it waits: below the bound, so the
    # bound is for recomputation only
    s = solver.solve(g, budget, method="offload", bandwidth=1e12, time_limit=10)
    assert solver.simulate(g, s, bandwidth=1e12).peak_bytes <= budget < bound


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), groups=st.booleans())
def test_the_last_computed_bound_never_exceeds_the_smallest_peak(kind, size, seed, groups):
    from solver.feasibility import last_computed_peak_bound
    from solver.synthetic import small_graph

    g = small_graph(kind, size, seed, groups=groups)
    lb = solver.peak_lower_bound(g)[0]
    best, _ = brute_force_min_peak(g)
    # (an upper figure above the smallest peak, as the bound never exceeds it)
    bound, culprit = last_computed_peak_bound(g, lower=lb, upper=2 * best, time_limit=10)
    assert lb <= bound <= best
    assert (culprit is None) == (bound == lb)


def test_the_last_computed_bound_rises_where_a_join_waits_for_a_second_branch():
    # among small training graphs, some have a footprint bound below the true smallest
    # peak that the search back from an op's inputs closes: it rises on several, each
    # time to at most the brute-force smallest peak
    from solver.feasibility import last_computed_peak_bound
    from solver.synthetic import small_graph

    raised = 0
    for seed in range(60):
        g = small_graph(1, 8, seed)
        lb = solver.peak_lower_bound(g)[0]
        best, _ = brute_force_min_peak(g)
        bound, culprit = last_computed_peak_bound(g, lower=lb, upper=2 * best, time_limit=10)
        if bound > lb:
            raised += 1
            assert bound <= best and culprit in g.ops
    assert raised >= 3


def test_the_last_computed_bound_leaves_graphs_past_its_size_alone(monkeypatch):
    # a graph whose bound rises; past the size limit it is not searched (on 10,000 ops
    # the search held gigabytes and ran seconds past its limit)
    from solver import feasibility
    from solver.synthetic import small_graph

    for seed in range(60):
        g = small_graph(1, 8, seed)
        lb = solver.peak_lower_bound(g)[0]
        if feasibility.last_computed_peak_bound(g, lower=lb, upper=2 * lb, time_limit=10)[0] > lb:
            break
    else:
        pytest.fail("no small graph where the bound rises")
    monkeypatch.setattr(feasibility, "LAST_COMPUTED_MAX_OPS", len(g.ops) - 1)
    assert feasibility.last_computed_peak_bound(g, lower=lb, upper=2 * lb, time_limit=10) == (lb, None)
    assert feasibility.last_computed_rules_out(g, lb, time_limit=10) is None


def test_a_captured_resnet_budget_below_what_its_joins_need_is_proven_infeasible():
    """On a captured ResNet the gradient of a residual's skip is held while the
    convolution's backward on the other branch runs with its workspace: no single op
    shows it, the search back from the inputs does. A budget between the footprint
    bound and the raised one is reported infeasible (not merely unreached), by
    ``auto`` with a time limit too."""
    pytest.importorskip("torch")
    from solver.errors import BudgetNotReached
    from solver.feasibility import last_computed_peak_bound
    from tests.solver.test_auto import captured_model

    g = captured_model("resnet")
    lb = solver.peak_lower_bound(g)[0]
    found = smallest_feasible_peak(g, time_limit=5)[0]
    top = solver.simulate(g, g.order).peak_bytes
    bound, culprit = last_computed_peak_bound(g, lower=lb, upper=top, time_limit=10)
    assert lb < bound <= found < top
    assert g[culprit]["phase"] == "backward"
    budget = (lb + bound) // 2
    # (auto, with a limit, proves it before its exact methods would spend the limit on
    # it, which left no time for the figures: a bare NoScheduleFound; so does solve
    # before an exact method called by name: cpsat ended with a bare NoScheduleFound)
    for method, limit in (("eviction", None), ("auto", 10), ("cpsat", 4), ("checkmate_milp", 4),
                          ("stage_milp", 4), ("cpsat", None)):
        with pytest.raises(solver.InfeasibleBudget) as info:
            solver.solve(g, budget, method=method, time_limit=limit)
        exc = info.value
        assert not isinstance(exc, BudgetNotReached)
        assert exc.lower_bound_bytes > budget and exc.held_before
        assert "computed last" in str(exc)


def test_a_budget_below_the_footprint_bound_names_the_raised_bound():
    """A budget below what one op alone needs is refused before any method runs; the
    error names the higher bound that the search back from the inputs proves (closer to
    the smallest peak found: what ops that run once hold or what making an op's inputs
    resident needs), never above the brute-force smallest peak. A method that
    offloads gets the footprint bound only: the raised one holds for recomputation."""
    from solver.feasibility import last_computed_peak_bound
    from solver.synthetic import small_graph

    checked = 0
    for seed in range(60):
        g = small_graph(1, 8, seed)
        lb = solver.peak_lower_bound(g)[0]
        best, _ = brute_force_min_peak(g)
        if last_computed_peak_bound(g, lower=lb, upper=2 * best, time_limit=10)[0] <= lb:
            continue
        with pytest.raises(solver.InfeasibleBudget) as info:
            solver.solve(g, lb - 1, method="eviction")
        exc = info.value
        assert lb < exc.lower_bound_bytes <= best <= exc.smallest_feasible_bytes
        # (the reason named is the raised bound's, not the footprint's)
        assert exc.held_before or exc.held_bytes > 0 or exc.culprit is None
        assert "alone needs its inputs + output resident" not in str(exc)
        with pytest.raises(solver.InfeasibleBudget) as info:
            solver.solve(g, lb - 1, method="offload")
        assert info.value.lower_bound_bytes == lb
        checked += 1
    assert checked >= 3


def test_a_failure_on_a_long_chain_names_the_peak_chens_segments_reach():
    # on 2,000 layers the low-memory search's eviction probes do not finish in their
    # 0.8 s, so without the chain family's figure the error named the store-all peak,
    # ten times what Chen's segments reach
    from solver.methods.baselines import chen_sqrt
    from solver.synthetic import training_chain

    g = training_chain(2000)
    top = solver.simulate(g, g.order).peak_bytes
    chen = solver.simulate(g, chen_sqrt(g, top // 10)).peak_bytes
    assert chen < top // 5
    with pytest.raises(solver.InfeasibleBudget) as info:
        solver.solve(g, chen - 1, method="store_all")
    assert info.value.smallest_feasible_bytes <= chen

"""The 0/1 stage program as a schedule: valid, within the budget, first runs in the
reference order, its bound never above the fixed-order optimum, and never costlier
than the brute force's optimum where it says it is optimal."""

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.methods.bruteforce import brute_force_fixed
from solver.methods.stage_milp import sequence_from_stages, stage_milp
from solver.synthetic import budget_between, small_graph
from tests.solver.test_auto import captured_model
from tests.solver.test_staged import _first_runs


def _check(g, budget, s):
    r = solver.simulate(g, s)
    assert r.valid, r.error
    assert r.peak_bytes <= budget
    assert _first_runs(s.sequence) == list(g.order)
    assert g.total("time") <= s.lower_bound <= r.cost * (1 + 1e-9)
    return r


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 2), size=st.integers(2, 8), seed=st.integers(0, 10_000), frac=st.floats(0, 1),
       grouped=st.booleans(), held=st.booleans())
def test_never_below_and_optimal_only_at_the_brute_force_optimum(kind, size, seed, frac, grouped, held):
    g = small_graph(kind, size, seed)
    if grouped and len(g.ops) >= 3:  # two ops made projections of one multi-output op
        members = list(g.order)[1:3]
        total = sum(g[v]["time"] for v in members)
        for j, v in enumerate(members):
            g[v].update(group="op", group_index=j, group_time=total)
    budget = budget_between(g, frac)
    try:
        best = solver.simulate(g, brute_force_fixed(g, budget).sequence).cost
    except (NoScheduleFound, InfeasibleBudget):
        best = None
    try:
        # (held: the rounds of large graphs, one boundary first and two more a round)
        s = stage_milp(g, budget, time_limit=5, **(dict(hold_rounds=True, first=1, more=2) if held else {}))
    except NoScheduleFound as exc:
        if "infeasible" in str(exc):
            assert best is None, "the stage program called a budget infeasible that a schedule fits"
        return
    r = _check(g, budget, s)
    # the brute force searches Checkmate's stages, which never compute again after the
    # last op; the stage program's sequences may (an output freed and made again at
    # the end), so it may fit where the brute force does not, and cost less
    if best is not None:
        assert s.lower_bound <= best * (1 + 1e-9)
        if s.info["optimal"]:
            assert r.cost <= best * (1 + 1e-9), (r.cost, best)


def test_the_solution_becomes_the_reference_order_with_recomputations_in_place():
    g = ComputeGraph()
    for v, b in zip("abcd", [1, 4, 3, 3]):
        g.add_node(v, bytes=b, time=2.0)
    for e in ("ab", "bc", "cd", "ad"):
        g.add_edge(*e)
    # "a" computed again after boundary "c", just before its reader "d"
    assert sequence_from_stages(g, ["c"], {"a": [0]}) == ["a", "b", "c", "a", "d"]
    s = stage_milp(g, 7)
    assert s.sequence == ["a", "b", "c", "a", "d"] and s.info["optimal"]
    assert s.lower_bound == pytest.approx(10.0, rel=1e-5)


def test_an_infeasible_stage_program_is_reported():
    g = ComputeGraph()
    for v, b in zip("abc", [4, 4, 4]):
        g.add_node(v, bytes=b, time=1.0)
    g.add_edge("a", "b"), g.add_edge("b", "c")
    with pytest.raises(NoScheduleFound, match="infeasible"):
        stage_milp(g, 7)  # b alone needs a and b: 8 bytes


@pytest.mark.parametrize("name,kwargs", [("unet", {}), ("gpt", {"n_layer": 2, "d": 32, "seq": 16, "batch": 4})])
def test_on_captured_graphs_the_bound_is_below_every_schedule(name, kwargs):
    g = captured_model(name, **kwargs)
    top = solver.simulate(g, g.order).peak_bytes
    compared = 0
    for frac in (0.9, 0.8, 0.7, 0.6):
        budget = int(frac * top)
        others = []
        for method in ("eviction", "lns", "cover"):
            try:
                others.append(solver.simulate(g, solver.solve(g, budget, method=method, time_limit=2)).cost)
            except (NoScheduleFound, InfeasibleBudget):
                continue
        try:
            s = stage_milp(g, budget, time_limit=10)
        except NoScheduleFound as exc:
            if "infeasible" in str(exc):  # then no fixed-order method fits either
                assert not others, (frac, others)
            continue
        r = _check(g, budget, s)
        assert all(s.lower_bound <= c * (1 + 1e-9) for c in others), (frac, s.lower_bound, others)
        compared += bool(others) and r.cost > g.total("time")
    assert compared >= 2


def test_auto_keeps_the_bound_of_a_stage_program_that_gave_no_schedule(monkeypatch):
    import dataclasses

    from solver import registry
    from solver.synthetic import training_chain

    # past auto's exact methods' size (their bounds would join), within stage_milp's
    g = training_chain(70)
    budget = budget_between(g, 0.3)
    before = solver.solve(g, budget, method="auto", time_limit=5, bound=False, gap_tolerance=0.0)
    assert before.gap > 0
    proved = before.cost  # above what the others prove: the one auto must then report

    def no_schedule(graph, budget_bytes, **_):
        raise NoScheduleFound("none in the time", lower_bound=proved)

    info = registry.registered()["stage_milp"]
    monkeypatch.setitem(registry._REGISTRY, "stage_milp", dataclasses.replace(info, fn=no_schedule))
    # no other bound (bound=False): what auto reports is what the failed program proved
    s = solver.solve(g, budget, method="auto", time_limit=5, bound=False, gap_tolerance=0.0)
    assert s.info["auto"]["tried"]["stage_milp"].startswith("NoScheduleFound")
    assert s.info["bound_scope"] == "fixed order" and s.lower_bound == pytest.approx(min(proved, s.cost))
    assert s.lower_bound > before.lower_bound


def test_a_long_chain_of_recomputations_is_put_in_order():
    from solver.synthetic import chain

    g = chain(3000)  # deeper than Python's recursion limit
    ops = list(g.order)
    seq = sequence_from_stages(g, [ops[-1]], {v: [0] for v in ops[:-1]})
    assert seq == ops + ops[:-1]  # each after its input, all after the last boundary
    assert solver.simulate(g, seq).valid


def test_rounds_prove_ever_more_and_stop_at_enough():
    # a graph whose first programs give sequences over the budget: each round adds
    # boundaries, so its bound never falls; asked to stop at the first round's bound,
    # the method stops there
    from solver.synthetic import random_training_graph

    g = random_training_graph(30, seed=10)
    budget = budget_between(g, 0.5)
    full = stage_milp(g, budget, time_limit=30)
    bounds = [r["bound"] for r in full.info["rounds"]]
    assert len(bounds) >= 3 and all(b is not None for b in bounds)
    assert all(later >= earlier - 1e-6 * earlier for earlier, later in zip(bounds, bounds[1:]))
    assert all(r["seconds"] >= 0 for r in full.info["rounds"])
    try:
        early = stage_milp(g, budget, time_limit=30, enough=bounds[0])
    except NoScheduleFound as exc:  # the first round's sequence did not fit
        assert exc.lower_bound == pytest.approx(bounds[0])
    else:
        assert len(early.info["rounds"]) == 1


def test_its_boundaries_are_those_the_next_round_would_solve_at():
    # stopped after two rounds with the plan still over the budget, the method says where
    # the third round puts its boundaries: the program there proves what that round proves
    from solver.bounds import stage_lp_bound
    from solver.synthetic import random_training_graph

    g = random_training_graph(30, seed=10)
    budget = budget_between(g, 0.5)
    full = stage_milp(g, budget, time_limit=30)
    two = stage_milp(g, budget, time_limit=30, rounds=2)
    assert [r["boundaries"] for r in two.info["rounds"]] == [r["boundaries"] for r in full.info["rounds"][:2]]
    assert two.info["rounds"][-1]["peak"] > budget  # (its schedule is the plan, repaired)
    marks = two.info["boundaries"]
    ops = list(g.order)
    assert len(marks) == full.info["rounds"][2]["boundaries"] and marks == sorted(marks, key=ops.index)
    third = stage_lp_bound(g, budget, boundaries=marks, integral=True, time_limit=30)
    assert third == pytest.approx(full.info["rounds"][2]["bound"]) and third > two.lower_bound
    assert full.info["boundaries"] and set(full.info["boundaries"]) <= set(ops)


def test_a_held_program_keeps_its_intervals_and_bounds_nothing():
    # holding every interval to what the program's own solution computes again there
    # leaves its optimum; holding them to nothing forbids every recomputation
    from solver.bounds import stage_lp_bound
    from solver.methods.stage_milp import _intervals
    from solver.synthetic import random_training_graph

    g = random_training_graph(12, seed=3)
    budget = budget_between(g, 0.4)
    ops = list(g.order)
    marks = [ops[len(ops) // 3], ops[len(ops) // 2]]
    solution: dict = {}
    whole = stage_lp_bound(g, budget, boundaries=marks, integral=True, time_limit=10, solution=solution)
    assert solution["redo"] and whole > g.total("time")
    held = _intervals(ops, {v: i for i, v in enumerate(ops)}, solution)
    again: dict = {}
    same = stage_lp_bound(g, budget, boundaries=marks, integral=True, time_limit=10, solution=again, hold=held)
    assert same == pytest.approx(whole)
    assert set(again["redo"]) <= {v for vs in held.values() for v in vs}
    nothing = {key: set() for key in held}
    assert stage_lp_bound(g, budget, boundaries=marks, integral=True, time_limit=10, hold=nothing) == math.inf


def test_held_rounds_reach_the_optimum_the_whole_rounds_prove():
    # held rounds (the whole program restricted to the last plan's intervals where no new
    # boundary falls) find boundaries where the plan fits; the whole program there,
    # started from that plan, then proves it optimal: the cost the rounds of whole
    # programs prove optimal too
    from solver.synthetic import random_training_graph

    g = random_training_graph(20, seed=0)
    budget = budget_between(g, 0.35)
    s = stage_milp(g, budget, time_limit=60, hold_rounds=True, first=1, more=2)
    rounds = s.info["rounds"]
    assert any(r["held"] for r in rounds)
    assert all(r["bound"] is None for r in rounds if r["held"])  # a restriction proves nothing
    assert rounds[-1]["held"] is False and rounds[-1]["cost"] is not None
    r = _check(g, budget, s)
    whole = stage_milp(g, budget, time_limit=60)
    assert s.info["optimal"] and whole.info["optimal"]
    assert r.cost == pytest.approx(solver.simulate(g, whole).cost, rel=1e-6)


@pytest.fixture
def unhurried(monkeypatch):
    """Every stage program solved, whatever time is left: for tests of which rounds run."""
    import solver.bounds as bounds

    real = bounds.stage_lp_bound

    def solve_fully(*args, **kw):
        return real(*args, **{**kw, "time_limit": max(kw["time_limit"], 30.0)})

    monkeypatch.setattr(bounds, "stage_lp_bound", solve_fully)


def test_past_the_soft_limit_only_held_rounds_closing_in_go_on(monkeypatch, unhurried):
    # a graph whose rounds are held from the second on: with its soft limit spent at
    # once, the first round's plan (1.29x the budget) is too far over for more rounds;
    # where every plan counts as closing in, the held rounds go on past it
    import importlib

    from solver.synthetic import random_training_graph

    module = importlib.import_module("solver.methods.stage_milp")  # (solver.methods is a function)
    g = random_training_graph(24, seed=3)
    budget = budget_between(g, 0.35)
    kw = dict(time_limit=60, hold_rounds=True, first=1, more=2)
    free = stage_milp(g, budget, **kw)
    peaks = [r["peak"] for r in free.info["rounds"]]
    assert len(peaks) >= 3 and free.info["rounds"][1]["held"]
    assert peaks[0] > module.NEAR_OVER * budget
    at_once = stage_milp(g, budget, soft_limit=0.0, **kw)
    assert len(at_once.info["rounds"]) == 1
    monkeypatch.setattr(module, "NEAR_OVER", max(peaks) / budget + 0.01)
    on = stage_milp(g, budget, soft_limit=0.0, **kw)
    # (which of equally good plans a program returns may differ between runs: the rounds
    # are compared by how far they go, not plan by plan)
    rounds = on.info["rounds"]
    assert len(rounds) >= 3 and rounds[1]["held"]
    assert min(r["peak"] for r in rounds) <= min(peaks) * module.HELD_OVER


def test_a_held_plan_far_over_the_budget_ends_the_rounds_where_the_caller_asks(monkeypatch, unhurried):
    # give_up_over: the rounds end after a held round whose plan peaks above that times
    # the budget (auto passes it, and gives its other searches the time); without it
    # they go on
    import importlib

    from solver.synthetic import random_training_graph

    module = importlib.import_module("solver.methods.stage_milp")
    monkeypatch.setattr(module, "FIRST_GIVE_UP", 10.0)  # (the first plan: the test below)
    g = random_training_graph(24, seed=3)
    budget = budget_between(g, 0.35)
    kw = dict(time_limit=60, hold_rounds=True, first=1, more=2)
    rounds = stage_milp(g, budget, **kw).info["rounds"]
    over = [i for i, r in enumerate(rounds) if r["held"] and r["peak"] is not None and r["peak"] > budget]
    assert over and over[0] < len(rounds) - 1  # a held plan over the budget, and rounds after it
    s = stage_milp(g, budget, give_up_over=1.0, **kw)  # (its first held plan, repaired, fits)
    ended = s.info["rounds"]
    assert ended[-1]["held"] and ended[-1]["peak"] > budget
    assert all(not r["held"] or r["peak"] is None or r["peak"] <= budget for r in ended[:-1])
    assert len(ended) < len(rounds)
    _check(g, budget, s)


def test_a_first_plan_far_over_the_budget_ends_the_rounds_where_the_caller_asks(unhurried):
    # give_up_over: a first plan to hold from that peaks above give_up_over times
    # FIRST_GIVE_UP times the budget ends the rounds at once; one just below it does not
    import importlib

    from solver.synthetic import random_training_graph

    module = importlib.import_module("solver.methods.stage_milp")
    g = random_training_graph(24, seed=3)
    budget = budget_between(g, 0.35)
    kw = dict(time_limit=60, hold_rounds=True, first=1, more=2)
    first = stage_milp(g, budget, **kw).info["rounds"][0]["peak"]
    assert first > module.HELD_OVER * budget  # (the rounds after it are held)
    below = first / (module.FIRST_GIVE_UP * budget)
    ended = stage_milp(g, budget, give_up_over=0.99 * below, **kw)  # (its plan, repaired, fits)
    assert len(ended.info["rounds"]) == 1 and not ended.info["rounds"][0]["held"]
    _check(g, budget, ended)
    on = stage_milp(g, budget, give_up_over=1.01 * below, **kw)
    assert len(on.info["rounds"]) > 1 and on.info["rounds"][1]["held"]
    _check(g, budget, on)


def test_the_first_of_held_rounds_gets_its_share_and_runs_again_without_a_solution(monkeypatch):
    # the first program of held rounds gets FIRST_SHARE of the time; where it gives no
    # solution in it, the same program runs again with the time left, and its bound counts
    import solver.bounds as bounds
    from solver.methods.stage_milp import FIRST_SHARE
    from solver.synthetic import random_training_graph

    calls = []
    real = bounds.stage_lp_bound

    def first_without_a_solution(*args, **kw):
        calls.append((list(kw["boundaries"]), kw["time_limit"]))
        if len(calls) == 1:
            kw = {**kw, "solution": {}}  # as if the program gave none in its time
        return real(*args, **kw)

    monkeypatch.setattr(bounds, "stage_lp_bound", first_without_a_solution)
    g = random_training_graph(24, seed=3)
    budget = budget_between(g, 0.35)
    s = stage_milp(g, budget, time_limit=20, hold_rounds=True, first=1, more=2)
    assert FIRST_SHARE * 20 - 1.0 <= calls[0][1] <= FIRST_SHARE * 20
    assert calls[1][0] == calls[0][0] and calls[1][1] > calls[0][1]
    rounds = s.info["rounds"]
    assert rounds[0]["cost"] is None and rounds[0]["peak"] is None and rounds[0]["bound"] > g.total("time")
    assert rounds[1]["boundaries"] == rounds[0]["boundaries"] and rounds[1]["peak"] is not None
    _check(g, budget, s)


def test_only_held_rounds_stop_at_a_gap(monkeypatch):
    # a held round proves nothing: its program may stop once its solution is within
    # HELD_GAP of its optimum; the whole rounds, whose bounds count, solve to optimality
    import solver.bounds as bounds
    from solver.methods.stage_milp import HELD_GAP
    from solver.synthetic import random_training_graph

    calls = []
    real = bounds.stage_lp_bound

    def record(*args, **kw):
        calls.append((kw.get("hold") is not None, kw.get("gap")))
        return real(*args, **kw)

    monkeypatch.setattr(bounds, "stage_lp_bound", record)
    g = random_training_graph(24, seed=3)
    budget = budget_between(g, 0.35)
    s = stage_milp(g, budget, time_limit=60, hold_rounds=True, first=1, more=2)
    assert any(held for held, _ in calls) and any(not held for held, _ in calls)
    assert all(gap == (HELD_GAP if held else None) for held, gap in calls)
    _check(g, budget, s)


def test_the_last_round_repairs_its_plan_with_the_time_left(monkeypatch):
    # a repair leaves time for the rounds after it; the last round's (one round: the
    # first program's plan, repaired) has none to leave
    import importlib
    import time

    from solver.synthetic import random_training_graph

    module = importlib.import_module("solver.methods.stage_milp")
    real = module._repaired
    given_s = []

    def timed(graph, ix, sequence, budget, deadline):
        given_s.append(deadline - time.perf_counter())
        return real(graph, ix, sequence, budget, deadline)

    monkeypatch.setattr(module, "_repaired", timed)
    g = random_training_graph(20, seed=0)  # its first program's plan is over the budget
    budget = budget_between(g, 0.6)
    kw = dict(time_limit=20, hold_rounds=False)
    stage_milp(g, budget, rounds=8, **kw)
    assert given_s and given_s[0] <= module.ROUND_REPAIR_SHARE * 20  # the first of several rounds: a share
    given_s.clear()
    one = stage_milp(g, budget, rounds=1, **kw)
    assert len(given_s) == 1 and given_s[0] > 0.5 * 20  # the only round: the time left
    assert len(one.info["rounds"]) == 1 and one.info["rounds"][0]["cost"] is None  # repaired, not as planned
    _check(g, budget, one)

"""The rotor-style chain program: exact on training chains, valid everywhere."""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import example, given, settings, strategies as st

from graphs import ComputeGraph
from solver import InfeasibleBudget, NoScheduleFound, simulate, solve
from solver.feasibility import peak_lower_bound
from solver.methods.chain import chain_dp, chain_model
from solver.synthetic import random_training_graph, training_chain


def optimal_cost(g: ComputeGraph, budget: int) -> float | None:
    """Least cost of any sequence within ``budget``: Dijkstra over (live values, done).

    Moves: run an op whose inputs are live and whose value is not live (paying its time;
    the step's memory is the live values plus its output plus workspace), or drop a live
    value for free. This is the simulator's model with the best freeing decisions.
    """
    nodes = g.nx.nodes
    ops = list(g.ops)
    idx = {v: i for i, v in enumerate(ops)}
    preds = [[idx[u] for u in g.op_preds(v)] for v in ops]
    size = [int(nodes[v]["bytes"]) for v in ops]
    work = [int(nodes[v].get("workspace", 0)) for v in ops]
    cost = [float(nodes[v]["time"]) for v in ops]
    outputs = [i for i, v in enumerate(ops) if nodes[v]["output"]]
    once = [not nodes[v]["recomputable"] for v in ops]
    cap = budget - g.fixed_bytes
    full = (1 << len(ops)) - 1
    start = (0, 0)
    dist = {start: 0.0}
    heap = [(0.0, start)]
    while heap:
        d, (live, done) = heapq.heappop(heap)
        if d > dist.get((live, done), float("inf")):
            continue
        if done == full and all(live >> o & 1 for o in outputs):
            return d
        mem = sum(size[i] for i in range(len(ops)) if live >> i & 1)
        moves = []
        for i in range(len(ops)):
            if live >> i & 1:
                if i not in outputs:
                    moves.append((0.0, (live & ~(1 << i), done)))
                continue
            if once[i] and done >> i & 1:
                continue
            if all(live >> p & 1 for p in preds[i]) and mem + size[i] + work[i] <= cap:
                moves.append((cost[i], (live | 1 << i, done | 1 << i)))
        for c, state in moves:
            nd = d + c
            if nd < dist.get(state, float("inf")) - 1e-12:
                dist[state] = nd
                heapq.heappush(heap, (nd, state))
    return None


def test_bruteforce_sanity_store_all():
    g = training_chain(3)
    peak = simulate(g, g.order).peak_bytes
    assert optimal_cost(g, peak) == pytest.approx(g.total("time"))
    assert optimal_cost(g, peak_lower_bound(g)[0] - 1) is None


@pytest.mark.parametrize("n", range(1, 7))
def test_exact_on_uniform_training_chains(n):
    g = training_chain(n)
    lo = peak_lower_bound(g)[0]
    hi = simulate(g, g.order).peak_bytes
    for budget in range(lo, hi + 1):
        want = optimal_cost(g, budget)
        if want is None:
            with pytest.raises(NoScheduleFound):
                solve(g, budget, method="chain_dp")
            continue
        s = solve(g, budget, method="chain_dp")
        assert s.peak_bytes <= budget
        assert s.cost == pytest.approx(want), (n, budget, s.sequence)


@pytest.mark.parametrize("seed", range(12))
def test_heterogeneous_training_chains_against_optimum(seed):
    # against the optimum of every order (not only the stage space): the program finds
    # a schedule exactly when one exists and never beats that optimum
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    g = training_chain(n, fwd_bytes=[rng.randint(1, 6) for _ in range(n)],
                       fwd_time=[float(rng.randint(1, 5)) for _ in range(n)],
                       bwd_bytes=[rng.randint(1, 6) for _ in range(n)])
    lo = peak_lower_bound(g)[0]
    hi = simulate(g, g.order).peak_bytes
    for budget in range(lo, hi + 1):
        want = optimal_cost(g, budget)
        if want is None:
            with pytest.raises(NoScheduleFound):
                solve(g, budget, method="chain_dp")
            continue
        s = solve(g, budget, method="chain_dp")
        assert s.peak_bytes <= budget
        assert s.cost >= want - 1e-9
    assert solve(g, hi, method="chain_dp").cost == pytest.approx(g.total("time"))


def test_uniform_chain_matches_store_all_when_it_fits():
    g = training_chain(10)
    peak = simulate(g, g.order).peak_bytes
    s = solve(g, peak, method="chain_dp")
    assert s.cost == pytest.approx(g.total("time"))


def test_cost_decreases_with_budget():
    g = training_chain(16, fwd_bytes=[(3 * i) % 7 + 1 for i in range(16)])
    lo = peak_lower_bound(g)[0]
    hi = simulate(g, g.order).peak_bytes
    costs = []
    for b in range(lo, hi + 1):
        try:
            costs.append(solve(g, b, method="chain_dp").cost)
        except NoScheduleFound:
            costs.append(float("inf"))
    assert costs == sorted(costs, reverse=True)
    assert costs[-1] == pytest.approx(g.total("time"))


def test_model_measures_stages():
    g = training_chain(3, fwd_bytes=[1, 2, 3], bwd_bytes=[5, 6, 7])
    m = chain_model(g)
    # b2 -> b1 -> b0: the gradient leaving stage i is b_i's output
    assert m.grad[3] == 0 and m.grad[2] == 7 and m.grad[1] == 6
    assert m.fwd.tolist() == [1.0, 1.0, 1.0]  # loss takes no time


def test_no_backward_falls_back_to_store_all():
    from solver.synthetic import chain
    g = chain(5)
    peak = simulate(g, g.order).peak_bytes
    assert chain_dp(g, peak).sequence == list(g.order)
    with pytest.raises(NoScheduleFound):
        chain_dp(g, peak - 1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 7), seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0))
def test_random_training_graphs_valid_and_within_budget(n, seed, frac):
    g = random_training_graph(n, seed=seed)
    lo = peak_lower_bound(g)[0]
    hi = simulate(g, g.order).peak_bytes
    budget = int(lo + frac * (hi - lo))
    try:
        s = solve(g, budget, method="chain_dp")
    except (NoScheduleFound, InfeasibleBudget):  # (none found, or proven not to exist)
        return
    r = simulate(g, s)
    assert r.valid and r.peak_bytes <= budget


def _random_chain(rng: random.Random, n: int, *, bwd_time: bool) -> ComputeGraph:
    return training_chain(
        n, fwd_bytes=[rng.randint(1, 20) for _ in range(n)],
        fwd_time=[float(rng.randint(1, 9)) for _ in range(n)],
        bwd_bytes=[rng.randint(1, 20) for _ in range(n)],
        bwd_time=[float(rng.randint(1, 9)) for _ in range(n)] if bwd_time else None)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 5), seed=st.integers(0, 10_000), bwd_time=st.booleans())
@example(n=5, seed=2758, bwd_time=False)  # recomputation hoisted above a backward
def test_equals_brute_force_of_the_stage_space_at_every_budget(n, seed, bwd_time):
    # the Checkmate stage space (what checkmate_milp optimizes), searched exhaustively;
    # on these chains the optimum often drops a checkpoint after advancing from it, and
    # sometimes recomputes for a lower stage before the backward of the stage above
    from solver.methods.bruteforce import brute_force_fixed
    g = _random_chain(random.Random(seed), n, bwd_time=bwd_time)
    lo = peak_lower_bound(g)[0]
    hi = simulate(g, g.order).peak_bytes
    for budget in range(lo, hi + 1):
        try:
            want = simulate(g, brute_force_fixed(g, budget)).cost
        except NoScheduleFound:
            # (InfeasibleBudget: proven that no schedule in any order fits)
            with pytest.raises((NoScheduleFound, InfeasibleBudget)):
                solve(g, budget, method="chain_dp")
            continue
        s = solve(g, budget, method="chain_dp")
        assert s.peak_bytes <= budget
        assert s.cost == pytest.approx(want), (n, seed, budget, s.sequence)


def test_non_persistent_checkpoint_beats_the_persistent_family():
    # f0 is a cheap start for f1's recomputation, but holding it through b2 does not fit:
    # it has to be dropped once f1 is computed and recomputed later for b1
    g = training_chain(4, fwd_bytes=[5, 19, 3, 9], fwd_time=[2.0, 8.0, 8.0, 8.0],
                       bwd_bytes=[13, 7, 4, 16])
    budget = peak_lower_bound(g)[0]
    full = solve(g, budget, method="chain_dp")
    persistent = solve(g, budget, method="chain_dp", nonpersistent=False)
    assert full.peak_bytes <= budget
    assert full.cost < persistent.cost


def test_recomputation_hoisted_above_a_backward_that_grows_memory():
    # After b4, f0, f2 and f3 are resident (36 B with b4's gradient). b3 frees f3 and
    # b4's gradient (6 B) but makes an 11 B gradient, so recomputing f1 from f0 (which
    # needs f0 and f1 together, 25 B) fits 52 B only before b3 (36 + 15 = 51), not after
    # it (41 + 15 = 56). Without that order the cheapest way recomputes f2 instead.
    from solver.methods.bruteforce import brute_force_fixed
    g = training_chain(5, fwd_bytes=[10, 15, 20, 5, 13], fwd_time=[2.0, 6.0, 9.0, 4.0, 5.0],
                       bwd_bytes=[15, 16, 3, 11, 1])
    budget = 52
    s = solve(g, budget, method="chain_dp")
    assert s.peak_bytes <= budget
    assert s.cost == pytest.approx(simulate(g, brute_force_fixed(g, budget)).cost)
    seq = s.sequence
    again = seq.index("f1", seq.index("b4"))  # the recomputation of f1
    assert again < seq.index("b3")

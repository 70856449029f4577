"""drop_recomputations grades each candidate as one simulation per candidate would."""

import random

from hypothesis import HealthCheck, given, settings, strategies as st

import solver
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.methods.drop import drop_recomputations, dropped_and_graded
from solver.synthetic import random_training_graph


def _by_simulation(graph, sequence, budget):
    """The definition: each later run, costliest first, goes when the simulator grades the
    sequence without it valid, within the budget and no costlier (to the rounding of sums
    over other steps)."""
    seq = list(sequence)
    cost = solver.simulate(graph, seq).cost
    seen, later = set(), []
    for i, v in enumerate(seq):
        if v in seen:
            later.append(i)
        seen.add(v)
    later.sort(key=lambda i: -graph[seq[i]].get("time", 0.0))
    for i in later:
        cand = seq[:i] + [None] + seq[i + 1:]
        r = solver.simulate(graph, [v for v in cand if v is not None])
        if r.valid and r.peak_bytes <= budget and r.cost <= cost * (1 + 1e-12):
            seq, cost = cand, r.cost
    return [v for v in seq if v is not None]


def _annotated(seed: int):
    """A random training graph with multi-output runs, workspaces and extra outputs."""
    g = random_training_graph(16, seed=seed)
    rng = random.Random(seed)
    fwd = [v for v in g.order if v.startswith("f")]
    for k in range(0, len(fwd) - 1, 3):
        a, b = fwd[k], fwd[k + 1]
        if rng.random() < 0.6:
            total = g[a]["time"] + g[b]["time"]
            for idx, v in enumerate((a, b)):
                g[v].update(group=f"op{k}", group_index=idx, group_time=total)
                g[v]["workspace"] = rng.randint(0, 6)
                g[v]["run_workspace"] = rng.randint(0, g[v]["workspace"])
    for v in g.order:
        if rng.random() < 0.15:
            g[v]["workspace"] = g[v].get("workspace", 0) + rng.randint(1, 5)
        if rng.random() < 0.05:
            g[v]["output"] = True
    return g


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0), slack=st.floats(0.0, 0.3))
def test_the_same_removals_as_one_simulation_per_candidate(seed, frac, slack):
    g = _annotated(seed)
    lb = solver.peak_lower_bound(g)[0]
    top = solver.simulate(g, g.order).peak_bytes
    budget = int(lb + frac * (top - lb))
    try:
        s = solver.solve(g, budget, method="eviction")
    except (NoScheduleFound, InfeasibleBudget):
        return
    # a looser budget than the schedule was made for leaves removals to find
    looser = int(budget + slack * (top - budget))
    assert drop_recomputations(g, s.sequence, looser) == _by_simulation(g, s.sequence, looser)
    # the grade handed back with the result is the simulator's grade of it
    got, grade = dropped_and_graded(g, s.sequence, looser)
    again = solver.simulate(g, got)
    assert (grade.valid, grade.peak_bytes, grade.cost) == (again.valid, again.peak_bytes, again.cost)


def test_on_a_captured_graph_the_same_removals_as_one_simulation_per_candidate():
    from examples import models
    from graphs.capture import capture

    model, inputs = models.gpt(n_layer=3, d=32, seq=32, batch=2, dropout=0.0)
    g = capture(model, inputs, backward="outputs", measure_time=False)
    top = solver.simulate(g, g.order).peak_bytes
    s = solver.solve(g, int(0.7 * top), method="eviction")
    assert len(s.sequence) > len(g.ops)  # it recomputes
    for frac in (0.7, 0.75, 0.8):
        got = drop_recomputations(g, s.sequence, int(frac * top))
        assert got == _by_simulation(g, s.sequence, int(frac * top))
    assert len(got) < len(s.sequence)  # with room to spare, some recomputations go


def test_an_invalid_schedule_comes_back_unchanged():
    g = random_training_graph(5, seed=1)
    seq = list(reversed(g.order))
    assert not solver.simulate(g, seq).valid
    assert drop_recomputations(g, seq, 10**9) == seq

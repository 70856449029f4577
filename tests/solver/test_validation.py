"""Bad input to :func:`solver.solve` is refused before any work, with the project's own
error types: the graph as :meth:`ComputeGraph.load` checks it, the time limit, and the
options each method takes."""

import math

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from graphs import ComputeGraph, GraphFormatError
from solver import simulate, solve
from solver.errors import InfeasibleBudget, SolverError
from solver.errors import OptionError
from solver.solving import methods
from solver.synthetic import budget_between, random_training_graph, small_graph, training_chain


def _chain():
    return training_chain(4, fwd_bytes=[4, 8, 8, 4])


@pytest.mark.parametrize("key,value", [("bytes", -5000), ("time", -3.0), ("time", math.nan), ("bytes", math.inf),
                                       ("bytes", "1000"), ("time", "1.0"), ("bytes", True), ("workspace", -1),
                                       ("bytes", 2.5), ("workspace", None)])
def test_solve_refuses_bad_amounts_as_load_does(key, value):
    g = _chain()
    g["f1"][key] = value
    with pytest.raises(GraphFormatError, match=rf"node 'f1' has {key}="):
        solve(g, 10**6, method="store_all")
    # the same check as a file gets
    with pytest.raises(GraphFormatError, match=rf"node 'f1' has {key}="):
        ComputeGraph.from_dict(g.to_dict())


def test_solve_refuses_an_unknown_kind():
    g = _chain()
    g["f2"]["kind"] = "layer"  # was silently dropped from the schedule
    with pytest.raises(GraphFormatError, match="unknown kind 'layer'"):
        solve(g, 10**6)


@pytest.mark.parametrize("edge,needle", [(("b0", "f0"), "cycle"), (("f2", "f2"), "reads itself")])
def test_solve_refuses_cycles_and_self_loops(edge, needle):
    g = _chain()
    g.add_edge(*edge)
    with pytest.raises(GraphFormatError, match=needle):
        solve(g, 10**6, method="eviction", time_limit=2)


def test_a_node_added_past_the_defaults_is_named():
    g = _chain()
    g.nx.add_node("z")
    with pytest.raises(GraphFormatError, match="node 'z' has no 'kind'.*ComputeGraph.add_node"):
        solve(g, 10**6, method="store_all")


@pytest.mark.parametrize("arg,needle", [("x.json", "ComputeGraph.load"), (nx.DiGraph(), r"ComputeGraph\(g\)"),
                                        (None, "got None"), ({"nodes": []}, "ComputeGraph.from_dict"),
                                        (ComputeGraph(), "no op nodes")])
def test_solve_says_what_to_pass(arg, needle):
    with pytest.raises(GraphFormatError, match=needle):
        solve(arg, 1000)


def test_a_non_topological_order_is_named_not_blamed_on_time():
    g = _chain()
    bad = ComputeGraph(g.nx.copy(), order=list(reversed(g.order)))
    with pytest.raises(GraphFormatError, match=r"not topological: node 'f1' comes before node 'f0', which it reads \(the edge 'f0' -> 'f1'\)"):
        solve(bad, 10**6, time_limit=2)


def test_nan_time_is_refused_before_the_exact_methods():
    # with a NaN time the MILP solver ran past any time limit
    g = random_training_graph(15, seed=3)
    b = budget_between(g, 0.3)
    g["f3"]["time"] = math.nan
    with pytest.raises(GraphFormatError, match="time=nan"):
        solve(g, b, method="checkmate_milp", time_limit=2)


@pytest.mark.parametrize("limit", [-1, math.nan, "5", True])
def test_solve_refuses_a_bad_time_limit(limit):
    with pytest.raises(OptionError, match="time_limit"):
        solve(_chain(), 10**6, method="store_all", time_limit=limit)


@pytest.mark.parametrize("budget", ["1000", True])
def test_solve_refuses_a_budget_that_is_not_a_number(budget):
    with pytest.raises(ValueError, match="number of bytes"):
        solve(_chain(), budget, method="store_all")


def test_unknown_method_is_the_projects_error():
    with pytest.raises(OptionError, match="unknown method 'nope'"):
        solve(_chain(), 10**6, method="nope")


@pytest.mark.parametrize("name", sorted(methods()))
def test_every_method_refuses_an_option_it_does_not_take(name):
    info = methods()[name]
    with pytest.raises(OptionError) as got:
        solve(_chain(), 10**6, method=name, kk=2)
    msg = str(got.value)
    assert f"method {name!r}" in msg and "'kk'" in msg
    assert all(opt in msg for opt in info.options)
    # (no method swallows options: each names its own)
    assert info.options is not None


def test_an_option_a_method_takes_still_goes_through():
    g = _chain()
    assert solve(g, 10**6, method="every_k", k=2).method == "every_k"
    with pytest.raises(OptionError, match="did you mean 'k'"):
        solve(g, 10**6, method="every_k", kk=2)


# -- the property: one corrupted field is refused or solved right, never hung

_CORRUPT = st.sampled_from([
    ("bytes", -5000), ("bytes", math.nan), ("bytes", math.inf), ("bytes", "1000"), ("bytes", 1.5), ("bytes", 0),
    ("time", -3.0), ("time", math.nan), ("time", math.inf), ("time", "1.0"), ("time", 0.0), ("time", 1e9),
    ("workspace", -1), ("workspace", 3), ("kind", "layer"), ("kind", "input"), ("phase", "sideways"),
    ("phase", "backward"), ("recomputable", "no"), ("recomputable", False), ("output", 1), ("output", True),
    ("edge", "cycle"), ("edge", "self"), ("edge", "extra"), ("order", "reversed"),
])


@settings(max_examples=60, deadline=None)
@given(kind=st.integers(0, 2), size=st.integers(4, 10), seed=st.integers(0, 10**6), where=st.integers(0, 10**6),
       corrupt=_CORRUPT, fraction=st.sampled_from([0.3, 0.7, 1.0]),
       method=st.sampled_from(["auto", "eviction", "checkmate_milp", "chain_dp", "store_all"]))
def test_one_corrupted_field_is_refused_or_solved_right(kind, size, seed, where, corrupt, fraction, method):
    g = small_graph(kind, size, seed)
    budget = budget_between(g, fraction)
    ops = list(g.ops)
    v = ops[where % len(ops)]
    key, value = corrupt
    if key == "edge":
        u = ops[(where // 7) % len(ops)]
        if value == "cycle":
            g.add_edge(ops[-1], ops[0])
        elif value == "self":
            g.add_edge(v, v)
        elif ops.index(u) < ops.index(v):
            g.add_edge(u, v)  # a legal extra read
    elif key == "order":
        g.order = list(reversed(ops))
    else:
        g[v][key] = value
    try:
        s = solve(g, budget, method=method, time_limit=1)
    except GraphFormatError:
        return
    except (InfeasibleBudget, SolverError):
        # a method's own failure (no schedule of it within the budget and the limit),
        # on a graph that is well formed
        g.validate()
        return
    r = simulate(g, s)
    assert r.valid and r.peak_bytes <= budget
    assert s.peak_bytes == r.peak_bytes and math.isfinite(s.cost) and s.cost == pytest.approx(r.cost)


"""Module mode's DAG holds a value a name of a block's forward binds until the block's
call ends (:func:`solver.module_plan.hold_bound_values`), in the forward and in a
checkpointed block's rerun."""

from __future__ import annotations

from graphs import ComputeGraph
from solver.module_plan import hold_bound_values
from solver.simulate import simulate


def _chain(modules: list[str]) -> ComputeGraph:
    g = ComputeGraph()
    for i, m in enumerate(modules):
        g.add_node(f"f{i}", bytes=10 * (i + 1), phase="forward", module=m)
        if i:
            g.add_edge(f"f{i - 1}", f"f{i}")
    g.order = [f"f{i}" for i in range(len(modules))]
    return g


def test_a_bound_value_is_read_by_every_later_op_of_its_modules_call_and_no_other():
    g = _chain(["blk.0", "blk.0", "blk.0.fc", "blk.0", "blk.1", "blk.1"])
    g["f0"]["held_by"] = "blk.0"
    assert hold_bound_values(g, ["blk.0", "blk.1"]) == 2  # f2 and f3; f1 already reads it
    assert sorted(g.nx.successors("f0")) == ["f1", "f2", "f3"]


def test_a_value_held_by_a_module_around_the_blocks_gets_no_edge():
    g = _chain(["", "blk.0", "blk.0", ""])
    g["f0"]["held_by"] = ""
    assert hold_bound_values(g, ["blk.0"]) == 0


def test_the_held_value_counts_at_the_later_ops():
    g = _chain(["blk.0"] * 4)
    before = simulate(g, g.order).memory_curve
    g["f0"]["held_by"] = "blk.0"
    hold_bound_values(g, ["blk.0"])
    after = simulate(g, g.order).memory_curve
    assert list(after - before) == [0, 0, 10, 10]

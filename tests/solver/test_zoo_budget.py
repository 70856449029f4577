"""optimize() on models of torchvision's and Hugging Face's structure at 0.7 and 0.5 of
the plain step's peak (or the smallest feasible budget named when one is refused): the
whole call, counted by an allocation counter that planning does not own
(``c10_allocations.c``), within the budget; the first real step within it; the
gradients those of the plain model. The cases are ``benchmarks/zoo_budget.py``'s, on
the rebuilt vision models at its smaller test sizes."""

from __future__ import annotations

import pytest

from tests.solver.test_planning_peak import SLACK, _optimize_counted, counter  # noqa: F401  (the fixture)

CHILD = "from benchmarks.zoo_budget import child; child(source='rebuilt', scale='test')"


@pytest.mark.slow
@pytest.mark.parametrize("name,fracs", [("resnet18", "0.5"), ("convnext", "0.7"), ("convnext_wide", "0.7"),
                                        ("efficientnet", "0.5"),
                                        ("vit", "0.7"), ("bert", "0.5"), ("qwen2", "0.7"), ("t5", "0.5")])
def test_optimize_holds_the_budget_and_the_gradients(counter, name, fracs):
    # one fraction of the plain step per model, 0.7 and 0.5 taking turns along the zoo
    for row in _optimize_counted(counter, name, fracs, child=CHILD)["rows"]:
        assert "error" not in row, row
        if "named" in row:  # refused, then the figure named is one that works
            assert row["named"] > row["budget"], row
            # the refused call went no higher than the figure it names
            assert row["refused_planning"] <= row["named"] + SLACK, row
        assert row["report"] <= row["used"], row  # the whole optimize() call, as the report says
        # by the counter: what the report leaves out is the random generators' states (SLACK)
        assert row["planning"] <= row["report"] + SLACK, row
        assert row["step"] <= row["used"], row  # the first real step
        assert row["differ"] == [], row


@pytest.mark.slow
def test_convolutions_are_measured_alone_before_a_step_runs_on_their_estimates(counter):
    # the convolution backward's rule made to estimate nothing: what keeps planning within
    # the budget is measuring the convolutions alone before the whole step runs
    low = ("import torch, graphs.costs\n"
           "graphs.costs.WORKSPACE_ESTIMATES[torch.ops.aten.convolution_backward.default] = lambda node: 0\n")
    for row in _optimize_counted(counter, "convnext_wide", "0.75", child=low + CHILD)["rows"]:
        assert "error" not in row and "named" not in row, row
        assert row["report"] <= row["used"], row
        assert row["planning"] <= row["report"] + SLACK, row
        assert row["step"] <= row["used"], row
        assert row["differ"] == [], row

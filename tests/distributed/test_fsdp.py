"""FSDP2 + a module-mode remat plan on 2 gloo ranks: exact training, per-rank memory as predicted."""

from __future__ import annotations

import pytest

from tests.distributed import BUDGET, STEPS, fsdp_worker, spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def full_plan(tmp_path_factory):
    return spawn(fsdp_worker, tmp_path_factory.mktemp("fsdp_full"), "full")


def test_fsdp_remat_matches_single_process(full_plan):
    for r in full_plan:
        assert len(r["loss_err"]) == STEPS
        assert max(r["loss_err"]) < 1e-5
        assert max(r["grad_err"]) < 1e-5
        assert r["ref_losses"][-1] < r["ref_losses"][0]  # the reference really trained


def test_fsdp_rank_peak_within_budget_and_prediction(full_plan):
    for r in full_plan:
        assert r["no_remat"] > BUDGET  # without remat this rank would not fit
        assert r["predicted"] <= BUDGET
        assert r["measured"] <= BUDGET
        assert abs(r["measured"] / r["predicted"] - 1) <= 0.05, r


def test_graph_mode_under_fsdp_is_refused():
    from graphs.distributed import DistributedPlanError, check_supported
    from graphs.errors import RematError

    with pytest.raises(DistributedPlanError, match="mode='module'"):
        check_supported("fsdp", "graph")
    with pytest.raises(RematError, match="offload"):
        check_supported("fsdp", "module", {"blocks.0": "offload"})

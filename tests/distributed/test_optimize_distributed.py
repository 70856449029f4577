"""``solver.optimize(..., sharding=...)`` on 2 gloo ranks: FSDP2 (module mode) and DDP
(graph and module mode) train exactly like one process on the global batch, and each
rank's measured peak fits its per-rank budget and matches the report's prediction."""

from __future__ import annotations

import pytest

from tests.distributed import BLOCKS, STEPS, WORLD, optimize_worker, spawn

@pytest.mark.slow
@pytest.mark.parametrize("sharding, mode", [("fsdp", "module"), ("ddp", "module"), ("ddp", "graph")])
def test_optimize_data_parallel(tmp_path, sharding, mode):
    ranks = spawn(optimize_worker, tmp_path, sharding, mode)
    for r in ranks:
        assert r["sharding"] == sharding and r["world_size"] == WORLD
        assert f"{sharding}, world size {WORLD}" in r["text"]
        assert r["wrapper"] == ("DistributedDataParallel" if sharding == "ddp" else "FSDPGPT")
        # same training as one process on the whole batch
        assert len(r["loss_err"]) == STEPS
        assert max(r["loss_err"]) < 1e-5
        assert max(r["grad_err"]) < 1e-5
        assert r["ref_losses"][-1] < r["ref_losses"][0]
        # the budget is per rank and binding: without remat this rank would not fit
        assert r["no_remat"] > r["asked_budget"]
        assert r["predicted"] <= r["budget"] <= r["asked_budget"]
        for measured in (r["measured"], r["verified"]):
            assert measured <= r["budget"], r
            assert abs(measured / r["predicted"] - 1) <= 0.05, r
        assert r["fits"] is True
        if sharding == "ddp":
            assert r["copy_session_apart"] is True
        if mode == "module":
            assert set(r["plan"]) <= set(BLOCKS) and any(a != "none" for a in r["plan"].values())
        else:
            assert r["recomputed"] > 0
    fixed = ranks[0]["rank_fixed"]
    if sharding == "ddp":
        assert fixed["buckets"] == fixed["grads"] > 0 and fixed["params"] > 0
    else:
        assert fixed["buckets"] == 0 and 0 < fixed["params"]


def test_graph_mode_under_fsdp_refused_before_anything():
    import torch

    from examples.models import gpt
    from graphs.distributed import DistributedPlanError
    from solver.join.optimize_model import optimize

    model, batch = gpt(n_layer=2, d=32, seq=16, batch=2, dropout=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DistributedPlanError, match="mode='module'"):
        optimize(model, 1.0, batch, mode="graph", sharding="fsdp", world_size=2)
    with pytest.raises(DistributedPlanError, match="unknown sharding"):
        optimize(model, 1.0, batch, mode="module", sharding="zero2", world_size=2)
    with pytest.raises(ValueError, match="without sharding"):
        optimize(model, 1.0, batch, world_size=2)
    # no process group here: refused with a clear message, nothing captured or wrapped
    with pytest.raises(DistributedPlanError, match="init_process_group"):
        optimize(model, 1.0, batch, mode="module", sharding="ddp", world_size=2)
    assert type(model).__name__ == "GPT" and not hasattr(model, "report")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

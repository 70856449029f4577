"""Per-rank accounting (pure math): fixed bytes, all-gather transients, rank peaks, 1F1B stages."""

from __future__ import annotations

import pytest

import tests.distributed  # noqa: F401  (puts the repository root on sys.path)
from solver.distributed import (allgather_bytes, checkpoint_sequence, rank_fixed_bytes, rank_peak, shard_bytes,
                                unit_of)
from solver.errors import SolverError
from solver.simulate import simulate
from tests.solver.test_policy import test_1f1b_hand_count_p4 as _policy_1f1b_hand_count_p4


def test_fixed_bytes_hand_count():
    # 1000 B of parameters, Adam state 2000 B
    ddp = rank_fixed_bytes(world_size=4, sharding="ddp", param_bytes=1000, optimizer_bytes=2000)
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.buckets) == (1000, 1000, 2000, 1000)
    assert rank_fixed_bytes(world_size=4, sharding="ddp", param_bytes=1000,
                            gradient_as_bucket_view=True).buckets == 0
    fsdp = rank_fixed_bytes(world_size=4, sharding="fsdp", param_bytes=1000, optimizer_bytes=2000)
    assert (fsdp.params, fsdp.grads, fsdp.optimizer, fsdp.buckets) == (250, 250, 500, 0)
    # per-unit padding: 3 units of 10 B over 4 ranks -> 3 B each
    assert rank_fixed_bytes(world_size=4, sharding="fsdp", param_bytes=30,
                            unit_param_bytes={"": 10, "a": 10, "b": 10}).params == 9
    assert shard_bytes(10, 4) == 3


def test_allgather_hand_count():
    units = {"": 100, "a": 400, "b": 300, "c": 200}
    # root + the largest unit + one prefetched + the largest unit's input shard (400 / 2)
    assert allgather_bytes(units, world_size=2) == 100 + 400 + 300 + 200
    assert allgather_bytes(units, world_size=2, prefetch=0) == 100 + 400 + 200


def test_unknown_sharding_and_world_size():
    with pytest.raises(SolverError, match="sharding"):
        rank_fixed_bytes(world_size=2, sharding="zero1", param_bytes=1)
    with pytest.raises(SolverError, match="world_size"):
        rank_fixed_bytes(world_size=0, sharding="ddp", param_bytes=1)
    assert unit_of("blocks.10.fc", ["blocks.1", "blocks.10"]) == "blocks.10"


@pytest.fixture(scope="module")
def gpt_graph():
    import torch

    from examples.models import gpt
    from graphs.capture import capture

    model, batch = gpt(n_layer=4, d=64, seq=64, batch=2, dropout=0.0)
    with torch.random.fork_rng():
        return capture(model, batch, measure_time=False)


def test_checkpoint_sequence_is_valid_and_groups_recomputation(gpt_graph):
    from solver.module_plan import block_nodes, keep_for_plan
    from solver.plans import sequence_from_keep

    plan = {f"blocks.{i}": "full" for i in range(4)}
    lazy = sequence_from_keep(gpt_graph, keep_for_plan(gpt_graph, plan))
    eager = checkpoint_sequence(gpt_graph, lazy, plan)
    assert sorted(map(str, eager)) == sorted(map(str, lazy))
    assert simulate(gpt_graph, eager).valid
    first_bwd = next(i for i, v in enumerate(eager) if gpt_graph[v]["phase"] == "backward")
    for b in plan:
        fwd = set(block_nodes(gpt_graph, b)[0])
        pos = [i for i, v in enumerate(eager) if i > first_bwd and v in fwd]
        assert pos and pos == list(range(pos[0], pos[0] + len(pos)))  # one contiguous rerun per block


def test_rank_peak_sharding_effects(gpt_graph):
    plan = {f"blocks.{i}": "full" for i in range(4)}
    from solver.module_plan import keep_for_plan
    from solver.plans import sequence_from_keep

    seq = checkpoint_sequence(gpt_graph, sequence_from_keep(gpt_graph, keep_for_plan(gpt_graph, plan)), plan)
    units = list(plan)
    single = simulate(gpt_graph, seq).peak_bytes
    ddp = rank_peak(gpt_graph, seq, world_size=2, sharding="ddp", units=units)
    assert ddp.peak_bytes == single + ddp.fixed.buckets
    f2 = rank_peak(gpt_graph, seq, world_size=2, sharding="fsdp", units=units)
    f4 = rank_peak(gpt_graph, seq, world_size=4, sharding="fsdp", units=units)
    assert f4.peak_bytes < f2.peak_bytes < ddp.peak_bytes
    # optimizer state: DDP holds all of it, FSDP a shard
    adam = 2 * ddp.fixed.params
    assert rank_peak(gpt_graph, seq, world_size=2, sharding="ddp", optimizer_bytes=adam).peak_bytes \
        == ddp.peak_bytes + adam
    assert rank_peak(gpt_graph, seq, world_size=2, sharding="fsdp", units=units,
                     optimizer_bytes=adam).peak_bytes == f2.peak_bytes + shard_bytes(adam, 2)


def test_pipeline_1f1b_stage_accounting_p4():
    _policy_1f1b_hand_count_p4()

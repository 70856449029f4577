"""Per-layer policies: fit, monotonicity, infeasibility, optimality and 1F1B stage accounting."""

import itertools

import pytest

from solver.analytic import (TransformerConfig, backward_workspace_bytes, embedding_activation_bytes,
                             embedding_parameters, layer_activation_bytes, layer_parameters,
                             loss_workspace_bytes, output_activation_bytes, output_parameters)
from solver.errors import InfeasibleBudget, SolverError
from graphs.actions import TRAINER_ACTIONS
from solver.policy import LayerAction, build_planner, policy

CFG = TransformerConfig(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000, seq_len=2048,
                        micro_batch=2)
GiB = 1024**3


def test_fits_and_monotone():
    pl = build_planner(CFG)
    lo = pl.min_peak() / GiB
    hi = pl.policy_of([LayerAction.NONE] * 8, 0).peak_bytes / GiB
    prev = None
    for k in range(21):
        gb = lo + (hi - lo) * k / 20 + 1e-6
        p = policy(CFG, gb)
        assert p.peak_bytes <= gb * GiB
        assert len(p.actions) == 8
        if prev is not None:
            assert p.extra_flops <= prev + 1e-6
        prev = p.extra_flops
    assert prev == 0  # at store-all memory nothing is recomputed
    assert "LayerPolicy" in str(p)


def test_infeasible_names_smallest_budget():
    pl = build_planner(CFG)
    with pytest.raises(InfeasibleBudget) as e:
        policy(CFG, 0.5)
    assert e.value.smallest_feasible_bytes == pl.min_peak()
    p = policy(CFG, pl.min_peak() / GiB + 1e-9)  # the named budget is enough
    assert p.peak_bytes <= pl.min_peak()


def test_exact_against_brute_force():
    cfg = CFG.replace(num_layers=4)
    pl = build_planner(cfg, hardware="pcie4")
    acts = list(TRAINER_ACTIONS)
    for frac in (0.3, 0.5, 0.7, 0.9):
        budget = int(pl.min_peak() + frac * (pl.policy_of([LayerAction.NONE] * 4, 0).peak_bytes - pl.min_peak()))
        best = min((pl.policy_of(list(c), budget) for c in itertools.product(acts, repeat=4)),
                   key=lambda p: (not p.fits, p.extra_flops))
        got = pl.solve(budget)
        assert got.fits and got.extra_flops == pytest.approx(best.extra_flops)


def test_offload_only_with_hardware_and_cost_follows_bandwidth():
    assert LayerAction.OFFLOAD not in {o.action for o in build_planner(CFG).options}
    from graphs.hardware import get_hardware
    hw = get_hardware("h100-pcie5")
    off = lambda bw: {o.action: o for o in build_planner(CFG, hardware=hw.with_(host_bandwidth=bw)).options}[
        LayerAction.OFFLOAD]
    slow, fast, huge = off(1e9), off(50e9), off(1e15)
    assert slow.stored_bytes == 0
    assert huge.extra_flops == 0 < fast.extra_flops < slow.extra_flops


def test_1f1b_hand_count_p4():
    P, L = 4, 8
    cfg = CFG.replace(num_layers=L)
    acts = [LayerAction.NONE, LayerAction.SELECTIVE, LayerAction.FULL, LayerAction.NONE,
            LayerAction.FULL, LayerAction.FULL, LayerAction.SELECTIVE, LayerAction.NONE]
    p = build_planner(cfg, pipeline_parallel=P).policy_of(acts, 10**12)
    kept = {a: layer_activation_bytes(cfg, recompute=a.value) for a in TRAINER_ACTIONS}
    none = kept[LayerAction.NONE]
    per_param = 2 + 2 + 12
    for i, stage in enumerate(p.stages):
        mine = acts[2 * i: 2 * i + 2]
        assert list(stage.layers) == [2 * i, 2 * i + 1]
        assert stage.in_flight == P - i
        act = sum(kept[a] for a in mine)
        params = 2 * layer_parameters(cfg)
        if i == 0:
            act += embedding_activation_bytes(cfg)
            params += embedding_parameters(cfg)
        if i == P - 1:
            act += output_activation_bytes(cfg)
            params += output_parameters(cfg, separate_stage=True)
        transient = max(none - kept[a] for a in mine)
        loss = loss_workspace_bytes(cfg) if i == P - 1 else 0
        expect = params * per_param + (P - i) * act + backward_workspace_bytes(cfg) + max(transient, loss)
        assert stage.peak_bytes == pytest.approx(expect, rel=1e-9)
    assert p.peak_bytes == max(s.peak_bytes for s in p.stages)


def test_pipeline_stages_may_differ():
    cfg = TransformerConfig(num_layers=16, hidden_size=2048, num_heads=16, vocab_size=32000, seq_len=4096,
                            micro_batch=1)
    pl = build_planner(cfg, pipeline_parallel=4)
    budget = (pl.min_peak() + pl.policy_of([LayerAction.NONE] * 16, 0).peak_bytes) / 2 / GiB
    p = policy(cfg, budget, pipeline_parallel=4)
    assert p.fits
    first, last = p.stages[0], p.stages[-1]
    recomputed = lambda s: sum(p.actions[i] != LayerAction.NONE for i in s.layers)
    assert recomputed(first) >= recomputed(last)  # stage 0 holds 4 micro-batches, the last only 1
    assert first.in_flight == 4 and last.in_flight == 1


def test_hf_model_and_bad_options():
    transformers = pytest.importorskip("transformers")
    conf = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                    intermediate_size=512, vocab_size=1000)
    assert len(policy(conf, 80, seq_len=256).actions) == 4

    class Wrapped:
        config = conf
    assert policy(Wrapped(), 80, seq_len=256).actions == policy(conf, 80, seq_len=256).actions
    with pytest.raises(SolverError):
        policy(object(), 80)
    with pytest.raises(SolverError):
        policy(CFG, 80, schedule="zero-bubble")
    with pytest.raises(SolverError):
        policy(CFG, 80, optimizer="lion")


def test_70b_shape_plans():
    cfg = TransformerConfig(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_size=28672,
                            vocab_size=128256, seq_len=8192, gated_ffn=True, dropout=False, bias=False,
                            tied_embeddings=False, tensor_parallel=8, sequence_parallel=True)
    p = policy(cfg, 80, pipeline_parallel=4, hardware="h100-pcie5")
    assert p.fits and len(p.actions) == 80


# ------------------------------------------------------------ captured-graph path (nn.Module)

@pytest.fixture(scope="module")
def small_gpt():
    torch = pytest.importorskip("torch")
    from examples import models

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield models.gpt(n_layer=3, d=64, seq=64, batch=2, dropout=0.0)
    torch.set_num_threads(threads)  # the tests after these run as they would alone


def test_graph_policy_fits_and_uses_simulator(small_gpt):
    from solver.policy import build_graph_planner
    from solver.simulate import simulate

    model, inputs = small_gpt
    pl = build_graph_planner(model, example_inputs=inputs, optimizer="none")
    none = pl.evaluate([LayerAction.NONE] * 3)[1].peak_bytes
    full = pl.evaluate([LayerAction.FULL] * 3)[1].peak_bytes
    assert full < none
    budget = (none + full) / 2
    p = policy(model, budget / GiB, example_inputs=inputs, optimizer="none")
    assert p.source == "graph" and p.blocks == ("blocks.0", "blocks.1", "blocks.2")
    assert p.peak_bytes <= p.budget_bytes
    assert p.peak_bytes == simulate(pl.graph, p.graph_schedule).peak_bytes
    assert any(a != LayerAction.NONE for a in p.actions)
    roomy = policy(model, 2 * none / GiB, example_inputs=inputs, optimizer="none")
    assert roomy.counts()[LayerAction.NONE] == 3 and roomy.extra_flops == 0
    assert "captured graph" in str(p) and p.to_dict()["source"] == "graph"
    with pytest.raises(InfeasibleBudget):
        policy(model, 0.5 * full / GiB, example_inputs=inputs, optimizer="none")


@pytest.mark.parametrize("actions", [("selective", "none", "full"), ("selective",) * 3, ("save_matmuls",) * 3])
def test_a_captured_per_layer_plan_is_priced_as_module_mode_runs_it(small_gpt, actions):
    from graphs.capture import default_loss
    from graphs.memory import AllocatorPeak
    from graphs.module_mode import apply_module_plan
    from solver.policy import build_graph_planner

    model, inputs = small_gpt
    pl = build_graph_planner(model, example_inputs=inputs, optimizer="none")
    predicted = pl.evaluate([LayerAction(a) for a in actions])[1].peak_bytes
    fast = apply_module_plan(model, dict(zip(pl.blocks, actions)))
    for p in model.parameters():
        p.grad = None
    with AllocatorPeak(fast, inputs) as judge:
        out = fast(*inputs)  # held during backward, as a training loop does
        default_loss(out).backward()
        del out
    for p in model.parameters():
        p.grad = None
    # by the allocator: within 2 %; op-level SAC measured 2.2 % over its prediction
    # (2,216,264 B for 2,168,324 B: what its recomputation allocates beyond the graph)
    assert judge.peak_bytes == pytest.approx(predicted, rel=0.03 if "save_matmuls" in actions else 0.02)


def test_the_two_selective_policies_are_priced_apart(small_gpt):
    from solver.policy import build_graph_planner

    model, inputs = small_gpt
    pl = build_graph_planner(model, example_inputs=inputs, optimizer="none")
    core = pl.evaluate([LayerAction.SELECTIVE] * 3)
    matmuls = pl.evaluate([LayerAction.SAVE_MATMULS] * 3)
    assert core[1].peak_bytes != matmuls[1].peak_bytes
    assert core[1].cost != matmuls[1].cost


def test_graph_policy_offload_and_bad_options(small_gpt):
    model, inputs = small_gpt
    p = policy(model, 1.0, example_inputs=inputs, hardware="pcie5")
    assert LayerAction.OFFLOAD not in p.actions and any("not CUDA" in n for n in p.notes)
    from solver.policy import build_graph_planner

    pl = build_graph_planner(model, example_inputs=inputs, hardware="pcie5", allow_offload=True, optimizer="none")
    off = pl.evaluate([LayerAction.OFFLOAD] * 3)
    assert off[0].offloads and off[1].peak_bytes < pl.evaluate([LayerAction.NONE] * 3)[1].peak_bytes
    with pytest.raises(SolverError):
        policy(model, 1.0, example_inputs=inputs, pipeline_parallel=2)
    with pytest.raises(SolverError):
        policy(model, 1.0, via="bogus")
    with pytest.raises(SolverError):
        policy(model, 1.0)  # no example inputs and no HF config


# ------------------------------------------------------------ data parallelism: per-rank accounting

def test_per_rank_static_hand_count_fsdp_and_ddp():
    # CFG is bf16 with Adam: 2 (param) + 2 (grad) + 12 (fp32 master + moments) bytes per parameter
    layer, emb, out = layer_parameters(CFG), embedding_parameters(CFG), output_parameters(CFG)
    total = CFG.num_layers * layer + emb + out
    acts = [LayerAction.FULL] * CFG.num_layers
    one = build_planner(CFG).policy_of(acts, 10**12).stages[0]
    assert one.static_bytes == pytest.approx(total * 16, rel=1e-9)
    fsdp = build_planner(CFG, world_size=4, sharding="fsdp").policy_of(acts, 10**12).stages[0]
    # a quarter of everything, plus the gathered root (params + whole grads) and two layers' params and grads
    assert fsdp.static_bytes == pytest.approx(total * 16 / 4 + (emb + out) * 4 + 2 * layer * 4, rel=1e-9)
    ddp = build_planner(CFG, world_size=4, sharding="ddp").policy_of(acts, 10**12).stages[0]
    assert ddp.static_bytes == pytest.approx(total * (16 + 2), rel=1e-9)  # + gradient buckets
    # only the static part changes: activations and workspaces are the rank's own micro-batch
    for s in (fsdp, ddp):
        assert s.activation_bytes == one.activation_bytes and s.workspace_bytes == one.workspace_bytes
    # sharding frees memory for activations: FSDP needs no more remat than one device, DDP no less
    budget = (one.peak_bytes + build_planner(CFG).policy_of([LayerAction.NONE] * 8, 0).peak_bytes) / 2 / GiB
    p1, pf, pd = (policy(CFG, budget, **kw) for kw in ({}, dict(world_size=4, sharding="fsdp"),
                                                        dict(world_size=4, sharding="ddp")))
    assert pf.extra_flops <= p1.extra_flops
    assert pd.extra_flops >= p1.extra_flops
    assert pf.to_dict()["sharding"] == "fsdp" and pf.world_size == 4 and "FSDP x4" in str(pf)


def test_per_rank_with_pipeline_stages():
    P = 2
    pl = build_planner(CFG, pipeline_parallel=P, world_size=2, sharding="fsdp")
    layer, emb = layer_parameters(CFG), embedding_parameters(CFG)
    out = output_parameters(CFG, separate_stage=True)
    n = CFG.num_layers // P
    assert pl.stage_static(0) == pytest.approx((n * layer + emb) * 16 / 2 + emb * 4 + 2 * layer * 4, rel=1e-9)
    assert pl.stage_static(1) == pytest.approx((n * layer + out) * 16 / 2 + out * 4 + 2 * layer * 4, rel=1e-9)


def test_bad_data_parallel_options():
    with pytest.raises(SolverError, match="needs sharding"):
        policy(CFG, 40, world_size=4)
    with pytest.raises(SolverError, match="unknown sharding"):
        policy(CFG, 40, world_size=4, sharding="zero2")
    with pytest.raises(SolverError, match="world_size"):
        policy(CFG, 40, world_size=0, sharding="ddp")
    with pytest.raises(SolverError, match="FSDP2"):
        policy(CFG, 40, world_size=2, sharding="fsdp", hardware="pcie5", allow_offload=True)


def test_graph_policy_per_rank(small_gpt):
    from solver.distributed import rank_peak, shard_bytes
    from solver.policy import build_graph_planner

    model, inputs = small_gpt
    one = build_graph_planner(model, example_inputs=inputs, optimizer="adam")
    ddp = build_graph_planner(model, example_inputs=inputs, optimizer="adam", world_size=2, sharding="ddp")
    fsdp = build_graph_planner(model, example_inputs=inputs, optimizer="adam", world_size=2, sharding="fsdp")
    none = [LayerAction.NONE] * 3
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # DDP: one more copy of the gradients (as many bytes as the parameters here)
    assert ddp.evaluate(none)[1].peak_bytes == one.evaluate(none)[1].peak_bytes + param_bytes
    # FSDP: the rank peak of the same sequence, Adam state sharded (2 x params over 2 ranks)
    sched, res = fsdp.evaluate(none)
    fresh = rank_peak(fsdp.graph, sched.sequence, world_size=2, sharding="fsdp", units=fsdp.blocks,
                      optimizer_bytes=2 * param_bytes)
    assert res.peak_bytes == fresh.peak_bytes < one.evaluate(none)[1].peak_bytes
    assert fresh.fixed.optimizer == shard_bytes(2 * param_bytes, 2)
    full = fsdp.evaluate([LayerAction.FULL] * 3)[1].peak_bytes
    p = policy(model, (res.peak_bytes + full) / 2 / GiB, example_inputs=inputs, optimizer="adam", world_size=2,
               sharding="fsdp")
    assert p.peak_bytes <= p.budget_bytes and any(a != LayerAction.NONE for a in p.actions)
    assert p.sharding == "fsdp" and p.world_size == 2

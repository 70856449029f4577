"""Exporters: option names and ranges of each target, and the HF per-layer apply."""

import json

import pytest

from solver.analytic import TransformerConfig
from solver.exporters import (MEGATRON_RECOMPUTE_MODULES, apply_hf, sac_policy_fn, to_deepspeed, to_hf,
                              to_megatron, to_torch_sac, to_torchtitan)
from solver.policy import LayerAction, build_planner

N, S, F, O = LayerAction.NONE, LayerAction.SELECTIVE, LayerAction.FULL, LayerAction.OFFLOAD
CFG = TransformerConfig(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000, seq_len=2048,
                        micro_batch=2)
PLANS = [[N] * 8, [S] * 8, [F] * 8, [F, F, S, S, S, N, N, N], [O, F, S, N, N, N, N, N], [F, N] * 4]


def plan(actions, pp=1):
    pl = build_planner(CFG, pipeline_parallel=pp, hardware="h100-pcie5")
    return pl.policy_of(actions, pl.policy_of(actions, 0).peak_bytes)  # the plan just fits


@pytest.mark.parametrize("frac", [0.0, 0.2, 0.5, 0.8])
@pytest.mark.parametrize("pp", [1, 2])
def test_every_exporter_fits_or_warns(frac, pp):
    pl = build_planner(CFG, pipeline_parallel=pp, hardware="h100-pcie5")
    top = pl.policy_of([N] * 8, 0).peak_bytes
    p = pl.solve(int(pl.min_peak() + frac * (top - pl.min_peak())))  # an optimal plan
    for exp in (to_hf(p), to_megatron(p), to_deepspeed(p), to_torchtitan(p), to_torch_sac(p)):
        assert exp.expressed.num_layers == 8
        # a setting different from the plan is always explained
        if list(exp.expressed.actions) != list(p.actions):
            assert exp.warnings
        if exp.fits:
            assert exp.expressed.extra_flops >= p.extra_flops - 1e-6
        else:
            assert any("none of its settings fits" in w for w in exp.warnings)


@pytest.mark.parametrize("actions", PLANS)
def test_megatron_options(actions):
    c = to_megatron(plan(actions)).config
    assert set(c) == {"recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"}
    assert c["recompute_granularity"] in (None, "selective", "full")
    if c["recompute_granularity"] == "full":
        assert c["recompute_method"] in ("uniform", "block")
        assert isinstance(c["recompute_num_layers"], int) and 1 <= c["recompute_num_layers"] <= 8
    else:
        assert c["recompute_method"] is None and c["recompute_num_layers"] is None
    if c["recompute_granularity"] == "selective":
        assert set(c["recompute_modules"]) <= set(MEGATRON_RECOMPUTE_MODULES)
    json.dumps(c)


def test_megatron_selective_everywhere_and_block():
    assert to_megatron(plan([S] * 8)).config["recompute_modules"] == ["core_attn"]
    # with fused attention selective saves almost nothing: two full layers per stage are needed
    pl = build_planner(CFG.replace(flash_attention=True), pipeline_parallel=2)
    acts = [F, F, N, N, F, F, N, N]
    c = to_megatron(pl.policy_of(acts, pl.policy_of(acts, 0).peak_bytes)).config
    assert (c["recompute_granularity"], c["recompute_method"], c["recompute_num_layers"]) == ("full", "block", 2)


@pytest.mark.parametrize("actions", PLANS)
def test_deepspeed_block(actions):
    exp = to_deepspeed(plan(actions))
    b = exp.config["activation_checkpointing"]
    assert set(b) == {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                      "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
    for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
              "synchronize_checkpoint_boundary", "profile"):
        assert isinstance(b[k], bool)
    assert b["number_checkpoints"] is None or b["number_checkpoints"] >= 1
    if b["cpu_checkpointing"]:
        assert b["partition_activations"]  # DeepSpeed needs it for CPU checkpointing
    assert b["number_checkpoints"] == (sum(a != N for a in actions) or None)
    json.dumps(exp.config)


@pytest.mark.parametrize("actions", PLANS)
def test_torchtitan_section(actions):
    c = to_torchtitan(plan(actions)).config
    sec = c["activation_checkpoint"]
    assert sec["mode"] in ("none", "selective", "full")
    if sec["mode"] == "selective":
        assert sec["selective_ac_option"] == "op" or int(sec["selective_ac_option"]) >= 1
    assert c["toml"].startswith("[activation_checkpoint]\n") and f'mode = "{sec["mode"]}"' in c["toml"]


@pytest.mark.parametrize("actions", PLANS)
def test_hf_kwargs_match_installed_signature(actions):
    transformers = pytest.importorskip("transformers")
    import inspect

    c = to_hf(plan(actions)).config
    if c["method"] is None:
        return
    sig = inspect.signature(getattr(transformers.PreTrainedModel, c["method"]))
    assert set(c["kwargs"]) <= set(sig.parameters)
    assert 1 <= c["kwargs"]["every_n_layers"] <= 8
    if c["legacy"]:
        legacy = inspect.signature(getattr(transformers.PreTrainedModel, c["legacy"]["method"]))
        assert set(c["legacy"]["kwargs"]) <= set(legacy.parameters)


def test_sac_policy_fn_values():
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import CheckpointPolicy

    fn = sac_policy_fn()
    aten = torch.ops.aten
    assert fn(None, aten.bmm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert fn(None, aten._softmax.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert fn(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert fn(None, aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    exp = to_torch_sac(plan([O, F, S, N, N, N, N, N]))
    assert exp.config["layers"]["offload"] == [0] and exp.config["layers"]["selective"] == [2]
    assert any("save_on_cpu" in w for w in exp.warnings)


def _tiny_llama(attn):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    conf = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                                    max_position_embeddings=64, attn_implementation=attn)
    torch.manual_seed(0)
    return conf, transformers.LlamaForCausalLM(conf)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_apply_hf_same_loss_and_grads(attn):
    import copy

    import torch

    conf, ref = _tiny_llama(attn)
    model = copy.deepcopy(ref)
    pl = build_planner(conf, seq_len=16, micro_batch=2, hardware="cpu")
    apply_hf(model, pl.policy_of([F, S, O, N], 10**12))
    # count MLP forwards: checkpointed layers (full, and selective, whose replay serves the
    # saved matmuls from its cache) run the Python forward again in backward; offloaded and
    # kept layers do not
    calls = [0] * 4
    for i, layer in enumerate(model.model.layers):
        def counted(*a, _f=layer.mlp.forward, _i=i, **k):
            calls[_i] += 1
            return _f(*a, **k)
        layer.mlp.forward = counted
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    ref.train(), model.train()
    l_ref = ref(input_ids=ids, labels=ids).loss
    l_ref.backward()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert calls == [2, 2, 1, 1]
    torch.testing.assert_close(loss, l_ref, rtol=0, atol=0)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_apply_hf_uses_hf_checkpointing_and_the_layer_flags_where_they_express_the_plan():
    conf, model = _tiny_llama("eager")
    layers = list(model.model.layers)
    top = getattr(model.model, "gradient_checkpointing", None)
    apply_hf(model, build_planner(conf, seq_len=16).policy_of([F, N, F, N], 10**12))
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, False]
    assert len({id(layer._gradient_checkpointing_func) for layer in layers}) == 1  # HF's one function
    assert getattr(model.model, "gradient_checkpointing", None) == top  # only the planned layers act
    apply_hf(model, build_planner(conf, seq_len=16).policy_of([F, S, S, N], 10**12))
    funcs = [layer._gradient_checkpointing_func for layer in layers[:3]]
    assert funcs[1] is funcs[2] and funcs[0] is not funcs[1]  # selective is the common one; full gets its own


def test_apply_hf_layer_count_checked():
    conf, model = _tiny_llama("eager")
    from solver.errors import SolverError

    with pytest.raises(SolverError):
        apply_hf(model, build_planner(CFG).policy_of([N] * 8, 10**12))

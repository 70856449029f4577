"""The analytic model against Korthikanti et al. 2022's closed forms (arXiv:2205.05198)."""

import pytest

from solver.analytic import (TransformerConfig, as_config, layer_activation_bytes, layer_forward_flops,
                             parameter_count, recompute_flops, state_bytes_per_parameter)
from solver.errors import SolverError

# (s, b, h, a, t) — including the paper's Table 3 shapes (22B, 175B, 530B, 1T)
SHAPES = [(2048, 4, 6144, 64, 8), (2048, 1, 12288, 96, 8), (2048, 1, 20480, 128, 35),
          (2048, 1, 25600, 160, 32), (512, 2, 1024, 16, 2), (128, 3, 256, 8, 1)]


def gpt(s, b, h, a, t=1, sp=False):
    return TransformerConfig(num_layers=2, hidden_size=h, num_heads=a, vocab_size=51200, seq_len=s,
                             micro_batch=b, tensor_parallel=t, sequence_parallel=sp)


@pytest.mark.parametrize("s,b,h,a,t", SHAPES)
def test_no_recompute_matches_paper(s, b, h, a, t):
    assert layer_activation_bytes(gpt(s, b, h, a)) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


@pytest.mark.parametrize("s,b,h,a,t", SHAPES)
def test_tensor_parallel_matches_paper(s, b, h, a, t):
    expect = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(gpt(s, b, h, a, t)) == pytest.approx(expect)


@pytest.mark.parametrize("s,b,h,a,t", SHAPES)
def test_tensor_and_sequence_parallel_matches_paper(s, b, h, a, t):
    cfg = gpt(s, b, h, a, t, sp=True)
    assert layer_activation_bytes(cfg) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(cfg, recompute="selective") == pytest.approx(34 * s * b * h / t)


@pytest.mark.parametrize("s,b,h,a,t", SHAPES)
def test_selective_and_full(s, b, h, a, t):
    cfg = gpt(s, b, h, a)
    assert layer_activation_bytes(cfg, recompute="selective") == pytest.approx(34 * s * b * h)
    assert layer_activation_bytes(cfg, recompute="full") == pytest.approx(2 * s * b * h)
    assert layer_activation_bytes(gpt(s, b, h, a, t), recompute="selective") == pytest.approx(
        s * b * h * (10 + 24 / t))
    assert layer_activation_bytes(cfg, recompute="offload") == 0


@pytest.mark.parametrize("s,b,h,a,t", SHAPES)
def test_flops_match_paper(s, b, h, a, t):
    cfg = gpt(s, b, h, a)
    assert layer_forward_flops(cfg) == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    assert recompute_flops(cfg, "selective") == pytest.approx(4 * b * s * s * h)
    assert recompute_flops(cfg, "full") == layer_forward_flops(cfg)
    assert recompute_flops(cfg, "none") == 0


def test_gqa_swiglu_fp32_terms():
    s, b, h, a, kv, f = 256, 2, 512, 8, 2, 1376
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_heads=a, num_kv_heads=kv, ffn_size=f,
                            gated_ffn=True, dropout=False, dtype_bytes=4, vocab_size=1000, seq_len=s,
                            micro_batch=b)
    hkv = kv * h // a
    # norms 2 inputs, qkv input, Q, K, V, softmax output, out-proj input, ffn input, 4 ffn tensors
    elems = 2 * s * b * h + s * b * h + s * b * (h + 2 * hkv) + a * s * s * b + s * b * h + s * b * h + 4 * s * b * f
    assert layer_activation_bytes(cfg) == pytest.approx(4 * elems)
    flops = 2 * s * b * h * (h + 2 * hkv) + 2 * s * b * h * h + 6 * s * b * h * f + 4 * b * s * s * h
    assert layer_forward_flops(cfg) == pytest.approx(flops)


def test_state_bytes_conventions():
    assert sum(state_bytes_per_parameter(2, "adam")) == 16
    assert state_bytes_per_parameter(2, "adam", grad_bytes=4) == (2, 4, 12)
    assert state_bytes_per_parameter(2, "sgd") == (2, 2, 4)
    assert state_bytes_per_parameter(4, "none") == (4, 4, 0)
    with pytest.raises(SolverError):
        state_bytes_per_parameter(2, "lion")


def test_hf_configs_are_read():
    transformers = pytest.importorskip("transformers")
    g = as_config(transformers.GPT2Config(), seq_len=1024)
    assert (g.num_layers, g.hidden_size, g.num_heads, g.ffn, g.gated_ffn, g.dropout) == (12, 768, 12, 3072, False, True)
    assert parameter_count(g) == pytest.approx(124_439_808)  # GPT-2 small's published size
    ll = transformers.LlamaConfig(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                                  num_key_value_heads=8, intermediate_size=28672, vocab_size=128256)
    c = as_config(ll, seq_len=4096, dtype="bf16")
    assert (c.num_layers, c.kv_heads, c.ffn, c.gated_ffn, c.dtype_bytes, c.bias) == (80, 8, 28672, True, 2, False)
    # Llama-3-70B has 70.6e9 parameters
    assert parameter_count(c) == pytest.approx(70.55e9, rel=0.01)


def test_bad_config_rejected():
    with pytest.raises(SolverError):
        TransformerConfig(num_layers=2, hidden_size=100, num_heads=3, vocab_size=10, seq_len=4)
    with pytest.raises(SolverError):
        as_config({"n_layer": 2})

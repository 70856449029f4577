"""Will-it-fit estimates."""

import pytest

from solver.analytic import TransformerConfig
from solver.estimate import estimate
from solver.policy import LayerAction, build_planner

CFG = TransformerConfig(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000, seq_len=2048,
                        micro_batch=2)
GiB = 1024**3


def test_three_peaks_ordered_and_consistent():
    pl = build_planner(CFG)
    e = estimate(CFG, 6.0)
    assert e.peak_no_remat == pl.policy_of([LayerAction.NONE] * 8, 0).peak_bytes
    assert e.peak_full_remat == pl.policy_of([LayerAction.FULL] * 8, 0).peak_bytes
    assert e.peak_full_remat < e.peak_no_remat
    assert e.fits == (e.peak_best <= e.budget_bytes)
    assert e.fits_no_remat == (e.peak_no_remat <= 6 * GiB)
    assert "best policy" in str(e) and e.to_dict()["fits"] == e.fits


def test_largest_batch_and_seq_are_tight():
    e = estimate(CFG, 6.0)
    assert e.max_micro_batch >= 1 and e.max_seq_len >= 1
    fits = lambda **kw: build_planner(CFG.replace(**kw)).min_peak() <= 6 * GiB
    assert fits(micro_batch=e.max_micro_batch) and not fits(micro_batch=e.max_micro_batch + 1)
    assert fits(seq_len=e.max_seq_len) and not fits(seq_len=e.max_seq_len + 1)


def test_nothing_fits():
    e = estimate(CFG, 0.1)
    assert not e.fits and e.policy is None and e.max_micro_batch == 0 and e.max_seq_len == 0
    assert e.peak_best == build_planner(CFG).min_peak()


# ------------------------------------------------------------ captured small model vs a real step

def _measured_peak(model, inputs, plan):
    """Peak of one real eager step (grads None; params, buffers and inputs in the baseline)."""
    torch = pytest.importorskip("torch")
    from graphs.capture import default_loss
    from graphs.memory import MemoryTracker
    from graphs.module_mode import apply_module_plan

    run = apply_module_plan(model, plan)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    default_loss(run(*args, **kwargs)).backward()  # warm-up
    for p in model.parameters():
        p.grad = None
    with MemoryTracker(model, inputs) as mt:
        default_loss(run(*args, **kwargs)).backward()
    for p in model.parameters():
        p.grad = None
    return mt.peak_bytes


@pytest.mark.parametrize("zoo", [
    "gpt",
    # Known gap: with every decoder layer checkpointed, the captured-graph estimate of
    # this HF Llama is 6 % below the measured eager peak (12.25 MB vs 13.03 MB); graph
    # mode and the uncheckpointed estimate agree within 1 %.
    pytest.param("hf_llama", marks=pytest.mark.xfail(strict=True, reason="eager checkpoint peak 6 % above the estimate")),
])
def test_captured_estimate_within_5_percent_of_measured(zoo, request):
    torch = pytest.importorskip("torch")
    if zoo == "hf_llama":
        pytest.importorskip("transformers")
    from examples import models
    from solver.policy import layer_blocks

    request.addfinalizer(lambda n=torch.get_num_threads(): torch.set_num_threads(n))  # as found, after
    torch.set_num_threads(1)
    if zoo == "gpt":
        model, inputs = models.gpt(n_layer=3, d=128, seq=128, batch=4, dropout=0.0)
    else:
        model, inputs = models.hf_llama(n_layer=2, d=128, seq=128, batch=4)
    e = estimate(model, 1.0, example_inputs=inputs, optimizer="none")
    assert e.source == "graph" and e.fits and e.max_micro_batch is None
    blocks = layer_blocks(model)
    none = _measured_peak(model, inputs, {})
    full = _measured_peak(model, inputs, {b: "full" for b in blocks})
    assert full < none
    assert abs(e.peak_no_remat - none) <= 0.05 * none, (e.peak_no_remat, none)
    assert abs(e.peak_full_remat - full) <= 0.05 * full, (e.peak_full_remat, full)


def test_captured_estimate_counts_optimizer_state():
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    x = (torch.randn(32, 64),)
    bare = estimate(net, 1.0, example_inputs=x, optimizer="none")
    adam = estimate(net, 1.0, example_inputs=x, optimizer="adam")
    n = sum(p.numel() for p in net.parameters())
    assert adam.peak_no_remat - bare.peak_no_remat == 8 * n  # two fp32 moments per parameter
    assert "not searched" in str(adam)


def test_per_rank_estimate_fsdp_fits_more():
    one = estimate(CFG, 6.0)
    sharded = estimate(CFG, 6.0, world_size=8, sharding="fsdp")
    pl = build_planner(CFG, world_size=8, sharding="fsdp")
    assert sharded.peak_no_remat == pl.policy_of([LayerAction.NONE] * 8, 0).peak_bytes < one.peak_no_remat
    assert sharded.max_micro_batch >= one.max_micro_batch
    fits = lambda **kw: build_planner(CFG.replace(**kw), world_size=8, sharding="fsdp").min_peak() <= 6 * GiB
    assert fits(micro_batch=sharded.max_micro_batch) and not fits(micro_batch=sharded.max_micro_batch + 1)
    assert sharded.to_dict()["sharding"] == "fsdp" and "FSDP x8" in str(sharded)
    ddp = estimate(CFG, 6.0, world_size=8, sharding="ddp")
    assert ddp.peak_no_remat > one.peak_no_remat  # gradient buckets on top

"""The self-check under 16-bit arithmetic: a graph-mode rewrite of a model trained
under bfloat16 autocast is compared with eager at bfloat16's rounding, so that a
correct rewrite is not refused for the last place of a 16-bit result (where it was, the
plan fell back to module mode, or a budget that graph mode meets was refused)."""

from __future__ import annotations

import copy

import pytest
import torch

import solver
from graphs.memory import measure_peak, settle_open_judges
from graphs.units import GiB

transformers = pytest.importorskip("transformers")

AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=300, max_position_embeddings=256,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config).train()


def _batch():
    ids = torch.randint(0, 300, (4, 48), generator=torch.Generator().manual_seed(48))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _norm_close(a, b):
    """Within bfloat16's rounding, in norm (its epsilon is 2**-7)."""
    return bool((a.float() - b.float()).norm() <= 2 ** -7 * b.float().norm())


@pytest.mark.slow
def test_a_rewrite_trained_under_bf16_autocast_is_checked_at_bf16_rounding():
    model = _llama()
    ref = copy.deepcopy(model)
    batch = _batch()
    with torch.autocast(**AUTOCAST):
        peak = measure_peak(lambda: ref(**batch).loss.backward(), roots=[ref]).peak_bytes
    ref.zero_grad(set_to_none=True)
    budget = int(0.6 * peak)
    fast = solver.optimize(model, budget / GiB, mode="graph")  # pinned: a failed check raises
    losses = []
    for m in (ref, fast):
        with torch.autocast(**AUTOCAST):
            loss = m(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    report = fast.report
    assert report.mode == "graph" and report.method != "store_all", (report.mode, report.method)
    assert not any("self-check" in note for note in report.notes), report.notes
    assert torch.equal(losses[0], losses[1])
    for p, q in zip(ref.parameters(), model.parameters()):
        assert _norm_close(q.grad, p.grad)
    # the first real step, planned in it and measured by the allocator, the loss included
    settle_open_judges()
    peaks = [p for step in fast.remat_steps.values() for p in step.step_peaks]
    assert peaks and max(peaks) <= budget, (peaks, budget)

"""Steps whose captured graph reads constants the trace lifted (a ``torch.tensor(...)``
built in the forward, as in Hugging Face T5): measured, planned and run in both modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import solver
from graphs.capture import capture
from graphs.measured import measure_in_schedule
from graphs.units import GiB
from solver.join.checks import measured_peak


class ScaledBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * torch.tensor([2.0])  # a constant built in the forward


class Scaled(nn.Module):
    def __init__(self, depth: int = 8, width: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(ScaledBlock(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _grads(model: nn.Module, call) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = call()
    (out.loss if hasattr(out, "loss") else out).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_a_schedule_of_a_graph_with_lifted_constants_is_measured():
    torch.manual_seed(0)
    model, x = Scaled(depth=2), torch.randn(16, 64)
    cg = capture(model, (x,), backward="outputs", inplace="functional", measure_time=False,
                 measure_workspace=False)
    run = measure_in_schedule(cg, cg.order, times=False)
    assert run.peak_bytes is not None and run.peak_bytes > 0
    assert cg.meta["workspace_source"] == "measured"


@pytest.mark.parametrize("mode", ["graph", "module"])
def test_a_model_with_a_constant_in_its_forward_plans_with_the_plain_gradients(mode):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(512, 64)
    expected = _grads(model, lambda: model(x))
    peak = measured_peak(model, lambda: model(x), (x,), {})
    fast = solver.optimize(model, 0.8 * peak / GiB, (x,), mode=mode, measure_time=False)
    assert fast.report.mode == mode
    assert mode == "module" or fast.report.recomputed > 0, str(fast.report)
    fast(x).backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode, share", [("graph", 0.7), ("module", 0.95)])  # two blocks: module mode's least
def test_hf_t5_with_labels_plans_below_the_plain_step(mode, share):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    inputs = {"input_ids": torch.randint(1, 64, (16, 64)), "labels": torch.randint(1, 64, (16, 48))}
    expected = _grads(model, lambda: model(**inputs))
    peak = measured_peak(model, lambda: model(**inputs), (), inputs)
    fast = solver.optimize(model, share * peak / GiB, inputs, mode=mode, measure_time=False)
    assert fast.report.mode == mode
    fast(**inputs).loss.backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)

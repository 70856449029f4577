"""Training loops as people write them: keywords that change nothing share a plan (one
plan for a whole HF Trainer run), keywords that change the computation get their own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import solver
from graphs.memory import settle_open_judges


class _Scaled(nn.Module):
    """A forward with keywords: ``scale`` changes what it computes, ``verbose`` and an
    unused ``count`` do not."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x, *, scale=1.0, verbose=False, count=None):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * scale


def _loss(out):
    return out.float().square().mean()


def _grads(model, x, **kw):
    for p in model.parameters():
        p.grad = None
    _loss(model(x, **kw)).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_keywords_that_change_nothing_share_the_plan():
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(128, 64)
    fast = solver.optimize(model, 2.0, example_inputs=(x,), mode="graph", measure_time=False)
    assert len(fast.remat_steps) == 1
    for kw in ({"verbose": True}, {"count": torch.tensor(3.0)}, {"verbose": False, "scale": 1.0}):
        got, want = _grads(fast, x, **kw), _grads(model, x, **kw)
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    assert len(fast.remat_steps) == 1
    # a keyword that changes the computation gets its own plan, and its own gradients
    got, want = _grads(fast, x, scale=3.0), _grads(model, x, scale=3.0)
    assert len(fast.remat_steps) == 2
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))


def _qwen2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64, vocab_size=128, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).train()


@pytest.mark.slow
def test_hf_trainer_makes_one_plan(tmp_path):
    """HF Trainer passes ``num_items_in_batch`` to a model whose forward takes ``**kwargs``;
    with the loss computed by the Trainer (``compute_loss_func``) the model ignores it,
    and the plan made from the example batch runs the whole run."""
    transformers = pytest.importorskip("transformers")
    model = _qwen2()
    seq, batch = 16, 4
    data = [{"input_ids": torch.randint(0, 128, (seq,)), "labels": torch.randint(0, 128, (seq,))} for _ in range(12)]
    example = {"input_ids": torch.stack([d["input_ids"] for d in data[:batch]])}
    fast = solver.optimize(model, 1.0, example_inputs=example)
    assert len(fast.remat_steps) == 1
    planned = list(fast.remat_steps.values())

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3,
                                          per_device_train_batch_size=batch, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=fast, args=args, train_dataset=data, compute_loss_func=loss_func)
    trainer.train()
    assert trainer.state.global_step == 3
    assert list(fast.remat_steps.values()) == planned
    assert not [n for n in fast.report.notes if n.startswith(("planned again", "this plan was made again"))]
    assert planned[0].step_peaks  # the Trainer's steps ran the plan (it measured the first)


@pytest.mark.slow
def test_hf_return_dict_and_use_cache_share_the_plan():
    model = _qwen2()
    ids = torch.randint(0, 128, (4, 16))
    fast = solver.optimize(model, 10.0, example_inputs={"input_ids": ids, "labels": ids})
    for kw in ({}, {"return_dict": True}, {"use_cache": False}):
        fast(input_ids=ids, labels=ids, **kw).loss.backward()
    assert len(fast.remat_steps) == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_of_the_returned_module_runs_the_plan(backend):
    """``torch.compile(fast)`` runs the planned step (Dynamo does not trace planning
    nor the step): one plan; each of four real steps within the budget by the allocator,
    measured from outside the compiled call; losses and gradients as the plain model's.
    The watch does not start its CPU profiler inside the compiled calls, and says so."""
    import copy

    from examples import models
    from graphs.memory import AllocatorPeak
    from solver.join.fixed import untracked_bytes
    from solver.join.watch import COMPILED_NOTE

    torch.manual_seed(0)
    model, inputs = models.gpt(n_layer=2, d=32, seq=32, batch=8)
    plain = copy.deepcopy(model)
    loss_fn = _loss
    roomy = solver.optimize(model, 1.0, example_inputs=inputs, loss_fn=loss_fn)
    budget = 0.7 * roomy.report.predicted_peak_bytes / 2**30
    fast = solver.optimize(model, budget, example_inputs=inputs, loss_fn=loss_fn, watch="every")
    step = next(iter(fast.remat_steps.values()))
    compiled = torch.compile(fast, backend=backend)
    peaks = []
    for i in range(4):
        for m in (model, plain):
            for p in m.parameters():
                p.grad = None
        torch.manual_seed(i)
        with AllocatorPeak(model, inputs) as judge:
            loss = loss_fn(compiled(*inputs))
            loss.backward()
        peaks.append(judge.peak_bytes + untracked_bytes(fast.report.graph))  # as the watch counts a step
        torch.manual_seed(i)
        want = loss_fn(plain(*inputs))
        want.backward()
        torch.testing.assert_close(loss, want)
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(fast.remat_steps) == 1 and next(iter(fast.remat_steps.values())) is step
    assert max(peaks) <= fast.report.budget_bytes, (peaks, fast.report.budget_bytes)
    assert not step.step_peaks and COMPILED_NOTE in fast.report.notes
    # called eagerly, the same module's step is measured by the watch again
    for p in model.parameters():
        p.grad = None
    loss_fn(fast(*inputs)).backward()
    settle_open_judges()
    assert len(step.step_peaks) == 1 and step.step_peaks[0] <= fast.report.budget_bytes


def test_keywords_that_change_nothing_and_smaller_sizes_share_the_plan(monkeypatch):
    """A loop whose batches vary in size and carry a keyword the forward ignores (HF
    Trainer's ``num_items_in_batch``) runs the one plan."""
    import solver.join.planning

    # a measurement an earlier test left open (its CPU profiler still running) is closed
    # now, not by this test's first watched step; this test closes its own last one
    settle_open_judges()
    made = []
    plan = solver.join.planning._plan_step
    monkeypatch.setattr(solver.join.planning, "_plan_step", lambda *a, **k: made.append(a[0]) or plan(*a, **k))
    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(128, 64)
    fast = solver.optimize(model, 2.0, example_inputs=(x,), mode="module", measure_time=False)
    for n, kw in ((64, {"count": torch.tensor(3.0)}), (96, {"verbose": True}), (32, {})):
        got, want = _grads(fast, x[:n], **kw), _grads(model, x[:n], **kw)
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    settle_open_judges()
    # the plans made for this model, not whatever else the process plans meanwhile; where
    # it fails, the watch's measured peaks and the notes say whether a step planned again
    peaks = [p for step in fast.remat_steps.values() for p in step.step_peaks]
    assert sum(m is model for m in made) == 1, (len(made), peaks, fast.report.notes)

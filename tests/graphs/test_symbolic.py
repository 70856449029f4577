"""A step captured with symbolic sizes (``capture(..., symbolic_sizes=...)``): one joint
graph and one rewrite of it run at every size of the dimensions named, with the loss and
gradients of eager; the DAG at a size (``graphs.symbolic.at_sizes``) is the one a capture
at that size gives, and the allocator's peak of a recomputing schedule there is its
prediction; calls the capture does not run as traced are told apart."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import solver
from graphs.capture import capture
from graphs.errors import CaptureError
from graphs.graph_mode import ScheduledStep
from graphs.measured import carry_costs, measure_in_schedule
from graphs.memory import measure_peak
from graphs.symbolic import at_sizes, call_sizes, is_symbolic

transformers = pytest.importorskip("transformers")

OPTIONS = dict(backward="outputs", measure_time=False, measure_workspace=False, inplace="functional")


def _qwen2():
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=64, vocab_size=128, max_position_embeddings=128,
                                      use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def _batch(length, batch=4):
    ids = torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def captured():
    model = _qwen2()
    cg = capture(model, (), example_kwargs=_batch(24), symbolic_sizes={0: (1,), 1: (1,)}, **OPTIONS)
    return model, cg


def test_the_dag_at_a_size_is_a_capture_at_that_size(captured):
    model, cg = captured
    assert is_symbolic(cg) and cg.meta["symbolic_sizes"]
    for length in (16, 40):
        sized = at_sizes(cg, call_sizes(cg, (), _batch(length)))
        static = capture(model, (), example_kwargs=_batch(length), **OPTIONS)
        assert solver.simulate(sized, sized.order).peak_bytes == solver.simulate(static, static.order).peak_bytes
        assert sized.total("flops") == static.total("flops")
    # sizes are read off the step's inputs, never off an activation (which they would pin)
    graph = cg.fx.graph
    sizes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int]
    assert sizes and all(n.args[0].op == "placeholder" for n in sizes)


def test_one_rewrite_runs_every_size_as_eager_and_as_predicted(captured):
    model, cg = captured
    plain = copy.deepcopy(model)
    sequence = list(solver.solve(cg, int(0.6 * solver.simulate(cg, cg.order).peak_bytes)).sequence)
    assert len(sequence) > len(set(sequence))  # it recomputes
    measure_in_schedule(cg, sequence, times=False)  # the workspaces, measured at the traced sizes
    step = ScheduledStep(cg, sequence)
    for length in (24, 12, 40):
        batch = _batch(length)

        def run():
            step(model, (), dict(batch)).loss.backward()

        run()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        peak = measure_peak(run, roots=[model]).peak_bytes
        model.zero_grad(set_to_none=True)
        want = plain(**batch).loss
        want.backward()
        loss = step(model, (), dict(batch)).loss
        model.zero_grad(set_to_none=True)
        assert torch.equal(loss, want)
        for g, p in zip(got, plain.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
        plain.zero_grad(set_to_none=True)
        sized = at_sizes(cg, call_sizes(cg, (), batch))
        assert carry_costs(cg, sized, any_source=True)  # the workspaces scaled to the sizes, as planning does
        predicted = solver.simulate(sized, sequence).peak_bytes
        # the DAG holds a gradient of the logits too, which a step that backpropagates
        # from the loss never makes: no more than that above the allocator, never below
        logits_grad = 4 * length * 128 * 4
        assert peak <= 1.01 * predicted and predicted - peak <= logits_grad + 0.01 * predicted, (
            length, peak, predicted)


def test_calls_the_capture_does_not_run_as_traced_are_told_apart(captured):
    _, cg = captured
    ids = _batch(32)["input_ids"]
    assert call_sizes(cg, (), {"input_ids": ids, "labels": ids}) == {next(iter(cg.sizes.values()))[0]: 32}
    assert call_sizes(cg, (), {"input_ids": ids, "labels": ids[:, :16]}) is None  # one size, two values
    wide = _batch(32, batch=8)["input_ids"]
    assert call_sizes(cg, (), {"input_ids": wide, "labels": wide}) is None  # a size captured as it was


class _Branching(nn.Module):
    """A forward whose computation depends on a size."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.shape[0] > 16 else self.b(x)


def test_a_size_the_forward_branches_on_bounds_the_capture():
    cg = capture(_Branching(), (torch.randn(32, 8),), symbolic_sizes={0: (0,)}, **OPTIONS)
    assert call_sizes(cg, (torch.randn(64, 8),), {}) is not None
    assert call_sizes(cg, (torch.randn(8, 8),), {}) is None  # the other branch: not this graph


def test_a_size_the_forward_ties_to_a_width_stays_static_and_the_others_symbolic():
    """Every size asked symbolic, as ``optimize(dynamic=True)`` asks: the feature size,
    which ``nn.Linear`` ties to its width, stays static; the batch goes symbolic. Asked
    alone, the feature size is refused with the size named."""
    cg = capture(_Branching(), (torch.randn(32, 8),), symbolic_sizes={0: (0, 1)}, **OPTIONS)
    assert list(cg.meta["symbolic_sizes"]) == ["0:0"], cg.meta["symbolic_sizes"]
    assert call_sizes(cg, (torch.randn(64, 8),), {}) is not None
    with pytest.raises(CaptureError, match="size 1 of input 0"):
        capture(_Branching(), (torch.randn(32, 8),), symbolic_sizes={0: (1,)}, **OPTIONS)


def test_every_size_symbolic_views_that_read_sizes_are_derived_again_in_the_backward():
    # T5 with batch and both lengths symbolic: attention views read sizes (batch x
    # heads) that the backward computes again; such a size's new copy must not drop
    # the views that read it (they share their base's storage, not the size's)
    from solver.join.planning import lowest_peak_sequence, replayed_view

    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4, d_kv=8,
                                   vocab_size=64, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    plain = copy.deepcopy(model)

    def batch(n, source, target):
        g = torch.Generator().manual_seed(source + target)
        return {"input_ids": torch.randint(0, 64, (n, source), generator=g),
                "labels": torch.randint(0, 64, (n, target), generator=g)}

    cg = capture(model, (), example_kwargs=batch(4, 24, 8), symbolic_sizes={0: (0, 1), 1: (0, 1)}, **OPTIONS)
    assert len({e for e, _ in cg.sizes.values()}) == 3  # batch and both lengths
    sequence = lowest_peak_sequence(replayed_view(cg), target=int(0.9 * solver.simulate(cg, cg.order).peak_bytes))
    assert len(sequence) > len(set(sequence))
    step = ScheduledStep(cg, sequence)
    for sizes in ((4, 24, 8), (3, 16, 12)):
        torch.manual_seed(1)  # (the dropout masks drawn alike)
        loss = step(model, (), batch(*sizes)).loss
        torch.manual_seed(1)
        want = plain(**batch(*sizes)).loss
        loss.backward()
        want.backward()
        assert torch.equal(loss, want)
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)

"""Dropout in a captured step draws eager's numbers, whatever the layout of its input."""

from __future__ import annotations

import pytest
import torch

import solver
from examples import models
from graphs.capture import _eager_noise, capture, default_loss
from graphs.graph_mode import ScheduledStep
from solver.simulate import simulate


@pytest.mark.parametrize("shape,dims", [((16, 4, 32), (0, 1)), ((4, 8, 16, 16), (1, 2)), ((8, 6), (0, 1)),
                                        ((5, 7), None)])
def test_noise_is_eager_noise_for_any_layout(shape, dims):
    x = torch.randn(*shape)
    if dims is not None:
        x = x.transpose(*dims)
    torch.manual_seed(0)
    eager = torch.empty_like(x).bernoulli_(0.9)
    torch.manual_seed(0)
    ours = _eager_noise(x, 0.9)
    assert torch.equal(ours, eager)


def _loss_and_grads(model, run):
    torch.manual_seed(7)
    for p in model.parameters():
        p.grad = None
    loss = default_loss(run())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("method", ["store_all", "checkpoint_all"])
def test_transformer_encoder_layers_with_dropout_match_eager_bitwise(method):
    model, (x,) = models.encoder_stack(layers=2, seq=16, batch=4)
    cg = capture(model, (x,), backward="outputs", inplace="functional", measure_time=False)
    random_ops = [v for v in cg.ops if "bernoulli" in str(cg[v]["op"])]
    assert len(random_ops) == 8  # attention, two residual and one feed-forward dropout per layer
    for v in random_ops:  # recomputed draws replay the generator state
        cg[v]["recomputable"] = True
    sched = solver.solve(cg, simulate(cg, cg.order).peak_bytes, method=method)
    if method == "checkpoint_all":
        assert any(sched.counts()[v] > 1 for v in random_ops)
    step = ScheduledStep(cg, sched.sequence)
    want_loss, want = _loss_and_grads(model, lambda: model(x))
    got_loss, got = _loss_and_grads(model, lambda: step(model, (x,), {}))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_first_draw_that_no_op_reads_still_draws():
    # the schedule draws each mask, then draws it again right away: the consumers read
    # the second copy, so nothing reads the first; it must still advance the generator,
    # or every later mask of the step comes from another state
    model, (x,) = models.encoder_stack(layers=2, seq=16, batch=4)
    cg = capture(model, (x,), backward="outputs", inplace="functional", measure_time=False)
    random_ops = [v for v in cg.ops if "bernoulli" in str(cg[v]["op"])]
    for v in random_ops:
        cg[v]["recomputable"] = True
    seq = []
    for v in cg.order:
        seq.append(v)
        if v in random_ops:
            seq.append(v)
    assert simulate(cg, seq).valid
    step = ScheduledStep(cg, seq)
    want_loss, want = _loss_and_grads(model, lambda: model(x))
    got_loss, got = _loss_and_grads(model, lambda: step(model, (x,), {}))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

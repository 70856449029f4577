"""The rewrite of a schedule into forward and backward graphs, on schedules that the
solvers may return."""

from __future__ import annotations

import torch

from examples import models
from graphs.capture import capture, default_loss
from graphs.compute_graph import BACKWARD_START
from graphs.graph_mode import ScheduledStep
from solver.simulate import simulate


def _loss_and_grads(model, run):
    for p in model.parameters():
        p.grad = None
    loss = default_loss(run())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_view_whose_base_runs_again_in_the_forward_is_derived_again_for_the_backward():
    # the forward takes ``detach(relu)`` and then recomputes ``relu`` (a lowest-peak
    # schedule does this): the view of the first copy is dropped with it, and the
    # backward, which reads the view, derives it from the copy that is left
    model, inputs = models.mlp(batch=4, d_in=8, hidden=16, depth=2)
    cg = capture(model, inputs, backward="outputs", inplace="functional", measure_time=False)
    view = next(v for v in cg.ops if str(cg[v]["op"]) == "aten.detach.default" and cg[v]["phase"] == "forward")
    (base,) = [u for u in cg.nx.predecessors(view) if cg.is_op(u)]
    (reader,) = [w for w in cg.nx.successors(view) if cg.is_op(w) and str(cg[w]["op"]) == "aten.detach.default"]
    seq = []
    for v in cg.order:
        if v == reader:
            continue
        seq.append(v)
        if v == view:
            seq.append(base)
        if v == BACKWARD_START:  # the backward reads the view first
            seq.append(reader)
    assert simulate(cg, seq).valid
    step = ScheduledStep(cg, seq)
    want_loss, want = _loss_and_grads(model, lambda: model(*inputs))
    got_loss, got = _loss_and_grads(model, lambda: step(model, inputs, {}))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

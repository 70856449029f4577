"""The rewrite of a schedule into forward and backward graphs, on schedules that the
solvers may return."""

from __future__ import annotations

import torch

from examples import models
from graphs.capture import capture, default_loss
from graphs.compute_graph import BACKWARD_START
from graphs.graph_mode import ScheduledStep
from graphs.rewrite import is_tangent, schedule_graphs
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


class _Attention(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_an_attention_run_for_each_of_its_outputs_leaves_no_unread_copy():
    # CPU's fused attention (tagged random, drawing nothing without dropout) has two
    # outputs; a schedule that lists them out of their order runs it once for each, and
    # where the backward computes them again, the forward's first run is read by nothing:
    # left in a graph, fx would keep it (a random-tagged op) and hold its outputs to the
    # end of the graph
    model, x = _Attention(), torch.randn(2, 8, 16)
    cg = capture(model, (x,), backward="outputs", inplace="functional", measure_time=False)
    group = sorted((v for v in cg.ops if cg[v].get("group") is not None and cg[v]["phase"] == "forward"
                    and "attention" in str(cg[v]["op"])), key=lambda v: cg[v]["group_index"])
    assert len(group) >= 2, [cg[v]["op"] for v in cg.ops]
    first = [v for v in cg.order if v in group]
    at = cg.order.index(first[0])
    seq = [v for v in cg.order if v not in group]
    seq[at:at] = list(reversed(first))  # the outputs out of their order: a run of the op for each
    back = seq.index(BACKWARD_START) + 1
    seq[back:back] = first  # and once more for the backward
    assert simulate(cg, seq).valid
    joint = cg.fx
    n_in = sum(1 for n in joint.graph.nodes if n.op == "placeholder" and not is_tangent(n))
    n_out = len(next(n for n in reversed(joint.graph.nodes) if n.op == "output").args[0])
    fw, bw, _ = schedule_graphs(joint, [str(v) for v in seq if v != BACKWARD_START], num_fwd_outputs=n_out - n_in)
    for g in (fw, bw):
        unread = [n for n in g.nodes if n.op == "call_function" and not n.users and "attention" in str(n.target)]
        assert not unread, unread
    step = ScheduledStep(cg, seq)
    want_loss, want = _loss_and_grads(model, lambda: model(x))
    got_loss, got = _loss_and_grads(model, lambda: step(model, (x,), {}))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

"""Planning's own costs: the rewrite generates the code of each of its graphs once."""

import torch

from examples import models
from graphs.capture import capture, default_loss
from graphs.graph_mode import ScheduledStep


def _gpt():
    return models.gpt(n_layer=2, d=16, n_head=2, seq=8, batch=2, dropout=0.0)


def test_a_scheduled_step_generates_the_code_of_each_graph_once(monkeypatch):
    model, inputs = _gpt()
    cg = capture(model, inputs, backward="outputs", inplace="functional", measure_time=False,
                 measure_workspace=False)
    seq = list(cg.order)
    seq.insert(seq.index(next(v for v in seq if cg[v]["phase"] == "backward")), seq[3])  # a recomputation
    generated = []
    real = torch.fx.Graph.python_code

    def counting(self, *args, **kwargs):
        generated.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Graph, "python_code", counting)
    step = ScheduledStep(cg, seq)
    for _ in range(2):
        default_loss(step(model, inputs, {})).backward()
    # the forward graph and the backward graph, each once: not when AOTAutograd copies
    # the backward, nor when the compilers switch both to the boxed calling convention
    assert len(generated) == 2 and len(set(map(id, generated))) == 2
    model.zero_grad()
    monkeypatch.undo()
    ref = default_loss(model(*inputs))
    ref.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    default_loss(step(model, inputs, {})).backward()
    assert all(torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6) for p, g in zip(model.parameters(), expected))


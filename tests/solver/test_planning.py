"""Planning's own costs: the rewrite generates the code of each of its graphs once, and
the step the gradient check compares with is chosen by the checkpointed model's
predicted peak, as computed block by block."""

import time
from dataclasses import replace

import torch

import solver
from examples import models
from graphs.capture import capture, default_loss
from graphs.graph_mode import ScheduledStep
from graphs.module_mode import layer_blocks
from graphs.units import GiB
from solver.module_plan import checkpoint_view, plan_schedule
from solver.join.planning import Request, capture_step, gradient_reference


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


def test_the_gradient_check_uses_the_checkpointed_model_exactly_where_it_is_predicted_to_fit():
    model, inputs = _gpt()
    cap = capture_step(model, inputs, {}, request=Request(mode="graph", budget=2**40, measure_time=False))
    blocks = layer_blocks(model)
    # the checkpointed model's peak as the plan of every block checkpointed, priced without an index
    need = plan_schedule(checkpoint_view(cap.graph, blocks), {b: "full" for b in blocks})[0].peak_bytes
    assert need < cap.store_all
    measured = replace(cap, measured_with=tuple(cap.graph.order))  # as measure_within leaves it
    assert gradient_reference(model, replace(measured, budget=need)) == (None, None)
    step, note = gradient_reference(model, replace(measured, budget=need - 1))
    assert callable(step) and "kept on disk" in note and "over the budget" in note  # the model's own step
    # without a measured schedule (the reference order measured the step) there is none to check against
    assert cap.measured_with is None and gradient_reference(model, replace(cap, budget=need - 1)) == (None, None)


def test_the_planning_line_says_where_the_time_went():
    model, inputs = models.gpt(n_layer=2, d=16, n_head=2, seq=32, batch=8, dropout=0.0)  # activations dominate
    cg = capture(model, inputs, backward="outputs", inplace="functional", measure_time=False,
                 measure_workspace=False)
    budget = 0.7 * solver.simulate(cg, cg.order).peak_bytes  # a rewrite, checked against eager's gradients
    t0 = time.perf_counter()
    report = solver.optimize(model, budget / GiB, inputs, mode="graph", method="chain_dp", measure_time=False).report
    wall = time.perf_counter() - t0
    parts = [report.capture_seconds, report.measure_seconds, report.solve_seconds, report.check_seconds]
    assert report.predicted_overhead > 0 and report.checked_peak_bytes is not None
    assert all(p > 0 for p in parts) and sum(parts) <= wall
    assert f"solve {report.solve_seconds:.2f} s, check {report.check_seconds:.2f} s" in str(report)

"""Random ops as CUDA dispatches them (``native_dropout``'s output and mask, fused
attention) are recomputed with the forward's draws; fused attention without dropout is
not random at all."""

from __future__ import annotations

import torch

import solver
from examples import models
from graphs.capture import capture, default_loss, is_random_op
from graphs.graph_mode import ScheduledStep
from graphs.rewrite import random_replay, replay_random_ops, rng_state_bytes
from solver.simulate import simulate
from tests.emulation import cuda_dispatch
from tests.graphs.test_dropout_draws import _loss_and_grads


def test_native_dropout_output_and_mask_are_recomputed_with_the_forwards_draws():
    with cuda_dispatch():
        model, (idx, _) = models.gpt(n_layer=2, d=32, seq=16, batch=2)
        cg = capture(model, (idx,), backward="outputs", inplace="functional", measure_time=False)
        drops = [v for v in cg.ops if "native_dropout.default" in str(cg[v]["op"])]
        assert drops and all(cg[v].get("group") is not None for v in drops)  # output and mask of one op
        assert set(drops) <= set(cg.meta["ordered"])
        replay_random_ops(cg)
        assert all(cg[v]["recomputable"] for v in drops)
        sched = solver.solve(cg, simulate(cg, cg.order).peak_bytes, method="checkpoint_all")
        assert simulate(cg, sched).valid
        assert any(sched.counts()[v] > 1 for v in drops)
        step = ScheduledStep(cg, sched.sequence)
        want_loss, want = _loss_and_grads(model, lambda: model(idx))
        got_loss, got = _loss_and_grads(model, lambda: step(model, (idx,), {}))
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_one_generator_state_per_multi_output_random_op():
    with cuda_dispatch():
        model, (idx, _) = models.gpt(n_layer=2, d=32, seq=16, batch=2)
        cg = capture(model, (idx,), backward="outputs", inplace="functional", measure_time=False)
    replay_random_ops(cg)
    groups = {cg[v]["group"] for v in random_replay(cg).ops}
    assert None not in groups and len(random_replay(cg).ops) == 2 * len(groups)
    # one state per op, and one that a replay swaps out while its op runs
    assert random_replay(cg).state_bytes == (len(groups) + 1) * rng_state_bytes("cpu")
    assert random_replay(cg).per_state == rng_state_bytes("cpu")


def test_fused_attention_without_dropout_is_recomputable():
    model, (idx, _) = models.gpt(n_layer=2, d=32, seq=16, batch=2, dropout=0.0)
    cg = capture(model, (idx,), backward="outputs", inplace="functional", measure_time=False)
    fused = [v for v in cg.ops if "scaled_dot_product" in str(cg[v]["op"]) and cg[v]["phase"] == "forward"]
    assert fused
    assert all(cg[v]["recomputable"] for v in fused)
    assert not cg.meta["ordered"]


def test_the_gradient_of_dropout_is_not_random():
    g = torch.fx.Graph()
    x, mask = g.placeholder("x"), g.placeholder("mask")
    assert not is_random_op(g.call_function(torch.ops.aten.native_dropout_backward.default, (x, mask, 2.0)))
    assert is_random_op(g.call_function(torch.ops.aten.native_dropout.default, (x, 0.5, True)))


def test_the_emulation_routes_dropout_to_native_dropout():
    model, (idx, _) = models.gpt(n_layer=1, d=32, seq=16, batch=2)
    ops = {}
    for on in (False, True):
        with cuda_dispatch(on):
            cg = capture(model, (idx,), backward="outputs", inplace="functional", measure_time=False)
        ops[on] = {str(cg[v]["op"]) for v in cg.ops}
    assert "aten.native_dropout.default" in ops[True] and "aten.native_dropout.default" not in ops[False]
    assert "aten.bernoulli.p" in ops[False] and "aten.bernoulli.p" not in ops[True]

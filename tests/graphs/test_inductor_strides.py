"""Inductor segments of a scheduled step run whatever strides their inputs arrive with:
a segment compiled for a strided view and fed a contiguous tensor (or the reverse) gives
eager's values instead of failing inductor's size and stride assertion."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphs.graph_mode import _fuse_segments


def _pointwise(a):
    return ((a * 2 + 1).sin() * a).cos() + a


def _one_segment(example):
    gm = make_fx(_pointwise)(example)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    compiled: dict = {}
    fused = _fuse_segments(gm, {n: 0 for n in ops}, {0}, [example], False, compiled, "forward")
    assert compiled["forward"] == 1
    return fused


@pytest.mark.parametrize("compiled_for", ["view", "contiguous"])
def test_a_segment_runs_inputs_of_other_strides_than_it_was_compiled_for(compiled_for):
    torch.manual_seed(0)
    base = torch.randn(4, 16)
    view = base[:, :8]  # strides (16, 1): the halves of a rotary embedding
    dense = view.contiguous()
    assert view.stride() != dense.stride()
    fused = _one_segment(view if compiled_for == "view" else dense)
    for x in (dense, view, dense.t().contiguous().t()):
        torch.testing.assert_close(fused(x), _pointwise(x))


def test_a_rewrite_that_raises_in_the_self_check_falls_back_with_a_note(monkeypatch):
    """An exception while the self-check runs the rewrite (a compiled segment rejecting
    its inputs) fails the check: the plan falls back to module mode."""
    import solver
    from examples import models
    from graphs.capture import capture
    from graphs.graph_mode import ScheduledStep
    from graphs.units import GiB
    from solver import simulate

    def raises(self, model, args, kwargs):
        raise AssertionError("expected size 4==4, stride 6144==12288 at dim=0")

    model, inputs = models.gpt(n_layer=2, d=32, seq=32, batch=8)
    cg = capture(model, inputs, backward="outputs", measure_time=False, inplace="functional")
    budget = 0.6 * simulate(cg, cg.order).peak_bytes / GiB
    monkeypatch.setattr(ScheduledStep, "__call__", raises)
    fast = solver.optimize(model, budget, inputs, measure_time=False)
    assert fast.report.mode == "module"
    assert any("planned in module mode" in n for n in fast.report.notes)

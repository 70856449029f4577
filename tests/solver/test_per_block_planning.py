"""optimize()'s planning knows the model's layer blocks: the captured step carries them
(checkpointing each is ``auto``'s start and the floor of the smallest-feasible figure,
also in the graph-mode report), and module mode prices its plans from one block's
measured run."""

from __future__ import annotations

import pytest
import torch

import solver
from examples import models
from graphs.module_mode import ModulePlanError, layer_blocks
from graphs.units import GiB
from solver import simulate
from solver.join.checks import Session
from solver.methods import minpeak
from solver.methods.blocks import per_block_schedule
from solver.join.planning import Request, capture_step, plan_graph
from solver.solving import reached_floor
from tests.graphs import torchvision_like
from tests.solver.test_per_block_floor import slow_search  # noqa: F401 - a fixture


def _hf(make):
    return lambda: make(n_layer=3, d=32, n_head=4, seq=16, batch=2, vocab=128)


def _vision(make, size):
    def build():
        torch.manual_seed(0)
        return make().train(), (torch.randn(2, 3, size, size),)
    return build


MODELS = {
    "hf_gpt2": _hf(models.hf_gpt2),
    "hf_llama": _hf(models.hf_llama),
    "resnet18": _vision(lambda: torchvision_like.resnet18(width=4), 32),
    "vit": _vision(lambda: torchvision_like.vit(image_size=16, patch_size=4, num_layers=3, hidden_dim=32,
                                                mlp_dim=64), 16),
}


def _inputs(example):
    return ((), example) if isinstance(example, dict) else (example, {})


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [("hf_gpt2", "graph"), ("hf_llama", "module"), ("resnet18", "graph"),
                                       ("vit", "module")])
def test_the_captured_step_carries_the_models_layer_blocks(name, mode):
    model, example = MODELS[name]()
    args, kwargs = _inputs(example)
    cap = capture_step(model, args, kwargs, request=Request(mode=mode, budget=2**40, measure_time=False))
    cg = cap.graph
    assert cg.meta["layer_blocks"] == layer_blocks(model)
    floor = per_block_schedule(cg)
    assert floor.info["blocks"] == layer_blocks(model)
    assert floor.peak_bytes < simulate(cg, cg.order).peak_bytes
    assert reached_floor(cg) == floor.peak_bytes


def test_blocks_given_are_the_ones_the_step_carries_and_unknown_ones_are_refused():
    model, inputs = models.gpt(n_layer=4, d=16, n_head=2, seq=8, batch=2, dropout=0.0)
    chosen = ["blocks.1", "blocks.3"]
    cap = capture_step(model, inputs, {}, request=Request(mode="graph", budget=2**40, measure_time=False,
                                                          blocks=chosen))
    assert cap.graph.meta["layer_blocks"] == chosen
    assert per_block_schedule(cap.graph).info["blocks"] == chosen
    with pytest.raises(ModulePlanError, match="no submodule 'blocks.9'"):
        capture_step(model, inputs, {}, request=Request(mode="graph", budget=2**40, measure_time=False,
                                                        blocks=["blocks.9"]))


def test_the_graph_reports_smallest_feasible_figure_is_at_most_per_block(slow_search):  # noqa: F811
    torch.manual_seed(0)
    model, inputs = models.gpt(n_layer=4, d=32, n_head=2, seq=16, batch=2)
    request = Request(mode="graph", budget=2**40, measure_time=False)
    cap = capture_step(model, inputs, {}, request=request)
    session = Session()
    plan_graph(cap=cap, request=request, session=session, method="auto")  # the store-all schedule fits
    cg = cap.graph
    floor = per_block_schedule(cg).peak_bytes
    assert minpeak.smallest_feasible_peak(cg)[0] > floor  # the slowed search alone names more
    assert session.report.smallest_feasible_bytes <= floor


@pytest.fixture
def block_runs(monkeypatch):
    """The blocks :func:`measure_block_actions` measured, as planning calls it."""
    import graphs.module_mode as module_mode

    calls = []
    real = module_mode.measure_block_actions

    def counted(*a, **k):
        calls.append(k["block"])
        return real(*a, **k)

    monkeypatch.setattr(module_mode, "measure_block_actions", counted)
    return calls


def _plain_peak(model, inputs):
    from graphs.memory import measure_peak

    peak = measure_peak(lambda: model(**inputs).loss.backward(), roots=[model, inputs]).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


@pytest.mark.slow
def test_module_mode_is_priced_from_a_measured_run_of_one_block(block_runs):
    model, inputs = models.hf_llama(n_layer=4, d=32, n_head=4, seq=32, batch=2, vocab=128)
    budget = 0.7 * _plain_peak(model, inputs)
    fast = solver.optimize(model, budget / GiB, inputs, mode="module")
    fast(**inputs).loss.backward()
    sched = fast.report.schedule
    assert block_runs == [layer_blocks(model)[2]]  # the middle block, once
    assert set(sched.info["measured"]) == {"none", "full", "save_matmuls"}
    assert all(t > 0 for t in sched.info["measured"].values())
    assert "priced_cost" in sched.info


def test_module_mode_measures_no_block_where_no_time_is_measured(block_runs):
    model, inputs = models.hf_llama(n_layer=2, d=16, n_head=2, seq=64, batch=4, vocab=64)
    budget = 0.7 * _plain_peak(model, inputs)
    fast = solver.optimize(model, budget / GiB, inputs, mode="module", measure_time=False)
    fast(**inputs).loss.backward()
    assert block_runs == [] and "measured" not in fast.report.schedule.info

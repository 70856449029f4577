"""Measuring a captured step by running one of its schedules (graphs.measured)."""

import pytest
import torch

from examples import models
from graphs import CaptureError
from graphs.capture import capture
from graphs.measured import measure_in_schedule, probe_workspaces
from solver import simulate, solve

CASES = {
    "unet_bn": lambda: models.unet_bn(batch=4, width=8, size=32),
    "encoder": lambda: models.encoder_stack(layers=2, d=32, seq=32, batch=8),
    "gpt": lambda: models.gpt(n_layer=2, d=32, n_head=4, seq=64, batch=4, vocab=256),
}


def _captured(name, **kw):
    model, inputs = CASES[name]()
    return model, inputs, capture(model, inputs[:1], backward="outputs", inplace="functional",
                                  measure_time=False, **kw)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_schedule_run_measures_the_workspaces_of_the_store_all_run(name):
    _, _, reference = _captured(name)  # measured by capture, in its own order
    _, _, cg = _captured(name, measure_workspace=False)
    assert cg.meta["workspace_source"] == "estimated"
    measure_in_schedule(cg, cg.order, times=False)
    assert cg.meta["workspace_source"] == "measured"
    assert {v: cg[v]["workspace"] for v in cg.ops} == {v: reference[v]["workspace"] for v in reference.ops}


@pytest.mark.parametrize("name,frac", [("unet_bn", 0.85), ("encoder", 0.6), ("gpt", 0.6)])
def test_a_run_of_a_schedule_peaks_where_the_simulator_says(name, frac):
    _, _, cg = _captured(name, measure_workspace=False)
    schedule = solve(cg, int(frac * simulate(cg, cg.order).peak_bytes), method="eviction")
    run = measure_in_schedule(cg, schedule.sequence, times=False)
    predicted = simulate(cg, schedule).peak_bytes  # with the workspaces just measured
    assert run.peak_bytes < 0.95 * simulate(cg, cg.order).peak_bytes  # the plan's memory, not the plain step's
    assert abs(run.peak_bytes - predicted) <= 0.01 * predicted


def test_times_are_measured_for_every_op_and_recomputations_are_timed_too():
    _, _, cg = _captured("encoder", measure_workspace=False)
    assert cg.meta["time_source"].startswith("roofline")
    schedule = solve(cg, int(0.5 * simulate(cg, cg.order).peak_bytes), method="eviction")
    measure_in_schedule(cg, schedule.sequence, times=True, repeats=1)
    assert cg.meta["time_source"] == "measured"
    heavy = [v for v in cg.ops if cg[v]["op"] in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")]
    assert heavy and all(cg[v]["time"] > 0 for v in heavy)
    recomputed = [v for v, c in schedule.counts().items() if c > 1 and v in heavy]
    assert all(cg[v]["time"] > 0 for v in recomputed)


def test_the_run_leaves_the_generators_and_buffers_as_they_were():
    model, _, cg = _captured("unet_bn", measure_workspace=False)
    buffers = [b.clone() for b in model.buffers()]
    state = torch.get_rng_state()
    measure_in_schedule(cg, cg.order, times=False)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))


def test_fake_inputs_cannot_be_measured():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    cg = capture(model, (torch.empty(2, 4, device="meta"),), backward="outputs", measure_time=False)
    with pytest.raises(CaptureError, match="real tensors"):
        measure_in_schedule(cg, cg.order)


def test_costs_measured_at_one_size_are_carried_to_another_scaled():
    from graphs.measured import carry_costs

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    small, large = (capture(net, (torch.randn(n, 16),), backward="outputs", inplace="functional",
                            measure_time=False, measure_workspace=False) for n in (8, 32))
    assert not carry_costs(small, large)  # nothing measured to carry
    measure_in_schedule(small, small.order, repeats=1)
    roofline = {v: large[v]["time"] for v in large.ops}
    assert carry_costs(small, large)
    assert large.meta["time_source"] == large.meta["workspace_source"] == "measured"
    for v in large.ops:
        if large[v]["op"] == "tangent":
            continue
        ratio = large[v]["bytes"] / small[v]["bytes"] if small[v]["bytes"] else 1.0
        if small[v]["flops"] and large[v]["flops"]:
            ratio = large[v]["flops"] / small[v]["flops"]
        assert large[v]["time"] == pytest.approx(small[v]["time"] * ratio)
    assert any(large[v]["time"] != roofline[v] for v in large.ops)


def test_costs_are_not_carried_to_a_step_with_other_ops():
    from graphs.measured import carry_costs

    a = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    b = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ga, gb = (capture(m, (torch.randn(8, 16),), backward="outputs", inplace="functional", measure_time=False,
                      measure_workspace=False) for m in (a, b))
    measure_in_schedule(ga, ga.order, repeats=1)
    before = {v: (gb[v]["time"], gb[v]["workspace"]) for v in gb.ops}
    assert not carry_costs(ga, gb)
    assert {v: (gb[v]["time"], gb[v]["workspace"]) for v in gb.ops} == before
    assert gb.meta["time_source"] != "measured"
def test_convolutions_measured_alone_take_the_workspaces_of_a_whole_run(monkeypatch):
    import graphs.costs

    # a rule that estimates nothing for the convolution backward; the block permutes, so
    # the depthwise convolution runs on channels-last activations
    monkeypatch.setitem(graphs.costs.WORKSPACE_ESTIMATES, torch.ops.aten.convolution_backward.default,
                        lambda node: 0)
    graphs.costs.forget_measured_workspaces()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 2, 2), torch.nn.Conv2d(32, 32, 7, padding=3, groups=32))
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    options = dict(backward="outputs", inplace="functional", measure_time=False, measure_workspace=False)
    probed = capture(net, (x,), **options)
    alone = probe_workspaces(probed).workspace
    graphs.costs.forget_measured_workspaces()
    whole = capture(net, (x,), **options)
    measure_in_schedule(whole, whole.order, times=False)
    graphs.costs.forget_measured_workspaces()
    convs = [v for v in probed.ops if str(probed[v].get("group") or v).startswith("convolution")]
    backs = [v for v in convs if probed[v].get("group") == "convolution_backward"]
    assert "convolution_backward" in alone and backs
    assert max(probed[v]["workspace"] for v in backs) > 1024 * 32 * 49 // 2  # the padded weight gradient
    for v in convs:
        # alone, an op allocates what it does inside the step, to the allocator's rounding
        assert probed[v]["workspace"] == pytest.approx(whole[v]["workspace"], rel=0.05, abs=4096), v

"""A model of alike layers captured from four of them is the model captured whole."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from graphs.capture import capture
from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.module_mode import layer_blocks
from graphs.repeated import capture_repeated, repeated_layers
from solver.simulate import simulate

LAYERS = 6


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig

    from solver.join.models import hf_example_inputs, meta_model

    cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                      vocab_size=64, use_cache=False)
    model = meta_model(cfg, dtype="bf16")
    return model, hf_example_inputs(model, seq_len=8, micro_batch=2)


@pytest.fixture(scope="module")
def both(llama):
    model, batch = llama
    blocks = layer_blocks(model)
    whole = capture(model, batch, backward="loss", measure_time=False)
    fast = capture_repeated(model, batch, blocks=blocks, capture=capture, backward="loss", measure_time=False)
    return whole, fast


def _per_layer(graph):
    out = {}
    for v, d in graph.nx.nodes(data=True):
        key = (d.get("module") if d["kind"] == "op" else "source " + ".".join(str(d.get("name")).split(".")[:3]),
               d["phase"], d["kind"])
        row = out.setdefault(key, [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += d["bytes"]
        row[2] += d["flops"]
        row[3] += d["time"]
    return out


def test_repeated_graph_has_the_whole_capture_figures(both):
    whole, fast = both
    assert fast is not None and fast.meta["repeated"]["layers"] == LAYERS
    assert (len(fast), len(fast.ops), fast.nx.number_of_edges()) == (len(whole), len(whole.ops),
                                                                    whole.nx.number_of_edges())
    assert simulate(fast, fast.order).peak_bytes == simulate(whole, whole.order).peak_bytes
    assert (fast.fixed_bytes, fast.grad_bytes, fast.saved_bytes()) == (whole.fixed_bytes, whole.grad_bytes,
                                                                      whole.saved_bytes())
    a, b = _per_layer(whole), _per_layer(fast)
    assert set(a) == set(b)
    assert any(k[0] == f"model.layers.{LAYERS - 2}.mlp.down_proj" for k in b)
    for key in a:
        assert a[key][:3] == b[key][:3], key
        assert math.isclose(a[key][3], b[key][3], rel_tol=1e-9, abs_tol=1e-18), key


def test_repeated_graph_prices_every_plan_as_the_whole(llama, both):
    from solver.join.models import capture_module
    from solver.policy import GraphPlanner

    model, batch = llama
    planners = [GraphPlanner(capture_module(model, batch, repeat=r), optimizer="adamw") for r in (False, True)]
    assert [p.notes for p in planners][1] != [p.notes for p in planners][0]  # the note says so
    plans = [["none"] * LAYERS, ["full"] * LAYERS, ["selective"] * LAYERS,
             ["full", "none", "selective", "full", "none", "full"]]
    for plan in plans:
        (s0, r0), (s1, r1) = (p.evaluate(plan) for p in planners)
        assert (r0.peak_bytes, len(s0.sequence)) == (r1.peak_bytes, len(s1.sequence)), plan
        assert math.isclose(r0.cost, r1.cost, rel_tol=1e-9)
    budget = (planners[0].evaluate(plans[0])[1].peak_bytes + planners[0].evaluate(plans[1])[1].peak_bytes) // 2
    p0, p1 = (p.solve(budget) for p in planners)
    assert (p0.actions, p0.peak_bytes, p0.extra_flops) == (p1.actions, p1.peak_bytes, p1.extra_flops)


class _Scaled(nn.Module):
    """Alike modules that compute differently: layer ``k`` applies tanh ``k`` times."""

    def __init__(self, k: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.k = k

    def forward(self, x):
        x = self.fc(x)
        for _ in range(self.k):
            x = torch.tanh(x)
        return x


def test_layers_that_compute_differently_are_captured_whole():
    net = nn.Sequential(*[_Scaled(k) for k in range(6)])
    blocks = [str(i) for i in range(6)]
    assert repeated_layers(net, blocks) is not None  # alike by their modules
    assert capture_repeated(net, (torch.randn(2, 8),), blocks=blocks, capture=capture, measure_time=False) is None


def test_layers_of_other_shapes_are_not_repeated():
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)], nn.Linear(8, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert repeated_layers(net, [str(i) for i in range(6)]) is None
    assert repeated_layers(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]), [str(i) for i in range(5)]) is None


class _CountsLayers(nn.Module):
    """Runs only with all of its layers (the cut model fails)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))

    def forward(self, x):
        if len(self.layers) != 6:
            raise RuntimeError("needs its six layers")
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_model_that_cannot_be_cut_is_captured_whole():
    net = _CountsLayers()
    blocks = layer_blocks(net)
    assert repeated_layers(net, blocks) is not None
    assert capture_repeated(net, (torch.randn(2, 4),), blocks=blocks, capture=capture, measure_time=False) is None


def test_figures_measured_on_the_cut_capture_reach_every_copy():
    """Module mode measures a model of alike layers on four of them (real tensors) and
    copies each figure onto the whole DAG: a copy of the template takes its template's."""
    from examples.models import hf_llama
    from graphs.measured import measure_in_schedule
    from graphs.repeated import capture_cut

    model, batch = hf_llama(n_layer=LAYERS, d=32, n_head=2, seq=16, batch=2, vocab=64)
    blocks = layer_blocks(model)
    cc = capture_cut(model, (), blocks=blocks, capture=capture, example_kwargs=batch, backward="outputs",
                     measure_time=False, measure_workspace=False)
    assert cc is not None and cc.cut.fx is not None and cc.whole.fx is None
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[3].parameters())
    assert cc.resident_gap == (LAYERS - 4) * per_layer  # layers 3 .. L-2 are not in the cut model
    before = {v: cc.whole[v]["time"] for v in cc.whole.ops}
    measure_in_schedule(cc.cut, list(cc.cut.order), times=True, repeats=1)
    cc.whole[BACKWARD_START]["workspace"] = loss = 12345  # the step's loss, charged on the whole DAG
    assert cc.copy_costs() == len(cc.whole.ops) - 1  # every op but the node the backward starts at
    assert cc.whole[BACKWARD_START]["workspace"] == loss
    assert cc.whole.meta["time_source"] == cc.whole.meta["workspace_source"] == "measured"
    copies = [v for v in cc.whole.ops if v not in cc.cut.nx]
    named = [cc.whole[v]["module"] for v in copies if cc.whole[v].get("module")]
    assert named and all(m.startswith(("model.layers.3", "model.layers.4")) for m in named)
    for v in cc.whole.ops:
        if v == BACKWARD_START:
            continue
        template = cc.cut[v if v in cc.cut.nx else v.rpartition("@")[0]]
        assert cc.whole[v]["time"] == template["time"] and cc.whole[v]["workspace"] == template["workspace"]
    assert sum(before[v] != cc.whole[v]["time"] for v in cc.whole.ops) > len(cc.whole.ops) // 2  # they changed


# ---- graph mode: the whole step's joint graph written from the cut capture's

_RUN = dict(backward="outputs", inplace="functional", measure_time=False, measure_workspace=False)


@pytest.fixture(scope="module", params=["hf_llama", "gpt"])
def written(request):
    """A real model of six alike layers (a Llama; a GPT with dropout in every layer): its
    joint graph written from four layers, and captured whole."""
    from examples.models import gpt, hf_llama
    from graphs.repeated import capture_cut

    if request.param == "gpt":
        model, (idx, targets) = gpt(n_layer=LAYERS, d=32, n_head=4, seq=16, batch=2, vocab=64)
        args, kwargs = (idx, targets), {}
    else:
        model, kwargs = hf_llama(n_layer=LAYERS, d=32, n_head=2, seq=16, batch=2, vocab=64)
        args = ()
    cc = capture_cut(model, args, blocks=layer_blocks(model), capture=capture, example_kwargs=kwargs, runnable=True,
                     **_RUN)
    return model, args, kwargs, cc, capture(model, args, example_kwargs=kwargs, **_RUN)


def test_the_written_joint_graph_computes_what_the_whole_capture_does(written):
    from graphs.capture import real_placeholder_values
    from graphs.rewrite import is_tangent
    from graphs.torch_internals import tree_leaves

    model, args, kwargs, cc, whole = written
    assert cc is not None and cc.whole.capture_info.stitched is not None
    ops = [[n.target for n in g.graph.nodes if n.op == "call_function"] for g in (cc.whole.fx, whole.fx)]
    assert ops[0] == ops[1]
    g = cc.whole
    assert (len(g), len(g.ops), g.nx.number_of_edges()) == (len(whole), len(whole.ops), whole.nx.number_of_edges())
    assert simulate(g, g.order).peak_bytes == simulate(whole, whole.order).peak_bytes
    assert (g.fixed_bytes, g.grad_bytes, g.saved_bytes()) == (whole.fixed_bytes, whole.grad_bytes, whole.saved_bytes())
    # the random ops that must keep their order: every layer's, not the four captured ones'
    assert [g[v]["op"] for v in g.meta["ordered"]] == [whole[v]["op"] for v in whole.meta["ordered"]]
    assert {g[v]["module"] for v in g.ops if g[v].get("module")} == {whole[v]["module"] for v in whole.ops
                                                                        if whole[v].get("module")}
    # the same values and gradients, run on the same inputs
    placeholders = [n for n in whole.fx.graph.nodes if n.op == "placeholder"]
    values = real_placeholder_values(placeholders, whole.capture_info.step, whole.capture_info.flat_inputs)
    def run(m):
        torch.manual_seed(0)
        return tree_leaves(torch.fx.Interpreter(m).run(*values))

    got, want = run(g.fx), run(whole.fx)
    primals = [n for n in placeholders if not is_tangent(n)]  # parameters, buffers, inputs: a gradient each
    assert len(got) == len(want) == g.capture_info.stitched.num_fwd_outputs + len(primals)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_written_step_that_recomputes_gives_the_models_gradients_bitwise(written):
    from graphs.capture import default_loss
    from graphs.graph_mode import ScheduledStep
    from graphs.rewrite import replay_random_ops
    from solver import solve
    from solver.methods.minpeak import smallest_feasible_peak

    model, args, kwargs, cc, _ = written
    g = cc.whole
    replay_random_ops(g)
    low = smallest_feasible_peak(g, time_limit=10)[0]
    schedule = solve(g, (low + simulate(g, g.order).peak_bytes) // 2, method="auto", time_limit=10)
    assert len(schedule.sequence) > len(g.order)  # it recomputes

    def step(fn):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # dropout draws alike
        loss = default_loss(fn())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    scheduled = ScheduledStep(g, schedule.sequence)
    (l0, g0), (l1, g1) = step(lambda: model(*args, **kwargs)), step(lambda: scheduled(model, args, kwargs))
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_a_joint_graph_run_without_aotautograds_runtime_peaks_as_it_does():
    """The written graph's forward and backward run in an autograd function of their
    own; on a whole capture it peaks, by the allocator, as AOTAutograd's runtime does
    (an output the loss does not read gets zeros only the backward graph holds)."""
    import dataclasses

    from examples.models import hf_llama
    from graphs.graph_mode import ScheduledStep
    from graphs.repeated import Stitched
    from graphs.rewrite import is_tangent, replay_random_ops
    from solver import solve
    from solver.join.checks import measured_peak

    model, batch = hf_llama(n_layer=2, d=64, n_head=4, seq=128, batch=4, vocab=256)
    cg = capture(model, (), example_kwargs=batch, **_RUN)
    replay_random_ops(cg)
    jd = cg.capture_info.joint
    primals = [n for n in cg.fx.graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    n_fwd = len(next(n for n in cg.fx.graph.nodes if n.op == "output").args[0]) - len(primals)
    plain = ComputeGraph(cg.nx, name=cg.name, meta=dict(cg.meta))
    plain.order, plain.fx = cg.order, cg.fx
    plain.capture_info = dataclasses.replace(cg.capture_info, stitched=Stitched(
        params_spec=list(jd.params_spec), buffers_spec=list(jd.buffers_spec), num_fwd_outputs=n_fwd, template={}))
    half = solve(cg, simulate(cg, cg.order).peak_bytes // 2, method="auto", time_limit=10).sequence
    for sequence in (cg.order, half):
        peaks = [measured_peak(model, lambda s=ScheduledStep(g, sequence): s(model, (), batch), (), batch)
                 for g in (cg, plain)]
        assert peaks[0] is not None and peaks[0] == peaks[1]


def test_a_joint_graph_that_mutates_buffers_is_not_written():
    from graphs.repeated import stitch_joint
    from graphs.torch_internals import joint_is_plain

    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8))
    cg = capture(net, (torch.randn(4, 8),), **_RUN)
    assert not joint_is_plain(cg.capture_info.joint)  # BatchNorm writes its running statistics
    assert stitch_joint(cg, net, parent="", count=6) is None


class _ReturnsAView(nn.Module):
    """Alike layers whose forward returns its result and a no-op view of it: torch 2.15
    classifies the view as an alias of an intermediate base that is a user output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x, x.view(x.shape)


def test_a_joint_graph_with_an_output_aliasing_another_is_not_plain():
    from graphs.graph_mode import ScheduledStep
    from graphs.repeated import stitch_joint
    from graphs.torch_internals import joint_is_plain
    from solver import solve

    torch.manual_seed(0)
    net, x = _ReturnsAView(), torch.randn(512, 8)
    cg = capture(net, (x,), backward="outputs", inplace="functional", measure_time=False, measure_workspace=False)
    kinds = [o.output_type.name for o in cg.capture_info.joint._aot_state.fw_metadata.output_info]
    assert kinds[0] == "non_alias" and kinds[1] != "non_alias"  # the view is some alias class
    assert not joint_is_plain(cg.capture_info.joint)  # so AOTAutograd's runtime runs it
    assert stitch_joint(cg, net, parent="layers", count=LAYERS) is None

    expected = net(x)
    (expected[0].sum() + 2 * expected[1].square().sum()).backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    half = solve(cg, simulate(cg, cg.order).peak_bytes * 4 // 5, method="auto", time_limit=5).sequence
    assert len(half) > len(set(half))  # something is computed again
    out = ScheduledStep(cg, half)(net, (x,), {})
    assert out[1].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()  # still a view
    (out[0].sum() + 2 * out[1].square().sum()).backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(net.parameters(), want))

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphs import CaptureError
from graphs.costs import (annotate_estimated_workspace, annotate_flops, annotate_measured_workspace,
                          annotate_roofline_time, annotate_storage, forget_measured_workspaces)
from graphs.hardware import Hardware


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_views_and_inplace_alias_their_base():
    gm = _trace(lambda a: a.view(-1).t() if False else (a * 2).view(-1), torch.ones(4, 4))
    rec = {n.name: r for n, r in annotate_storage(gm).items()}
    mul = next(n for n in rec if n.startswith("mul"))
    view = next(n for n in rec if n.startswith("view"))
    assert rec[mul].bytes == 64 and not rec[mul].alias
    assert rec[view].bytes == 0 and rec[view].base == mul


def test_multi_output_op_getitems_own_storage():
    gm = _trace(lambda a: torch.ops.aten.native_dropout(a, 0.5, True), torch.ones(8, 8))
    records = annotate_storage(gm)
    tup = next(n for n in records if n.op == "call_function" and n.target is not operator.getitem)
    items = [n for n in records if n.target is operator.getitem]
    assert records[tup].bytes == 0
    assert sorted(records[n].bytes for n in items) == [64, 256]  # bool mask, float output


def test_split_getitems_are_views():
    gm = _trace(lambda a: [x * 1 for x in (a * 1).split(2)], torch.ones(4, 4))
    records = annotate_storage(gm)
    items = [n for n in records if n.target is operator.getitem]
    assert items and all(records[n].alias and records[n].bytes == 0 for n in items)


def test_flops_follow_flop_counter():
    a, b = torch.ones(3, 5), torch.ones(5, 7)
    gm = _trace(torch.mm, a, b)
    flops = annotate_flops(gm)
    assert flops[next(n for n in flops if n.startswith("mm"))] == 2 * 3 * 5 * 7


def test_roofline_time_is_max_of_compute_and_memory():
    gm = _trace(lambda a, b: (a @ b).relu(), torch.ones(64, 64), torch.ones(64, 64))
    annotate_storage(gm)
    annotate_flops(gm)
    hw = Hardware("toy", peak_flops=1e9, mem_bandwidth=1e9, host_bandwidth=1e9, memory_bytes=1 << 30)
    times = annotate_roofline_time(gm, hw)
    mm = next(n for n in times if n.startswith("mm"))
    relu = next(n for n in times if n.startswith("relu"))
    assert times[mm] == pytest.approx(2 * 64**3 / 1e9)
    assert times[relu] == pytest.approx(2 * 64 * 64 * 4 / 1e9)


def test_errors_name_the_node():
    gm = _trace(torch.mm, torch.ones(2, 2), torch.ones(2, 2))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["val"] = object()  # corrupt the fake value
    node.args = (node.args[0], node.args[1])
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = None
    with pytest.raises(CaptureError, match="mm"):
        annotate_flops(gm)


def test_measured_workspace_of_a_convolution_and_none_for_a_matmul():
    x, w = torch.randn(4, 8, 32, 32), torch.randn(16, 8, 3, 3)
    conv = lambda a, b: torch.ops.aten.convolution(a, b, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    gm = make_fx(lambda a, b, m: (conv(a, b), m @ m))(x, w, torch.ones(64, 64))
    ws = annotate_measured_workspace(gm, [x, w, torch.ones(64, 64)])
    assert ws["convolution"] > 0 and ws["mm"] == 0
    assert gm.meta["remat_workspace_source"] == "measured"
    assert all("remat_workspace" in n.meta for n in gm.graph.nodes)


def test_estimated_workspace_follows_the_convolution_rules():
    x, w = torch.ones(2, 3, 16, 16), torch.ones(8, 3, 3, 3)

    def step(a, b):
        out = torch.ops.aten.convolution(a, b, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
        return torch.ops.aten.convolution_backward(out, a, b, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1,
                                                    [False, True, False])

    gm = _trace(step, x, w)
    forget_measured_workspaces()  # the rules alone, not what earlier tests measured
    ws = annotate_estimated_workspace(gm)
    out_bytes, in_bytes, w_bytes = 2 * 8 * 8 * 8 * 4, 2 * 3 * 16 * 16 * 4, 8 * 3 * 9 * 4
    assert ws["convolution"] == max(in_bytes, out_bytes) + w_bytes
    assert ws["convolution_backward"] == out_bytes  # no input gradient asked for: only the output's
    assert gm.meta["remat_workspace_source"] == "estimated"


def test_inside_another_profiler_the_workspace_is_estimated(caplog):
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    conv = lambda a, b: torch.ops.aten.convolution(a, b, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    gm = make_fx(conv)(x, w)
    forget_measured_workspaces()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        ws = annotate_measured_workspace(gm, [x, w])
    assert gm.meta["remat_workspace_source"] == "estimated"
    assert ws["convolution"] == (2 * 4 * 64 + 4 * 3 * 9) * 4
    assert "estimated" in caplog.text


def test_a_workspace_measured_once_is_what_later_estimates_take():
    x, w = torch.randn(2, 3, 12, 12), torch.randn(4, 3, 3, 3)
    conv = lambda a, b: torch.ops.aten.convolution(a, b, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    forget_measured_workspaces()
    rule = annotate_estimated_workspace(make_fx(conv)(x, w))["convolution"]
    measured = annotate_measured_workspace(make_fx(conv)(x, w), [x, w])["convolution"]
    assert measured != rule  # else the test shows nothing
    assert annotate_estimated_workspace(make_fx(conv)(x, w))["convolution"] == measured
    other = make_fx(conv)(torch.randn(2, 3, 20, 20), w)  # another shape: the rule again
    assert annotate_estimated_workspace(other)["convolution"] != measured
    forget_measured_workspaces()
    assert annotate_estimated_workspace(make_fx(conv)(x, w))["convolution"] == rule


def test_alike_calls_are_timed_once_and_share_the_figure():
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphs.costs import time_ops, whole_graph

    def layers(x, w, v):
        for _ in range(4):  # four alike layers, then one of another shape
            x = torch.tanh(x @ w)
        return torch.tanh(x @ v)

    args = [torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 16)]
    gm = make_fx(layers)(*args)
    mms = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]

    class Count(TorchDispatchMode):
        runs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.runs += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    with Count():
        times = time_ops(whole_graph(gm, args), devices={"cpu"}, repeats=3, warm=False)
    # the first 64x32 @ 32x32 call: a warm-up and 3 timed runs; the three alike ones run
    # once and take its figure; the 64x32 @ 32x16 call is timed on its own
    assert Count.runs == (1 + 3) + 3 + (1 + 3)
    assert len(mms) == 5 and all(times[m] > 0 for m in mms)
    assert times[mms[0]] == times[mms[1]] == times[mms[2]] == times[mms[3]]


def test_cpu_flash_attention_is_counted_as_flash_attention_on_every_torch():
    # torch 2.15's flop counter counts the CPU kernel; older releases count it as zero
    q, k, v = (torch.ones(2, 3, 16, 8) for _ in range(3))
    gm = make_fx(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, tracing_mode="fake")(q, k, v)
    flops = annotate_flops(gm)
    forward = next(n for n in flops if n.startswith("_scaled_dot_product_flash_attention_for_cpu"))
    assert flops[forward] == 2 * (2 * 2 * 3 * 16 * 16 * 8)  # q @ k^T and p @ v


@pytest.mark.parametrize("channels,groups,size", [(192, 192, 2), (64, 64, 8), (64, 32, 2), (32, 1, 4)])
def test_the_channels_last_convolution_backward_estimate_covers_what_the_allocator_sees(channels, groups, size):
    # channels-last activations (ConvNeXt's blocks permute): oneDNN computes the weight's
    # gradient in a layout padded per group, far more than the activations for a
    # depthwise convolution
    x = torch.randn(4, channels, size, size).contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, channels, size, size).contiguous(memory_format=torch.channels_last)
    w = torch.randn(channels, channels // groups, 7, 7)

    def back(g, x, w):
        return torch.ops.aten.convolution_backward(g, x, w, None, [1, 1], [3, 3], [1, 1], False, [0, 0], groups,
                                                    [True, True, False])

    gm = make_fx(back, tracing_mode="fake")(g, x, w)
    forget_measured_workspaces()
    estimated = annotate_estimated_workspace(gm)["convolution_backward"]
    measured = annotate_measured_workspace(gm, [g, x, w])["convolution_backward"]
    forget_measured_workspaces()
    assert measured > 0
    assert measured <= estimated <= 2 * measured, (estimated, measured)

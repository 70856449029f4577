"""Graph mode runs a schedule's offloads: the same loss and gradients as eager, bit for
bit; the allocator's peak (host copies in the emulated host pool) within the budget and
the simulator's prediction; every offload window honoured by the rewritten graphs."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from examples import models
from graphs import host_pool
from graphs.capture import capture
from graphs.compute_graph import BACKWARD_START
from graphs.graph_mode import ScheduledStep
from graphs.loss import charge_loss
from graphs.memory import AllocatorPeak
from graphs.rewrite import RewriteError, is_view, replay_random_ops, transfers
from solver import simulate, solve
from solver.methods.offload import offload_windows
from solver.schedule import Offload, Schedule
from solver.synthetic import random_training_graph, training_chain


def _gpt():
    model, (idx, targets) = models.gpt(n_layer=4, d=64, n_head=4, seq=64, batch=8, vocab=128)
    return model, (idx,), lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())


def _cnn():
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()]
    for _ in range(14):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Conv2d(16, 1, 1))
    return model, (torch.randn(8, 3, 32, 32),), lambda out: out.square().mean()


MODELS = {"gpt": _gpt, "cnn": _cnn}


@functools.lru_cache(maxsize=None)
def _captured(name):
    model, args, loss_fn = MODELS[name]()
    cg = capture(model, args, backward="outputs", measure_time=False)
    charge_loss(cg, loss_fn)
    replay_random_ops(cg)
    return model, args, loss_fn, cg


def _step(model, args, loss_fn, run, *, judged=True):
    """Loss, gradients and the allocator's peak of one training step (the same draws)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    judge = AllocatorPeak(model, args) if judged else None
    with judge or contextlib.nullcontext():
        out = run()
        loss = loss_fn(out)
        loss.backward()
        del out
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads, judge.peak_bytes if judged else None


def _runs_as_planned(name, schedule, budget):
    model, args, loss_fn, cg = _captured(name)
    want_loss, want, _ = _step(model, args, loss_fn, lambda: model(*args))
    predicted = simulate(cg, schedule)
    assert predicted.valid, predicted.error
    step = ScheduledStep(cg, schedule.sequence, offloads=schedule.offloads)
    host_pool.reset_host_stats()
    loss, grads, peak = _step(model, args, loss_fn, lambda: step(model, args, {}))
    host = host_pool.host_stats()
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))
    assert peak <= budget, (peak, budget)
    assert abs(peak - predicted.peak_bytes) <= 0.02 * predicted.peak_bytes, (peak, predicted.peak_bytes)
    # every planned offload went to the host and came back, and the host let go of it
    planned = sum(cg[o.node]["bytes"] for o in schedule.offloads)
    assert host.sends == host.fetches == len(schedule.offloads)
    assert host.sent_bytes == host.fetched_bytes == planned
    assert host.held_bytes == 0 and host.peak_bytes > 0
    return step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "cnn"])
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_an_offload_plan_runs_bitwise_within_its_budget_and_prediction(name, fraction):
    *_, cg = _captured(name)
    budget = int(fraction * simulate(cg, cg.order).peak_bytes)
    schedule = solve(cg, budget, method="offload", bandwidth=1e12, mode="offload")
    assert schedule.offloads and schedule.sequence == list(cg.order)
    step = _runs_as_planned(name, schedule, budget)
    assert any(s.startswith("host:") for s in step.saved)  # host copies cross into the backward


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_a_plan_that_both_recomputes_and_offloads_runs_bitwise(fraction):
    # at this link speed (bytes per second of the roofline op times) the cheapest plan mixes both
    *_, cg = _captured("gpt")
    budget = int(fraction * simulate(cg, cg.order).peak_bytes)
    schedule = solve(cg, budget, method="offload", bandwidth=1e9, mode="both", time_limit=20)
    assert schedule.offloads and any(c > 1 for c in schedule.counts().values())
    _runs_as_planned("gpt", schedule, budget)


@contextlib.contextmanager
def _no_collection():
    """Garbage left by earlier tests is collected first, not freed inside the window
    (a free of an older block would lower the running total the peak is read from)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_host_copies_are_outside_the_allocator_and_device_copies_inside():
    x = torch.randn(64, 32).t()
    with _no_collection(), AllocatorPeak() as judge:
        host = host_pool.send(x)
    assert judge.peak_bytes == 0 and host.stride() == x.stride()
    with _no_collection(), AllocatorPeak() as judge:
        back = host_pool.arrived(host_pool.fetch(host, x.device))
    assert judge.peak_bytes == x.numel() * x.element_size()
    assert torch.equal(back, x) and back.stride() == x.stride()


def _mlp_graph():
    model, args = models.mlp(batch=8, d_in=16, hidden=32, depth=3)
    cg = capture(model, args, backward="outputs", measure_time=False)
    return model, args, cg


def test_a_read_inside_a_window_is_refused():
    model, args, cg = _mlp_graph()
    seq = list(cg.order)
    # a window over a read: the value leaves right after it is made and is back too late
    w = max(offload_windows(cg, seq), key=lambda w: w.in_last - w.out_first)
    reads = [t for t, v in enumerate(seq) if w.node in cg.nx.predecessors(v) and t > w.in_last]
    late = Offload(w.node, w.out_first - 1, reads[0] + 2)
    assert not simulate(cg, Schedule(seq, offloads=[late], bandwidth=1.0)).valid
    with pytest.raises(RewriteError, match="on the host"):
        ScheduledStep(cg, seq, offloads=[late])(model, args, {})


def test_a_forward_output_is_not_offloaded():
    model, args, cg = _mlp_graph()
    out = next(v for v in cg.ops if cg[v]["output"] and cg[v]["phase"] == "forward")
    seq = list(cg.order)
    assert all(w.node != out for w in offload_windows(cg, seq))
    t = seq.index(out)
    with pytest.raises(RewriteError, match="caller"):
        ScheduledStep(cg, seq, offloads=[Offload(out, t, len(seq))])(model, args, {})


def _random_offloads(data, graph, seq):
    """Windows of ``seq`` drawn at random, each with its transfers at random steps."""
    windows = offload_windows(graph, seq)
    if not windows:
        return []
    chosen = data.draw(st.lists(st.sampled_from(range(len(windows))), max_size=8, unique=True))
    offs = []
    for i in chosen:
        w = windows[i]
        out = data.draw(st.integers(w.out_first, w.in_last - 2))
        back = data.draw(st.integers(out + 2, w.in_last))
        offs.append(w.offload(out, back))
    return offs


def _reads(graph, seq):
    """(step, value) for every op step reading a value."""
    return [(t, u) for t, v in enumerate(seq) for u in graph.nx.predecessors(v) if graph.is_op(u)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(2, 7), seed=st.integers(0, 10_000), backward_start=st.booleans())
def test_transfer_slots_leave_every_read_outside_its_window(data, n, seed, backward_start):
    # synthetic graphs: a valid offload (the simulator's verdict) becomes transfers whose
    # window (from the device copy's release to the copy's arrival) holds no read
    graph = random_training_graph(n, seed=seed)
    seq = list(graph.order)
    if backward_start:  # a step without an op, as where a captured backward starts
        graph.add_node(BACKWARD_START, bytes=0, time=0.0, op="backward_start", phase="backward")
        k = next(i for i, v in enumerate(seq) if graph[v]["phase"] == "backward")
        seq.insert(k, BACKWARD_START)
    offs = _random_offloads(data, graph, seq)
    assert simulate(graph, Schedule(seq, offloads=offs, bandwidth=1.0)).valid
    kept, trs = transfers(seq, offs, skip={BACKWARD_START})
    assert kept == [v for v in seq if v != BACKWARD_START]
    reads = _reads(graph, kept)
    for tr in trs:
        lo, hi = tr.window
        assert tr.send <= tr.release < tr.fetch <= tr.arrive
        assert not [t for t, u in reads if u == tr.node and lo < 2 * t <= hi]


@functools.lru_cache(maxsize=None)
def _small_gpt():
    model, (idx, targets) = models.gpt(n_layer=1, d=16, n_head=2, seq=8, batch=2, vocab=32)
    loss_fn = lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    cg = capture(model, (idx,), backward="outputs", measure_time=False)
    charge_loss(cg, loss_fn)
    replay_random_ops(cg)
    # (room for the generator states that recomputed dropout keeps, which store-all does not)
    base = [list(cg.order), solve(cg, 2 * simulate(cg, cg.order).peak_bytes, method="checkpoint_all").sequence]
    assert len(base[1]) > len(base[0])  # it recomputes
    return model, (idx,), loss_fn, cg, base


class _Recording(ScheduledStep):
    """A scheduled step that keeps the forward and backward graphs it was cut into."""

    def _partition(self, joint, joint_inputs, **kw):
        fw, bw = super()._partition(joint, joint_inputs, **kw)
        self.graphs = (fw.graph, bw.graph)
        return fw, bw


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), which=st.integers(0, 1))
def test_random_offload_windows_are_honoured_by_the_rewrite(data, which):
    # captured graphs, offloads at random on the store-all order and on a recomputing
    # schedule: the rewritten graphs never read a value between its release and its
    # arrival (no read before arrival), the device copy is dropped at its release, and
    # the step's loss and gradients are eager's
    model, args, loss_fn, cg, base = _small_gpt()
    seq = base[which]
    offs = _random_offloads(data, cg, seq)
    schedule = Schedule(seq, offloads=offs, bandwidth=1.0)
    assert simulate(cg, schedule).valid
    step = _Recording(cg, seq, offloads=offs)
    _check_windows(*step.graphs, step.transfers)
    want_loss, want, _ = _step(model, args, loss_fn, lambda: model(*args))
    loss, grads, _ = _step(model, args, loss_fn, lambda: step(model, args, {}))
    assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want))


def _check_windows(fg, bg, trs):
    order = list(fg.nodes) + list(bg.nodes)
    pos = {n: i for i, n in enumerate(order)}
    events = {}
    for n in order:
        tag = n.meta.get("remat_transfer")
        if tag is not None and n.op == "call_function":  # (a saved value's input copies its meta)
            events[(tag[0], tag[2])] = n
    for k, tr in enumerate(trs):
        released = events.get(("release", k))
        assert released is not None and ("send", k) in events
        dev = released.args[0]
        assert pos[events[("send", k)]] < pos[released]
        # nothing reads the device copy, or a view of it, after its release
        stack, late = [dev], []
        while stack:
            n = stack.pop()
            for u in n.users:
                if u is released:
                    continue
                if u.op == "output" or pos.get(u, -1) > pos[released]:
                    late.append(u)
                if _aliases(u):
                    stack.append(u)
        assert not late, (tr, late)
        # what reads the value after the window reads the copy that came back
        back = events.get(("arrive", k))
        if back is not None:
            assert events[("fetch", k)] in back.all_input_nodes
            assert pos[back] > pos[released]


def _real_step_peak(fast, args, loss_fn):
    """The allocator's peak of one training step of the planned module (its watch)."""
    opt = torch.optim.SGD(fast.parameters(), lr=0.0)
    out = fast(*args)
    loss_fn(out).backward()
    del out
    opt.step()  # ends the measurement of the step
    opt.zero_grad(set_to_none=True)
    return fast.report.step_peak_bytes


def _aliases(n):
    return n.op == "call_function" and is_view(n)


@pytest.mark.slow
def test_optimize_with_offload_lets_auto_offload_and_the_real_step_fits():
    import solver
    from graphs.units import GiB

    model, args, loss_fn = _gpt()
    want_loss, want, plain = _step(model, args, loss_fn, lambda: model(*args))
    budget = 0.5 * plain
    fast = solver.optimize(model, budget / GiB, args, mode="graph", loss_fn=loss_fn, measure_time=False,
                           offload=True)
    report = fast.report
    assert report.schedule.offloads and report.method == "offload"
    assert any(n.startswith("offload: ") and "hidden behind compute" in n for n in report.notes)
    recompute_only = solver.optimize(model, budget / GiB, args, mode="graph", loss_fn=loss_fn, measure_time=False)
    assert report.predicted_overhead < recompute_only.report.predicted_overhead
    loss, grads, _ = _step(model, args, loss_fn, lambda: fast(*args), judged=False)  # (the module judges its step)
    assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want))
    real = _real_step_peak(fast, args, loss_fn)
    assert real is not None and real <= budget, (real, budget)
    assert abs(real - report.predicted_peak_bytes) <= 0.02 * real


@pytest.mark.parametrize("options,error", [
    (dict(mode="module"), "module mode checkpoints whole blocks"),
    (dict(method="chain_dp"), "lets method='auto' choose"),
])
def test_offload_where_nothing_would_offload_is_refused_with_the_reason(options, error):
    import solver

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(solver.OptionError, match=error):
        solver.optimize(net, 1.0, offload=True, **options)


@pytest.mark.slow
def test_a_budget_only_offload_reaches_is_planned_with_offload():
    import solver
    from graphs.units import GiB

    model, args, loss_fn = _gpt()
    want_loss, want, plain = _step(model, args, loss_fn, lambda: model(*args))
    budget = 0.2 * plain  # below every recomputing schedule of this step
    with pytest.raises(solver.InfeasibleBudget):
        solver.optimize(model, budget / GiB, args, mode="graph", loss_fn=loss_fn)
    fast = solver.optimize(model, budget / GiB, args, mode="graph", loss_fn=loss_fn, offload=True)
    report = fast.report
    assert report.method == "offload" and report.schedule.offloads
    assert report.planning_peak_bytes <= budget, (report.planning_peak_bytes, budget)
    loss, grads, _ = _step(model, args, loss_fn, lambda: fast(*args), judged=False)
    assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want))
    real = _real_step_peak(fast, args, loss_fn)
    assert real <= budget, (real, budget)

"""Measuring a captured step by running one of its schedules.

:func:`graphs.capture.capture` can measure op times and workspaces by running the joint
graph in its own order, which holds every value the backward reads: the peak of the
plain training step, the one a budget is asked for because it does not fit.
:func:`measure_in_schedule` runs a schedule instead: the forward and backward graphs that
:func:`graphs.rewrite.schedule_graphs` cuts for it, as the rewritten step runs
them (the forward keeps only what the schedule stores, recomputations where it puts
them, each value freed after its last use, the output gradients made when the backward
starts), with every op timed and its workspace measured by the allocator. A schedule
that fits the budget measures within it, and the run's own peak is returned.

Example
-------
>>> import torch
>>> from torch import nn
>>> from graphs.capture import capture
>>> net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
>>> cg = capture(net, (torch.randn(4, 8),), backward="outputs", inplace="functional",
...              measure_time=False, measure_workspace=False)
>>> run = measure_in_schedule(cg, cg.order, times=True, repeats=1)
>>> cg.meta["time_source"], cg.meta["workspace_source"], run.peak_bytes > 0
('measured', 'measured', True)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.fx as fx

from graphs.autocast import no_autocast
from graphs.capture import real_placeholder_values, set_op_costs
from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.costs import StepRunner, measure_workspaces, remember_workspaces, time_ops
from graphs.errors import CaptureError
from graphs.memory import generators_kept, resident_bytes
from graphs.rewrite import is_tangent, schedule_graphs, transfers
from graphs.torch_internals import tree_leaves

__all__ = ["PROBED_OPS", "ProbeRun", "ScheduleRun", "carry_costs", "measure_in_schedule", "probe_workspaces"]

#: op families whose workspace follows the kernel and layouts chosen when they run
#: (oneDNN's convolutions pad and reorder by channel blocks): estimates of them are the
#: least reliable, so :func:`probe_workspaces` measures them alone before a whole step runs
PROBED_OPS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


@dataclass(frozen=True)
class ScheduleRun:
    """One measured run of a schedule of a captured step.

    Attributes
    ----------
    peak_bytes : int or None
        The allocator's peak of the run: what it allocated at its highest, plus the
        parameters, buffers and inputs it started from (None where the allocator could
        not be read: on CPU inside another torch profiler).
    seconds : float
        Wall-clock seconds the measuring took.
    """

    peak_bytes: int | None
    seconds: float


class _Runnable(torch.nn.Module):
    """A bare fx graph for an ``fx.Interpreter`` to run: the interpreter reads its
    ``graph`` (no Python code is generated for it) and the attributes its ``get_attr``
    nodes name (constants that the trace lifted, such as a ``torch.tensor(...)`` built
    in the forward), which live on ``owner``, the captured graph module."""

    def __init__(self, graph: fx.Graph, owner: torch.nn.Module) -> None:
        super().__init__()
        self.graph = graph
        self.__dict__["_owner"] = owner  # not a submodule: its parameters are not this module's

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_owner"], name)


def _schedule_runner(cg: ComputeGraph, sequence: Sequence[Hashable],
                     offloads: Sequence[Any] = ()) -> tuple[StepRunner, list]:
    """A runner of the forward and backward graphs of ``sequence`` (and its
    ``offloads``, through :mod:`graphs.host_pool`) on real values, and the values that
    exist before it runs (parameters, buffers, inputs)."""
    info = cg.capture_info
    gm = cg.fx
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if not is_tangent(n)]
    tangents = [n for n in placeholders if is_tangent(n)]
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    num_fwd = len(out_node.args[0]) - len(primals)
    seq, slots = transfers(sequence, offloads, skip=(BACKWARD_START,))
    fw, bw = (_Runnable(g, gm) for g in schedule_graphs(gm, seq, num_fwd_outputs=num_fwd, offloads=slots)[:2])
    values = real_placeholder_values(placeholders, info.step, info.flat_inputs)
    by_name = dict(zip((p.name for p in placeholders), values))
    primal_values = [by_name[p.name] for p in primals]
    # the output gradients' shapes only: the run makes them where the backward starts, so
    # that nothing beyond the resident values is held outside the measured run
    tangent_specs = [(by_name[t.name].to("meta"), by_name[t.name].device) for t in tangents]
    del values, by_name
    num_out = num_fwd

    def run(make: Callable[[fx.GraphModule], fx.Interpreter]) -> None:
        fw_in = [n for n in fw.graph.nodes if n.op == "placeholder"]
        outs = list(make(fw).run(initial_env=dict(zip(fw_in, primal_values)), enable_io_processing=False))
        held, saved = outs[:num_out], outs[num_out:]  # the step holds its outputs through backward
        del outs
        bw_in = [n for n in bw.graph.nodes if n.op == "placeholder"]
        # the output gradients arrive when the backward starts
        env = dict(zip(bw_in, saved + [torch.ones_like(t, device=d) for t, d in tangent_specs]))
        del saved
        grads = make(bw).run(initial_env=env, enable_io_processing=False)
        del env, grads, held

    return run, primal_values


def measure_in_schedule(cg: ComputeGraph, sequence: Sequence[Hashable], *, times: bool = True,
                        repeats: int = 5, offloads: Sequence[Any] = ()) -> ScheduleRun:
    """Measure the ops of a captured step by running ``sequence``, a schedule of it, on
    the tensors it was captured with, and write the figures onto ``cg``.

    Every op's workspace (what it allocates beyond its outputs, by the allocator; an op
    the schedule runs more than once: the largest) and, with ``times``, its time (the
    fastest of ``repeats`` runs after a warm-up, over all its runs) replace the
    capture's figures (``cg.meta["workspace_source"]`` and ``["time_source"]`` become
    ``"measured"``). The run holds what the schedule holds, so its peak is the
    schedule's, not the plain step's. The generator state ends as it was.

    Parameters
    ----------
    cg : ComputeGraph
        Captured on real tensors with ``backward="outputs"`` (it carries ``fx`` and
        ``capture_info``).
    sequence : sequence of node ids
        A valid schedule of ``cg`` (its ops in run order, a repeated id a recomputation).
    times : bool, keyword-only
        Also time the ops (one more run of the schedule, plus its warm-up).
    repeats : int, keyword-only
        Timed runs per op.
    offloads : sequence of Offload, keyword-only
        The schedule's offloads (:class:`solver.schedule.Offload`): the run copies those
        values to the host and back as the rewrite does, so that it holds no more than
        the schedule.

    Returns
    -------
    ScheduleRun

    Raises
    ------
    CaptureError
        The graph carries no real tensors to run, or a run failed.
    """
    import time

    info = getattr(cg, "capture_info", None)
    if info is None or getattr(cg, "fx", None) is None or not info.real:
        raise CaptureError("measure_in_schedule needs a graph captured on real tensors (its fx graph and "
                           "capture info are kept in memory only)")
    if info.backward != "outputs":
        raise CaptureError("measure_in_schedule needs a graph captured with backward='outputs'")
    t0 = time.perf_counter()
    runner, resident = _schedule_runner(cg, sequence, offloads)
    tensors = [t for t in resident if isinstance(t, torch.Tensor)]
    devices = {t.device.type for t in tensors}
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with no_autocast(), generators_kept(cuda):  # (the states held outside the allocator the run measures)
        work = measure_workspaces(runner, devices=devices)
        timed = time_ops(runner, devices=devices, repeats=repeats, warm=work is None) if times else None
    peak = None
    if work is not None:
        # the run's values are copies of the step's buffers: the step's own are held beside them
        peak = resident_bytes(tensors, list(info.step.buffers())) + int(work.peak_bytes or 0)
        set_op_costs(cg, workspaces=work.workspace)
        remember_workspaces(cg.fx, work.workspace)
        cg.meta["workspace_source"] = "measured"
    if timed is not None:
        set_op_costs(cg, times=timed)
        cg.meta["time_source"] = "measured"
    return ScheduleRun(peak_bytes=peak, seconds=time.perf_counter() - t0)


def _op_costs(cg: ComputeGraph) -> dict[str, tuple[Any, float, int, int, int]]:
    """Per op of the joint graph (a multi-output op once, by its fx name, as
    :func:`graphs.capture.set_op_costs` keys it): its target, time, workspace, output
    bytes and FLOPs."""
    out: dict[str, tuple[Any, float, int, int, int]] = {}
    groups: dict[str, list[str]] = {}
    for v in cg.ops:
        d = cg[v]
        if d.get("group") is not None:
            groups.setdefault(d["group"], []).append(v)
        elif d.get("op") != "tangent":
            out[str(v)] = (d.get("target"), float(d.get("time", 0.0)), int(d.get("workspace", 0)),
                           int(d.get("bytes", 0)), int(d.get("flops", 0)))
    for name, members in groups.items():
        members = sorted(members, key=lambda p: cg[p]["group_index"])
        first = cg[members[0]]
        size = sum(int(cg[p]["bytes"]) for p in members)
        workspace = int(first["run_workspace"]) - (size - int(first["bytes"]))
        out[str(name)] = (first.get("target"), float(first["group_time"]), workspace, size,
                          sum(int(cg[p].get("flops", 0)) for p in members))
    return out


def carry_costs(source: ComputeGraph, target: ComputeGraph, *, any_source: bool = False) -> bool:
    """Write the measured op times and workspaces of ``source`` onto ``target``, a
    capture of the same step at other sizes (every op of ``target`` is an op of
    ``source``: the same fx name and target), each scaled to the op's sizes in
    ``target``: a time by the ratio of the op's FLOPs (of its output bytes where it has
    none), a workspace by the ratio of its output bytes. Nothing runs: a plan for a new
    size of a planned family is priced from the measured one. The figures stay
    ``"measured"`` (``target.meta["costs_from"]`` names where they were measured);
    the memory of a plan made from them is still judged by the allocator on its first
    step.

    ``any_source``: carry ``source``'s figures however they were made (estimated
    ones stay estimates); by default only measured ones.

    Returns
    -------
    bool
        Whether the costs were carried (False, and ``target`` untouched, where
        ``source`` was not measured or the two differ in their ops).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from graphs.capture import capture
    >>> net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    >>> cap = lambda n: capture(net, (torch.randn(n, 8),), backward="outputs", inplace="functional",
    ...                         measure_time=False, measure_workspace=False)
    >>> small, large = cap(4), cap(16)
    >>> _ = measure_in_schedule(small, small.order, repeats=1)
    >>> carry_costs(small, large), large.meta["time_source"]
    (True, 'measured')
    >>> large["relu"]["time"] == 4 * small["relu"]["time"]
    True
    """
    measured = source.meta.get("time_source") == "measured" and source.meta.get("workspace_source") == "measured"
    if not measured and not any_source:
        return False
    try:
        have, want = _op_costs(source), _op_costs(target)
    except KeyError:  # a multi-output op without its shares: not a capture's DAG
        return False
    if not want or any(name not in have or have[name][0] != w[0] for name, w in want.items()):
        return False
    times, workspaces = {}, {}
    for name, (_, _, _, size, flops) in want.items():
        _, seconds, workspace, old_size, old_flops = have[name]
        by_size = size / old_size if old_size else 1.0
        times[name] = seconds * (flops / old_flops if flops and old_flops else by_size)
        workspaces[name] = int(round(workspace * by_size))
    set_op_costs(target, times=times, workspaces=workspaces)
    target.meta["time_source"] = source.meta.get("time_source")
    target.meta["workspace_source"] = source.meta.get("workspace_source")
    target.meta["costs_from"] = "a capture of the step at other sizes, scaled"
    return True
@dataclass(frozen=True)
class ProbeRun:
    """The convolutions of a captured step measured alone (:func:`probe_workspaces`).

    Attributes
    ----------
    workspace : dict
        fx node name -> measured workspace bytes.
    peak_bytes : int or None
        The highest of the runs: the step's parameters, buffers and inputs, the inputs
        made for the op and what it allocated (None where nothing ran).
    """

    workspace: dict
    peak_bytes: int | None


def probe_workspaces(cg: ComputeGraph, *, ops: Sequence[Any] = PROBED_OPS) -> ProbeRun:
    """Measure the workspace of each of ``cg``'s ops of the families ``ops`` alone, on
    its captured inputs (the step's own parameters and inputs where the op reads them,
    else tensors of the captured shapes, strides and dtypes filled with ones: no
    generator is drawn from), and write the figures onto ``cg``
    (:func:`graphs.capture.set_op_costs`), for choosing the schedule a whole step is
    then measured in. Each run holds one op's inputs, outputs and workspace beside the
    step's resident values: less than any step that runs the op. Ops alike by
    :func:`graphs.costs.op_signature` run once. Where nothing can run (no fx graph,
    fake or meta tensors, a torch profiler already recording on CPU) nothing is measured.

    Parameters
    ----------
    cg : ComputeGraph
        Captured on real tensors (it carries ``fx`` and ``capture_info``).
    ops : sequence of op overloads, keyword-only
        The families to measure.

    Returns
    -------
    ProbeRun

    Examples
    --------
    >>> from torch import nn
    >>> from graphs.capture import capture
    >>> net = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4))
    >>> cg = capture(net, (torch.randn(2, 4, 8, 8),), backward="outputs", inplace="functional",
    ...              measure_time=False, measure_workspace=False)
    >>> sorted(probe_workspaces(cg).workspace)
    ['convolution', 'convolution_backward']
    """
    from graphs.costs import op_signature
    from graphs.memory import AllocatorPeak, judge_available

    info, gm = getattr(cg, "capture_info", None), getattr(cg, "fx", None)
    if info is None or gm is None or not info.real:
        return ProbeRun({}, None)
    wanted = set(ops)
    seen: dict[tuple, int] = {}
    found: dict[str, int] = {}
    peak: int | None = None
    resident = [info.step, info.flat_inputs]

    def value(n: fx.Node) -> Any:
        if n.op == "placeholder":  # the step's parameter or input itself, no copy of it
            return real_placeholder_values([n], info.step, info.flat_inputs)[0]
        return _ones_like_value(n)

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in wanted:
            continue
        sig = op_signature(node)
        if sig is not None and sig in seen:
            found[node.name] = seen[sig]
            continue
        try:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
        except LookupError:  # an argument that is not a tensor of known size
            continue
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or not judge_available(*tensors):
            continue
        with no_autocast(), torch.no_grad(), AllocatorPeak(device=tensors[0].device) as m:
            out = node.target(*args, **kwargs)
        del out
        # what the op held at its peak beyond what it left allocated (its outputs)
        found[node.name] = max(int(m.peak_bytes - max(m.allocated_bytes, 0)), 0)
        held = resident_bytes(resident, tensors, device=tensors[0].device) + int(m.peak_bytes)
        peak = held if peak is None else max(peak, held)
        if sig is not None:
            seen[sig] = found[node.name]
        del args, kwargs, tensors
    if found:
        set_op_costs(cg, workspaces=found)
        remember_workspaces(gm, found)
    return ProbeRun(found, peak)


def _ones_like_value(n: fx.Node) -> Any:
    """A real tensor of ``n``'s captured value's size, strides, dtype and device, or the
    value itself when it is not a tensor; LookupError where it cannot be made."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        if v is None:
            raise LookupError(n.name)
        return v
    try:
        t = torch.empty_strided(tuple(int(x) for x in v.shape), tuple(int(x) for x in v.stride()), dtype=v.dtype,
                                device=v.device)
    except (TypeError, RuntimeError):  # symbolic sizes, or a device that cannot allocate
        raise LookupError(n.name) from None
    return t.fill_(1) if t.numel() else t

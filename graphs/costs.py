"""Annotation passes over an ATen-level fx graph: storage (alias-aware bytes), FLOPs, time.

Each pass walks the graph once and writes one typed record per node into ``node.meta``
(the style of ``torch.fx.passes.shape_prop``): :func:`annotate_storage` writes
``meta["remat_storage"]`` (a :class:`StorageRecord`), :func:`annotate_flops` writes
``meta["remat_flops"]`` (an int), :func:`annotate_roofline_time` and
:func:`annotate_measured_time` write ``meta["remat_time"]`` (seconds),
:func:`annotate_measured_workspace` and :func:`annotate_estimated_workspace` write
``meta["remat_workspace"]`` (bytes an op allocates beyond its outputs while it runs, and
``gm.meta["remat_workspace_source"]``: ``"measured"`` or ``"estimated"``). The passes read
the ``meta["val"]`` (fake or real tensor) that AOTAutograd leaves on every node.

Example
-------
>>> import torch
>>> from torch.fx.experimental.proxy_tensor import make_fx
>>> gm = make_fx(lambda a: (a.t() @ a).relu(), tracing_mode="fake")(torch.ones(4, 3))
>>> records = annotate_storage(gm)
>>> [(n.name, r.bytes, r.base) for n, r in records.items() if n.op == "call_function"]
[('t', 0, 'a_1'), ('mm', 36, 'mm'), ('relu', 36, 'relu')]
>>> annotate_flops(gm)["mm"]
72
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx

from graphs.errors import CaptureError
from graphs.hardware import Hardware
from graphs.memory import AllocatorPeak, peak_of_events, quiet_profile, settle_open_judges
from graphs.torch_internals import (allocation_events, is_op_overload, labelled_spans, op_schema, profiler_running,
                                   release_results, size_expr, size_hint, tree_leaves)

__all__ = [
    "StorageRecord",
    "annotate_storage",
    "annotate_flops",
    "annotate_roofline_time",
    "annotate_measured_time",
    "annotate_measured_workspace",
    "annotate_estimated_workspace",
    "measure_workspaces",
    "op_signature",
    "remember_workspaces",
    "forget_measured_workspaces",
    "time_ops",
    "whole_graph",
    "op_label",
    "WorkspaceRun",
    "StepRunner",
    "source_line",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageRecord:
    """Where a node's output lives.

    Attributes
    ----------
    bytes : int
        Bytes of storage the node allocates itself: 0 for views, in-place results and
        the tuple of a multi-output op (its ``getitem`` nodes own the storages).
    base : str
        Name of the node that owns the storage the output lives in (the node itself
        when it allocates).
    alias : bool
        The output shares the storage of another node.
    """

    bytes: int
    base: str
    alias: bool


def source_line(node: torch.fx.Node) -> str:
    """``file:line`` of the user code that made ``node`` (or ``""``), from its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    last = ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith("File "):
            try:
                path = line.split('"')[1]
                lineno = line.split("line ")[1].split(",")[0]
                last = f"{path.rsplit('/', 1)[-1]}:{lineno}"
            except IndexError:
                continue
    return last


def _where(node: torch.fx.Node) -> str:
    src = source_line(node)
    return node.format_node() + (f" (from {src})" if src else "")


def tensor_storage_bytes(value: Any) -> int:
    """Bytes of the storages of the tensors in ``value`` (a tensor or a nest of them),
    a view counted at its whole base's size.

    Examples
    --------
    >>> x = torch.zeros(4, 4)
    >>> tensor_storage_bytes(x[0]), tensor_storage_bytes((x, torch.zeros(2)))
    (64, 72)
    """
    return size_hint(_storage_bytes(value))


def _storage_bytes(value: Any) -> Any:
    """:func:`tensor_storage_bytes`, symbolic where the sizes are (an int or a SymInt)."""
    total = 0
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            try:
                total = total + t.untyped_storage().nbytes()
            except Exception:  # tensors without storage (e.g. some subclasses)
                total = total + t.numel() * t.element_size()
    return total


def _tensor_bytes(value: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor)
    )


def _aliased_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input node whose storage ``node``'s output shares (views, in-place ops)."""
    target = node.target
    if target is operator.getitem:
        return None
    custom = node.meta.get("custom") or {}
    if custom.get("remat_inplace") and node.meta.get("partitioner_tag") != "is_backward":
        first = node.args[0] if node.args else None
        return first if isinstance(first, torch.fx.Node) else None
    if not is_op_overload(target):
        return None
    if target is torch.ops.aten._unsafe_view.default:
        first = node.args[0]
        return first if isinstance(first, torch.fx.Node) else None
    schema = op_schema(target)
    if not schema.returns or schema.returns[0].alias_info is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            return value
    return None


def annotate_storage(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, StorageRecord]:
    """Alias-aware storage pass: who owns each node's output storage, and its bytes.

    Views and in-place results (``meta["custom"]["remat_inplace"]``, set by capture for
    ops that were in-place in the user's program) get 0 bytes and the base of the value
    they alias. A multi-output op gets 0 bytes; each ``getitem`` owns its output (or
    aliases the base when the op returns views, e.g. ``split``).

    Returns
    -------
    dict
        node -> :class:`StorageRecord`; also written to ``node.meta["remat_storage"]``.
    """
    records: dict[torch.fx.Node, StorageRecord] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        try:
            val = node.meta.get("val")
            # a graph captured with symbolic sizes: the bytes as an expression of them too
            node.meta["remat_bytes_expr"] = size_expr(_storage_bytes(val))
            if node.op in ("placeholder", "get_attr"):
                rec = StorageRecord(tensor_storage_bytes(val), node.name, False)
            elif node.target is operator.getitem:
                parent = node.args[0]
                prec = records[parent]
                if prec.alias:
                    rec = StorageRecord(0, prec.base, True)
                else:
                    rec = StorageRecord(tensor_storage_bytes(val), node.name, False)
            else:
                src = _aliased_arg(node)
                if src is not None and src in records:
                    rec = StorageRecord(0, records[src].base, True)
                elif isinstance(val, (tuple, list)):
                    rec = StorageRecord(0, node.name, False)
                else:
                    rec = StorageRecord(tensor_storage_bytes(val), node.name, False)
        except Exception as exc:
            raise CaptureError(f"cannot size the output of {_where(node)}: {exc}") from exc
        node.meta["remat_storage"] = rec
        records[node] = rec
    return records


#: ops that :mod:`torch.utils.flop_counter` counts from torch 2.15 on, by the rule of the
#: op named beside them, so that FLOPs do not depend on the torch release
_COUNTED_AS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
}


def _flop_counter(target: Any) -> Callable[..., int] | None:
    from torch.utils.flop_counter import flop_registry

    if not is_op_overload(target):
        return None
    packet = target.overloadpacket
    rule = flop_registry.get(packet)
    if rule is None and packet.__name__ in _COUNTED_AS:
        rule = flop_registry.get(getattr(torch.ops.aten, _COUNTED_AS[packet.__name__]))
    return rule


def _vals(x: Any) -> Any:
    return torch.fx.node.map_arg(x, lambda n: n.meta.get("val"))


def annotate_flops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """FLOPs of every node by the rules of :mod:`torch.utils.flop_counter` (0 for others).

    Returns
    -------
    dict
        node name -> FLOPs; also written to ``node.meta["remat_flops"]``.
    """
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        flops = 0
        if node.op == "call_function":
            fn = _flop_counter(node.target)
            if fn is not None:
                try:
                    flops = fn(*_vals(node.args), **_vals(node.kwargs), out_val=node.meta.get("val"))
                except Exception as exc:
                    raise CaptureError(f"cannot count the FLOPs of {_where(node)}: {exc}") from exc
        node.meta["remat_flops_expr"] = size_expr(flops)
        flops = size_hint(flops)
        node.meta["remat_flops"] = flops
        out[node.name] = flops
    return out


def annotate_roofline_time(gm: torch.fx.GraphModule, hardware: Hardware) -> dict[str, float]:
    """Roofline seconds per node: ``max(flops / peak, bytes moved / bandwidth)``.

    Bytes moved are the tensor bytes the op reads plus those it writes; views,
    ``getitem`` and sources take no time. Needs :func:`annotate_storage` and
    :func:`annotate_flops` first.
    """
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        seconds = 0.0
        rec = node.meta.get("remat_storage")
        if node.op == "call_function" and rec is not None and not rec.alias and node.target is not operator.getitem:
            moved = _tensor_bytes(_vals(list(node.args) + list(node.kwargs.values()))) + _tensor_bytes(
                node.meta.get("val")
            )
            seconds = hardware.roofline_seconds(node.meta.get("remat_flops", 0), moved)
        node.meta["remat_time"] = seconds
        out[node.name] = seconds
    return out


def op_label(n: torch.fx.Node) -> str | None:
    """The joint-graph op that node ``n`` runs: its own name, or, in a graph cut from a
    schedule (:func:`graphs.rewrite.partition_by_schedule`), the name of the node it is
    a copy of; None for what is not an op (``getitem`` projections of a multi-output
    op's result)."""
    if n.op != "call_function" or n.target is operator.getitem:
        return None
    return n.meta.get("remat_source", n.name)


#: runs a step's graph(s), each under an interpreter that ``make(graph)`` returns
StepRunner = Callable[[Callable[[torch.fx.GraphModule], torch.fx.Interpreter]], None]


def whole_graph(gm: torch.fx.GraphModule, args: list[Any]) -> StepRunner:
    """The runner of ``gm`` on ``args`` in its own order (the store-all schedule)."""
    def run(make: Callable[[torch.fx.GraphModule], torch.fx.Interpreter]) -> None:
        make(gm).run(*args, enable_io_processing=False)
    return run


class _TimingInterpreter(torch.fx.Interpreter):
    """Times each op: the fastest of ``repeats`` runs after a warm-up run. An op whose
    call signature (the op, its arguments' shapes, dtypes and strides) was timed before
    in the step, such as the same op of the next alike layer or a recomputation,
    runs once, untimed, and takes that figure: the same kernel on the same shapes."""

    def __init__(self, gm: torch.fx.GraphModule, *, repeats: int, sync: Callable[[], None], times: dict,
                 by_signature: dict):
        super().__init__(gm)
        self.repeats = repeats
        self.sync = sync
        self.times = times
        self.by_signature = by_signature

    def run_node(self, n: torch.fx.Node) -> Any:
        label = op_label(n)
        if label is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        sig = _call_signature(n.target, args, kwargs)
        if sig is not None and sig in self.by_signature:
            self.times[label] = min(self.by_signature[sig], self.times.get(label, float("inf")))
            return self.call_function(n.target, args, kwargs)
        samples = []
        result = None
        for i in range(self.repeats + 1):  # the first run is the warm-up
            self.sync()
            t0 = time.perf_counter()
            result = self.call_function(n.target, args, kwargs)
            self.sync()
            if i:
                samples.append(time.perf_counter() - t0)
        fastest = min(samples)
        if sig is not None:
            self.by_signature[sig] = fastest
        self.times[label] = min(fastest, self.times.get(label, float("inf")))
        return result


def _call_signature(target: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What a call's time depends on, from its real arguments: the op, the shapes,
    dtypes, strides and devices of its tensors and its other arguments (None where an
    argument is not a plain value)."""
    def key(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.dtype, a.stride(), a.device, a.requires_grad)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__,) + tuple(key(x) for x in a)
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return a
        raise LookupError

    try:
        return (target, key(args), tuple(sorted((k, key(v)) for k, v in kwargs.items())))
    except LookupError:
        return None


def _sync_of(devices: set[str]) -> Callable[[], None]:
    if "cuda" in devices:
        return torch.cuda.synchronize

    def sync() -> None:
        return None
    return sync


def time_ops(runner: StepRunner, *, devices: set[str], repeats: int = 5, warm: bool = True) -> dict[str, float]:
    """Time every op that ``runner`` runs: the fastest of ``repeats`` runs after one
    warm-up run, keyed by :func:`op_label`. Calls of one op on arguments of the same
    shapes, dtypes and strides (alike layers, an op a schedule runs again) are timed
    once and share the figure: a model of many alike layers times each distinct call
    once. With ``warm``, the whole step runs once untimed first (see
    :func:`annotate_measured_time`). Runs without autograd; the generator state is the
    caller's to restore."""
    times: dict[str, float] = {}
    by_signature: dict[tuple, float] = {}
    sync = _sync_of(devices)
    with torch.no_grad():
        try:
            if warm:
                runner(torch.fx.Interpreter)
            runner(lambda g: _TimingInterpreter(g, repeats=max(1, repeats), sync=sync, times=times,
                                               by_signature=by_signature))
        except Exception as exc:
            raise CaptureError(f"timing the captured graph on real tensors failed: {exc}") from exc
    return times


def annotate_measured_time(
    gm: torch.fx.GraphModule, args: list[Any], *, repeats: int = 5
) -> dict[str, float]:
    """Run the graph on real tensors and time every op: the fastest of ``repeats`` runs
    after one warm-up run.

    The whole graph runs once untimed first (with the generator state restored after
    it), so that the allocator is in the state of a training loop. In a fresh process
    glibc serves the first large tensors from fresh pages, and an op run several times
    in a row can have its output's pages returned and faulted in again between runs:
    timed by the median, convolutions near the input of a ResNet took up to 5x (first)
    and 1.3x (next ones) what they take from the second training step on. The fastest
    run is what a step in a training loop sees.

    Parameters
    ----------
    gm : torch.fx.GraphModule
    args : list
        Real values of the placeholders, in order.
    repeats : int, keyword-only

    Returns
    -------
    dict
        node name -> seconds; also written to ``node.meta["remat_time"]``.
    """
    devices = {t.device.type for t in args if isinstance(t, torch.Tensor)}
    cuda = sorted({t.device.index or 0 for t in args if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        times = time_ops(whole_graph(gm, args), devices=devices, repeats=repeats)
    for node in gm.graph.nodes:
        node.meta["remat_time"] = times.get(node.name, 0.0)
    return times


_SPAN = "remat.op::"


class _LabelledInterpreter(torch.fx.Interpreter):
    """Runs each op inside a profiler range named after the joint-graph op it runs."""

    def run_node(self, n: torch.fx.Node) -> Any:
        label = op_label(n)
        if label is None:
            return super().run_node(n)
        with torch.profiler.record_function(_SPAN + label):
            return super().run_node(n)


def _workspace_of_spans(events: list[tuple[int, int, str]], spans: list[tuple[str, int, int]],
                        device: str) -> dict[str, int]:
    """Per span: the highest running total of the allocations inside it, less what is
    still allocated at its end (the op's outputs); per label, the largest of its spans."""
    times = [t for t, _, dev in events if dev == device]
    sizes = [b for _, b, dev in events if dev == device]
    out: dict[str, int] = {}
    i = 0
    for label, start, end in spans:
        while i < len(times) and times[i] < start:
            i += 1
        j = i
        while j < len(times) and times[j] <= end:
            j += 1
        peak, net = peak_of_events(sizes[i:j])
        key = label[len(_SPAN):]
        out[key] = max(out.get(key, 0), peak - max(net, 0), 0)
        i = j
    return out


@dataclass(frozen=True)
class WorkspaceRun:
    """What one measured run of a step found.

    Attributes
    ----------
    workspace : dict
        Joint-graph op name -> the bytes it allocated beyond its outputs at its own
        peak (the largest of its runs).
    peak_bytes : int or None
        The allocator's peak of the whole run above its state on entry (None where the
        run was not measured as a whole).
    """

    workspace: dict
    peak_bytes: int | None


def measure_workspaces(runner: StepRunner, *, devices: set[str]) -> WorkspaceRun | None:
    """Run the step once and measure each op's workspace by the allocator, keyed by
    :func:`op_label`, and the run's own peak; None on CPU inside another torch profiler
    (a second one would take over its session). Runs without autograd; the generator
    state is the caller's to restore."""
    accelerators = devices - {"cpu"}
    settle_open_judges()  # a watched step's measurement still open
    if not accelerators and profiler_running():
        return None
    try:
        with torch.no_grad():
            if not accelerators:
                with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                    runner(_LabelledInterpreter)
                events, spans = allocation_events(prof), labelled_spans(prof, _SPAN)
                release_results(prof)
                peak = peak_of_events(b for _, b, dev in events if dev == "cpu")[0]
                return WorkspaceRun(_workspace_of_spans(events, spans, "cpu"), peak)
            device = torch.device(sorted(accelerators)[0])
            workspace: dict[str, int] = {}
            peaks = [0]
            runner(lambda g: _PeakPerOpInterpreter(g, device, workspace, peaks))
            return WorkspaceRun(workspace, max(peaks))
    except Exception as exc:
        raise CaptureError(f"measuring the workspace of the captured graph's ops failed: {exc}") from exc


def annotate_measured_workspace(gm: torch.fx.GraphModule, args: list[Any]) -> dict[str, int]:
    """Run the graph once on real tensors and measure each op's workspace: the bytes
    the allocator holds at the op's own peak beyond what it leaves allocated (its
    outputs), e.g. the column buffers of a CPU convolution.

    On CPU the run is profiled once (``profile_memory=True``) with a profiler range
    around every op, and the allocations inside each range are replayed; on CUDA each op
    runs under :class:`graphs.memory.AllocatorPeak` (the allocator's peak statistics).
    The generator state is restored after the run. Inside another torch profiler on
    CPU (which a second one would take over), the workspaces are
    :func:`annotate_estimated_workspace`'s instead, with a warning in the log.

    Parameters
    ----------
    gm : torch.fx.GraphModule
    args : list
        Real values of the placeholders, in order.

    Returns
    -------
    dict
        node name -> bytes (ops only); also written to ``node.meta["remat_workspace"]``
        (0 for the other nodes).

    Examples
    --------
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda a, b: (a @ b).relu())(torch.ones(8, 8), torch.ones(8, 8))
    >>> annotate_measured_workspace(gm, [torch.ones(8, 8), torch.ones(8, 8)])
    {'mm': 0, 'relu': 0}
    """
    devices = {t.device.type for t in args if isinstance(t, torch.Tensor)}
    cuda = sorted({t.device.index or 0 for t in args if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        run = measure_workspaces(whole_graph(gm, args), devices=devices)
    if run is None:
        log.warning("a torch profiler is running: op workspaces are estimated, not measured")
        return annotate_estimated_workspace(gm)
    for node in gm.graph.nodes:
        node.meta["remat_workspace"] = int(run.workspace.get(node.name, 0))
    gm.meta["remat_workspace_source"] = "measured"
    remember_workspaces(gm, run.workspace)
    return run.workspace


class _PeakPerOpInterpreter(torch.fx.Interpreter):
    """Runs each op under its own :class:`graphs.memory.AllocatorPeak` (accelerators,
    whose peak statistics cost no profiler); ``peaks`` collects each op's peak above
    the allocator's state when the run began."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, workspace: dict, peaks: list):
        super().__init__(gm)
        self.device = device
        self.workspace = workspace
        self.peaks = peaks
        self.start: int | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        label = op_label(n)
        if label is None:
            return super().run_node(n)
        with AllocatorPeak(device=self.device) as m:
            result = super().run_node(n)
        if self.start is None:
            self.start = m.entry_bytes
        self.workspace[label] = max(self.workspace.get(label, 0), m.peak_bytes - max(m.allocated_bytes, 0), 0)
        self.peaks.append(m.entry_bytes - self.start + m.peak_bytes)
        return result


def _conv_forward_buffers(node: torch.fx.Node) -> int:
    """A convolution's forward: its larger activation (input or output) copied into the
    kernel's blocked layout, and the weight reordered."""
    x, w = (_vals(a) for a in node.args[:2])
    return max(_tensor_bytes(x), _tensor_bytes(node.meta.get("val"))) + _tensor_bytes(w)


#: oneDNN's channel block on CPU: 16 fp32 lanes of AVX-512, the widest it uses (on
#: narrower vector units the blocks are smaller, and the rule below an upper bound)
_ONEDNN_CHANNEL_BLOCK = 16


def _channels_last(t: Any) -> bool:
    """Whether torch's CPU convolution takes ``t`` as channels-last (its strides say so
    and not plain contiguity as well), the case where it runs oneDNN in NHWC."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5):
        return False
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    try:
        return bool(t.is_contiguous(memory_format=fmt)) and not bool(t.is_contiguous())
    except (TypeError, RuntimeError):  # symbolic strides
        return False


def _blocked_weight_grad_bytes(x: Any, w: Any, groups: int) -> int:
    """The weight gradient of a channels-last CPU convolution, as oneDNN computes it: in
    its blocked weight layout, each group's output and input channels padded up to whole
    channel blocks, accumulated in fp32 (and copied to the weight's dtype when that is
    narrower), then reordered into the weight's own layout. For a depthwise convolution
    (one channel a group) the padding makes it ``block ** 2`` times the weight: 1 KiB a
    group and kernel tap, whatever the batch and spatial sizes. Contiguous inputs go
    another way, which the rule leaves to the activation copies."""
    if not (_channels_last(x) or _channels_last(w)) or not isinstance(w, torch.Tensor):
        return 0
    if x.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return 0
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return 0
    b = _ONEDNN_CHANNEL_BLOCK
    pad = lambda c: -(-int(c) // b) * b  # noqa: E731
    taps = 1
    for k in w.shape[2:]:
        taps *= int(k)
    padded = groups * pad(int(w.shape[0]) // groups) * pad(w.shape[1]) * taps
    narrow = padded * w.element_size() if w.element_size() < 4 else 0
    # a weight not laid out channels-last is first copied into that layout too
    fmt = torch.channels_last if w.dim() == 4 else torch.channels_last_3d
    copied = 0 if w.is_contiguous(memory_format=fmt) else _tensor_bytes(w)
    return padded * 4 + narrow + _tensor_bytes(w) + copied


def _conv_backward_buffers(node: torch.fx.Node) -> int:
    """A convolution's backward: the output's gradient, and the input when the input's
    gradient is asked for, copied into the kernel's blocked layout; and, when the
    weight's gradient is asked for on channels-last activations, that gradient in
    oneDNN's padded blocked layout (:func:`_blocked_weight_grad_bytes`)."""
    grad_out, x, w = (_vals(a) for a in node.args[:3])
    mask = node.args[-1] if isinstance(node.args[-1], (list, tuple)) else (True, True)
    groups = node.args[9] if len(node.args) > 9 and isinstance(node.args[9], int) else 1
    weight_grad = _blocked_weight_grad_bytes(x, w, groups) if len(mask) > 1 and mask[1] else 0
    return _tensor_bytes(grad_out) + (_tensor_bytes(x) if mask[0] else 0) + weight_grad


#: per op overload, the function of its node that estimates its workspace in bytes
WORKSPACE_ESTIMATES: dict[Any, Callable[[torch.fx.Node], int]] = {
    torch.ops.aten.convolution.default: _conv_forward_buffers,
    torch.ops.aten.convolution_backward.default: _conv_backward_buffers,
}


def _safe_softmax_mask(node: torch.fx.Node) -> int:
    """``_safe_softmax``: a one-byte mask per element (where a row is all ``-inf``)."""
    val = node.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


WORKSPACE_ESTIMATES[torch.ops.aten._safe_softmax.default] = _safe_softmax_mask

#: workspaces measured in this process, by op signature (:func:`op_signature`): what an
#: estimate takes first
_MEASURED: dict[tuple, int] = {}
_MEASURED_MAX = 100_000


def op_signature(node: torch.fx.Node) -> tuple | None:
    """What an op's workspace depends on: the op, the shapes, dtypes and strides of its
    tensor arguments and its other arguments; None where an argument is symbolic."""
    def key(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                try:
                    return ("T", tuple(int(x) for x in v.shape), str(v.dtype), tuple(int(x) for x in v.stride()),
                            v.device.type)
                except (TypeError, RuntimeError):  # symbolic sizes
                    raise LookupError from None
            return ("N", repr(v))
        if isinstance(a, (list, tuple)):
            return tuple(key(x) for x in a)
        return repr(a)

    if node.op != "call_function":
        return None
    try:
        return (str(node.target), key(list(node.args)), tuple(sorted((k, key(v)) for k, v in node.kwargs.items())))
    except LookupError:
        return None


def remember_workspaces(gm: torch.fx.GraphModule, workspace: Mapping[str, int]) -> None:
    """Keep measured workspaces (node name -> bytes) of ``gm``'s ops by op signature, for
    later estimates in this process (:func:`annotate_estimated_workspace`)."""
    for node in gm.graph.nodes:
        if node.name in workspace and len(_MEASURED) < _MEASURED_MAX:
            sig = op_signature(node)
            if sig is not None:
                _MEASURED[sig] = int(workspace[node.name])


def forget_measured_workspaces() -> None:
    """Drop the workspaces :func:`remember_workspaces` kept: estimates follow the rules
    alone again."""
    _MEASURED.clear()


def annotate_estimated_workspace(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Estimate each op's workspace from its fake values, by op family, when nothing can
    run. The rules follow what the CPU convolution kernels (oneDNN) allocate inside the
    op: they copy activations into a blocked memory layout. A convolution's forward
    holds the larger of its input and output plus its weight; its backward holds the
    output's gradient, plus the input when the input's gradient is computed, plus, on
    channels-last activations when the weight's gradient is computed, that gradient in
    oneDNN's blocked layout with each group's channels padded to whole blocks (a
    depthwise convolution's: 1 KiB a channel and kernel tap). Every other
    op: 0, but ``_safe_softmax`` (a one-byte mask per element). On the U-Net-like CNNs
    of the tests they are within a factor 2 of the measured workspaces of 3x3
    convolutions and of every convolution's backward (1x1 and transposed forwards
    differ more); the measured ones, :func:`annotate_measured_workspace`, are the ones
    to trust. The rules are :data:`WORKSPACE_ESTIMATES` (op overload -> function of the
    node). An op whose signature (:func:`op_signature`: the op, its arguments' shapes,
    dtypes and strides) was measured earlier in the process takes that figure instead.

    Returns
    -------
    dict
        node name -> bytes; also written to ``node.meta["remat_workspace"]``.

    Examples
    --------
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> conv = lambda x, w: torch.ops.aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    >>> gm = make_fx(conv, tracing_mode="fake")(torch.ones(2, 3, 8, 8), torch.ones(4, 3, 3, 3))
    >>> annotate_estimated_workspace(gm)["convolution"] == (2 * 4 * 64 + 4 * 3 * 9) * 4  # output + weight
    True
    """
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        rule = WORKSPACE_ESTIMATES.get(node.target) if node.op == "call_function" else None
        known = _MEASURED.get(op_signature(node)) if _MEASURED and node.op == "call_function" else None
        try:
            out[node.name] = known if known is not None else int(rule(node)) if rule is not None else 0
        except Exception as exc:
            raise CaptureError(f"cannot estimate the workspace of {_where(node)}: {exc}") from exc
        node.meta["remat_workspace"] = out[node.name]
    gm.meta["remat_workspace_source"] = "estimated"
    return out


def storage_records(gm: torch.fx.GraphModule) -> Mapping[str, StorageRecord]:
    """The ``remat_storage`` records by node name (after :func:`annotate_storage`)."""
    return {n.name: n.meta["remat_storage"] for n in gm.graph.nodes if "remat_storage" in n.meta}

"""Capture one training step (forward, loss, backward) as a cost-annotated DAG.

How the step is captured, and why this path
-------------------------------------------
1. ``torch.export.export(model, ..., strict=False)`` traces the forward at ATen level
   without TorchDynamo. Non-strict export handles Hugging Face models (``use_cache=False``),
   whose mask creation defeats a direct AOTAutograd trace; it records each op's source
   line and module path (``stack_trace``, ``nn_module_stack``) and keeps in-place ops
   (``relu_``, ``add_``) visible, which lets us model their results as aliases.
   Data-dependent Python control flow fails here, with a :class:`CaptureError` that
   names the source line.
2. ``torch._functorch.aot_autograd.aot_export_joint_with_descriptors`` traces a small
   module that replays the exported graph (node by node, so that the metadata is
   carried over) and computes the loss. It returns the functionalized *joint* graph:
   forward and backward in one fx graph, with a FakeTensor in ``meta["val"]`` of every
   node, a ``partitioner_tag`` that tells forward from backward, and a descriptor of
   every input and output (parameter, buffer, user input, tangent; loss, gradient,
   mutated buffer). The same object feeds
   ``aot_compile_joint_with_descriptors(..., partition_fn=...)``, the AOTAutograd
   runtime that a rewriter uses to run a chosen forward/backward split as one autograd
   function: each compile of it copies the metadata that compiling writes into, so one
   export serves every cut.
   ``make_fx`` of a functional train step would also give a joint graph, but no
   fw/bw tags, no descriptors and no runtime to host the rewritten graphs.

Parameters built on ``torch.device("meta")`` and fake or meta inputs are traced under a
FakeTensorMode: nothing is allocated for the weights.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

from graphs import costs
from graphs.autocast import autocast_as, autocast_state, no_autocast
from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.errors import CaptureError
from graphs.hardware import Hardware, get_hardware
from graphs.torch_internals import (FakeTensorMode, aot_export_joint, custom_functions_called, detect_fake_mode,
                                     drop_python_kernels,
                                     fake_mode_of, is_fake, is_op_overload, lazy_graph_modules, op_schema, override_python_kernels,
                                     shape_guards, size_expr, size_hint, tree_flatten, tree_leaves, tree_unflatten)

__all__ = ["capture", "CaptureInfo", "default_loss", "is_random_op", "op_draws", "node_draws", "random_order",
           "graph_of_joint", "plain_state", "fake_copies"]

log = logging.getLogger(__name__)

_RANDOM_OPS = ("rand", "bernoulli", "dropout", "normal", "uniform", "randint", "randperm", "multinomial",
               "exponential", "geometric", "cauchy", "log_normal", "poisson")
#: parts of op names that a random op's name may contain but that draw nothing: gradients
#: (``native_dropout_backward``), kernels without dropout, ``poisson_nll_loss``
_NAMED_BUT_NOT_RANDOM = ("_backward", "no_dropout", "nll_loss")
_INPLACE_EXEMPT = ("copy_",)


_NOTHING_TO_DIFFERENTIATE = ("the model returned no floating point tensor to differentiate; pass loss_fn=... "
                             "that maps the model's output to a scalar loss")


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a step whose ``loss_fn`` is not given.

    The output itself when it is a scalar tensor; its ``loss`` when it is a Hugging Face
    ``ModelOutput`` or a dict that has one; else the sum of ``x.sum()`` over its
    floating point tensors.

    Examples
    --------
    >>> default_loss({"loss": torch.tensor(2.0), "logits": torch.ones(3)})
    tensor(2.)
    >>> default_loss((torch.ones(2), torch.ones(3, dtype=torch.long)))
    tensor(2.)
    """
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return output
    loss = None
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            loss = output["loss"] if "loss" in output.keys() else None
        except Exception:
            loss = getattr(output, "loss", None)
    elif hasattr(output, "loss"):
        loss = output.loss
    if isinstance(loss, torch.Tensor):
        return loss
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise CaptureError(_NOTHING_TO_DIFFERENTIATE)
    total = floats[0].sum()
    for t in floats[1:]:
        total = total + t.sum()
    return total


class _Replay(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, replace: dict):
        super().__init__(gm)
        self._replace = replace

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._replace.get(target, target)(*args, **kwargs)


class _LossStep(torch.nn.Module):
    """Replays the exported forward graph node by node, then computes the loss."""

    def __init__(self, gm: torch.fx.GraphModule, out_spec: Any, loss_fn: Callable[[Any], torch.Tensor],
                 replace: dict | None = None):
        super().__init__()
        self.gm = gm
        self._out_spec = out_spec
        self._loss_fn = loss_fn
        self._replace = dict(replace or {})

    def forward(self, *flat_inputs: Any) -> Any:
        with override_python_kernels(self._replace):
            flat_out = _Replay(self.gm, self._replace).run(*flat_inputs, enable_io_processing=False)
        if not isinstance(flat_out, (list, tuple)):
            flat_out = [flat_out]
        if self._loss_fn is None:  # backward from the outputs
            if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in flat_out):
                raise CaptureError(_NOTHING_TO_DIFFERENTIATE)
            return tuple(flat_out)
        out = tree_unflatten(list(flat_out), self._out_spec)
        loss = self._loss_fn(out)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise CaptureError(f"the loss must be a scalar tensor, got {type(loss).__name__} "
                               f"{getattr(loss, 'shape', '')}; pass loss_fn=...")
        return loss


_PLAIN = (bool, int, float, complex, str, type(None))

#: plain attributes that a trace does not bake in: the mode, and the mark that
#: ``torch.compile`` sets on the modules it compiles
_NOT_TRACED = frozenset({"training", "_is_torch_compile"})


def _plain(value: Any) -> Any:
    """``value`` when it is a plain Python constant (or a tuple or list of them, as a
    tuple), else the marker ``NotImplemented``."""
    if type(value) in _PLAIN:
        return value
    if type(value) in (tuple, list):
        items = tuple(_plain(v) for v in value)
        return NotImplemented if any(v is NotImplemented for v in items) else items
    return NotImplemented


def plain_state(model: torch.nn.Module) -> dict[str, tuple]:
    """What a trace of ``model``'s forward bakes into its graph as constants, per module
    path: the module's class and its plain attributes (numbers, strings, booleans,
    ``None`` and tuples or lists of them; ``training`` and ``torch.compile``'s mark left
    out). Tensors, parameters
    and buffers are not in it: a captured step reads them at each call.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> before = plain_state(net)
    >>> net[1] = torch.nn.GELU()
    >>> plain_state(net)["1"] == before["1"], plain_state(net)["0"] == before["0"]
    (False, True)
    """
    state = {}
    for path, module in model.named_modules(remove_duplicate=False):
        found = ((k, _plain(v)) for k, v in vars(module).items() if k not in _NOT_TRACED)
        attrs = tuple(sorted(((k, v) for k, v in found if v is not NotImplemented), key=lambda kv: kv[0]))
        state[path] = (type(module), attrs)
    return state


@dataclass
class CaptureInfo:
    """What it takes to re-run the AOTAutograd pipeline on the captured step (in memory).

    Attributes
    ----------
    step : torch.nn.Module
        The module whose forward is one step up to the loss (replays the export).
    flat_inputs : list
        Its positional inputs (the flattened user inputs, fake when the capture was).
    fake_mode : FakeTensorMode or None
        The mode that ``flat_inputs`` and the step's parameters live in, if fake.
    joint : JointWithDescriptors
        The export that produced :attr:`ComputeGraph.fx`.
    real : bool
        The inputs and parameters were real tensors.
    input_indices : list of int
        Which leaves of the flattened ``(args, kwargs)`` the step takes.
    in_spec, out_spec : pytree specs
        Of the model's ``(args, kwargs)`` and of its output.
    backward : str
        ``"loss"`` (the step ends with the loss) or ``"outputs"`` (it returns the
        model's flat outputs; backward starts from their gradients).
    autocast : tuple
        The autocast state of the capture (:func:`graphs.autocast.autocast_state`): the
        joint graph is traced under it and holds its casts.
    stitched : graphs.repeated.Stitched or None
        Set when the joint graph was written from a capture of fewer layers
        (:func:`graphs.repeated.capture_cut` with ``runnable=True``): ``joint`` is then
        that capture's export, and the step runs ``fx`` itself.
    state : dict
        :func:`plain_state` of the model when it was captured: the joint graph holds
        those values as constants.
    custom_functions : tuple of str
        The custom :class:`torch.autograd.Function`\\ s that the forward calls on the
        way to its outputs. The joint graph's backward of their ops is autograd's
        derivative of what their forward computes, not their own ``backward``: only
        the model's own forward gives their gradients (see :func:`capture`).
    """

    step: torch.nn.Module
    flat_inputs: list
    fake_mode: Any
    joint: Any
    real: bool
    input_indices: list = field(default_factory=list)
    in_spec: Any = None
    out_spec: Any = None
    backward: str = "loss"
    autocast: tuple = ()
    stitched: Any = None
    custom_functions: tuple = ()
    state: dict = field(default_factory=dict)


def _export_joint(stack: contextlib.ExitStack, step: torch.nn.Module, flat_inputs: list, fake_mode: Any,
                  amp: tuple = ()) -> Any:
    """AOTAutograd's joint forward+backward export of ``step``, inside ``stack``."""
    stack.enter_context(fx_traceback.preserve_node_meta())
    stack.enter_context(lazy_graph_modules())  # the joint's code is generated only if it is run or read
    stack.enter_context(autocast_as(amp))  # the joint graph then holds autocast's casts
    if fake_mode is not None:
        stack.enter_context(fake_mode)
    stack.enter_context(_native_upsampling())
    return aot_export_joint(stack, step, tuple(flat_inputs))


def _user_frame(exc: BaseException) -> str:
    """The innermost stack frame outside torch/transformers: ``file:line: code``."""
    frames = traceback.extract_tb(exc.__traceback__)
    best = ""
    for fr in frames:
        fn = fr.filename.replace("\\", "/")
        if "/torch/" in fn or "/transformers/" in fn or "/graphs/capture" in fn or fn.startswith("<"):
            continue
        best = f"{fr.filename}:{fr.lineno}: {(fr.line or '').strip()}"
    return best


def _data_dependent(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    text = " ".join(str(e) for e in _chain(exc))
    return bool(
        names & {"DataDependentOutputException", "GuardOnDataDependentSymNode", "UserError",
                 "DynamicOutputShapeException"}
        or "data-dependent" in text.lower() or "data dependent" in text.lower()
    )


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


@contextlib.contextmanager
def _native_upsampling():
    """Trace the upsampling ops as themselves, not as index gathers and scatters.

    PyTorch registers Python decompositions for ``upsample_*`` at the Autograd key, for
    compilers: under tracing, the forward becomes ``_unsafe_index`` and the backward
    ``_unsafe_index_put`` with accumulation. The step that graph mode runs executes the
    captured ops one by one, and there those are several times slower than the native
    kernels (a U-Net's nearest-neighbour upsampling: 56 ms against 7.5 ms per step), so
    for the length of the trace the native kernels and their autograd formulas are used.
    """
    ops = []
    for name in dir(torch.ops.aten):
        if "upsample" not in name or name.endswith("_backward"):
            continue
        packet = getattr(torch.ops.aten, name)
        ops.extend(getattr(packet, overload) for overload in packet.overloads())
    with drop_python_kernels(ops):
        yield


def _capture_error(exc: BaseException, stage: str) -> CaptureError:
    where = ""
    for e in _chain(exc):
        where = _user_frame(e) or where
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _data_dependent(exc):
        msg = (f"the model's Python control flow depends on tensor values"
               f"{' at ' + where if where else ''} ({type(exc).__name__}: {first}). A graph of the "
               "training step cannot branch on data: express the branch with torch.cond / "
               "torch.where, move it out of forward, or plan at module level (mode='module') "
               "instead of capturing the graph.")
    else:
        msg = (f"{stage} failed{' at ' + where if where else ''}: {type(exc).__name__}: {first}. "
               "Check that the model runs on the example inputs; for Hugging Face models build "
               "them with use_cache=False.")
    return CaptureError(msg)


def _is_fake_or_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (is_fake(t) or t.device.type == "meta")


def fake_copies(model: torch.nn.Module, flat_inputs: list, fake_mode: Any) -> tuple[torch.nn.Module, list]:
    """A copy of ``model`` whose parameters and buffers are fake tensors of ``fake_mode``,
    and fake copies of the tensors among ``flat_inputs`` (nothing allocated).

    Meta tensors become fake CPU tensors: ops on the meta device take other kernels
    (some without autograd), while fake tensors trace the real CPU kernels.

    Examples
    --------
    >>> from graphs.torch_internals import FakeTensorMode, is_fake
    >>> net, x = torch.nn.Linear(2, 3), torch.ones(4, 2)
    >>> fake_net, (fake_x, n) = fake_copies(net, [x, 7], FakeTensorMode())
    >>> is_fake(fake_net.weight), is_fake(net.weight), tuple(fake_x.shape), n
    (True, False, (4, 2), 7)
    """
    import copy

    def fake(t: torch.Tensor) -> torch.Tensor:
        if fake_mode_of(t) is fake_mode and t.device.type != "meta":
            return t
        device = "cpu" if t.device.type == "meta" else t.device
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    memo: dict[int, Any] = {}
    for p in list(model.parameters()) + list(model.buffers()):
        if id(p) not in memo:
            if isinstance(p, torch.nn.Parameter):
                memo[id(p)] = torch.nn.Parameter(fake(p.detach()), requires_grad=p.requires_grad)
            else:
                memo[id(p)] = fake(p)
    fake_model = copy.deepcopy(model, memo=memo)
    return fake_model, [fake(t) if isinstance(t, torch.Tensor) else t for t in flat_inputs]


def _mark_inplace(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and is_op_overload(target):
            returns = op_schema(target).returns
            if (returns and returns[0].alias_info is not None
                    and returns[0].alias_info.is_write
                    and target.overloadpacket.__name__ not in _INPLACE_EXEMPT):
                custom = dict(node.meta.get("custom") or {})
                custom["remat_inplace"] = True
                node.meta["custom"] = custom


def _readable_name(node: torch.fx.Node) -> str:
    """``module.path:aten.op @ file:line`` from the node's metadata."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    path = ""
    if stack:
        last = list(stack.values())[-1]
        path = last[0] if isinstance(last, tuple) else str(last)
    src = costs.source_line(node)
    text = f"{path}:{_op_name(node)}" if path else _op_name(node)
    return text + (f" @ {src}" if src else "")


def _module_path(node: torch.fx.Node) -> str:
    """The innermost module that ran the op (``""`` for the top level)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) else str(last)
    return _clean_path(path)


def _clean_path(path: str) -> str:
    # export spells ModuleList items as "layers.0" or "layers[0]" / "L['self'].layers[0]"
    import re

    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    return path.strip(".")


def _op_name(node: torch.fx.Node) -> str:
    if node.target is operator.getitem:
        return f"getitem[{node.args[1]}]"
    if is_op_overload(node.target):
        return str(node.target)
    return str(node.target) if node.op == "call_function" else node.op


def is_random_op(node: torch.fx.Node) -> bool:
    """Does ``node`` draw from a random generator (dropout's ``bernoulli``, ``rand``...)?

    Examples
    --------
    >>> g = torch.fx.Graph(); x = g.placeholder("x")
    >>> is_random_op(g.call_function(torch.ops.aten.bernoulli.p, (x, 0.9)))
    True
    >>> is_random_op(g.call_function(torch.ops.aten.relu.default, (x,)))
    False
    """
    return is_op_overload(node.target) and _seeded(node.target)


@functools.lru_cache(maxsize=None)
def _seeded(op: Any) -> bool:
    """An op overload tagged as drawing from a generator, or named as a random op (not
    a gradient such as ``native_dropout_backward``, which reads the forward's mask).
    Asked for every node of every graph that capture and rewrite walk: kept per op."""
    if torch.Tag.nondeterministic_seeded in op.tags:
        return True
    name = op.overloadpacket.__name__
    return any(r in name for r in _RANDOM_OPS) and not any(w in name for w in _NAMED_BUT_NOT_RANDOM)


@functools.lru_cache(maxsize=None)
def _argument_names(op: Any) -> tuple[str, ...]:
    return tuple(a.name for a in op_schema(op).arguments)


def op_draws(op: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Does this call of ``op`` draw from a random generator: a random op
    (:func:`is_random_op`'s rule), or an op called with a ``dropout_p`` above zero (the
    fused attention kernels of CUDA, which draw their dropout inside)?

    Examples
    --------
    >>> op_draws(torch.ops.aten.native_dropout.default), op_draws(torch.ops.aten.mm.default)
    (True, False)
    >>> sdpa = torch.ops.aten._scaled_dot_product_efficient_attention.default
    >>> q = torch.empty(0)
    >>> op_draws(sdpa, (q, q, q, None, False, 0.1)), op_draws(sdpa, (q, q, q, None, False), {"dropout_p": 0.0})
    (True, False)
    """
    if not is_op_overload(op):
        return False
    names = _argument_names(op)
    if "dropout_p" in names:  # tagged as seeded, but drawing only with a dropout
        i = names.index("dropout_p")
        return bool((kwargs or {}).get("dropout_p", args[i] if i < len(args) else 0.0))
    return _seeded(op)


def node_draws(node: torch.fx.Node) -> bool:
    """Does this call in an fx graph draw from a random generator (:func:`op_draws` on
    its target and arguments)? A fused attention with ``dropout_p=0`` does not, though
    its op is tagged as seeded.

    Examples
    --------
    >>> g = torch.fx.Graph(); q = g.placeholder("q")
    >>> sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    >>> node_draws(g.call_function(sdpa, (q, q, q, 0.0, True))), node_draws(g.call_function(sdpa, (q, q, q, 0.1)))
    (False, True)
    >>> node_draws(g.call_function(torch.ops.aten.native_dropout.default, (q, 0.1, True)))
    True
    """
    return node.op == "call_function" and op_draws(node.target, tuple(node.args), dict(node.kwargs))


def random_order(cg: ComputeGraph, order: list) -> list:
    """The random ops of ``cg`` in ``order``, for ``cg.meta["ordered"]``: the nodes
    that are not recomputable because they draw, the tangents and the start of the
    backward left out. The projections of a random multi-output op (``native_dropout``'s
    output and mask, a fused attention's outputs) are all listed, in group order, so the
    op's first run is the run of its first projection and comes where eager draws it.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v, r in [("a", True), ("d0", False), ("d1", False), ("b", False)]: g.add_node(v, recomputable=r)
    >>> random_order(g, ["a", "d0", "d1", "b"])
    ['d0', 'd1', 'b']
    """
    return [n for n in order if n in cg.nx and cg[n]["op"] not in ("tangent", BACKWARD_START)
            and not cg[n]["recomputable"]]


def capture(
    model: torch.nn.Module,
    example_inputs: tuple | dict,
    *,
    example_kwargs: dict | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: str = "loss",
    inplace: str = "alias",
    hardware: str | Hardware | None = None,
    measure_time: bool | None = None,
    measure_workspace: bool | None = None,
    repeats: int = 5,
    name: str | None = None,
    symbolic_sizes: Mapping[int, Sequence[int]] | None = None,
) -> ComputeGraph:
    """Capture one training step of ``model`` as a cost-annotated :class:`ComputeGraph`.

    Parameters
    ----------
    model : torch.nn.Module
        In training mode for a training step. Its parameters may be real, fake or meta
        tensors (``with torch.device("meta"): model = ...`` plans without allocating).
    example_inputs : tuple or dict
        Positional arguments, or keyword arguments, of ``model``.
    example_kwargs : dict, optional
        Keyword arguments that follow positional ``example_inputs``, as in
        ``model(ids, labels=labels)``.
    loss_fn : callable, optional
        Maps the model's output to a scalar loss; default :func:`default_loss`.
    backward : {"loss", "outputs"}
        ``"loss"``: the step ends with the loss and backward starts from it.
        ``"outputs"``: the step returns the model's outputs and backward starts from
        their gradients (tangent inputs), as when the loss is computed outside the
        model; this is the graph that :mod:`graphs.graph_mode` runs.
    inplace : {"alias", "functional"}
        ``"alias"``: an op that was in-place in the model (``relu_``, ``add_``) shares
        its input's storage, as in eager execution. ``"functional"``: it writes a new
        tensor, as in the functionalized graphs that :mod:`graphs.graph_mode` runs.
    hardware : str or Hardware, optional
        Spec for roofline times when inputs are fake/meta (default ``"cpu"`` for CPU
        tensors, ``"h100-pcie5"`` otherwise).
    measure_time : bool, optional
        Time every op on the real device (fastest of ``repeats`` after a warm-up run of
        the graph).
        Default: when the inputs and parameters are real tensors.
    measure_workspace : bool, optional
        Measure op workspaces (what an op allocates beyond its outputs) by one run of
        the graph under the allocator's judge. Default: when the tensors are real;
        otherwise, and with ``False``, they are estimated per op family
        (``cg.meta["workspace_source"]``). Both measurements run the graph in its own
        order, which holds everything the backward reads: the store-all peak.
        :func:`graphs.measured.measure_in_schedule` measures both by running a schedule
        instead.
    repeats : int
        Timed runs per op when measuring.
    name : str, optional
        Graph name; default the model's class name.
    symbolic_sizes : mapping, optional
        ``{i: dims}``: dimensions of the ``i``-th tensor of ``(args, kwargs)`` traced as
        symbolic sizes; the joint graph then runs at any sizes there, and
        :mod:`graphs.symbolic` sizes the DAG. A dimension the forward ties to a
        constant stays static. Real inputs, nothing measured.

    Returns
    -------
    ComputeGraph
        Node ids are the fx joint graph's node names. Extra attributes (in memory only):
        ``cg.fx`` (the joint :class:`torch.fx.GraphModule`) and ``cg.capture_info``
        (a :class:`CaptureInfo`).

    Raises
    ------
    CaptureError
        The step cannot be traced as one graph (e.g. Python control flow on tensor
        values); the message names the source line and what to do.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> cg = capture(net, (torch.randn(2, 4),), measure_time=False)
    >>> sorted({cg[n]["phase"] for n in cg.ops})
    ['backward', 'forward']
    >>> cg.saved_bytes() > 0 and cg.total("flops") > 0
    True
    """
    args, kwargs = _call_arguments(model, example_inputs, example_kwargs)
    loss_fn = loss_fn or default_loss
    inputs = _step_inputs(model, args, kwargs, measure_time=measure_time, measure_workspace=measure_workspace)
    fwd = _trace_forward(model, inputs, inplace=inplace, symbolic_sizes=symbolic_sizes)
    if backward not in ("loss", "outputs"):
        raise ValueError(f"backward must be 'loss' or 'outputs', got {backward!r}")
    step = _LossStep(fwd.module, fwd.out_spec, loss_fn if backward == "loss" else None, replace=_eager_semantics(
        [t for t in fwd.flat_in if isinstance(t, torch.Tensor)] + list(fwd.work_model.parameters())))
    joint, gm = _trace_joint(step, fwd)
    guards = shape_guards(fwd.fake_mode) if fwd.sizes else []  # what the trace assumed of symbolic sizes
    if fwd.sizes:
        _sizes_from_inputs(gm)
    hw, storage, placeholders = _annotate_costs(gm, step, inputs, fwd, hardware=hardware, repeats=repeats)

    cg = _build(gm, storage, name=name or type(model).__name__, shared=_shared_sources(placeholders, step))
    _keep_sizes(cg, fwd, guards)
    cg.meta.update({
        "captured_with": "torch.export(strict=False) + aot_export_joint_with_descriptors",
        "time_source": "measured" if inputs.measure_time else f"roofline:{hw.name}",
        "torch": torch.__version__,
        "autocast": [f"{device}:{dtype}".replace("torch.", "") for device, dtype in fwd.amp],
    })
    names = tuple(f.__qualname__ for f in fwd.functions)
    if names:
        cg.meta["custom_functions"] = list(names)
        log.info("the forward calls custom autograd Functions %s: the captured backward differentiates their "
                 "forward's ops", ", ".join(names))
    cg.fx = gm
    cg.capture_info = CaptureInfo(step=step, flat_inputs=fwd.user_flat, fake_mode=fwd.fake_mode, joint=joint,
                                  real=inputs.real, input_indices=fwd.input_indices, in_spec=fwd.in_spec,
                                  out_spec=fwd.out_spec, backward=backward, autocast=fwd.amp,
                                  custom_functions=names, state=plain_state(model))
    return cg


def _call_arguments(model: torch.nn.Module, example_inputs: Any, example_kwargs: dict | None) -> tuple[tuple, dict]:
    """:func:`capture`'s first phase: the model's call as ``(args, kwargs)``, the
    keywords of ``example_kwargs`` after those of ``example_inputs``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    if example_kwargs:
        overlap = sorted(set(kwargs) & set(example_kwargs))
        if overlap:
            raise CaptureError(f"the keyword argument {overlap[0]!r} is given twice (in example_inputs "
                               "and in example_kwargs)")
        kwargs.update(example_kwargs)
    return args, kwargs


@dataclass
class _StepInputs:
    """What :func:`capture` runs on: the call, its tensors and the model's, whether all
    are real, and what is measured on them."""

    args: tuple
    kwargs: dict
    tensors: list
    state: list
    real: bool
    measure_time: bool
    measure_workspace: bool


def _step_inputs(model: torch.nn.Module, args: tuple, kwargs: dict, *, measure_time: bool | None,
                 measure_workspace: bool | None) -> _StepInputs:
    """:func:`capture`'s second phase: are the tensors real, and what is measured (by
    default what real tensors allow; a measurement asked of fake tensors is refused)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    state = [t for t in list(model.parameters()) + list(model.buffers())]
    real = not any(_is_fake_or_meta(t) for t in tensors + state)
    if measure_time is None:
        measure_time = real
    if measure_time and not real:
        raise CaptureError("measure_time=True needs real parameters and inputs; "
                           "the model or inputs are fake/meta (use measure_time=False for roofline times)")
    if measure_workspace is None:
        measure_workspace = real
    if measure_workspace and not real:
        raise CaptureError("measure_workspace=True needs real parameters and inputs; the model or inputs are "
                           "fake/meta (use measure_workspace=False for estimated workspaces)")
    return _StepInputs(args, kwargs, tensors, state, real, measure_time, measure_workspace)


@dataclass
class _Forward:
    """The forward traced at ATen level (:func:`_trace_forward`)."""

    export: Any  # the ExportedProgram, alive as long as the capture runs
    module: torch.fx.GraphModule  # the export's module
    work_model: torch.nn.Module  # the model traced (a fake copy for fake inputs)
    fake_mode: Any
    amp: tuple  # the autocast state of the trace
    flat_in: list  # the flattened (args, kwargs)
    in_spec: Any
    out_spec: Any
    functions: list  # the custom autograd Functions that the forward calls
    input_indices: list  # which of ``flat_in`` the export takes
    user_flat: list  # those inputs
    traced_flat: list | None = None  # what the joint is traced on, where not ``user_flat`` (symbolic sizes)
    sizes: dict = field(default_factory=dict)  # (i, dim) -> the sympy expression of a symbolic size


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, flat: list,
                    symbolic_sizes: Mapping[int, Sequence[int]]) -> Any:
    """``torch.export``'s ``dynamic_shapes`` for the call: the dimensions named by
    :func:`capture`'s ``symbolic_sizes`` marked ``Dim.AUTO`` (export ties the sizes that
    must be equal), per argument of the forward's signature."""
    import inspect

    marked = {id(flat[i]): {d: torch.export.Dim.AUTO for d in dims} for i, dims in symbolic_sizes.items()}
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments

    def spec(value: Any) -> Any:
        leaves, tree = tree_flatten(value)
        return tree_unflatten([marked.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves], tree)

    return {name: spec(value) for name, value in bound.items()}


def _trace_forward(model: torch.nn.Module, inputs: _StepInputs, *, inplace: str,
                   symbolic_sizes: Mapping[int, Sequence[int]] | None = None) -> _Forward:
    """:func:`capture`'s third phase: the forward at ATen level, with source lines (and
    the custom autograd Functions that the trace inlines: it keeps their forward's ops,
    whose derivative the joint takes), in fake tensors when the inputs are not real."""
    fake_mode = None
    work_model = model
    amp = autocast_state()
    flat_in, in_spec = tree_flatten((inputs.args, inputs.kwargs))
    if not inputs.real:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        work_model, flat_in = fake_copies(model, flat_in, fake_mode)
    eargs, ekwargs = tree_unflatten(flat_in, in_spec)

    functions: list = []
    options = {}
    if symbolic_sizes:
        if not inputs.real or inputs.measure_time or inputs.measure_workspace:
            raise CaptureError("symbolic_sizes needs real inputs and measure_time=False, measure_workspace=False")
        options["dynamic_shapes"] = _dynamic_shapes(work_model, eargs, ekwargs, flat_in, symbolic_sizes)
    try:
        # (the graph modules made on the way generate their code only if run or read)
        with lazy_graph_modules(), fake_mode if fake_mode is not None else contextlib.nullcontext(), \
                custom_functions_called(work_model, functions):
            ep = torch.export.export(work_model, eargs, ekwargs, strict=False, **options)
    except CaptureError:
        raise
    except Exception as exc:
        raise _capture_error(exc, "tracing the forward (torch.export, non-strict)") from exc
    if torch.utils.checkpoint.CheckpointFunction in functions:
        raise CaptureError("the model calls torch.utils.checkpoint.checkpoint with use_reentrant=True, whose forward "
                           "runs without autograd, so its backward cannot be traced; pass use_reentrant=False (or "
                           "remove the checkpoint: optimize chooses what to recompute; mode='module' needs the same "
                           "trace)")
    fwd = ep.module()
    if inplace == "alias":
        _mark_inplace(fwd)
    elif inplace != "functional":
        raise ValueError(f"inplace must be 'alias' or 'functional', got {inplace!r}")
    input_indices = list(range(len(flat_in)))
    fwd_inputs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    if len(fwd_inputs) != len(input_indices):  # non-tensor leaves that export folded away
        input_indices = [i for i, t in enumerate(flat_in)
                         if isinstance(t, (torch.Tensor, int, float, bool))][: len(fwd_inputs)]
    user_flat = [flat_in[i] for i in input_indices]
    traced, sizes = None, {}
    if symbolic_sizes:
        traced, sizes = _symbolic_inputs(fwd_inputs, input_indices, symbolic_sizes)
        fake_mode = detect_fake_mode(traced)
        ranges = {e: (r.lower, r.upper) for e, r in ep.range_constraints.items()}
        sizes = {k: (e, ranges.get(e)) for k, e in sizes.items()}
    return _Forward(export=ep, module=fwd, work_model=work_model, fake_mode=fake_mode, amp=amp, flat_in=flat_in,
                    in_spec=in_spec, out_spec=ep.call_spec.out_spec, functions=functions,
                    input_indices=input_indices, user_flat=user_flat, traced_flat=traced, sizes=sizes)


def _keep_sizes(cg: ComputeGraph, fwd: _Forward, guards: list) -> None:
    """Write onto ``cg`` the traced inputs' shapes and, for a capture with symbolic
    sizes, the sizes' expressions and ranges and the trace's conditions on them
    (:mod:`graphs.symbolic` reads them)."""
    # the traced inputs' shapes (in the order of ``capture_info.input_indices``)
    cg.meta["input_shapes"] = [list(t.shape) if isinstance(t, torch.Tensor) else None for t in fwd.user_flat]
    cg.sizes = fwd.sizes  # (i, dim) -> (expression, (least, most))
    cg.size_guards = guards
    if fwd.sizes:
        cg.meta["symbolic_sizes"] = {f"{i}:{d}": str(e) for (i, d), (e, _) in fwd.sizes.items()}


def _sizes_from_inputs(gm: torch.fx.GraphModule) -> None:
    """Read every symbolic size off the step's inputs, which live through the whole
    step, rather than off an intermediate: a size the backward reads from a forward
    activation (``sym_size(view, 0)``) would keep that activation, or its base, alive
    into the backward only to be measured. Each ``sym_size`` node of an intermediate
    whose size is a sum of products of the inputs' size symbols and integers is
    rewritten as that expression of the inputs' ``sym_size``; others are left."""
    import sympy

    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first is None:
        return
    symbols: dict = {}  # symbol -> (placeholder, dim)
    for p in placeholders:
        val = p.meta.get("val")
        for d, n in enumerate(getattr(val, "shape", ())):
            e = size_expr(n)
            if isinstance(e, sympy.Symbol) and e not in symbols:
                symbols[e] = (p, d)
    read: dict = {}  # symbol -> its sym_size node of the input, made once at the top

    def emit(expr: Any, meta: dict) -> Any:
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in read:
                p, d = symbols[expr]
                with graph.inserting_before(first):
                    node = graph.call_function(torch.ops.aten.sym_size.int, (p, d))
                node.meta = {"val": p.meta["val"].shape[d]}
                read[expr] = node
            return read[expr]
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            parts = [emit(a, meta) for a in expr.args]
            out = parts[0]
            for part in parts[1:]:
                out = graph.call_function(operator.add if isinstance(expr, sympy.Add) else operator.mul, (out, part))
                out.meta = dict(meta)
            return out
        raise ValueError(expr)

    def readable(expr: Any) -> bool:
        if isinstance(expr, sympy.Integer):
            return True
        if isinstance(expr, sympy.Symbol):
            return expr in symbols
        return isinstance(expr, (sympy.Add, sympy.Mul)) and all(readable(a) for a in expr.args)

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.sym_size.int:
            continue
        source = node.args[0]
        expr = size_expr(node.meta.get("val"))
        if source.op == "placeholder" or expr is None or not readable(expr):
            continue
        with graph.inserting_before(node):
            new = emit(expr, node.meta)
        if isinstance(new, torch.fx.Node):
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _symbolic_inputs(placeholders: list, input_indices: list, symbolic_sizes: Mapping[int, Sequence[int]]
                     ) -> tuple[list, dict]:
    """The export's fake inputs, whose sizes are symbolic where asked, and each asked
    dimension's expression. A dimension the forward ties to a constant (a model width,
    a size of 1) stays static; a :class:`CaptureError` where none of them stays symbolic."""
    traced = [n.meta.get("val") for n in placeholders]
    sizes, static = {}, []
    for i, dims in symbolic_sizes.items():
        if i not in input_indices:
            raise CaptureError(f"symbolic_sizes names input {i}, which the traced forward does not take")
        val = traced[input_indices.index(i)]
        for d in dims:
            expr = size_expr(val.shape[d])
            if expr is None or expr.is_number:  # specialized by the trace
                static.append(f"size {d} of input {i} ({int(val.shape[d])})")
            else:
                sizes[(i, d)] = expr
    if not sizes:
        raise CaptureError(f"no size can stay symbolic: the forward specializes {', '.join(static)}")
    return traced, sizes


def _trace_joint(step: torch.nn.Module, fwd: _Forward) -> tuple[Any, torch.fx.GraphModule]:
    """:func:`capture`'s fourth phase: the joint forward+backward export of ``step``, and
    its graph."""
    try:
        with contextlib.ExitStack() as stack:
            joint = _export_joint(stack, step, fwd.traced_flat if fwd.traced_flat is not None else fwd.user_flat,
                                  fwd.fake_mode, fwd.amp)
            gm = joint.graph_module
    except CaptureError:
        raise
    except Exception as exc:
        raise _capture_error(exc, "tracing the backward (AOTAutograd joint export)") from exc
    return joint, gm


def _annotate_costs(gm: torch.fx.GraphModule, step: torch.nn.Module, inputs: _StepInputs, fwd: _Forward, *,
                    hardware: str | Hardware | None, repeats: int) -> tuple[Hardware, dict, list]:
    """:func:`capture`'s fifth phase: every node's storage, FLOPs, time and workspace,
    measured on the real tensors or estimated for ``hardware``; returns the hardware,
    the storages and the joint's placeholders."""
    tensors, state = inputs.tensors, inputs.state
    hw = get_hardware(hardware) if hardware is not None else get_hardware(
        "cpu" if all(t.device.type == "cpu" for t in tensors + state if not _is_fake_or_meta(t))
        and any(t.device.type == "cpu" for t in tensors + state) else "h100-pcie5")
    storage = costs.annotate_storage(gm)
    costs.annotate_flops(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not inputs.measure_time:
        costs.annotate_roofline_time(gm, hw)
    if inputs.measure_time or inputs.measure_workspace:
        values = real_placeholder_values(placeholders, step, fwd.user_flat)
        cuda = sorted({t.device.index or 0 for t in tensors + state if t.device.type == "cuda"})
        # timing and measuring run the random ops too: the generators end as they were
        with no_autocast(), torch.random.fork_rng(devices=cuda):
            if inputs.measure_time:
                costs.annotate_measured_time(gm, values, repeats=repeats)
            if inputs.measure_workspace:
                costs.annotate_measured_workspace(gm, values)
    if not inputs.measure_workspace:
        costs.annotate_estimated_workspace(gm)
    return hw, storage, placeholders


def graph_of_joint(gm: torch.fx.GraphModule, *, name: str, state: torch.nn.Module, meta: dict) -> ComputeGraph:
    """The :class:`ComputeGraph` of a joint graph whose nodes carry their costs in their
    metadata already (a joint written from a capture's, :mod:`graphs.repeated`):
    storages are read again, the rest as the nodes say.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The joint graph.
    name : str
    state : torch.nn.Module
        Holds the parameters and buffers that the inputs' descriptors name (tied
        weights are found by identity there).
    meta : dict
        Graph metadata to carry (``time_source``, ``workspace_source``, ...).

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> cg = capture(net, (torch.randn(2, 4),), backward="outputs", measure_time=False)
    >>> again = graph_of_joint(cg.fx, name="net", state=cg.capture_info.step, meta={})
    >>> (len(again), again.order) == (len(cg), cg.order)
    True
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cg = _build(gm, costs.annotate_storage(gm), name=name, shared=_shared_sources(placeholders, state))
    cg.meta.update(meta)
    cg.fx = gm
    return cg


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from outermost to innermost in memory, when ``t`` is dense and
    not contiguous (``empty_like`` then keeps its strides); None otherwise."""
    if t.is_contiguous():
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    expected = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return None  # gaps or overlaps: empty_like makes a contiguous tensor
        expected *= t.shape[d]
    return order


def _eager_noise(input: torch.Tensor, keep: float) -> torch.Tensor:
    """``torch.empty_like(input).bernoulli_(keep)``, as a traced graph draws it.

    Eager fills the noise in the memory order of ``input``'s strides. In the graph the
    in-place draw becomes the out-of-place ``bernoulli``, which fills a contiguous
    tensor: for a permuted input (a transposed attention output) the same draws would
    land on other elements. So the noise is drawn contiguous in memory order and
    permuted back.
    """
    order = _memory_order(input)
    if order is None:
        return torch.empty_like(input).bernoulli_(keep)
    noise = torch.empty([input.shape[d] for d in order], dtype=input.dtype, device=input.device).bernoulli_(keep)
    return noise.permute([order.index(d) for d in range(input.dim())])


def _eager_cpu_dropout(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    # what eager dropout does on CPU: a float noise tensor, scaled, then multiplied
    if not train or p == 0:
        return input
    if p == 1:
        return input * torch.zeros_like(input)
    noise = _eager_noise(input, 1 - p).div_(1 - p)
    return input * noise


def _eager_semantics(tensors: list) -> dict:
    """Op replacements that make the graph do what eager does on the model's device.

    On CPU eager dropout saves a float noise tensor (``native_dropout``, with its
    boolean mask, is the CUDA kernel): the graph follows eager so that its bytes are
    what a real step holds.
    """
    devices = {t.device.type for t in tensors if t.device.type != "meta"}
    if devices == {"cpu"}:
        return {torch.ops.aten.dropout.default: _eager_cpu_dropout}
    return {}


def real_placeholder_values(placeholders: list, step: torch.nn.Module, user_flat: list) -> list:
    """Real values for the joint graph's placeholders: the step's parameters (detached),
    copies of its buffers, the user's inputs, and ones for the output gradients."""
    params = dict(step.named_parameters(remove_duplicate=False))
    buffers = dict(step.named_buffers())
    values = []
    for node in placeholders:
        desc = node.meta.get("desc")
        cls = type(desc).__name__
        if cls == "ParamAOTInput":
            values.append(params[desc.target].detach())
        elif cls == "BufferAOTInput":
            values.append(buffers[desc.target].detach().clone())
        elif cls == "PlainAOTInput":
            values.append(user_flat[desc.idx])
        else:  # tangents and anything else: a tensor like the fake value (at the traced sizes)
            val = node.meta["val"]
            values.append(torch.ones([size_hint(n) for n in val.shape], dtype=val.dtype, device=val.device))
    return values


def _source_kind(node: torch.fx.Node) -> str:
    cls = type(node.meta.get("desc")).__name__
    if cls == "ParamAOTInput":
        return "param"
    if cls == "BufferAOTInput":
        return "buffer"
    return "input"


def _source_name(node: torch.fx.Node) -> str:
    desc = node.meta.get("desc")
    target = getattr(desc, "target", None)
    if isinstance(target, str):
        return target[3:] if target.startswith("gm.") else target
    return str(desc) if desc is not None else node.name


def _shared_sources(placeholders: list, step: torch.nn.Module) -> dict[str, str]:
    """Placeholders that are the same tensor as an earlier one (tied weights)."""
    state = dict(step.named_parameters(remove_duplicate=False))
    state.update(dict(step.named_buffers(remove_duplicate=False)))
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for node in placeholders:
        target = getattr(node.meta.get("desc"), "target", None)
        if isinstance(target, str) and target in state:
            key = id(state[target])
            if key in first:
                shared[node.name] = first[key]
            else:
                first[key] = node.name
    return shared


def _build(gm: torch.fx.GraphModule, storage: dict, *, name: str, shared: dict[str, str]) -> ComputeGraph:
    cg = ComputeGraph(name=name)
    base_of = {n.name: rec.base for n, rec in storage.items()}
    order: list[str] = []
    tangents: list[str] = []
    sized: dict[str, Any] = {}  # bytes and FLOPs as expressions of symbolic sizes (graphs.symbolic)
    sized_flops: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output" or _is_size_node(node):
            # (a symbolic size is an int the rewrite computes where it is read, from the
            # step's inputs: not a value of the DAG)
            continue
        rec = storage[node]
        phase = "backward" if node.meta.get("partitioner_tag") == "is_backward" else "forward"
        if rec.bytes and node.meta.get("remat_bytes_expr") is not None:
            sized[node.name] = node.meta["remat_bytes_expr"]
        if node.meta.get("remat_flops_expr") is not None:
            sized_flops[node.name] = node.meta["remat_flops_expr"]
        if node.op == "placeholder" and phase == "backward":
            # a tangent arrives when the forward is done: an op that reads the forward
            # outputs, computed once, live from then on
            cg.add_node(node.name, kind="op", phase="backward", op="tangent", bytes=rec.bytes,
                        recomputable=False, name=f"gradient of the output ({node.name})")
            tangents.append(node.name)
            order.append(node.name)
            continue
        if node.op == "placeholder":
            cg.add_node(node.name, kind=_source_kind(node), phase=phase, op=_source_kind(node),
                        bytes=0 if node.name in shared else rec.bytes, name=_source_name(node),
                        alias_of=shared.get(node.name))
            continue
        cg.add_node(
            node.name,
            kind="op",
            phase=phase,
            op=_op_name(node),
            bytes=rec.bytes,
            flops=int(node.meta.get("remat_flops", 0)),
            time=float(node.meta.get("remat_time", 0.0)),
            workspace=int(node.meta.get("remat_workspace", 0)),
            recomputable=not node_draws(node),
            name=_readable_name(node),
            alias_of=rec.base if rec.alias else None,
            source=costs.source_line(node),
            module=_module_path(node),
            autograd_node=node.meta.get("seq_nr"),
        )
        order.append(node.name)
        for u in node.all_input_nodes:
            if _is_size_node(u):
                continue
            cg.add_edge(u.name, node.name)
            b = base_of.get(u.name, u.name)
            if b != u.name:
                cg.add_edge(b, node.name)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for v in tree_leaves(out_node.args):
        if isinstance(v, torch.fx.Node):
            for n in {v.name, base_of.get(v.name, v.name)}:
                if cg[n]["kind"] == "op":
                    cg[n]["output"] = True
    # which output each tangent is the gradient of (descriptors of AOTAutograd's joint)
    out_args = list(out_node.args[0]) if out_node.args and isinstance(out_node.args[0], (list, tuple)) else []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in tangents:
            idx = getattr(getattr(node.meta.get("desc"), "output", None), "idx", None)
            if isinstance(idx, int) and idx < len(out_args) and isinstance(out_args[idx], torch.fx.Node):
                cg[node.name]["grad_of"] = base_of.get(out_args[idx].name, out_args[idx].name)
    forward_outputs = [n for n in order if cg[n]["output"] and cg[n]["phase"] == "forward"]
    for t in tangents:
        for n in forward_outputs:
            cg.add_edge(n, t)
    # in the reference order the tangents come right after the last forward output
    rest = [n for n in order if n not in set(tangents)]
    cut = max((i + 1 for i, n in enumerate(rest) if n in set(forward_outputs)), default=0)
    start = _add_backward_start(cg, tangents)
    order[:] = rest[:cut] + tangents + ([start] if start else []) + rest[cut:]
    _fold_multi_output_ops(cg, gm)
    # random ops draw from one generator: a schedule must keep their relative order to
    # draw the same numbers as eager (checked by the simulator; not a data edge, which
    # would tie distant blocks together)
    cg.meta["ordered"] = random_order(cg, order)
    # the forward hands its outputs to the caller, who holds them until the step ends: a
    # copy made again later would not free that one (a schedule that freed the logits
    # after the loss and computed them again at the end was predicted 512 KiB below the
    # allocator's peak of its step), so none is made
    for n in forward_outputs:
        if n in cg.nx:
            cg[n]["recomputable"] = False
    cg.order = [n for n in order if n in cg.nx]
    # op workspaces: "measured" (real tensors: one profiled run of the graph) or
    # "estimated" (per op family, fake or meta tensors)
    cg.meta["workspace_source"] = gm.meta.get("remat_workspace_source", "none")
    cg.sized_bytes = {v: e for v, e in sized.items() if v in cg.nx and cg[v]["bytes"]}
    cg.sized_flops = dict(sized_flops)  # a multi-output op's too: its projections share its FLOPs
    return cg


def _is_size_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a symbolic size (a graph captured with symbolic sizes)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _add_backward_start(cg: ComputeGraph, tangents: list[str]) -> str | None:
    """Every output gradient arrives when the backward starts, all at once, and stays
    until its last use. A zero-byte op that reads every tangent and that every first
    backward op reads makes schedules say so: no backward op runs before all tangents,
    so no schedule can count a gradient as arriving later than it does."""
    if not tangents:
        return None
    cg.add_node(BACKWARD_START, kind="op", phase="backward", op=BACKWARD_START, bytes=0, time=0.0,
                recomputable=False, name="the backward starts: every output gradient has arrived")
    for t in tangents:
        cg.add_edge(t, BACKWARD_START)
    for v in list(cg.nx.nodes):
        d = cg[v]
        if d["kind"] != "op" or d["phase"] != "backward" or d["op"] in ("tangent", BACKWARD_START):
            continue
        if not any(cg.is_op(u) and cg[u]["phase"] == "backward" and cg[u]["op"] != "tangent"
                   for u in cg.nx.predecessors(v)):
            cg.add_edge(BACKWARD_START, v)
    return BACKWARD_START


def _fold_multi_output_ops(cg: ComputeGraph, gm: torch.fx.GraphModule) -> None:
    """Fold each multi-output op into its ``getitem`` projections.

    A projection owns its output storage, but it cannot be computed without running
    the whole op again. So the op itself is not a node of the DAG: every projection
    reads the op's inputs and carries a share of its time and FLOPs proportional to its
    bytes, and the projections form a ``group``. Run alone, a projection's
    ``workspace`` holds the op's other outputs (they exist while the op runs); right
    after an earlier projection of the same group (one run of the op) only the outputs
    still to come count (``run_workspace``). The rewriter re-runs the op exactly when a
    projection does not directly follow an earlier projection of its group.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in cg.nx or not node.users:
            continue
        if not all(u.target is operator.getitem for u in node.users):
            continue
        parent = cg[node.name]
        projections = [u.name for u in node.users if u.name in cg.nx]
        inputs = list(cg.nx.predecessors(node.name))
        for i, p in enumerate(projections):
            d = cg[p]
            d["group"] = node.name
            d["group_index"] = i
            d["recomputable"] = parent["recomputable"]
            d["op"] = parent["op"]
            for u in inputs:
                cg.add_edge(u, p)
        _share_costs(cg, projections, time=float(parent["time"]), flops=int(parent["flops"]),
                     workspace=int(parent["workspace"]))
        cg.nx.remove_node(node.name)


def _share_costs(cg: ComputeGraph, projections: list[str], *, time: float, flops: int | None,
                 workspace: int) -> None:
    """A multi-output op's time, FLOPs and workspace on its projections (see
    :func:`_fold_multi_output_ops`); ``flops=None`` keeps theirs."""
    sizes = [cg[p]["bytes"] for p in projections]
    total = sum(sizes)
    after = total
    for p, b in zip(projections, sizes):
        share = b / total if total else 1.0 / len(projections)
        after -= b
        d = cg[p]
        d["time"] = time * share
        if flops is not None:
            d["flops"] = int(round(flops * share))
        d["workspace"] = workspace + total - b
        d["group_time"] = time
        d["run_workspace"] = workspace + after


def set_op_costs(cg: ComputeGraph, *, times: Mapping[str, float] | None = None,
                 workspaces: Mapping[str, int] | None = None) -> None:
    """Write measured times (seconds) and workspaces (bytes) of the joint graph's ops,
    keyed by fx node name, onto the DAG ``cg`` captured from it: an op's own node, or
    for a multi-output op its projections, shared as :func:`capture` shares them. An op
    that a mapping does not name keeps its figure.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    >>> cg = capture(net, (torch.randn(2, 4),), measure_time=False)
    >>> op = "addmm"
    >>> set_op_costs(cg, times={op: 0.25}, workspaces={op: 64})
    >>> cg[op]["time"], cg[op]["workspace"]
    (0.25, 64)
    """
    times, workspaces = times or {}, workspaces or {}
    groups: dict[str, list[str]] = {}
    for v in cg.ops:
        if cg[v].get("group") is not None:
            groups.setdefault(cg[v]["group"], []).append(v)
    for name in set(times) | set(workspaces):
        if name in groups:
            members = sorted(groups[name], key=lambda p: cg[p]["group_index"])
            first = cg[members[0]]
            old_ws = first["run_workspace"] - sum(cg[p]["bytes"] for p in members[1:])
            _share_costs(cg, members, time=float(times.get(name, first["group_time"])), flops=None,
                         workspace=int(workspaces.get(name, old_ws)))
        elif name in cg.nx and cg.is_op(name):
            if name in times:
                cg[name]["time"] = float(times[name])
            if name in workspaces:
                cg[name]["workspace"] = int(workspaces[name])


class _CallableModule(__import__("types").ModuleType):
    """``graphs.capture`` names both this module and its function: calling the module
    calls :func:`capture`, whichever of the two the package attribute holds."""

    def __call__(self, *args: Any, **kwargs: Any) -> ComputeGraph:
        return capture(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule

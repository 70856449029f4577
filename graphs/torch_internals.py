"""The one seam between remat and torch's private internals.

Capture and graph mode need pieces of torch that are not a stable API: AOTAutograd's
joint export and partitioned runtime, fake tensors, inductor's inner compiler and the
globals of its generated code, Python kernels at dispatch keys, fx's boxed code
generation, pytree and the dispatch-mode base class. They change between torch releases
(torch 2.14 began to require a fake tensor in ``meta["val"]`` of every value a forward
graph saves for backward; torch 2.15 classifies a no-op view of another output as an alias
of an intermediate that is a user output), so every use of them is here, and nowhere else in ``graphs``
or ``solver``; ``tests/test_torch_seam.py`` holds the other modules to that.

Importing this module checks the torch version against :data:`SUPPORTED`: outside that
range it raises :class:`UnsupportedTorch`, which names the range and the version found,
instead of an assertion from deep inside AOTAutograd later. Setting the environment
variable ``REMAT_ALLOW_UNTESTED_TORCH=1`` turns the error into a warning, for trying a
newer torch at one's own risk.

Examples
--------
>>> supported_range()
'2.13-2.15'
>>> check_torch_version("2.15.0+cpu") is None
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx

from graphs.errors import RematError

__all__ = [
    "SUPPORTED", "UnsupportedTorch", "check_torch_version", "supported_range",
    # pytree and dispatch modes
    "tree_flatten", "tree_unflatten", "tree_leaves", "TorchDispatchMode",
    # ops
    "OpOverload", "is_op_overload", "op_schema", "override_python_kernels", "drop_python_kernels",
    # fake tensors
    "FakeTensorMode", "is_fake", "detect_fake_mode", "fake_value", "size_hint", "size_expr", "shape_guards",
    # AOTAutograd
    "aot_export_joint", "aot_compile_joint", "boxed_codegen", "joint_is_plain", "renamed_input",
    "clear_saved_tensors",
    # inductor
    "inductor_compile", "inductor_decompositions", "functorch_config",
    # storages and DTensor
    "storage_key", "local_tensor", "forward_hooks",
]

#: the torch minor versions remat is tested on (both ends run in CI)
SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 15))

_ALLOW_ENV = "REMAT_ALLOW_UNTESTED_TORCH"


class UnsupportedTorch(RematError, ImportError):
    """The installed torch is outside the range remat supports."""


def supported_range() -> str:
    """The supported torch versions, as ``"A-B"``."""
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b}-{c}.{d}"


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_torch_version(version: str | None = None, *, allow_untested: bool | None = None) -> None:
    """Raise :class:`UnsupportedTorch` when ``version`` (default: the installed torch) is
    outside :data:`SUPPORTED`.

    Parameters
    ----------
    version : str, optional
        A torch version string; default the installed torch's.
    allow_untested : bool, optional
        Warn instead of raising outside the range. Default: read from the environment
        variable ``REMAT_ALLOW_UNTESTED_TORCH`` (set and not ``0`` means warn).

    Examples
    --------
    >>> check_torch_version("2.13.0")
    >>> check_torch_version("2.9.1", allow_untested=False)
    Traceback (most recent call last):
    ...
    graphs.torch_internals.UnsupportedTorch: remat supports torch 2.13-2.15; this is 2.9.1. Install a supported one (pip install "torch>=2.13,<2.16"), or set REMAT_ALLOW_UNTESTED_TORCH=1 to try this one at your own risk.
    """
    if allow_untested is None:
        allow_untested = os.environ.get(_ALLOW_ENV, "") not in ("", "0")
    version = version or torch.__version__
    minor = _minor(version)
    if minor is not None and SUPPORTED[0] <= minor <= SUPPORTED[1]:
        return None
    msg = (f"remat supports torch {supported_range()}; this is {version}. Install a supported one "
           f'(pip install "torch>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1] + 1}"), '
           f"or set {_ALLOW_ENV}=1 to try this one at your own risk.")
    if allow_untested:
        warnings.warn(msg, stacklevel=2)
        return None
    raise UnsupportedTorch(msg)


check_torch_version()

# ---------------------------------------------------------------- pytree, dispatch modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ---------------------------------------------------------------- ops
OpOverload = torch._ops.OpOverload


def is_op_overload(target: Any) -> bool:
    """Is ``target`` an ATen/prim op overload (``torch.ops.aten.mm.default``...)?

    Examples
    --------
    >>> is_op_overload(torch.ops.aten.mm.default), is_op_overload(len)
    (True, False)
    """
    return isinstance(target, OpOverload)


def op_schema(op: OpOverload) -> Any:
    """``op``'s schema: ``arguments`` and ``returns``, each with ``alias_info``.

    Examples
    --------
    >>> [r.alias_info is not None for r in op_schema(torch.ops.aten.view.default).returns]
    [True]
    """
    return op._schema


def _dispatch_keys() -> tuple:
    from torch._C import DispatchKey

    return (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


@contextlib.contextmanager
def override_python_kernels(replace: dict[OpOverload, Callable]) -> Iterator[None]:
    """Route each op of ``replace`` to its function at the composite and autograd keys,
    for code traced under the Python dispatcher (ops that composite kernels call
    internally included); put everything back on exit."""
    saved = []
    try:
        for op, fn in replace.items():
            for key in _dispatch_keys():
                saved.append((op, key, op.py_kernels.get(key)))
                op.py_kernels[key] = fn
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, fn in saved:
            if fn is None:
                op.py_kernels.pop(key, None)
            else:
                op.py_kernels[key] = fn
            op._dispatch_cache.clear()


@contextlib.contextmanager
def drop_python_kernels(ops: Iterable[OpOverload]) -> Iterator[None]:
    """Remove the Python kernels (decompositions) registered for ``ops`` at the
    composite and autograd keys, so that tracing keeps the native op and its autograd
    formula; put them back on exit."""
    removed = []
    for op in ops:
        for key in _dispatch_keys():
            if key in op.py_kernels:
                removed.append((op, key, op.py_kernels.pop(key)))
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, fn in removed:
            op.py_kernels[key] = fn
            op._dispatch_cache.clear()


# ---------------------------------------------------------------- fake tensors
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402


def is_fake(t: Any) -> bool:
    """Is ``t`` a fake tensor (metadata only, nothing allocated)?"""
    return isinstance(t, FakeTensor)


def size_hint(value: Any) -> int:
    """``value`` as an int: itself, or for a symbolic size (a graph captured with
    symbolic sizes) the value it has at the sizes it was traced at, read without adding
    a guard.

    Examples
    --------
    >>> size_hint(3)
    3
    """
    if isinstance(value, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(value))
    return int(value)


def size_expr(value: Any) -> Any:
    """The sympy expression of a symbolic size, in the symbols of its capture's inputs'
    sizes; None for a plain number.

    Examples
    --------
    >>> size_expr(3) is None
    True
    """
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def shape_guards(fake_mode: Any) -> list:
    """The conditions on symbolic sizes (sympy expressions) that a trace in
    ``fake_mode`` assumed so far, those that its own findings do not settle: a graph it
    traced runs as traced only at sizes that meet them all."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return []
    # in the trace's own terms: a size it found equal to another is that one
    found = [shape_env.simplify(g.expr) for g in shape_env.guards]
    return [e for e in found if not (e is True or getattr(e, "is_Boolean", False) and bool(e) is True)]


def fake_mode_of(t: Any) -> Any:
    """The fake mode a fake tensor belongs to (None for anything else)."""
    return t.fake_mode if isinstance(t, FakeTensor) else None


def detect_fake_mode(values: Sequence[Any]) -> Any:
    """The fake mode of the fake tensors among ``values`` (or the active one), or None."""
    return torch._guards.detect_fake_mode(list(values))


def fake_value(real: torch.Tensor, *, like: Iterable[fx.Node]) -> torch.Tensor:
    """A fake copy of ``real`` in the fake mode of the graph that ``like`` belongs to,
    for the ``meta["val"]`` of a node that a rewrite adds (AOTAutograd counts a saved
    value as a tensor only when its ``meta["val"]`` is fake)."""
    mode = detect_fake_mode([n.meta.get("val") for n in like])
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode.from_tensor(real)


# ---------------------------------------------------------------- AOTAutograd
def aot_export_joint(stack: contextlib.ExitStack, module: torch.nn.Module, args: tuple) -> Any:
    """AOTAutograd's joint forward+backward export of ``module`` (a
    ``JointWithDescriptors``), alive while ``stack`` is open."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    return aot_export_joint_with_descriptors(stack, module, args)


def aot_compile_joint(joint: Any, *, partition_fn: Callable, fw_compiler: Callable,
                      bw_compiler: Callable) -> Callable:
    """The runnable autograd function of an exported joint graph, cut by ``partition_fn``.

    The export itself is left as it was: compiling writes into the export's forward
    metadata (the traced tangents become runtime metadata, the random-state count is
    set, the saved tensors whose sizes are symbolic are listed), so each compile works on
    its own copy of it, and one export compiles any
    number of cuts, after its stack has closed too. Compiling logs nothing: AOTAutograd
    otherwise prints the joint, forward and backward graphs to strings for its logs
    whether or not a log reads them (seconds on a graph of thousands of ops)."""
    import copy

    from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors

    state = copy.copy(joint._aot_state)
    state.aot_config = dataclasses.replace(state.aot_config, enable_log=False)
    meta = state.fw_metadata = copy.copy(state.fw_metadata)
    meta.traced_tangents = list(meta.traced_tangents)
    meta.output_info = list(meta.output_info)
    if hasattr(meta, "dynamic_saved_tensors_idxs"):  # written per cut (saved tensors with symbolic sizes)
        meta.dynamic_saved_tensors_idxs = {}
    return aot_compile_joint_with_descriptors(dataclasses.replace(joint, _aot_state=state),
                                              partition_fn=partition_fn,
                                              fw_compiler=fw_compiler, bw_compiler=bw_compiler)


def joint_is_plain(joint: Any) -> bool:
    """Whether an exported joint graph runs as plain forward and backward graphs: no
    input is mutated, no output aliases an input or another output, every output has a
    gradient input (tangent), and no effect tokens or tensor subclasses are threaded
    through it. Such a joint needs none of AOTAutograd's runtime wrappers."""
    try:
        meta = joint._aot_state.fw_metadata
        outputs = list(meta.output_info)
        return (not any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
                and all(o.output_type.name == "non_alias" for o in outputs)
                and meta.num_intermediate_bases == 0
                and len(meta.traced_tangents) == len(outputs)
                and not meta.tokens
                and all(isinstance(m, int) or type(m).__name__ == "PlainTensorMeta"
                        for m in meta.subclass_inp_meta or ()))
    except AttributeError:  # another torch's layout: take it as not plain
        return False


def renamed_input(desc: Any, target: str) -> Any:
    """A joint graph's parameter or buffer input descriptor naming ``target`` instead."""
    return dataclasses.replace(desc, target=target)


def clear_saved_tensors(ctx: Any) -> None:
    """Drop an autograd function's saved tensors now (its backward holds them in a list
    that the backward graph clears as it goes), as AOTAutograd's runtime does."""
    ctx.maybe_clear_saved_tensors()


@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """Inside the block, the ``GraphModule`` objects that torch's tracers and export
    passes make generate their Python code when first run or read (as
    :func:`lazy_graph_module`), not on every construction and ``recompile()``."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        yield


def lazy_graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A ``GraphModule`` of ``graph`` whose Python code is generated when it is first
    run or read, once, rather than on every construction, copy and ``recompile()``
    (AOTAutograd copies the backward graph, and the compilers switch both graphs to the
    boxed calling convention: three code generations of a graph of thousands of ops)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def boxed_codegen() -> Any:
    """fx code generation for the boxed calling convention (inputs as one list that the
    graph clears, so each input is freed after its last use)."""
    return fx.graph._BoxedCodeGen()


def functorch_config() -> Any:
    """AOTAutograd's configuration module (``activation_memory_budget``...)."""
    import torch._functorch.config as config

    return config


# ---------------------------------------------------------------- inductor
def inductor_decompositions() -> dict:
    """Inductor's decomposition table."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence, *, is_backward: bool,
                     segment: bool = False) -> Callable:
    """Decompose ``gm`` for inductor and compile it (boxed calling convention), with
    every buffer of the generated code allocated through the dispatcher.

    Random ops left after decomposition draw from the global generator, as in eager. A
    ``segment`` (a piece of a larger graph) compiles outside AOTAutograd's tracing
    context, which describes the whole graph's outputs, keeps its outputs' strides, and
    makes no copies into another layout (it allocates what its fx ops make).
    """
    from torch._inductor import compile_fx as inductor_fx
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(example_inputs)
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        lowered = make_fx(gm, decomposition_table=inductor_decompositions())(*example_inputs)
    if segment:  # the next segment, or an eager op, reads these with the strides fx recorded
        out = lowered.graph.output_node()
        out.meta["user_visible_output_idxs"] = list(range(len(out.args[0])))
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(V.set_fake_mode(fake_mode))
        if segment:
            stack.enter_context(torch._guards.tracing(None))
        stack.enter_context(inductor_config.patch(fallback_random=True))
        if segment:
            stack.enter_context(inductor_config.patch(layout_optimization=False))
        compiled = inductor_fx.compile_fx_inner(lowered, example_inputs, is_backward=is_backward)
    _allocate_through_dispatcher(compiled)
    return compiled


def _empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, *, device: str) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _generated_namespace(fn: Any, depth: int = 4) -> dict | None:
    """The globals of inductor's generated module behind ``fn``, looking through the
    wrappers inductor may put around it (input alignment: a closure over the call)."""
    namespace = getattr(fn, "__globals__", None)
    if namespace is not None and any(k.startswith("empty_strided_") for k in namespace):
        return namespace
    if depth == 0:
        return None
    inner = [getattr(fn, "__wrapped__", None), getattr(fn, "__func__", None)]
    inner += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
    for candidate in inner:
        if candidate is not None:
            found = _generated_namespace(candidate, depth - 1)
            if found is not None:
                return found
    return None


def _allocate_through_dispatcher(compiled: Any) -> None:
    """Make the buffers of inductor's generated code ordinary ``torch.empty_strided``
    calls, so that a dispatch mode sees every tensor of a compiled step. Inductor's code
    allocates through a direct C++ binding otherwise; the cost is one dispatcher call
    per buffer."""
    namespace = _generated_namespace(getattr(compiled, "current_callable", None))
    if namespace is None:
        raise RematError("compiler='inductor': found no generated Python module behind a compiled graph "
                         "(is inductor's C++ wrapper on?), so its memory could not be measured; "
                         "use compiler='eager'")
    for device in ("cpu", "cuda", "xpu"):
        if f"empty_strided_{device}" in namespace:
            namespace[f"empty_strided_{device}"] = functools.partial(_empty_strided, device=device)


# ---------------------------------------------------------------- storages, DTensor
def storage_key(storage: Any) -> int:
    """A key that tells storages apart (two tensors that share a storage share its key,
    empty storages included)."""
    return storage._cdata


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard a DTensor holds on this rank, without autograd (``t`` itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


# ---------------------------------------------------------------- module hooks
__all__ += ["hook_registrations", "root_hooks_off", "module_hooks_off"]

#: the attributes of a module that hold the hooks ``nn.Module.__call__`` runs
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks")


def forward_hooks(model: torch.nn.Module, *, root: bool = True) -> list[str]:
    """The forward hooks and pre-hooks registered on ``model``, its submodules, and for
    every module (``register_module_forward_hook``), as ``"path: hook name"``; with them
    the full backward hooks and pre-hooks (``register_full_backward_hook``), which
    run around the same call. ``root=False`` leaves out the hooks of ``model`` itself.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> def log_shapes(module, args, out): pass
    >>> _ = net[0].register_forward_hook(log_shapes)
    >>> forward_hooks(net)
    ['0: forward hook log_shapes']
    >>> _ = net.register_forward_pre_hook(lambda module, args: None)
    >>> forward_hooks(net, root=False)
    ['0: forward hook log_shapes']
    """
    import torch.nn.modules.module as module_mod

    def names(hooks: dict, kind: str, path: str) -> list[str]:
        return [f"{path}: {kind} {getattr(h, '__qualname__', None) or type(h).__name__}" for h in hooks.values()]

    found = names(module_mod._global_forward_pre_hooks, "global forward pre-hook", "(every module)")
    found += names(module_mod._global_forward_hooks, "global forward hook", "(every module)")
    found += names(module_mod._global_backward_pre_hooks, "global backward pre-hook", "(every module)")
    found += names(module_mod._global_backward_hooks, "global backward hook", "(every module)")
    for path, mod in model.named_modules():
        if not path and not root:
            continue
        found += names(mod._forward_pre_hooks, "forward pre-hook", path or "(the model)")
        found += names(mod._forward_hooks, "forward hook", path or "(the model)")
        found += names(mod._backward_pre_hooks, "backward pre-hook", path or "(the model)")
        found += names(mod._backward_hooks, "backward hook", path or "(the model)")
    return found


def hook_registrations() -> int:
    """How many hooks torch has handed out a handle for in this process, of any kind
    (modules, tensors, state dicts): unchanged means no hook was registered since.

    Examples
    --------
    >>> before = hook_registrations()
    >>> _ = torch.nn.Linear(2, 2).register_forward_hook(lambda m, a, o: None)
    >>> hook_registrations() > before
    True
    """
    import torch.utils.hooks

    return torch.utils.hooks.RemovableHandle.next_id


@contextlib.contextmanager
def root_hooks_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, calling ``model`` runs none of its own forward and backward
    hooks (those of its submodules still run); they are back on exit.

    For capturing ``model``'s step when another module's ``__call__`` runs these hooks
    around it (tracing the call would bake them into the graph).

    Examples
    --------
    >>> net = torch.nn.Linear(2, 2)
    >>> _ = net.register_forward_hook(lambda m, a, o: o * 0)
    >>> with root_hooks_off(net):
    ...     bool(net(torch.ones(1, 2)).abs().sum() > 0)
    True
    >>> net(torch.ones(1, 2)).abs().sum().item()
    0.0
    """
    with _hooks_off([model]):
        yield


@contextlib.contextmanager
def module_hooks_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, calling ``model`` or any of its submodules runs none of their
    forward and backward hooks (hooks registered for every module still run); they are
    back on exit. For runs that are not training steps (planning's measurements and
    checks), which a user's hooks should not see.

    Examples
    --------
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> calls = []
    >>> _ = net[0].register_forward_hook(lambda m, a, o: calls.append(1))
    >>> with module_hooks_off(net):
    ...     _ = net(torch.ones(1, 2))
    >>> _ = net(torch.ones(1, 2))
    >>> len(calls)
    1
    """
    with _hooks_off(list(model.modules())):
        yield


@contextlib.contextmanager
def _hooks_off(modules: list) -> Iterator[None]:
    saved = [(m, {name: m.__dict__[name] for name in _CALL_HOOKS if name in m.__dict__}) for m in modules]
    for m, hooks in saved:
        for name, found in hooks.items():
            m.__dict__[name] = type(found)()
    try:
        yield
    finally:
        for m, hooks in saved:
            m.__dict__.update(hooks)


# ---------------------------------------------------------------- profiler results
__all__ += ["profiler_running", "allocation_events", "labelled_spans", "release_results"]


def profiler_running() -> bool:
    """Whether a torch profiler is recording on this thread (a second one would take
    over its session silently)."""
    return bool(torch._C._autograd._profiler_enabled())


def _kineto_events(prof: Any) -> list:
    """The raw events of a finished ``torch.profiler.profile`` (torch 2.13-2.15: its
    autograd profiler's kineto result; ``prof.events()`` would build the whole
    FunctionEvent tree first, which costs more than the step it profiles)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise RematError("the profiler has no results: read them after its `with` block ends")
    return list(results.events())


def allocation_events(prof: Any) -> list[tuple[int, int, str]]:
    """Every alloc and free of c10's allocators that ``prof`` recorded (it must be
    started with ``profile_memory=True``), in time order.

    Returns
    -------
    list of (time_ns, nbytes, device_type)
        ``nbytes`` is positive for an allocation, negative for a free; ``device_type``
        is lower case (``"cpu"``, ``"cuda"``).
    """
    out = [(int(e.start_ns()), int(e.nbytes()), str(e.device_type()).rsplit(".", 1)[-1].lower())
           for e in _kineto_events(prof) if e.name() == "[memory]"]
    out.sort(key=lambda ev: ev[0])
    return out


def labelled_spans(prof: Any, prefix: str) -> list[tuple[str, int, int]]:
    """``(label, start_ns, end_ns)`` of every ``torch.profiler.record_function`` range
    whose label starts with ``prefix``, in time order, on the clock of
    :func:`allocation_events`."""
    out = [(e.name(), int(e.start_ns()), int(e.end_ns())) for e in _kineto_events(prof)
           if e.name().startswith(prefix)]
    out.sort(key=lambda ev: ev[1])
    return out


def release_results(prof: Any) -> None:
    """Free the native results a finished ``torch.profiler.profile`` holds, now.

    A ``torch.profiler.profile`` refers to itself (its action map holds its bound
    methods), so its results are otherwise freed whenever the garbage collector next
    runs: maybe in the middle of a later profiled step, where torch 2.15's kineto
    crashes freeing a memory-profiling trace (a segmentation fault in
    ``ActivityBuffers``' destructor, seen after a Trainer run and a compiled step).
    Read the events first: they are gone after this."""
    inner = getattr(prof, "profiler", None)
    if inner is not None:
        inner.kineto_results = None


# ---------------------------------------------------------------- autograd engine
__all__ += ["at_backward_end"]


def at_backward_end(callback: Any) -> None:
    """Run ``callback()`` once the backward pass that is running now has finished (the
    autograd engine's final callbacks, as FSDP uses them). Call it from a hook that
    runs during backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ---------------------------------------------------------------- torch.compile
__all__ += ["is_compiled_module"]


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(model)`` returns (Dynamo's
    ``OptimizedModule``, which runs its wrapped model through a compiled frame).
    Dynamo is not imported for this: a process that has not imported it has no
    compiled module.

    Examples
    --------
    >>> is_compiled_module(torch.nn.Linear(2, 2))
    False
    """
    import sys

    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(eval_frame, "OptimizedModule", None)
    return cls is not None and isinstance(module, cls)


# ---------------------------------------------------------------- custom autograd Functions
__all__ += ["custom_functions_called"]


@contextlib.contextmanager
def custom_functions_called(model: torch.nn.Module, found: list) -> Iterator[None]:
    """Inside the block, each call of ``model`` appends to ``found`` the classes of the
    custom :class:`torch.autograd.Function`\\ s whose backward its outputs' gradients
    would run (found in their autograd graph; torch's own Functions are left out). A
    trace of the forward (``torch.export``) records what such a Function's forward does,
    not its backward.

    Examples
    --------
    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x): return x.clone()
    ...     @staticmethod
    ...     def backward(ctx, g): return 2 * g
    >>> class Net(torch.nn.Module):
    ...     def __init__(self): super().__init__(); self.lin = torch.nn.Linear(2, 2)
    ...     def forward(self, x): return Twice.apply(self.lin(x)).sum()
    >>> net, found = Net(), []
    >>> with custom_functions_called(net, found):
    ...     _ = net(torch.ones(1, 2))
    >>> [f.__name__ for f in found]
    ['Twice']
    """
    from torch.autograd.function import BackwardCFunction

    def look(module: torch.nn.Module, args: Any, output: Any) -> None:
        if module is not model:
            return
        leaves = tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
        todo = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set = set()
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if isinstance(fn, BackwardCFunction):
                cls = getattr(fn, "_forward_cls", type(fn))
                if not (getattr(cls, "__module__", "") or "").startswith("torch.") and cls not in found:
                    found.append(cls)
            todo.extend(nxt for nxt, _ in fn.next_functions)

    # a reentrant checkpoint (torch's own Function) is found where it runs: without an
    # input that requires a gradient its output has no autograd graph to find it in
    reentrant = torch.utils.checkpoint.CheckpointFunction
    forward = reentrant.__dict__["forward"]

    def called(*args: Any, **kwargs: Any) -> Any:
        if reentrant not in found:
            found.append(reentrant)
        return forward.__func__(*args, **kwargs)

    handle = torch.nn.modules.module.register_module_forward_hook(look)
    reentrant.forward = staticmethod(called)
    try:
        yield
    finally:
        reentrant.forward = forward
        handle.remove()


__all__ += ["lazy_copy", "is_lazy_copy"]


def lazy_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that shares its memory until one of the two is written
    (copy-on-write); a plain clone where torch has no lazy clone for it."""
    try:
        return torch._lazy_clone(t)
    except (AttributeError, RuntimeError, NotImplementedError):
        return t.clone()


def is_lazy_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` still shares its memory copy-on-write (:func:`lazy_copy`)."""
    try:
        return bool(torch._C._is_cow_tensor(t))
    except (AttributeError, RuntimeError):
        return False

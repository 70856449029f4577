"""Run a model's training step as the forward and backward graphs of a schedule.

:class:`ScheduledStep` compiles one captured step (``graphs.capture(...,
backward="outputs")``) with AOTAutograd's runtime, cutting the joint graph with
:func:`graphs.rewrite.partition_by_schedule`: the forward keeps exactly the tensors the
schedule stores and the backward recomputes the rest where the schedule says. Both graphs
are plain fx code (boxed, freeing every value after its last use), run eagerly, or, with
``compiler="inductor"``, compiled by torch inductor after the cut (inductor never sees the
joint graph, so it cannot move a value across it): each graph is decomposed with
inductor's decomposition table and compiled with ``compile_fx_inner``; random ops and the
generator-state steps that replay them run as plain fx code between compiled segments,
so every draw is eager's (:func:`graphs.rewrite.partition_by_schedule`).

:func:`wrap_graph_mode` returns a drop-in module: a shallow copy of the user's model (same
class, parameters, buffers and ``state_dict`` keys) whose forward plans on the first call
for each input signature (through a planner callback, so this module never imports a
solver), runs the scheduled step in training with gradients enabled, and the original
forward otherwise (``eval()``, ``torch.no_grad()``: no recomputation at all).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphs.capture import is_random_op
from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.errors import RematError
from graphs.rewrite import boxed, partition_by_schedule

__all__ = ["ScheduledStep", "wrap_graph_mode", "input_signature", "COMPILERS"]

log = logging.getLogger(__name__)


#: the ways :class:`ScheduledStep` runs its forward and backward graphs
COMPILERS = ("eager", "inductor")


def _compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    return boxed(gm)


def _runs_eagerly(node: torch.fx.Node) -> bool:
    """Random ops and plain Python calls (the generator-state steps of a replayed random
    op) stay outside inductor: they draw from, or set, the device's global generator in
    the graph's order."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return is_random_op(node)


#: a run of fewer deterministic ops than this between two random ones runs eagerly too
#: (an inductor compile costs about a second on CPU; a few ops gain nothing from it)
_MIN_SEGMENT_OPS = 4


def _segments(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Number consecutive runs of nodes that inductor compiles and of nodes that run
    eagerly; odd numbers run eagerly. A ``getitem`` goes with the op it projects."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    eager: dict[torch.fx.Node, bool] = {}
    for node in nodes:
        src = node.args[0] if node.target is operator.getitem and node.args else None
        eager[node] = eager[src] if isinstance(src, torch.fx.Node) and src in eager else _runs_eagerly(node)
    if any(eager.values()):  # short deterministic runs join their eager neighbours
        run: list[torch.fx.Node] = []
        for node in nodes + [None]:
            if node is not None and not eager[node]:
                run.append(node)
                continue
            if run and sum(1 for n in run if n.target is not operator.getitem) < _MIN_SEGMENT_OPS:
                eager.update(dict.fromkeys(run, True))
            run = []
    part: dict[torch.fx.Node, int] = {}
    current = 0
    for node in nodes:
        src = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(src, torch.fx.Node) and src in part:
            part[node] = part[src]
            continue
        if eager[node] != bool(current % 2):
            current += 1
        part[node] = current
    return part


class _Compiled(nn.Module):
    """A graph compiled by inductor (boxed: it frees each input after its last use)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(list(args))


def _fake_inputs(gm: torch.fx.GraphModule, fake_mode: Any) -> list:
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise RematError(f"compiler='inductor': the graph input {node.name!r} has no tensor metadata; "
                             "use compiler='eager'")
        with fake_mode:
            out.append(torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                           device=val.device))
    return out


def _inductor(gm: torch.fx.GraphModule, example_inputs: Sequence, *, is_backward: bool,
              segment: bool = False) -> Callable:
    """Decompose ``gm`` for inductor and compile it (boxed calling convention). A segment
    of a graph compiles outside AOTAutograd's tracing context, which describes the
    outputs of the whole graph."""
    from torch._inductor import compile_fx as inductor_fx
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        lowered = make_fx(gm, decomposition_table=select_decomp_table())(*example_inputs)
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(V.set_fake_mode(fake_mode))
        if segment:
            stack.enter_context(torch._guards.tracing(None))
        # random ops left after decomposition draw from the global generator, as eager
        stack.enter_context(inductor_config.patch(fallback_random=True))
        return inductor_fx.compile_fx_inner(lowered, example_inputs, is_backward=is_backward)


def _inductor_compiler(is_backward: bool, compiled: dict[str, int]) -> Callable:
    """AOTAutograd's ``fw_compiler``/``bw_compiler`` for one of the partitioned graphs:
    inductor for the deterministic segments, plain fx code for the random ones (the
    number of inductor graphs goes to ``compiled[which]``)."""
    which = "backward" if is_backward else "forward"

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Any:
        try:
            part = _segments(gm)
            if not any(p % 2 for p in part.values()):
                compiled[which] = 1
                return _inductor(gm, example_inputs, is_backward=is_backward)
            from torch.fx.passes.split_module import split_module

            fake_mode = torch._guards.detect_fake_mode(example_inputs)
            if fake_mode is None:
                fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
            split = split_module(gm, gm, lambda n: part[n], keep_original_order=True,
                                 keep_original_node_name=True, tuple_return=True)
            for name, sub in list(split.named_children()):
                if int(name.rsplit("_", 1)[-1]) % 2 == 0:
                    fn = _inductor(sub, _fake_inputs(sub, fake_mode), is_backward=is_backward, segment=True)
                    setattr(split, name, _Compiled(fn))
                    compiled[which] = compiled.get(which, 0) + 1
            log.info("compiler='inductor': the %s graph runs as %d segments (random ops run eagerly)",
                     which, len(list(split.children())))
            return boxed(split)
        except RematError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise RematError(
                f"inductor could not compile the {which} graph of the schedule ({type(exc).__name__}: {first}); "
                "on CPU inductor needs a working C++ compiler. Run with compiler='eager' (plain fx code, "
                "the same schedule)"
            ) from exc

    return compile_graph


class ScheduledStep:
    """One captured step compiled to run ``sequence``.

    Parameters
    ----------
    graph : ComputeGraph
        Captured with ``backward="outputs"`` (it carries ``capture_info``).
    sequence : sequence of node ids
        The schedule's steps.
    compiler : {"eager", "inductor"}
        How the forward and backward graphs run: ``"eager"``, as plain fx code;
        ``"inductor"``, compiled by torch inductor (the same cut: the forward keeps
        exactly the stored values; random ops run eagerly between compiled segments so
        that recomputed draws are the first run's). Compiling takes seconds to minutes
        on CPU and needs a C++ compiler there.

    Raises
    ------
    RematError
        The graph was not captured with ``backward="outputs"``, ``compiler`` is unknown,
        or inductor failed to compile a graph (the message suggests ``compiler="eager"``).

    Examples
    --------
    >>> from graphs.capture import capture, default_loss
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    >>> x = torch.randn(4, 8)
    >>> cg = capture(net, (x,), backward="outputs", inplace="functional", measure_time=False)
    >>> step = ScheduledStep(cg, cg.order)
    >>> loss = default_loss(step(net, (x,), {}))
    >>> torch.allclose(loss, default_loss(net(x)))
    True

    Attributes
    ----------
    saved : list of str
        The values the forward keeps for backward.
    inductor_graphs : dict
        With ``compiler="inductor"``: how many graphs inductor compiled for the
        ``"forward"`` and the ``"backward"`` (more than one where random ops split a
        graph into segments).
    """

    def __init__(self, graph: ComputeGraph, sequence: Sequence[Hashable], *, compiler: str = "eager") -> None:
        from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors

        if compiler not in COMPILERS:
            raise RematError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        info = graph.capture_info
        if info is None or info.backward != "outputs":
            raise RematError("ScheduledStep needs a graph captured with backward='outputs'")
        self.compiler = compiler
        self.inductor_graphs: dict[str, int] = {}
        # steps without an fx node (where the backward starts) only constrain the order
        self.sequence = [str(s) for s in sequence if s != BACKWARD_START]
        self.saved: list[str] = []
        self.info = info
        fw_comp = bw_comp = _compiler
        if compiler == "inductor":
            fw_comp, bw_comp = (_inductor_compiler(False, self.inductor_graphs),
                                _inductor_compiler(True, self.inductor_graphs))
        with contextlib.ExitStack() as stack:
            jd = info.export_joint(stack)
            self.params_spec = list(jd.params_spec)
            self.buffers_spec = list(jd.buffers_spec)
            self.fn = aot_compile_joint_with_descriptors(
                jd, partition_fn=self._partition, fw_compiler=fw_comp, bw_compiler=bw_comp
            )

    def _partition(self, joint, joint_inputs, *, num_fwd_outputs, **_):
        fw, bw, saved = partition_by_schedule(joint, self.sequence, num_fwd_outputs=num_fwd_outputs)
        self.saved = saved
        return fw, bw

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        flat, _ = pytree.tree_flatten((args, kwargs))
        user = [flat[i] for i in self.info.input_indices]
        params = [model.get_parameter(_fqn(n)) for n in self.params_spec]
        buffers = [model.get_buffer(_fqn(n)) for n in self.buffers_spec]
        out = self.fn(*params, *buffers, *user)
        return pytree.tree_unflatten(list(out), self.info.out_spec)


def _fqn(name: str) -> str:
    return name[3:] if name.startswith("gm.") else name


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """A hashable key of the inputs' structure, shapes, dtypes and devices.

    Examples
    --------
    >>> input_signature((torch.ones(2, 3),), {}) == input_signature((torch.zeros(2, 3),), {})
    True
    """
    flat, spec = pytree.tree_flatten((args, kwargs))
    leaves = []
    for t in flat:
        if isinstance(t, torch.Tensor):
            leaves.append(("T", tuple(t.shape), t.dtype, t.device.type, t.requires_grad))
        else:
            leaves.append(("V", repr(t)))
    return (str(spec), tuple(leaves))


Planner = Callable[[nn.Module, tuple, dict], Any]


def wrap_graph_mode(model: nn.Module, planner: Planner) -> nn.Module:
    """A drop-in module that runs ``model``'s training steps as scheduled graphs.

    Parameters
    ----------
    model : torch.nn.Module
    planner : callable
        ``planner(model, args, kwargs) -> ScheduledStep`` (it captures, solves and
        compiles); called once per input signature, on the first call in training mode
        with gradients enabled.

    Returns
    -------
    torch.nn.Module
        A shallow copy of ``model``: same class, same parameter and buffer objects, same
        ``state_dict`` keys; ``model`` itself is not changed.
    """
    wrapper = copy.copy(model)
    original_forward = type(model).forward
    steps: dict[tuple, ScheduledStep] = {}

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (wrapper.training and torch.is_grad_enabled()):
            return original_forward(wrapper, *args, **kwargs)
        key = input_signature(args, kwargs)
        step = steps.get(key)
        if step is None:
            step = planner(model, args, kwargs)
            steps[key] = step
        return step(wrapper, args, kwargs)

    wrapper.forward = forward
    wrapper.remat_steps = steps
    return wrapper

"""Run a model's training step as the forward and backward graphs of a schedule.

:class:`ScheduledStep` compiles one captured step (``graphs.capture(...,
backward="outputs")``) with AOTAutograd's runtime, cutting the joint graph with
:func:`graphs.rewrite.partition_by_schedule`: the forward keeps exactly the tensors the
schedule stores and the backward recomputes the rest where the schedule says. Both graphs
are plain fx code (boxed, freeing every value after its last use), run eagerly.

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
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.errors import RematError
from graphs.rewrite import boxed, partition_by_schedule

__all__ = ["ScheduledStep", "wrap_graph_mode", "input_signature"]

log = logging.getLogger(__name__)


def _compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    return boxed(gm)


class ScheduledStep:
    """One captured step compiled to run ``sequence``.

    Parameters
    ----------
    graph : ComputeGraph
        Captured with ``backward="outputs"`` (it carries ``capture_info``).
    sequence : sequence of node ids
        The schedule's steps.

    Attributes
    ----------
    saved : list of str
        The values the forward keeps for backward.
    """

    def __init__(self, graph: ComputeGraph, sequence: Sequence[Hashable]) -> None:
        from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors

        info = graph.capture_info
        if info is None or info.backward != "outputs":
            raise RematError("ScheduledStep needs a graph captured with backward='outputs'")
        # steps without an fx node (where the backward starts) only constrain the order
        self.sequence = [str(s) for s in sequence if s != BACKWARD_START]
        self.saved: list[str] = []
        self.info = info
        comp = _compiler
        with contextlib.ExitStack() as stack:
            jd = info.export_joint(stack)
            self.params_spec = list(jd.params_spec)
            self.buffers_spec = list(jd.buffers_spec)
            self.fn = aot_compile_joint_with_descriptors(
                jd, partition_fn=self._partition, fw_compiler=comp, bw_compiler=comp
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

"""The drop-in module that plans a training step on its first call: one lazy wrapper
for graph mode and module mode.

:func:`wrap_planned` returns a shallow copy of the user's model (same class, parameters,
buffers and ``state_dict`` keys) whose forward, in training with gradients enabled, asks
a planner for a *step* once per input signature and runs it; in ``eval()`` or under
``torch.no_grad()`` it runs the original forward. The planner is a callback, so this
module never imports a solver; a step is any callable ``step(wrapper, args, kwargs)``
(graph mode's :class:`graphs.graph_mode.ScheduledStep`, module mode's
:class:`ModuleStep`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn

from graphs.autocast import autocast_state
from graphs.torch_internals import tree_flatten

__all__ = ["ModuleStep", "Planner", "input_signature", "wrap_planned"]

#: ``planner(model, args, kwargs) -> step``
Planner = Callable[[nn.Module, tuple, dict], Any]


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """A hashable key of the inputs' structure, shapes, dtypes and devices, and of the
    autocast state (a graph captured under autocast holds its casts).

    Examples
    --------
    >>> input_signature((torch.ones(2, 3),), {}) == input_signature((torch.zeros(2, 3),), {})
    True
    """
    flat, spec = tree_flatten((args, kwargs))
    leaves = []
    for t in flat:
        if isinstance(t, torch.Tensor):
            leaves.append(("T", tuple(t.shape), t.dtype, t.device.type, t.requires_grad))
        else:
            leaves.append(("V", repr(t)))
    return (str(spec), tuple(leaves), autocast_state())


class ModuleStep:
    """A module-mode step: the model's forward with its layer blocks wrapped as
    ``actions`` says (:func:`graphs.module_mode.apply_module_plan`, applied on the first
    call).

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> step = ModuleStep(net, {"0": "full"})
    >>> x = torch.randn(2, 4)
    >>> torch.equal(step(net, (x,), {}), net(x))
    True
    """

    def __init__(self, model: nn.Module, actions: Mapping[str, str], *, plan: Any = None) -> None:
        self.model, self.actions, self.plan = model, dict(actions), plan
        self._applied: nn.Module | None = None

    def __call__(self, wrapper: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._applied is None:
            from graphs.module_mode import apply_module_plan

            self._applied = apply_module_plan(self.model, self.actions)
        return self._applied.forward(*args, **kwargs)


def wrap_planned(model: nn.Module, planner: Planner) -> nn.Module:
    """A drop-in module that runs ``model``'s training steps as planned steps.

    Parameters
    ----------
    model : torch.nn.Module
    planner : callable
        ``planner(model, args, kwargs) -> step`` (it captures, solves and builds the
        step); called once per input signature, on the first call in training mode with
        gradients enabled, or by ``wrapper.remat_plan_now(args, kwargs)``.

    Returns
    -------
    torch.nn.Module
        A shallow copy of ``model``: same class, same parameter and buffer objects, same
        ``state_dict`` keys; ``model`` itself is not changed. ``remat_steps`` maps input
        signatures to their steps; a module-mode step's actions are ``remat_plan``.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> fast = wrap_planned(net, lambda m, a, k: ModuleStep(m, {"0": "full"}))
    >>> x = torch.randn(2, 4)
    >>> torch.equal(fast(x), net(x)), fast.remat_plan
    (True, {'0': 'full'})
    """
    wrapper = copy.copy(model)
    original_forward = type(model).forward
    steps: dict[tuple, Any] = {}

    def plan_now(args: tuple, kwargs: dict) -> Any:
        step = steps[input_signature(args, kwargs)] = planner(model, args, kwargs)
        actions = getattr(step, "actions", None)  # a module-mode step, perhaps wrapped
        if actions is not None:
            wrapper.remat_plan = actions
        return step

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (wrapper.training and torch.is_grad_enabled()):
            return original_forward(wrapper, *args, **kwargs)
        step = steps.get(input_signature(args, kwargs))
        if step is None:
            step = plan_now(args, kwargs)
        return step(wrapper, args, kwargs)

    wrapper.forward = forward
    wrapper.remat_steps = steps
    wrapper.remat_plan_now = plan_now
    return wrapper

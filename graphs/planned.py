"""The drop-in module that plans a training step on its first call: one lazy wrapper
for graph mode and module mode.

:func:`wrap_planned` returns a shallow copy of the user's model (same class, parameters,
buffers and ``state_dict`` keys) whose forward, in training with gradients enabled, asks
a planner for a *step* once per input signature and runs it; in ``eval()`` or under
``torch.no_grad()`` it runs the original forward. The planner is a callback, so this
module never imports a solver; a step is any callable ``step(wrapper, args, kwargs)``
(graph mode's :class:`graphs.graph_mode.ScheduledStep`, module mode's
:class:`ModuleStep`).

What the wrapper keeps of a drop-in's contract, beyond forward's outputs:

- **hooks**: the model's own forward hooks and pre-hooks are the wrapper's (the same
  dicts): its ``__call__`` runs them around every step, and planning runs without them,
  so they are not baked into a captured step. Hooks on submodules fire where the step
  calls the submodules (module mode, the original forward). A step that runs a captured
  graph does not call submodules: it has ``hooks_captured = True``, and a call refuses
  (:class:`HookNotRun`, naming the hook) while a submodule carries a hook, checked again
  only when torch has registered a hook since the last check.
- **its own module dicts**: ``_modules``, ``_parameters``, ``_buffers`` are the wrapper's
  own (holding the model's objects): a submodule added to the wrapper is not added to
  the model. ``train()``/``eval()`` set the model's own flag too.
- **copies**: ``copy.deepcopy`` gives an independent wrapper, with a copy of the
  parameters, no plans (it plans again on its first training call) and the planner that
  ``copy_planner`` gives it. ``pickle`` / ``torch.save`` of the wrapper is refused with
  :class:`NotPicklable` (save its ``state_dict()``, whose keys are the model's).
- **the plan cache**: at most :data:`PLAN_CACHE_SIZE` plans, least recently used dropped
  first (it is made again, with a note in ``report``, if its signature comes back).
- **shape families** (with a ``resizer``): a call that differs from a planned call only
  in sizes, none larger, runs that plan's decisions (:func:`size_family`); a larger one
  plans its bucket once (:func:`bucket_sizes`).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import logging
import math
import warnings
from collections import OrderedDict
from typing import Any, Callable, Mapping

import torch
from torch import nn

from graphs.autocast import autocast_state
from graphs.errors import RematError
from graphs.torch_internals import (TorchDispatchMode, forward_hooks, hook_registrations, root_hooks_off,
                                   tree_flatten, tree_unflatten)

__all__ = ["HookNotRun", "in_compiled_call", "ModuleStep", "NotPicklable", "PLAN_CACHE_SIZE", "SIZED_CACHE_SIZE", "Planner",
           "Resizer", "bucket_sizes", "grown_inputs", "input_signature", "parameters_read", "same_forward",
           "size_family",
           "wrap_planned"]

log = logging.getLogger(__name__)

#: plans a wrapper keeps (one per input signature), like torch.compile's recompile limit
PLAN_CACHE_SIZE = 8
#: steps a wrapper keeps that run a plan's decisions at other sizes (cheap to make again)
SIZED_CACHE_SIZE = 64

#: the wrapper's attributes that belong to its plans (a deep copy plans again); and every
#: attribute whose name starts with ``_remat``
PLAN_STATE = frozenset({"forward", "train", "remat_steps", "remat_plan_now", "remat_plan", "report",

                        "__deepcopy__", "__reduce_ex__"})


class HookNotRun(RematError):
    """A hook on a submodule that a planned step would not run (graph mode)."""


class NotPicklable(RematError, TypeError):
    """The drop-in module is not pickled: its plans hold captured graphs and closures."""

#: ``planner(model, args, kwargs) -> step``
Planner = Callable[[nn.Module, tuple, dict], Any]
#: ``resizer(model, step, args, kwargs, larger=False) -> step or None``: ``step``'s
#: decisions run on inputs of the same family no larger than the ones it was planned
#: for; with ``larger=True``, on inputs larger than every planned call, where the
#: resizer can plan them without a new capture (None: plan them)
Resizer = Callable[..., Any]


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """A hashable key of the inputs' structure, shapes, dtypes and devices, and of the
    autocast state (a graph captured under autocast holds its casts).

    A call whose key has no plan may still run another key's plan: a planned module
    checks, once per new key, whether the call differs from a planned call only in
    keyword arguments that do not change what the forward computes
    (:func:`same_forward`), and then runs that plan with the planned call's keywords.

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


def size_family(key: tuple) -> tuple:
    """An :func:`input_signature` with the tensors' sizes left out (their number of
    dimensions kept): calls of one family differ only in sizes.

    Examples
    --------
    >>> a = input_signature((torch.ones(2, 3),), {})
    >>> size_family(a) == size_family(input_signature((torch.ones(5, 7),), {}))
    True
    >>> size_family(a) == size_family(input_signature((torch.ones(5),), {}))
    False
    """
    spec, leaves, autocast = key
    return spec, tuple(("T", len(v[1])) + v[2:] if v[0] == "T" else v for v in leaves), autocast


def _sizes(key: tuple) -> list[tuple[int, ...]]:
    return [v[1] for v in key[1] if v[0] == "T"]


def _covers(big: tuple, small: tuple) -> bool:
    """Whether every tensor of the signature ``big`` is at least as large as
    ``small``'s in every dimension (one family)."""
    return all(b >= s for bs, ss in zip(_sizes(big), _sizes(small)) for b, s in zip(bs, ss))


def _power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_sizes(key: tuple, planned: list[tuple]) -> list[tuple[int, ...]]:
    """The sizes a family's plan is made for when the call ``key`` is larger than every
    planned call of its family (``planned``) in some dimension: per tensor and
    dimension the largest size met, rounded up to a power of two where the call is
    the one that grew it.

    Examples
    --------
    >>> k = lambda *shapes: input_signature(tuple(torch.ones(s) for s in shapes), {})
    >>> bucket_sizes(k((8, 40)), [k((8, 24))])
    [(8, 64)]
    """
    sizes = _sizes(key)
    largest = [tuple(max(d) for d in zip(*shapes)) for shapes in zip(*(_sizes(k) for k in planned))]
    return [tuple(_power_of_two(s) if s > m else m for s, m in zip(shape, most))
            for shape, most in zip(sizes, largest)]


def grown_inputs(args: tuple, kwargs: dict, sizes: list[tuple[int, ...]]) -> tuple[tuple, dict]:
    """Copies of the call's tensors grown to ``sizes`` (one per tensor, in flattening
    order) by repeating their values along each dimension that grows (index ``i``
    takes ``i % size``): inputs that plan a larger step of the same family. Tensors
    grown alike along a dimension stay aligned (token ids and their labels), and a
    tensor passed twice gives one grown tensor.

    Examples
    --------
    >>> (x,), _ = grown_inputs((torch.arange(3),), {}, [(5,)])
    >>> x.tolist()
    [0, 1, 2, 0, 1]
    """
    flat, spec = tree_flatten((args, kwargs))
    it = iter(sizes)
    out, made = [], {}  # a tensor passed twice is grown once (the capture sees one input)
    with torch.no_grad():
        for t in flat:
            if isinstance(t, torch.Tensor):
                target = next(it)
                if id(t) not in made:
                    grown = t.detach()
                    for dim, (have, want) in enumerate(zip(t.shape, target)):
                        if want > have:
                            grown = grown.index_select(dim, torch.arange(want, device=t.device) % have)
                    made[id(t)] = grown.requires_grad_(t.requires_grad) if grown is not t.detach() else t
                t = made[id(t)]
            out.append(t)
    args, kwargs = tree_unflatten(out, spec)
    return args, kwargs


class _OpTrace(TorchDispatchMode):
    """Records every op a forward dispatches: its name and, per argument, the input,
    parameter or buffer it is (by name) or the shape and dtype of an intermediate, and
    every other argument's value."""

    def __init__(self, named: dict[int, str]) -> None:
        super().__init__()
        self.named, self.ops = named, []

    def describe(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (self.named.get(id(v), "t"), tuple(v.shape), v.dtype, v.device.type)
        if isinstance(v, (list, tuple)):
            return tuple(self.describe(a) for a in v)
        if isinstance(v, (bool, int, float, complex, str, type(None), torch.dtype, torch.device,
                          torch.memory_format, torch.layout)):
            return (type(v).__name__, repr(v))
        return (type(v).__name__, id(v))  # an object: the same one in both calls, or a difference

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func), self.describe(args), tuple((k, self.describe(v)) for k, v in kwargs.items())))
        return func(*args, **kwargs)


def _forward_trace(forward: Callable, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The ops ``forward(module, *args, **kwargs)`` dispatches and the structure of its
    output (:class:`_OpTrace`), run without gradients, with the random generators and
    the buffers' values put back afterwards; None where the forward raises."""
    named: dict[int, str] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        named.setdefault(id(t), name)
    for i, a in enumerate(args):
        for j, t in enumerate(tree_flatten(a)[0]):
            named[id(t)] = f"args[{i}].{j}"
    for k, v in kwargs.items():
        for j, t in enumerate(tree_flatten(v)[0]):
            named[id(t)] = f"{k}.{j}"
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    trace = _OpTrace(named)
    try:
        with torch.no_grad(), torch.random.fork_rng(), trace:
            out = forward(module, *args, **kwargs)
        flat, spec = tree_flatten(out)
        return str(spec), trace.describe(flat), tuple(trace.ops)
    except Exception:  # a forward that cannot run this way proves nothing
        return None
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def same_forward(forward: Callable, module: nn.Module, call: tuple[tuple, dict], other: tuple[tuple, dict]) -> bool:
    """Whether ``forward(module, *args, **kwargs)`` computes the same thing for the two
    calls ``(args, kwargs)``: the same ops in the same order on the same inputs,
    parameters and buffers (by name; intermediates by shape and dtype), with the same
    non-tensor arguments, and an output of the same structure. Both calls run once
    without gradients (random generators and buffers are put back).

    A keyword argument that the forward ignores or that only picks a default
    (``return_dict=True``, ``use_cache=False`` in training, an unused count) gives the
    same ops; one that changes the computation (a scale, a loss reduction, a mask)
    does not.

    Examples
    --------
    >>> def fwd(m, x, *, scale=1.0, verbose=False):
    ...     return m(x) * scale
    >>> lin, x = nn.Linear(2, 2), torch.ones(1, 2)
    >>> same_forward(fwd, lin, ((x,), {}), ((x,), {"verbose": True}))
    True
    >>> same_forward(fwd, lin, ((x,), {}), ((x,), {"scale": 2.0}))
    False
    """
    first = _forward_trace(forward, module, *call)
    return first is not None and first == _forward_trace(forward, module, *other)


def parameters_read(module: nn.Module, args: tuple, kwargs: dict) -> set[str] | None:
    """The names of the parameters that one forward of ``module`` on ``(args, kwargs)``
    reads (run once without gradients and without the modules' hooks, random generators
    and buffers put back); None where that forward cannot run so.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> sorted(parameters_read(net[0], (torch.ones(1, 2),), {}))
    ['bias', 'weight']
    """
    from graphs.torch_internals import module_hooks_off

    with module_hooks_off(module):  # not a training step: the user's hooks do not see it
        trace = _forward_trace(type(module).forward, module, args, kwargs)
    if trace is None:
        return None
    names = {n for n, _ in module.named_parameters()}
    found: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, tuple):
            if len(v) == 4 and isinstance(v[0], str) and v[0] in names:
                found.add(v[0])
            for a in v:
                walk(a)

    walk(trace[2])
    return found


_TENSORS = object()  # a keyword whose value holds tensors (a graph input)


def _call_template(args: tuple, kwargs: dict) -> tuple[int, dict]:
    """What a planned call's keywords are: tensor-bearing (graph inputs) or a value
    baked into the plan."""
    return len(args), {k: _TENSORS if any(isinstance(t, torch.Tensor) for t in tree_flatten(v)[0]) else v
                       for k, v in kwargs.items()}


def _as_planned(args: tuple, kwargs: dict, template: tuple[int, dict]) -> dict | None:
    """``kwargs`` made like a planned call's: keywords it did not have dropped, its
    non-tensor values put back; None where a tensor keyword it had is missing."""
    n_args, planned = template
    if len(args) != n_args:
        return None
    out = {}
    for k, v in planned.items():
        if v is _TENSORS:
            if k not in kwargs:
                return None
            out[k] = kwargs[k]
        else:
            out[k] = v
    return out


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

    #: the step calls the model's submodules, so their hooks fire as in eager
    hooks_captured = False

    def __init__(self, model: nn.Module, actions: Mapping[str, str], *, plan: Any = None) -> None:
        self.model, self.actions, self.plan = model, dict(actions), plan
        self._applied: nn.Module | None = None

    def __call__(self, wrapper: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._applied is None:
            from graphs.module_mode import apply_module_plan

            self._applied = apply_module_plan(self.model, self.actions)
        return self._applied.forward(*args, **kwargs)


def wrap_planned(model: nn.Module, planner: Planner, *,
                 copy_planner: Callable[[nn.Module], Planner] | None = None,
                 resizer: Resizer | None = None) -> nn.Module:
    """A drop-in module that runs ``model``'s training steps as planned steps.

    Parameters
    ----------
    model : torch.nn.Module
    planner : callable
        ``planner(model, args, kwargs) -> step`` (it captures, solves and builds the
        step); called once per input signature, on the first call in training mode with
        gradients enabled, or by ``wrapper.remat_plan_now(args, kwargs)``. It is called
        with ``model``'s own hooks off (the wrapper's ``__call__`` runs them).
    copy_planner : callable, optional
        ``copy_planner(copy) -> planner`` for a ``copy.deepcopy`` of the wrapper (it may
        set attributes of the copy, such as its report); default: the same ``planner``.
    resizer : callable, optional
        Shape families (:func:`size_family`): ``resizer(model, step, args, kwargs) ->
        step or None`` runs a plan's decisions on a call that differs from the planned
        one only in sizes, none larger (None: the call is planned). Given, a call larger
        than every planned call of its family in some dimension is offered to
        ``resizer(..., larger=True)`` (a plan of a capture with symbolic sizes takes it
        without a capture), else planned once for the
        family's bucket (:func:`bucket_sizes`: the dimensions that grew rounded up to a
        power of two, on inputs grown by :func:`grown_inputs`) and runs that plan's
        decisions; where the bucket cannot be planned (a model that refuses the grown
        sizes, a budget too small for them) the call is planned at its own sizes.
        Default: a plan per input signature.

    Returns
    -------
    torch.nn.Module
        A shallow copy of ``model``: same class, same parameter and buffer objects, same
        ``state_dict`` keys, its own ``_modules``/``_parameters``/``_buffers`` dicts;
        ``model`` itself is not changed. ``remat_steps`` maps input signatures to their
        steps (the :data:`PLAN_CACHE_SIZE` most recently used plans, and up to
        :data:`SIZED_CACHE_SIZE` steps running them at other sizes); a module-mode step's
        actions are ``remat_plan``.

    Raises
    ------
    HookNotRun
        On a call whose step runs a captured graph while a submodule has a forward or
        backward hook (it would not fire); the message names the hook.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> fast = wrap_planned(net, lambda m, a, k: ModuleStep(m, {"0": "full"}))
    >>> x = torch.randn(2, 4)
    >>> torch.equal(fast(x), net(x)), fast.remat_plan
    (True, {'0': 'full'})
    >>> _ = fast.eval(); fast.training, net.training, net[0].training
    (False, False, False)
    """
    wrapper = copy.copy(model)
    for name in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        if name in model.__dict__:
            wrapper.__dict__[name] = type(model.__dict__[name])(model.__dict__[name])
    _install(wrapper, model, planner, copy_planner, resizer)
    return wrapper


def _install(wrapper: nn.Module, model: nn.Module, planner: Planner,
             copy_planner: Callable[[nn.Module], Planner] | None, resizer: Resizer | None = None) -> None:
    """Give ``wrapper`` the forward, train, plan cache and copy rules of a planned
    module of ``model``."""
    original_forward = type(model).forward
    cache = _PlanCache(wrapper, model, planner, resizer)

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (wrapper.training and model.training and torch.is_grad_enabled()):
            return original_forward(wrapper, *args, **kwargs)
        if torch.compiler.is_compiling():
            # traced once by Dynamo, and the store replayed before every compiled call
            cache.compiled_call = True
        return cache.planned_forward(args, kwargs)

    def train(mode: bool = True) -> nn.Module:
        type(wrapper).train(wrapper, mode)
        model.training = mode
        return wrapper

    wrapper.forward = forward
    wrapper.train = train
    wrapper.__deepcopy__ = functools.partial(_deep_copy, wrapper, model, planner, copy_planner, resizer)
    wrapper.__reduce_ex__ = functools.partial(_reduce, wrapper, model)
    wrapper.remat_steps = cache.steps
    wrapper.remat_plan_now = cache.plan_now


_IN_COMPILED_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_in_compiled_call", default=False)


def in_compiled_call() -> bool:
    """Whether the planned step running now was called from a frame that
    ``torch.compile`` compiled (``torch.compile(fast)``, or a compiled function that
    calls it). On CPU the watch does not start its profiler there: a CPU profiler
    started inside a compiled call and left running into the next one made the
    gradients of later steps wrong (torch 2.15, backends "eager" and "aot_eager",
    about a third of fresh processes).

    Examples
    --------
    >>> in_compiled_call()
    False
    """
    return _IN_COMPILED_CALL.get()


class _PlanCache:
    """The steps of a planned module (:func:`_install`), per input signature: a call
    runs its signature's step (:meth:`planned_forward`), or a planned call's that differs
    only in keywords that do not change the forward (:meth:`as_planned_call`), or a
    resized plan of its size family (:meth:`in_family`), or a plan made for it
    (:meth:`plan_now`)."""

    def __init__(self, wrapper: nn.Module, model: nn.Module, planner: Planner, resizer: Resizer | None) -> None:
        self.wrapper, self.model, self.planner, self.resizer = wrapper, model, planner, resizer
        self.original_forward = type(model).forward
        self.steps: OrderedDict[tuple, Any] = OrderedDict()
        self.dropped: set[tuple] = set()  # signatures whose plans the cache dropped
        self.warned = False  # the cache has dropped a plan (a warning, once)
        self.checked = -1  # hook_registrations() when the submodules were last seen without hooks
        self.templates: dict[tuple, tuple] = {}  # per planned signature, its call's keywords (_call_template)
        self.same_as: dict[tuple, tuple | None] = {}  # a new signature -> the planned one it runs, or None
        self.sized: set[tuple] = set()  # signatures whose steps run another signature's plan (resizer)
        self.compiled_call = False  # the running call came through a torch.compile'd frame
        self.cache_keyword: tuple[bool, int] | None = None  # the forward takes use_cache, and at which position
        self.cache_warned = False  # use_cache was turned off for training (warned once)
        self.cache_note: str | None = None

    def without_cache(self, args: tuple, kwargs: dict) -> dict:
        """A training call's keywords with ``use_cache=False`` where the forward takes a
        ``use_cache`` keyword that the call (or the model's ``config``) leaves on, as
        Hugging Face's own gradient checkpointing does: a key-value cache is of no use to
        a training step, and the cache objects a model returns are not tensors a captured
        step can return. A forward that passes its ``**kwargs`` on (a PEFT model's) takes
        it where the model's ``config`` has a ``use_cache``. Warned once per module; the
        report notes it."""
        if self.cache_keyword is None:
            params = inspect.signature(self.original_forward).parameters
            names = list(params)
            named = "use_cache" in params and params["use_cache"].kind != inspect.Parameter.POSITIONAL_ONLY
            passed_on = ("use_cache" not in params and any(p.kind == inspect.Parameter.VAR_KEYWORD
                                                           for p in params.values())
                         and hasattr(getattr(self.model, "config", None), "use_cache"))
            self.cache_keyword = (named or passed_on, names.index("use_cache") if named else -1)
        takes, position = self.cache_keyword
        if not takes or 0 <= position - 1 < len(args):  # (position counts self) given positionally: as given
            return kwargs
        given = kwargs.get("use_cache")
        on = given if given is not None else getattr(getattr(self.model, "config", None), "use_cache", False)
        if not on:
            return kwargs
        if not self.cache_warned:
            self.cache_warned = True
            why = ("use_cache=True is of no use in a training step, and the cache a model returns cannot be part "
                   "of a planned step: training calls run with use_cache=False (as Hugging Face's gradient "
                   "checkpointing does); eval() and no_grad() calls run as given")
            warnings.warn(f"{type(self.model).__name__}: {why}", stacklevel=5)
            self.cache_note = why
        return {**kwargs, "use_cache": False}

    @torch.compiler.disable
    def plan_now(self, args: tuple, kwargs: dict) -> Any:
        """Plan the call, keep its step (dropping the least recently used plan past
        :data:`PLAN_CACHE_SIZE`) and return it."""
        steps, model, wrapper = self.steps, self.model, self.wrapper
        kwargs = self.without_cache(args, kwargs)
        key = input_signature(args, kwargs)
        again = "it was planned before" if key in steps else (
            f"its plan was dropped (a module keeps the {PLAN_CACHE_SIZE} most recently used plans)"
            if key in self.dropped else None)
        with root_hooks_off(model):
            step = self.planner(model, args, kwargs)
        self.keep(key, step, args, kwargs)
        self.dropped.discard(key)
        while len(steps) - len(self.sized) > PLAN_CACHE_SIZE:
            old = next(k for k in steps if k not in self.sized)
            del steps[old]
            if not self.warned:
                warnings.warn(f"{type(model).__name__} was called with more than {PLAN_CACHE_SIZE} input "
                              "signatures (shapes, dtypes, autocast state) in training: the least recently "
                              "used plan is dropped and made again when its signature comes back; pad inputs "
                              "to a few fixed shapes to plan once", stacklevel=4)
            self.dropped.add(old)
            self.warned = True
        actions = getattr(step, "actions", None)  # a module-mode step, perhaps wrapped
        if actions is not None:
            wrapper.remat_plan = actions
        report = wrapper.__dict__.get("report")
        if again is not None and report is not None:
            report.notes.append(f"this plan was made again for an input signature: {again}")
        if self.cache_note is not None and report is not None and self.cache_note not in report.notes:
            report.notes.append(self.cache_note)
        self.checked = -1
        return step

    def keep(self, key: tuple, step: Any, args: tuple, kwargs: dict, *, resized: bool = False) -> None:
        """Keep ``step`` as the most recently used, for the signature ``key``."""
        steps, sized = self.steps, self.sized
        steps[key] = step
        steps.move_to_end(key)
        self.templates[key] = _call_template(args, kwargs)
        self.same_as.clear()  # a call that found no plan before may find one now
        if resized:
            sized.add(key)
            while len(sized) > SIZED_CACHE_SIZE:  # made again, cheaply, if it comes back
                old = next(k for k in steps if k in sized)
                del steps[old]
                sized.discard(old)
        else:
            sized.discard(key)

    def in_family(self, args: tuple, kwargs: dict, key: tuple) -> Any:
        """The step of a call of a planned family: a plan's decisions at its sizes (the
        smallest planned call that covers it), or a plan for the family's bucket when
        it is larger than every one; None where it is planned on its own."""
        steps = self.steps
        family = size_family(key)
        planned = [k for k in steps if k not in self.sized and size_family(k) == family]
        if not planned:
            return None
        covering = [k for k in planned if _covers(k, key)]
        grown = None
        if covering:
            base = min(covering, key=lambda k: sum(math.prod(s) for s in _sizes(k)))
            base_step = steps[base]
            steps.move_to_end(base)
        else:
            with root_hooks_off(self.model):
                step = self.resizer(self.model, steps[planned[-1]], args, kwargs, larger=True)
            if step is not None:
                self.keep(key, step, args, kwargs, resized=True)
                return step
            sizes = bucket_sizes(key, planned)
            big_args, big_kwargs = grown_inputs(args, kwargs, sizes)
            try:
                base_step = self.plan_now(big_args, big_kwargs)
                grown = input_signature(big_args, big_kwargs)
            except Exception as exc:  # the model or the budget does not take the bucket's sizes
                log.info("no plan for the bucket %s (%s): planning the call's own sizes", sizes, exc)
                return None
            report = self.wrapper.__dict__.get("report")
            if report is not None:
                report.notes.append(f"planned for the inputs' sizes up to {', '.join(map(str, sizes))} (the "
                                    "dimensions that vary rounded up to a power of two); calls no larger in any "
                                    "dimension run its decisions")
        if grown == key:  # the call has the bucket's sizes: the plan is its own
            return base_step
        with root_hooks_off(self.model):
            step = self.resizer(self.model, base_step, args, kwargs)
        if step is not None:
            self.keep(key, step, args, kwargs, resized=True)
        return step

    def check_hooks(self) -> None:
        """Refuse a step that runs a captured graph while a submodule has a hook."""
        now = hook_registrations()
        if now == self.checked:
            return
        found = forward_hooks(self.wrapper, root=False)
        if found:
            raise HookNotRun(
                f"{type(self.model).__name__}'s planned step runs a captured graph, which does not call its "
                f"submodules, so these hooks would not fire: {', '.join(found)}. Remove them, or optimize "
                "the model with mode='module' (its steps call the submodules, and their hooks fire)")
        self.checked = now

    # a compiled caller (torch.compile of the module or of a function calling it) runs
    # the planned step as it is: Dynamo does not trace planning, nor the step, whose
    # graphs already are what the plan runs (compiler="inductor" compiles them)
    @torch.compiler.disable
    def planned_forward(self, args: tuple, kwargs: dict) -> Any:
        """Run the training call's step, planning it first where no step serves."""
        steps = self.steps
        kwargs = self.without_cache(args, kwargs)
        key = input_signature(args, kwargs)
        if key not in steps and steps:
            args, kwargs, key = self.as_planned_call(args, kwargs, key)
        step = steps.get(key)
        if step is None and self.resizer is not None and steps:
            step = self.in_family(args, kwargs, key)
        if step is None:
            step = self.plan_now(args, kwargs)
        else:
            steps.move_to_end(key)
        if getattr(step, "hooks_captured", True):
            self.check_hooks()
        compiled, self.compiled_call = self.compiled_call, False
        token = _IN_COMPILED_CALL.set(compiled)
        try:
            return step(self.wrapper, args, kwargs)
        finally:
            _IN_COMPILED_CALL.reset(token)

    def as_planned_call(self, args: tuple, kwargs: dict, key: tuple) -> tuple[tuple, dict, tuple]:
        """The call made like a planned call (its keywords) where the two differ only in
        keywords that do not change the forward, checked once per new signature; with a
        ``resizer``, a planned call of the same family counts (sizes may differ)."""
        same_as, templates, resizer = self.same_as, self.templates, self.resizer
        if key not in same_as:
            same_as[key] = None
            for planned in reversed(self.steps):
                other = _as_planned(args, kwargs, templates[planned])
                if other is None:
                    continue
                like = input_signature(args, other)
                if like == key:
                    continue
                if ((like == planned or (resizer is not None and size_family(like) == size_family(planned)))
                        and same_forward(self.original_forward, self.wrapper, (args, kwargs), (args, other))):
                    same_as[key] = planned
                    break
        planned = same_as[key]
        if planned is None or planned not in templates:
            return args, kwargs, key
        other = _as_planned(args, kwargs, templates[planned])
        return args, other, input_signature(args, other)


def _deep_copy(wrapper: nn.Module, model: nn.Module, planner: Planner,
               copy_planner: Callable[[nn.Module], Planner] | None, resizer: Resizer | None,
               memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a planned module: a copy of ``model`` and of the wrapper's
    own state, without plans, planned again on its first training call."""
    model_copy = copy.deepcopy(model, memo)
    new = object.__new__(type(wrapper))
    memo[id(wrapper)] = new
    state = {k: v for k, v in wrapper.__dict__.items() if k not in PLAN_STATE and not k.startswith("_remat")}
    new.__dict__.update(copy.deepcopy(state, memo))
    for m in list(model_copy.modules()) + list(new.modules()):
        _drop_plan_wrapper(m)
    new_planner = planner if copy_planner is None else copy_planner(new)
    _install(new, model_copy, new_planner, copy_planner, resizer)
    return new


def _reduce(wrapper: nn.Module, model: nn.Module, protocol: int) -> Any:
    """Pickling a planned module is refused when the pickle is written; ``copy.copy``,
    which reduces too, gets a shallow copy."""
    refusal = _Refused(f"a module returned by solver.optimize is not pickled (its plans hold captured "
                       f"graphs and closures): save its state_dict(), whose keys are those of "
                       f"{type(model).__name__}, or the original model, and optimize it again after loading")
    return _rebuild, (refusal, type(wrapper)), dict(wrapper.__dict__)


class _Refused:
    """Pickling it raises :class:`NotPicklable` with its message (a shallow copy passes
    it along untouched)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce_ex__(self, protocol: int) -> Any:
        raise NotPicklable(self.message)


def _rebuild(refusal: _Refused, cls: type) -> nn.Module:
    return object.__new__(cls)


def _drop_plan_wrapper(module: nn.Module) -> None:
    """Undo, on a deep copy, module mode's per-block forward wrapper: copied, it would
    still call the block it was made for (the original's parameters)."""
    forward = module.__dict__.get("forward")
    original = getattr(forward, "__remat_original__", None)
    if original is not None and getattr(original, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]

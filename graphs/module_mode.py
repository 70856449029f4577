"""Layer-level rewrite: run chosen submodules under checkpoint, selective checkpoint or
offload, the form that trainers, FSDP2 and Hugging Face models compose with.

A plan maps submodule names (``model.get_submodule`` paths) to one of

``"none"``
    store every activation (plain eager).
``"full"``
    non-reentrant :func:`torch.utils.checkpoint.checkpoint`: keep the block's inputs,
    recompute its forward just before its backward.
``"selective"``
    the same with a selective-checkpoint policy
    (:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that recomputes
    the attention core and saves the rest (Korthikanti et al.).
``"save_matmuls"``
    the same with a policy that saves the outputs of matmul-like ops and recomputes the
    cheap rest (:mod:`graphs.actions` defines both rules).
``"offload"``
    :class:`torch.autograd.graph.save_on_cpu`: the block's saved tensors go to host
    memory during forward and come back in backward. (torch's ``*_CPU_OFFLOAD``
    checkpoint policies are treated as recompute in eager mode; saved-tensor hooks are
    what really offloads.)

Guarantees: dropout and every other RNG op give the same values on recomputation
(``preserve_rng_state=True``); buffers that a block mutates in forward (BatchNorm running
statistics) are updated once per step, not again on recomputation; the wrapped model keeps
its parameters, ``state_dict`` keys and forward signature. The user's model is not changed
in behaviour: the wrappers only act while the returned module runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphs.actions import LayerAction, op_packet, saves_output
from graphs.errors import RematError

__all__ = ["LAYER_ACTIONS", "apply_module_plan", "layer_blocks", "selective_policy", "ModulePlanError",
           "measure_block_actions"]

#: the actions a plan may name (:class:`graphs.actions.LayerAction`)
LAYER_ACTIONS = tuple(a.value for a in LayerAction)

_state = threading.local()


class ModulePlanError(RematError, ValueError):
    """A module plan that names unknown submodules or actions."""


def layer_blocks(model: nn.Module, *, blocks: Iterable[str] | None = None) -> list[str]:
    """Module paths of a model's repeated layers: a transformer's layers (HF
    ``model.layers``, ``transformer.h``, ``encoder.layer``; torchvision's
    ``encoder.layers``), a ResNet's residual blocks in every stage; chosen by structure
    and by the share of the parameters they hold (:func:`graphs.layers.pick_layers`),
    not by the longest container. A model without two alike submodules gives its
    top-level children.

    Parameters
    ----------
    model : torch.nn.Module
    blocks : iterable of str, optional
        Module paths chosen by the caller: checked (each names a submodule, none lies
        inside another) and returned as given.

    Returns
    -------
    list of str

    Raises
    ------
    ModulePlanError
        A name in ``blocks`` that is not a submodule, or one inside another.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> layer_blocks(net)
    ['0', '1', '2']
    >>> layer_blocks(net, blocks=["3"])
    Traceback (most recent call last):
    ...
    graphs.module_mode.ModulePlanError: blocks=: the model has no submodule '3' (its layers are ['0', '1', '2'])
    """
    if blocks is not None:
        return _checked_blocks(model, list(blocks))
    from graphs.layers import ModuleInfo, pick_layers

    mods = list(model.named_modules())
    weight: dict[str, float] = {}
    for name, mod in reversed(mods):  # children before parents
        own = sum(p.numel() for p in mod.parameters(recurse=False))
        weight[name] = float(own + sum(weight.get(f"{name}.{k}" if name else k, 0.0)
                                       for k, _ in mod.named_children()))
    info = {name: ModuleInfo(type(mod).__qualname__, weight[name],
                             isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)))
            for name, mod in mods}
    return pick_layers(info) or [k for k, _ in model.named_children()]


def _checked_blocks(model: nn.Module, names: list[str]) -> list[str]:
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ModulePlanError(f"blocks=: the model has no submodule {name!r} (its layers are "
                                  f"{layer_blocks(model)})") from None
    for a in names:
        for b in names:
            if a != b and (b.startswith(a + ".") or a == ""):
                raise ModulePlanError(f"blocks=: {b!r} lies inside {a!r}; name one of them")
    if len(set(names)) != len(names):
        raise ModulePlanError(f"blocks=: a name appears twice in {names}")
    return names


def _active_plan() -> Mapping[str, str] | None:
    return getattr(_state, "plan", None)


@contextlib.contextmanager
def plan_active(plan: Mapping[str, str]):
    """Within the ``with`` block, ``plan`` (block -> action) is the plan that the wrapped
    blocks of this thread read; the plan before is put back on leaving it.

    Examples
    --------
    >>> with plan_active({"0": "full"}):
    ...     _active_plan()
    {'0': 'full'}
    """
    prev = getattr(_state, "plan", None)
    _state.plan = plan
    try:
        yield
    finally:
        _state.plan = prev


def selective_policy(save_ops: set | None = None, *, action: LayerAction | str = LayerAction.SAVE_MATMULS,
                     recompute_ops: Iterable[str] | None = None) -> Callable:
    """A selective-checkpoint policy for
    :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`: the rule of
    ``action`` (:func:`graphs.actions.saves_output`; default ``save_matmuls``: save the
    outputs of matmuls, convolutions and fused attention, recompute everything else;
    ``selective``: recompute the attention core, save the rest). ``save_ops`` (a set of
    ops whose outputs are saved) or ``recompute_ops`` (op packet names recomputed) replace
    the rule.

    Examples
    --------
    >>> from torch.utils.checkpoint import CheckpointPolicy
    >>> fn = selective_policy(action="selective")
    >>> fn(None, torch.ops.aten.bmm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    True
    >>> selective_policy()(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    True
    """
    from torch.utils.checkpoint import CheckpointPolicy

    if save_ops is not None:
        ops = set(save_ops)

        def saved(op) -> bool:
            return op in ops
    elif recompute_ops is not None:
        names = frozenset(recompute_ops)

        def saved(op) -> bool:
            return op_packet(op) not in names
    else:
        rule = LayerAction(action)

        def saved(op) -> bool:
            return saves_output(rule, op)

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if saved(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def _buffers_snapshot(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers() if b is not None]


def _context_fn(module: nn.Module, action: str, owner: "_BlockForward | None" = None):
    """Contexts for checkpoint: forward as is; recomputation flagged, with the module's
    buffers restored afterwards so that running statistics are updated once. Under a
    selective policy, the draws of random ops are replayed (:class:`_DrawReplay`) unless
    ``owner``'s block drew nothing on its first checkpointed forward: a block without
    random ops then runs with torch's selective-checkpoint mode alone."""

    def make():
        if action in (LayerAction.SELECTIVE, LayerAction.SAVE_MATMULS):
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            fwd_ctx, rec_ctx = create_selective_checkpoint_contexts(selective_policy(action=action))
            if owner is None or owner.draws is not False:
                draws = _DrawReplay()
                noted = None if owner is None else (lambda: owner.saw_draws(bool(draws.states)))
                fwd_ctx, rec_ctx = (_Stacked(fwd_ctx, draws.mode(recompute=False), after=noted),
                                    _Stacked(rec_ctx, draws.mode(recompute=True)))
        else:
            fwd_ctx, rec_ctx = contextlib.nullcontext(), contextlib.nullcontext()
        return fwd_ctx, _RecomputeContext(module, rec_ctx)

    return make


class _DrawReplay:
    """Makes the random ops that a selective checkpoint recomputes draw what they drew in
    the forward.

    Checkpointing restores the generator state of the block's start before recomputing,
    which replays the draws only when every random op of the block runs again. A policy
    that saves some random ops' outputs (a fused attention with dropout under
    ``save_matmuls``, on CUDA) and recomputes later ones (the dropout after it) would
    have the later ones draw from the state before the saved ones drew: other masks.
    So a dispatch mode above the forward's notes the generator state before each random
    op, and one above the recomputation's sets it again before each random op there (a
    saved op does not draw; one that runs again draws what it drew). One per
    checkpointed call of a block."""

    def __init__(self) -> None:
        self.states: list = []

    def mode(self, *, recompute: bool):
        from graphs.capture import op_draws
        from graphs.rewrite import rng_state, rng_swap
        from graphs.torch_internals import TorchDispatchMode

        states, replay = self.states, iter(self.states)

        class _Draws(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if op_draws(func, args, kwargs):
                    if recompute:
                        device, state = next(replay, (None, None))
                        if state is not None:
                            rng_swap(state, device)
                    else:
                        device = kwargs.get("device") or next(
                            (a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
                        device = torch.device(device)
                        states.append((device, rng_state(device)))
                return func(*args, **kwargs)

        return _Draws()


class _Stacked:
    """Enter ``inner``, then ``mode`` above it; leave in the reverse order, then call
    ``after()`` (when given)."""

    def __init__(self, inner, mode, after: Callable[[], None] | None = None) -> None:
        self.inner, self.mode, self.after = inner, mode, after

    def __enter__(self):
        out = self.inner.__enter__()
        self.mode.__enter__()
        return out

    def __exit__(self, *exc):
        try:
            self.mode.__exit__(*exc)
        finally:
            out = self.inner.__exit__(*exc)
        if self.after is not None and exc[0] is None:
            self.after()
        return out


class _RecomputeContext:
    def __init__(self, module: nn.Module, inner) -> None:
        self.module, self.inner = module, inner

    def __enter__(self):
        self.snapshot = _buffers_snapshot(self.module)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for buf, saved in self.snapshot:
                    buf.copy_(saved)
            self.snapshot = []


class _BlockForward:
    """A layer block's forward under the active plan (set on the block as ``forward``).

    An object rather than a closure, so that ``copy.deepcopy`` of a model whose blocks
    carry it gives blocks that run with their own parameters: ``module`` and the bound
    ``original`` are copied with the block."""

    def __init__(self, module: nn.Module, name: str, original: Callable) -> None:
        self.module, self.name, self.__remat_original__ = module, name, original
        #: whether the block's first checkpointed forward under a selective policy drew
        #: random numbers (None: not run yet); one that did not runs without the replay
        self.draws: bool | None = None
        functools.update_wrapper(self, original)  # signature and name of the block's forward

    def saw_draws(self, drew: bool) -> None:
        if self.draws is None:
            self.draws = drew

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original, module = self.__remat_original__, self.module
        plan = _active_plan()
        action = plan.get(self.name, LayerAction.NONE) if plan is not None else LayerAction.NONE
        if action == LayerAction.NONE or not torch.is_grad_enabled() or not module.training:
            return original(*args, **kwargs)
        if action == LayerAction.OFFLOAD:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return original(*args, **kwargs)
        return checkpoint(
            original, *args, use_reentrant=False, preserve_rng_state=True,
            context_fn=_context_fn(module, action, self), **kwargs,
        )


def _wrapped_forward(module: nn.Module, name: str, original: Callable) -> Callable:
    return _BlockForward(module, name, original)


def apply_module_plan(model: nn.Module, plan: Mapping[str, str]) -> nn.Module:
    """Return a drop-in module that runs ``model`` with ``plan`` applied.

    Parameters
    ----------
    model : torch.nn.Module
    plan : mapping of submodule name to action
        Actions from :data:`LAYER_ACTIONS`. Names are ``model.get_submodule`` paths.
        Nested checkpoint regions are not allowed (a name inside another planned one).

    Returns
    -------
    torch.nn.Module
        A shallow copy of ``model`` (same class, same parameter and buffer objects, same
        ``state_dict`` keys) whose forward applies the plan. ``model`` itself behaves as
        before.

    Raises
    ------
    ModulePlanError
        Unknown submodule or action, or nested regions.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> fast = apply_module_plan(net, {"0": "full"})
    >>> x = torch.randn(2, 4)
    >>> torch.equal(fast(x), net(x)), list(fast.state_dict()) == list(net.state_dict())
    (True, True)
    """
    plan = {k: v for k, v in plan.items() if v != LayerAction.NONE}
    for name, action in plan.items():
        if action not in LAYER_ACTIONS:
            raise ModulePlanError(f"unknown action {action!r} for {name!r}; choose one of {LAYER_ACTIONS}")
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ModulePlanError(f"the model has no submodule {name!r}") from None
    names = sorted(plan)
    for a in names:
        for b in names:
            if a != b and (b.startswith(a + ".") or a == ""):
                raise ModulePlanError(f"nested regions: {b!r} lies inside {a!r}; plan one of them")
    for name in plan:
        sub = model.get_submodule(name)
        if not hasattr(sub.forward, "__remat_original__"):
            sub.forward = _wrapped_forward(sub, name, sub.forward)
        else:  # already wrapped by an earlier plan: rebind its name lookup
            sub.forward = _wrapped_forward(sub, name, sub.forward.__remat_original__)
    wrapper = copy.copy(model)
    frozen = dict(plan)
    original_forward = type(model).forward

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with plan_active(frozen):
            return original_forward(wrapper, *args, **kwargs)

    wrapper.forward = forward
    wrapper.remat_plan = frozen
    return wrapper


class _Stop(Exception):
    """Ends a forward once a block's inputs are seen."""


def _block_inputs(model: nn.Module, block: str, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The inputs ``block`` gets in a forward of ``model`` (the forward stops there),
    detached, floating ones requiring gradients as in training."""
    seen: list = []

    def grab(_module, a, k):
        seen.append((a, k))
        raise _Stop

    sub = model.get_submodule(block)
    handle = sub.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(*args, **dict(kwargs))
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ModulePlanError(f"the block {block!r} did not run in the model's forward; name a block that runs")

    def prepared(x):
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            return x.requires_grad_(True) if x.is_floating_point() else x
        return x

    from graphs.torch_internals import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((tuple(seen[0][0]), dict(seen[0][1])))
    a, k = tree_unflatten([prepared(x) for x in leaves], spec)
    return a, k


def measure_block_actions(model: nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None, *, block: str,
                          actions: Iterable[str] = ("none", "full", "save_matmuls"), repeats: int = 3,
                          warmup: int = 1) -> dict[str, float]:
    """Seconds of one forward and backward of ``block`` under each action, on the inputs
    it gets in ``model``'s forward: what a selective policy costs (torch's dispatch mode
    on every op, the replay of draws) next to checkpointing the block whole, on this
    machine, where the graph's op times leave it out.

    Process CPU time on CPU; on an accelerator, wall time with the device synchronized
    around each run. The median of ``repeats`` runs after ``warmup``, the actions taking
    turns.

    Parameters
    ----------
    model : torch.nn.Module
        In training mode.
    args, kwargs
        A batch of the model's inputs.
    block : str
        A module path (one of :func:`layer_blocks`).
    actions : iterable of str
    repeats, warmup : int

    Returns
    -------
    dict
        Action -> seconds.

    Examples
    --------
    >>> net = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Linear(8, 1))
    >>> times = measure_block_actions(net, (torch.randn(4, 8),), block="0", repeats=1)
    >>> sorted(times), all(t > 0 for t in times.values())
    (['full', 'none', 'save_matmuls'], True)
    """
    import statistics
    import time

    actions = list(dict.fromkeys(actions))
    for a in actions:
        if a not in LAYER_ACTIONS:
            raise ModulePlanError(f"unknown action {a!r}; choose among {LAYER_ACTIONS}")
    with torch.random.fork_rng(devices=[]):
        bargs, bkwargs = _block_inputs(model, block, args, kwargs or {})
    sub = model.get_submodule(block)
    wrapped = _BlockForward(sub, block, sub.forward)
    device = next((t.device for t in bargs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    accelerator = device.type not in ("cpu", "meta")
    stats = (torch.cuda if device.type == "cuda" else torch.accelerator) if accelerator else None
    params = [p for p in sub.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:  # (a backward would accumulate into the held tensors in place)
        p.grad = None

    def once(action: str) -> float:
        if accelerator:
            stats.synchronize(device)
        t0 = time.perf_counter() if accelerator else time.process_time()
        with plan_active({block: action}):
            out = wrapped(*bargs, **bkwargs)
        leaves = [t for t in _tensors(out) if t.requires_grad]
        if leaves:
            torch.autograd.backward([t.float().sum() for t in leaves])
        if accelerator:
            stats.synchronize(device)
        return (time.perf_counter() if accelerator else time.process_time()) - t0

    snapshot = _buffers_snapshot(sub)
    times: dict[str, list[float]] = {a: [] for a in actions}
    try:
        with torch.random.fork_rng(devices=[device] if accelerator else []):  # the user's draws stay theirs
            for k in range(warmup + repeats):
                for a in actions:
                    t = once(a)
                    if k >= warmup:
                        times[a].append(t)
    finally:  # the gradients and buffers as found (graphs does not use solver.join.checks.step_undone)
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for buf, saved in snapshot:
                buf.copy_(saved)
    return {a: statistics.median(v) for a, v in times.items()}


def _tensors(out: Any) -> list:
    from graphs.torch_internals import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

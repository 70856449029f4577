"""Run a module-mode remat plan under FSDP2 or DDP, and see what one rank holds.

Composition (what runs where):

* **FSDP2** (:func:`torch.distributed.fsdp.fully_shard`): :func:`apply_under_fsdp`
  first wraps the planned layers' forwards (non-reentrant checkpoint, selective
  checkpoint or offload, :func:`graphs.module_mode.apply_module_plan`), then shards each
  unit and the root. The checkpoint region therefore lies *inside* the unit: FSDP2's
  pre-forward hook all-gathers the unit's parameters, the checkpointed forward runs,
  the post-forward hook frees them; in backward FSDP2's pre-backward hook gathers them
  again before the recomputation runs, and its post-backward hook reduce-scatters the
  gradients. The root module itself is returned (FSDP2 swaps its class in place), with
  a forward that activates the plan inside the root's hooks.
* **DDP** (:class:`torch.nn.parallel.DistributedDataParallel`): :func:`apply_under_ddp`
  wraps the module returned by :func:`graphs.module_mode.apply_module_plan` (module
  mode) or by :func:`solver.optimize` in graph mode (a
  :class:`graphs.graph_mode.ScheduledStep` is one autograd function whose gradients
  land on the same parameter objects, so DDP's all-reduce hooks on their gradient
  accumulators fire as usual).

Not supported (raise :class:`DistributedPlanError`): graph mode under FSDP2 (the
scheduled step reads whole parameters, FSDP2 holds shards between units), offload
plans under FSDP2 (``save_on_cpu`` would also move the all-gathered parameters that
autograd saves), and nested plans.

:func:`rank_tensors` lists what a rank holds before a step (local shards of
parameters, gradients and optimizer state; buffers; DDP's gradient buckets), the roots
to give :class:`graphs.memory.MemoryTracker` on that rank: a ``DTensor`` reports the
storage size of the *global* tensor, so the tracker must see local tensors only.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from graphs.errors import RematError
from graphs.memory import MemoryTracker
from graphs.module_mode import apply_module_plan, plan_active
from graphs.torch_internals import local_tensor, storage_key, tree_leaves

__all__ = [
    "DistributedPlanError", "SUPPORTED", "check_supported", "fsdp_units", "apply_under_fsdp",
    "apply_under_ddp", "rank_tensors", "unit_param_bytes", "RankMemoryTracker",
]

log = logging.getLogger(__name__)

#: (sharding, mode) pairs that run and are tested; every other pair raises.
SUPPORTED = (("fsdp", "module"), ("ddp", "module"), ("ddp", "graph"))


class DistributedPlanError(RematError, ValueError):
    """A remat plan that cannot run under the requested data-parallel engine."""


def check_supported(sharding: str | None, mode: str, plan: Mapping[str, str] | None = None) -> None:
    """Raise :class:`DistributedPlanError` unless ``(sharding, mode)`` is supported.

    Parameters
    ----------
    sharding : {"fsdp", "ddp", None}
    mode : {"graph", "module"}
    plan : mapping, optional
        A module plan; offload actions are refused under FSDP2.

    Raises
    ------
    DistributedPlanError

    Examples
    --------
    >>> check_supported("ddp", "graph")
    >>> check_supported("fsdp", "graph")
    Traceback (most recent call last):
    ...
    graphs.distributed.DistributedPlanError: graph mode under FSDP2 is not supported: ...
    """
    if sharding is None:
        return
    if sharding not in ("fsdp", "ddp"):
        raise DistributedPlanError(f"unknown sharding {sharding!r}; use 'fsdp' (FSDP2 fully_shard), "
                                   "'ddp' (DistributedDataParallel) or None")
    if (sharding, mode) not in SUPPORTED:
        raise DistributedPlanError(
            f"graph mode under FSDP2 is not supported: the scheduled step reads whole parameters, while "
            f"FSDP2 holds shards outside each unit's forward and backward; use mode='module' "
            f"(checkpoint inside each fully_shard unit) or sharding='ddp'. Supported: {SUPPORTED}")
    if sharding == "fsdp" and plan is not None:
        off = sorted(k for k, v in plan.items() if v == "offload")
        if off:
            raise DistributedPlanError(
                f"offload under FSDP2 is not supported ({', '.join(off)}): save_on_cpu would also move the "
                "all-gathered parameters that autograd saves; use 'full' or 'selective' for these blocks, "
                "or FSDP2's own offload_policy=CPUOffloadPolicy() for parameters")


def fsdp_units(model: nn.Module, plan: Mapping[str, str] | None = None,
               blocks: Sequence[str] | None = None) -> list[str]:
    """The submodules to ``fully_shard`` besides the root: the given ``blocks``, else the
    planned blocks plus their siblings in the same container, else the children of the
    model's longest ``ModuleList``/``Sequential``.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> fsdp_units(net)
    ['0', '1', '2']
    """
    if blocks is not None:
        return list(blocks)
    best: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kids = [f"{name}.{k}" if name else k for k, _ in mod.named_children()]
            if plan and any(p in kids for p in plan):
                return kids
            if len(kids) > len(best):
                best = kids
    return best


def apply_under_fsdp(model: nn.Module, plan: Mapping[str, str], *, mesh: Any = None,
                     units: Sequence[str] | None = None, reshard_after_forward: bool = True,
                     **fully_shard_kwargs: Any) -> nn.Module:
    """Apply a module-mode plan, then shard with FSDP2: checkpoint inside each unit.

    Parameters
    ----------
    model : torch.nn.Module
        Not yet sharded; sharded in place (FSDP2 swaps its class and parameters).
    plan : mapping of submodule name to action
        ``"none"``, ``"full"`` or ``"selective"`` (see :mod:`graphs.module_mode`). A
        planned block may be a unit or lie inside one.
    mesh : DeviceMesh, optional
        1-D data-parallel mesh (default: FSDP2's, over the default process group).
    units : sequence of str, optional
        Submodules to shard as units (default :func:`fsdp_units`); the root is always
        sharded last.
    reshard_after_forward : bool
        Passed to every unit (the root keeps its parameters gathered, as FSDP2 does).
    **fully_shard_kwargs
        Passed to every ``fully_shard`` call (``mp_policy``, ...).

    Returns
    -------
    torch.nn.Module
        ``model`` itself, sharded, whose training forward runs the plan. The plan is
        stored as ``model.remat_plan``.

    Raises
    ------
    DistributedPlanError
        Offload in the plan, or a unit that is not a submodule.
    """
    from torch.distributed.fsdp import fully_shard

    check_supported("fsdp", "module", plan)
    active = apply_module_plan(model, plan)  # wraps the planned submodules' forwards in place
    frozen = dict(active.remat_plan)
    names = fsdp_units(model, frozen, units)
    for name in names:
        try:
            sub = model.get_submodule(name)
        except AttributeError:
            raise DistributedPlanError(f"the model has no submodule {name!r} to shard") from None
        fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    original = type(model).forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with plan_active(frozen):
            return original(model, *args, **kwargs)

    model.forward = forward  # FSDP2's root hooks run around this, in nn.Module.__call__
    model.remat_plan = frozen
    model.remat_units = list(names)
    log.info("FSDP2 units %s with plan %s", names, frozen)
    return model


def apply_under_ddp(model: nn.Module, plan: Mapping[str, str] | None = None, *, record_buckets: bool = False,
                    **ddp_kwargs: Any) -> nn.Module:
    """Wrap a remat-planned module in ``DistributedDataParallel``.

    Parameters
    ----------
    model : torch.nn.Module
        A plain module (``plan`` is then applied with
        :func:`graphs.module_mode.apply_module_plan`) or a module already returned by
        :func:`solver.optimize` (graph or module mode; ``plan`` must be None).
    plan : mapping, optional
    record_buckets : bool
        Register an all-reduce comm hook (the same arithmetic as DDP's built-in one:
        divide by the world size, sum) that remembers the gradient buckets, so that
        :func:`rank_tensors` can count them from the first backward on. The buckets
        exist from construction, but a tracker otherwise sees them only when gradients
        are copied in, which in graph mode happens after the backward's peak.
    **ddp_kwargs
        Passed to ``DistributedDataParallel`` (``bucket_cap_mb``, ...).

    Returns
    -------
    torch.nn.parallel.DistributedDataParallel
        Its ``.module`` runs the plan; parameters are the model's own objects.
    """
    from torch.nn.parallel import DistributedDataParallel

    inner = apply_module_plan(model, plan) if plan else model
    ddp = DistributedDataParallel(inner, **ddp_kwargs)
    if record_buckets:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buckets: dict[int, torch.Tensor] = {}

        def hook(state, bucket):
            buckets[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        # DDP checks real annotations (this module's are strings, PEP 563)
        hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

        ddp.register_comm_hook(None, hook)
        ddp.remat_buckets = buckets
    return ddp


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t.detach()


def rank_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: Iterable[Any] = ()) -> list[torch.Tensor]:
    """The tensors a rank holds between steps, as local tensors.

    Parameters, their gradients and buffers (local shards of ``DTensor`` ones), the
    optimizer's state tensors, DDP's gradient buckets when ``model`` came from
    ``apply_under_ddp(..., record_buckets=True)`` and has run a backward, and
    the tensors in ``extra`` (the batch). Pass them to
    :class:`graphs.memory.MemoryTracker` as roots.

    Examples
    --------
    >>> lin = nn.Linear(2, 2)
    >>> sum(t.numel() for t in rank_tensors(lin))
    6
    """
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(_local(p))
        if p.grad is not None:
            out.append(_local(p.grad))
    out.extend(_local(b) for b in model.buffers())
    if optimizer is not None:
        for st in optimizer.state.values():
            out.extend(_local(v) for v in st.values() if isinstance(v, torch.Tensor))
    out.extend(getattr(model, "remat_buckets", {}).values())  # DDP, apply_under_ddp(record_buckets=True)
    for t in extra:
        if isinstance(t, torch.Tensor):
            out.append(_local(t))
    return out


def unit_param_bytes(model: nn.Module, units: Sequence[str]) -> dict[str, int]:
    """Bytes of the (global, unsharded) parameters that each FSDP2 unit owns; the root is
    ``""`` and owns what no unit does. Shared parameters count once, at the first owner.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> unit_param_bytes(net, ["1"])
    {'1': 12, '': 24}
    """
    out = {u: 0 for u in units}
    out[""] = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        owner = max((u for u in units if name.startswith(u + ".")), key=len, default="")
        out[owner] += p.numel() * p.element_size()
    return out


class RankMemoryTracker(MemoryTracker):
    """:class:`graphs.memory.MemoryTracker` for one rank of FSDP2 or DDP.

    Two things differ from a single-process step. FSDP2 frees an unsharded parameter or
    an all-gather buffer by resizing its storage to zero bytes and grows it back before
    the next all-gather: the storage object lives on, so a tracker that counts a storage
    from creation to destruction would count it forever. Here a storage is counted at
    its *current* size, re-read after every op. And a ``DTensor`` reports the storage
    of a global-sized tensor: its local tensor is counted instead.

    Parameters
    ----------
    *roots : tensors or containers of tensors
        What the rank holds before the block: use :func:`rank_tensors` (local tensors).
        Modules are refused (their ``DTensor`` parameters would count at global size).

    Examples
    --------
    >>> a = torch.ones(256)
    >>> with RankMemoryTracker([a]) as mt:
    ...     b = a * 2
    ...     _ = b.untyped_storage().resize_(0)   # freed the FSDP2 way
    ...     c = a + 1
    >>> mt.peak_bytes == 2 * 1024 and mt.current_bytes == 2 * 1024
    True
    """

    def __init__(self, *roots: Any) -> None:
        for r in roots:
            if isinstance(r, nn.Module):
                raise TypeError("pass rank_tensors(module) to RankMemoryTracker, not the module: DTensor "
                                "parameters report the storage size of the global tensor")
        super().__init__(*roots)
        self._storages: dict[int, Any] = {}

    def _track(self, t: torch.Tensor) -> None:
        t = local_tensor(t)
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except Exception:
            return
        key = storage_key(st)
        if key in self._storages:
            return
        self._storages[key] = weakref.ref(st)
        weakref.finalize(st, self._storages.pop, key, None)
        self.current_bytes += st.nbytes()

    def _recount(self) -> None:
        total = 0
        for ref in list(self._storages.values()):
            st = ref() if ref is not None else None
            if st is not None:
                total += st.nbytes()
        self.current_bytes = total

    def __enter__(self) -> "RankMemoryTracker":
        out = super().__enter__()
        self._recount()
        self.baseline_bytes = self.peak_bytes = self.current_bytes
        return out

    def __exit__(self, *exc: Any) -> None:
        self._recount()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        for t in tree_leaves((args, kwargs)):  # in-place writes into storages grown by resize_
            if isinstance(t, torch.Tensor):
                self._track(t)
        self._recount()
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        return out

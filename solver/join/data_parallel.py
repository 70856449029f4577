"""The data-parallel setting of one :func:`solver.optimize` call (``sharding="ddp"`` or
``"fsdp"``): what a rank is charged, how its plan is searched, and how the planned
module is wrapped for the rank (:mod:`graphs.distributed`, :mod:`solver.distributed`).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from graphs import ComputeGraph
from graphs.actions import LayerAction
from graphs.fixed import charge
from graphs.module_mode import layer_blocks
from graphs.planned import wrap_planned
from solver.join.checks import Session
from solver.join.fixed import SEED_RESERVE
from solver.report import Report

__all__ = ["DataParallel", "data_parallel"]


def data_parallel(*, sharding: str | None, mode: str, world_size: int | None, mesh: Any,
                  options: dict | None) -> "DataParallel | None":
    """Read the data-parallel options of :func:`solver.optimize`; refuse what cannot run
    before anything is captured or wrapped (None: one process).

    Examples
    --------
    >>> data_parallel(sharding=None, mode="graph", world_size=None, mesh=None, options=None) is None
    True
    """
    from graphs.distributed import DistributedPlanError, check_supported

    check_supported(sharding, mode)
    if sharding is None:
        given = [k for k, v in (("world_size", world_size), ("mesh", mesh), ("sharding_options", options))
                 if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without sharding: pass sharding='ddp' or 'fsdp'")
        return None
    if mesh is not None:
        if getattr(mesh, "ndim", 1) != 1:
            raise DistributedPlanError(f"remat plans data parallelism over a 1-D mesh; got a {mesh.ndim}-D mesh "
                                       "(pass the data-parallel sub-mesh, e.g. mesh['dp'])")
        n = int(mesh.size())
        if world_size is not None and int(world_size) != n:
            raise DistributedPlanError(f"world_size={world_size} contradicts the mesh of {n} ranks")
        world_size = n
    if world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedPlanError(f"sharding={sharding!r} needs an initialized process group "
                                       "(torch.distributed.init_process_group) or world_size=/mesh=")
        world_size = dist.get_world_size()
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return DataParallel(sharding=sharding, world_size=int(world_size), mesh=mesh, options=dict(options or {}))


class DataParallel:
    """The data-parallel setting of one :func:`solver.optimize` call: what a rank is
    charged, how the plan is searched, and how the planned module is wrapped."""

    def __init__(self, *, sharding: str, world_size: int, mesh: Any, options: dict, optimizer_bytes: int = 0) -> None:
        self.sharding, self.world_size, self.mesh = sharding, world_size, mesh
        self.record_buckets = bool(options.pop("record_buckets", True))
        self.options = options
        self.optimizer_bytes = optimizer_bytes
        self.fixed = None
        self.untracked = 0

    def require_process_group(self) -> None:
        import torch.distributed as dist

        from graphs.distributed import DistributedPlanError

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedPlanError(f"optimize(sharding={self.sharding!r}) wraps the model for this rank: "
                                       "call torch.distributed.init_process_group first")
        group = self.mesh.get_group() if self.mesh is not None else None
        n = dist.get_world_size(group)
        if n != self.world_size:
            raise DistributedPlanError(f"world_size={self.world_size} but the "
                                       f"{'mesh' if self.mesh is not None else 'default process group'} has {n} ranks")

    def charge(self, cg: ComputeGraph) -> None:
        """Charge what a rank holds besides the captured step to the graph."""
        from solver.distributed import rank_fixed_bytes, shard_bytes

        opt_bytes = self.optimizer_bytes
        if self.sharding == "ddp":
            self.fixed = rank_fixed_bytes(world_size=self.world_size, sharding="ddp", param_bytes=cg.param_bytes,
                                          grad_bytes=cg.grad_bytes, optimizer_bytes=opt_bytes,
                                          gradient_as_bucket_view=bool(self.options.get("gradient_as_bucket_view")))
            charge(cg, buckets=self.fixed.buckets)  # a planning step of the bare model has none: untracked
            # a tracker sees the buckets (recorded by the comm hook), not the optimizer state
            self.untracked = opt_bytes + SEED_RESERVE + (0 if self.record_buckets else self.fixed.buckets)
        else:  # rank_peak shards parameters, gradients and the optimizer state itself
            charge(cg, optimizer=0)
            self.untracked = shard_bytes(opt_bytes, self.world_size) + SEED_RESERVE

    def plan_fsdp(self, cg: ComputeGraph, budget: int, *, names: list, optimizer_bytes: int, time_limit: Any):
        from solver.distributed import plan_modules_per_rank

        # selective checkpoint inside a unit measures above the simulator's prediction
        # (one recomputed activation more); plan with none / full until it is modelled
        mp, rp = plan_modules_per_rank(cg, budget, blocks=names, world_size=self.world_size, sharding="fsdp",
                                       units=names, optimizer_bytes=optimizer_bytes,
                                       actions=(LayerAction.NONE.value, LayerAction.FULL.value),
                                       time_limit=time_limit)
        self.fixed = rp.fixed
        return mp, rp

    def rank_store_all(self, view: ComputeGraph, *, names: list, optimizer_bytes: int) -> int:
        from solver.distributed import rank_peak
        from solver.module_plan import plan_schedule

        sched, _ = plan_schedule(view, {b: "none" for b in names})
        return rank_peak(view, sched.sequence, world_size=self.world_size, sharding="fsdp", units=names,
                         optimizer_bytes=optimizer_bytes).peak_bytes

    def annotate(self, report: Report) -> None:
        report.sharding, report.world_size = self.sharding, self.world_size
        if self.fixed is not None:
            f = self.fixed
            report.rank_fixed = {"params": f.params, "grads": f.grads, "optimizer": f.optimizer, "buckets": f.buckets}
        report.untracked_bytes = int(self.untracked)

    def plan_and_wrap(self, model: nn.Module, *, planner: Callable, args: tuple, kwargs: dict,
                      blocks: list[str] | None, session: Session,
                      copy_planner: Callable | None = None) -> nn.Module:
        """Plan on this rank's batch and return the module ready to train on the rank;
        under DDP a deep copy of the planned module plans again with ``copy_planner``
        (:func:`graphs.planned.wrap_planned`), into its own report."""
        from graphs.distributed import apply_under_ddp, apply_under_fsdp, check_supported

        if self.sharding == "fsdp":
            step = planner(model, args, kwargs)
            check_supported("fsdp", "module", step.actions)
            out = apply_under_fsdp(model, step.actions, mesh=self.mesh, units=blocks or layer_blocks(model),
                                   **self.options)
        else:
            inner = wrap_planned(model, planner, copy_planner=copy_planner)
            session.modules.append(inner)
            inner.remat_plan_now(args, kwargs)
            opts = dict(self.options)
            if self.mesh is not None:
                opts.setdefault("process_group", self.mesh.get_group())
            out = apply_under_ddp(inner, record_buckets=self.record_buckets, **opts)
        session.modules.append(out)
        session.publish()
        return out

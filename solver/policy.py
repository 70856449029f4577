"""Per-layer activation policies for trainers: none / selective / full / offload per layer.

:func:`policy` reads a transformer's shape (a :class:`solver.analytic.TransformerConfig`,
an HF ``PretrainedConfig`` or an HF model), prices every layer's four choices with the
analytic model of :mod:`solver.analytic`, and picks per layer the choice that makes the
whole training step fit the device with the least extra compute, exactly (a
multiple-choice knapsack solved by a Pareto dynamic program over layers). Pipeline
stages are planned separately, each with its own micro-batches in flight. Under data
parallelism (``sharding="ddp"`` or ``"fsdp"`` with ``world_size`` ranks) the budget and
every peak are per rank: DDP adds its gradient buckets, FSDP2 shards parameters,
gradients and optimizer state and adds the units it gathers (:mod:`solver.distributed`).

How a plan is made
------------------
Memory of a pipeline stage (one device, bytes)::

    static (parameters x (param + grad + optimizer bytes))
    + in_flight x (kept bytes of its layers + embedding/output activations)
    + backward workspace + max(largest transient of its layers, loss workspace)

Under 1F1B (Narayanan et al. 2021) stage ``i`` (0-based) of ``P`` holds up to
``P - i`` micro-batches of activations; under GPipe, all ``num_microbatches``. Layers
split evenly over stages (a remainder goes to the last stages); each stage is planned
on its own and the reported peak is the largest. Per layer, kept bytes follow
Korthikanti et al. 2022 (see :mod:`solver.analytic`); the transient is what a
recomputed (or brought back) layer re-materializes during its backward.

The choice is exact: for each bound on the largest transient, a Pareto dynamic
program over the layers of a stage (a multiple-choice knapsack: kept bytes vs extra
FLOPs) keeps every non-dominated (bytes, FLOPs) pair; the cheapest pair that fits
wins. Complexity O(L x F x K log(F K)) per stage for L layers, K <= 4 options and a
front of F pairs (F stays in the hundreds for identical layers).

Offload (only with ``hardware``) keeps nothing on the device; it is charged only the
host-transfer time that the layer's own forward (out) and backward (back) cannot
hide, converted to FLOPs at the device's peak rate.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from graphs.actions import TRAINER_ACTIONS, LayerAction
from graphs.compute_graph import repeated_note
from graphs.fixed import charge
from graphs.hardware import Hardware, get_hardware
from graphs.units import GiB, format_bytes, format_count
from solver import analytic
from solver.analytic import TransformerConfig
from solver.errors import InfeasibleBudget, SolverError

if TYPE_CHECKING:
    from solver.join.models import CapturedModel

__all__ = ["LayerAction", "LayerOption", "StagePlan", "LayerPolicy", "policy", "build_planner", "budget_bytes_of", "check_batch_options",
           "SCHEDULES", "GraphPlanner", "build_graph_planner", "layer_blocks",
           "check_graph_options", "wants_graph"]

log = logging.getLogger(__name__)

#: Pipeline schedules whose in-flight micro-batches :func:`policy` counts.
SCHEDULES = ("1f1b", "gpipe")


# Order in which a stage's layers receive actions: offloaded layers first (their copies
# back have the longest time to hide), then recomputed ones, kept layers last.
_ORDER = (LayerAction.OFFLOAD, LayerAction.FULL, LayerAction.SELECTIVE, LayerAction.NONE)


@dataclass(frozen=True)
class LayerOption:
    """One choice for one layer, per micro-batch.

    Attributes
    ----------
    action : LayerAction
    stored_bytes : float
        Device bytes kept from the layer's forward until its backward.
    transient_bytes : float
        Extra device bytes while the layer's backward runs (what is recomputed or
        brought back).
    extra_flops : float
        Recomputation FLOPs; for offload, the transfer time that compute cannot hide,
        expressed in FLOPs at the device's peak rate.
    """

    action: LayerAction
    stored_bytes: float
    transient_bytes: float
    extra_flops: float


@dataclass(frozen=True)
class StagePlan:
    """The memory of one pipeline stage under a policy (all bytes per device).

    ``peak_bytes = static_bytes + activation_bytes + workspace_bytes`` where
    ``activation_bytes`` is ``in_flight`` micro-batches of kept activations.
    """

    index: int
    layers: range
    in_flight: int
    static_bytes: int
    activation_bytes: int
    workspace_bytes: int
    peak_bytes: int
    extra_flops: float


@dataclass
class LayerPolicy:
    """Per layer one :class:`LayerAction`, with the predicted memory and extra compute.

    Attributes
    ----------
    actions : tuple of LayerAction
        One per transformer layer, in model order.
    stages : tuple of StagePlan
        One per pipeline stage; ``peak_bytes`` is the largest of theirs.
    budget_bytes : int
        Device bytes the step had to fit.
    peak_bytes : int
        Predicted peak of the step on the fullest device.
    extra_flops : float
        Extra FLOPs per micro-batch, summed over all layers (offload: hidden-transfer
        equivalent, see :class:`LayerOption`).
    base_flops : float
        Forward + backward FLOPs per micro-batch without recomputation.
    config : TransformerConfig or None
        The analytic shape (None for a captured module without an HF ``.config``).
    pipeline_parallel : int
    schedule : str
    optimizer : str
    hardware : Hardware or None
    notes : list of str
    blocks : tuple of str
        Captured path: the module path of every layer (``model.layers.0``...).
    source : {"config", "graph"}
        Priced by the analytic model, or simulated on the captured training step.
    graph_schedule : Schedule or None
        Captured path: the simulated sequence (and offloads) of the plan.
    world_size : int
        Data-parallel ranks (per pipeline stage); budget and peaks are per rank.
    sharding : {None, "ddp", "fsdp"}
    """

    actions: tuple
    stages: tuple
    budget_bytes: int
    peak_bytes: int
    extra_flops: float
    base_flops: float
    config: TransformerConfig | None
    pipeline_parallel: int = 1
    schedule: str = "1f1b"
    optimizer: str = "adam"
    hardware: Hardware | None = None
    notes: list = field(default_factory=list)
    solve_seconds: float = 0.0
    blocks: tuple = ()
    source: str = "config"
    graph_schedule: Any = field(default=None, repr=False, compare=False)
    world_size: int = 1
    sharding: str | None = None
    _planner: Any = field(default=None, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.actions)

    @property
    def overhead(self) -> float:
        """Extra compute as a fraction of a step without recomputation."""
        return self.extra_flops / self.base_flops if self.base_flops else 0.0

    def counts(self) -> dict[LayerAction, int]:
        """How many layers take each action."""
        return {a: sum(1 for x in self.actions if x == a) for a in TRAINER_ACTIONS}

    def layers_with(self, action: "LayerAction | str") -> list[int]:
        """Indices of the layers that take ``action``."""
        a = LayerAction(action)
        return [i for i, x in enumerate(self.actions) if x == a]

    def evaluate(self, actions: Sequence["LayerAction | str"]) -> "LayerPolicy":
        """The same problem under other per-layer actions (e.g. what an exporter can
        express): predicted stages, peak and extra FLOPs, with this policy's budget."""
        if self._planner is None:
            raise SolverError("this LayerPolicy carries no planner to evaluate other actions with")
        return self._planner.policy_of([LayerAction(a) for a in actions], self.budget_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "actions": [a.value for a in self.actions],
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "extra_flops": self.extra_flops,
            "base_flops": self.base_flops,
            "overhead": self.overhead,
            "pipeline_parallel": self.pipeline_parallel,
            "schedule": self.schedule,
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "sharding": self.sharding,
            "stages": [{"index": s.index, "layers": [s.layers.start, s.layers.stop], "in_flight": s.in_flight,
                        "static_bytes": s.static_bytes, "activation_bytes": s.activation_bytes,
                        "workspace_bytes": s.workspace_bytes, "peak_bytes": s.peak_bytes,
                        "extra_flops": s.extra_flops} for s in self.stages],
            "notes": list(self.notes),
            "source": self.source,
            "blocks": list(self.blocks),
        }

    def __str__(self) -> str:
        if self.source == "graph":
            return _graph_policy_str(self)
        c = self.config
        head = (f"LayerPolicy: {c.num_layers} layers, h={c.hidden_size}, seq {c.seq_len}, micro-batch "
                f"{c.micro_batch}, TP {c.tensor_parallel}{'+SP' if c.sequence_parallel else ''}, "
                f"PP {self.pipeline_parallel} ({self.schedule}), {self.optimizer}"
                + (f", {self.sharding.upper()} x{self.world_size} (per rank)" if self.sharding else ""))
        lines = [head,
                 f"peak {format_bytes(self.peak_bytes)} / budget {format_bytes(self.budget_bytes)}, "
                 f"extra {format_count(self.extra_flops)}FLOP per micro-batch "
                 f"(+{100 * self.overhead:.2f} % of the step)",
                 f"{'stage':>5} {'layers':>11} {'action':<10} {'in flight':>9} {'static':>11} "
                 f"{'activations':>12} {'peak':>11}"]
        for s in self.stages:
            runs = _runs(self.actions, s.layers)
            for j, (lo, hi, a) in enumerate(runs):
                span = f"{lo}" if lo == hi else f"{lo}-{hi}"
                if j == 0:
                    lines.append(f"{s.index:>5} {span:>11} {a.value:<10} {s.in_flight:>9} "
                                 f"{format_bytes(s.static_bytes):>11} {format_bytes(s.activation_bytes):>12} "
                                 f"{format_bytes(s.peak_bytes):>11}")
                else:
                    lines.append(f"{'':>5} {span:>11} {a.value:<10}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _runs(actions, layers: range) -> list[tuple[int, int, LayerAction]]:
    out: list[list] = []
    for i in layers:
        if out and out[-1][2] == actions[i] and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i, actions[i]])
    return [tuple(r) for r in out]


# ------------------------------------------------------------------------ the planner

class _Planner:
    """Prices the options of every layer and the fixed memory of every stage."""

    def __init__(self, cfg: TransformerConfig, *, pipeline_parallel: int, schedule: str,
                 num_microbatches: int | None, optimizer: str, hardware: Hardware | None,
                 allow_offload: bool | None, grad_bytes: int | None, world_size: int = 1,
                 sharding: str | None = None) -> None:
        P = int(pipeline_parallel)
        self.world_size, self.sharding = _check_data_parallel(world_size, sharding)
        if self.sharding == "fsdp" and allow_offload:
            raise SolverError("offload is not planned under FSDP2 (save_on_cpu would also move the gathered "
                              "parameters); use allow_offload=False")
        if self.sharding == "fsdp":
            allow_offload = False
        if P < 1:
            raise SolverError(f"pipeline_parallel must be >= 1, got {pipeline_parallel!r}")
        if P > cfg.num_layers:
            raise SolverError(f"pipeline_parallel {P} exceeds the {cfg.num_layers} layers")
        sched = str(schedule).lower()
        if sched not in SCHEDULES:
            raise SolverError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        if num_microbatches is not None and int(num_microbatches) < 1:
            raise SolverError(f"num_microbatches must be >= 1, got {num_microbatches!r}")
        self.cfg, self.P, self.schedule, self.optimizer = cfg, P, sched, str(optimizer).lower()
        self.hardware = hardware
        self.allow_offload = hardware is not None if allow_offload is None else bool(allow_offload)
        if self.allow_offload and hardware is None:
            raise SolverError("offload needs a hardware spec for its host bandwidth: pass hardware='pcie5' "
                              "(or another graphs.hardware preset)")
        p_b, g_b, o_b = analytic.state_bytes_per_parameter(cfg.dtype_bytes, self.optimizer, grad_bytes=grad_bytes)
        self.bytes_per_param = p_b + g_b + o_b
        self.param_bytes, self.grad_bytes = p_b, g_b
        # layers split evenly; the remainder goes to the last stages (fewest micro-batches in flight)
        L = cfg.num_layers
        sizes = [L // P + (1 if i >= P - L % P else 0) for i in range(P)] if L % P else [L // P] * P
        starts = np.cumsum([0] + sizes)
        self.stage_layers = [range(int(starts[i]), int(starts[i + 1])) for i in range(P)]
        m = None if num_microbatches is None else int(num_microbatches)
        if sched == "1f1b":
            self.in_flight = [P - i if m is None else min(P - i, m) for i in range(P)]
        else:
            self.in_flight = [m if m is not None else P] * P
        self.options = self._layer_options()
        self.base_workspace = analytic.backward_workspace_bytes(cfg)
        self.loss_workspace = analytic.loss_workspace_bytes(cfg)
        self._fronts: dict[int, list] = {}

    # -- prices
    def _layer_options(self) -> list[LayerOption]:
        cfg = self.cfg
        a_none = analytic.layer_activation_bytes(cfg, recompute="none")
        a_sel = analytic.layer_activation_bytes(cfg, recompute="selective")
        a_full = analytic.layer_activation_bytes(cfg, recompute="full")
        opts = [
            LayerOption(LayerAction.NONE, a_none, 0.0, 0.0),
            LayerOption(LayerAction.SELECTIVE, a_sel, a_none - a_sel, analytic.recompute_flops(cfg, "selective")),
            LayerOption(LayerAction.FULL, a_full, a_none - a_full, analytic.recompute_flops(cfg, "full")),
        ]
        if self.allow_offload:
            hw = self.hardware
            move = a_none / hw.host_bandwidth
            fwd = analytic.layer_forward_flops(cfg) / hw.peak_flops
            # The copy out overlaps the next layers' forward, the copy back the later
            # layers' backward (2x forward); only what compute cannot hide costs time.
            exposed = max(0.0, move - fwd) + max(0.0, move - 2 * fwd)
            opts.append(LayerOption(LayerAction.OFFLOAD, 0.0, a_none, exposed * hw.peak_flops))
        return opts

    def stage_static(self, i: int) -> float:
        """Bytes of stage ``i``'s device outside activations and workspaces.

        One device: parameters x (param + grad + optimizer bytes). DDP adds its
        gradient buckets (one more gradient copy). FSDP2 holds a ``1/world_size``
        shard of all of it, plus what it gathers: the root's parameters (embedding
        and output, kept gathered through the step) and their whole gradients, two
        layers' whole parameters (the one computing and the one prefetched) and two
        layers' whole gradients (the one in backward and the previous one's
        reduce-scatter input)."""
        cfg = self.cfg
        layer = analytic.layer_parameters(cfg)
        n_layers = len(self.stage_layers[i])
        root = 0.0
        if i == 0:
            root += analytic.embedding_parameters(cfg)
        if i == self.P - 1:
            root += analytic.output_parameters(cfg, separate_stage=self.P > 1)
        params = n_layers * layer + root
        if self.sharding == "ddp":
            return params * (self.bytes_per_param + self.grad_bytes)
        if self.sharding == "fsdp":
            gathered = root * (self.param_bytes + self.grad_bytes) + min(2, n_layers) * layer * (
                self.param_bytes + self.grad_bytes)
            return params * self.bytes_per_param / self.world_size + gathered
        return params * self.bytes_per_param

    def stage_fixed_activations(self, i: int) -> float:
        """Per micro-batch activations outside the layers (embedding, output and loss)."""
        out = 0.0
        if i == 0:
            out += analytic.embedding_activation_bytes(self.cfg)
        if i == self.P - 1:
            out += analytic.output_activation_bytes(self.cfg)
        return out

    def stage_peak(self, i: int, stored: float, transient: float) -> tuple[float, float]:
        """(peak, workspace) of stage ``i`` given its layers' summed kept bytes per
        micro-batch and the largest transient of its layers."""
        k = self.in_flight[i]
        extra = self.loss_workspace if i == self.P - 1 else 0.0
        workspace = self.base_workspace + max(transient, extra)
        return self.stage_static(i) + k * (stored + self.stage_fixed_activations(i)) + workspace, workspace

    # -- exact per-stage solve
    def _front(self, i: int, tau: float) -> tuple[np.ndarray, np.ndarray, list]:
        """Pareto front (kept bytes ascending, extra FLOPs) of stage ``i``'s layers using
        only options whose transient is at most ``tau``, with back-pointers."""
        key = (i, tau)
        if key in self._fronts:
            return self._fronts[key]
        opts = [o for o in self.options if o.transient_bytes <= tau]
        s_opt = np.array([o.stored_bytes for o in opts])
        c_opt = np.array([o.extra_flops for o in opts])
        S, C = np.zeros(1), np.zeros(1)
        back = []
        for _ in self.stage_layers[i]:
            S2 = (S[:, None] + s_opt[None, :]).ravel()
            C2 = (C[:, None] + c_opt[None, :]).ravel()
            order = np.lexsort((C2, S2))
            S2, C2 = S2[order], C2[order]
            best_before = np.minimum.accumulate(np.concatenate(([np.inf], C2[:-1])))
            keep = C2 < best_before - 1e-9 * np.maximum(1.0, np.abs(C2))
            idx = order[keep]
            S, C = S2[keep], C2[keep]
            back.append((idx // len(opts), idx % len(opts)))
        res = (S, C, [opts, back])
        self._fronts[key] = res
        return res

    def _taus(self) -> list[float]:
        return sorted({o.transient_bytes for o in self.options})

    def solve_stage(self, i: int, budget: float) -> list[LayerAction] | None:
        best = None
        k = self.in_flight[i]
        for tau in self._taus():
            S, C, (opts, back) = self._front(i, tau)
            workspace = self.stage_peak(i, 0.0, tau)[1]
            peak = self.stage_static(i) + k * (S + self.stage_fixed_activations(i)) + workspace
            ok = np.nonzero(peak <= budget)[0]
            if len(ok) == 0:
                continue
            j = int(ok[np.argmin(C[ok])])
            if best is None or C[j] < best[0] - 1e-9 * max(1.0, abs(best[0])):
                best = (C[j], j, opts, back)
        if best is None:
            return None
        _, j, opts, back = best
        chosen = []
        for parent, opt in reversed(back):
            chosen.append(opts[int(opt[j])].action)
            j = int(parent[j])
        chosen.sort(key=_ORDER.index)
        return chosen

    def stage_min_peak(self, i: int) -> float:
        return min(self.stage_static(i) + self.in_flight[i] * (self._front(i, tau)[0][0]
                   + self.stage_fixed_activations(i)) + self.stage_peak(i, 0.0, tau)[1] for tau in self._taus())

    def min_peak(self) -> int:
        return int(np.ceil(max(self.stage_min_peak(i) for i in range(self.P))))

    # -- evaluation of given actions
    def policy_of(self, actions: list[LayerAction], budget: int, *, notes=None, seconds=0.0) -> LayerPolicy:
        if len(actions) != self.cfg.num_layers:
            raise SolverError(f"{len(actions)} actions for {self.cfg.num_layers} layers")
        by_action = {o.action: o for o in self.options}
        missing = {a for a in actions if a not in by_action}
        if missing:
            raise SolverError(f"action(s) {', '.join(sorted(map(str, missing)))} not available here "
                              "(offload needs hardware=...)")
        stages = []
        for i, rng in enumerate(self.stage_layers):
            opts = [by_action[actions[l]] for l in rng]
            stored = sum(o.stored_bytes for o in opts)
            transient = max(o.transient_bytes for o in opts)
            peak, ws = self.stage_peak(i, stored, transient)
            k = self.in_flight[i]
            stages.append(StagePlan(i, rng, k, int(round(self.stage_static(i))),
                                    int(round(k * (stored + self.stage_fixed_activations(i)))),
                                    int(round(ws)), int(np.ceil(peak)), sum(o.extra_flops for o in opts)))
        return LayerPolicy(
            actions=tuple(actions), stages=tuple(stages), budget_bytes=int(budget),
            peak_bytes=max(s.peak_bytes for s in stages), extra_flops=sum(s.extra_flops for s in stages),
            base_flops=analytic.step_flops(self.cfg), config=self.cfg, pipeline_parallel=self.P,
            schedule=self.schedule, optimizer=self.optimizer, hardware=self.hardware,
            notes=list(notes or []), solve_seconds=seconds, world_size=self.world_size, sharding=self.sharding,
            _planner=self)

    def solve(self, budget: int) -> LayerPolicy:
        t0 = time.perf_counter()
        actions: list[LayerAction] = []
        for i in range(self.P):
            got = self.solve_stage(i, budget)
            if got is None:
                raise InfeasibleBudget(budget, self.min_peak(), what=f"peak of a training step (stage {i} "
                                       "is the first that does not fit)")
            actions.extend(got)
        notes = []
        if self.allow_offload:
            notes.append("offload is charged only the host-transfer time that the layer's compute cannot "
                         f"hide, at {self.hardware.host_bandwidth / 1e9:.0f} GB/s each way ({self.hardware.name})")
        else:
            notes.append("offload not considered (pass hardware=... to price host transfers)")
        return self.policy_of(actions, budget, notes=notes, seconds=time.perf_counter() - t0)


def _is_module(obj: Any) -> bool:
    """An ``nn.Module``, checked without importing torch when it is not loaded."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def layer_blocks(model: Any, *, blocks: Any = None) -> list[str]:
    """Module paths of a model's repeated layers, or ``blocks`` checked against it: the
    one implementation, :func:`graphs.module_mode.layer_blocks`."""
    from graphs.module_mode import layer_blocks as _layer_blocks

    return _layer_blocks(model, blocks=blocks)


def _graph_options(*, world_size: Any, sharding: Any, hardware: Any, allow_offload: bool | None
                   ) -> tuple[int, str | None, Hardware | None, bool | None]:
    """Validate the captured path's options: (world size, sharding, hardware, allow_offload
    or None for the device's default)."""
    world_size, sharding = _check_data_parallel(world_size, sharding)
    if sharding == "fsdp":
        if allow_offload:
            raise SolverError("offload is not planned under FSDP2; use allow_offload=False")
        allow_offload = False
    hw = None if hardware is None else get_hardware(hardware)
    if allow_offload and hw is None:
        raise SolverError("offload needs a hardware spec for its host bandwidth: pass hardware='pcie5'")
    return world_size, sharding, hw, allow_offload


class GraphPlanner:
    """Prices per-layer plans on the captured training step of a real module.

    Every plan (one action per layer) becomes a schedule of the captured DAG
    (:func:`solver.module_plan.plan_schedule`: each checkpointed layer's recomputation
    placed where torch runs it, at the start of the layer's backward) that
    :func:`solver.simulate` grades. Offload moves every value of a layer that its
    backward reads to the host right after its last forward use and back just before its
    first backward use.

    Parameters
    ----------
    captured : solver.join.models.CapturedModel
        The step, captured by :func:`solver.join.models.capture_module` (this class sees only
        its DAG and a few numbers: it never touches the module).
    optimizer, hardware, allow_offload, world_size, sharding :
        As for :func:`policy`.

    Attributes
    ----------
    graph : ComputeGraph
        The captured step (``backward="loss"``); its fixed charges
        (:class:`graphs.fixed.FixedCharges`) hold the optimizer state.
    blocks : list of str
    options : tuple of LayerAction
    """

    def __init__(self, captured: "CapturedModel", *, optimizer: str = "adam", hardware: Any = None,
                 allow_offload: bool | None = None, world_size: int | None = None,
                 sharding: str | None = None) -> None:
        self.world_size, self.sharding, self.hardware, allow_offload = _graph_options(
            world_size=world_size, sharding=sharding, hardware=hardware, allow_offload=allow_offload)
        self.blocks = list(captured.blocks)
        self.optimizer = str(optimizer).lower()
        self.device = device = captured.device
        self.notes: list[str] = []
        if allow_offload is None:
            allow_offload = self.hardware is not None and device == "cuda"
            if self.hardware is not None and device != "cuda":
                self.notes.append(f"offload not considered: the model is on {device}, not CUDA")
        self.allow_offload = bool(allow_offload)
        self.graph = captured.graph
        self.capture_seconds = captured.capture_seconds
        repeated = repeated_note(self.graph)
        if repeated:
            self.notes.append(repeated)
        _, _, o_b = analytic.state_bytes_per_parameter(captured.element_size, self.optimizer)
        self.optimizer_bytes = int(captured.trainable_numel * o_b)
        # DDP's gradient buckets: one more copy of the gradients; under FSDP2 rank_peak
        # shards and charges the optimizer state itself
        charge(self.graph, optimizer=0 if self.sharding == "fsdp" else self.optimizer_bytes,
               buckets=self.graph.grad_bytes if self.sharding == "ddp" else 0)
        self.options = (LayerAction.NONE, LayerAction.SELECTIVE, LayerAction.FULL) + (
            (LayerAction.OFFLOAD,) if self.allow_offload else ())
        self.base_flops = float(sum(self.graph[v].get("flops", 0) for v in self.graph.ops))
        self.config = None
        if captured.hf_config is not None:
            try:
                self.config = analytic.as_config(captured.hf_config)
            except Exception:  # an unusual HF config: the captured graph is all we need
                self.config = None
        self._cache: dict[tuple, tuple] = {}
        self._index = None  # solver.module_plan.BlockIndex of the graph, made at the first plan

    def evaluate(self, actions: Sequence[LayerAction]) -> tuple:
        """(Schedule, SimulationResult) of one action per layer (cached)."""
        from solver.module_plan import BlockIndex, plan_schedule

        key = tuple(LayerAction(a) for a in actions)
        if key in self._cache:
            return self._cache[key]
        if len(key) != len(self.blocks):
            raise SolverError(f"{len(key)} actions for {len(self.blocks)} layers")
        if self._index is None:
            self._index = BlockIndex(self.graph, self.blocks)
        sched, res = plan_schedule(self.graph, {b: a.value for b, a in zip(self.blocks, key)},
                                   bandwidth=self._bandwidth(), index=self._index)
        if self.sharding == "fsdp":  # one rank's peak: shards, gathered units, whole gradients
            from solver.distributed import rank_peak

            rp = rank_peak(self.graph, sched.sequence, world_size=self.world_size, sharding="fsdp",
                           units=self.blocks, optimizer_bytes=self.optimizer_bytes)
            res.peak_bytes = sched.peak_bytes = rp.peak_bytes
            self.rank_fixed = rp.fixed.total
        self._cache[key] = (sched, res)
        return self._cache[key]

    def _bandwidth(self) -> float | None:
        # captured times are seconds: the host link in bytes per second
        return float(self.hardware.host_bandwidth) if self.allow_offload else None

    def _extra_flops(self, sched) -> float:
        seen: set = set()
        extra = 0.0
        for v in sched.sequence:
            if v in seen:
                extra += float(self.graph[v].get("flops", 0))
            seen.add(v)
        return extra

    def policy_of(self, actions: Sequence[LayerAction], budget: int, *, notes=None, seconds: float = 0.0
                  ) -> LayerPolicy:
        acts = tuple(LayerAction(a) for a in actions)
        missing = [a for a in acts if a not in self.options]
        if missing:
            raise SolverError(f"action {missing[0]} not available here (offload needs hardware=... and CUDA)")
        sched, res = self.evaluate(acts)
        fixed = int(self.rank_fixed if self.sharding == "fsdp" else self.graph.fixed_bytes)
        stage = StagePlan(0, range(len(acts)), 1, fixed, int(res.peak_bytes - fixed), 0, int(res.peak_bytes),
                          self._extra_flops(sched))
        return LayerPolicy(actions=acts, stages=(stage,), budget_bytes=int(budget), peak_bytes=int(res.peak_bytes),
                           extra_flops=stage.extra_flops, base_flops=self.base_flops, config=self.config,
                           optimizer=self.optimizer, hardware=self.hardware,
                           notes=list(self.notes if notes is None else notes), solve_seconds=seconds,
                           blocks=tuple(self.blocks), source="graph", graph_schedule=sched,
                           world_size=self.world_size, sharding=self.sharding, _planner=self)

    def min_peak(self) -> int:
        """Smallest peak over the uniform plans (every layer the same action)."""
        return min(self.evaluate([a] * len(self.blocks))[1].peak_bytes for a in self.options)

    def solve(self, budget: int) -> LayerPolicy:
        """The cheapest plan found that fits (greedy, :func:`solver.module_plan.plan_modules`)."""
        from solver.module_plan import plan_modules

        t0 = time.perf_counter()
        try:
            if self.sharding == "fsdp":
                from solver.distributed import plan_modules_per_rank

                mp, _ = plan_modules_per_rank(self.graph, budget, blocks=self.blocks, world_size=self.world_size,
                                              units=self.blocks, optimizer_bytes=self.optimizer_bytes,
                                              actions=[a.value for a in self.options])
            else:
                mp = plan_modules(self.graph, budget, blocks=self.blocks, actions=[a.value for a in self.options],
                                  bandwidth=self._bandwidth())
        except InfeasibleBudget:
            raise InfeasibleBudget(budget, self.min_peak(), what="peak of a training step (captured graph)") from None
        cur = [LayerAction(mp.actions[b]) for b in self.blocks]
        notes = list(self.notes)
        notes.append(f"planned on the captured training step ({len(self.graph.ops)} ops, captured in "
                     f"{self.capture_seconds:.1f} s); peaks from the simulator")
        if self.allow_offload:
            notes.append(f"offload priced at {self.hardware.host_bandwidth / 1e9:.0f} GB/s each way "
                         f"({self.hardware.name})")
        return self.policy_of(cur, budget, notes=notes, seconds=time.perf_counter() - t0)


def _graph_policy_str(p: LayerPolicy) -> str:
    lines = [f"LayerPolicy (captured graph): {len(p.actions)} layers, optimizer {p.optimizer}",
             f"peak {format_bytes(p.peak_bytes)} / budget {format_bytes(p.budget_bytes)}, extra "
             f"{format_count(p.extra_flops)}FLOP (+{100 * p.overhead:.2f} % of the step)",
             f"{'layers':>11} {'action':<10} modules"]
    for lo, hi, a in _runs(p.actions, range(len(p.actions))):
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        mods = p.blocks[lo] if lo == hi else f"{p.blocks[lo]} .. {p.blocks[hi]}"
        lines.append(f"{span:>11} {a.value:<10} {mods}")
    lines.extend(f"note: {n}" for n in p.notes)
    return "\n".join(lines)


def build_graph_planner(model: Any, *, example_inputs: Any = None, seq_len: int | None = None,
                        micro_batch: int | None = None, optimizer: str = "adam", hardware: Any = None,
                        allow_offload: bool | None = None, blocks: Sequence[str] | None = None,
                        measure_time: bool = False, loss_fn: Any = None, world_size: int | None = None,
                        sharding: str | None = None) -> GraphPlanner:
    """The planner behind :func:`policy` and :func:`solver.estimate.estimate` for a real
    ``nn.Module``: its training step captured by :func:`solver.join.models.capture_module`
    (the one way this module reaches torch) on ``example_inputs`` (default for an HF
    model: ``input_ids``/``labels`` of shape ``(micro_batch, seq_len)``).

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    >>> pl = build_graph_planner(net, example_inputs=(torch.randn(8, 16),), optimizer="none")
    >>> pl.blocks, pl.evaluate(["none"] * 3)[1].valid
    (['0', '1', '2'], True)
    """
    from solver.join.models import capture_module

    opts = dict(world_size=world_size, sharding=sharding, hardware=hardware, allow_offload=allow_offload)
    hw = _graph_options(**opts)[2]  # a bad option is refused before the capture
    captured = capture_module(model, example_inputs, seq_len=seq_len, micro_batch=micro_batch, blocks=blocks,
                              measure_time=measure_time, loss_fn=loss_fn, hardware=hw)
    return GraphPlanner(captured, optimizer=optimizer, **opts)


def check_graph_options(*, pipeline_parallel: int = 1, **config_only: Any) -> None:
    """Refuse the config-only options on the captured path, which plans one device's step
    as captured: no parallelism knobs, no dtype or attention overrides.

    Parameters
    ----------
    pipeline_parallel : int
        Must be 1 (or None).
    **config_only
        Options that only the config path reads (``tensor_parallel``, ``dtype``, ...);
        each must be None or False (``tensor_parallel`` may be 1).

    Raises
    ------
    SolverError
        Naming the options to drop or to plan with ``via='config'``.

    Examples
    --------
    >>> check_graph_options(pipeline_parallel=1, tensor_parallel=None, dtype=None)
    >>> check_graph_options(dtype="bf16")
    Traceback (most recent call last):
    ...
    solver.errors.SolverError: dtype only apply to via='config'; the captured graph fixes them (build the model in the dtype you want)
    """
    if pipeline_parallel not in (None, 1) or config_only.get("tensor_parallel") not in (None, 1):
        raise SolverError("tensor/pipeline parallelism is planned from a config (via='config'); the captured "
                          "graph is one device's step")
    given = [k for k, v in config_only.items() if v not in (None, False) and k != "tensor_parallel"]
    if given:
        raise SolverError(f"{', '.join(given)} only apply to via='config'; the captured graph fixes them "
                          "(build the model in the dtype you want)")


def wants_graph(model_or_config: Any, via: str) -> bool:
    """Whether :func:`policy` plans on the captured graph (True) or on the config (False).

    Parameters
    ----------
    model_or_config : any
        What :func:`policy` was given.
    via : {"auto", "graph", "config"}
        ``"auto"``: the graph for an ``nn.Module``, else the config.

    Raises
    ------
    SolverError
        An unknown ``via``, or ``via="graph"`` without an ``nn.Module``.

    Examples
    --------
    >>> wants_graph({"num_hidden_layers": 2}, "auto")
    False
    """
    if via not in ("auto", "graph", "config"):
        raise SolverError(f"via must be 'auto', 'graph' or 'config', got {via!r}")
    if via == "config":
        return False
    if via == "graph" and not _is_module(model_or_config):
        raise SolverError(f"via='graph' needs an nn.Module, got {type(model_or_config).__name__}")
    return _is_module(model_or_config)


def _module_planner_config(model: Any, **overrides) -> TransformerConfig:
    """Shape of an ``nn.Module``: HF models through their ``.config``.

    This is the hook for the captured-graph path: a module without a readable config
    will be planned from its captured training step (``graphs.capture``) instead.
    """
    if getattr(model, "config", None) is not None:
        return analytic.as_config(model, **overrides)
    raise SolverError(f"cannot plan {type(model).__name__} from a config: it has no `.config`. Pass a "
                      "solver.analytic.TransformerConfig of its shape (planning from the captured graph "
                      "of an arbitrary module is not available in policy() yet)")


def build_planner(model_or_config: Any, *, seq_len=None, micro_batch=None, dtype=None, tensor_parallel=None,
                  sequence_parallel=None, pipeline_parallel=1, schedule="1f1b", num_microbatches=None,
                  optimizer="adam", hardware=None, allow_offload=None, grad_bytes=None,
                  flash_attention=None, world_size=1, sharding=None) -> _Planner:
    """The planner behind :func:`policy` and :func:`solver.estimate.estimate`: the priced
    options of every layer and the fixed memory of every stage (same options as
    :func:`policy`, without a budget).

    Examples
    --------
    >>> from solver.analytic import TransformerConfig
    >>> cfg = TransformerConfig(num_layers=8, hidden_size=256, num_heads=4, vocab_size=1000, seq_len=128)
    >>> pl = build_planner(cfg, pipeline_parallel=4)
    >>> pl.in_flight, [len(r) for r in pl.stage_layers]
    ([4, 3, 2, 1], [2, 2, 2, 2])
    """
    over = dict(seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, tensor_parallel=tensor_parallel,
                sequence_parallel=sequence_parallel, flash_attention=flash_attention)
    if (isinstance(model_or_config, TransformerConfig) or analytic.looks_like_hf_config(model_or_config)
            or isinstance(model_or_config, dict)):
        cfg = analytic.as_config(model_or_config, **over)
    else:
        cfg = _module_planner_config(model_or_config, **over)
    hw = None if hardware is None else get_hardware(hardware)
    return _Planner(cfg, pipeline_parallel=pipeline_parallel, schedule=schedule,
                    num_microbatches=num_microbatches, optimizer=optimizer, hardware=hw,
                    allow_offload=allow_offload, grad_bytes=grad_bytes, world_size=world_size, sharding=sharding)


def _check_data_parallel(world_size: Any, sharding: Any) -> tuple[int, str | None]:
    """Validate ``world_size`` / ``sharding``: (world size, sharding)."""
    from solver.distributed import SHARDINGS

    w = 1 if world_size is None else world_size
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise SolverError(f"world_size must be an integer >= 1, got {world_size!r}")
    if sharding is not None and sharding not in SHARDINGS:
        raise SolverError(f"unknown sharding {sharding!r}; use one of {', '.join(SHARDINGS)} or None")
    if sharding is None and w != 1:
        raise SolverError(f"world_size={w} needs sharding='ddp' or 'fsdp' (what a rank holds depends on it)")
    return int(w), sharding


def budget_bytes_of(gpu_gb: float, reserved_bytes: int = 0) -> int:
    """Device bytes of a ``gpu_gb`` GiB device, less ``reserved_bytes``.

    Examples
    --------
    >>> budget_bytes_of(1.5)
    1610612736
    """
    if isinstance(gpu_gb, bool) or not isinstance(gpu_gb, numbers.Real) or not math.isfinite(gpu_gb) or gpu_gb <= 0:
        raise SolverError(f"gpu_gb must be a positive, finite number of GiB, got {gpu_gb!r}")
    return int(gpu_gb * GiB) - int(reserved_bytes)


def check_batch_options(*, seq_len: Any = None, micro_batch: Any = None) -> None:
    """Refuse a sequence length or micro-batch that is not a positive whole number.

    Examples
    --------
    >>> check_batch_options(seq_len=1024, micro_batch=8)
    >>> check_batch_options(micro_batch=2.5)
    Traceback (most recent call last):
    ...
    solver.errors.SolverError: micro_batch must be a positive whole number, got 2.5
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise SolverError(f"{name} must be a positive whole number, got {value!r}")


def policy(model_or_config: Any, gpu_gb: float, *, seq_len: int | None = None, micro_batch: int | None = None,
           dtype: Any = None, tensor_parallel: int | None = None, sequence_parallel: bool | None = None,
           pipeline_parallel: int = 1, schedule: str = "1f1b", num_microbatches: int | None = None,
           optimizer: str = "adam", hardware: "str | Hardware | None" = None, allow_offload: bool | None = None,
           grad_bytes: int | None = None, flash_attention: bool | None = None,
           reserved_bytes: int = 0, example_inputs: Any = None, via: str = "auto",
           blocks: Sequence[str] | None = None, measure_time: bool = False,
           loss_fn: Any = None, world_size: int | None = None, sharding: str | None = None) -> LayerPolicy:
    """Per layer none / selective / full / offload, so that a training step fits ``gpu_gb``
    with the least extra compute.

    The memory model and the search are described in the module docstring
    (:mod:`solver.policy`).

    Parameters
    ----------
    model_or_config : TransformerConfig, HF PretrainedConfig, HF model or mapping
        Any ``nn.Module`` with an HF ``.config`` is read through it.
    gpu_gb : float
        Device memory in GiB (2**30 bytes) per device.
    seq_len, micro_batch, dtype :
        Override the config's (``dtype``: bytes, a name like ``"bf16"`` or a torch dtype).
    tensor_parallel : int, optional
    sequence_parallel : bool, optional
        Override the config's (an HF config: 1 and False).
    pipeline_parallel : int
    schedule : {"1f1b", "gpipe"}
    num_microbatches : int, optional
        Micro-batches per step (caps the in-flight count; GPipe needs it, default P).
    optimizer : {"adam", "adamw", "sgd", "sgd_momentum", "none"}
    hardware : str or graphs.Hardware, optional
        Enables offload, priced by its ``host_bandwidth`` and ``peak_flops``.
    allow_offload : bool, optional
        Default: True exactly when ``hardware`` is given.
    grad_bytes : int, optional
        Bytes per gradient element (default: the dtype's; Megatron accumulates in fp32: 4).
    flash_attention : bool, optional
        Fused attention (no score matrices kept); default: read from the config, else unfused.
    reserved_bytes : int
        Device bytes held back for the runtime (CUDA context, allocator slack).
    example_inputs : tuple or dict, optional
        Captured path: the model's positional or keyword arguments (default for an HF
        model: ``input_ids`` and ``labels`` of shape ``(micro_batch, seq_len)``).
    via : {"auto", "graph", "config"}
        ``"graph"``: capture the module's training step (:func:`graphs.capture`) and
        plan on it: per layer none / selective / full (and offload when ``hardware`` is
        given and the model is on CUDA), every candidate graded by
        :func:`solver.simulate`; layers are the children of the model's longest
        ``ModuleList`` (or ``blocks``); the search is greedy. ``"config"``: the
        analytic model above. ``"auto"``: graph for an ``nn.Module``, else config.
    blocks : sequence of str, optional
        Captured path: module paths of the layers.
    measure_time : bool
        Captured path: time every op for the cost model (default: roofline).
    loss_fn : callable, optional
        Captured path: output -> scalar loss (default: ``output.loss`` or a sum).
    world_size : int, optional
        Data-parallel ranks (of one pipeline stage); needs ``sharding``. ``gpu_gb``
        and every peak are then per rank, and the micro-batch (or example batch) is
        the rank's own.
    sharding : {None, "ddp", "fsdp"}
        ``"ddp"``: a rank holds everything plus DDP's gradient buckets (one more copy
        of the gradients). ``"fsdp"`` (FSDP2 ``fully_shard``, one unit per layer):
        ``1/world_size`` of parameters, gradients and optimizer state, plus the
        gathered root, two gathered layers and two layers' whole gradients (config
        path, see ``_Planner.stage_static``), or every step re-priced by
        :func:`solver.distributed.rank_peak` (captured path). No offload under FSDP2.

    Returns
    -------
    LayerPolicy

    Raises
    ------
    InfeasibleBudget
        When no choice fits; it names the smallest feasible peak.
    SolverError
        On an unknown option or an unreadable model.

    Examples
    --------
    >>> from solver.analytic import TransformerConfig
    >>> cfg = TransformerConfig(num_layers=4, hidden_size=1024, num_heads=16, vocab_size=32000,
    ...                         seq_len=2048, micro_batch=4)
    >>> p = policy(cfg, 5.0)
    >>> p.fits, p.counts()[LayerAction.NONE] < 4
    (True, True)
    >>> sharded = policy(cfg, 5.0, world_size=8, sharding="fsdp")
    >>> sharded.stages[0].static_bytes < p.stages[0].static_bytes
    True
    """
    budget = budget_bytes_of(gpu_gb, reserved_bytes)
    check_batch_options(seq_len=seq_len, micro_batch=micro_batch)
    if wants_graph(model_or_config, via):
        check_graph_options(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, dtype=dtype,
                             sequence_parallel=sequence_parallel, num_microbatches=num_microbatches,
                             grad_bytes=grad_bytes, flash_attention=flash_attention)
        gp = build_graph_planner(model_or_config, example_inputs=example_inputs, seq_len=seq_len,
                                 micro_batch=micro_batch, optimizer=optimizer, hardware=hardware,
                                 allow_offload=allow_offload, blocks=blocks, measure_time=measure_time,
                                 loss_fn=loss_fn, world_size=world_size, sharding=sharding)
        out = gp.solve(budget)
        log.info("policy (captured graph): %s", dict((k.value, v) for k, v in out.counts().items()))
        return out
    planner = build_planner(model_or_config, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                            tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                            pipeline_parallel=pipeline_parallel, schedule=schedule,
                            num_microbatches=num_microbatches, optimizer=optimizer, hardware=hardware,
                            allow_offload=allow_offload, grad_bytes=grad_bytes, flash_attention=flash_attention,
                            world_size=world_size, sharding=sharding)
    out = planner.solve(budget)
    log.info("policy: %s in %.3f s", dict((k.value, v) for k, v in out.counts().items()), out.solve_seconds)
    return out

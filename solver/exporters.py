"""Per-layer policies as trainer settings: HF transformers, Megatron-Core, torch SAC,
DeepSpeed and torchtitan.

Each exporter returns an :class:`Export`: the target's configuration, the per-layer
actions the target will really run (re-priced with the same analytic model), and plain
warnings of what the target cannot express. When a target cannot express the policy,
the exporter picks among the settings it *can* express the cheapest one that still fits
the policy's budget (a superset of the recomputation, hence of the memory savings), and
says which. Nothing here imports torch: :func:`apply_hf` runs a plan through
:func:`solver.join.models.apply_hf_actions` and :func:`sac_policy_fn` is
:func:`graphs.module_mode.selective_policy`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from graphs.actions import ATTENTION_CORE_OPS, TRAINER_ACTIONS, LayerAction
from graphs.units import format_bytes, format_count
from solver.errors import SolverError
from solver.policy import LayerPolicy

__all__ = [
    "Export",
    "to_hf",
    "apply_hf",
    "to_megatron",
    "to_torch_sac",
    "sac_policy_fn",
    "to_deepspeed",
    "to_torchtitan",
    "MEGATRON_RECOMPUTE_MODULES",
    "ATTENTION_CORE_OPS",
]

log = logging.getLogger(__name__)

#: Values Megatron-Core's ``recompute_modules`` accepts.
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")

@dataclass
class Export:
    """One policy as one target's settings.

    Attributes
    ----------
    target : str
    config : dict
        The target's settings (JSON-ready except torch SAC's callables).
    expressed : LayerPolicy
        The per-layer actions the target will run, re-priced.
    warnings : list of str
        What the target cannot express and what was done instead.
    """

    target: str
    config: dict
    expressed: LayerPolicy
    warnings: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.expressed.fits

    def __str__(self) -> str:
        lines = [f"{self.target}: {self.config}",
                 f"  expressed: peak {format_bytes(self.expressed.peak_bytes)} / budget "
                 f"{format_bytes(self.expressed.budget_bytes)}, extra "
                 f"{format_count(self.expressed.extra_flops)}FLOP per micro-batch"]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _pick(policy: LayerPolicy, target: str, candidates: Iterable[tuple[Sequence[LayerAction], dict]],
          warnings: list[str]) -> Export:
    """The cheapest candidate that fits the policy's budget, else the smallest peak."""
    scored = []
    for actions, config in candidates:
        p = policy.evaluate(actions)
        scored.append((not p.fits, p.extra_flops if p.fits else p.peak_bytes, p, config))
    if not scored:
        raise SolverError(f"no {target} setting to choose from")
    scored.sort(key=lambda x: (x[0], x[1]))
    _, _, p, config = scored[0]
    if tuple(p.actions) != tuple(policy.actions):
        if p.fits:
            warnings.append(
                f"{target} cannot express this per-layer mix; using the cheapest setting it can express that "
                f"still fits: {_describe(p)} (+{format_count(p.extra_flops - policy.extra_flops)}FLOP per "
                f"micro-batch over the plan)")
        else:
            warnings.append(
                f"{target} cannot express this plan and none of its settings fits the budget of "
                f"{format_bytes(policy.budget_bytes)}: the closest, {_describe(p)}, peaks at "
                f"{format_bytes(p.peak_bytes)}")
    return Export(target, config, p, warnings)


def _describe(p: LayerPolicy) -> str:
    return ", ".join(f"{n} layer(s) {a.value}" for a, n in p.counts().items() if n) or "nothing"


def _stage_local(policy: LayerPolicy) -> list[list[int]]:
    return [list(s.layers) for s in policy.stages]


# ------------------------------------------------------------------------ HF transformers

def to_hf(policy: LayerPolicy) -> Export:
    """Keyword arguments of ``PreTrainedModel.activation_checkpointing_enable``
    (transformers 5: ``activation_checkpointing_kwargs``, ``every_n_layers``, ``offload``)
    and of the older ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``.

    ``every_n_layers=n`` checkpoints (fully) the layers whose index is a multiple of
    ``n``; neither method selects layers freely nor recomputes only the attention
    core, so a mix becomes the cheapest ``n`` that fits. :func:`apply_hf` applies the
    plan itself.

    Returns
    -------
    Export
        ``config = {"method": name or None, "kwargs": {...}, "legacy": {...} or None}``.

    Examples
    --------
    >>> from solver.analytic import TransformerConfig
    >>> from solver.policy import build_planner
    >>> cfg = TransformerConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=100, seq_len=32)
    >>> pl, acts = build_planner(cfg), [LayerAction.FULL] * 4
    >>> plan = pl.policy_of(acts, pl.policy_of(acts, 0).peak_bytes)  # just fits
    >>> to_hf(plan).config["kwargs"]["every_n_layers"]
    1
    """
    L = policy.num_layers
    cands = [([LayerAction.NONE] * L, {"method": None, "kwargs": {}, "legacy": None})]
    for n in range(1, L + 1):
        actions = [LayerAction.FULL if i % n == 0 else LayerAction.NONE for i in range(L)]
        kwargs = {"activation_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": n,
                  "offload": False}
        legacy = ({"method": "gradient_checkpointing_enable",
                   "kwargs": {"gradient_checkpointing_kwargs": {"use_reentrant": False}}} if n == 1 else None)
        cands.append((actions, {"method": "activation_checkpointing_enable", "kwargs": kwargs, "legacy": legacy}))
    warnings = []
    c = policy.counts()
    if c[LayerAction.SELECTIVE]:
        warnings.append("HF checkpointing recomputes whole layers: selective (attention-core) layers become full "
                        "or kept; apply_hf(model, policy) runs the plan as is")
    if c[LayerAction.OFFLOAD]:
        warnings.append("HF `offload=True` moves the inputs of checkpointed layers to host and still recomputes "
                        "them: offloaded layers become full checkpoints here; apply_hf offloads them as planned")
    if policy.pipeline_parallel > 1:
        warnings.append("HF models run without pipeline stages: the setting is chosen against every stage's "
                        "memory of this plan")
    return _pick(policy, "hf", cands, warnings)


def apply_hf(model: Any, policy: LayerPolicy) -> Any:
    """Apply a per-layer plan to an HF model's decoder layers, in place.

    ``full`` layers run under non-reentrant :func:`torch.utils.checkpoint.checkpoint`;
    ``selective`` ones under it with a :func:`torch.utils.checkpoint.
    create_selective_checkpoint_contexts` policy that recomputes only the attention core
    (:func:`sac_policy_fn`); ``offload`` ones under
    :func:`torch.autograd.graph.save_on_cpu` (no recomputation); ``none`` layers run as
    they are. HF's public checkpointing switch (``activation_checkpointing_enable``)
    and the per-layer ``gradient_checkpointing`` flags carry the plan where they can
    express it; see :func:`solver.join.models.apply_hf_actions` for the rest. The layers act
    in training mode with gradients enabled only.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    policy : LayerPolicy
        One action per decoder layer of ``model``.

    Returns
    -------
    model

    Raises
    ------
    SolverError
        When the model's decoder-layer count differs from the policy's.
    """
    from solver.join.models import apply_hf_actions

    return apply_hf_actions(model, policy.actions)


# ------------------------------------------------------------------------ torch SAC

def sac_policy_fn(*, recompute_ops: Iterable[str] | None = None) -> Callable:
    """A ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`` for
    :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts` that recomputes
    the attention core and saves every other op's output: Korthikanti et al.'s selective
    recomputation, the ``selective`` action of :mod:`graphs.actions` (module mode runs
    the same policy). ``recompute_ops``: other op packet names to recompute instead of
    :data:`graphs.actions.ATTENTION_CORE_OPS`.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.checkpoint import CheckpointPolicy
    >>> fn = sac_policy_fn()
    >>> fn(None, torch.ops.aten.bmm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    True
    >>> fn(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    True
    """
    from graphs.module_mode import selective_policy

    return selective_policy(action=LayerAction.SELECTIVE, recompute_ops=recompute_ops)


def to_torch_sac(policy: LayerPolicy) -> Export:
    """Torch selective activation checkpointing per layer: which layers to wrap with
    ``checkpoint(..., use_reentrant=False)`` alone (``full``), with
    ``context_fn=partial(create_selective_checkpoint_contexts, policy_fn)``
    (``selective``), and which need ``torch.autograd.graph.save_on_cpu`` (``offload``).

    Returns
    -------
    Export
        ``config = {"policy_fn": callable, "layers": {action: [indices]}, "use_reentrant": False}``.
    """
    warnings = []
    if policy.counts()[LayerAction.OFFLOAD]:
        warnings.append("torch SAC's *_CPU_OFFLOAD policies are treated as recompute in eager mode: run the "
                        "'offload' layers under torch.autograd.graph.save_on_cpu instead (apply_hf does)")
    config = {"policy_fn": sac_policy_fn(), "use_reentrant": False,
              "layers": {a.value: policy.layers_with(a) for a in TRAINER_ACTIONS}}
    return Export("torch_sac", config, policy.evaluate(policy.actions), warnings)


# ------------------------------------------------------------------------ Megatron-Core

def to_megatron(policy: LayerPolicy) -> Export:
    """Megatron-Core ``TransformerConfig`` recompute fields: ``recompute_granularity``
    (None, ``"selective"``, ``"full"``), ``recompute_method`` (``"uniform"``, ``"block"``),
    ``recompute_num_layers`` and ``recompute_modules`` (e.g. ``["core_attn"]``).

    Megatron's selective mode applies to every layer, and ``full`` + ``block`` recomputes
    the first ``recompute_num_layers`` layers of every pipeline stage; a per-layer mix
    becomes the cheapest of these that fits. Activation offload is not expressed
    (Megatron's ``cpu_offloading*`` options are separate and not planned here).

    Examples
    --------
    >>> from solver.analytic import TransformerConfig
    >>> from solver.policy import build_planner
    >>> cfg = TransformerConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=100, seq_len=32)
    >>> pl, acts = build_planner(cfg), [LayerAction.SELECTIVE] * 4
    >>> plan = pl.policy_of(acts, pl.policy_of(acts, 0).peak_bytes)  # just fits
    >>> to_megatron(plan).config["recompute_granularity"]
    'selective'
    """
    L = policy.num_layers
    stages = _stage_local(policy)
    off = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
           "recompute_modules": None}
    cands = [([LayerAction.NONE] * L, dict(off)),
             ([LayerAction.SELECTIVE] * L, dict(off, recompute_granularity="selective",
                                                recompute_modules=["core_attn"]))]
    for n in range(1, max(len(s) for s in stages) + 1):
        actions = [LayerAction.NONE] * L
        for s in stages:
            for i in s[:n]:
                actions[i] = LayerAction.FULL
        method = "uniform" if n >= max(len(s) for s in stages) else "block"
        cands.append((actions, dict(off, recompute_granularity="full", recompute_method=method,
                                    recompute_num_layers=1 if method == "uniform" else n)))
    warnings = []
    if policy.counts()[LayerAction.OFFLOAD]:
        warnings.append("activation offload is not expressed in Megatron's recompute settings: offloaded "
                        "layers are recomputed instead")
    return _pick(policy, "megatron", cands, warnings)


# ------------------------------------------------------------------------ DeepSpeed

def to_deepspeed(policy: LayerPolicy) -> Export:
    """The DeepSpeed ``activation_checkpointing`` JSON block.

    The block does not choose layers: the model code wraps each layer to checkpoint with
    ``deepspeed.checkpointing.checkpoint``; the layers are listed in the warnings and in
    ``config["layers_to_checkpoint"]`` (not a DeepSpeed key: drop it before passing the
    block on). DeepSpeed recomputes whole layers; ``cpu_checkpointing`` (which needs
    ``partition_activations``) keeps the checkpointed inputs in host memory, so planned
    offload layers become checkpointed layers with it on.

    Examples
    --------
    >>> from solver.analytic import TransformerConfig
    >>> from solver.policy import build_planner
    >>> cfg = TransformerConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=100, seq_len=32)
    >>> pl, acts = build_planner(cfg), [LayerAction.FULL, LayerAction.NONE] * 2
    >>> plan = pl.policy_of(acts, pl.policy_of(acts, 0).peak_bytes)  # just fits
    >>> to_deepspeed(plan).config["activation_checkpointing"]["number_checkpoints"]
    2
    """
    c = policy.counts()
    actions = [LayerAction.NONE if a == LayerAction.NONE else LayerAction.FULL for a in policy.actions]
    layers = [i for i, a in enumerate(actions) if a == LayerAction.FULL]
    cpu = bool(c[LayerAction.OFFLOAD])
    block = {
        "partition_activations": cpu or getattr(policy.config, "tensor_parallel", 1) > 1,
        "cpu_checkpointing": cpu,
        "contiguous_memory_optimization": False,
        "number_checkpoints": len(layers) or None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }
    warnings = []
    if c[LayerAction.SELECTIVE]:
        warnings.append("DeepSpeed recomputes whole layers: selective layers become full checkpoints")
    if layers:
        warnings.append(f"wrap layers {layers} with deepspeed.checkpointing.checkpoint in the model code; the "
                        "JSON block alone does not select layers")
    return _pick(policy, "deepspeed",
                 [(actions, {"activation_checkpointing": block, "layers_to_checkpoint": layers})], warnings)


# ------------------------------------------------------------------------ torchtitan

def to_torchtitan(policy: LayerPolicy) -> Export:
    """The torchtitan ``[activation_checkpoint]`` section: ``mode`` in ``"none"``,
    ``"selective"``, ``"full"``; with ``selective``, ``selective_ac_option`` an int string
    ``"n"`` checkpoints (fully) every n-th layer of a stage (layers ``n-1, 2n-1, ...``).

    torchtitan's ``"op"`` option saves matmul and attention outputs and recomputes the
    rest, which is not the attention-core recomputation planned here, so it is not used.

    Returns
    -------
    Export
        ``config = {"activation_checkpoint": {...}}`` and a TOML rendering in
        ``config["toml"]``.
    """
    L = policy.num_layers
    stages = _stage_local(policy)
    cands = [([LayerAction.NONE] * L, {"mode": "none"}), ([LayerAction.FULL] * L, {"mode": "full"})]
    for n in range(2, max(len(s) for s in stages) + 1):
        actions = [LayerAction.NONE] * L
        for s in stages:
            for j, i in enumerate(s):
                if (j + 1) % n == 0:
                    actions[i] = LayerAction.FULL
        cands.append((actions, {"mode": "selective", "selective_ac_option": str(n)}))
    warnings = []
    c = policy.counts()
    if c[LayerAction.SELECTIVE]:
        warnings.append("torchtitan has no attention-core-only recomputation ('op' saves matmuls and attention "
                        "instead): selective layers become full or kept")
    if c[LayerAction.OFFLOAD]:
        warnings.append("torchtitan's [activation_checkpoint] has no activation offload: offloaded layers are "
                        "recomputed instead")
    exp = _pick(policy, "torchtitan", cands, warnings)
    section = exp.config
    toml = "[activation_checkpoint]\n" + "".join(f'{k} = "{v}"\n' for k, v in section.items())
    exp.config = {"activation_checkpoint": section, "toml": toml}
    return exp

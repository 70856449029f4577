""""Will it fit?": the peak of a training step without remat, with every layer
checkpointed and with the best per-layer policy, and the largest micro-batch and
sequence length that fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphs.units import format_bytes
from solver.errors import InfeasibleBudget
from solver.policy import (LayerAction, LayerPolicy, budget_bytes_of, build_graph_planner, build_planner,
                           check_batch_options, check_graph_options, wants_graph)

__all__ = ["Estimate", "estimate"]


@dataclass
class Estimate:
    """Predicted peaks of one training step on one device (bytes; on one rank under
    ``sharding``).

    Attributes
    ----------
    budget_bytes : int
    peak_no_remat : int
        Every activation kept.
    peak_full_remat : int
        Every layer checkpointed (``full``).
    peak_best : int
        The best policy's peak when it fits, else the smallest feasible peak.
    policy : LayerPolicy or None
        The best policy, None when nothing fits.
    max_micro_batch, max_seq_len : int or None
        Largest values that fit with the best policy (0: not even 1 fits), the other
        held at the asked value. None on the captured path when the example batch was
        given (its shape cannot be varied).
    source : {"config", "graph"}
        Analytic model, or the simulator on the captured training step.
    notes : list of str
    world_size : int
    sharding : {None, "ddp", "fsdp"}
    """

    budget_bytes: int
    peak_no_remat: int
    peak_full_remat: int
    peak_best: int
    policy: LayerPolicy | None
    max_micro_batch: int
    max_seq_len: int
    seq_len: int | None
    micro_batch: int | None
    source: str = "config"
    notes: list = None
    world_size: int = 1
    sharding: str | None = None

    def __post_init__(self) -> None:
        if self.notes is None:
            self.notes = []

    @property
    def fits_no_remat(self) -> bool:
        return self.peak_no_remat <= self.budget_bytes

    @property
    def fits_full_remat(self) -> bool:
        return self.peak_full_remat <= self.budget_bytes

    @property
    def fits(self) -> bool:
        return self.policy is not None

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "peak_no_remat": self.peak_no_remat,
                "peak_full_remat": self.peak_full_remat, "peak_best": self.peak_best,
                "fits_no_remat": self.fits_no_remat, "fits_full_remat": self.fits_full_remat, "fits": self.fits,
                "max_micro_batch": self.max_micro_batch, "max_seq_len": self.max_seq_len,
                "seq_len": self.seq_len, "micro_batch": self.micro_batch, "source": self.source,
                "notes": list(self.notes), "world_size": self.world_size, "sharding": self.sharding,
                "policy": None if self.policy is None else self.policy.to_dict()}

    def __str__(self) -> str:
        def row(name, peak, ok, extra=""):
            return f"{name:<22} {format_bytes(peak):>11}  {'fits' if ok else 'does not fit':<12} {extra}"
        best_extra = "" if self.policy is None else (
            f"+{100 * self.policy.overhead:.2f} % compute, "
            + ", ".join(f"{v} {k.value}" for k, v in self.policy.counts().items() if v))
        shape = "" if self.seq_len is None else f", seq {self.seq_len}, micro-batch {self.micro_batch}"
        dp = f", {self.sharding.upper()} x{self.world_size}, per rank" if self.sharding else ""
        lines = [f"Estimate ({self.source}): budget {format_bytes(self.budget_bytes)}{shape}{dp}",
                 row("no remat", self.peak_no_remat, self.fits_no_remat),
                 row("full (every layer)", self.peak_full_remat, self.fits_full_remat),
                 row("best policy", self.peak_best, self.fits, best_extra),
                 ]
        if self.max_micro_batch is not None:
            lines.append(f"largest micro-batch that fits (seq {self.seq_len}): {self.max_micro_batch}")
        if self.max_seq_len is not None:
            lines.append(f"largest sequence length that fits (micro-batch {self.micro_batch}): {self.max_seq_len}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _largest(fits, *, start: int, cap: int) -> int:
    """Largest n in [1, cap] with fits(n) (fits is monotone decreasing), 0 if none."""
    if not fits(1):
        return 0
    lo = 1
    hi = max(2, start)
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def estimate(model_or_config: Any, gpu_gb: float, *, seq_len: int | None = None, micro_batch: int | None = None,
             max_seq_cap: int = 1 << 22, max_batch_cap: int = 1 << 16, reserved_bytes: int = 0,
             **options) -> Estimate:
    """Will a training step fit ``gpu_gb``: without remat, with every layer checkpointed,
    with the best per-layer policy; and the largest micro-batch and sequence length that
    fit with the best policy.

    Both searches are exponential then binary (O(log n) plans), valid because the
    smallest feasible peak grows with the micro-batch and with the sequence length.

    Parameters
    ----------
    model_or_config :
        As for :func:`solver.policy.policy`.
    gpu_gb : float
        Device memory in GiB.
    seq_len, micro_batch : int, optional
        Override the config's.
    max_seq_cap, max_batch_cap : int
        Upper ends of the searches.
    reserved_bytes : int
    **options
        Any other keyword of :func:`solver.policy.policy` (``tensor_parallel``,
        ``pipeline_parallel``, ``world_size``, ``sharding``, ``optimizer``,
        ``hardware``, ``example_inputs``, ``via``...). With ``world_size`` and
        ``sharding`` (``"ddp"`` or ``"fsdp"``) ``gpu_gb`` and every peak are per rank,
        and the micro-batch is the rank's own. An ``nn.Module`` is estimated on its captured training step (see
        :func:`solver.policy.policy`): the three peaks are the simulator's; for an HF
        model whose batch is built from ``seq_len``/``micro_batch`` the largest
        micro-batch and sequence length are searched with ``search=True`` (one capture per
        size tried), else they are None.

    Returns
    -------
    Estimate

    Examples
    --------
    >>> from solver.analytic import TransformerConfig
    >>> cfg = TransformerConfig(num_layers=4, hidden_size=1024, num_heads=16, vocab_size=32000,
    ...                         seq_len=2048, micro_batch=4)
    >>> e = estimate(cfg, 5.0)
    >>> e.fits, e.fits_no_remat, e.max_micro_batch >= 4
    (True, False, True)
    >>> estimate(cfg, 5.0, world_size=8, sharding="fsdp").max_micro_batch >= e.max_micro_batch
    True
    """
    budget = budget_bytes_of(gpu_gb, reserved_bytes)
    check_batch_options(seq_len=seq_len, micro_batch=micro_batch)
    if wants_graph(model_or_config, options.pop("via", "auto")):
        return _estimate_graph(model_or_config, budget, seq_len=seq_len, micro_batch=micro_batch,
                               max_seq_cap=max_seq_cap, max_batch_cap=max_batch_cap, **options)
    options.pop("via", None)
    planner = build_planner(model_or_config, seq_len=seq_len, micro_batch=micro_batch, **options)
    cfg = planner.cfg
    L = cfg.num_layers
    peak_none = planner.policy_of([LayerAction.NONE] * L, budget).peak_bytes
    peak_full = planner.policy_of([LayerAction.FULL] * L, budget).peak_bytes
    try:
        best: LayerPolicy | None = planner.solve(budget)
        peak_best = best.peak_bytes
    except InfeasibleBudget as e:
        best, peak_best = None, e.smallest_feasible_bytes

    def fits_with(**change) -> bool:
        pl = build_planner(cfg.replace(**change), **options)
        return pl.min_peak() <= budget

    max_b = _largest(lambda b: fits_with(micro_batch=b), start=cfg.micro_batch, cap=max_batch_cap)
    max_s = _largest(lambda s: fits_with(seq_len=s), start=cfg.seq_len, cap=max_seq_cap)
    return Estimate(budget, peak_none, peak_full, peak_best, best, max_b, max_s, cfg.seq_len, cfg.micro_batch,
                    world_size=planner.world_size, sharding=planner.sharding)


def _estimate_graph(model: Any, budget: int, *, seq_len, micro_batch, max_seq_cap: int, max_batch_cap: int,
                    example_inputs: Any = None, search: bool | None = None, **options) -> Estimate:
    graph_opts = {k: options.pop(k) for k in ("optimizer", "hardware", "allow_offload", "blocks", "measure_time",
                                               "loss_fn", "world_size", "sharding") if k in options}
    check_graph_options(**options)
    gp = build_graph_planner(model, example_inputs=example_inputs, seq_len=seq_len, micro_batch=micro_batch,
                             **graph_opts)
    L = len(gp.blocks)
    peak_none = gp.evaluate([LayerAction.NONE] * L)[1].peak_bytes
    peak_full = gp.evaluate([LayerAction.FULL] * L)[1].peak_bytes
    try:
        best: LayerPolicy | None = gp.solve(budget)
        peak_best = best.peak_bytes
    except InfeasibleBudget as e:
        best, peak_best = None, e.smallest_feasible_bytes
    notes = [f"peaks simulated on the captured training step ({len(gp.graph.ops)} ops; parameters, buffers, "
             f"inputs, gradients and {format_bytes(gp.optimizer_bytes)} of {gp.optimizer} state included)"]
    notes.extend(gp.notes)
    built = example_inputs is None
    max_b = max_s = None
    if search and built:
        def fits_with(b: int, s: int) -> bool:
            pl = build_graph_planner(model, seq_len=s, micro_batch=b, **graph_opts)
            return pl.min_peak() <= budget

        b0, s0 = int(micro_batch or 1), int(seq_len)
        max_pos = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        seq_cap = min(max_seq_cap, int(max_pos)) if max_pos else max_seq_cap
        max_b = _largest(lambda b: fits_with(b, s0), start=b0, cap=max_batch_cap)
        max_s = _largest(lambda s: fits_with(b0, s), start=s0, cap=seq_cap)
        if max_pos and max_s == seq_cap:
            notes.append(f"sequence length capped at the model's {seq_cap} positions")
    elif not built:
        notes.append("largest micro-batch / sequence length not searched: the example batch was given")
    else:
        notes.append("largest micro-batch / sequence length not searched (search=True captures the step "
                     "again for each size tried)")
    return Estimate(budget, int(peak_none), int(peak_full), int(peak_best), best, max_b, max_s,
                    seq_len, micro_batch, source="graph", notes=notes, world_size=gp.world_size,
                    sharding=gp.sharding)

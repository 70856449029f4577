""""Will it fit?": the peak of a training step without remat, with every layer
checkpointed and with the best per-layer policy, and the largest micro-batch and
sequence length that fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphs.units import format_bytes
from solver.errors import InfeasibleBudget
from solver.policy import LayerAction, LayerPolicy, budget_bytes_of, build_planner

__all__ = ["Estimate", "estimate"]


@dataclass
class Estimate:
    """Predicted peaks of one training step on one device (bytes).

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
    max_micro_batch, max_seq_len : int
        Largest values that fit with the best policy (0: not even 1 fits), the other
        held at the asked value.
    """

    budget_bytes: int
    peak_no_remat: int
    peak_full_remat: int
    peak_best: int
    policy: LayerPolicy | None
    max_micro_batch: int
    max_seq_len: int
    seq_len: int
    micro_batch: int

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
                "seq_len": self.seq_len, "micro_batch": self.micro_batch,
                "policy": None if self.policy is None else self.policy.to_dict()}

    def __str__(self) -> str:
        def row(name, peak, ok, extra=""):
            return f"{name:<22} {format_bytes(peak):>11}  {'fits' if ok else 'does not fit':<12} {extra}"
        best_extra = "" if self.policy is None else (
            f"+{100 * self.policy.overhead:.2f} % compute, "
            + ", ".join(f"{v} {k.value}" for k, v in self.policy.counts().items() if v))
        lines = [f"Estimate: budget {format_bytes(self.budget_bytes)}, seq {self.seq_len}, "
                 f"micro-batch {self.micro_batch}",
                 row("no remat", self.peak_no_remat, self.fits_no_remat),
                 row("full (every layer)", self.peak_full_remat, self.fits_full_remat),
                 row("best policy", self.peak_best, self.fits, best_extra),
                 f"largest micro-batch that fits (seq {self.seq_len}): {self.max_micro_batch}",
                 f"largest sequence length that fits (micro-batch {self.micro_batch}): {self.max_seq_len}"]
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
        ``pipeline_parallel``, ``optimizer``, ``hardware``...).

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
    """
    budget = budget_bytes_of(gpu_gb, reserved_bytes)
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
    return Estimate(budget, peak_none, peak_full, peak_best, best, max_b, max_s, cfg.seq_len, cfg.micro_batch)

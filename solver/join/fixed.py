"""The fixed charges of a step that :func:`solver.optimize` plans: optimizer state and
the gradient seed (:class:`graphs.fixed.FixedCharges`).

Two optimizer-state models, on purpose:

- :func:`optimizer_state_bytes` (here, for :func:`solver.optimize`) prices the torch
  optimizer that will run: its state measured when it exists, else what that optimizer
  keeps in steady state, in the parameters' own dtype (Adam/AdamW: two moments per
  parameter; no master copy: a torch optimizer keeps none).
- :func:`solver.analytic.state_bytes_per_parameter` (for :func:`solver.policy` and
  :func:`solver.estimate`, which price a trainer's step before any optimizer exists)
  follows the mixed-precision convention of Megatron and DeepSpeed: with 16-bit
  parameters the optimizer keeps an fp32 master copy and fp32 moments, 12 bytes per
  parameter for Adam. In fp32 the two models agree (8 bytes per parameter for Adam).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphs import ComputeGraph
from graphs.fixed import fixed_charges

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["SEED_RESERVE", "optimizer_state_bytes", "untracked_bytes"]

#: bytes charged on top of the graph for the scalars autograd creates outside it (the
#: gradient seed of ``loss.backward()``)
SEED_RESERVE = 64


def untracked_bytes(cg: ComputeGraph | None) -> int:
    """Bytes the prediction charges that a live-tensor tracker cannot see in a step of
    the bare model: the optimizer state, not yet created, and under DDP the gradient
    buckets (the tracker sees the loss and its gradient seed).

    Examples
    --------
    >>> from graphs.fixed import charge
    >>> g = ComputeGraph(); _ = charge(g, optimizer=160, seed=64)
    >>> untracked_bytes(g), untracked_bytes(None)
    (160, 0)
    """
    return 0 if cg is None else fixed_charges(cg).untracked


def optimizer_state_bytes(optimizer: "torch.optim.Optimizer | None", model: "nn.Module") -> int:
    """Bytes of optimizer state during a step: measured when the state exists, else the
    steady state of the optimizer's kind (Adam/AdamW: two tensors per parameter; SGD
    with momentum: one).

    Examples
    --------
    >>> import torch
    >>> net = torch.nn.Linear(4, 4)
    >>> optimizer_state_bytes(torch.optim.Adam(net.parameters()), net)
    160
    """
    if optimizer is None:
        return 0
    import torch

    total = 0
    seen = set()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    if total:
        return total
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return 2 * param_bytes
    if name == "sgd" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return param_bytes
    if "rmsprop" in name or "adagrad" in name:
        return param_bytes
    return 0

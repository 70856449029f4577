"""The user's own loss in the captured step: what it holds between the model's forward
and backward.

A training loop computes the loss outside the model (``loss =
F.cross_entropy(fast(ids).flatten(0, 1), targets)``): after the model's forward, the
loss's forward keeps what its backward needs (cross-entropy: the log-softmax of the
logits), its backward makes the gradient of the model's outputs and frees it; then the
model's backward starts. A graph captured with ``backward="outputs"`` starts its
backward at the output gradients (tangents), so the loss is outside it.
:func:`charge_loss` measures one run of the loss on outputs shaped as the captured ones
and charges its peak as the workspace of the node where the backward starts
(:data:`graphs.compute_graph.BACKWARD_START`, which runs when every output gradient has
arrived): the simulator then counts, at that moment, everything the forward keeps, the
output gradients and the loss's own peak, as the real step holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.errors import CaptureError
from graphs.memory import AllocatorPeak
from graphs.torch_internals import tree_leaves, tree_unflatten

__all__ = ["LossCharge", "charge_loss", "loss_charge", "outputs_like"]


@dataclass(frozen=True)
class LossCharge:
    """One run of the loss on the model's outputs, measured by the allocator.

    Attributes
    ----------
    held_bytes : int
        What the loss's forward leaves allocated for its backward (saved tensors, the
        loss itself).
    peak_bytes : int
        The highest the loss's forward and backward took the allocator above the
        outputs, the output gradients it makes included.
    grad_bytes : int
        Bytes of the output gradients it makes.
    """

    held_bytes: int
    peak_bytes: int
    grad_bytes: int

    @property
    def workspace(self) -> int:
        """What the loss needs beyond the output gradients, charged where the backward
        starts (the gradients are the graph's tangents, charged on their own)."""
        return max(0, self.peak_bytes - self.grad_bytes)


def outputs_like(cg: ComputeGraph, *, requires_grad: bool = True) -> Any:
    """Zero tensors shaped as the captured step's outputs, in the structure the model
    returns them (an HF ``ModelOutput``, a tuple, a tensor); floating ones require grad.

    Examples
    --------
    >>> from graphs.capture import capture
    >>> net = torch.nn.Linear(4, 3)
    >>> cg = capture(net, (torch.randn(2, 4),), backward="outputs", measure_time=False)
    >>> out = outputs_like(cg)
    >>> out.shape, out.requires_grad
    (torch.Size([2, 3]), True)
    """
    info = cg.capture_info
    if info is None:
        raise CaptureError("outputs_like needs a graph captured in this process (it carries capture_info)")
    out_node = next(n for n in info.step.gm.graph.nodes if n.op == "output")
    flat = []
    for a in tree_leaves(out_node.args):
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if isinstance(val, torch.Tensor):
            device = val.device if val.device.type != "meta" else torch.device("cpu")
            t = torch.zeros(val.shape, dtype=val.dtype, device=device)
            if requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            val = t
        flat.append(val)
    return tree_unflatten(flat, info.out_spec)


def loss_charge(loss_fn: Callable[[Any], torch.Tensor], outputs: Any) -> LossCharge:
    """Measure one forward and backward of ``loss_fn(outputs)`` by the allocator.

    Examples
    --------
    >>> logits = torch.zeros(64, 1000, requires_grad=True)
    >>> targets = torch.zeros(64, dtype=torch.long)
    >>> c = loss_charge(lambda out: torch.nn.functional.cross_entropy(out, targets), logits)
    >>> c.grad_bytes == 64 * 1000 * 4 and c.held_bytes >= 64 * 1000 * 4   # the log-softmax
    True
    """
    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    with AllocatorPeak(outputs) as fwd:
        loss = loss_fn(outputs)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
        raise CaptureError(f"loss_fn must return a scalar tensor that depends on the model's output, got "
                           f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    with AllocatorPeak(device=fwd.device) as bwd:
        loss.backward()
    held = max(0, fwd.allocated_bytes)
    grads = sum(t.grad.untyped_storage().nbytes() for t in leaves if t.grad is not None)
    peak = max(fwd.peak_bytes - fwd.baseline_bytes, held + bwd.peak_bytes)
    return LossCharge(held_bytes=held, peak_bytes=int(peak), grad_bytes=int(grads))


def charge_loss(cg: ComputeGraph, loss_fn: Callable[[Any], torch.Tensor], *,
                outputs_of: ComputeGraph | None = None) -> LossCharge | None:
    """Charge the user's loss on a graph captured with ``backward="outputs"``: its peak
    beyond the output gradients becomes the workspace of the node where the backward
    starts. None (nothing charged) when the graph has no such node, or on fake and meta
    inputs, where nothing can run; ``cg.meta["loss"]`` says which.

    ``outputs_of``: the capture whose outputs the loss is measured on, where ``cg`` is a
    DAG written from another capture with outputs of the same shapes (the whole model's
    DAG of a capture cut to fewer alike layers, :class:`graphs.repeated.CutCapture`);
    default ``cg`` itself.

    Examples
    --------
    >>> from graphs.capture import capture
    >>> net = torch.nn.Linear(16, 1000)
    >>> x, y = torch.randn(64, 16), torch.zeros(64, dtype=torch.long)
    >>> cg = capture(net, (x,), backward="outputs", measure_time=False)
    >>> c = charge_loss(cg, lambda out: torch.nn.functional.cross_entropy(out, y))
    >>> cg[BACKWARD_START]["workspace"] == c.workspace > 0, cg.meta["loss"]
    (True, 'measured')
    """
    if BACKWARD_START not in cg.nx:
        cg.meta["loss"] = "none"
        return None
    source = cg if outputs_of is None else outputs_of
    if not source.capture_info.real:
        cg.meta["loss"] = "not measured (fake or meta inputs)"
        return None
    with torch.random.fork_rng():
        charge = loss_charge(loss_fn, outputs_like(source))
    cg[BACKWARD_START]["workspace"] = charge.workspace
    cg.meta["loss"] = "measured"
    return charge

"""What a training step's forward needs at the least, found without running it on real
tensors: one forward of fake copies of the model and its inputs (nothing allocated),
with gradients enabled so that autograd picks the kernels a training step runs.

Two facts come out of it, both bounds that no schedule goes below:

- the parameters the forward reads (each gets a gradient, held at the step's end);
- the largest op's footprint: the bytes of the storages its inputs and outputs use,
  beyond the parameters, buffers and inputs, which must be resident together while the
  op runs in any schedule that runs the op as it is. A compiler that fuses ops (inductor)
  may never materialize an output, so the bound is for eager ATen ops only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from graphs.torch_internals import (FakeTensorMode, TorchDispatchMode, module_hooks_off, storage_key, tree_flatten,
                                    tree_unflatten)

__all__ = ["ForwardFootprint", "forward_footprint"]


@dataclass(frozen=True)
class ForwardFootprint:
    """What one training forward of a model reads and needs at the least.

    Attributes
    ----------
    parameters_read : frozenset of str
        Names of the parameters the forward reads.
    largest_op_bytes : int
        The largest footprint of one op: the bytes of the distinct storages of its
        tensor inputs and outputs, parameters, buffers and the model's inputs left out.
    largest_op : str
        That op's name (``"aten.mm.default"``); empty where no op holds anything.
    """

    parameters_read: frozenset
    largest_op_bytes: int
    largest_op: str


class _Footprints(TorchDispatchMode):
    """Records, per op dispatched, which parameters it reads and its footprint."""

    def __init__(self, params: dict[int, str], resident: set[int]) -> None:
        super().__init__()
        self.params, self.resident = params, resident
        self.read: set[str] = set()
        self.largest, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen: dict[int, int] = {}
        for t in tree_flatten((args, kwargs, out))[0]:
            if not isinstance(t, torch.Tensor):
                continue
            name = self.params.get(id(t))
            if name is not None:
                self.read.add(name)
            st = t.untyped_storage()
            key = storage_key(st)
            if key not in self.resident:
                seen[key] = st.nbytes()
        total = sum(seen.values())
        if total > self.largest:
            self.largest, self.op = total, str(func)
        return out


def forward_footprint(model: nn.Module, args: tuple, kwargs: dict) -> ForwardFootprint | None:
    """One training forward of ``model`` on ``(args, kwargs)`` run on fake copies in
    training mode (no memory allocated, no random number drawn, the model's modes,
    buffers and hooks untouched):
    the parameters it reads and its largest op's footprint. None where the forward
    cannot run on fake tensors (an op that reads values, say) or where a module holds a
    tensor as a plain attribute (neither parameter nor buffer: copying the model would
    allocate it).

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 1))
    >>> fp = forward_footprint(net, (torch.randn(8, 64),), {})
    >>> sorted(fp.parameters_read)
    ['0.bias', '0.weight', '2.bias', '2.weight']
    >>> fp.largest_op_bytes == 2 * 8 * 512 * 4  # the ReLU: its input and output
    True
    """
    from graphs.capture import fake_copies

    if any(isinstance(v, torch.Tensor) for m in model.modules() for v in vars(m).values()):
        return None  # a tensor held as a plain attribute: the copy would allocate it again
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    flat, spec = tree_flatten((args, kwargs))
    try:
        fake_model, fake_flat = fake_copies(model, flat, fake_mode)
    except Exception:
        return None
    fake_model.train()  # a training step's forward, whatever mode the model is in now (the copy's flag)
    params = {id(p): name for name, p in fake_model.named_parameters()}
    resident = {storage_key(t.untyped_storage())
                for t in list(fake_model.parameters()) + list(fake_model.buffers()) + fake_flat
                if isinstance(t, torch.Tensor)}
    fargs, fkwargs = tree_unflatten(fake_flat, spec)
    recorder = _Footprints(params, resident)
    try:
        with module_hooks_off(fake_model), torch.random.fork_rng(devices=[]), torch.enable_grad(), fake_mode, \
                recorder:
            type(fake_model).__call__(fake_model, *fargs, **fkwargs)
    except Exception:  # a forward that cannot run on fake tensors proves nothing
        return None
    return ForwardFootprint(frozenset(recorder.read), int(recorder.largest), recorder.op)

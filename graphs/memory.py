"""Measure, don't assume: peak bytes of live tensors, and bytes autograd saves.

:class:`MemoryTracker` counts every tensor storage alive during a call, on any device:
a ``TorchDispatchMode`` registers the storage of every op output, weak-reference
finalizers subtract it when it is freed, and tensors that exist beforehand (parameters,
buffers, gradients, inputs: pass them as ``roots``) are registered on entry. Storages are
counted once however many views share them. On CUDA it also reports
``torch.cuda.max_memory_allocated`` over the same call.

:class:`SavedTensorCounter` counts, with ``torch.autograd.graph.saved_tensors_hooks``,
the storages that autograd saves for backward during a real forward.

Examples
--------
>>> import torch
>>> lin = torch.nn.Linear(256, 256)
>>> x = torch.randn(64, 256)
>>> with MemoryTracker(lin, x) as mt:
...     lin(x).relu().sum().backward()
>>> mt.baseline_bytes == (256 * 256 + 256 + 64 * 256) * 4
True
>>> mt.peak_bytes - mt.baseline_bytes >= 2 * 64 * 256 * 4   # two activations at least
True
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch

from graphs.torch_internals import TorchDispatchMode, tree_leaves

__all__ = ["MemoryTracker", "SavedTensorCounter", "measure_peak"]


def _tensors_of(roots: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for root in roots:
        if isinstance(root, torch.nn.Module):
            for p in root.parameters():
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
            out.extend(root.buffers())
        elif isinstance(root, torch.Tensor):
            out.append(root)
            if root.grad is not None:
                out.append(root.grad)
        else:
            out.extend(_tensors_of(t for t in tree_leaves(root) if isinstance(t, (torch.Tensor, torch.nn.Module))))
    return out


def _storage_key(t: torch.Tensor) -> tuple[Any, int, int] | None:
    try:
        st = t.untyped_storage()
    except Exception:
        return None
    if st.nbytes() == 0 or t.device.type == "meta":
        return None
    return (t.device, st.data_ptr(), st.nbytes())


class MemoryTracker(TorchDispatchMode):
    """Peak bytes of all live tensor storages during a ``with`` block.

    Parameters
    ----------
    *roots : modules, tensors or containers of them
        What exists before the block and counts toward the peak: a module's parameters,
        buffers and existing gradients; tensors (and their gradients).

    Attributes
    ----------
    baseline_bytes : int
        Bytes of the roots on entry.
    peak_bytes : int
        Largest total of live storages seen (baseline included), sampled after every op.
    current_bytes : int
        Live bytes now (on exit: what survives the block).
    cuda_peak_bytes : int or None
        ``torch.cuda.max_memory_allocated`` during the block, when CUDA is available.
    """

    def __init__(self, *roots: Any) -> None:
        super().__init__()
        self._roots = roots
        self._live: dict[tuple, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.cuda_peak_bytes: int | None = None
        self._cuda_start = 0

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None or key in self._live:
            return
        nbytes = key[2]
        self._live[key] = nbytes
        self.current_bytes += nbytes
        weakref.finalize(t.untyped_storage(), self._release, key)

    def _release(self, key: tuple) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.current_bytes -= nbytes

    def __enter__(self) -> "MemoryTracker":
        for t in _tensors_of(self._roots):
            self._track(t)
        self.baseline_bytes = self.current_bytes
        self.peak_bytes = self.current_bytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.cuda_peak_bytes = int(torch.cuda.max_memory_allocated())
        self._roots = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        return out


def measure_peak(fn, *args: Any, roots: Iterable[Any] = (), **kwargs: Any) -> MemoryTracker:
    """Call ``fn(*args, **kwargs)`` under a :class:`MemoryTracker` and return the tracker.

    ``args`` and ``roots`` count as pre-existing tensors.

    Examples
    --------
    >>> a = torch.ones(1024)
    >>> measure_peak(lambda x: (x * 2) + 1, a).peak_bytes
    12288
    """
    with MemoryTracker(*roots, args, kwargs) as tracker:
        tracker.result = fn(*args, **kwargs)
    return tracker


class SavedTensorCounter:
    """Bytes that autograd saves for backward inside a ``with`` block.

    Storage-deduplicated; storages of ``exclude`` (e.g. a model's parameters and
    buffers) are not counted. Inputs are counted when autograd saves them.

    Parameters
    ----------
    *exclude : modules, tensors or containers of them

    Examples
    --------
    >>> lin = torch.nn.Linear(8, 8)
    >>> x = torch.randn(4, 8)
    >>> with SavedTensorCounter(lin) as saved:
    ...     y = lin(x).relu()
    >>> saved.bytes == 2 * 4 * 8 * 4   # the input of the matmul and the relu result
    True
    """

    def __init__(self, *exclude: Any) -> None:
        self._exclude = {k[:2] for k in (_storage_key(t) for t in _tensors_of(exclude)) if k}
        self._seen: dict[tuple, int] = {}
        self._hooks = None

    @property
    def bytes(self) -> int:
        return int(sum(self._seen.values()))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key[:2] not in self._exclude:
            self._seen.setdefault(key[:2], key[2])
        return t

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

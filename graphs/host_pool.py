"""Host memory for offloaded values, and the four transfer steps a rewritten graph runs.

A schedule's :class:`~solver.schedule.Offload` sends a copy of a value to host memory and
fetches it back before it is read again. :mod:`graphs.rewrite` emits, for each one, four
calls of this module into the forward and backward graphs:

* :func:`send` (before the op of the transfer-out step): start the copy to the host;
  returns the host copy, which the graphs carry like any value (a saved value when the
  window spans the end of the forward);
* :func:`sent` (after that op): the last use of the device copy, so that it is freed
  there, as the simulator stops charging it;
* :func:`fetch` (before the op of the transfer-in step): allocate the device copy and
  start the copy back;
* :func:`arrived` (after that op): the value as the ops that read it next see it.

On CUDA the host copy is pinned memory and both copies are non-blocking, each direction
on a side stream of its own (the two run concurrently, as the simulator's link model
has it), and events order the streams: a side stream waits for the compute stream
before it reads a value or writes into fresh memory; the device copy of a sent value is
marked as used by its side stream (``record_stream``), so its memory is not reused
before the copy has left; a fetch waits for its value's copy to the host; and the
compute stream waits for a fetch's event in :func:`arrived`, so nothing reads a value
before it is back.

On CPU device and host share one allocator, so an offload could not show in the
allocator's peak. The host is *emulated*: a host copy is a NumPy-owned buffer wrapped by
``torch.from_numpy`` without copying, outside c10's CPU allocator. The profiler's
allocation events, which :class:`graphs.memory.AllocatorPeak` judges a CPU step by, do
not see it; the device copies (what :func:`fetch` allocates) are ordinary tensors and
are counted. The copies are synchronous, so on CPU an offload is judged for its memory,
not for its time. :func:`host_stats` reports what the host holds.

Examples
--------
>>> x = torch.arange(6.0).reshape(2, 3).t()       # any strides
>>> h = send(x); sent(x)
>>> h.device.type, h.shape == x.shape, h.stride() == x.stride()
('cpu', True, True)
>>> y = arrived(fetch(h, x.device))
>>> torch.equal(y, x), y.stride() == x.stride()
(True, True)
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from graphs.errors import RematError

__all__ = ["HostStats", "arrived", "fetch", "host_stats", "measure_host_bandwidth", "reset_host_stats", "send",
           "sent", "span_bytes"]

log = logging.getLogger(__name__)

_ARRIVAL = "_remat_arrival"  # attribute of a fetched CUDA tensor: the event its copy records
_LEFT = "_remat_left"  # attribute of a CUDA value's host copy: the event its copy to the host records
_lock = threading.Lock()
_side_streams: dict[Any, Any] = {}


@dataclass
class HostStats:
    """What the host side of offloading did since :func:`reset_host_stats`.

    Attributes
    ----------
    held_bytes : int
        Bytes of host copies alive now (emulated ones on CPU, pinned ones on CUDA).
    peak_bytes : int
        The most ``held_bytes`` reached.
    sent_bytes, fetched_bytes : int
        Bytes copied to the host and back.
    sends, fetches : int
        How many copies each way.
    """

    held_bytes: int = 0
    peak_bytes: int = 0
    sent_bytes: int = 0
    fetched_bytes: int = 0
    sends: int = 0
    fetches: int = 0


_stats = HostStats()


def host_stats() -> HostStats:
    """A copy of the host side's counters (process-wide).

    Examples
    --------
    >>> before = host_stats().held_bytes
    >>> h = send(torch.ones(4)); host_stats().held_bytes - before
    16
    >>> del h; host_stats().held_bytes - before
    0
    """
    with _lock:
        return HostStats(**vars(_stats))


def reset_host_stats() -> None:
    """Set the counters to zero (``held_bytes`` and ``peak_bytes`` to what is held now)."""
    with _lock:
        held = _stats.held_bytes
        _stats.__init__(held_bytes=held, peak_bytes=held)


def _released(nbytes: int) -> None:
    with _lock:
        _stats.held_bytes -= nbytes


def span_bytes(t: torch.Tensor) -> int:
    """Bytes of the stretch of storage that ``t``'s elements cover (what an offload of
    ``t`` moves: its strides kept, gaps included).

    Examples
    --------
    >>> span_bytes(torch.empty(4, 4)[:, :2])      # 3 rows of 4 and 2 more elements
    56
    """
    return _span(t.shape, t.stride()) * t.element_size()


def _span(shape, stride) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _flat(t: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` elements of storage from ``t``'s first one, as a 1-d tensor."""
    return t.as_strided((n,), (1,), t.storage_offset())


def _emulated_host(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` in a NumPy-owned buffer (outside c10's allocator)."""
    buf = np.empty(n * dtype.itemsize, dtype=np.uint8)
    weakref.finalize(buf, _released, buf.nbytes)
    flat = torch.from_numpy(buf)  # shares the buffer: no copy, no allocator call
    return flat.view(dtype) if dtype != torch.uint8 else flat


def _side_stream(device: torch.device, direction: str) -> Any:
    """The stream of one direction of ``device``'s host link (``"out"`` or ``"in"``)."""
    with _lock:
        stream = _side_streams.get((device, direction))
        if stream is None:
            stream = _side_streams[(device, direction)] = torch.cuda.Stream(device)
        return stream


def send(x: torch.Tensor) -> torch.Tensor:
    """Start copying ``x`` to host memory; the host copy (same shape, strides, dtype).

    On CUDA, pinned memory written by a non-blocking copy on the device's outgoing side
    stream, after everything the compute stream has queued; ``x``'s memory is not
    reused before the copy is done. On CPU, an emulated host buffer (see the module's
    notes).
    """
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        raise RematError(f"only strided tensors can be offloaded, got {type(x).__name__}; plan this value "
                         "without offload (method='auto' without offload=True)")
    n = _span(x.shape, x.stride())
    if x.device.type == "cuda":
        host = torch.empty(n, dtype=x.dtype, pin_memory=True)
        stream = _side_stream(x.device, "out")
        stream.wait_stream(torch.cuda.current_stream(x.device))  # x is made
        with torch.cuda.stream(stream):
            host.copy_(_flat(x, n), non_blocking=True)
            left = torch.cuda.Event()
            left.record(stream)
        x.record_stream(stream)  # x's memory is not reused before the copy has read it
        nbytes = n * x.element_size()
        weakref.finalize(host, _released, nbytes)
    else:
        host = _emulated_host(n, x.dtype)
        host.copy_(_flat(x, n))
        nbytes = n * x.element_size()
    with _lock:
        _stats.held_bytes += nbytes
        _stats.peak_bytes = max(_stats.peak_bytes, _stats.held_bytes)
        _stats.sent_bytes += nbytes
        _stats.sends += 1
    out = host.as_strided(x.shape, x.stride(), 0)
    if x.device.type == "cuda":
        setattr(out, _LEFT, left)
    return out


@fx.node.has_side_effect
def sent(x: torch.Tensor) -> None:
    """The last use of a sent value's device copy, placed after the op it stays alive
    through: the graph frees the copy after this call."""


def fetch(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Start copying a host copy back to ``device``; the new device tensor (its strides
    kept). Read it only through :func:`arrived`."""
    device = torch.device(device)
    n = _span(host.shape, host.stride())
    out = torch.empty(n, dtype=host.dtype, device=device)
    if device.type == "cuda":
        stream = _side_stream(device, "in")
        stream.wait_stream(torch.cuda.current_stream(device))  # fresh memory: its last readers are done
        left = host.__dict__.get(_LEFT)
        if left is not None:
            stream.wait_event(left)  # the host copy is written
        else:  # (a host copy that lost its event: wait for every copy to the host)
            stream.wait_stream(_side_stream(device, "out"))
        with torch.cuda.stream(stream):
            out.copy_(_flat(host, n), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        y = out.as_strided(host.shape, host.stride(), 0)
        setattr(y, _ARRIVAL, event)
    else:
        out.copy_(_flat(host, n))
        y = out.as_strided(host.shape, host.stride(), 0)
    with _lock:
        _stats.fetched_bytes += n * host.element_size()
        _stats.fetches += 1
    return y


def arrived(y: torch.Tensor) -> torch.Tensor:
    """``y`` once its fetch is done: on CUDA the compute stream waits for the fetch's
    event here (placed after the op that the fetch overlaps)."""
    event = y.__dict__.pop(_ARRIVAL, None) if y.device.type == "cuda" else None
    if event is not None:
        torch.cuda.current_stream(y.device).wait_event(event)
    return y


def measure_host_bandwidth(device: torch.device | str = "cpu", *, nbytes: int = 16 * 2**20,
                           repeats: int = 3) -> float:
    """Bytes per second of one copy to the host and back, timed on ``device``: the
    slower direction, best of ``repeats`` (the first, warm-up copy is not timed).

    On CUDA, pinned memory and the side stream that offloads use; on CPU, a copy into
    the emulated host buffer and back (the speed of memory itself).

    Parameters
    ----------
    device : torch.device or str
    nbytes : int
        Bytes per copy.
    repeats : int

    Returns
    -------
    float

    Examples
    --------
    >>> measure_host_bandwidth("cpu", nbytes=2**20) > 0
    True
    """
    device = torch.device(device)
    x = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device)
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):
        times = []
        for step in ("out", "in"):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if step == "out":
                h = send(x)
            else:
                arrived(fetch(h, device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        del h
        if i:
            best = [min(b, t) for b, t in zip(best, times)]
    return x.numel() * x.element_size() / max(max(best), 1e-9)

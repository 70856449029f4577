"""Autocast: a captured step bakes the caller's autocast state in, and then runs without it.

Under ``torch.autocast`` AOTAutograd's joint trace records autocast's casts as ordinary
ops (``_to_copy`` to the autocast dtype before a matmul), so the joint graph already does
what autocast does. Running it under autocast again would cast a second time, and an op
that autocast leaves alone (the CPU flash-attention kernel) would then see mixed dtypes.
So the joint graph is traced (and traced again, to compile a schedule) under the autocast
state of the capture (:func:`autocast_as`), its ops run under :func:`no_autocast`, and a
plan is made per :func:`autocast_state`, like torch.compile's guards.

Examples
--------
>>> autocast_state()
()
>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     state = autocast_state()
...     with no_autocast():
...         inner = autocast_state()
>>> state, inner
((('cpu', torch.bfloat16),), ())
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["autocast_state", "autocast_as", "no_autocast"]

#: the device types whose autocast state a plan depends on
_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The (device type, dtype) of every device type autocast is enabled for now."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Inside the block, autocast is on exactly for the device types of ``state`` (an
    :func:`autocast_state`), with their dtypes."""
    wanted = dict(state)
    with contextlib.ExitStack() as stack:
        for device in _DEVICES:
            if device in wanted:
                stack.enter_context(torch.autocast(device, dtype=wanted[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def no_autocast() -> contextlib.AbstractContextManager:
    """Turn autocast off, on every device type, inside the block."""
    return autocast_as(())

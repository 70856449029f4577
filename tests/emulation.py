"""CUDA's dispatch of dropout and attention, emulated on the CPU, so that the paths a
GPU takes are tested on every machine.

In training on CUDA, ``F.dropout`` runs the fused ``aten.native_dropout`` (one op, two
outputs: the result and a boolean mask, drawn from the generator), and
``F.scaled_dot_product_attention`` runs a fused kernel. On the CPU, dropout is a
``bernoulli`` noise tensor and a multiplication, and the fused attention kernel exists
only without dropout. Under :func:`cuda_dispatch`:

* ``F.dropout`` in training runs ``aten.native_dropout``, as CUDA dispatches it
  (``inplace=True`` copies its result into the input, as CUDA's ``dropout_`` does);
* ``F.scaled_dot_product_attention`` with ``dropout_p == 0`` runs the CPU's fused kernel
  (``_scaled_dot_product_flash_attention_for_cpu``, a multi-output op tagged as seeded
  that draws nothing); with ``dropout_p > 0``, for which the CPU has no fused kernel,
  it runs the attention's math with its dropout through ``aten.native_dropout``.

The eager model and every capture made inside the context see the same ops, so a
step replayed from a captured graph can be compared bitwise with eager.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["cuda_dispatch"]

_dropout = F.dropout
_sdpa = F.scaled_dot_product_attention


def _native_dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    out = torch.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if dropout_p == 0:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            return _sdpa(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return _native_dropout(scores.softmax(-1), dropout_p) @ value


@contextlib.contextmanager
def cuda_dispatch(enabled: bool = True):
    """Run dropout and attention as CUDA dispatches them (see the module's text);
    ``enabled=False`` changes nothing.

    Examples
    --------
    >>> x = torch.ones(4, 4)
    >>> with cuda_dispatch():
    ...     y = F.dropout(x, 0.5, True)
    >>> bool(((y == 0) | (y == 2)).all())
    True
    """
    if not enabled:
        yield
        return
    with mock.patch.object(F, "dropout", _native_dropout), mock.patch.object(F, "scaled_dot_product_attention",
                                                                             _attention):
        yield

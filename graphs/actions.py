"""What a layer does with its activations: one vocabulary, and one definition of each
recompute policy, for pricing a plan and for running it.

Two policies go by "selective" in the field; here they have two names:

``selective``
    Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
    Models": recompute the attention core (QK^T, softmax, dropout, attention x V, fused
    attention) and save every other op's output.
``save_matmuls``
    op-level selective activation checkpointing as torch's SAC examples use it: save
    the outputs of matmuls, convolutions and fused attention, recompute the cheap rest.

:func:`saves_output` is the rule of both (and of ``none`` and ``full``), on an op's
name: :mod:`solver.module_plan` prices a plan with it on the captured graph, and
:mod:`graphs.module_mode` and :mod:`solver.exporters` build their
``create_selective_checkpoint_contexts`` policies from it. Pure Python: no torch here.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["LayerAction", "CHECKPOINTED", "TRAINER_ACTIONS", "ATTENTION_CORE_OPS", "MATMUL_OPS", "op_packet",
           "saves_output"]


class LayerAction(str, enum.Enum):
    """What one layer (a block of the model) does with its activations between forward
    and backward.

    Examples
    --------
    >>> LayerAction("selective") is LayerAction.SELECTIVE, str(LayerAction.FULL)
    (True, 'full')
    """

    NONE = "none"                  #: keep every activation
    SELECTIVE = "selective"        #: recompute the attention core (Korthikanti et al. 2022)
    SAVE_MATMULS = "save_matmuls"  #: save matmul / convolution / attention outputs, recompute the rest
    FULL = "full"                  #: keep the layer input, recompute the whole layer
    OFFLOAD = "offload"            #: move the activations to host memory and back

    def __str__(self) -> str:
        return self.value


#: the actions that run the layer under ``torch.utils.checkpoint``
CHECKPOINTED = (LayerAction.SELECTIVE, LayerAction.SAVE_MATMULS, LayerAction.FULL)

#: the actions trainers (Megatron-Core, DeepSpeed, HF, torchtitan) and the analytic model
#: know: :func:`solver.policy` plans with these
TRAINER_ACTIONS = (LayerAction.NONE, LayerAction.SELECTIVE, LayerAction.FULL, LayerAction.OFFLOAD)

#: ATen op packets that make up the attention core (QK^T, softmax, dropout, attention x V,
#: fused attention): what ``selective`` recomputes
ATTENTION_CORE_OPS = frozenset({
    "bmm", "baddbmm", "_softmax", "softmax", "_safe_softmax", "native_dropout", "dropout",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_flash_attention_forward", "_efficient_attention_forward",
})

#: ATen op packets whose outputs ``save_matmuls`` saves (and every fused attention,
#: ``_scaled_dot_product_*``)
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "linear", "matmul"})


#: allocations that the next op fills in place
_FILLED_IN_PLACE = ("empty", "new_empty")


def op_packet(op: Any) -> str:
    """The ATen packet name of an op: a torch ``OpOverload`` or the name a captured graph
    records (``"aten.mm.default"``).

    Examples
    --------
    >>> op_packet("aten.mm.default"), op_packet("aten._softmax.default"), op_packet("getitem")
    ('mm', '_softmax', 'getitem')
    """
    packet = getattr(op, "overloadpacket", None)
    if packet is not None:
        return getattr(packet, "__name__", str(packet)).split(".")[-1]
    parts = str(op).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else parts[-1]


def saves_output(action: LayerAction | str, op: Any) -> bool:
    """Whether a layer under ``action`` keeps the output of ``op`` for its backward
    instead of recomputing it.

    Examples
    --------
    >>> saves_output("selective", "aten.mm.default"), saves_output("selective", "aten.bmm.default")
    (True, False)
    >>> saves_output("selective", "aten.add_.Tensor")
    False
    >>> saves_output("save_matmuls", "aten.mm.default"), saves_output("save_matmuls", "aten.gelu.default")
    (True, False)
    """
    action = LayerAction(action)
    if action in (LayerAction.NONE, LayerAction.OFFLOAD):
        return True
    if action == LayerAction.FULL:
        return False
    name = op_packet(op)
    if action == LayerAction.SELECTIVE:
        # an in-place op's output is its input, and an allocation (``empty_like``) is
        # filled in place next (eager dropout): saving either frees nothing, and torch
        # refuses a cached tensor that is mutated afterwards
        return name not in ATTENTION_CORE_OPS and not name.endswith("_") and not name.startswith(_FILLED_IN_PLACE)
    return name in MATMUL_OPS or name.startswith("_scaled_dot_product")

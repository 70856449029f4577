"""Real models for the trainer policies: the one place where they meet torch.

The trainer-policy layer (:mod:`solver.analytic`, :mod:`solver.policy`,
:mod:`solver.estimate`, :mod:`solver.exporters`) prices plans on a DAG and never imports
torch. What needs a real ``nn.Module`` lives here, in the join layer beside
:mod:`solver.join.planning`, and is reached through one function each:

- :func:`capture_module`: a module's training step captured for pricing, a
  :class:`CapturedModel` (the DAG and the few facts of the module the prices need); what
  ``policy(..., via="graph")`` and ``estimate`` plan on;
- :func:`hf_example_inputs`: the example batch of an HF causal LM;
- :func:`meta_model`: an HF config built as a model on the meta device (nothing is
  allocated); the CLI's ``--captured``;
- :func:`apply_hf_actions`: one action per decoder layer, run by an HF model.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from graphs import ComputeGraph
from graphs.actions import LayerAction
from graphs.hardware import Hardware
from solver.errors import SolverError

__all__ = ["CapturedModel", "capture_module", "hf_example_inputs", "META_DTYPES", "meta_model", "apply_hf_actions"]

log = logging.getLogger(__name__)

#: dtype names :func:`meta_model` builds a model in
META_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class CapturedModel:
    """A module's training step as the trainer policies price it.

    Attributes
    ----------
    graph : ComputeGraph
        The captured step (``backward="loss"``), as eager layer-level checkpointing sees
        it (:func:`solver.module_plan.checkpoint_view` over ``blocks``).
    blocks : list of str
        Module paths of the layers a policy plans.
    device : str
        Device type of the parameters (``"cpu"`` for a module without any).
    trainable_numel : int
        Elements of the parameters that take gradients (what optimizer state is kept for).
    element_size : int
        Bytes per element of the first trainable parameter (4 without one).
    hf_config : object or None
        The module's HF ``.config``, when it has one.
    capture_seconds : float
    """

    graph: ComputeGraph
    blocks: list
    device: str
    trainable_numel: int
    element_size: int
    hf_config: Any
    capture_seconds: float


def capture_module(model: Any, example_inputs: Any = None, *, seq_len: int | None = None,
                   micro_batch: int | None = None, blocks: Sequence[str] | None = None,
                   measure_time: bool = False, loss_fn: Any = None, hardware: Hardware | None = None,
                   repeat: bool = True) -> CapturedModel:
    """Capture one training step of ``model`` for the trainer policies.

    Parameters
    ----------
    model : nn.Module
    example_inputs : tuple or dict, optional
        Positional or keyword arguments; default for an HF model: :func:`hf_example_inputs`.
    seq_len, micro_batch : int, optional
        Shape of the default HF batch.
    blocks : sequence of str, optional
        Module paths of the layers (default: :func:`graphs.module_mode.layer_blocks`).
    measure_time : bool
        Time every op (default: roofline).
    loss_fn : callable, optional
        Output -> scalar loss.
    hardware : graphs.Hardware, optional
        For the roofline times.
    repeat : bool
        When the layers are the items of one layer list and the middle ones are alike,
        capture the first three and the last and repeat the third as every middle layer
        (:func:`graphs.repeated.capture_repeated`): the same DAG up to node names, in
        the time of a 4-layer capture. Where the captured middle layers differ, the
        whole model is captured.

    Returns
    -------
    CapturedModel

    Raises
    ------
    SolverError
        The model has no layers to plan, or no batch can be built for it.

    Examples
    --------
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    >>> cm = capture_module(net, (torch.randn(8, 16),))
    >>> cm.blocks, cm.device, cm.trainable_numel
    (['0', '1', '2'], 'cpu', 816)
    """
    from graphs.capture import capture
    from graphs.module_mode import layer_blocks
    from solver.module_plan import checkpoint_view

    if example_inputs is None:
        example_inputs = hf_example_inputs(model, seq_len=seq_len, micro_batch=micro_batch)
    names = list(blocks) if blocks is not None else layer_blocks(model)
    if not names:
        raise SolverError(f"{type(model).__name__} has no layers to plan (no ModuleList/Sequential or children)")
    try:
        device = next(model.parameters()).device.type
    except StopIteration:
        device = "cpu"
    t0 = time.perf_counter()
    options = dict(backward="loss", measure_time=measure_time, loss_fn=loss_fn, hardware=hardware)
    graph = None
    if repeat:
        from graphs.repeated import capture_repeated

        graph = capture_repeated(model, example_inputs, blocks=names, capture=capture, **options)
    if graph is None:
        graph = capture(model, example_inputs, **options)
    graph = checkpoint_view(graph, names)
    seconds = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    return CapturedModel(graph=graph, blocks=names, device=device, trainable_numel=sum(p.numel() for p in params),
                         element_size=params[0].element_size() if params else 4,
                         hf_config=getattr(model, "config", None), capture_seconds=seconds)


def hf_example_inputs(model: Any, *, seq_len: int | None, micro_batch: int | None) -> dict:
    """``input_ids`` and ``labels`` of shape (micro_batch, seq_len) for an HF causal LM,
    on the model's device (a meta model gets meta tensors: nothing is allocated).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> net = torch.nn.Linear(2, 2); net.config = SimpleNamespace(vocab_size=10)
    >>> hf_example_inputs(net, seq_len=5, micro_batch=2)["input_ids"].shape
    torch.Size([2, 5])
    """
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise SolverError(f"{type(model).__name__} has no HF `.config`: pass example_inputs=... (a tuple of "
                          "positional arguments or a dict of keyword arguments)")
    if not seq_len:
        raise SolverError("pass seq_len=... (and micro_batch=...) to build the example batch, or example_inputs=...")
    vocab = int(getattr(cfg, "vocab_size", 0) or 2)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    b = int(micro_batch or 1)
    if device.type == "meta":
        ids = torch.zeros((b, int(seq_len)), dtype=torch.long, device="meta")
    else:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (b, int(seq_len)), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def meta_model(config: Any, *, dtype: str | None = None) -> Any:
    """An HF causal LM of ``config`` on the meta device, in training mode (shapes and
    dtypes only: nothing is allocated, so any size can be captured and planned).

    Parameters
    ----------
    config : transformers.PretrainedConfig
    dtype : {"bf16", "fp16", "fp32"}, optional
        Default fp32.

    Raises
    ------
    SolverError
        On another dtype name.

    Examples
    --------
    >>> from transformers import GPT2Config
    >>> m = meta_model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50), dtype="bf16")
    >>> next(m.parameters()).device.type, next(m.parameters()).dtype, m.training
    ('meta', torch.bfloat16, True)
    """
    from transformers import AutoModelForCausalLM

    if dtype is not None and dtype not in META_DTYPES:
        raise SolverError(f"dtype {dtype!r}: use {', '.join(META_DTYPES)}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=META_DTYPES[dtype or "fp32"])
    model.train()
    return model


# ------------------------------------------------------------------------ HF layers

def _offloaded_forward(function, *args, **kwargs):
    from torch.autograd.graph import save_on_cpu

    with save_on_cpu(pin_memory=torch.cuda.is_available()):
        return function(*args, **kwargs)


def _checkpoint_kwargs(action: LayerAction) -> dict:
    """Keyword arguments of :func:`torch.utils.checkpoint.checkpoint` that run a ``full``
    or a ``selective`` layer (what HF's checkpointing passes to it for every layer)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from graphs.module_mode import selective_policy

    if action == LayerAction.FULL:
        return {"use_reentrant": False}
    return {"use_reentrant": False, "context_fn": functools.partial(
        create_selective_checkpoint_contexts, selective_policy(action=LayerAction.SELECTIVE))}


def _run_layer_under(layer: Any, wrapper: Callable) -> None:
    """Run one HF decoder layer's forward under ``wrapper(function, *args, **kwargs)``.

    The only private name of transformers used here: HF's public checkpointing
    (``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``) gives every
    layer the same ``checkpoint`` call, and a ``GradientCheckpointingLayer`` calls its
    ``_gradient_checkpointing_func`` while its public ``gradient_checkpointing`` flag is
    on. A plan that mixes full and selective layers, or offloads some, needs another
    function on those layers, and HF has no public per-layer hook for it."""
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = wrapper


def _enable_hf_checkpointing(model: Any, kwargs: dict) -> None:
    """HF's public switch: every checkpointable module runs ``checkpoint(..., **kwargs)``."""
    try:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as exc:
        raise SolverError(f"{type(model).__name__} refuses HF checkpointing ({exc}); plan it with "
                          "solver.optimize(..., mode='module') instead") from exc


def apply_hf_actions(model: Any, actions: Sequence[LayerAction]) -> Any:
    """Run one action per decoder layer (``GradientCheckpointingLayer``) of an HF model,
    in place: ``full`` under non-reentrant :func:`torch.utils.checkpoint.checkpoint`,
    ``selective`` under it with the attention-core policy of
    :func:`graphs.module_mode.selective_policy`, ``offload`` under
    :func:`torch.autograd.graph.save_on_cpu` (no recomputation), ``none`` as it is.

    HF's public checkpointing switch gives every layer the recompute action most of them
    take and the per-layer ``gradient_checkpointing`` flag turns it off where the plan
    keeps a layer (every other module HF's switch reaches keeps its flag); only layers whose
    action differs (the other recompute action, offload) get their own function
    (:func:`_run_layer_under`). The layers act in training mode with gradients enabled
    only.

    Raises
    ------
    SolverError
        When the model's decoder-layer count differs from ``len(actions)``.

    Examples
    --------
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> m = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
    ...                                  intermediate_size=64, vocab_size=50))
    >>> _ = apply_hf_actions(m, [LayerAction.FULL, LayerAction.NONE])
    >>> [layer.gradient_checkpointing for layer in m.model.layers]
    [True, False]
    """
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    acts = [LayerAction(a) for a in actions]
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(layers) != len(acts):
        raise SolverError(f"{type(model).__name__} has {len(layers)} checkpointable decoder layers but the policy "
                          f"plans {len(acts)}; plan from this model's config")
    recompute = [a for a in acts if a in (LayerAction.FULL, LayerAction.SELECTIVE)]
    public = max((LayerAction.FULL, LayerAction.SELECTIVE), key=recompute.count)  # a tie: full
    if any(a != LayerAction.NONE for a in acts):
        flags = [(m, m.gradient_checkpointing) for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        _enable_hf_checkpointing(model, _checkpoint_kwargs(public))
        planned = {id(layer) for layer in layers}
        for m, flag in flags:  # HF's switch reaches every module with the flag: the others are put back
            if id(m) not in planned:
                m.gradient_checkpointing = flag
    own: dict[LayerAction, Callable] = {}
    for layer, action in zip(layers, acts):
        if action == LayerAction.NONE:
            layer.gradient_checkpointing = False
        elif action != public:
            if action not in own:
                own[action] = (_offloaded_forward if action == LayerAction.OFFLOAD else
                               functools.partial(checkpoint, **_checkpoint_kwargs(action)))
            _run_layer_under(layer, own[action])
    log.info("apply_hf: %s", {a.value: acts.count(a) for a in dict.fromkeys(acts)})
    return model

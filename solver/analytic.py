"""An analytic memory and FLOP model of a decoder-only transformer, from its config alone.

Per layer and per micro-batch, the bytes that the backward pass needs follow
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (MLSys 2023, arXiv:2205.05198), Section 4. For their GPT layer (16-bit
activations, 1-byte dropout masks, ``s`` sequence, ``b`` micro-batch, ``h`` hidden,
``a`` heads, ``t`` tensor-parallel ranks) the model reproduces:

============================================  =================================
no recomputation                              ``s*b*h*(34 + 5*a*s/h)``
tensor parallel                               ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``
tensor + sequence parallel                    ``s*b*h/t*(34 + 5*a*s/h)``
selective recomputation (attention core)      ``34*s*b*h`` (``/t`` with TP + SP)
full recomputation (layer input only)         ``2*s*b*h``
============================================  =================================

The same accounting is generalized term by term: grouped-query attention (K and V
have ``kv_heads * head_dim`` features), gated (SwiGLU) FFNs of any width, no dropout,
any activation dtype, and flash attention (the attention core then keeps only the
row log-sum-exp). FLOPs count matrix multiplies only, as the paper does:
``24*b*s*h**2 + 4*b*s**2*h`` per GPT layer forward.

Everything here is plain arithmetic; :func:`as_config` reads Hugging Face
``PretrainedConfig`` objects by attribute (transformers is never imported here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from graphs.actions import TRAINER_ACTIONS, LayerAction
from solver.errors import SolverError

__all__ = [
    "TransformerConfig",
    "as_config",
    "looks_like_hf_config",
    "dtype_bytes",
    "layer_activation_breakdown",
    "layer_activation_bytes",
    "attention_core_bytes",
    "embedding_activation_bytes",
    "output_activation_bytes",
    "loss_workspace_bytes",
    "backward_workspace_bytes",
    "layer_parameters",
    "embedding_parameters",
    "output_parameters",
    "parameter_count",
    "state_bytes_per_parameter",
    "layer_forward_flops",
    "attention_core_flops",
    "output_forward_flops",
    "recompute_flops",
    "step_flops",
    "OPTIMIZERS",
]

#: Optimizers whose state :func:`state_bytes_per_parameter` knows.
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd_momentum", "none")

_DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4, "32": 4, "tf32": 4,
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "16": 2,
    "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "8": 1,
    "fp64": 8, "float64": 8, "double": 8,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: an int, a name (``"bf16"``, ``"float32"``...) or a
    torch dtype (read through its ``itemsize``; torch is not imported).

    Examples
    --------
    >>> dtype_bytes("bf16"), dtype_bytes(4), dtype_bytes("torch.float32")
    (2, 4, 4)
    """
    if isinstance(dtype, bool):
        raise SolverError(f"dtype {dtype!r} is not a dtype; pass bytes per element or a name like 'bf16'")
    if isinstance(dtype, int):
        if dtype not in (1, 2, 4, 8):
            raise SolverError(f"dtype of {dtype} bytes per element is not supported; use 1, 2, 4 or 8")
        return dtype
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and not isinstance(dtype, str):
        return itemsize
    name = str(dtype).lower().removeprefix("torch.")
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise SolverError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPE_BYTES))} "
                          "or bytes per element") from None


@dataclass(frozen=True)
class TransformerConfig:
    """The shape of a decoder-only transformer and of one training micro-batch.

    Attributes
    ----------
    num_layers, hidden_size, num_heads, vocab_size : int
    seq_len : int
        Tokens per sequence of the micro-batch.
    micro_batch : int
        Sequences per micro-batch.
    num_kv_heads : int or None
        Key/value heads (grouped-query attention); None means ``num_heads``.
    ffn_size : int or None
        FFN inner width; None means ``4 * hidden_size``.
    gated_ffn : bool
        A gated FFN (SwiGLU: gate, up and down projections) instead of GeLU's two.
    dtype_bytes : int
        Bytes per activation and parameter element (2 for 16-bit).
    dropout : bool
        Attention and hidden dropout (each keeps a 1-byte mask), as in Korthikanti's GPT.
    flash_attention : bool
        Fused attention that keeps only Q, K, V, the output and the fp32 log-sum-exp.
    tensor_parallel : int
    sequence_parallel : bool
        Shard the norm and dropout activations along the sequence (Korthikanti Sec. 4.2.2).
    bias : bool
        Linear layers have biases (GPT-2) or not (Llama).
    tied_embeddings : bool
        The output projection shares the input embedding.
    max_positions : int
        Rows of a learned position embedding (0 for rotary/none).
    name : str
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    micro_batch: int = 1
    num_kv_heads: int | None = None
    ffn_size: int | None = None
    gated_ffn: bool = False
    dtype_bytes: int = 2
    dropout: bool = True
    flash_attention: bool = False
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    bias: bool = True
    tied_embeddings: bool = True
    max_positions: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len", "micro_batch",
                  "tensor_parallel"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SolverError(f"TransformerConfig.{f} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise SolverError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise SolverError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
        dtype_bytes(self.dtype_bytes)

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else int(self.num_kv_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_hidden(self) -> int:
        """Features of K (and of V): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        return 4 * self.hidden_size if self.ffn_size is None else int(self.ffn_size)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with some fields changed (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# ---------------------------------------------------------------- activations (bytes)

def _sp(cfg: TransformerConfig) -> int:
    """Divisor of the activations that only sequence parallelism shards."""
    return cfg.tensor_parallel if cfg.sequence_parallel else 1


def attention_core_bytes(cfg: TransformerConfig) -> float:
    """Bytes the attention core (QK^T, softmax, dropout, attention x V) keeps for backward,
    beyond Q, K, V: what selective recomputation frees.

    Korthikanti's ``5*a*s**2*b`` in 16-bit: softmax output (2), dropout mask (1), dropout
    output (2) per score. With flash attention, only the fp32 log-sum-exp per row.

    Examples
    --------
    >>> c = TransformerConfig(num_layers=1, hidden_size=64, num_heads=4, vocab_size=10, seq_len=8)
    >>> attention_core_bytes(c) == 5 * 4 * 8 * 8 * 1
    True
    """
    a, s, b, t, d = cfg.num_heads, cfg.seq_len, cfg.micro_batch, cfg.tensor_parallel, cfg.dtype_bytes
    if cfg.flash_attention:
        return 4.0 * a * s * b / t
    per_score = d + (1 + d if cfg.dropout else 0)
    return float(per_score) * a * s * s * b / t


def layer_activation_breakdown(cfg: TransformerConfig) -> dict[str, float]:
    """Bytes one layer keeps for its backward pass, per micro-batch, term by term.

    Returns
    -------
    dict
        Names (``norm_inputs``, ``qkv_input``, ``q_k``, ``v``, ``attention_core``,
        ``out_proj_input``, ``dropout_masks``, ``ffn_input``, ``ffn_hidden``) to bytes.
        The sum is the layer's activation memory without recomputation.

    Examples
    --------
    >>> c = TransformerConfig(num_layers=1, hidden_size=64, num_heads=4, vocab_size=10, seq_len=8)
    >>> sum(layer_activation_breakdown(c).values()) == 8 * 1 * 64 * (34 + 5 * 4 * 8 / 64)
    True
    """
    s, b, h, t, d = cfg.seq_len, cfg.micro_batch, cfg.hidden_size, cfg.tensor_parallel, cfg.dtype_bytes
    sbh = float(s * b * h)
    tokens = float(s * b)
    sp = _sp(cfg)
    f = cfg.ffn
    # A GeLU FFN keeps the GeLU input and output (2 x f); SwiGLU keeps gate, up, silu(gate)
    # and their product (4 x f).
    ffn_tensors = 4 if cfg.gated_ffn else 2
    return {
        "norm_inputs": 2 * d * sbh / sp,
        "qkv_input": d * sbh / sp,
        "q_k": d * tokens * (h + cfg.kv_hidden) / t,
        "v": d * tokens * cfg.kv_hidden / t,
        "attention_core": attention_core_bytes(cfg),
        "out_proj_input": d * sbh / t,
        "dropout_masks": (2 * 1 * sbh / sp) if cfg.dropout else 0.0,
        "ffn_input": d * sbh / sp,
        "ffn_hidden": ffn_tensors * d * tokens * f / t,
    }


def _trainer_action(name: "LayerAction | str") -> LayerAction:
    """The action, one the analytic model prices (:data:`graphs.actions.TRAINER_ACTIONS`)."""
    try:
        action = LayerAction(name)
    except ValueError:
        action = None
    if action not in TRAINER_ACTIONS:
        raise SolverError(f"unknown recompute {name!r}; use " + ", ".join(a.value for a in TRAINER_ACTIONS))
    return action


def layer_activation_bytes(cfg: TransformerConfig, *, recompute: str = "none") -> float:
    """Bytes one layer keeps between its forward and its backward, per micro-batch.

    Parameters
    ----------
    cfg : TransformerConfig
    recompute : {"none", "selective", "full", "offload"}
        ``selective`` drops the attention core (recomputed in backward); ``full`` keeps
        only the layer input; ``offload`` keeps nothing on the device.

    Examples
    --------
    >>> c = TransformerConfig(num_layers=1, hidden_size=64, num_heads=4, vocab_size=10, seq_len=8)
    >>> layer_activation_bytes(c, recompute="selective") == 34 * 8 * 64
    True
    """
    action = _trainer_action(recompute)
    br = layer_activation_breakdown(cfg)
    total = sum(br.values())
    if action == LayerAction.SELECTIVE:
        return total - br["attention_core"]
    if action == LayerAction.FULL:
        return cfg.dtype_bytes * float(cfg.tokens * cfg.hidden_size) / _sp(cfg)
    return 0.0 if action == LayerAction.OFFLOAD else total


def embedding_activation_bytes(cfg: TransformerConfig) -> float:
    """Bytes the input embedding keeps per micro-batch: token ids (int64) and the
    embedding-dropout mask."""
    s, b, h = cfg.seq_len, cfg.micro_batch, cfg.hidden_size
    return 8.0 * s * b + ((1.0 * s * b * h / _sp(cfg)) if cfg.dropout else 0.0)


def output_activation_bytes(cfg: TransformerConfig) -> float:
    """Bytes the final norm, output projection and cross entropy keep per micro-batch:
    the norm input and projection input (dtype) and the fp32 log-probabilities
    (Korthikanti Sec. 4.3: ``4*s*b*h/t*(1 + v/h)`` in 16-bit with sequence parallelism)."""
    s, b, h, v, t, d = (cfg.seq_len, cfg.micro_batch, cfg.hidden_size, cfg.vocab_size,
                        cfg.tensor_parallel, cfg.dtype_bytes)
    return 2.0 * d * s * b * h / _sp(cfg) + 4.0 * s * b * v / t


def loss_workspace_bytes(cfg: TransformerConfig) -> float:
    """Transient bytes around the loss: the logits in the activation dtype and the fp32
    gradient of the logits, both live when the backward pass starts."""
    s, b, v, t, d = cfg.seq_len, cfg.micro_batch, cfg.vocab_size, cfg.tensor_parallel, cfg.dtype_bytes
    return (d + 4.0) * s * b * v / t


def backward_workspace_bytes(cfg: TransformerConfig) -> float:
    """Transient bytes of one layer's backward beyond what it saved: the incoming and
    outgoing activation gradients and, with unfused attention, the gradient of one score
    matrix."""
    s, b, h, t, d = cfg.seq_len, cfg.micro_batch, cfg.hidden_size, cfg.tensor_parallel, cfg.dtype_bytes
    grads = 2.0 * d * s * b * h / _sp(cfg)
    scores = 0.0 if cfg.flash_attention else float(d) * cfg.num_heads * s * s * b / t
    return grads + scores


# ---------------------------------------------------------------- parameters and state

def layer_parameters(cfg: TransformerConfig) -> float:
    """Parameters of one layer held by one tensor-parallel rank (norms replicated)."""
    h, kv, f, t = cfg.hidden_size, cfg.kv_hidden, cfg.ffn, cfg.tensor_parallel
    attn = h * (h + 2 * kv) + h * h
    mlp = (3 if cfg.gated_ffn else 2) * h * f
    biases = ((h + 2 * kv) + h + (2 * f if cfg.gated_ffn else f) + h) if cfg.bias else 0
    norms = 2 * h * (2 if cfg.bias else 1)
    return (attn + mlp + biases) / t + norms


def embedding_parameters(cfg: TransformerConfig) -> float:
    """Input embedding parameters of one rank (vocabulary-parallel) plus learned positions."""
    return cfg.vocab_size * cfg.hidden_size / cfg.tensor_parallel + cfg.max_positions * cfg.hidden_size


def output_parameters(cfg: TransformerConfig, *, separate_stage: bool = False) -> float:
    """Final norm and output projection parameters of one rank. A tied projection costs
    nothing extra unless it lives on another pipeline stage (``separate_stage``), which
    then holds its own copy."""
    norm = cfg.hidden_size * (2 if cfg.bias else 1)
    proj = cfg.vocab_size * cfg.hidden_size / cfg.tensor_parallel
    return norm + (proj if (not cfg.tied_embeddings or separate_stage) else 0.0)


def parameter_count(cfg: TransformerConfig) -> float:
    """Parameters of one tensor-parallel rank of the whole model (one pipeline stage).

    Examples
    --------
    >>> c = TransformerConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257,
    ...                       seq_len=1024, max_positions=1024)
    >>> parameter_count(c)   # GPT-2 small
    124439808.0
    """
    return cfg.num_layers * layer_parameters(cfg) + embedding_parameters(cfg) + output_parameters(cfg)


def state_bytes_per_parameter(dtype_bytes_: int, optimizer: str = "adam", *,
                              grad_bytes: int | None = None) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter.

    Mixed precision (``dtype_bytes_ < 4``) follows Megatron's convention: the optimizer
    keeps an fp32 master copy next to its fp32 moments, so Adam/AdamW hold
    4 + 4 + 4 = 12 bytes per parameter (ZeRO's "16 bytes per parameter" with 16-bit
    parameters and gradients). In fp32 there is no master copy. ``sgd`` keeps no moment,
    ``sgd_momentum`` one; ``none`` keeps no optimizer state (gradients still count).

    Examples
    --------
    >>> state_bytes_per_parameter(2, "adam"), state_bytes_per_parameter(4, "adamw")
    ((2, 2, 12), (4, 4, 8))
    """
    opt = str(optimizer).lower()
    if opt not in OPTIMIZERS:
        raise SolverError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    g = dtype_bytes_ if grad_bytes is None else int(grad_bytes)
    master = 4 if dtype_bytes_ < 4 else 0
    moments = {"adam": 8, "adamw": 8, "sgd": 0, "sgd_momentum": 4, "none": 0}[opt]
    state = 0 if opt == "none" else master + moments
    return dtype_bytes_, g, state


# ---------------------------------------------------------------- FLOPs (matmuls)

def attention_core_flops(cfg: TransformerConfig) -> float:
    """Forward FLOPs of QK^T and attention x V: ``4*b*s**2*h/t``."""
    return 4.0 * cfg.micro_batch * cfg.seq_len ** 2 * cfg.hidden_size / cfg.tensor_parallel


def layer_forward_flops(cfg: TransformerConfig) -> float:
    """Forward matmul FLOPs of one layer per micro-batch (``24*b*s*h**2 + 4*b*s**2*h``
    for Korthikanti's GPT layer), per tensor-parallel rank.

    Examples
    --------
    >>> c = TransformerConfig(num_layers=1, hidden_size=64, num_heads=4, vocab_size=10, seq_len=8)
    >>> layer_forward_flops(c) == 24 * 8 * 64 ** 2 + 4 * 8 ** 2 * 64
    True
    """
    bs, h, kv, f, t = cfg.tokens, cfg.hidden_size, cfg.kv_hidden, cfg.ffn, cfg.tensor_parallel
    proj = 2.0 * bs * h * (h + 2 * kv) + 2.0 * bs * h * h
    mlp = 2.0 * bs * h * f * (3 if cfg.gated_ffn else 2)
    return (proj + mlp) / t + attention_core_flops(cfg)


def output_forward_flops(cfg: TransformerConfig) -> float:
    """Forward FLOPs of the output projection: ``2*b*s*h*v/t``."""
    return 2.0 * cfg.tokens * cfg.hidden_size * cfg.vocab_size / cfg.tensor_parallel


def recompute_flops(cfg: TransformerConfig, action: str) -> float:
    """Extra forward FLOPs that one layer's recomputation choice costs per micro-batch:
    0 for ``none`` and ``offload``, the attention core for ``selective``, one more layer
    forward for ``full``."""
    action = _trainer_action(action)
    if action == LayerAction.SELECTIVE:
        return attention_core_flops(cfg)
    if action == LayerAction.FULL:
        return layer_forward_flops(cfg)
    return 0.0


def step_flops(cfg: TransformerConfig) -> float:
    """Forward + backward FLOPs of a micro-batch without recomputation (backward = 2x forward)."""
    return 3.0 * (cfg.num_layers * layer_forward_flops(cfg) + output_forward_flops(cfg))


# ---------------------------------------------------------------- reading configs

_GATED_ACTS = {"silu", "swish", "swiglu", "geglu", "gelu_pytorch_tanh_gated"}
_GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                      "phi3", "olmo", "olmo2", "cohere", "granite", "internlm2", "deepseek_v3",
                      "starcoder2_gated", "smollm3", "glm", "ministral"}


def _first(obj: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for n in names:
        v = obj.get(n) if isinstance(obj, Mapping) else getattr(obj, n, None)
        if v is not None:
            return v
    return default


def looks_like_hf_config(obj: Any) -> bool:
    """Whether ``obj`` reads as an HF ``PretrainedConfig`` (a ``model_type`` and a ``to_dict``).

    Examples
    --------
    >>> looks_like_hf_config({"num_hidden_layers": 2}), looks_like_hf_config(TransformerConfig(
    ...     num_layers=2, hidden_size=64, num_heads=4, vocab_size=100, seq_len=8, micro_batch=1))
    (False, False)
    """
    return hasattr(obj, "model_type") and hasattr(obj, "to_dict")


def _from_mapping(c: Any, *, seq_len: int | None, micro_batch: int | None, dtype: Any,
                  tensor_parallel: int | None, sequence_parallel: bool | None,
                  flash_attention: bool | None) -> TransformerConfig:
    if looks_like_hf_config(c) and hasattr(c, "get_text_config"):
        c = c.get_text_config()
    layers = _first(c, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    hidden = _first(c, ("hidden_size", "n_embd", "d_model", "dim"))
    heads = _first(c, ("num_attention_heads", "n_head", "num_heads", "n_heads"))
    vocab = _first(c, ("vocab_size", "padded_vocab_size"))
    missing = [n for n, v in (("layers", layers), ("hidden size", hidden), ("heads", heads),
                              ("vocab size", vocab)) if v is None]
    if missing:
        raise SolverError(f"config {type(c).__name__} lacks {', '.join(missing)}: pass a TransformerConfig "
                          "or an HF PretrainedConfig of a decoder-only transformer")
    kv = _first(c, ("num_key_value_heads", "n_kv_heads", "num_kv_heads"))
    if kv is None and _first(c, ("multi_query",), False):
        kv = 1
    ffn = _first(c, ("intermediate_size", "n_inner", "ffn_dim", "ffn_size", "d_ff", "ffn_hidden_size"))
    act = str(_first(c, ("hidden_act", "activation_function", "hidden_activation"), "")).lower()
    model_type = str(_first(c, ("model_type",), "")).lower()
    gated = act in _GATED_ACTS or model_type in _GATED_MODEL_TYPES
    max_pos = _first(c, ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len"), None)
    if seq_len is None:
        if max_pos is None:
            raise SolverError("the config names no maximum sequence length: pass seq_len=")
        seq_len = int(max_pos)
    drops = [_first(c, (n,), 0.0) for n in ("attn_pdrop", "attention_dropout", "resid_pdrop",
                                            "hidden_dropout", "hidden_dropout_prob", "embd_pdrop",
                                            "dropout")]
    dropout = any(isinstance(p, (int, float)) and p > 0 for p in drops)
    if dtype is None:
        names = ("dtype",) if looks_like_hf_config(c) else ("dtype", "torch_dtype", "params_dtype")
        dtype = _first(c, names, None) or 2
    if flash_attention is None:
        impl = _first(c, ("_attn_implementation_internal", "attn_implementation"), None)
        flash_attention = impl is not None and str(impl) != "eager"
    bias = bool(_first(c, ("attention_bias", "bias", "use_bias"), model_type in ("gpt2", "gpt_neo", "gptj", "opt",
                                                                                     "gpt_neox", "gpt_bigcode")))
    learned = model_type in ("gpt2", "gpt_neo", "opt", "gpt_bigcode") and max_pos is not None
    return TransformerConfig(
        num_layers=int(layers), hidden_size=int(hidden), num_heads=int(heads), vocab_size=int(vocab),
        seq_len=int(seq_len), micro_batch=int(micro_batch or 1),
        num_kv_heads=int(kv) if kv is not None else None,
        ffn_size=int(ffn) if ffn is not None else None, gated_ffn=gated,
        dtype_bytes=dtype_bytes(dtype), dropout=dropout, flash_attention=bool(flash_attention),
        tensor_parallel=int(tensor_parallel or 1), sequence_parallel=bool(sequence_parallel),
        bias=bias, tied_embeddings=bool(_first(c, ("tie_word_embeddings",), True)),
        max_positions=int(max_pos) if learned else 0, name=model_type,
    )


def as_config(model_or_config: Any, *, seq_len: int | None = None, micro_batch: int | None = None,
              dtype: Any = None, tensor_parallel: int | None = None, sequence_parallel: bool | None = None,
              flash_attention: bool | None = None) -> TransformerConfig:
    """A :class:`TransformerConfig` from a config, an HF ``PretrainedConfig``, a model with
    a ``.config`` (HF models) or a plain mapping of HF-style keys; keyword overrides win.

    HF names read: ``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``,
    ``num_attention_heads``/``n_head``, ``num_key_value_heads``,
    ``intermediate_size``/``n_inner``, ``vocab_size``, ``max_position_embeddings``/
    ``n_positions`` (the default ``seq_len``), dropout probabilities, ``dtype``.
    Attention is taken as unfused (Korthikanti's accounting) unless the config names a
    fused implementation or ``flash_attention=True``.

    Raises
    ------
    SolverError
        When the config lacks a field the model needs.

    Examples
    --------
    >>> c = as_config({"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
    ...                "n_positions": 32, "model_type": "gpt2"}, micro_batch=2)
    >>> c.num_layers, c.seq_len, c.micro_batch, c.ffn
    (2, 32, 2, 256)
    """
    if isinstance(model_or_config, TransformerConfig):
        out = model_or_config.replace(seq_len=seq_len, micro_batch=micro_batch,
                                      dtype_bytes=None if dtype is None else dtype_bytes(dtype),
                                      tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                                      flash_attention=flash_attention)
        return out
    cfg = model_or_config
    if not isinstance(cfg, Mapping) and not looks_like_hf_config(cfg):
        inner = getattr(cfg, "config", None)
        if inner is None:
            raise SolverError(f"cannot read a transformer shape from {type(cfg).__name__}: pass a "
                              "TransformerConfig, an HF PretrainedConfig or an HF model")
        cfg = inner
    return _from_mapping(cfg, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                         tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                         flash_attention=flash_attention)

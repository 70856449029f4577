"""The model zoo: small builders with random weights for tests, benchmarks and examples.

Every builder returns ``(model, example_inputs)`` where ``example_inputs`` is a tuple of
positional arguments or a dict of keyword arguments. Tensors are created on the current
default device, so ``with torch.device("meta"): model, inputs = gpt()`` builds a model
without allocating its weights. Hugging Face models are built from configs (never
downloaded) with ``use_cache=False``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ZOO", "mlp", "resnet", "unet", "unet_bn", "gpt", "hf_gpt2", "hf_llama", "inplace_mlp", "multi_input",
    "data_dependent", "GPT",
]


def mlp(*, batch: int = 32, d_in: int = 64, hidden: int = 128, depth: int = 3, seed: int = 0):
    """A ReLU MLP with a mean-squared-error loss outside the model."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers), (torch.randn(batch, d_in),)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.short(x))


class ResNet(nn.Module):
    """ResNet-style CNN: a stem, residual blocks with BatchNorm, a linear head."""

    def __init__(self, *, width: int = 8, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, c = [], width
        for i in range(blocks):
            layers.append(_Block(c, c * (2 if i else 1), 2 if i else 1))
            c = c * (2 if i else 1)
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x, y):
        h = self.layers(self.stem(x))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


def resnet(*, batch: int = 4, width: int = 8, size: int = 16, blocks: int = 2, seed: int = 0):
    """ResNet-style CNN with BatchNorm and residuals; returns the loss."""
    torch.manual_seed(seed)
    model = ResNet(width=width, blocks=blocks)
    return model, (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))


class UNet(nn.Module):
    """U-Net-style encoder/decoder with long skip connections (concatenation)."""

    def __init__(self, *, width: int = 8, depth: int = 2):
        super().__init__()
        self.down = nn.ModuleList()
        self.up = nn.ModuleList()
        c, chans = 3, []
        for i in range(depth):
            self.down.append(nn.Sequential(nn.Conv2d(c, width * 2**i, 3, padding=1), nn.ReLU()))
            c = width * 2**i
            chans.append(c)
        self.mid = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        for skip in reversed(chans):
            self.up.append(nn.Sequential(nn.Conv2d(c + skip, skip, 3, padding=1), nn.ReLU()))
            c = skip
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for block in self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)


def unet(*, batch: int = 2, width: int = 8, size: int = 32, depth: int = 2, seed: int = 0):
    """U-Net-style model with long skips; the loss is the output's sum."""
    torch.manual_seed(seed)
    return UNet(width=width, depth=depth), (torch.randn(batch, 3, size, size),)


class UNetBN(nn.Module):
    """A small U-Net-style CNN: conv + BatchNorm + ReLU, a strided conv down, Dropout2d,
    a transposed conv up, and a long skip through ``cat``."""

    def __init__(self, *, width: int = 16):
        super().__init__()
        w = width

        def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.enc = conv_bn(3, w)
        self.down = nn.Sequential(conv_bn(w, 2 * w, stride=2), nn.Dropout2d(0.1))
        self.mid = conv_bn(2 * w, 2 * w)
        self.up = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.dec = conv_bn(2 * w, w)
        self.head = nn.Conv2d(w, 1, 1)

    def forward(self, x):
        skip = self.enc(x)
        h = self.up(self.mid(self.down(skip)))
        return self.head(self.dec(torch.cat([h, skip], dim=1)))


def unet_bn(*, batch: int = 16, width: int = 16, size: int = 64, seed: int = 0):
    """U-Net-style CNN with BatchNorm, Dropout2d and a transposed conv; the loss is the
    output's sum. Its CPU convolutions allocate buffers inside the op (see
    :class:`graphs.memory.AllocatorPeak`)."""
    torch.manual_seed(seed)
    return UNetBN(width=width), (torch.randn(batch, 3, size, size),)


class _GPTBlock(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """GPT-style decoder: token + position embeddings, causal attention, dropout, tied head."""

    def __init__(self, *, vocab: int = 128, seq: int = 32, d: int = 64, n_layer: int = 2,
                 n_head: int = 4, dropout: float = 0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_GPTBlock(d, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 if p is self.wte.weight else 2 * n_layer))

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:  # the logits, for a loss written outside the model
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt(*, n_layer: int = 2, d: int = 64, n_head: int = 4, seq: int = 32, batch: int = 2,
        vocab: int = 128, dropout: float = 0.1, seed: int = 0):
    """GPT-style stack; ``gpt(n_layer=8, d=256, seq=256, batch=8)`` is the benchmark GPT."""
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, seq=seq, d=d, n_layer=n_layer, n_head=n_head, dropout=dropout)
    idx = torch.randint(0, vocab, (batch, seq))
    return model, (idx, torch.roll(idx, -1, dims=1))


def hf_gpt2(*, n_layer: int = 2, d: int = 64, n_head: int = 4, seq: int = 32, batch: int = 2,
            vocab: int = 256, seed: int = 0):
    """Hugging Face GPT-2 from a small config (random weights, ``use_cache=False``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=d, n_head=n_head, n_positions=max(seq, 8),
                     vocab_size=vocab, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def hf_llama(*, n_layer: int = 2, d: int = 64, n_head: int = 4, n_kv_head: int | None = None,
             ffn: int | None = None, seq: int = 32, batch: int = 2, vocab: int = 256, seed: int = 0):
    """Hugging Face Llama from a small config (random weights, ``use_cache=False``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=d, num_attention_heads=n_head,
                      num_key_value_heads=n_kv_head or n_head, intermediate_size=ffn or 4 * d,
                      vocab_size=vocab, max_position_embeddings=max(seq, 8), use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


class InplaceMLP(nn.Module):
    """An MLP whose activations and residuals are in-place (``relu_``, ``add_``)."""

    def __init__(self, d: int = 64, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            h.add_(x)  # residual, in place on the linear output
            h.relu_()
            x = h
        return x.sum()


def inplace_mlp(*, batch: int = 32, d: int = 64, depth: int = 3, seed: int = 0):
    """In-place ops: ``relu_`` and ``add_`` on activations."""
    torch.manual_seed(seed)
    return InplaceMLP(d, depth), (torch.randn(batch, d),)


class MultiInput(nn.Module):
    """Several positional and keyword inputs, one of them optional."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, 1)

    def forward(self, x, y, *, mask=None, scale: float = 1.0):
        h = torch.tanh(self.a(x)) * torch.sigmoid(self.b(y))
        if mask is not None:
            h = h * mask
        return (self.c(h) * scale).pow(2).mean()


def multi_input(*, batch: int = 16, d: int = 32, seed: int = 0):
    """Keyword inputs: ``x``, ``y`` (positional in the signature), ``mask`` and ``scale``."""
    torch.manual_seed(seed)
    return MultiInput(d), {"x": torch.randn(batch, d), "y": torch.randn(batch, d),
                           "mask": (torch.rand(batch, d) > 0.5).float(), "scale": 0.5}


class DataDependent(nn.Module):
    """Python control flow on a tensor value: not capturable as one graph."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = self.b(h)
        return h.sum()


def data_dependent(*, batch: int = 4, d: int = 16, seed: int = 0):
    """Branches on ``h.sum() > 0``."""
    torch.manual_seed(seed)
    return DataDependent(d), (torch.randn(batch, d),)


class EncoderStack(nn.Module):
    """torch's own ``TransformerEncoderLayer`` stack with dropout and a causal mask, as
    people write it (pre-norm, batch first), behind a linear input projection."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True, norm_first=True)
            for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return x


def encoder_stack(*, layers: int = 3, d: int = 32, heads: int = 4, seq: int = 32, batch: int = 8,
                  dropout: float = 0.1, seed: int = 0):
    """A stack of ``nn.TransformerEncoderLayer`` with dropout; returns the output (the loss
    is the caller's)."""
    torch.manual_seed(seed)
    return EncoderStack(d, heads, layers, dropout).train(), (torch.randn(batch, seq, d),)


ZOO: dict[str, Callable[..., tuple[nn.Module, Any]]] = {
    "mlp": mlp,
    "resnet": resnet,
    "unet": unet,
    "unet_bn": unet_bn,
    "gpt": gpt,
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "inplace_mlp": inplace_mlp,
    "multi_input": multi_input,
    "encoder_stack": encoder_stack,
}

"""Block discovery finds a model's repeated layers, on the model and on its captured DAG."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphs.layers import graph_layer_blocks, node_blocks
from graphs.module_mode import ModulePlanError, layer_blocks
from graphs.errors import RematError
from examples.models import unet
from tests.graphs.torchvision_like import convnext, efficientnet, resnet18, vit


def test_resnet18_gives_every_block_of_every_stage():
    model = resnet18()
    assert layer_blocks(model) == [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)]


def test_convnext_gives_the_blocks_of_every_stage_not_the_heaviest_alone():
    # the last stages hold most of the parameters (widths 8 to 64): their blocks win, and
    # the lighter stages' blocks of the same kind join them
    model = convnext(depths=(2, 2, 6, 2))
    assert layer_blocks(model) == [f"features.{2 * s + 1}.{i}" for s, n in enumerate((2, 2, 6, 2)) for i in range(n)]


def test_efficientnet_gives_every_block_and_none_of_their_parts():
    model = efficientnet()
    stages = [(i, len(model.features[i])) for i in range(1, len(model.features) - 1)]
    assert layer_blocks(model) == [f"features.{i}.{k}" for i, n in stages for k in range(n)]


def test_vit_gives_the_encoder_layers_not_an_mlp():
    model = vit(num_layers=4)
    assert layer_blocks(model) == [f"encoder.layers.encoder_layer_{i}" for i in range(4)]


def _gpt2():
    from transformers import GPT2Config, GPT2Model

    # the embedding (vocabulary 5000 x 32) holds more parameters than the two blocks
    return GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=5000, n_positions=16)), "h"


def _llama():
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=16)), "layers"


def _bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                vocab_size=64, max_position_embeddings=16)), "encoder.layer"


class _WithHead(nn.Module):
    """An HF backbone under a classification head of three children (longer than the
    layer list)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2))


@pytest.mark.parametrize("build", [_gpt2, _llama, _bert], ids=["gpt2", "llama", "bert"])
def test_hf_models_give_their_layers_not_a_longer_head(build):
    backbone, layers = build()
    assert layer_blocks(_WithHead(backbone)) == [f"backbone.{layers}.{i}" for i in range(2)]


def test_encoder_and_decoder_layers_both_count():
    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(3))
            self.dec = nn.ModuleList(nn.TransformerDecoderLayer(16, 2, 32) for _ in range(2))

    assert layer_blocks(Seq2Seq()) == ["enc.0", "enc.1", "enc.2", "dec.0", "dec.1"]


def test_unknown_or_nested_blocks_are_an_error():
    model = resnet18()
    with pytest.raises(ModulePlanError, match="no submodule 'layer5.0'") as info:
        layer_blocks(model, blocks=["layer1.0", "layer5.0"])
    assert isinstance(info.value, RematError)
    with pytest.raises(ModulePlanError, match="inside"):
        layer_blocks(model, blocks=["layer1", "layer1.0"])
    assert layer_blocks(model, blocks=["layer1", "layer2.1"]) == ["layer1", "layer2.1"]


def test_policy_layer_blocks_is_the_same():
    from solver.policy import layer_blocks as policy_blocks

    model = vit(num_layers=3)
    assert policy_blocks(model) == layer_blocks(model)
    with pytest.raises(ModulePlanError):
        policy_blocks(model, blocks=["encoder.nothing"])


@pytest.mark.parametrize("build, args", [
    (lambda: resnet18(), lambda: (torch.randn(2, 3, 32, 32),)),
    (lambda: vit(num_layers=3), lambda: (torch.randn(2, 3, 32, 32),)),
    (lambda: convnext(depths=(1, 1, 3, 1)), lambda: (torch.randn(2, 3, 32, 32),)),
    (lambda: unet()[0], lambda: unet()[1]),  # its middle is a Sequential of single ops
], ids=["resnet18", "vit", "convnext", "unet"])
def test_the_dag_gives_the_blocks_the_model_does(build, args):
    from graphs.capture import capture

    torch.manual_seed(0)
    model = build()
    cg = capture(model, args(), measure_time=False)
    blocks = layer_blocks(model)
    assert graph_layer_blocks(cg) == blocks
    owner = node_blocks(cg, blocks)
    assert set(owner.values()) == set(blocks)
    assert all(str(cg[v]["module"]).startswith(owner[v]) for v in owner)


def test_t5_gives_the_blocks_of_both_stacks_not_the_stacks():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_heads=4, decoder_start_token_id=0, pad_token_id=0))
    assert layer_blocks(model) == [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(2)]

"""Hugging Face models as their configs come (``use_cache`` on): a training call runs
with ``use_cache=False``, as Hugging Face's own gradient checkpointing does, with one
warning and a note in the report; the loss and gradients are the plain model's, and
calls in ``eval()`` still return the cache."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import solver

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128)
    assert config.use_cache  # as it comes
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    assert config.use_cache
    return transformers.GPT2LMHeadModel(config)


def _lora_llama():
    """A PEFT model, whose forward passes its ``**kwargs`` on to the model it wraps."""
    peft = pytest.importorskip("peft")  # a dev extra: installed wherever the tests run
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(_llama(), config)


@pytest.mark.parametrize("mode", ["graph", "module"])
@pytest.mark.parametrize("make", [_llama, _gpt2, _lora_llama], ids=["llama", "gpt2", "lora-llama"])
def test_a_model_with_its_cache_on_trains_as_the_plain_model(make, mode):
    torch.manual_seed(0)
    model = make().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    with pytest.warns(UserWarning, match="use_cache=False") as caught:
        fast = solver.optimize(model, 1.0, {"input_ids": ids, "labels": ids}, mode=mode, measure_time=False)
        for step in range(2):
            torch.manual_seed(step)  # GPT-2's dropout draws alike
            loss = fast(input_ids=ids, labels=ids).loss
            loss.backward()
    assert sum("use_cache" in str(w.message) for w in caught) == 1  # once per module
    assert any("use_cache=False" in n for n in fast.report.notes)
    for step in range(2):  # two steps' gradients, as above
        torch.manual_seed(step)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # (GPT-2's tied embedding sums its two gradients in another order)
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    fast.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is changed, nor warned, outside training
        assert fast(input_ids=ids).past_key_values is not None

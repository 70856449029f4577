"""Never refused where checkpointing every block fits: on a zoo of models (a GPT whose
cross-entropy is written outside it, a stack of ``TransformerEncoderLayer`` with dropout,
HF GPT-2 and Llama, torchvision's ResNet18 and a small ``VisionTransformer`` in their
module structure, a U-Net), at 1.02x or 1.10x the allocator's peak of one step with
non-reentrant ``torch.utils.checkpoint`` on every layer block, graph mode and module
mode plan, and the real training step fits by the allocator, planned once and predicted
within 1 % (but for the known misses of ``MISSES``, checked to miss still); with CUDA's
dispatch of dropout and attention emulated and without, on the models that dropout or
attention reach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import solver
from examples import models
from graphs.memory import AllocatorPeak
from graphs.module_mode import layer_blocks
from graphs.units import GiB
from tests.emulation import cuda_dispatch
from tests.graphs import torchvision_like


def _gpt():
    model, (idx, targets) = models.gpt(n_layer=4, d=32, n_head=4, seq=64, batch=4, vocab=256)
    return model, (idx,), {}, lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())


def _encoder():
    model, (x,) = models.encoder_stack(layers=4, d=32, seq=32, batch=4)
    return model, (x,), {}, lambda out: out.square().mean()


def _hf(make):
    def build():
        model, inputs = make(n_layer=3, d=32, n_head=4, seq=32, batch=2, vocab=128)
        return model, (), inputs, None  # the model's own loss (labels given)
    return build


def _vision(make, size):
    def build():
        torch.manual_seed(0)
        model = make().train()
        x, labels = torch.randn(2, 3, size, size), torch.randint(0, 10, (2,))
        return model, (x,), {}, lambda out: F.cross_entropy(out, labels)
    return build


def _unet():
    model, (x,) = models.unet(batch=2, width=8, size=32)
    return model, (x,), {}, lambda out: out.square().mean()


ZOO = {
    "gpt_cross_entropy": _gpt,
    "encoder_dropout": _encoder,
    "hf_gpt2": _hf(models.hf_gpt2),
    "hf_llama": _hf(models.hf_llama),
    "resnet18": _vision(lambda: torchvision_like.resnet18(width=4), 32),
    "vit": _vision(lambda: torchvision_like.vit(image_size=32, patch_size=4, num_layers=3, hidden_dim=32,
                                                mlp_dim=64, dropout=0.1), 32),
    "unet": _unet,
}

#: the models that dropout or scaled-dot-product attention reach: CUDA's dispatch changes their ops
EMULATED = ("gpt_cross_entropy", "encoder_dropout", "hf_gpt2", "hf_llama", "vit")


def _loss(out, loss_fn):
    return out.loss if loss_fn is None else loss_fn(out)


def planned_again_note(note: str) -> bool:
    """Whether a report's note tells of a second plan: by the watch after a real step, or
    by planning after a measured step of the first."""
    return note.startswith("planned again") or note.startswith("planned for ") and "measured" in note


def per_block_peak(model, args, kwargs, loss_fn) -> int:
    """The allocator's peak of one training step of ``model`` with non-reentrant
    ``torch.utils.checkpoint`` around every layer block (:func:`layer_blocks`), the
    loss included; the model is left as found."""
    blocks = [model.get_submodule(name) for name in layer_blocks(model)]
    for b in blocks:
        b.forward = (lambda f: lambda *a, **k: checkpoint.checkpoint(f, *a, use_reentrant=False, **k))(b.forward)
    try:
        model.zero_grad(set_to_none=True)
        with AllocatorPeak(model, args, kwargs) as judge:
            out = model(*args, **kwargs)
            _loss(out, loss_fn).backward()
            del out
    finally:
        for b in blocks:
            del b.forward
        model.zero_grad(set_to_none=True)
    return judge.peak_bytes


def _cases():
    """Each model in both modes, one at 1.02x and the other at 1.10x (taking turns along
    the zoo), the 1.10x case with CUDA's dispatch where it changes the model's ops."""
    for i, name in enumerate(ZOO):
        for j, mode in enumerate(("graph", "module")):
            frac, emulate = (1.02, False) if (i + j) % 2 == 0 else (1.10, name in EMULATED)
            yield pytest.param(name, mode, frac, emulate,
                               id=f"{name}-{mode}-{frac}-{'cuda' if emulate else 'cpu'}-dispatch")


#: cases known to be planned a second time or predicted more than 1 % off the allocator's
#: peak, and why (each is checked to miss still: one that no longer misses fails until it
#: leaves the list)
MISSES: dict[tuple[str, str], str] = {}


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,frac,emulate", list(_cases()))
def test_a_budget_per_block_checkpointing_meets_is_planned_and_fits(name, mode, frac, emulate):
    with cuda_dispatch(emulate):
        model, args, kwargs, loss_fn = ZOO[name]()
        floor = per_block_peak(model, args, kwargs, loss_fn)
        budget = int(frac * floor)
        fast = solver.optimize(model, budget / GiB, kwargs or args, mode=mode, loss_fn=loss_fn, measure_time=False)
        opt = torch.optim.SGD(fast.parameters(), lr=0.0)
        out = fast(*args, **kwargs)
        _loss(out, loss_fn).backward()
        del out
        opt.step()  # ends the measurement of the step
        opt.zero_grad(set_to_none=True)
        report = fast.report
        assert report.step_peak_bytes is not None
        assert report.step_peak_bytes <= budget, (report.step_peak_bytes, budget, floor, report.notes)
        again = [n for n in report.notes if planned_again_note(n)]
        error = (report.predicted_peak_bytes - report.step_peak_bytes) / report.step_peak_bytes
        if (name, mode) in MISSES:
            assert again or abs(error) > 0.01, f"planned once, predicted {error:+.2%}: take {(name, mode)} out of MISSES"
            pytest.xfail(MISSES[name, mode])
        assert not again, report.notes
        assert abs(error) <= 0.01, (report.predicted_peak_bytes, report.step_peak_bytes)


def test_a_checkpointed_blocks_forward_runs_a_multi_output_op_once():
    from graphs.capture import capture
    from solver.module_plan import BlockIndex, checkpoint_view, plan_schedule

    with cuda_dispatch():  # dropout as native_dropout: a result and a mask from one op
        model, (idx, _) = models.gpt(n_layer=2, d=16, n_head=2, seq=16, batch=2, vocab=64)
        cg = capture(model, (idx,), backward="outputs", measure_time=False, measure_workspace=False)
    blocks = layer_blocks(model)
    view = checkpoint_view(cg, blocks)
    plan = {b: "full" for b in blocks}
    sched, res = plan_schedule(view, plan, index=BlockIndex(view, blocks))
    seq = sched.sequence
    first_bwd = next(i for i, v in enumerate(seq) if view[v]["phase"] == "backward")
    runs = {}
    for i, v in enumerate(seq[first_bwd:], first_bwd):
        if view[v].get("group") is not None and "native_dropout." in str(view[v]["op"]):
            runs.setdefault(view[v]["group"], []).append(i)
    assert any(len(p) == 2 for p in runs.values())  # result and mask both recomputed
    assert all(len(p) == 1 or p == [p[0], p[0] + 1] for p in runs.values()), runs
    assert BlockIndex(view, blocks).price(plan).peak_bytes == res.peak_bytes


def test_a_checkpointed_block_is_recomputed_in_the_order_its_forward_ran():
    # torch.utils.checkpoint reruns a block's forward as it ran: a copy that the forward
    # makes late (attention's value, cloned for its matmul) is not made early in the
    # recomputation, where it would free what it copies before the scores are computed
    from graphs.capture import capture
    from solver.module_plan import BlockIndex, checkpoint_sequence, checkpoint_view, keep_for_plan, plan_schedule
    from solver.plans import sequence_from_keep

    model, (idx, _) = models.gpt(n_layer=2, d=16, n_head=2, seq=16, batch=2, vocab=64)
    cg = capture(model, (idx,), backward="outputs", measure_time=False, measure_workspace=False)
    blocks = layer_blocks(model)
    view = checkpoint_view(cg, blocks)
    plan = {b: "full" for b in blocks}
    index = BlockIndex(view, blocks)
    plain = sequence_from_keep(view, keep_for_plan(view, plan))
    for seq in (plan_schedule(view, plan, index=index)[0].sequence, checkpoint_sequence(view, plain, plan)):
        first_bwd = next(i for i, v in enumerate(seq) if view[v]["phase"] == "backward")
        ran = {v: i for i, v in reversed(list(enumerate(seq[:first_bwd])))}
        for b in blocks:
            fwd = set(index.nodes(b)[0])
            again = [v for v in seq[first_bwd:] if v in fwd]
            assert len(again) > 1
            assert again == sorted(again, key=ran.__getitem__), b
    assert index.price(plan).peak_bytes == plan_schedule(view, plan, index=index)[1].peak_bytes

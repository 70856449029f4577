"""The layer-level rewrite: same numbers as eager, BatchNorm updated once, drop-in module."""

import copy

import pytest
import torch
from torch import nn

from graphs.module_mode import ModulePlanError, apply_module_plan


def _net():
    def block():
        return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))

    torch.manual_seed(0)
    return nn.Sequential(block(), block(), nn.Linear(16, 1))


def _step(model, x, seed):
    torch.manual_seed(seed)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("action", ["full", "selective", "offload"])
def test_same_loss_grads_and_running_stats_over_three_steps(action):
    ref = _net()
    net = copy.deepcopy(ref)
    wrapped = apply_module_plan(net, {"0": action, "1": action})
    opt_a = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for step in range(3):
        la, lb = _step(wrapped, x, step), _step(ref, x, step)
        assert torch.equal(la, lb)
        for (name, a), b in zip(net.named_parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), name
        for a, b in zip(net.buffers(), ref.buffers()):
            assert torch.equal(a, b)  # running stats updated once per step
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()


class _SavedDrawThenRecomputedDraw(nn.Module):
    """A draw whose output a selective policy saves (a functional ``bernoulli``), then
    one it recomputes (``native_dropout``, the attention core's): on CUDA, a fused
    attention with dropout under ``save_matmuls`` followed by a dropout is the same."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        keep = torch.bernoulli(torch.full_like(h, 0.7))
        out, _ = torch.native_dropout(torch.tanh(h * keep), 0.5, True)
        return out


def test_selective_recomputation_draws_what_the_forward_drew_after_a_saved_draw():
    torch.manual_seed(0)
    ref = nn.Sequential(_SavedDrawThenRecomputedDraw(), _SavedDrawThenRecomputedDraw(), nn.Linear(16, 1))
    net = copy.deepcopy(ref)
    wrapped = apply_module_plan(net, {"0": "selective", "1": "selective"})
    x = torch.randn(8, 16)
    for step in range(2):
        assert torch.equal(_step(wrapped, x, step), _step(ref, x, step))
        for (name, a), b in zip(net.named_parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad), name
            a.grad, b.grad = None, None


def test_checkpointed_block_really_recomputes():
    net = _net()
    calls = []
    net[0][0].register_forward_hook(lambda *a: calls.append(1))
    wrapped = apply_module_plan(net, {"0": "full"})
    _step(wrapped, torch.randn(4, 16), 0)
    assert len(calls) == 2  # forward, then recomputation in backward
    calls.clear()
    _step(net, torch.randn(4, 16), 0)  # the original model is not changed
    assert len(calls) == 1


def test_eval_and_no_grad_do_not_recompute():
    net = _net()
    calls = []
    net[0][0].register_forward_hook(lambda *a: calls.append(1))
    wrapped = apply_module_plan(net, {"0": "full"})
    with torch.no_grad():
        wrapped(torch.randn(4, 16))
    wrapped.eval()
    wrapped(torch.randn(4, 16)).sum().backward()
    assert len(calls) == 2


def test_drop_in_shares_parameters_and_state_dict():
    net = _net()
    wrapped = apply_module_plan(net, {"1": "full"})
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in net.parameters()]
    assert list(wrapped.state_dict()) == list(net.state_dict())
    assert type(wrapped) is type(net)


def test_bad_plans_are_rejected_with_names():
    net = _net()
    with pytest.raises(ModulePlanError, match="no submodule '7'"):
        apply_module_plan(net, {"7": "full"})
    with pytest.raises(ModulePlanError, match="unknown action"):
        apply_module_plan(net, {"0": "sometimes"})
    with pytest.raises(ModulePlanError, match="nested"):
        apply_module_plan(net, {"0": "full", "0.1": "full"})

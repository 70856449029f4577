"""A model that calls ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` is
refused at capture with an error that names it and what to do, in both modes; the
non-reentrant checkpoint is captured."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import solver
from graphs.errors import CaptureError


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(lambda h, layer=layer: torch.tanh(layer(h)), x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("mode", ["graph", "module"])
def test_a_reentrant_checkpoint_is_named_with_what_to_do(mode):
    torch.manual_seed(0)
    model, x = Checkpointed(reentrant=True), torch.randn(8, 16)
    with pytest.warns(UserWarning), pytest.raises(CaptureError, match=r"use_reentrant=True.*pass use_reentrant=False"):
        solver.optimize(model, 1.0, (x,), mode=mode, measure_time=False)
    assert "remat_steps" not in model.__dict__
    # the checkpoint's class is torch's own again once capture is done
    assert torch.utils.checkpoint.CheckpointFunction.forward.__module__ == "torch.utils.checkpoint"


def test_a_non_reentrant_checkpoint_is_captured():
    torch.manual_seed(0)
    model, x = Checkpointed(reentrant=False), torch.randn(8, 16)
    fast = solver.optimize(model, 1.0, (x,), measure_time=False)
    fast(x).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())

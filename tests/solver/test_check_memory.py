"""What planning's own runs hold beside the step they measure: the example inputs once
(planning's copies share the user's memory until a run writes into them), and no
gradients in the gradient check's reference step."""

import torch
from torch import nn

from graphs.memory import AllocatorPeak, resident_bytes
from solver.join.checks import PlanningInputs, reference_step, reproduces


def test_planning_copies_of_the_inputs_hold_no_memory_until_written():
    x = torch.randn(256, 1024)  # 1 MiB
    with AllocatorPeak(x) as judge:
        inputs = PlanningInputs((x,), {})
    assert judge.peak_bytes == resident_bytes(x)  # no second MiB
    assert inputs.beside_bytes == 0
    (c,), _ = inputs.args, inputs.kwargs
    c.mul_(2)  # a model that writes into its input
    assert torch.equal(c, 2 * x) and inputs.beside_bytes == resident_bytes(x)
    inputs.reset()
    assert torch.equal(c, x) and inputs.beside_bytes == 0
    inputs.release()
    assert x.numel() == 256 * 1024


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_the_reference_step_of_the_gradient_check_holds_no_gradients():
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(4, 512)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # 4 MiB, the activations 40 KiB
    found = reproduces(model, reference_step(model), (x,), {})
    assert found.same
    # the step checked holds its gradients; the reference compares each as it arrives and drops it
    assert found.peak_bytes >= resident_bytes(model, x) + grads
    assert found.reference_peak_bytes < resident_bytes(model, x) + grads / 2
    assert all(p.grad is None for p in model.parameters())

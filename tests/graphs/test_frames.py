"""Python's lifetimes in an eager forward: the values a name of a module's ``forward``
holds until it returns are found from the capture and the forward's source."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples import models
from graphs.capture import capture
from graphs.frames import bound_until_return, held_statements


def test_a_name_assigned_again_or_inside_a_loop_does_not_hold_its_value():
    src = """def forward(self, x):
    a = x + 1
    b, c = x.split(2)
    b = b * 2
    for i in range(3):
        d = x * i
    e = a + c
    del e
    return a
"""
    lines, held = held_statements(src, 10)
    # a (line 11) and the last b (line 13) stay bound; "b, c" does not count (b is
    # assigned again), e is deleted, d is in a loop
    assert held == {(11, 11), (13, 13)}
    assert lines[13] == (13, 13) and lines[15] == (15, 15) and 14 not in lines


def test_a_statement_over_several_lines_is_one_statement():
    src = """def forward(self, x):
    y = torch.cat(
        [x, x])
    return y
"""
    lines, held = held_statements(src)
    assert lines[2] == lines[3] == (2, 3) and held == {(2, 3)}


def test_the_gpt_blocks_attention_projection_and_output_are_held():
    model, (idx, _) = models.gpt(n_layer=2, d=16, seq=8, batch=2, vocab=32)
    g = capture(model, (idx,), backward="outputs", measure_time=False)
    held = bound_until_return(g, model)
    for i in range(2):
        mine = sorted(g[v]["op"] for v, m in held.items() if m == f"blocks.{i}")
        # q, k, v view the projection; a is the attention's output; x the residual sum
        assert mine == ["aten.add.Tensor", "aten.addmm.default", "aten.bmm.default"], mine
    # the MLP's values are temporaries of one statement
    assert not any(g[v]["op"] == "aten.gelu.default" for v in held)


def _twice(z):
    w = z * 2  # a helper's names are its own frame's: not the module's
    return w + 1


class Rebinding(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = _twice(h)
        return torch.tanh(self.b(h)).sum()


def test_values_of_a_name_assigned_again_and_of_helpers_are_not_held():
    model = Rebinding()
    g = capture(model, (torch.randn(4, 8),), backward="outputs", measure_time=False)
    assert bound_until_return(g, model) == {}


class Kept(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        big = F.relu(self.a(x))
        out = self.b(big)
        return out.square().sum() + big.mean()


def test_a_value_read_by_a_later_statement_is_held_by_its_module():
    model = Kept()
    g = capture(model, (torch.randn(4, 8),), backward="outputs", measure_time=False)
    held = bound_until_return(g, model)
    assert [g[v]["op"] for v in held] == ["aten.relu.default"] and set(held.values()) == {""}

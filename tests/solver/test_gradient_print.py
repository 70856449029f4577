"""The self-check's compact gradient comparison (solver.join.checks.GradientPrint)."""

import pytest
import torch

from torch import nn

from solver.join.checks import CHUNK_ELEMENTS, COMPILED, EAGER, HALF, GradientPrint, check_tolerance


@pytest.mark.parametrize("n", [5000, 70_000, 3 * CHUNK_ELEMENTS * 64 + 17])
def test_gradient_print_tells_equal_from_wrong_at_every_chunk_size(n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    printed = GradientPrint(g, seed=3)
    assert printed.matches(g.clone(), tolerance=EAGER)
    assert printed.matches(g * (1 + 1e-6), tolerance=EAGER)
    for at in (0, n // 2, n - 1):  # one element wrong, in the first, a middle and the last chunk
        wrong = g.clone()
        wrong[at] += 1.0
        assert not printed.matches(wrong, tolerance=EAGER)
    assert not printed.matches(g / 10, tolerance=EAGER)
    assert not printed.matches(g.reshape(1, -1), tolerance=EAGER)  # another shape


def test_gradient_print_reads_a_gradient_in_few_chunks():
    """At most 8 chunks where each stays within CHUNK_ELEMENTS; never above 64."""
    for n, most in [(70_000, 8), (8 * CHUNK_ELEMENTS, 8), (200 * CHUNK_ELEMENTS, 64)]:
        printed = GradientPrint(torch.zeros(1), seed=0)
        chunks = list(printed._chunks(torch.zeros(n)))
        assert len(chunks) <= most + 1
        assert sum(c.numel() for c, _ in chunks) == n


@pytest.mark.parametrize("tolerance", [HALF, COMPILED], ids=["half", "compiled"])
def test_a_looser_tolerance_takes_rounding_and_still_tells_a_wrong_gradient(tolerance):
    n = 70_000
    g = torch.randn(n, generator=torch.Generator().manual_seed(1))
    printed = GradientPrint(g, seed=3)
    # 16-bit rounding of every element (bfloat16 keeps 8 bits of mantissa)
    assert printed.matches(g.bfloat16().float(), tolerance=tolerance)
    assert not printed.matches(g * 1.05, tolerance=tolerance)
    assert not printed.matches(g / 10, tolerance=tolerance)
    if not tolerance.by_norm:  # one element wrong: by elements, not lost in the norm
        wrong = g.clone()
        wrong[n // 2] += 1.0
        assert not printed.matches(wrong, tolerance=tolerance)
    assert not printed.matches(g.bfloat16().float(), tolerance=EAGER)


def test_the_tolerance_follows_the_arithmetic_of_the_step():
    net = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert check_tolerance(net, (x,)) is EAGER
    assert check_tolerance(net, (x,), compiled=True) is COMPILED
    assert check_tolerance(net, (x.half(),)) is HALF  # 16-bit inputs
    assert check_tolerance(net.to(torch.bfloat16), (x,)) is HALF  # 16-bit weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert check_tolerance(nn.Linear(4, 4), (x,)) is HALF
    with torch.autocast("cpu", enabled=False):
        assert check_tolerance(nn.Linear(4, 4), (x,)) is EAGER

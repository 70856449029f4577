"""The self-check's compact gradient comparison (solver.join.checks.GradientPrint)."""

import pytest
import torch

from solver.join.checks import CHUNK_ELEMENTS, GradientPrint


@pytest.mark.parametrize("n", [5000, 70_000, 3 * CHUNK_ELEMENTS * 64 + 17])
def test_gradient_print_tells_equal_from_wrong_at_every_chunk_size(n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    printed = GradientPrint(g, seed=3)
    assert printed.matches(g.clone(), compiled=False)
    assert printed.matches(g * (1 + 1e-6), compiled=False)
    for at in (0, n // 2, n - 1):  # one element wrong, in the first, a middle and the last chunk
        wrong = g.clone()
        wrong[at] += 1.0
        assert not printed.matches(wrong, compiled=False)
    assert not printed.matches(g / 10, compiled=False)
    assert not printed.matches(g.reshape(1, -1), compiled=False)  # another shape


def test_gradient_print_reads_a_gradient_in_few_chunks():
    """At most 8 chunks where each stays within CHUNK_ELEMENTS; never above 64."""
    for n, most in [(70_000, 8), (8 * CHUNK_ELEMENTS, 8), (200 * CHUNK_ELEMENTS, 64)]:
        printed = GradientPrint(torch.zeros(1), seed=0)
        chunks = list(printed._chunks(torch.zeros(n)))
        assert len(chunks) <= most + 1
        assert sum(c.numel() for c, _ in chunks) == n

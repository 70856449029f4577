"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest

from tests.emulation import cuda_dispatch as _cuda_dispatch


@pytest.fixture(params=[False, True], ids=["cpu-dispatch", "cuda-dispatch"])
def cuda_dispatch(request):
    """Runs the test twice: with the CPU's own dispatch of dropout and attention, and
    with CUDA's emulated (:func:`tests.emulation.cuda_dispatch`). Yields whether the
    emulation is on."""
    with _cuda_dispatch(request.param):
        yield request.param

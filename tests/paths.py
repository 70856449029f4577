"""Where the tests find the public benchmark graphs: ``shared/`` beside the repository
(``REMAT_BENCHMARK_GRAPHS`` overrides).

A clone without them skips the tests that need them, with a one-line reason; with
``REMAT_REQUIRE_BENCHMARK_GRAPHS=1`` (CI, which has them) a missing graph fails instead.
"""

import os
from pathlib import Path

import pytest

BENCHMARK_GRAPHS = Path(
    os.environ.get("REMAT_BENCHMARK_GRAPHS", Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "graphs")
)
REQUIRED = os.environ.get("REMAT_REQUIRE_BENCHMARK_GRAPHS", "") not in ("", "0")
PRESENT = BENCHMARK_GRAPHS.is_dir() and any(BENCHMARK_GRAPHS.glob("*.json"))

if REQUIRED and not PRESENT:
    raise RuntimeError(f"REMAT_REQUIRE_BENCHMARK_GRAPHS is set but {BENCHMARK_GRAPHS} holds no benchmark graph")

#: marks a test that reads the public benchmark graphs
needs_benchmark_graphs = pytest.mark.skipif(
    not PRESENT, reason=f"the public benchmark graphs are not in {BENCHMARK_GRAPHS} (set REMAT_BENCHMARK_GRAPHS)")

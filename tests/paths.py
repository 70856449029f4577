"""Where the tests find the public benchmark graphs: ``shared/`` beside the repository
(``REMAT_BENCHMARK_GRAPHS`` overrides)."""

import os
from pathlib import Path

BENCHMARK_GRAPHS = Path(
    os.environ.get("REMAT_BENCHMARK_GRAPHS", Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "graphs")
)

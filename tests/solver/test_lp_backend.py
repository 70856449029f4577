"""OR-Tools linear solvers leave stdout alone: no banner, any native output on stderr."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os
from solver.lp_backend import create_solver, solve_quietly, stdout_to_stderr
for backend in ("HIGHS", "SCIP", "GLOP"):
    s = create_solver(backend)
    x = s.NumVar(0, 1, "x")
    s.Maximize(x)
    assert solve_quietly(s) == s.OPTIMAL and x.solution_value() == 1.0, backend
with stdout_to_stderr():
    os.write(1, b"native write\\n")
    print("python print", flush=True)
print("after")
"""


def test_solvers_write_nothing_to_stdout():
    got = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert got.returncode == 0, got.stderr
    assert got.stdout == "after\n"
    assert "native write" in got.stderr and "python print" in got.stderr
    assert "HiGHS" not in got.stderr

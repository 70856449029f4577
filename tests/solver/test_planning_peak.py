"""``report.planning_peak_bytes`` is the peak of the whole ``optimize()`` call, checked by
an allocation counter that planning does not own: a preloaded library that counts what
the c10 CPU allocator holds (``c10_allocations.c``), read in a child process around the
call."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

CHILD = r'''
import ctypes, json, sys, torch
torch.set_num_threads(1)
import solver
from graphs.memory import AllocatorPeak, resident_bytes
from graphs.units import GiB
from benchmarks.zoo_budget import make_case

lib = ctypes.CDLL(None)
lib.c10count_current.restype = lib.c10count_peak.restype = ctypes.c_longlong

name, frac = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model, inputs, _ = make_case(name, source="rebuilt", scale="test")
model.train()
with AllocatorPeak(model, inputs) as judge:
    out = model(**inputs)
    out.loss.backward()
    del out
for p in model.parameters():
    p.grad = None
budget = int(frac * judge.peak_bytes)
resident = resident_bytes(model, inputs)
start = lib.c10count_current()
lib.c10count_reset()
row = dict(budget=budget)
try:
    fast = solver.optimize(model, budget / GiB, inputs, measure_time=False)
    row.update(report=fast.report.planning_peak_bytes, notes=fast.report.notes)
except solver.InfeasibleBudget as exc:
    row.update(named=exc.smallest_feasible_bytes)
row["outer"] = lib.c10count_peak() - start + resident
print("ROW " + json.dumps(row))
'''

#: what the report may leave out: the random generators' states that ``fork_rng`` keeps
#: outside the measuring runs' windows (5 KiB on CPU) and the like
SLACK = 16 * 1024


def compile_counter(directory: Path) -> Path | None:
    """The allocation counter built into ``directory``; None without Linux and a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    lib = directory / "c10_allocations.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(HERE / "c10_allocations.c"), "-ldl"],
                   check=True)
    return lib


@pytest.fixture(scope="module")
def counter(tmp_path_factory) -> Path:
    lib = compile_counter(tmp_path_factory.mktemp("counter"))
    if lib is None:
        pytest.skip("the allocation counter is a preloaded C library: needs Linux and a C compiler")
    return lib


def _optimize_counted(counter: Path, name: str, frac: float | str, *, child: str = CHILD) -> Any:
    """What ``child`` prints as its row, run with the counter preloaded on ``name`` at ``frac``."""
    env = dict(os.environ, LD_PRELOAD=str(counter), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", child, name, str(frac)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    assert done.returncode == 0 and rows, done.stderr[-3000:]
    return json.loads(rows[-1])


def _check(row: dict) -> None:
    if "report" in row:  # the whole call, from its start, as the report says
        assert row["report"] is not None
        assert row["outer"] <= row["report"] + SLACK, row
        over = row["report"] > row["budget"]
        assert over == any("planning itself peaked" in n for n in row["notes"]), row
    else:  # raised: planning went no higher than the smallest budget it names
        assert row["outer"] <= row["named"] + SLACK, row


def test_the_planning_peak_is_the_whole_call(counter):
    _check(_optimize_counted(counter, "bert", 0.7))


@pytest.mark.slow
@pytest.mark.parametrize("name,frac", [("bert", 0.5), ("qwen2", 0.7), ("qwen2", 0.5)])
def test_hf_models_planning_peak_is_the_whole_call(counter, name, frac):
    _check(_optimize_counted(counter, name, frac))

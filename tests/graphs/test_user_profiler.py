"""remat's allocator judge beside a user's torch profiler: the user's trace is kept,
steps inside it are said (once) not to be measured, the first step after it is; remat's
own profiler prints nothing."""

from __future__ import annotations

import pytest
import torch

import graphs.memory
import solver
from examples import models
from graphs.memory import AllocatorPeak, settle_open_judges

CPU = [torch.profiler.ProfilerActivity.CPU]


def _loss(out):
    return out.float().square().mean()


def _planned():
    model, inputs = models.gpt(n_layer=2, d=32, seq=32, batch=8)
    return solver.optimize(model, 1.0, inputs, measure_time=False), inputs


def test_a_user_profiler_around_training_steps_keeps_its_trace_and_is_told(monkeypatch):
    monkeypatch.setattr(graphs.memory, "_WARNED_USER_PROFILER", [False])
    fast, inputs = _planned()
    step = next(iter(fast.remat_steps.values()))
    with pytest.warns(RuntimeWarning, match="not checked against the budget"):
        with torch.profiler.profile(activities=CPU, profile_memory=True) as prof:
            for _ in range(2):
                _loss(fast(*inputs)).backward()
    names = {e.name for e in prof.events()}
    assert {"aten::addmm", "[memory]"} <= names or {"aten::mm", "[memory]"} <= names
    assert step.step_peaks == []  # not measured inside the user's profiler
    _loss(fast(*inputs)).backward()
    settle_open_judges()
    assert len(step.step_peaks) == 1 and step.step_peaks[0] <= fast.report.budget_bytes


def test_the_judges_own_profiler_prints_nothing(capfd):
    for _ in range(2):
        with AllocatorPeak() as judge:
            torch.ones(1000).sum()
    assert judge.peak_bytes >= 4000
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "gpuGetDeviceCount" not in err


def test_a_free_inside_the_judge_of_a_block_made_before_it_prints_nothing():
    # c10 warns once per process, on stderr, when a block allocated before a profiler is
    # freed inside it: a fresh process, so that no earlier test has used up that warning
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\nfrom graphs.memory import AllocatorPeak\nx = torch.randn(1000)\n"
            "with AllocatorPeak() as judge:\n    del x\n    y = torch.randn(10)\nprint(judge.peak_bytes)\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "40"
    assert "Memory block of unknown size" not in done.stderr, done.stderr

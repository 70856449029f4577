"""On an accelerator the watch measures the first step of a plan from the allocator's
counters: no synchronization, no reset of the user's peak statistics, nothing on later
steps. Tested on CPU with the CUDA statistics replaced by counters the step moves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from solver.join.checks import Session
from solver.join.watch import UNSEEN_TRIES, WatchedStep


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it lives on CUDA (what the watch reads to pick its judge)."""

    @property
    def device(self):
        return torch.device("cuda")


class Counters:
    """The caching allocator's statistics, moved by hand."""

    def __init__(self, allocated: int = 1000, peak: int = 1000) -> None:
        self.allocated, self.peak = allocated, peak
        self.calls = {"synchronize": 0, "reset_peak_memory_stats": 0, "max_memory_allocated": 0,
                      "memory_allocated": 0}

    def install(self, monkeypatch) -> None:
        def count(name, fn):
            def wrapped(*a, **k):
                self.calls[name] += 1
                return fn()
            return wrapped

        monkeypatch.setattr(torch.cuda, "synchronize", count("synchronize", lambda: None))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", count("reset_peak_memory_stats", self._reset))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", count("max_memory_allocated", lambda: self.peak))
        monkeypatch.setattr(torch.cuda, "memory_allocated", count("memory_allocated", lambda: self.allocated))

    def _reset(self) -> None:
        self.peak = self.allocated

    def spike(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)

    @property
    def reads(self) -> int:
        return self.calls["max_memory_allocated"] + self.calls["memory_allocated"]


def _watched(counters: Counters, *, budget: int, spike: int, watch: str = "auto", replan=None):
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def step(module, args, kwargs):
        counters.spike(spike)
        return module(x).sum()

    report = SimpleNamespace(budget_bytes=budget, predicted_peak_bytes=budget // 2, graph=None,
                             step_peak_bytes=None, notes=[])
    watched = WatchedStep(step, replan=replan or (lambda held: pytest.fail("planned again")),
                          session=Session(report=report), watch=watch)
    arg = torch.zeros(4).as_subclass(FakeCuda)  # 16 bytes "on the device"
    return watched, lin, arg, report


def test_only_the_first_step_is_measured_and_nothing_is_synchronized(monkeypatch):
    counters = Counters()
    counters.install(monkeypatch)
    watched, lin, arg, report = _watched(counters, budget=10_000, spike=3000)
    watched(lin, (arg,), {}).backward()
    after_first = counters.reads
    assert after_first > 0
    assert watched.step_peaks == [16 + 3000]  # the input, and the step's rise above its entry
    for _ in range(3):
        watched(lin, (arg,), {}).backward()
    assert counters.reads == after_first  # later steps read nothing
    assert counters.calls["synchronize"] == 0
    assert counters.calls["reset_peak_memory_stats"] == 0
    assert report.step_peak_bytes == 16 + 3000


def test_the_users_peak_statistics_are_left_as_they_were(monkeypatch):
    counters = Counters(allocated=1000, peak=50_000)  # the user's own peak, from before
    counters.install(monkeypatch)
    watched, lin, arg, report = _watched(counters, budget=100_000, spike=3000)
    watched(lin, (arg,), {}).backward()
    assert counters.peak == 50_000 and counters.calls["reset_peak_memory_stats"] == 0
    # the step's own peak is hidden: at most the earlier one, within the budget: it fits
    assert watched.step_peaks == [16 + 50_000 - 1000]


def test_a_hidden_peak_over_the_budget_is_no_verdict(monkeypatch):
    counters = Counters(allocated=1000, peak=50_000)
    counters.install(monkeypatch)
    watched, lin, arg, report = _watched(counters, budget=10_000, spike=3000)
    for _ in range(UNSEEN_TRIES + 2):
        watched(lin, (arg,), {}).backward()
    assert watched.step_peaks == []  # never planned again on a figure that is not the step's
    assert any("reset_peak_memory_stats" in note for note in report.notes)


def test_a_step_over_the_budget_plans_again(monkeypatch):
    counters = Counters()
    counters.install(monkeypatch)
    held = []

    def replan(h):
        held.append(h)
        again, *_ = _watched(counters, budget=10_000, spike=100, watch="off")
        return again

    watched, lin, arg, report = _watched(counters, budget=10_000, spike=20_000, replan=replan)
    with pytest.warns(RuntimeWarning, match="over the budget"):
        watched(lin, (arg,), {}).backward()
    watched(lin, (arg,), {}).backward()
    assert held and held[0] >= 16 + 20_000 - 10_000
    assert counters.calls["synchronize"] == counters.calls["reset_peak_memory_stats"] == 0

"""``verify(module, example_inputs)``: real training steps of an optimized module,
measured, next to what its plan predicted."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from graphs.capture import default_loss
from graphs.memory import AllocatorPeak
from solver.join.checks import split_inputs, step_undone
from solver.join.fixed import untracked_bytes
from solver.report import Report

__all__ = ["verify"]

log = logging.getLogger(__name__)

#: where :func:`solver.optimize` leaves the planning session on the module it returns
SESSION = "_remat_session"


def _call(module: nn.Module, inputs: Any) -> Any:
    args, kwargs = split_inputs(inputs)
    return module(*args, **kwargs)


def _clear_grads(*modules: nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _step_seconds(modules: list[nn.Module], inputs: Any, loss_fn, *, repeats: int = 3) -> list[float]:
    """Median seconds of a training step of each module, the modules stepped in turn so
    that every median sees the same load of the machine."""
    times: list[list[float]] = [[] for _ in modules]
    for _ in range(repeats):
        for module, acc in zip(modules, times):
            _clear_grads(module)
            t0 = time.process_time()
            loss_fn(_call(module, inputs)).backward()
            acc.append(time.process_time() - t0)
    return [statistics.median(t) for t in times]


def verify(module: nn.Module, example_inputs: Any, *, loss_fn: Callable | None = None,
           original: nn.Module | None = None, repeats: int = 3) -> Report:
    """Run real training steps of an optimized module and measure them.

    Adds the measured peak (one step, gradients initially None, by the allocator:
    :class:`graphs.memory.AllocatorPeak`, the CUDA allocator's peak statistics or, on
    CPU, the profiler's allocation events; for a data-parallel module, :class:`graphs.distributed.RankMemoryTracker` over the rank's
    local tensors, :func:`graphs.distributed.rank_tensors`: call it on every rank) and the
    median step time (process CPU time on CPU) to ``module.report``; with ``original``,
    also the original module's step time (the two stepped in turn) and peak, and
    ``report.predicted_step_ratio``. Gradients, buffers and the random generators are
    left as found.

    Parameters
    ----------
    module : torch.nn.Module
        Returned by :func:`solver.optimize`.
    example_inputs : tuple or dict
    loss_fn : callable, optional
        Output -> scalar loss (default: the ``loss_fn`` given to :func:`solver.optimize`,
        else :func:`graphs.capture.default_loss`).
    original : torch.nn.Module, optional
        The model before optimization, to time side by side.
    repeats : int
        Timed steps (median) after one warm-up.

    Returns
    -------
    Report

    Examples
    --------
    >>> import solver
    >>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> x = torch.randn(4, 8)
    >>> fast = solver.optimize(net, 1.0, (x,), measure_time=False)
    >>> solver.verify(fast, (x,), repeats=1).fits
    True
    """
    session = module.__dict__.get(SESSION)
    if session is None:
        raise ValueError("verify() takes a module returned by solver.optimize")
    if original is not None and session.report is not None and session.report.sharding:
        raise ValueError("original= is not available for a data-parallel module (its step runs collectives); "
                         "verify it without original")
    return verify_into(module, example_inputs, session=session, original=original, loss_fn=loss_fn,
                       repeats=repeats)


def verify_into(module: nn.Module, example_inputs: Any, *, session: Any, original: nn.Module | None = None,
                loss_fn: Callable | None = None, repeats: int = 3) -> Report:
    """:func:`verify`, its figures written into the session's report."""
    loss_fn = loss_fn or session.loss_fn or default_loss
    with step_undone(module):
        if session.report is None:  # lazy plan: the first call plans
            with torch.random.fork_rng():
                loss_fn(_call(module, example_inputs)).backward()
        report = session.report
        _clear_grads(module)
        loss_fn(_call(module, example_inputs)).backward()  # warm-up
        _clear_grads(module)
        report.measured_peak_bytes = _measured(module, example_inputs, report=report, loss_fn=loss_fn)
        if original is None:
            (report.measured_step_seconds,) = _step_seconds([module], example_inputs, loss_fn, repeats=repeats)
        else:
            with step_undone(original):
                _clear_grads(module)
                loss_fn(_call(original, example_inputs)).backward()  # warm-up
                report.measured_step_seconds, report.original_step_seconds = _step_seconds(
                    [module, original], example_inputs, loss_fn, repeats=repeats)
                _clear_grads(module, original)
                with AllocatorPeak(original, example_inputs) as t2:
                    out = _call(original, example_inputs)
                    loss_fn(out).backward()
                    del out
            report.original_peak_bytes = int(t2.peak_bytes + untracked_bytes(report.graph))
    if report.measured_peak_bytes > report.budget_bytes:
        log.warning("measured peak %s exceeds the budget %s", report.measured_peak_bytes, report.budget_bytes)
    return report


def _measured(module: nn.Module, example_inputs: Any, *, report: Report, loss_fn: Callable) -> int:
    """Peak bytes of one step of ``module`` by the allocator, with what the step does
    not allocate yet added (optimizer state not created)."""
    if report.sharding:  # local shards and buckets; FSDP2 frees by resizing storages
        from graphs.distributed import RankMemoryTracker, rank_tensors

        a, k = split_inputs(example_inputs)
        judge = RankMemoryTracker(rank_tensors(module, extra=list(a) + list(k.values())))
        untracked = report.untracked_bytes or 0
    else:
        judge = AllocatorPeak(module, example_inputs)
        untracked = untracked_bytes(report.graph)
    with judge:
        out = _call(module, example_inputs)  # held during backward, as a training loop does
        loss_fn(out).backward()
        del out
    return int(judge.peak_bytes + untracked)


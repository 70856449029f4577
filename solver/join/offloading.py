"""Offload in :func:`solver.optimize` (``offload=True``): the host link measured on the
step's device, the ``offload`` method built on ``auto``'s schedule, and what the report
says about it.

The link is timed with a few copies to the host and back
(:func:`graphs.host_pool.measure_host_bandwidth`, once per device and process), of the
size of the step's largest forward value; the graph's op times are seconds, so the
bandwidth is bytes per second. The ``offload`` method then plans windows on ``auto``'s
sequence among its own bases, and the plan with offloads is taken only where the
simulator grades it cheaper than ``auto``'s: with a slow link it recomputes, with a fast
one it offloads, and per tensor it may do both.
"""

from __future__ import annotations

import logging

import torch

from graphs import ComputeGraph
from graphs.host_pool import measure_host_bandwidth
from graphs.units import format_bytes
from solver.errors import RematError
from solver.methods.offload import offload_summary
from solver.schedule import Schedule
from solver.solving import solve

__all__ = ["graph_device", "link_bandwidth", "offload_note", "reach_by_offload", "with_offload"]

log = logging.getLogger(__name__)

_MEASURED: dict[str, float] = {}  # device -> bytes per second
_MIN_BYTES, _MAX_BYTES = 2**20, 64 * 2**20


def graph_device(graph: ComputeGraph) -> torch.device:
    """The device of a captured step (that of its first tensor input; CPU if none).

    Examples
    --------
    >>> graph_device(ComputeGraph())
    device(type='cpu')
    """
    info = graph.capture_info
    for t in getattr(info, "flat_inputs", None) or []:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def link_bandwidth(graph: ComputeGraph) -> float:
    """Host-link bytes per second of the step's device, measured once per device.

    Examples
    --------
    >>> link_bandwidth(ComputeGraph()) > 0
    True
    """
    device = graph_device(graph)
    key = str(device)
    if key not in _MEASURED:
        largest = max((int(graph[v]["bytes"]) for v in graph.ops if graph[v]["phase"] == "forward"), default=0)
        nbytes = min(_MAX_BYTES, max(_MIN_BYTES, largest))
        _MEASURED[key] = measure_host_bandwidth(device, nbytes=nbytes)
        log.info("host link of %s: %.3g GB/s (copies of %s)", key, _MEASURED[key] / 1e9, format_bytes(nbytes))
    return _MEASURED[key]


def with_offload(graph: ComputeGraph, schedule: Schedule, budget: int, *,
                 time_limit: float | None = None) -> Schedule:
    """The ``offload`` method's plan on ``schedule``'s sequence (and its own bases) at
    the measured link, when the simulator grades it cheaper than ``schedule``; else
    ``schedule``.

    Examples
    --------
    >>> from solver import simulate, solve
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4)
    >>> s = solve(g, simulate(g, g.order).peak_bytes, method="store_all")
    >>> with_offload(g, s, s.peak_bytes) is s     # no recomputation to save
    True
    """
    if not schedule.extra_cost > 0:
        return schedule
    bandwidth = link_bandwidth(graph)
    try:
        planned = solve(graph, budget, method="offload", bandwidth=bandwidth, time_limit=time_limit,
                        bases=[schedule.sequence])
    except (RematError, ValueError) as exc:
        log.info("offload found no plan cheaper than %s: %s", schedule.method, exc)
        return schedule
    if not planned.offloads or not planned.cost < schedule.cost:
        return schedule
    planned.budget_bytes = budget
    planned.info["link_bandwidth"] = bandwidth
    return planned


def reach_by_offload(graph: ComputeGraph, budget: int, *, time_limit: float | None = None) -> Schedule | None:
    """The ``offload`` method's plan within ``budget`` at the measured link, for a budget
    that no recomputation reaches; None where offload reaches none either.

    Values leave for the host in the reference order's forward and come back before
    their backward readers (``mode="offload"``): a plan of a budget below what any
    recomputing schedule holds, whatever its link time.

    Examples
    --------
    >>> from solver import simulate
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(6, fwd_bytes=10)
    >>> simulate(g, g.order).peak_bytes
    71
    >>> plan = reach_by_offload(g, 60)
    >>> bool(plan.offloads), plan.peak_bytes <= 60
    (True, True)
    >>> reach_by_offload(g, 45) is None
    True
    """
    bandwidth = link_bandwidth(graph)
    try:
        planned = solve(graph, budget, method="offload", bandwidth=bandwidth, mode="offload", time_limit=time_limit)
    except (RematError, ValueError) as exc:
        log.info("offload reaches no plan within %s either: %s", format_bytes(budget), exc)
        return None
    planned.budget_bytes = budget
    planned.info["link_bandwidth"] = bandwidth
    return planned


def offload_note(graph: ComputeGraph, schedule: Schedule) -> str:
    """The report's line about a schedule's offloads: values and bytes moved, the link,
    its time and how much of it hides behind compute (the simulator's figures).

    Examples
    --------
    >>> from solver.schedule import Offload
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=10)
    >>> offload_note(g, Schedule(list(g.order), offloads=[Offload("f0", 0, 7)], bandwidth=10.0))
    'offload: 1 values (10 B) to the host and back over a link of 1e-08 GB/s; link time 2 s, 100 % of it hidden behind compute'
    """
    s = offload_summary(graph, schedule)
    return (f"offload: {s['offloads']} values ({format_bytes(s['offloaded_bytes'])}) to the host and back over a "
            f"link of {schedule.bandwidth / 1e9:.3g} GB/s; link time {s['link_time']:.3g} s, "
            f"{100 * s['hidden_fraction']:.0f} % of it hidden behind compute")

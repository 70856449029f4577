"""What planning does not wait for: the timed search for the lowest peak runs neither
to pick the schedule a step is measured in (where an eviction pass reaches the target)
nor for the report's smallest-feasible figure (made when it is read)."""

from __future__ import annotations

import torch

import solver
from examples import models
from solver.join.checks import Session
from solver.join.planning import MEASURE_MARGIN, Request, capture_step, lowest_peak_sequence, plan_graph
from solver.methods import minpeak
from solver.report import Report
from solver.solving import reached_floor
from solver.synthetic import training_chain


def _counted(monkeypatch) -> list:
    calls: list = []
    search = minpeak.smallest_feasible_peak

    def counted(graph, **kw):
        calls.append(graph)
        return search(graph, **kw)

    monkeypatch.setattr(minpeak, "smallest_feasible_peak", counted)
    return calls


def test_the_measuring_schedule_is_found_without_the_timed_search(monkeypatch):
    g = training_chain(24)
    store_all = solver.simulate(g, g.order).peak_bytes
    found = minpeak.smallest_feasible_peak(g, time_limit=5.0)[0]
    calls = _counted(monkeypatch)
    target = int((found + store_all) / 2 / MEASURE_MARGIN)
    seq = lowest_peak_sequence(g, target=target)
    assert calls == []
    result = solver.simulate(g, seq)
    assert result.valid and result.peak_bytes <= MEASURE_MARGIN * target
    # below what any pass reaches, the search's own schedule
    seq = lowest_peak_sequence(g, target=found // 2)
    assert len(calls) == 1
    assert solver.simulate(g, seq).peak_bytes <= solver.simulate(g, g.order).peak_bytes


def test_the_reports_smallest_feasible_figure_is_searched_when_read(monkeypatch):
    torch.manual_seed(0)
    model, inputs = models.gpt(n_layer=3, d=32, n_head=2, seq=16, batch=2)
    request = Request(mode="graph", budget=2**40, measure_time=False)
    cap = capture_step(model, inputs, {}, request=request)
    calls = _counted(monkeypatch)
    session = Session()
    plan_graph(cap=cap, request=request, session=session, method="auto")
    assert calls == []
    report = session.report
    figure = report.smallest_feasible_bytes
    assert len(calls) == 1 and calls[0] is cap.graph
    assert figure <= min(reached_floor(cap.graph), report.predicted_peak_bytes)
    assert report.smallest_feasible_bytes == figure and len(calls) == 1  # searched once
    assert report.to_dict()["smallest_feasible_bytes"] == figure
    assert "_deferred" not in report.to_dict()


def test_a_deferred_figure_is_in_the_dict_and_text_of_a_report():
    r = Report(mode="graph", method="auto", budget_bytes=100, predicted_peak_bytes=80, store_all_peak_bytes=120,
               smallest_feasible_bytes=80, predicted_overhead=0.0, gap=None, solve_seconds=0.0,
               capture_seconds=0.0, decisions="")
    r.defer("smallest_feasible_bytes", lambda: 64)
    assert r.to_dict()["smallest_feasible_bytes"] == 64
    assert "64 B" in str(r)
    try:
        r.no_such_figure
    except AttributeError as exc:
        assert "no_such_figure" in str(exc)
    else:
        raise AssertionError("an unknown attribute was found")

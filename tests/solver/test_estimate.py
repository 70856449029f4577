"""Will-it-fit estimates."""

import pytest

from solver.analytic import TransformerConfig
from solver.estimate import estimate
from solver.policy import LayerAction, build_planner

CFG = TransformerConfig(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32000, seq_len=2048,
                        micro_batch=2)
GiB = 1024**3


def test_three_peaks_ordered_and_consistent():
    pl = build_planner(CFG)
    e = estimate(CFG, 6.0)
    assert e.peak_no_remat == pl.policy_of([LayerAction.NONE] * 8, 0).peak_bytes
    assert e.peak_full_remat == pl.policy_of([LayerAction.FULL] * 8, 0).peak_bytes
    assert e.peak_full_remat < e.peak_no_remat
    assert e.fits == (e.peak_best <= e.budget_bytes)
    assert e.fits_no_remat == (e.peak_no_remat <= 6 * GiB)
    assert "best policy" in str(e) and e.to_dict()["fits"] == e.fits


def test_largest_batch_and_seq_are_tight():
    e = estimate(CFG, 6.0)
    assert e.max_micro_batch >= 1 and e.max_seq_len >= 1
    fits = lambda **kw: build_planner(CFG.replace(**kw)).min_peak() <= 6 * GiB
    assert fits(micro_batch=e.max_micro_batch) and not fits(micro_batch=e.max_micro_batch + 1)
    assert fits(seq_len=e.max_seq_len) and not fits(seq_len=e.max_seq_len + 1)


def test_nothing_fits():
    e = estimate(CFG, 0.1)
    assert not e.fits and e.policy is None and e.max_micro_batch == 0 and e.max_seq_len == 0
    assert e.peak_best == build_planner(CFG).min_peak()

"""The runnable examples finish with --quick, print their table and write their PNG."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("script,needle", [("sweep_segments.py", "knee"), ("selective_vs_full.py", "selective"),
                                           ("offload_vs_recompute.py", "break-even")])
def test_example_runs_quick(tmp_path, script, needle):
    pytest.importorskip("matplotlib")
    if script == "selective_vs_full.py":
        pytest.importorskip("transformers")
    out = tmp_path / "plot.png"
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert needle in res.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_sweep_segments_knee_is_interior():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import sweep_segments
    finally:
        sys.path.pop(0)
    rows = sweep_segments.sweep(16)
    best = sweep_segments.knee(rows)
    assert 1 < best["k"] < 16
    assert rows[-1]["peak"] > best["peak"] and rows[0]["peak"] > best["peak"]
    assert rows[0]["extra"] <= best["extra"]  # k=1 keeps every boundary: least recomputation


@pytest.mark.slow
def test_variable_lengths_example_captures_once_with_dynamic_true():
    """The variable-length example, one pass over its five lengths: every setting's
    losses equal the plain model's and every measured step is within the budget;
    ``dynamic=True`` captures once, ``dynamic=False`` once per length."""
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "variable_lengths.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in res.stdout.splitlines() if line.startswith("| "))}
    assert set(rows) >= {"None", "True", "False"}, res.stdout
    for name in ("None", "True", "False"):
        assert rows[name][4] == "True" and float(rows[name][3]) <= 1.0, rows[name]
    assert rows["True"][1].endswith("(1)") and rows["False"][1] == "5 (5)", rows

"""The ``remat`` command line on bad input: one line on stderr, never a traceback."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from solver.cli import main
from solver.synthetic import training_chain

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def graph(tmp_path) -> Path:
    path = tmp_path / "chain.json"
    training_chain(6, fwd_bytes=[4, 8, 8, 4, 6, 2]).save(path)
    return path


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("budget,needle", [("infx", "cannot read budget 'infx'"), ("1e400", "not finite"),
                                           ("nanx", "cannot read budget"),
                                           ("0x", "above 0"), ("0.9", "write 0.9x")])
def test_bad_budgets_are_one_line(capsys, graph, budget, needle):
    rc, out, err = run(capsys, ["solve", str(graph), "--budget", budget])
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_a_small_plain_budget_that_fails_hints_at_the_fraction(capsys, graph):
    rc, out, err = run(capsys, ["solve", str(graph), "--budget", "2"])
    assert rc != 0 and "infeasible" in err and "2x" in err and len(err.strip().splitlines()) == 1


def test_a_bad_time_limit_is_one_line(capsys, graph):
    rc, out, err = run(capsys, ["solve", str(graph), "--budget", "0.8x", "--time-limit", "nan"])
    assert rc != 0 and "time_limit" in err and len(err.strip().splitlines()) == 1


def test_a_factory_that_raises_is_one_line(capsys, tmp_path):
    f = tmp_path / "net.py"
    f.write_text(textwrap.dedent("""
        def make():
            raise RuntimeError("no weights here")
    """))
    rc, out, err = run(capsys, ["plan", f"{f}:make", "--gpu-gb", "1"])
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1 and "RuntimeError: no weights here" in lines[0] and ":make" in lines[0]


@pytest.mark.parametrize("json", [True, False])
def test_a_reader_that_leaves_ends_the_sweep_quietly(graph, json):
    # as `remat sweep ... | head`: the pipe is closed before the output is written
    argv = [sys.executable, "-m", "solver.cli", "sweep", str(graph), "--methods", "chen_sqrt,eviction",
            "--points", "3"] + (["--json"] if json else [])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=120) == 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe ended
    assert err == ""


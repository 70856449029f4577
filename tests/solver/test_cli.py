"""The ``remat`` command line end to end: exit codes, --json, PNG files, one-line errors."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from solver.cli import main
from tests.paths import BENCHMARK_GRAPHS, needs_benchmark_graphs

GRAPHS = BENCHMARK_GRAPHS
VGG = GRAPHS / "VGG16_256_224_224_3_train.json"
LLAMA = ["llama", "--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--ffn", "2816",
         "--vocab", "32000", "--seq", "2048", "--micro-batch", "2", "--dtype", "bf16"]


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_estimate_and_plan_json(capsys):
    rc, out, err = run(capsys, ["estimate", *LLAMA, "--gpu-gb", "24", "--json"])
    assert rc == 0, err
    d = json.loads(out)
    assert d["peak_full_remat"] < d["peak_no_remat"] and d["source"] == "config"
    rc, out, _ = run(capsys, ["plan", *LLAMA, "--gpu-gb", "24", "--json"])
    p = json.loads(out)["policy"]
    assert rc == 0 and len(p["actions"]) == 8 and p["peak_bytes"] <= p["budget_bytes"]


@pytest.mark.parametrize("fmt,key", [("hf", "method"), ("megatron", "recompute_granularity"),
                                     ("deepspeed", "activation_checkpointing"),
                                     ("torchtitan", "activation_checkpoint"), ("sac", "layers")])
def test_plan_exports(capsys, fmt, key):
    rc, out, err = run(capsys, ["plan", *LLAMA, "--gpu-gb", "20", "--format", fmt, "--json"])
    assert rc == 0, err
    assert key in json.loads(out)["export"]["config"]
    rc, out, _ = run(capsys, ["plan", *LLAMA, "--gpu-gb", "20", "--format", fmt])
    assert rc == 0 and "LayerPolicy" in out


def test_plan_factory_file_uses_captured_graph(capsys, tmp_path):
    f = tmp_path / "net.py"
    f.write_text(textwrap.dedent("""
        import torch
        def make():
            torch.manual_seed(0)
            net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
            return net, (torch.randn(32, 64),)
    """))
    rc, out, err = run(capsys, ["plan", f"{f}:make", "--gpu-gb", "1", "--json"])
    assert rc == 0, err
    p = json.loads(out)["policy"]
    assert p["source"] == "graph" and p["blocks"] == ["0", "1", "2"]
    rc, out, err = run(capsys, ["plan", f"{f}:nothing", "--gpu-gb", "1"])
    assert rc != 0 and "no function" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_plan_captured_builds_the_hf_model_on_the_meta_device(capsys):
    pytest.importorskip("transformers")
    rc, out, err = run(capsys, ["plan", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "100",
                                "--seq", "32", "--dtype", "bf16", "--captured", "--gpu-gb", "1", "--json"])
    assert rc == 0, err
    p = json.loads(out)["policy"]
    assert p["source"] == "graph" and len(p["actions"]) == 2 and p["blocks"][0].endswith("h.0")


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "no_such_model", "--gpu-gb", "8"], "unknown model"),
    (["plan", "gpt2", "--captured", "--dtype", "int8", "--gpu-gb", "8"], "--dtype 'int8'"),
    (["estimate", "gpt2", "--gpu-gb", "zero"], "--gpu-gb"),
    (["plan", "gpt2", "--gpu-gb", "0.01", "--seq", "1024"], "infeasible"),
    (["plan", "/nonexistent/model.py:make", "--gpu-gb", "8"], "no such file"),
    (["solve", "/nonexistent/graph.json", "--budget", "1GB"], "no such graph file"),
    pytest.param(["solve", str(VGG), "--budget", "lots"], "cannot read budget", marks=needs_benchmark_graphs),
])
def test_errors_are_one_line(capsys, argv, needle):
    rc, out, err = run(capsys, argv)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


@needs_benchmark_graphs
def test_solve_sweep_show_on_benchmark_graph(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, out, err = run(capsys, ["solve", str(VGG), "--budget", "0.9x", "--method", "eviction", "--json"])
    assert rc == 0, err
    assert json.loads(out)["peak_bytes"] <= 0.9 * json.loads(out)["store_all_peak"] + 1
    csv, js, png = tmp_path / "s.csv", tmp_path / "s.json", tmp_path / "s.png"
    rc, out, err = run(capsys, ["sweep", str(VGG), "--methods", "eviction,chen_sqrt", "--points", "3",
                                "--csv", str(csv), "--out", str(js), "--png", str(png), "--json"])
    assert rc == 0, err
    assert len(json.loads(out)["rows"]) == 6 and csv.read_text().count("\n") == 7
    assert json.loads(js.read_text())["graph"]
    _png_ok(png)
    show = tmp_path / "show.png"
    rc, out, err = run(capsys, ["show", str(VGG), "--budget", "0.9x", "--method", "eviction", "--out", str(show),
                                "--json"])
    assert rc == 0, err
    assert json.loads(out)["png"] == str(show)
    _png_ok(show)


@pytest.mark.slow
def test_console_script_subprocess():
    exe = shutil.which("remat")
    cmd = [exe] if exe else [sys.executable, "-m", "solver.cli"]
    ok = subprocess.run(cmd + ["estimate", *LLAMA, "--gpu-gb", "24", "--json"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "peak_best" in json.loads(ok.stdout)
    bad = subprocess.run(cmd + ["plan", "no_such_model", "--gpu-gb", "8"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr


REPO = Path(__file__).resolve().parents[2]


def _cli(*argv, timeout=300):
    """The CLI in a fresh process, as a script would run it."""
    return subprocess.run([sys.executable, "-m", "solver.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.skipif(not VGG.exists(), reason="benchmark graphs not present")
@pytest.mark.parametrize("method", ["auto", "checkmate_milp"])
def test_json_stdout_is_json_alone(method):
    # auto also runs the HiGHS lower bound, whose banner used to open stdout
    got = _cli("solve", str(VGG), "--budget", "0.9x", "--method", method, "--time-limit", "30", "--json")
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["peak_bytes"] <= 0.9 * out["store_all_peak"] + 1
    assert out["method"] == method or (method == "auto" and out["method"].startswith("auto:"))
    assert "HiGHS" not in got.stderr and "Running" not in got.stderr


def _malformed(tmp_path) -> dict[str, Path]:
    from solver.synthetic import random_training_graph

    files = {}
    files["list"] = tmp_path / "list.json"
    files["list"].write_text(json.dumps([{"id": 0, "out_cost": 4, "duration": 1}]))
    layered = {"directed": True, "multigraph": False, "graph": {"order": [0, 1, 2]},
               "nodes": [{"id": 0, "out_cost": 4, "duration": 1.0}, {"id": 1, "duration": 1.0},
                         {"id": 2, "out_cost": 4, "duration": 1.0}],
               "links": [{"source": 0, "target": 1}, {"source": 1, "target": 2}]}
    files["out_cost"] = tmp_path / "no_out_cost.json"
    files["out_cost"].write_text(json.dumps(layered))
    data = random_training_graph(10, seed=0).to_dict()
    order = data["graph"]["order"]
    data["links"].append({"source": order[-1], "target": order[0]})
    files["cycle"] = tmp_path / "cycle.json"
    files["cycle"].write_text(json.dumps(data))
    return files


@pytest.mark.parametrize("case,needle", [("list", "top level is a list"), ("out_cost", "node 1 has no 'out_cost'"),
                                         ("cycle", "cycle")])
def test_malformed_graph_files_give_one_line(tmp_path, case, needle):
    path = _malformed(tmp_path)[case]
    for argv in (["solve", str(path), "--budget", "0.9x"], ["solve", str(path), "--budget", "0.9x", "--json"]):
        got = _cli(*argv, timeout=60)
        assert got.returncode != 0
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in got.stderr, got.stderr
        if "--json" in argv:
            assert json.loads(got.stdout)["type"] == "GraphFormatError"
        else:
            assert got.stdout == ""

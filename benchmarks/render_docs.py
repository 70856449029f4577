"""Write ``docs/benchmarks.md`` from the runs recorded in ``benchmarks/results/*.json``.

Every table of the benchmarks page is rendered here from the JSON that a benchmark
script wrote, so the page cannot drift from the runs; the prose around the tables lives
in :data:`PAGE`. The zoo, model and GPU tables use the renderers of the scripts that
wrote them (``benchmarks/graphs.py``, ``benchmarks/models.py``, ``benchmarks/cuda_check.py``).

Run: ``python benchmarks/render_docs.py`` (writes the page) or
``python benchmarks/render_docs.py --check`` (exit status 1 when the page is not what the
JSON renders to; ``tests/test_docs.py`` runs the check).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGE_PATH = ROOT / "docs" / "benchmarks.md"
MIB = 2**20

#: Short names of the public benchmark graphs, by the start of their file stem.
GRAPH_LABELS = (
    ("MobileNet", "MobileNet"), ("ResNet50", "ResNet50"), ("VGG16", "VGG16"), ("VGG19", "VGG19"),
    ("fcn_8", "FCN8"), ("segnet", "SegNet"), ("vgg_unet", "U-Net"),
    ("random_layered_n1000_", "random n1000"), ("random_layered_n100_", "random n100"),
    ("random_layered_n250_", "random n250"), ("random_layered_n500_", "random n500"),
)


def _script(name: str):
    """A benchmark script loaded as a module under a name that cannot shadow a package
    (``benchmarks/graphs.py`` would shadow ``graphs``)."""
    spec = importlib.util.spec_from_file_location(f"_remat_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(name: str):
    return json.loads((RESULTS / name).read_text())


def _label(stem: str) -> str:
    return next((label for start, label in GRAPH_LABELS if stem.startswith(start)), stem)


def _pct(x: float, digits: int = 3) -> str:
    return f"+{x:.{digits}f} %"


def public_graphs_table() -> str:
    """Per public graph and budget: the cheapest fixed-order schedule of the run of every
    method (``graphs.json``), ``auto`` from its own run (``graphs_auto.json``), its
    proven gap with the bound's scope, and Moccasin's published figure."""
    best: dict = {}
    failed: dict = {}
    for r in _load("graphs.json"):
        key = (r["graph"], r["fraction"])
        if r["method"] == "auto" or r["order"] != "fixed":
            continue
        if r["status"] == "ok":
            cur = best.get(key)
            if cur is None or (round(r["extra_pct"], 3), r["seconds"]) < (round(cur["extra_pct"], 3), cur["seconds"]):
                best[key] = r
        elif r["status"] == "infeasible":
            failed[key] = "infeasible"
        else:
            failed.setdefault(key, "none")
    out = ["| graph @ budget | best fixed order (method, time) | auto | auto picked | auto time | proven gap "
           "| Moccasin |", "|---|---|---|---|---|---|---|"]
    for r in _load("graphs_auto.json"):
        key = (r["graph"], r["fraction"])
        b = best.get(key)
        fixed = f"{_pct(b['extra_pct'])} ({b['method']}, {b['seconds']:.2f} s)" if b else failed.get(key, "none")
        if r["status"] == "ok":
            auto, picked = _pct(r["extra_pct"]), r["picked"].removeprefix("auto:")
            gap = "—" if r.get("gap") is None else f"{100 * r['gap']:.1f} % ({r['bound_scope']})"
        else:
            auto, picked, gap = r["status"], "", "—"
        out.append(f"| {_label(r['graph'])} @{r['fraction']:g} | {fixed} | {auto} | {picked} | "
                   f"{r['seconds']:.2f} s | {gap} | {r['moccasin']} |")
    return "\n".join(out) + "\n"


def zoo_table(name: str) -> str:
    return _script("graphs").zoo_table(_load(name))


def models_table() -> str:
    """``models.json``: allocator peak, resident memory and step time of every variant,
    in the table ``benchmarks/models.py`` writes beside it."""
    data = _load("models.json")
    return _script("models")._fmt(data["rows"], data["store_all_peak"]) + "\n"


def planning_table() -> str:
    data = _load("planning.json")
    out = ["| model | mode | layers | capture s | measure s | solve s | check s | total s | extra compute |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['model']} | {r['mode']} | {r['layers']} | {r['capture_s']:.2f} | {r['measure_s']:.2f} "
                   f"| {r['solve_s']:.2f} | {r['check_s']:.2f} | {r['total_s']:.2f} | {_pct(100 * r['overhead'], 2)} |")
    versions = ", ".join(sorted({r["torch"] for r in data["rows"] if "torch" in r}))
    return "\n".join(out) + f"\n\nRun on torch {versions}; {data['clock']}.\n"


def module_speed_table() -> str:
    """``module_speed.json``: module mode's step time against checkpointing every block."""
    data = _load("module_speed.json")
    mib = 2 ** 20
    out = ["| model | budget | plain | per-block checkpointing | module mode | module / per-block | blocks |",
           "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if r.get("status") != "planned":
            out.append(f"| {r['model']} | {r['budget_bytes'] / mib:.1f} MiB | {r.get('status')} | | | | |")
            continue
        actions = ", ".join(f"{a} x{n}" for a, n in sorted(_counts(r["module_actions"].values()).items()))
        out.append(f"| {r['model']} | {r['budget_bytes'] / mib:.1f} MiB "
                   f"| {1e3 * r['plain_seconds']:.1f} ms, {r['plain_peak_bytes'] / mib:.1f} MiB "
                   f"| {1e3 * r['per_block_seconds']:.1f} ms, {r['per_block_peak_bytes'] / mib:.1f} MiB "
                   f"| {1e3 * r['module_seconds']:.1f} ms, {r['module_peak_bytes'] / mib:.1f} MiB "
                   f"| {r['module_vs_per_block']:.3f}x | {actions} |")
    return "\n".join(out) + f"\n\n{data['clock']}, {data['repeats']} runs after {data['warmup']} warm-up.\n"


def per_block_speed_table() -> str:
    """``per_block_speed.json``: remat's plan against checkpointing every block, per model,
    mode, CUDA-dispatch emulation and budget."""
    data = _load("per_block_speed.json")
    out = ["| model | mode | emulated | budget | status | step peak / budget | predicted error | "
           "planned again | step / per-block |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        budget = f"{r['fraction']}x {'per-block' if r['of'] == 'per_block' else 'plain'}"
        if r.get("status") != "planned":
            meets = "per-block meets it" if r.get("per_block_meets_budget") else "per-block does not meet it either"
            out.append(f"| {r['model']} | {r['mode']} | {r['emulated']} | {budget} | {r.get('status')} ({meets}) "
                       "| | | | |")
            continue
        out.append(f"| {r['model']} | {r['mode']} | {r['emulated']} | {budget} | planned "
                   f"| {r['step_peak_bytes'] / r['budget_bytes']:.3f} | {100 * r['prediction_error']:+.2f} % "
                   f"| {'yes' if r['planned_again'] else 'no'} | {r['remat_vs_per_block']:.2f}x |")
    return "\n".join(out) + f"\n\n{data['clock']}, {data['repeats']} runs after {data['warmup']} warm-up.\n"


def _counts(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def offload_steps_table() -> str:
    """``offload_steps_cpu.json``: real graph-mode steps that offload, on CPU's emulated host."""
    mib = 2 ** 20
    out = ["| budget | plan | predicted peak | measured peak | fits | gradients bitwise | predicted extra compute "
           "| offloaded | link time hidden |", "|---|---|---|---|---|---|---|---|---|"]
    for r in _load("offload_steps_cpu.json")["rows"]:
        if r["status"] != "ok":
            out.append(f"| {r['fraction']:g}x | {r['plan']} | {r['status']} | | | | | | |")
            continue
        out.append(f"| {r['fraction']:g}x | {r['plan']} | {r['predicted_peak_bytes'] / mib:.1f} MiB "
                   f"| {r['measured_peak_bytes'] / mib:.1f} MiB | {'yes' if r['fits'] else 'no'} "
                   f"| {'yes' if r['bitwise'] else 'no'} | {100 * r['predicted_overhead']:.2f} % "
                   f"| {r['offloaded_bytes'] / mib:.1f} MiB | {100 * r['hidden_fraction']:.0f} % |")
    return "\n".join(out) + "\n"


def training_loops_table() -> str:
    """``training_loops.json``: a loop over varying lengths, and planning times."""
    data = _load("training_loops.json")
    out = ["| run | total s | vs plain | plans (captures) | first step at each length s | highest step peak / budget |",
           "|---|---|---|---|---|---|"]
    for r in data["loops"]:
        fit = "" if r.get("max_step_peak_bytes") is None else f"{r['max_step_peak_bytes'] / r['budget_bytes']:.2f}"
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        captures = f" ({r['captures']})" if "captures" in r else ""
        out.append(f"| {r['case']} | {r['total_s']:.2f} | {ratio} | {r['plans']}{captures} | "
                   f"{', '.join(f'{x:g}' for x in r['first_steps_s'])} | {fit} |")
    out += ["", f"Planning time of `optimize()` with example inputs at half of store-all (goal: "
                f"{data['goal_plan_s']:g} s; the parts are wall seconds):", "",
            "| model | mode | total s | capture s | measure s | solve s | check s |", "|---|---|---|---|---|---|---|"]
    for r in data["planning"]:
        out.append(f"| {r['model']} | {r['mode']} | {r['total_s']:.2f} | {r['capture_s']:.2f} | {r['measure_s']:.2f} "
                   f"| {r['solve_s']:.2f} | {r['check_s']:.2f} |")
    return "\n".join(out) + f"\n\nRun on torch {data['torch']}; {data['clock']}.\n"


def capture_table() -> str:
    out = ["| case | nodes | capture + annotation | goal | peak host memory | torch |", "|---|---|---|---|---|---|"]
    for r in _load("capture.json"):
        out.append(f"| {r['case']} | {r['nodes']:,} | {r['seconds']:.1f} s | {r['goal_s']:g} s | "
                   f"{r['peak_rss_mib']:.0f} MiB | {r['torch']} |")
    return "\n".join(out) + "\n"


def offload_table() -> str:
    """Extra compute of ``offload`` against recomputation only, per relative bandwidth."""
    data = _load("offload.json")
    bws = data["relative_bandwidths"]
    cells: dict = {}
    for r in data["rows"]:
        cells.setdefault((r["graph"], r["fraction"]), {})[r["relative_bandwidth"]] = r

    def fmt(x: dict) -> str:
        return f"{100 * x['overhead']:.2f} %" if x["status"] == "ok" else x["status"]

    out = ["| graph | budget | recompute only | " + " | ".join(f"{b:g} R" for b in bws) + " |",
           "|---|---|---|" + "---|" * len(bws)]
    for (graph, frac), by in cells.items():
        first = next(iter(by.values()))
        out.append(f"| {_label(graph)} | {frac:g}x | {fmt(first['recompute_only'])} | "
                   + " | ".join(fmt(by[b]["offload"]) if b in by else "" for b in bws) + " |")
    return "\n".join(out) + "\n"


def gpu_tables(name: str) -> str:
    cuda = _script("cuda_check")
    data = _load(name)
    return (f"Device and torch: {data['header']}.\n\n" + cuda.dropin_table(data["dropin"]) + "\n\n"
            + cuda.table(data["rows"]) + "\n")


def zoo_summary(name: str, limit: float = 10.0) -> str:
    """How many cells of a zoo run ``auto`` closed within a proven 10 %, computed from the
    JSON (the first run of each cell, with the zoo's time limit)."""
    cells, within, infeasible, slowest = 0, 0, 0, 0.0
    for r in _load(name):
        if r["method"] != "auto" or r.get("long"):
            continue
        cells += 1
        slowest = max(slowest, r["seconds"])
        if r["status"] == "infeasible":
            infeasible += 1
        elif r["status"] == "ok" and r.get("gap") is not None and r["gap"] <= 0.10:
            within += 1
    infeasible_text = f"; the other {infeasible} are proven infeasible" if infeasible else ""
    return (f"**With {limit:g} s, `auto` is within a proven 10 % in {within} of the {cells - infeasible} cells "
            f"that have a schedule**{infeasible_text}; it took {slowest:.1f} s at most.")


#: The page: prose, and ``{{name}}`` where a rendered table goes (see :data:`TABLES`).
PAGE = """\
# Benchmarks

<!-- Generated by `python benchmarks/render_docs.py` from benchmarks/results/*.json: edit the
script, not this page. -->

Every table on this page is rendered from the JSON a benchmark script wrote into
`benchmarks/results/`; each section gives the command that wrote it. The CPU runs were
made on a 2-core machine shared with other work, one thread per process. Extra compute is
over store-all; a *proven gap* is the distance from the schedule to a proven lower bound,
as a share of the extra compute, and its *scope* says which schedules the bound covers:
"fixed order" the schedules that keep the reference order of first computations
(`solver.bounds.fixed_order_bound`), "free order" every schedule
(`solver.bounds.free_order_bound`). Where no bound proves more, the gap is 100 %: the
store-all cost is the only bound. "infeasible" means the budget is below a proven lower
bound on the peak (the error names it and the smallest peak reached); "none" means no
schedule within the time limit.

## Public graphs: against the published optima

`python benchmarks/graphs.py --time-limit 4 --large-time-limit 60` runs every method on
every graph of Checkmate and Moccasin (`../shared/benchmarks/graphs`) at 0.9x and 0.8x of
the reference-order peak (`graphs.json`); the `auto` columns are from
`python benchmarks/graphs.py --methods auto --time-limit 4 --large-time-limit 60`
(`graphs_auto.json`). Every schedule is graded by the simulator. Moccasin's figures and
times are its reference implementation's, on the same kind of machine.

{{public_graphs}}
`auto` reorders where that pays: the random layered graphs of 100 and 250 ops reach zero
extra compute, proven optimal in any order. On the large random graphs the gap stays open
within 60 s. The full table of every method is `benchmarks/results/graphs.md`.

## Captured models: schedules with a proven gap

`python benchmarks/graphs.py --zoo-only` captures each model of the zoo on this machine
(random weights, op times measured on its CPU, so the graphs and the figures move a
little from run to run; `--zoo-save DIR` keeps the captures and `--zoo-load DIR` solves
them again) and solves its step at 0.7x, 0.5x and 0.3x of the store-all peak, each method
with `time_limit=10`; where `auto` leaves a cell above a proven gap of 10 %, it runs
again with 60 s (`--zoo-long-limit`, the "longer limit" column). The graphs are the steps
as `solver.optimize` plans them: random ops (dropout) may run again, their generator
states kept (`--zoo-masks-held` captures each mask computed once and held). Times are
wall-clock: `auto` runs its last bound in a second thread beside its search.

{{zoo}}
{{zoo_summary}} The 0.3x cells of the language models sit near the line and move with
the capture, since op times are measured on each run. A budget below what one op alone
needs is refused before any method runs, and the error names the bound.

With the masks held (`--zoo-masks-held`, `capture`'s own graph, where each dropout mask is
drawn once and held for its backward), GPT 0.3x is proven infeasible (< 0.326x; 0.338x
reached) by the bound on what ops that run once hold, and HF GPT-2 0.3x lies 1.8 % above
the smallest peak found. `solver.optimize` replays the masks, so the table above measures
the problem it solves: it plans the quickstart's GPT in graph mode within 0.30x of its
store-all peak.

**32 layers.** `python benchmarks/graphs.py --zoo-large` runs the same table on two
32-layer captures (d=64, seq 64, batch 4), with the methods that find something at that
size in seconds (`zoo_large.json`):

{{zoo_large}}
{{zoo_large_summary}}

## Real models: remat against PyTorch's own tools

`python benchmarks/models.py --quick --fractions 0.7,0.5,0.3` (`models.json`; the full
run adds the `torch.compile` variants). Each variant runs in two fresh processes, one
thread each. The first times it against a fresh copy of the plain model, stepped in turn
(7 pairs after 2 warm-ups): "step time vs eager" is the median process CPU time over the
plain model's (the `eager` row times two copies of the plain model, so its ratio shows the
noise). The second measures resident memory. "fits" judges the allocator's peak against
the budget, a fraction of the store-all peak. "predicted" is the plan's peak and step-time
ratio. GPT-style: 8 layers, d=256, seq 256, batch 8; ResNet-style: 4 blocks, width 32,
64x64, batch 16; U-Net-style: depth 3, width 16, 128x128, batch 8.

{{models}}
In the full run with the `torch.compile` variants (`python benchmarks/models.py`, judged by
the live-tensor tracker), `torch.compile`'s `activation_memory_budget` fitted neither 50 %
nor 30 % on the GPT, nor any budget on the ResNet. On the GPT at 100 / 70 / 50 / 30 % of
store-all, graph mode ran at 1.00x / 1.01x / 1.06x / 1.17x the plain step, with inductor
1.00x / 0.95x / 0.99x / 1.22x, and module mode 1.01x / 1.11x / 1.25x / 1.35x; the fastest
peer that fitted was the plain model at 100 %, `checkpoint_sequential` at 70 % (1.21x) and
per-block checkpointing at 50 % and 30 % (1.31x; 1.52x under `torch.compile`). Measured
over predicted step time: graph mode 0.95-1.02, module mode 0.97-1.01.
Module mode has only the model's blocks to choose from: on the ResNet and U-Net it cannot
reach 70 %.

## On a GPU

`python benchmarks/cuda_check.py --dropin --deadline 380` on one NVIDIA H200, with the
machine's own torch, below the supported range (`REMAT_ALLOW_UNTESTED_TORCH=1`), and
transformers 5.17 (`cuda_check_rerun.json`). Budgets are fractions of the plain step's
allocator peak; MiB by the allocator. The drop-in table runs two training steps, seeded
alike, against two copies of the original. "fits" asks that planning's own runs and the
two real steps all peak within the budget: where it says NO, the real steps fit and
planning went over (0.5-3.0 MiB, graph mode on HF GPT-2 and Llama).

{{gpu}}
An earlier run of the same script is kept in `cuda_check.json`, `cuda_dropin.json` and
`cuda_check_fixed.json`. Not measured on a GPU: torch 2.13-2.15, more than one GPU,
offload's bandwidth model.

## Offload

`python benchmarks/offload.py --quick` (`offload.json`): extra compute of the `offload`
method against recomputation only, as the host bandwidth grows (R is the graph's total
bytes over its total time).

{{offload}}
Real steps, `python benchmarks/offload.py --steps` (`offload_steps_cpu.json`): a GPT-style
model's graph-mode step at a fraction of its store-all peak, recomputing only, offloading
only and both (`optimize(offload=True)` plans the joint one), on CPU with the host emulated
outside the allocator (`graphs.host_pool`); the link's bandwidth is measured by a few
copies, so on CPU it hides behind compute by construction. Not run on a GPU.

{{offload_steps}}
## Module mode against checkpointing every block

`python benchmarks/module_speed.py` (`module_speed.json`): HF Llama and GPT-2 built from
their configs (4 layers, hidden 64 and 256, random weights), `optimize(mode="module")` at
0.7 of the plain step's peak against non-reentrant `torch.utils.checkpoint` on every
block, step time and allocator peak of each (goal: module mode no slower than
per-block checkpointing).

{{module_speed}}
`python benchmarks/per_block_speed.py` (`per_block_speed.json`): the per-block zoo of
`tests/solver/test_per_block_zoo.py` (random weights), both modes, CUDA's dispatch
emulated on the CPU or not, at 1.02x and 1.10x of per-block checkpointing's allocator
peak and at 0.7 of the plain step; the step's allocator peak against the budget, the
prediction's error, and process CPU time against per-block checkpointing's (interleaved).

{{per_block_speed}}
Where module mode's plan checkpoints every block (the GPT at 1.02x and 1.10x) its step
is per-block checkpointing's own, so the time ratio there is this machine's noise: the
GPT with CUDA's dispatch emulated, measured again alone with `--repeats 15`, gave 0.997x
and 1.003x where the whole run gave 1.00x and 1.07x.

## Capture

`python benchmarks/capture.py` (one thread, a fresh process per case, weights never
allocated; `capture.json`):

{{capture}}
## Planning time

`python benchmarks/planning.py` (`planning.json`): a tiny HF Llama built from its config
(hidden 64, 4 heads, seq 128, batch 4, random weights), `solver.optimize(..., mode=mode)`
at half the store-all peak of its captured step; process CPU time, one thread, a fresh
process per row. The four parts are the report's planning line (`check` is the rewrite,
its gradient check and the measured steps). From 6 layers on, both modes capture and
measure four layers and write the whole step from them (`graphs.repeated`).

{{planning}}
## Training loops

`python benchmarks/training_loops.py` (`training_loops.json`): an HF Qwen2 built from its
config (hidden 128, 4 layers, batch 8, random weights) fed 50 steps whose sequence lengths
cycle through 96, 64, 128, 80, 112, planned lazily on its first call at half of the plain
step's peak at the longest length; every case in a fresh process, one thread (goal: at
most 1.3x the plain model's time, planning included; not met).

{{training_loops}}
Graph mode (the default, `dynamic=None`) captures the step twice: on the first call, and
on the family's first call at new sizes with the dimensions that differ symbolic (5.0 s
with its plan and check); the length 128, which none of the family's plans fit, is
solved on that capture (0.75 s, no capture), and the other lengths run its plans
(0.1 s); that plan solved in 0.13 s once `auto` stopped at 0.1 % of the step's
compute (2.3 s before, for the 6.9 s of an earlier run). With `dynamic=True` the first call is captured with every size symbolic
(5.6 s with its plan and check, about 2x the default's first call) and no other length
is captured: 128 is solved in 0.95 s, within the goal for a new shape (3x the plain
step plus 2 s: 2.2 s), the others run its plans. Before symbolic captures, graph mode
captured every new length (about 2 s each; the `dynamic=False` row). The same code's
runs on one machine vary by about 10 %, and machines differ (the plain loop took 3.11 s
on the one of an earlier run, 2.36-2.42 s here). With more lengths the symbolic capture
pays more: side by side, 50 steps over 14 lengths (24 to 128) took 41.4 s capturing
every length and 28.0 s with the default's symbolic capture (5 lengths: 22.5 s and
20.2 s; process CPU time, `python benchmarks/training_loops.py`'s model and budget).
"""

#: What each ``{{name}}`` of :data:`PAGE` renders to.
TABLES = {
    "public_graphs": public_graphs_table,
    "zoo": lambda: zoo_table("zoo.json"),
    "zoo_summary": lambda: zoo_summary("zoo.json"),
    "zoo_large": lambda: zoo_table("zoo_large.json"),
    "zoo_large_summary": lambda: zoo_summary("zoo_large.json"),
    "models": models_table,
    "gpu": lambda: gpu_tables("cuda_check_rerun.json"),
    "offload": offload_table,
    "offload_steps": offload_steps_table,
    "module_speed": module_speed_table,
    "per_block_speed": per_block_speed_table,
    "training_loops": training_loops_table,
    "capture": capture_table,
    "planning": planning_table,
}


def render() -> str:
    """The benchmarks page, rendered from the JSON results.

    Examples
    --------
    >>> render().startswith("# Benchmarks")
    True
    """
    page = PAGE
    for name, fn in TABLES.items():
        page = page.replace("{{" + name + "}}", fn())
    return page


def is_current(path: pathlib.Path = PAGE_PATH) -> bool:
    """Whether ``path`` holds what :func:`render` gives now."""
    return path.exists() and path.read_text() == render()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is not up to date")
    args = ap.parse_args(argv)
    if args.check:
        if is_current():
            return 0
        print(f"{PAGE_PATH} is not what benchmarks/results/*.json render to: run python benchmarks/render_docs.py",
              file=sys.stderr)
        return 1
    PAGE_PATH.write_text(render())
    print(f"wrote {PAGE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

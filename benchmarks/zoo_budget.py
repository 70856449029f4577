"""``solver.optimize()`` on a zoo of vision and language models at 0.7 and 0.5 of the
plain step's peak, judged from outside.

Models: torchvision's ResNet18, a small ConvNeXt (torchvision's ``ConvNeXt`` built from
a block setting of 1, 1, 2, 1 blocks of 24 to 192 channels), EfficientNet-B0 and a
small ``VisionTransformer`` (64x64 images, patches of 8, 4 layers, hidden 128, MLP 256),
each with 10 classes, random weights, batch 8 at 64x64 (ResNet18: batch 16 at 112x112;
EfficientNet: 96x96) when torchvision is importable; else the models of torchvision's structure
rebuilt in ``tests/graphs/torchvision_like.py`` (the table says which ran). Hugging Face
``BertForMaskedLM``, ``Qwen2ForCausalLM`` and ``T5ForConditionalGeneration`` from small
configs (hidden 128, 2 layers of each stack, 4 heads, vocabulary 1024, batch 4 of 64
tokens, the labels the inputs).

Per model and fraction, in a fresh process on one thread (at most 600 s) with an
allocation counter that planning does not own preloaded (``tests/solver/c10_allocations.c``: the bytes the c10 CPU
allocator holds, read around each call): the plain step's peak (the project's judge,
:class:`graphs.memory.AllocatorPeak`, which the budgets are fractions of, and the
counter's) and gradients; then per fraction, ``solver.optimize(model, budget)`` in the
default mode (``auto``), counted from its start to its return; where it refuses the
budget (``InfeasibleBudget``), again at the smallest feasible budget it names, counted
likewise; then the first real step of the returned module, counted, and its
gradients against the plain model's (the same random seed in both steps). A case holds
when both counted peaks are within the budget used and every gradient matches
(``torch.allclose``, rtol 1e-4, atol 1e-6).

``tests/solver/test_zoo_budget.py`` runs the same cases on the rebuilt models at the
sizes of :data:`TEST_SIZES`, one fraction per model.

Run: ``python benchmarks/zoo_budget.py [--models resnet18,bert] [--fractions 0.7,0.5]
[--rebuilt] [--out PATH]``. Prints a Markdown table and writes
``benchmarks/results/zoo_budget_torch<version>[_torchvision].json`` after each case (a run of
some models replaces their cases in that file and keeps the others).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MIB = 2**20

VISION = ("resnet18", "convnext", "efficientnet", "vit", "convnext_wide")
HF = ("bert", "qwen2", "t5")
MODELS = VISION + HF
FRACTIONS = (0.7, 0.5)

#: what the benchmark builds: per vision model (image side, batch); the language models'
#: config sizes and (batch, tokens)
BENCH_SIZES: dict[str, Any] = dict(resnet18=(112, 16), convnext=(64, 8), convnext_wide=(64, 8), efficientnet=(96, 8), vit=(64, 8),
                                   hf=dict(hidden=128, layers=2, ff=256, vocab=1024, positions=128, batch=(4, 64)))
#: the smaller sizes of ``tests/solver/test_zoo_budget.py`` (rebuilt vision models)
TEST_SIZES: dict[str, Any] = dict(resnet18=(64, 4), convnext=(64, 4), convnext_wide=(64, 8), efficientnet=(32, 8), vit=(32, 8),
                                  hf=dict(hidden=64, layers=2, ff=128, vocab=256, positions=64, batch=(4, 32)))


def torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def vision_model(name: str, *, source: str, scale: str):
    """``name`` from torchvision (``source="torchvision"``) or rebuilt in
    ``tests/graphs/torchvision_like.py`` (``"rebuilt"``); ``scale`` ``"bench"`` or
    ``"test"`` picks the rebuilt models' sizes."""
    if source == "torchvision":
        import torchvision.models as tvm
        from torchvision.models.convnext import CNBlockConfig

        if name == "resnet18":
            return tvm.resnet18(num_classes=10)
        if name in ("convnext", "convnext_wide"):
            setting = [CNBlockConfig(24, 48, 1), CNBlockConfig(48, 96, 1), CNBlockConfig(96, 192, 2),
                       CNBlockConfig(192, None, 1)]
            return tvm.ConvNeXt(setting, num_classes=10)
        if name == "efficientnet":
            return tvm.efficientnet_b0(num_classes=10)
        image = BENCH_SIZES["vit"][0] if scale == "bench" else TEST_SIZES["vit"][0]
        return tvm.VisionTransformer(image_size=image, patch_size=8, num_layers=4, num_heads=4, hidden_dim=128,
                                     mlp_dim=256, num_classes=10)
    from tests.graphs import torchvision_like as tv

    if name == "resnet18":
        return tv.resnet18(width=4 if scale == "test" else 8)
    if name == "convnext":
        return tv.convnext()
    if name == "convnext_wide":  # torchvision's widths: the depthwise backward's workspace is most of the step
        return tv.convnext(dims=(24, 48, 96, 192))
    if name == "efficientnet":
        return tv.efficientnet()
    image = BENCH_SIZES["vit"][0] if scale == "bench" else TEST_SIZES["vit"][0]
    return tv.vit(num_layers=2, image_size=image) if scale == "test" else tv.vit(image_size=image)


def hf_model(name: str, sizes: dict):
    import transformers as tr

    d, n, ff = sizes["hidden"], sizes["layers"], sizes["ff"]
    small = dict(vocab_size=sizes["vocab"], num_attention_heads=4, max_position_embeddings=sizes["positions"])
    if name == "bert":
        return tr.BertForMaskedLM(tr.BertConfig(hidden_size=d, num_hidden_layers=n, intermediate_size=ff, **small))
    if name == "qwen2":
        return tr.Qwen2ForCausalLM(tr.Qwen2Config(hidden_size=d, num_hidden_layers=n, intermediate_size=ff,
                                                  num_key_value_heads=2, use_cache=False, **small))
    return tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=sizes["vocab"], d_model=d, d_kv=d // 4, d_ff=ff,
                                                     num_layers=n, num_heads=4, decoder_start_token_id=0,
                                                     pad_token_id=0, use_cache=False))


def make_case(name: str, *, source: str, scale: str) -> tuple[Any, Any, Callable | None]:
    """``(model, inputs, loss_fn)``: a vision model's images and its cross-entropy, or a
    language model's token ids as inputs and labels (its own loss, ``loss_fn`` None)."""
    import torch
    import torch.nn.functional as F

    sizes = BENCH_SIZES if scale == "bench" else TEST_SIZES
    if name in HF:
        model = hf_model(name, sizes["hf"])
        ids = torch.randint(0, sizes["hf"]["vocab"] // 2, sizes["hf"]["batch"])
        return model, {"input_ids": ids, "labels": ids}, None
    side, batch = sizes[name]
    model = vision_model(name, source=source, scale=scale)
    x, y = torch.randn(batch, 3, side, side), torch.randint(0, 10, (batch,))
    return model, (x,), lambda out: F.cross_entropy(out, y)


def step(model, inputs, loss_fn) -> None:
    """One training step's forward, loss and backward, with the random generators
    seeded alike for every model it runs (the same dropout masks)."""
    import torch

    torch.manual_seed(7)
    if isinstance(inputs, dict):
        out = model(**inputs)
        out.loss.backward()
    else:
        out = model(*inputs)
        loss_fn(out).backward()
    del out


def _counter():
    import ctypes

    lib = ctypes.CDLL(None)
    lib.c10count_current.restype = lib.c10count_peak.restype = ctypes.c_longlong
    return lib


def counted(fn: Callable[[], Any], resident: int) -> tuple[Any, int]:
    """``fn()`` and the preloaded counter's peak during it above its start, plus
    ``resident`` (what the model and inputs hold, allocated before the count)."""
    lib = _counter()
    start = lib.c10count_current()
    lib.c10count_reset()
    out = fn()
    return out, lib.c10count_peak() - start + resident


def row_at(model, inputs, loss_fn, frac: float, plain_peak: int, grads: dict) -> dict:
    """``solver.optimize()`` at ``frac`` of the plain step, counted (where refused, at the
    smallest feasible budget named, counted again); the first real step, counted; the
    gradients it gives against the plain model's. An error past the refusal is the
    row's ``error``."""
    import torch

    import solver
    from graphs.memory import resident_bytes
    from graphs.units import GiB

    for p in model.parameters():
        p.grad = None
    budget = int(frac * plain_peak)
    resident = resident_bytes(model, inputs)
    options = dict(measure_time=False, loss_fn=loss_fn)
    row: dict[str, Any] = dict(frac=frac, budget=budget)

    def optimize(at: int) -> tuple[Any, Any]:
        """The returned module or the refusal, and the call's counted peak."""
        def call():
            try:
                return solver.optimize(model, at / GiB, inputs, **options)
            except solver.InfeasibleBudget as exc:
                return exc

        t0 = time.perf_counter()
        out, peak = counted(call, resident)
        row["seconds"] = round(row.get("seconds", 0.0) + time.perf_counter() - t0, 1)
        return out, peak

    try:
        fast, row["planning"] = optimize(budget)
        # a refusal's counted peak kept; planned at the budget it names (a refusal before
        # capture, BelowResident, names a lower bound: the next one names what works)
        for _ in range(2):
            if not isinstance(fast, solver.InfeasibleBudget):
                break
            row["refused_planning"] = max(row.get("refused_planning", 0), row["planning"])
            row["named"] = budget = fast.smallest_feasible_bytes
            fast, row["planning"] = optimize(budget)
        if isinstance(fast, Exception):
            raise fast
        row.update(used=budget, report=fast.report.planning_peak_bytes, mode=fast.report.mode,
                   method=fast.report.method, notes=list(fast.report.notes))
        _, row["step"] = counted(lambda: step(fast, inputs, loss_fn), resident)
    except Exception as exc:  # past a refusal: what the case could not do
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return row
    named = dict(model.named_parameters())
    given = {n for n, p in named.items() if p.grad is not None}
    row["differ"] = [n for n in sorted(given & set(grads))
                     if not torch.allclose(named[n].grad, grads[n], rtol=1e-4, atol=1e-6)] + sorted(given ^ set(grads))
    row["max_grad_diff"] = max((float((named[n].grad - grads[n]).abs().max()) for n in given & set(grads)),
                               default=0.0)
    return row


def case_rows(name: str, fracs: list[float], *, source: str, scale: str) -> dict:
    """One model's rows: its plain step measured, then :func:`row_at` per fraction."""
    import copy

    import torch

    from graphs.memory import AllocatorPeak, resident_bytes

    torch.manual_seed(0)
    model, inputs, loss_fn = make_case(name, source=source, scale=scale)
    model.train()
    plain = copy.deepcopy(model)
    with AllocatorPeak(plain, inputs) as judge:
        _, plain_counted = counted(lambda: step(plain, inputs, loss_fn), resident_bytes(plain, inputs))
    grads = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    del plain
    return dict(model=name, source=source if name in VISION else "transformers", plain=judge.peak_bytes,
                plain_counted=plain_counted, params=sum(p.numel() for p in model.parameters()),
                rows=[row_at(model, inputs, loss_fn, f, judge.peak_bytes, grads) for f in fracs])


def child(*, source: str, scale: str) -> None:
    """The child process's entry: ``argv[1]`` the model, ``argv[2]`` the fractions
    (comma-separated); prints ``ROW`` and the case as JSON."""
    import torch

    torch.set_num_threads(1)
    name, fracs = sys.argv[1], [float(f) for f in sys.argv[2].split(",")]
    if source == "auto":
        source = "torchvision" if torchvision_available() else "rebuilt"
    print("ROW " + json.dumps(case_rows(name, fracs, source=source, scale=scale)))


def holds(row: dict) -> bool:
    """Whether a case's row is within its budget with the plain model's gradients."""
    return ("error" not in row and row["planning"] <= row["used"] and row["step"] <= row["used"]
            and not row["differ"])


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MIB:.2f}"


def table(cases: list[dict]) -> str:
    lines = ["| model | source | fraction | budget MiB | plain peak MiB (judge / counter) | outcome | "
             "optimize() peak MiB (counter / report) | real step MiB (counter) | max abs grad diff | mode, method | "
             "optimize() s | holds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        if "error" in case:
            why = case["error"].strip().splitlines()[-1][:200] if case["error"].strip() else "?"
            lines.append(f"| {case['model']} | - | {case.get('frac', '-')} | - | - | crashed: {why} | | | | | | no |")
            continue
        for r in case["rows"]:
            outcome = "planned" if "named" not in r else f"refused, named {_mib(r['named'])}; planned there"
            if "error" in r:
                outcome = ("refused, named " + _mib(r["named"]) + "; " if "named" in r else "") + r["error"][:160]
                lines.append(f"| {case['model']} | {case['source']} | {r['frac']} | {_mib(r['budget'])} | "
                             f"{_mib(case['plain'])} / {_mib(case['plain_counted'])} | {outcome} | | | | | | no |")
                continue
            lines.append(
                f"| {case['model']} | {case['source']} | {r['frac']} | {_mib(r['budget'])} | "
                f"{_mib(case['plain'])} / {_mib(case['plain_counted'])} | {outcome} | "
                f"{_mib(r['planning'])} / {_mib(r['report'])} | {_mib(r['step'])} | {r['max_grad_diff']:.2e} | "
                f"{r['mode']}, {r['method']} | {r['seconds']} | {'yes' if holds(r) else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    from tests.solver.test_planning_peak import _optimize_counted, compile_counter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--rebuilt", action="store_true", help="the rebuilt vision models even where torchvision is")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    source = "rebuilt" if args.rebuilt or not torchvision_available() else "torchvision"
    version = torch.__version__.split("+")[0]
    out = args.out or RESULTS / f"zoo_budget_torch{version}{'_torchvision' if source == 'torchvision' else ''}.json"
    code = f"from benchmarks.zoo_budget import child; child(source={source!r}, scale='bench')"
    tv = None
    if source == "torchvision":
        import torchvision

        tv = torchvision.__version__
    run = dict(torch=torch.__version__, torchvision=tv, python=platform.python_version(), vision_source=source,
               threads=1, sizes=BENCH_SIZES, cases=[])
    if out.exists():  # a run of other models kept: each model's case replaced by this run's
        kept = json.loads(out.read_text())
        if (kept.get("torch"), kept.get("vision_source")) == (run["torch"], source):
            run["cases"] = kept["cases"]
    cases = run["cases"]
    with tempfile.TemporaryDirectory() as tmp:
        counter = compile_counter(pathlib.Path(tmp))
        for name in args.models.split(","):
            for frac in args.fractions.split(","):  # a process per case: each within the child's time limit
                t0 = time.perf_counter()
                try:
                    case = _optimize_counted(counter, name, frac, child=code)
                except (AssertionError, subprocess.TimeoutExpired) as exc:  # the child crashed or ran out of time
                    case = dict(model=name, frac=float(frac), error=str(exc)[-3000:])
                case["wall_seconds"] = round(time.perf_counter() - t0, 1)
                cases[:] = [c for c in cases if (c["model"], c.get("frac", c.get("rows", [{}])[0].get("frac")))
                            != (name, float(frac))] + [case]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(run, indent=1) + "\n")
                print(table([case]).splitlines()[-1], flush=True)
    cases.sort(key=lambda c: (MODELS.index(c["model"]), -c.get("frac", c.get("rows", [{}])[0].get("frac", 0))))
    out.write_text(json.dumps(run, indent=1) + "\n")
    print(table(cases))
    bad = [f"{c['model']}@{r['frac']}" for c in cases for r in c.get("rows", []) if not holds(r)]
    bad += [c["model"] for c in cases if "error" in c]
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}; "
          f"{'every case holds' if not bad else 'NOT holding: ' + ', '.join(bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    if str(ROOT) not in sys.path[:1]:  # the project's packages, not benchmarks/graphs.py
        sys.path.insert(0, str(ROOT))
    sys.exit(main())

"""Training loops as people run them: variable sequence lengths, and planning time.

1. **Variable lengths.** A Hugging Face Qwen2 causal LM from a small config (hidden
   128, 4 layers, 4 heads, 2 key-value heads, MLP 256, vocab 512, about 0.7 M
   parameters, random weights), batch 8, fed 50 steps whose sequence lengths cycle
   through 96, 64, 128, 80, 112 (no padding, no packing), each step forward, loss and
   backward, the gradients dropped before the next. The plain model against
   ``solver.optimize(model, budget)`` planned lazily on its first call (as a training
   loop meets it) at half of the plain step's peak at the longest length, measured by
   the allocator: in graph mode (the default), in module mode, and in graph mode with
   ``dynamic=True`` (the first call captured with its sizes symbolic) and with
   ``dynamic=False`` (a plan per length). Reported: the total time of the 50 steps,
   planning included, against the plain model's; the plans made (solves, the watch's
   replans included) and, of them, those that captured the step (graph mode's plans of
   a family on its symbolic capture capture nothing); the first step at each new length
   (where a plan or a step at new sizes is made); the highest peak the allocator measured of a
   real step (the watch's default: the first step of each plan and of each new size).
   Goal: at most 1.3x the plain model's time.
2. **Planning time.** ``solver.optimize(model, budget, batch)`` with example inputs at
   half of the store-all peak of the captured step, on a ResNet18-like CNN
   (``tests/graphs/torchvision_like.py``, width 16, batch 16, 64x64 images), a BERT
   (``BertForMaskedLM``, hidden 128, 4 layers, seq 128, batch 8) and the Qwen2 above
   (seq 128), in graph mode. Goal: at most 5 s.

Every case runs in a fresh process with ``torch.set_num_threads(1)``; times are process
CPU time.

Run: ``python benchmarks/training_loops.py [--steps 50]``. Prints two Markdown tables
and writes ``benchmarks/results/training_loops.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "training_loops.json"
LENGTHS = (96, 64, 128, 80, 112)
BATCH = 8
GOAL_RATIO = 1.3
GOAL_PLAN_S = 5.0
QWEN2 = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=512, max_position_embeddings=256, use_cache=False)


def _qwen2():
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2)).train()


def _batch(length: int, batch: int = BATCH) -> dict:
    import torch

    ids = torch.randint(0, QWEN2["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def _plain_peak(model) -> int:
    from graphs.memory import measure_peak

    batch = _batch(max(LENGTHS))

    def step():
        model(**batch).loss.backward()

    peak = measure_peak(step, roots=[model]).peak_bytes
    for p in model.parameters():
        p.grad = None
    return int(peak)


def _loop(case: str, steps: int, queue) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    import solver
    import solver.join.planning as planning
    from graphs.memory import settle_open_judges
    from graphs.units import GiB

    plans, captures = [0], [0]
    plan, capture = planning._plan_step, planning.capture

    def counted(*args, **kwargs):
        plans[0] += 1
        return plan(*args, **kwargs)

    def captured(*args, **kwargs):
        captures[0] += 1
        return capture(*args, **kwargs)

    planning._plan_step, planning.capture = counted, captured
    model = _qwen2()
    budget = None
    if case == "plain":
        run = model
    else:
        budget = _plain_peak(model) // 2
        options = {"graph": {}, "module": {"mode": "module"}, "graph, dynamic=True": {"dynamic": True},
                   "graph, dynamic=False": {"dynamic": False}}[case]
        run = solver.optimize(model, budget / GiB, **options)
    batches = {n: _batch(n) for n in LENGTHS}
    firsts, seen = [], set()
    t0 = time.process_time()
    for i in range(steps):
        length = LENGTHS[i % len(LENGTHS)]
        t = time.process_time()
        run(**batches[length]).loss.backward()
        for p in model.parameters():
            p.grad = None
        if length not in seen:
            seen.add(length)
            firsts.append(round(time.process_time() - t, 2))
    total = time.process_time() - t0
    settle_open_judges()
    peaks = [p for s in getattr(run, "remat_steps", {}).values() for p in s.step_peaks]
    report = getattr(run, "report", None)
    queue.put(dict(case=case, steps=steps, total_s=round(total, 2), plans=plans[0], captures=captures[0],
                   first_steps_s=firsts,
                   budget_bytes=budget, max_step_peak_bytes=max(peaks) if peaks else None,
                   measured_steps=len(peaks), mode=getattr(report, "mode", None),
                   notes=list(getattr(report, "notes", []))))


def _planning(name: str, queue) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    import solver
    from graphs.capture import capture
    from graphs.units import GiB
    from solver.methods.minpeak import smallest_feasible_peak

    torch.manual_seed(0)
    if name == "resnet18-like":
        from tests.graphs.torchvision_like import resnet18

        model, batch = resnet18(width=16), (torch.randn(16, 3, 64, 64),)
    elif name == "bert":
        import transformers

        config = transformers.BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=256, vocab_size=2048, max_position_embeddings=256)
        model = transformers.BertForMaskedLM(config).train()
        ids = torch.randint(0, 2048, (8, 128))
        batch = {"input_ids": ids, "labels": ids}
    else:
        model, batch = _qwen2(), _batch(128)
    model.train()
    graph = capture(model, batch if isinstance(batch, tuple) else (), example_kwargs=None if isinstance(batch, tuple)
                    else batch, backward="outputs", measure_time=False)
    store_all = solver.simulate(graph, graph.order).peak_bytes
    # half of store-all, or more where the lowest-peak search's figure (an estimate: the
    # measured workspaces can add to it) is close to that
    budget = min(int(0.9 * store_all), max(store_all // 2, int(1.5 * smallest_feasible_peak(graph)[0])))
    del graph
    t0 = time.process_time()
    fast = solver.optimize(model, budget / GiB, batch)
    total = time.process_time() - t0
    r = fast.report
    queue.put(dict(model=name, budget_bytes=int(budget), store_all_bytes=int(store_all), total_s=round(total, 2),
                   mode=r.mode, method=r.method,
                   capture_s=round(r.capture_seconds, 2), measure_s=round(r.measure_seconds, 2),
                   solve_s=round(r.solve_seconds, 2), check_s=round(r.check_seconds, 2),
                   overhead=r.predicted_overhead, notes=list(r.notes)))


def _guarded(target, args, queue) -> None:
    try:
        target(*args, queue)
    except Exception as exc:  # a row that says what failed, not a parent waiting for ever
        queue.put(dict(error=f"{type(exc).__name__}: {exc}"[:400]))
        raise


def _spawn(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_guarded, args=(target, args, queue))
    proc.start()
    row = queue.get()
    proc.join()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cases", nargs="*",
                    default=["plain", "graph", "module", "graph, dynamic=True", "graph, dynamic=False"])
    ap.add_argument("--models", nargs="*", default=["resnet18-like", "bert", "qwen2"])
    args = ap.parse_args(argv)
    loops = []
    for case in args.cases:
        loops.append({"case": case, **_spawn(_loop, case, args.steps)})
        print(f"{case}: {loops[-1].get('total_s', loops[-1].get('error'))} s", file=sys.stderr)
    plain = next((r["total_s"] for r in loops if r["case"] == "plain"), None)
    loops = [r for r in loops if "error" not in r or print(f"{r['case']}: {r['error']}", file=sys.stderr)]
    for r in loops:
        r["ratio"] = round(r["total_s"] / plain, 2) if plain else None
    planned = []
    for name in args.models:
        planned.append({"model": name, **_spawn(_planning, name)})
        print(f"planning {name}: {planned[-1].get('total_s', planned[-1].get('error'))} s", file=sys.stderr)
    planned = [r for r in planned if "error" not in r or print(f"{r['model']}: {r['error']}", file=sys.stderr)]

    print(f"{args.steps} steps, lengths {', '.join(map(str, LENGTHS))} in turn, batch {BATCH}; "
          f"budget half of the plain step's peak (goal: at most {GOAL_RATIO}x the plain model's time)\n")
    print("| run | total s | vs plain | plans (captures) | first step at each length s | highest step peak / budget |")
    print("|---|---|---|---|---|---|")
    for r in loops:
        fit = "" if r["max_step_peak_bytes"] is None else f"{r['max_step_peak_bytes'] / r['budget_bytes']:.2f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"| {r['case']} | {r['total_s']:.2f} | {ratio} | {r['plans']} ({r.get('captures', '')}) | "
              f"{', '.join(map(str, r['first_steps_s']))} | {fit} |")
    print(f"\nplanning time of optimize() with example inputs, budget half of store-all (goal: {GOAL_PLAN_S} s)\n")
    print("| model | mode | total s | capture s (wall) | measure s (wall) | solve s (wall) | check s (wall) |")
    print("|---|---|---|---|---|---|---|")
    for r in planned:
        print(f"| {r['model']} | {r['mode']} | {r['total_s']:.2f} | {r['capture_s']:.2f} | {r['measure_s']:.2f} "
              f"| {r['solve_s']:.2f} | {r['check_s']:.2f} |")
    import torch

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(goal_ratio=GOAL_RATIO, goal_plan_s=GOAL_PLAN_S, lengths=LENGTHS, batch=BATCH,
                                       qwen2=QWEN2, clock="process CPU time, 1 thread", torch=torch.__version__,
                                       loops=loops, planning=planned), indent=2) + "\n")


if __name__ == "__main__":
    main()

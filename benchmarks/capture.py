"""Capture + annotation time and peak host memory for large models, without their weights.

Run: ``python benchmarks/capture.py``. Writes ``benchmarks/results/capture.json`` and prints
a Markdown table. Goals: HF GPT-2 (12 layers, d=768, seq 1024, fake tensors) under 20 s;
a Llama-shaped config (32 layers, d=4096, seq 4096, meta tensors) under 60 s.
Each case runs in a fresh process so that its RSS high-water mark is its own.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pathlib
import resource
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "capture.json"

CASES = {
    "hf-gpt2 12L d768 seq1024 (fake)": dict(builder="hf_gpt2", mode="fake", goal_s=20.0,
                                             kw=dict(n_layer=12, d=768, n_head=12, seq=1024, batch=1,
                                                     vocab=50257)),
    "llama 32L d4096 seq4096 (meta)": dict(builder="hf_llama", mode="meta", goal_s=60.0,
                                            kw=dict(n_layer=32, d=4096, n_head=32, ffn=11008, seq=4096,
                                                    batch=1, vocab=32000)),
}


def _run(name: str, queue) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from examples import models
    from graphs.capture import capture
    from graphs.torch_internals import FakeTensorMode

    torch.set_num_threads(1)
    case = CASES[name]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        model, inputs = getattr(models, case["builder"])(**case["kw"])
    if case["mode"] == "fake":
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = {k: mode.from_tensor(v) for k, v in inputs.items()}
    t0 = time.perf_counter()
    cg = capture(model, inputs)
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(cg[n]["bytes"] for n in cg.sources if cg[n]["kind"] == "param")
    queue.put(dict(case=name, nodes=len(cg), seconds=round(seconds, 2), goal_s=case["goal_s"],
                   peak_rss_mib=round(rss / 2**20, 1), rss_before_mib=round(rss0 / 2**20, 1),
                   param_gib=round(params / 2**30, 2), saved_gib=round(cg.saved_bytes() / 2**30, 2),
                   torch=torch.__version__))


def main() -> None:
    rows = []
    ctx = mp.get_context("spawn")
    for name in CASES:
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=(name, q))
        p.start()
        rows.append(q.get())
        p.join()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print("| case | nodes | capture+annotate s | goal s | peak RSS MiB | params (not allocated) | saved for bw |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['nodes']} | {r['seconds']} | {r['goal_s']:.0f} | {r['peak_rss_mib']} "
              f"| {r['param_gib']} GiB | {r['saved_gib']} GiB |")


if __name__ == "__main__":
    main()

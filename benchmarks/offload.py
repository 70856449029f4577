"""Offload vs recompute-only: extra cost over store-all as the host bandwidth varies.

For a heterogeneous training chain and one public benchmark graph, at 0.5x-0.9x of the
store-all peak, runs the ``offload`` method (store / recompute / offload) and its
recompute-only ablation (``mode="recompute"``) and prints the extra compute of each.
The benchmark graphs' time unit is arbitrary, so the bandwidth is given relative to the
graph's own ratio ``R = total bytes / total time`` (at ``1x R`` moving every value once
takes as long as the whole step). Every schedule is graded by ``solver.simulate``.

Run: ``python benchmarks/offload.py [--graph NAME] [--quick]``; writes
``benchmarks/results/offload.json``.

Real steps: ``python benchmarks/offload.py --steps`` captures a GPT-style model, measures
the host link with a few copies (:func:`graphs.host_pool.measure_host_bandwidth`), and
at 0.5x and 0.3x of the store-all peak plans recompute-only (``auto``), offload-only
(``offload``, ``mode="offload"``) and the joint plan (``mode="both"``); it runs each one's
graph-mode step and reports the allocator's peak against the budget and the prediction,
whether loss and gradients equal eager's bit for bit, the step time, the bytes
offloaded, the link time and how much of it hides behind compute (predicted by the
simulator, and measured as the plan's step time against the same sequence run without
its offloads). On CPU the host is emulated (NumPy buffers outside the allocator, see
:mod:`graphs.host_pool`): the peaks are the point, not the times. ``--cuda`` runs the
same on one GPU (pinned memory, a side stream) with a larger model; writes
``benchmarks/results/offload_steps_{cpu,cuda}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the library, not benchmarks/graphs.py

from graphs import ComputeGraph  # noqa: E402
from solver import InfeasibleBudget, NoScheduleFound, simulate, solve  # noqa: E402
from solver.synthetic import training_chain  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
GRAPHS = pathlib.Path(os.environ.get("REMAT_BENCHMARK_GRAPHS", ROOT.parent.parent / "shared" / "benchmarks" / "graphs"))
FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9)
RELATIVE_BW = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def _chain() -> ComputeGraph:
    n = 24
    g = training_chain(
        n,
        fwd_bytes=[(1 + (7 * i) % 5) * 2**20 for i in range(n)],
        fwd_time=[1.0 + (3 * i) % 4 for i in range(n)],
    )
    g.name = "training_chain24"
    return g


def _run(g, budget, **kw):
    t0 = time.perf_counter()
    try:
        s = solve(g, budget, time_limit=20, **kw)
    except (NoScheduleFound, InfeasibleBudget) as exc:
        return {"status": type(exc).__name__, "seconds": time.perf_counter() - t0}
    return {
        "status": "ok",
        "overhead": s.overhead,
        "offloads": len(s.offloads),
        "offloaded_bytes": s.info.get("offloaded_bytes", 0),
        "recomputations": simulate(g, s).recomputations,
        "seconds": time.perf_counter() - t0,
    }


def _fmt(r):
    return f"{100 * r['overhead']:7.2f}%" if r["status"] == "ok" else f"{'n/a':>8}"


SIZES = {  # model sizes of the real steps: (CPU, CUDA)
    "cpu": dict(n_layer=4, d=128, n_head=4, seq=128, batch=8, vocab=256),
    "cuda": dict(n_layer=12, d=768, n_head=12, seq=1024, batch=8, vocab=8192),
}


def _real_steps(device: str, *, fractions=(0.5, 0.3), repeats: int = 5, time_limit: float = 30.0) -> list[dict]:
    import statistics

    import torch
    import torch.nn.functional as F

    from examples import models
    from graphs.capture import capture
    from graphs.graph_mode import ScheduledStep
    from graphs.host_pool import host_stats, measure_host_bandwidth, reset_host_stats
    from graphs.loss import charge_loss
    from graphs.memory import AllocatorPeak
    from graphs.rewrite import replay_random_ops
    from solver.methods.offload import offload_summary
    from solver.schedule import Schedule

    size = SIZES["cuda" if device == "cuda" else "cpu"]
    model, (idx, targets) = models.gpt(**size)
    model, idx, targets = model.to(device), idx.to(device), targets.to(device)
    loss_fn = lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def one(run):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(0)
        with AllocatorPeak(model, idx, device=device) as judge:
            out = run()
            loss = loss_fn(out)
            loss.backward()
            del out
        grads = [p.grad.clone() for p in model.parameters()]
        times = []
        for _ in range(repeats):
            for p in model.parameters():
                p.grad = None
            sync()
            t0 = time.perf_counter()
            loss_fn(run()).backward()
            sync()
            times.append(time.perf_counter() - t0)
        for p in model.parameters():
            p.grad = None
        return loss.detach(), grads, judge.peak_bytes, statistics.median(times)

    t0 = time.perf_counter()
    cg = capture(model, (idx,), backward="outputs")
    charge_loss(cg, loss_fn)
    replay_random_ops(cg)
    capture_s = time.perf_counter() - t0
    bw = measure_host_bandwidth(device)  # bytes per second; the graph's times are seconds
    store_all = simulate(cg, cg.order)
    want_loss, want, eager_peak, eager_s = one(lambda: model(idx))
    print(f"\n{device}: GPT {size}, {len(cg.ops)} ops, capture {capture_s:.1f} s, time source "
          f"{cg.meta.get('time_source')}, host link {bw / 1e9:.2f} GB/s (measured)")
    print(f"eager: peak {eager_peak / 2**20:.1f} MiB, step {1e3 * eager_s:.1f} ms; store-all predicted "
          f"{store_all.peak_bytes / 2**20:.1f} MiB")
    timed: dict[tuple, float] = {}

    def step_time(seq, offs=()):
        key = (tuple(seq), tuple(offs))
        if key not in timed:
            step = ScheduledStep(cg, seq, offloads=list(offs))
            timed[key] = one(lambda: step(model, (idx,), {}))[3]
        return timed[key]

    rows = []
    head = (f"{'budget':>6} {'plan':<10} {'pred MiB':>9} {'meas MiB':>9} {'fits':>4} {'bitwise':>7} {'overhead':>8} "
            f"{'step ms':>8} {'offl MiB':>8} {'link ms':>8} {'hidden':>7} {'meas hidden':>11}")
    print(head)
    for frac in fractions:
        budget = int(frac * store_all.peak_bytes)
        plans = {"recompute": dict(method="auto"),
                 "offload": dict(method="offload", bandwidth=bw, mode="offload"),
                 "joint": dict(method="offload", bandwidth=bw, mode="both")}
        for name, kw in plans.items():
            row = {"device": device, "fraction": frac, "budget_bytes": budget, "plan": name}
            try:
                sched = solve(cg, budget, time_limit=time_limit, **kw)
            except (NoScheduleFound, InfeasibleBudget) as exc:
                row["status"] = type(exc).__name__
                rows.append(row)
                print(f"{frac:>5.1f}x {name:<10} {'n/a':>9}  ({type(exc).__name__})")
                continue
            pred = simulate(cg, sched)
            step = ScheduledStep(cg, sched.sequence, offloads=sched.offloads)
            reset_host_stats()
            loss, grads, peak, secs = one(lambda: step(model, (idx,), {}))
            bitwise = bool(torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want)))
            summ = offload_summary(cg, sched, bandwidth=bw) if sched.offloads else offload_summary(
                cg, Schedule(sched.sequence))
            measured_hidden = None
            if sched.offloads and summ["link_time"] > 0:
                plain = step_time(sched.sequence)
                measured_hidden = max(0.0, 1.0 - max(0.0, secs - plain) / summ["link_time"])
            row.update(status="ok", predicted_peak_bytes=pred.peak_bytes, measured_peak_bytes=peak,
                       fits=peak <= budget, bitwise=bitwise, predicted_overhead=sched.overhead, step_seconds=secs,
                       eager_step_seconds=eager_s, host_peak_bytes=host_stats().peak_bytes,
                       recomputed=sum(1 for c in sched.counts().values() if c > 1),
                       measured_hidden_fraction=measured_hidden, **summ)
            rows.append(row)
            mh = "" if measured_hidden is None else f"{100 * measured_hidden:.0f} %"
            print(f"{frac:>5.1f}x {name:<10} {pred.peak_bytes / 2**20:>9.2f} {peak / 2**20:>9.2f} "
                  f"{'yes' if peak <= budget else 'NO':>4} {'yes' if bitwise else 'NO':>7} "
                  f"{100 * sched.overhead:>7.2f}% {1e3 * secs:>8.1f} {summ['offloaded_bytes'] / 2**20:>8.2f} "
                  f"{1e3 * summ['link_time']:>8.2f} {100 * summ['hidden_fraction']:>6.0f}% {mh:>11}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="MobileNet_512_224_224_3_train", help="benchmark graph file stem")
    parser.add_argument("--quick", action="store_true", help="three bandwidths, three budgets")
    parser.add_argument("--steps", action="store_true", help="real graph-mode steps on CPU (emulated host pool)")
    parser.add_argument("--cuda", action="store_true", help="real graph-mode steps on one GPU")
    args = parser.parse_args()
    if args.steps or args.cuda:
        import torch

        torch.set_num_threads(1)
        device = "cuda" if args.cuda else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            parser.error("--cuda needs a GPU")
        rows = _real_steps(device)
        out = ROOT / "results" / f"offload_steps_{device}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows}, indent=1))
        print(f"\nwrote {out}")
        return
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # the solvers themselves never need torch
        pass
    fractions = (0.5, 0.7, 0.9) if args.quick else FRACTIONS
    rel_bws = (0.01, 0.3, 3.0) if args.quick else RELATIVE_BW
    graphs = [_chain(), ComputeGraph.load(GRAPHS / f"{args.graph}.json")]
    rows = []
    for g in graphs:
        peak = simulate(g, g.order).peak_bytes
        ratio = g.total("bytes") / g.total("time")
        print(f"\n{g.name}: {len(g.ops)} ops, store-all peak {peak} B, R = {ratio:.4g} B per time unit")
        print(f"{'budget':>7} {'recompute':>10} " + " ".join(f"{f'{m:g}x R':>9}" for m in rel_bws)
              + "   (extra compute over store-all)")
        for f in fractions:
            budget = int(f * peak)
            rec = _run(g, budget, method="offload", bandwidth=ratio, mode="recompute")
            cells = []
            for m in rel_bws:
                r = _run(g, budget, method="offload", bandwidth=m * ratio)
                cells.append(r)
                rows.append({"graph": g.name, "fraction": f, "budget_bytes": budget, "relative_bandwidth": m,
                             "bandwidth": m * ratio, "offload": r, "recompute_only": rec})
            print(f"{f:>6.1f}x {_fmt(rec):>10} " + " ".join(f"{_fmt(c):>9}" for c in cells))
        print("solve seconds (max): " + f"{max(r['offload']['seconds'] for r in rows if r['graph'] == g.name):.2f}")
    out = ROOT / "results" / "offload.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "fractions": fractions, "relative_bandwidths": rel_bws}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

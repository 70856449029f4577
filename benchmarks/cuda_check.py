"""On one CUDA GPU: does the real training step fit the budget, as the allocator counts it?
And do the plans reproduce eager's dropout draws there?

For a zoo of models trained as people train them (a CNN with BatchNorm and a transposed
convolution; a GPT-style LM and HF Llama with cross-entropy written outside the model; a
stack of torch's ``TransformerEncoderLayer`` with dropout; HF GPT-2 with labels), at 0.7,
0.5 and 0.3 of the plain step's allocator peak, in graph and module mode, it measures:

* the allocator's peak (:func:`graphs.memory.measure_peak`: on CUDA
  ``torch.cuda.max_memory_allocated`` after a reset, less what was allocated before, plus
  the model's parameters, buffers and the inputs) of one real step (forward, the user's
  loss, backward) of the returned module, on its first and on its second step, next to
  the budget and the plan's prediction;
* the peak that ``optimize`` itself reached while planning;
* step time (CUDA events, median of 10 after 3 warm-ups) against the plain model and
  against non-reentrant ``torch.utils.checkpoint`` on every block.

The peers section (``--peers``) measures, on each model of the zoo, per-block
checkpointing and ``torch.utils.checkpoint`` with selective checkpointing
(``create_selective_checkpoint_contexts`` saving the matmuls) on every block, and plans
remat in both modes for exactly each peer's allocator peak: whether it refuses a budget
a peer meets, whether its real steps fit, and its step time beside the peer's.

The drop-in section (``--dropin``) trains the GPT (SDPA with ``dropout_p`` and
``nn.Dropout``), the ``TransformerEncoderLayer`` stack (its attention's dropout and
fused dropout) and HF GPT-2 (attention, residual and embedding dropout) two steps, seeded
alike, with the optimized module and with two copies of the original, in fp32 and under
bf16 autocast, and reports whether the loss and the gradients are the original's
(bitwise, or how far apart, next to how far two runs of the original are apart).

Usage::

    python benchmarks/cuda_check.py              # the whole zoo (minutes on one GPU)
    python benchmarks/cuda_check.py --quick      # one model, 0.5 only
    python benchmarks/cuda_check.py --dropin     # the drop-in section, then the zoo
    python benchmarks/cuda_check.py --peers --no-zoo   # remat at its peers' peaks alone
    python benchmarks/cuda_check.py --device cpu --tiny --dropin   # a dry run of the script

Prints a table and writes ``benchmarks/results/cuda_check.{json,md}`` (the JSON after
every case, so a run cut short keeps what it measured); ``--deadline`` seconds stops
starting cases after that long, the zoo's 0.5 cases first.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

FRACTIONS = (0.5, 0.3, 0.7)  # the order cases run in: 0.5 first, when time is short
MODES = ("graph", "module")


def _zoo(tiny: bool) -> dict:
    """name -> () -> (model, inputs, loss_of(output)); ``tiny``: shapes for a dry run."""
    from examples import models

    k = 8 if tiny else 1  # the tiny shapes divide widths, lengths and batches

    def cnn():
        model, inputs = models.unet(batch=32 // k, width=32 // k, size=128 // k, depth=3)
        return model, inputs, lambda out: out.float().square().mean()

    def gpt_outside():
        model, (idx, targets) = models.gpt(n_layer=8 // k or 2, d=512 // k, seq=512 // k, batch=8 // k or 2,
                                           vocab=8192 // k)
    
        class Logits(nn.Module):  # the same model, returning logits: the loss is the caller's
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, idx):
                m = self.m
                pos = torch.arange(idx.shape[1], device=idx.device)
                x = m.drop(m.wte(idx) + m.wpe(pos))
                for block in m.blocks:
                    x = block(x)
                return m.head(m.ln(x))

        return Logits(), (idx,), lambda out: F.cross_entropy(out.flatten(0, 1), targets.to(out.device).flatten())

    def encoder():
        model, inputs = models.encoder_stack(layers=6 // k or 2, d=512 // k, heads=8, seq=512 // k,
                                             batch=16 // k)
        return model, inputs, lambda out: out.float().square().mean()

    def hf_gpt2():
        model, inputs = models.hf_gpt2(n_layer=6 // k or 2, d=512 // k, seq=512 // k, batch=8 // k or 2)
        return model, inputs, lambda out: out.loss

    def llama_outside():
        model, inputs = models.hf_llama(n_layer=6 // k or 2, d=512 // k, seq=512 // k, batch=8 // k or 2)
        labels = inputs["labels"]
        return model, {"input_ids": inputs["input_ids"]}, \
            lambda out: F.cross_entropy(out.logits.float().flatten(0, 1), labels.to(out.logits.device).flatten())

    return {"cnn": cnn, "gpt_ce_outside": gpt_outside, "encoder": encoder, "hf_gpt2": hf_gpt2,
            "llama_ce_outside": llama_outside}


def _dropin_zoo(tiny: bool) -> dict:
    """name -> () -> (model, inputs, loss_of(output)): models whose step draws dropout."""
    from examples import models

    k = 2 if tiny else 1

    def loss(out):
        if hasattr(out, "loss") and out.loss is not None:
            return out.loss
        return out.float().square().mean()

    def hf_gpt2():  # the config's default dropout (0.1 on attention, residuals, embeddings)
        model, inputs = models.hf_gpt2(n_layer=4 // k or 2, d=256 // k, seq=256 // k, batch=8 // k)
        return model, inputs, loss

    return {
        "gpt_sdpa_dropout": lambda: (*models.gpt(n_layer=4 // k or 2, d=256 // k, n_head=4, seq=256 // k,
                                                 batch=8 // k, vocab=1024 // k), loss),
        "encoder_dropout": lambda: (*models.encoder_stack(layers=4 // k or 2, d=256 // k, heads=4, seq=256 // k,
                                                          batch=8 // k), loss),
        "hf_gpt2_dropout": hf_gpt2,
    }


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _step(model, inputs, loss_of):
    # the output held until the backward is done, as a loop that keeps ``out`` holds it
    # (and as plans assume): dropped before the backward, a step peaks lower
    out = _call(model, inputs)
    loss = loss_of(out)
    loss.backward()
    del out
    return loss


def _peak(model, inputs, loss_of, device: str) -> int:
    """The allocator's peak of one step: the project's judge, the model's tensors and the
    inputs counted, whatever else is on the device not."""
    from graphs.memory import measure_peak

    peak = measure_peak(lambda: _step(model, inputs, loss_of), roots=(model, inputs), device=device).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


def _time(model, inputs, loss_of, device: str, *, warmup: int = 3, repeats: int = 10) -> float:
    """Milliseconds of one step, median (CUDA events; on CPU, process time)."""
    for _ in range(warmup):
        _step(model, inputs, loss_of)
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(model, inputs, loss_of)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.process_time()
            _step(model, inputs, loss_of)
            times.append(1e3 * (time.process_time() - t))
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _per_block_checkpoint(model: nn.Module, *, context_fn=None) -> nn.Module:
    """A copy of ``model`` with non-reentrant ``torch.utils.checkpoint`` around every layer
    block (:func:`graphs.module_mode.layer_blocks`), with ``context_fn`` where given."""
    from torch.utils.checkpoint import checkpoint

    from graphs.module_mode import layer_blocks

    extra = {} if context_fn is None else {"context_fn": context_fn}
    wrapped = copy.deepcopy(model)
    for name in layer_blocks(wrapped):
        block = wrapped.get_submodule(name)
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **extra, **k)
    return wrapped


def _matmul_ops() -> list:
    aten = torch.ops.aten
    return [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default]


def _sac_checkpoint(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with torch's selective activation checkpointing on every layer
    block: non-reentrant ``checkpoint`` whose ``context_fn`` is
    ``create_selective_checkpoint_contexts`` saving the matmuls' outputs (the rest of each
    block is recomputed)."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return _per_block_checkpoint(model, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                     _matmul_ops()))


#: the peers remat is compared with at their own allocator peak (``--peers``)
PEERS = {"per_block": _per_block_checkpoint, "sac_matmuls": _sac_checkpoint}


def run_peers(name: str, make, device: str) -> dict:
    """Each peer (:data:`PEERS`) measured (allocator peak, step time), then remat in both
    modes planned for exactly that peak: whether it plans, whether its real steps fit,
    and its step time beside the peer's."""
    import solver
    from graphs.units import GiB

    model, inputs, loss_of = _made(make, device)
    base = copy.deepcopy(model)
    row = {"model": name, "plain_peak_bytes": _peak(base, inputs, loss_of, device),
           "plain_ms": _time(base, inputs, loss_of, device)}
    for peer, wrap in PEERS.items():
        other = wrap(base)
        budget = _peak(other, inputs, loss_of, device)
        row[f"{peer}_peak_bytes"], row[f"{peer}_ms"] = budget, _time(other, inputs, loss_of, device)
        del other
        for mode in MODES:
            key = f"{peer}_{mode}"
            try:
                fast = solver.optimize(copy.deepcopy(base), budget / GiB, inputs, mode=mode, loss_fn=loss_of)
            except solver.InfeasibleBudget as exc:
                row[key] = {"status": "refused", "smallest_feasible_bytes": exc.smallest_feasible_bytes}
                continue
            except Exception as exc:  # a failure is a finding: record it and go on
                row[key] = {"status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                continue
            steps = [_peak(fast, inputs, loss_of, device) for _ in range(2)]
            row[key] = {"status": "ok", "used_mode": fast.report.mode, "predicted_peak_bytes":
                        fast.report.predicted_peak_bytes, "step_peak_bytes": max(steps),
                        "fits": max(steps) <= budget, "ms": _time(fast, inputs, loss_of, device)}
            del fast
    row["status"] = "ok"
    return row


def _made(make, device: str):
    torch.manual_seed(0)
    model, inputs, loss_of = make()
    return model.to(device).train(), _to(inputs, device), loss_of


def run_case(name: str, make, frac: float, mode: str, device: str) -> dict:
    import solver
    from graphs.units import GiB

    model, inputs, loss_of = _made(make, device)
    base = copy.deepcopy(model)
    plain_peak = _peak(base, inputs, loss_of, device)
    budget = int(frac * plain_peak)
    row = {"model": name, "fraction": frac, "mode": mode, "budget_bytes": budget, "plain_peak_bytes": plain_peak}
    try:
        fast = solver.optimize(model, budget / GiB, inputs, mode=mode, loss_fn=loss_of)
    except solver.InfeasibleBudget as exc:
        return {**row, "status": "infeasible", "smallest_feasible_bytes": exc.smallest_feasible_bytes}
    except Exception as exc:  # a failure is a finding: record it and go on
        return {**row, "status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    rep = fast.report
    row.update(planning_peak_bytes=rep.planning_peak_bytes, predicted_peak_bytes=rep.predicted_peak_bytes,
               report_step_peak_bytes=rep.step_peak_bytes, method=rep.method, used_mode=rep.mode,
               notes=list(rep.notes), plan_seconds=rep.capture_seconds + rep.measure_seconds + rep.solve_seconds
               + (rep.check_seconds or 0.0))
    row["first_step_peak_bytes"] = _peak(fast, inputs, loss_of, device)
    row["second_step_peak_bytes"] = _peak(fast, inputs, loss_of, device)
    plain_ms = _time(base, inputs, loss_of, device)
    ckpt = _per_block_checkpoint(base)
    row["ckpt_blocks_peak_bytes"] = _peak(ckpt, inputs, loss_of, device)
    row.update(step_ms=_time(fast, inputs, loss_of, device), plain_ms=plain_ms,
               ckpt_blocks_ms=_time(ckpt, inputs, loss_of, device))
    measured = [row["first_step_peak_bytes"], row["second_step_peak_bytes"], row["planning_peak_bytes"] or 0]
    row["fits"] = max(measured) <= budget
    row["status"] = "ok"
    return row


def _seeded_steps(model, inputs, loss_of, *, amp: str | None, device: str, n: int = 2) -> list:
    """Loss and gradients of ``n`` steps, SGD between them, each step seeded alike."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for step in range(n):
        torch.manual_seed(100 + step)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp is not None):
            loss = loss_of(_call(model, inputs))
        loss.backward()
        out.append([loss.detach().float()] + [p.grad.float().clone() for p in model.parameters()
                                              if p.grad is not None])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _apart(a: list, b: list) -> tuple[bool, float]:
    """(bitwise equal, the largest relative distance ``|x - y| / |y|`` over the tensors)."""
    same, worst = True, 0.0
    for xs, ys in zip(a, b):
        if len(xs) != len(ys):
            return False, float("inf")
        for x, y in zip(xs, ys):
            same = same and torch.equal(x, y)
            worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return same, worst


def run_dropin(name: str, make, mode: str, amp: str | None, device: str) -> dict:
    import solver
    from graphs.units import GiB

    model, inputs, loss_of = _made(make, device)
    ref, ref2 = copy.deepcopy(model), copy.deepcopy(model)
    row = {"model": name, "mode": mode, "autocast": amp or "off"}
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp is not None):
        plain_peak = _peak(copy.deepcopy(model), inputs, loss_of, device)
        budget = int(0.5 * plain_peak)
        try:
            try:
                fast = solver.optimize(model, budget / GiB, inputs, mode=mode, loss_fn=loss_of, measure_time=False)
            except solver.InfeasibleBudget as exc:  # the smallest budget named, then
                if not exc.smallest_feasible_bytes:
                    raise
                budget = int(1.01 * exc.smallest_feasible_bytes)
                fast = solver.optimize(model, budget / GiB, inputs, mode=mode, loss_fn=loss_of, measure_time=False)
        except Exception as exc:
            return {**row, "budget_bytes": budget,
                    "status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    row.update(budget_bytes=budget, budget_of_plain=round(budget / plain_peak, 3))
    rep = fast.report
    row.update(used_mode=rep.mode, method=rep.method, recomputed=rep.recomputed, notes=list(rep.notes))
    try:
        got = _seeded_steps(fast, inputs, loss_of, amp=amp, device=device)
        want = _seeded_steps(ref, inputs, loss_of, amp=amp, device=device)
        twice = _seeded_steps(ref2, inputs, loss_of, amp=amp, device=device)
    except Exception as exc:
        traceback.print_exc()
        return {**row, "status": f"error in training: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    row["bitwise"], row["apart"] = _apart(got, want)
    row["original_bitwise"], row["original_apart"] = _apart(twice, want)
    row["step_peak_bytes"] = rep.step_peak_bytes
    # another mask moves a gradient by tens of percent; rounding, by far less than 1 %
    # (bf16's rounding: its epsilon, 2**-7, where a recomputed op may round otherwise)
    row["same_draws"] = row["bitwise"] or row["apart"] <= max(2 ** -7 if amp else 1e-3, 10 * row["original_apart"])
    row["status"] = "ok"
    return row


def _mib(b):
    return "" if b is None else f"{b / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | budget | mode | budget MiB | predicted | step 1 | step 2 | planning | fits | "
             "step vs plain | per-block ckpt (MiB, time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['fraction']:.0%} | {r['mode']} | {_mib(r.get('budget_bytes'))} | "
                         f"{r['status']} {_mib(r.get('smallest_feasible_bytes'))} | | | | | | |")
            continue
        mode = r["mode"] if r.get("used_mode", r["mode"]) == r["mode"] else f"{r['mode']} -> {r['used_mode']}"
        lines.append(
            f"| {r['model']} | {r['fraction']:.0%} | {mode} | {_mib(r['budget_bytes'])} | "
            f"{_mib(r['predicted_peak_bytes'])} | {_mib(r['first_step_peak_bytes'])} | "
            f"{_mib(r['second_step_peak_bytes'])} | {_mib(r['planning_peak_bytes'])} | "
            f"{'yes' if r['fits'] else 'NO'} | {r['step_ms'] / r['plain_ms']:.2f}x | "
            f"{_mib(r['ckpt_blocks_peak_bytes'])}, {r['ckpt_blocks_ms'] / r['plain_ms']:.2f}x |")
    return "\n".join(lines)


def peers_table(rows: list[dict]) -> str:
    lines = ["| model | peer | peer MiB | peer time | remat graph: fits, time | remat module: fits, time |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['status']} | | | | |")
            continue
        for peer in PEERS:
            cells = []
            for mode in MODES:
                c = r[f"{peer}_{mode}"]
                if c["status"] == "ok":
                    cells.append(f"{'yes' if c['fits'] else 'NO'} {_mib(c['step_peak_bytes'])}, "
                                 f"{c['ms'] / r['plain_ms']:.2f}x")
                elif c["status"] == "refused":
                    cells.append(f"REFUSED ({_mib(c['smallest_feasible_bytes'])} named)")
                else:
                    cells.append(c["status"])
            lines.append(f"| {r['model']} | {peer} | {_mib(r[f'{peer}_peak_bytes'])} | "
                         f"{r[f'{peer}_ms'] / r['plain_ms']:.2f}x | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def dropin_table(rows: list[dict]) -> str:
    lines = ["| model | autocast | mode | budget | plan | same draws | loss and grads vs the original | "
             "two runs of the original |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['autocast']} | {r['mode']} | | {r['status']} | | | |")
            continue
        mode = r["mode"] if r["used_mode"] == r["mode"] else f"{r['mode']} -> {r['used_mode']}"

        plan = r["method"] if r["used_mode"] == "module" else f"{r['method']}, {r['recomputed']} ops recomputed"

        def far(same, apart):
            return "bitwise" if same else f"{apart:.1e} apart"

        lines.append(f"| {r['model']} | {r['autocast']} | {mode} | {r['budget_of_plain']:.2f}x | "
                     f"{plan} | "
                     f"{'yes' if r['same_draws'] else 'NO'} | {far(r['bitwise'], r['apart'])} | "
                     f"{far(r['original_bitwise'], r['original_apart'])} |")
    return "\n".join(lines)


def _write(out: str, header: str, dropin: list, rows: list, peers: list = ()) -> str:
    md = header
    if peers:
        md += ("\n\nPeers at equal memory: remat planned for each peer's allocator peak (times against the "
               "plain step)\n\n") + peers_table(list(peers))
    if dropin:
        md += ("\n\nDrop-in: two training steps seeded alike, at 0.5 of the plain step (or at the smallest "
               "feasible budget, 1 % over, where 0.5 is not)\n\n") + dropin_table(dropin)
    if rows:
        md += "\n\nMemory: the allocator's peak of the real step (MiB) against the budget\n\n" + table(rows)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"header": header, "torch": torch.__version__, "dropin": dropin, "rows": rows,
                   "peers": list(peers)}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(md + "\n")
    return md


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one model at 0.5, both modes")
    parser.add_argument("--models", default=None, help="comma-separated subset of the zoo")
    parser.add_argument("--dropin", action="store_true", help="run the drop-in section first")
    parser.add_argument("--no-zoo", action="store_true", help="the drop-in section alone")
    parser.add_argument("--peers", action="store_true",
                        help="first, remat at the allocator peak of per-block checkpointing and of SAC")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu for a dry run of the script")
    parser.add_argument("--tiny", action="store_true", help="small shapes, for a dry run")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no case starts (those left are listed as not run)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cuda_check"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check needs a CUDA GPU; none is available here (--device cpu runs it as a dry run)",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    header = (f"{torch.cuda.get_device_name()}" if args.device == "cuda" else "CPU (dry run)") + \
        f", torch {torch.__version__}"

    def timed_out() -> bool:
        return args.deadline is not None and time.perf_counter() - t0 > args.deadline

    def one(fn, *a, keys: dict) -> dict:
        if timed_out():
            return {**keys, "status": "not run: out of time"}
        try:
            row = fn(*a)
        except Exception as exc:
            traceback.print_exc()
            row = {**keys, "status": f"error: {type(exc).__name__}: {str(exc)[:200]}"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row, default=str), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return row

    dropin, rows, peers = [], [], []
    if args.peers:
        zoo = _zoo(args.tiny)
        for name in (args.models.split(",") if args.models else list(zoo)):
            peers.append(one(run_peers, name, zoo[name], args.device, keys={"model": name}))
            _write(args.out, header, dropin, rows, peers)
    if args.dropin:
        zoo = _dropin_zoo(args.tiny)
        cases = [(n, m, None) for n in zoo for m in MODES] + [("gpt_sdpa_dropout", m, "bf16") for m in MODES]
        for name, mode, amp in cases:
            dropin.append(one(run_dropin, name, zoo[name], mode, amp, args.device,
                              keys={"model": name, "mode": mode, "autocast": amp or "off"}))
            _write(args.out, header, dropin, rows, peers)
    if not args.no_zoo:
        zoo = _zoo(args.tiny)
        names = args.models.split(",") if args.models else (["encoder"] if args.quick else list(zoo))
        fractions = (0.5,) if args.quick else FRACTIONS
        for frac in fractions:
            for name in names:
                for mode in MODES:
                    rows.append(one(run_case, name, zoo[name], frac, mode, args.device,
                                    keys={"model": name, "fraction": frac, "mode": mode}))
                    _write(args.out, header, dropin, rows, peers)
    print(_write(args.out, header, dropin, rows, peers))
    return 0


if __name__ == "__main__":
    sys.exit(main())

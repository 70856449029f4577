"""Two-process (gloo, CPU) runs for the distributed tests.

Workers live here, in an importable module, so that ``torch.multiprocessing`` can start
them by name; each writes what it saw to a JSON file and the test asserts on it.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import socket
import sys
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORLD = 2
BLOCKS = [f"blocks.{i}" for i in range(4)]
GPT = dict(n_layer=4, d=64, seq=64, batch=4, dropout=0.0)
#: per-rank budget of the memory tests (bytes): below the rank's peak without remat
BUDGET = 2_400_000
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, out_dir: pathlib.Path, *args, timeout: float = 120.0) -> list[dict]:
    """Run ``worker(rank, world, port, out_dir, *args)`` on 2 processes; return each
    rank's JSON result."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(worker, args=(WORLD, port, str(out_dir), *args), nprocs=WORLD, join=False,
                             start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"distributed workers did not finish in {timeout} s")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _exit_cleanly() -> None:
    """End a worker whose results are written: leave without the interpreter's teardown,
    where a process-group thread still joinable at exit can abort the process
    ("terminate called without an active exception") after all its work is done.
    Reached only when the worker returned normally; an exception still propagates."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write(out_dir: str, rank: int, data: dict) -> None:
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(data))


def _local(batch, rank: int, world: int):
    n = batch[0].shape[0] // world
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def _reference(model, batch, steps: int, lr: float = 0.1):
    """Single-process losses and gradients over ``steps`` SGD steps on the whole batch."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ref(*batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
        opt.step()
    return losses, grads


def _predict(model, local, plan: dict, sharding: str) -> int:
    from graphs.capture import capture
    from solver.distributed import checkpoint_sequence, rank_peak
    from solver.module_plan import keep_for_plan
    from solver.plans import sequence_from_keep

    cg = capture(model, local, measure_time=False)
    seq = checkpoint_sequence(cg, sequence_from_keep(cg, keep_for_plan(cg, plan)), plan)
    return rank_peak(cg, seq, world_size=WORLD, sharding=sharding, units=BLOCKS).peak_bytes


def _train_and_measure(rank, world, wrapped, params_of, full_grad, batch, ref, plan, predicted, extra=None):
    """3 SGD steps of ``wrapped`` on the local batch vs the reference, then one measured step."""
    import torch.distributed as dist

    from graphs.distributed import RankMemoryTracker, rank_tensors

    local = _local(batch, rank, world)
    opt = torch.optim.SGD(params_of(), lr=0.1)
    ref_losses, ref_grads = ref
    loss_err, grad_err = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(*local)
        loss.backward()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        loss_err.append(abs(avg.item() / world - ref_losses[step]))
        errs = [float((full_grad(n, p) - ref_grads[step][n]).abs().max()) for n, p in named(wrapped)]
        grad_err.append(max(errs))
        opt.step()
    opt.zero_grad(set_to_none=True)
    with RankMemoryTracker(rank_tensors(wrapped, extra=local)) as mt:
        wrapped(*local).backward()
    out = dict(loss_err=loss_err, grad_err=grad_err, measured=mt.peak_bytes, predicted=predicted,
               ref_losses=ref_losses)
    out.update(extra or {})
    return out


def named(module):
    inner = getattr(module, "module", module)  # DDP
    return list(inner.named_parameters())


def fsdp_worker(rank: int, world: int, port: int, out_dir: str, action: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from examples.models import gpt
    from graphs.distributed import apply_under_fsdp

    _init(rank, world, port)
    try:
        model, batch = gpt(**GPT)
        ref = _reference(model, batch, STEPS)
        plan = {b: action for b in BLOCKS}
        local = _local(batch, rank, world)
        predicted = _predict(model, local, plan, "fsdp")
        no_remat = _predict(model, local, {}, "fsdp")
        sharded = apply_under_fsdp(model, plan, mesh=init_device_mesh("cpu", (world,)))

        def full_grad(name, p):
            return p.grad.full_tensor()

        res = _train_and_measure(rank, world, sharded, sharded.parameters, full_grad, batch, ref, plan, predicted,
                                 extra=dict(no_remat=no_remat))
        _write(out_dir, rank, res)
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def ddp_worker(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    import torch.distributed as dist

    from examples.models import gpt
    from graphs.distributed import apply_under_ddp

    _init(rank, world, port)
    try:
        model, batch = gpt(**GPT)
        ref = _reference(model, batch, STEPS)
        local = _local(batch, rank, world)
        extra = {}
        if mode == "module":
            plan = {b: "full" for b in BLOCKS}
            predicted = _predict(model, local, plan, "ddp")
            wrapped = apply_under_ddp(model, plan, record_buckets=True)
        else:
            from graphs.capture import capture
            from graphs.graph_mode import ScheduledStep, wrap_graph_mode
            from solver.distributed import rank_peak
            from solver.solving import solve
            from solver.simulate import simulate

            cg = capture(model, local, backward="outputs", measure_time=False)
            store_all = simulate(cg, cg.order).peak_bytes
            schedule = solve(cg, int(0.8 * store_all), method="eviction")
            predicted = rank_peak(cg, schedule.sequence, world_size=world, sharding="ddp").peak_bytes
            step = ScheduledStep(cg, schedule.sequence)
            extra = dict(recomputed=sum(1 for c in schedule.counts().values() if c > 1))
            wrapped = apply_under_ddp(wrap_graph_mode(model, lambda m, a, k: step), record_buckets=True)
        res = _train_and_measure(rank, world, wrapped, wrapped.parameters, lambda n, p: p.grad, batch, ref, None,
                                 predicted, extra=extra)
        _write(out_dir, rank, res)
    finally:
        dist.destroy_process_group()
    _exit_cleanly()


def optimize_worker(rank: int, world: int, port: int, out_dir: str, sharding: str, mode: str) -> None:
    """``solver.optimize(..., sharding=...)`` on this rank's batch, 3 SGD steps against the
    single-process reference, then ``solver.verify`` (collective) for the measured peak."""
    import torch.distributed as dist

    from examples.models import gpt
    from graphs.units import GiB
    from solver.join import optimize_model

    _init(rank, world, port)
    try:
        model, batch = gpt(**GPT)
        ref = _reference(model, batch, STEPS)
        local = _local(batch, rank, world)
        if sharding == "fsdp":
            budget = BUDGET
            no_remat = _predict(model, local, {}, "fsdp")
        else:  # below this rank's peak without remat (DDP buckets included)
            no_remat = _predict(model, local, {}, "ddp")
            budget = int(0.85 * no_remat)
        kw = dict(method="eviction") if mode == "graph" else {}
        wrapped = optimize_model.optimize(model, budget / GiB, local, mode=mode, sharding=sharding,
                                          measure_time=False, **kw)
        rep = wrapped.report

        def full_grad(name, p):
            return p.grad.full_tensor() if sharding == "fsdp" else p.grad

        res = _train_and_measure(rank, world, wrapped, wrapped.parameters, full_grad, batch, ref, None,
                                 rep.predicted_peak_bytes)
        if sharding == "ddp":  # a deep copy of the planned module (an EMA) plans into its own session
            from solver.join.verification import SESSION

            twin = copy.deepcopy(wrapped.module)
            res["copy_session_apart"] = twin.__dict__.get(SESSION) not in (None, wrapped.__dict__.get(SESSION))
        optimize_model.verify(wrapped, local, repeats=1)
        plan = getattr(wrapped, "remat_plan", None) or getattr(getattr(wrapped, "module", None), "remat_plan", None)
        res.update(budget=rep.budget_bytes, asked_budget=budget, no_remat=no_remat, predicted=rep.predicted_peak_bytes,
                   verified=rep.measured_peak_bytes, fits=rep.fits, sharding=rep.sharding, world_size=rep.world_size,
                   rank_fixed=rep.rank_fixed, recomputed=rep.recomputed, plan=dict(plan or {}),
                   wrapper=type(wrapped).__name__, text=str(rep))
        _write(out_dir, rank, res)
    finally:
        dist.destroy_process_group()
    _exit_cleanly()

"""Train a small GPT with FSDP2 and a remat plan, on CPU with gloo.

    torchrun --nproc-per-node 2 examples/fsdp_train.py

Every block runs under non-reentrant checkpoint inside its own ``fully_shard`` unit.
Each rank prints its predicted and measured peak for one step (forward and backward,
parameters, gradients and the batch included) and the loss of every step.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples.models import gpt  # noqa: E402
from graphs.capture import capture  # noqa: E402
from graphs.distributed import RankMemoryTracker, apply_under_fsdp, rank_tensors  # noqa: E402
from graphs.units import format_bytes  # noqa: E402
from solver.distributed import checkpoint_sequence, rank_peak  # noqa: E402
from solver.module_plan import keep_for_plan  # noqa: E402
from solver.plans import sequence_from_keep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--action", default="full", choices=["none", "full", "selective"])
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    model, (idx, tgt) = gpt(n_layer=args.layers, d=64, seq=64, batch=2 * world, dropout=0.0)
    local = (idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2])
    units = [f"blocks.{i}" for i in range(args.layers)]
    plan = {u: args.action for u in units}

    graph = capture(model, local, measure_time=False)  # this rank's step, in one process
    seq = checkpoint_sequence(graph, sequence_from_keep(graph, keep_for_plan(graph, plan)), plan)
    predicted = rank_peak(graph, seq, world_size=world, sharding="fsdp", units=units)

    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = apply_under_fsdp(model, plan, mesh=init_device_mesh("cpu", (world,)), units=units)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        if step == 1:  # measure a step with optimizer state present
            with RankMemoryTracker(rank_tensors(model, opt, extra=local)) as mt:
                loss = model(*local)
                loss.backward()
        else:
            loss = model(*local)
            loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step}: loss {avg.item() / world:.4f}", flush=True)
    adam = 2 * predicted.fixed.params  # this rank's AdamW state (two shards per parameter shard)
    pred = predicted.peak_bytes + adam
    single = predicted.single_peak_bytes + 2 * param_bytes  # same plan, one process, whole AdamW state
    dist.barrier()
    for r in range(world):
        if r == rank:
            print(f"rank {rank}: predicted peak {format_bytes(pred)} ({pred} B), measured {format_bytes(mt.peak_bytes)} "
                  f"({mt.peak_bytes} B), ratio {mt.peak_bytes / pred:.3f}; one process would hold "
                  f"{format_bytes(single)} with the same plan, unsharded", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("launch with: torchrun --nproc-per-node 2 examples/fsdp_train.py")
    main()

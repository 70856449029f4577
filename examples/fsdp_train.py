"""Train a small GPT with FSDP2 and a remat plan, on CPU with gloo.

    torchrun --nproc-per-node 2 examples/fsdp_train.py [--budget-mib 3.6]

``solver.optimize(..., mode="module", sharding="fsdp")`` plans on this rank's step (its
local batch) with the memory of one FSDP2 rank (parameter, gradient and optimizer-state
shards, the units it all-gathers), wraps the chosen blocks in non-reentrant checkpoint
inside their own ``fully_shard`` unit and returns the model, sharded. Each rank prints
its report: per-rank budget, predicted and measured peak (one step: forward and
backward, AdamW state, gradients and the batch included), and the loss of every step.
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
from graphs.units import MiB  # noqa: E402
from solver.join.optimize_model import optimize, verify  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-mib", type=float, default=3.6, help="per-rank budget, MiB")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model, (idx, tgt) = gpt(n_layer=args.layers, d=64, seq=64, batch=2 * world, dropout=0.0)
    local = (idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2])
    # an AdamW on the unsharded model only declares the state to count (sharded per rank)
    declared = torch.optim.AdamW(model.parameters())
    model = optimize(model, args.budget_mib * MiB / 2**30, local, mode="module", sharding="fsdp",
                     optimizer=declared, measure_time=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # on the sharded (DTensor) parameters
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*local)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step}: loss {avg.item() / world:.4f}", flush=True)
    report = verify(model, local, repeats=1)  # collective: every rank measures its own peak
    dist.barrier()
    for r in range(world):
        if r == rank:
            print(f"rank {rank}:\n{report}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("launch with: torchrun --nproc-per-node 2 examples/fsdp_train.py")
    main()

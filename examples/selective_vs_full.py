"""Selective vs full-layer recomputation on a 32-layer, seq 8192 transformer: memory and
extra FLOPs of each, from the analytic model (Korthikanti et al. 2022) and from the
captured training step of a scaled-down HF Llama (graded by the simulator).

    python examples/selective_vs_full.py [--quick] [--out /tmp/selective_vs_full.png]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from solver import analytic
from solver.analytic import TransformerConfig
from solver.policy import LayerAction

ACTIONS = (LayerAction.NONE, LayerAction.SELECTIVE, LayerAction.FULL)


def analytic_rows(cfg: TransformerConfig) -> list[dict]:
    base = analytic.step_flops(cfg)
    return [{"action": a.value, "act_bytes": cfg.num_layers * analytic.layer_activation_bytes(cfg, recompute=a.value),
             "extra": 0.0 if a == LayerAction.NONE else cfg.num_layers * analytic.recompute_flops(cfg, a.value) / base}
            for a in ACTIONS]


def captured_rows(*, layers: int, d: int, seq: int) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from solver.policy import build_graph_planner

    torch.set_num_threads(1)
    conf = LlamaConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=4 * d, vocab_size=256, max_position_embeddings=seq, use_cache=False,
                       attn_implementation="eager")
    with torch.device("meta"):
        model = LlamaForCausalLM(conf)
    model.train()
    pl = build_graph_planner(model, seq_len=seq, micro_batch=1, optimizer="none")
    none = pl.evaluate([LayerAction.NONE] * layers)[1]
    fixed = pl.graph.fixed_bytes
    rows = []
    for a in ACTIONS:
        sched, r = pl.evaluate([a] * layers)
        rows.append({"action": a.value, "act_bytes": r.peak_bytes - fixed, "extra": r.cost / none.cost - 1})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "selective_vs_full.png"))
    a = ap.parse_args(argv)
    cfg = TransformerConfig(num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000, seq_len=8192,
                            micro_batch=1, dtype_bytes=2)
    ana = analytic_rows(cfg)
    print("analytic, 32 layers, h=4096, a=32, seq 8192, bf16 (activations of all layers)")
    for r in ana:
        print(f"  {r['action']:<10} {r['act_bytes'] / 2**30:9.2f} GiB   +{100 * r['extra']:6.2f} % FLOPs")
    small = dict(layers=2, d=64, seq=64) if a.quick else dict(layers=4, d=128, seq=256)
    cap = captured_rows(**small)
    print(f"captured Llama ({small['layers']} layers, d={small['d']}, seq {small['seq']}), simulator "
          "(peak above parameters/inputs; extra simulated time)")
    for r in cap:
        print(f"  {r['action']:<10} {r['act_bytes'] / 2**20:9.2f} MiB   +{100 * r['extra']:6.2f} % time")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, rows, title, unit in ((axes[0], ana, "analytic 32L seq 8192", 2**30), (axes[1], cap, "captured small", 2**20)):
        ax.scatter([r["act_bytes"] / unit for r in rows], [100 * r["extra"] for r in rows])
        for r in rows:
            ax.annotate(r["action"], (r["act_bytes"] / unit, 100 * r["extra"]))
        ax.set_xlabel("activation memory (" + ("GiB" if unit == 2**30 else "MiB") + ")")
        ax.set_ylabel("extra compute (%)")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"plot written to {a.out}")


if __name__ == "__main__":
    main()

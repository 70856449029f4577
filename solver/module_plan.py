"""Layer-level plans: which blocks run under checkpoint, selective checkpoint or nothing.

The plan is chosen on the captured DAG, whose nodes carry the ``module`` that ran them:
checkpointing a block drops the forward values that only the block's own backward reads
(``torch.utils.checkpoint`` recomputes them; values that code outside the block saves,
such as the block's output, stay); the selective variant keeps the outputs of
matmul-like ops. Each candidate plan becomes a sequence
(:func:`solver.plans.sequence_from_keep`) that the simulator grades; a greedy search
upgrades the blocks that buy the most memory per unit of extra compute until the step
fits, then downgrades what the budget no longer needs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from graphs import ComputeGraph
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.plans import sequence_from_keep
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["ModulePlan", "plan_modules", "block_nodes", "keep_for_plan", "MATMUL_OPS"]

log = logging.getLogger(__name__)

#: ops whose outputs a selective plan saves (Korthikanti et al.'s "selective": keep the
#: matmuls, recompute the cheap rest)
MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution.",
              "aten._scaled_dot_product", "aten.linear", "aten.matmul")

ACTIONS = ("none", "selective", "full")
_RANK = {a: i for i, a in enumerate(ACTIONS)}


@dataclass
class ModulePlan:
    """A per-block plan and the schedule that it implies on the DAG.

    Attributes
    ----------
    actions : dict
        Block name -> ``"none"``, ``"selective"`` or ``"full"``.
    schedule : Schedule
        Graded by the simulator (``peak_bytes``, ``cost``, ``base_cost``).
    evaluations : int
        Plans simulated during the search.
    """

    actions: dict[str, str]
    schedule: Schedule
    evaluations: int = 0
    blocks: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{'block':<40} action"]
        for b in self.blocks:
            lines.append(f"{b:<40} {self.actions.get(b, 'none')}")
        return "\n".join(lines)


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")


def block_nodes(graph: ComputeGraph, block: str) -> tuple[list, list]:
    """The forward and backward op nodes that ``block`` (a module path) ran.

    Examples
    --------
    >>> g = ComputeGraph(); g.add_node("a", module="layers.0.fc"); g.add_node("b", module="layers.1")
    >>> block_nodes(g, "layers.0")
    (['a'], [])
    """
    fwd, bwd = [], []
    for v in graph.ops:
        d = graph[v]
        if _inside(d.get("module") or "", block):
            (fwd if d["phase"] == "forward" else bwd).append(v)
    return fwd, bwd


def keep_for_plan(graph: ComputeGraph, actions: Mapping[str, str]) -> set:
    """Forward values a plan keeps: all but those that only a checkpointed block's own
    backward reads (minus the matmul outputs of a selective block)."""
    forward = set(graph.forward_nodes())
    drop: set = set()
    for block, action in actions.items():
        if action == "none":
            continue
        fwd, bwd = block_nodes(graph, block)
        own_bwd = set(bwd)
        for v in fwd:
            if action == "selective" and str(graph[v]["op"]).startswith(MATMUL_OPS):
                continue
            readers = [s for s in graph.nx.successors(v) if graph.is_op(s) and graph[s]["phase"] == "backward"]
            if readers and all(r in own_bwd for r in readers):
                drop.add(v)
    return forward - drop


def _evaluate(graph: ComputeGraph, actions: Mapping[str, str]) -> tuple[list, int, float]:
    seq = sequence_from_keep(graph, keep_for_plan(graph, actions))
    r = simulate(graph, seq)
    if not r.valid:  # pragma: no cover - the builder makes valid sequences
        raise NoScheduleFound(f"plan {dict(actions)} gives an invalid sequence: {r.error}")
    return seq, r.peak_bytes, r.cost


def plan_modules(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    blocks: Sequence[str],
    actions: Iterable[str] = ACTIONS,
    time_limit: float | None = None,
) -> ModulePlan:
    """Choose, per block, none / selective / full checkpointing so that the step fits.

    Parameters
    ----------
    graph : ComputeGraph
        Nodes carry ``module`` (set by :func:`graphs.capture`).
    budget_bytes : int
    blocks : sequence of str
        Candidate module paths (e.g. the layers of a transformer); not nested.
    actions : iterable of str
        Allowed actions (``"none"`` is always allowed).
    time_limit : float, optional
        Seconds for the search.

    Returns
    -------
    ModulePlan

    Raises
    ------
    InfeasibleBudget
        Even checkpointing every block does not fit; carries the smallest peak found.

    Notes
    -----
    Greedy: each round simulates every one-step upgrade of every block and takes the one
    that lowers the peak most per unit of extra cost; once the step fits, blocks are
    downgraded again while it still fits. O(rounds x blocks) simulations.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=8)
    >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
    >>> p = plan_modules(g, 40, blocks=["layers.0", "layers.1"])
    >>> p.schedule.peak_bytes <= 40
    True
    """
    allowed = ["none"] + [a for a in ACTIONS if a != "none" and a in set(actions)]
    t0 = time.perf_counter()
    plan = {b: "none" for b in blocks}
    seq, peak, cost = _evaluate(graph, plan)
    evaluations = 1
    while peak > budget_bytes:
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
        best = None
        for b in blocks:
            for a in allowed:
                if _RANK[a] <= _RANK[plan[b]]:
                    continue
                trial = dict(plan)
                trial[b] = a
                s2, p2, c2 = _evaluate(graph, trial)
                evaluations += 1
                gain = peak - p2
                extra = max(c2 - cost, 1e-12 * max(1.0, cost))
                score = (p2 <= budget_bytes, gain / extra if gain > 0 else -extra)
                if gain > 0 or p2 <= budget_bytes:
                    key = (score[0], -c2 if score[0] else score[1])
                    if best is None or key > best[0]:
                        best = (key, trial, s2, p2, c2)
        if best is None:
            break
        _, plan, seq, peak, cost = best
    if peak > budget_bytes:
        raise InfeasibleBudget(budget_bytes, peak, lower_bound_bytes=None, what="peak with block checkpointing")
    # downgrade what the budget no longer needs, cheapest first
    improved = True
    while improved:
        improved = False
        for b in sorted(blocks, key=lambda b: -_RANK[plan[b]]):
            for a in allowed:
                if _RANK[a] >= _RANK[plan[b]]:
                    continue
                trial = dict(plan)
                trial[b] = a
                s2, p2, c2 = _evaluate(graph, trial)
                evaluations += 1
                if p2 <= budget_bytes and c2 < cost:
                    plan, seq, peak, cost, improved = trial, s2, p2, c2, True
                    break
    schedule = Schedule(sequence=seq, method="module_plan", info={"order": "fixed", "actions": dict(plan)})
    return ModulePlan(actions=plan, schedule=schedule, evaluations=evaluations, blocks=list(blocks))

"""Layer-level plans: which blocks run under checkpoint, selective checkpoint or nothing.

The plan is chosen on the captured DAG, whose nodes carry the ``module`` that ran them:
checkpointing a block drops the forward values that only the block's own backward reads
(``torch.utils.checkpoint`` recomputes them; values that code outside the block saves,
such as the block's output, stay); the selective variants keep what their rule saves
(:func:`graphs.actions.saves_output`: ``selective`` all but the attention core,
``save_matmuls`` the outputs of matmul-like ops). Each candidate plan becomes a sequence
(:func:`solver.plans.sequence_from_keep`) that the simulator grades; a greedy search
upgrades the blocks that buy the most memory per unit of extra compute until the step
fits, then downgrades what the budget no longer needs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np

from graphs import ComputeGraph
from graphs.actions import CHECKPOINTED, MATMUL_OPS, LayerAction, saves_output
from solver.errors import InfeasibleBudget, NoScheduleFound
from solver.plans import recompute_missing, sequence_from_keep
from solver.schedule import Schedule
from solver.simulate import SimulationResult, simulate

__all__ = ["ModulePlan", "BlockIndex", "checkpoint_view", "hold_bound_values", "hold_node_inputs", "plan_modules", "greedy_block_plan", "plan_schedule", "block_nodes", "keep_for_plan", "checkpoint_sequence",
           "MATMUL_OPS", "ACTIONS"]

log = logging.getLogger(__name__)

#: the actions a plan may name (:class:`graphs.actions.LayerAction`)
ACTIONS = tuple(a.value for a in LayerAction)
#: what :func:`plan_modules` chooses among by default
DEFAULT_ACTIONS = (LayerAction.NONE.value, LayerAction.SAVE_MATMULS.value, LayerAction.FULL.value)


@dataclass
class ModulePlan:
    """A per-block plan and the schedule that it implies on the DAG.

    Attributes
    ----------
    actions : dict
        Block name -> a :class:`graphs.actions.LayerAction` value.
    schedule : Schedule
        Graded by the simulator (``peak_bytes``, ``cost``, ``base_cost``).
    evaluations : int
        Plans simulated during the search.
    """

    actions: dict[str, str]
    schedule: Schedule
    evaluations: int = 0
    graph: ComputeGraph | None = None
    blocks: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{'block':<40} action"]
        for b in self.blocks:
            lines.append(f"{b:<40} {self.actions.get(b, 'none')}")
        return "\n".join(lines)


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")


def _prefixes(module: str) -> list[str]:
    """``module`` and every enclosing module path (``"a.b.c"`` -> ``a.b.c``, ``a.b``, ``a``)."""
    out = [module]
    while "." in module:
        module = module.rsplit(".", 1)[0]
        out.append(module)
    return out


class BlockIndex:
    """The op nodes of every block of a graph, found in one pass, and what a
    checkpointed block drops, found once per (block, action).

    Pricing per-block plans simulates many plans of one graph; each of them needs the
    nodes of its blocks (:func:`block_nodes`, a pass over the graph per block). An index
    answers those in O(1); every function that takes ``index=`` gives what it gives
    without one. The graph's op nodes and their ``module`` must not change while the
    index is used.

    Parameters
    ----------
    graph : ComputeGraph
    blocks : sequence of str
        Module paths.

    Examples
    --------
    >>> g = ComputeGraph(); g.add_node("a", module="layers.0.fc"); g.add_node("b", module="layers.1")
    >>> BlockIndex(g, ["layers.0", "layers.1"]).nodes("layers.0")
    (['a'], [])
    """

    def __init__(self, graph: ComputeGraph, blocks: Sequence[str]) -> None:
        self.graph = graph
        wanted = set(blocks)
        self._nodes: dict[str, tuple[list, list]] = {b: ([], []) for b in wanted}
        #: a node that two blocks hold (nested blocks): block order then matters
        self.nested = False
        for v in graph.ops:
            d = graph[v]
            hits = [p for p in _prefixes(d.get("module") or "") if p in wanted]
            self.nested = self.nested or len(hits) > 1
            for b in hits:
                self._nodes[b][0 if d["phase"] == "forward" else 1].append(v)
        self._drop: dict[tuple[str, str], frozenset] = {}
        self._piece: dict[tuple[str, str], tuple] = {}
        self._forward: frozenset | None = None
        self._sim: _IndexedSimulation | None = None

    def nodes(self, block: str) -> tuple[list, list]:
        """:func:`block_nodes` of ``block`` (a block outside the index is looked up)."""
        if block not in self._nodes:
            self._nodes[block] = block_nodes(self.graph, block)
        return self._nodes[block]

    def forward(self) -> frozenset:
        if self._forward is None:
            self._forward = frozenset(self.graph.forward_nodes())
        return self._forward

    def sequence_from_keep(self, keep: set) -> list:
        """:func:`solver.plans.sequence_from_keep` of ``keep`` (default order and regions)."""
        if self._sim is None:
            self._sim = _IndexedSimulation(self.graph)
        return self._sim.sequence_from_keep(keep)

    def simulate(self, sequence: Sequence[Hashable], extra_edges: list | None = None) -> SimulationResult | None:
        """:func:`solver.simulate` of a sequence without offloads that the plan builders
        made, with ``extra_edges`` read as edges of the graph; on integers, so faster.
        None for a sequence it does not take (a node that reads a value not computed
        yet): ask the simulator."""
        if self._sim is None:
            self._sim = _IndexedSimulation(self.graph)
        return self._sim.run(sequence, extra_edges or ())

    def dropped(self, block: str, action: str) -> frozenset:
        """The forward values that checkpointing ``block`` with ``action`` drops."""
        key = (block, action)
        if key not in self._drop:
            self._drop[key] = frozenset(_dropped(self.graph, self.nodes(block), action))
        return self._drop[key]

    def price(self, actions: Mapping[str, str]) -> SimulationResult | None:
        """The simulation of :func:`plan_schedule`'s sequence for ``actions`` (no offload),
        assembled from pieces found once per (block, action), without building the
        sequence of node ids. None for nested blocks or an offloaded block: ask
        :func:`plan_schedule`.

        Checkpointing a block drops values that only the block reads. So the inputs of a
        dropped value are the block's own values or kept ones, and what the block's
        backward recomputes, and where, does not depend on the other blocks' actions:
        each (block, action) gives the recomputations that :func:`sequence_from_keep`
        makes before each of the block's backward ops, which
        :func:`checkpoint_sequence` then gathers before the first of them (those made
        before the very first backward op stay where they are, as it leaves them).

        Examples
        --------
        >>> from solver.synthetic import training_chain
        >>> g = training_chain(4, fwd_bytes=8)
        >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
        >>> plan = {"layers.0": "full", "layers.1": "none"}
        >>> index = BlockIndex(g, ["layers.0", "layers.1"])
        >>> index.price(plan).peak_bytes == plan_schedule(g, plan)[1].peak_bytes
        True
        """
        if self.nested:
            return None
        if self._sim is None:
            self._sim = _IndexedSimulation(self.graph)
        sim = self._sim
        fb = sim.first_bwd
        head: list = []  # recomputed before the first backward op: checkpoint_sequence leaves them there
        at: list = []  # (position, recomputations) gathered before a later backward op
        sac: list = []
        for block, action in actions.items():
            if action == LayerAction.NONE:
                continue
            if action not in CHECKPOINTED:
                return None
            first, later, edges = self._pieces(block, action)
            head.extend(first)
            if later is not None:
                at.append(later)
            if edges is not None:
                sac.append(edges)
        parts = [sim.everywhere[:fb]] + head
        prev = fb
        for t, chunk in sorted(at, key=lambda tc: tc[0]):
            parts.append(sim.everywhere[prev:t])
            parts.append(chunk)
            prev = t
        parts.append(sim.everywhere[prev:])
        once = (np.concatenate([u for u, _ in sac]), np.concatenate([v for _, v in sac])) if sac else None
        return sim.run_numbered(np.concatenate(parts), once=once)

    def _pieces(self, block: str, action: str) -> tuple[list, tuple | None, tuple | None]:
        """What one checkpointed block adds to a plan's sequence, numbered: the
        recomputations made before the first backward op (where
        :func:`checkpoint_sequence` leaves them), the later ones as (the backward op
        before which they are gathered, the ops), and the selective rule's edges
        (:func:`_sac_edges`) as arrays (inputs, readers; a reader is a backward op)."""
        key = (block, action)
        if key in self._piece:
            return self._piece[key]
        sim = self._sim
        num, fb = sim.num, sim.first_bwd
        # kept anyway: forced values, and forward values after the first backward op
        # (the reference order computes them there)
        missing = {i for i in (num[v] for v in self.dropped(block, action)) if i < fb and not sim.forced[i]}
        avail = dict.fromkeys(range(fb), -1)
        for i in missing:
            avail[i] = 0
        chunks = []
        for r in sorted({r for u in missing for r in sim.succs[u] if r >= fb}):
            need = [u for u in sim.early_preds[r] if avail[u] == 0]
            if need:
                seq: list[int] = []
                recompute_missing(need, 1, avail, seq, preds=sim.preds.__getitem__,
                                   forward=sim.forward.__getitem__, name=sim.ids.__getitem__)
                chunks.append((r, np.array(seq, dtype=np.int64)))
        edges = _sac_edges(self.graph, {block: action}, self.graph.ops, index=self)
        later = [c for t, c in chunks if t > fb]
        if later:
            # numbers below the first backward op follow the forward's order
            ordered = np.sort(np.concatenate(later), kind="stable")
            together = _projections_together(self.graph, [sim.ids[i] for i in ordered])
            later = [np.array([num[v] for v in together], dtype=np.int64)]
        pieces = ([c for t, c in chunks if t == fb],
                  (next(t for t, _ in chunks if t > fb), later[0]) if later else None,
                  (np.array([num[u] for u, _ in edges], dtype=np.int64),
                   np.array([num[v] for _, v in edges], dtype=np.int64)) if edges else None)
        self._piece[key] = pieces
        return pieces


class _IndexedSimulation:
    """The simulator's arithmetic (:mod:`solver.simulate`, without offloads) on the op
    nodes of one graph numbered once: each plan then costs a pass over its sequence."""

    def __init__(self, graph: ComputeGraph) -> None:
        nodes, ops_set = graph.nx.nodes, graph.ops_set
        self.ids = list(graph.ops)
        self.num = {v: i for i, v in enumerate(self.ids)}
        self.preds = [[self.num[u] for u in graph.nx.predecessors(v) if u in ops_set] for v in self.ids]
        data = [nodes[v] for v in self.ids]
        self.nbytes = np.array([int(d["bytes"]) for d in data], dtype=np.int64)
        self.output = [bool(d.get("output", False)) for d in data]
        groups: dict = {}
        self.group = [-1 if d.get("group") is None else groups.setdefault(d["group"], len(groups)) for d in data]
        self.group_index = [d.get("group_index", 0) for d in data]
        self.group_arr = np.array(self.group, dtype=np.int64)
        self.gidx_arr = np.array(self.group_index, dtype=float)
        # a step's time and workspace, starting a run of its op or continuing one
        self.time_start = np.array([float(d["group_time"]) if d.get("group") is not None and "group_time" in d
                                    else float(d["time"]) for d in data])
        self.time_cont = np.array([0.0 if d.get("group") is not None and "group_time" in d else float(d["time"])
                                   for d in data])
        self.ws_start = np.array([int(d.get("workspace", 0)) for d in data], dtype=np.int64)
        self.ws_cont = np.array([int(d.get("run_workspace", d.get("workspace", 0))) for d in data], dtype=np.int64)
        self.fixed = graph.fixed_bytes
        self.base_cost = float(sum(nodes[v]["time"] for v in graph.ops))
        self.forward = [d["phase"] == "forward" for d in data]
        first_bwd = next((i for i, f in enumerate(self.forward) if not f), len(data))
        self.region = [0] * first_bwd + [1] * (len(data) - first_bwd)
        self.forced = [f and (not d.get("recomputable", True) or d.get("output", False))
                       for f, d in zip(self.forward, data)]
        self.first_bwd = first_bwd
        # the only values a step after the first backward op can miss: forward values
        # computed before it (later ones are computed in the backward's region)
        self.early_preds = [[u for u in p if u < first_bwd] for p in self.preds]
        counts = np.array([len(p) for p in self.preds], dtype=np.int64)
        self.pred_count = counts
        self.pred_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.pred_flat = np.array([u for p in self.preds for u in p], dtype=np.int64)
        self.output_arr = np.array(self.output, dtype=bool)
        self.everywhere = np.arange(len(self.ids), dtype=np.int64)
        self.succs: list[list[int]] = [[] for _ in self.ids]
        for v, p in enumerate(self.preds):
            for u in p:
                self.succs[u].append(v)

    def sequence_from_keep(self, keep: set) -> list:
        """:func:`solver.plans.sequence_from_keep` with its default order and regions.

        Before the first backward op nothing is missing (the reference order is
        topological); after it, only a forward value from before it that is not kept
        and not computed again yet."""
        fb = self.first_bwd
        kept = self.forced[:fb]
        num = self.num
        for v in keep:
            i = num[v]
            if i < fb:
                kept[i] = True
        # op -> region of its live copy (-1: every region); only values before fb are read
        avail = {i: (-1 if k else 0) for i, k in enumerate(kept)}
        preds, forward, ids, early = self.preds, self.forward, self.ids, self.early_preds
        seq: list[int] = list(range(fb))
        for i in range(fb, len(ids)):
            e = early[i]
            if e:
                missing = [u for u in e if avail[u] == 0]
                if missing:
                    recompute_missing(missing, 1, avail, seq, preds=preds.__getitem__, forward=forward.__getitem__,
                                      name=ids.__getitem__)
            seq.append(i)
        return [ids[i] for i in seq]

    def run(self, sequence: Sequence[Hashable], extra_edges) -> SimulationResult | None:
        num = self.num
        try:
            seq = np.fromiter((num[v] for v in sequence), dtype=np.int64, count=len(sequence))
            extra: dict[int, list] = {}
            for u, v in extra_edges:
                extra.setdefault(num[v], []).append(num[u])
        except KeyError:
            return None
        return self.run_numbered(seq, extra)

    def run_numbered(self, seq: np.ndarray, extra: Mapping[int, list] | None = None, *,
                     once: tuple[np.ndarray, np.ndarray] | None = None) -> SimulationResult | None:
        """:meth:`run` on op numbers; ``extra``: op -> the ops it also reads; ``once``:
        arrays ``(u, v)`` of more such reads, ``v`` an op that runs once at most."""
        n = len(seq)
        if n == 0:
            return SimulationResult(valid=True, error=None, peak_bytes=int(self.fixed), peak_step=0, cost=0.0,
                                    base_cost=self.base_cost, memory_curve=np.zeros(0, dtype=np.int64),
                                    recomputations=0)
        # every read (step, op read): the op's inputs, then the extra edges
        counts = self.pred_count[seq]
        steps = np.repeat(np.arange(n, dtype=np.int64), counts)
        first = np.repeat(self.pred_start[seq] - (np.cumsum(counts) - counts), counts)
        read = self.pred_flat[first + np.arange(len(steps), dtype=np.int64)]
        if extra:
            at = np.flatnonzero(np.isin(seq, np.fromiter(extra, dtype=np.int64)))
            more = [(t, u) for t in at.tolist() for u in extra[int(seq[t])]]
            if more:
                steps = np.concatenate([steps, np.array([t for t, _ in more], dtype=np.int64)])
                read = np.concatenate([read, np.array([u for _, u in more], dtype=np.int64)])
        # step t makes copy t; a read takes the latest copy of its op made before t
        everywhere = np.arange(n, dtype=np.int64)
        last = np.full(len(self.ids), -1, dtype=np.int64)
        last[seq] = everywhere  # of repeated indices, the last assignment holds
        if once is not None and len(once[0]):
            at = last[once[1]]
            steps = np.concatenate([steps, at[at >= 0]])
            read = np.concatenate([read, once[0][at >= 0]])
        ran = np.flatnonzero(last >= 0)
        latest = last[ran]  # the latest copy of each op that ran
        if np.bincount(seq).max() <= 2:
            # at most two copies of an op (a plan's one recomputation): the read takes
            # the second where it is made before the read, else the first
            first = np.full(len(self.ids), n, dtype=np.int64)
            first[seq[::-1]] = everywhere[::-1]
            before, second = first[read], last[read]
            if len(read) and (before >= steps).any():
                return None  # a read of a value not computed yet
            copy = np.where(second < steps, second, before)
        else:
            by_op = np.argsort(seq, kind="stable")
            keys = seq[by_op] * n + by_op
            pos = np.searchsorted(keys, read * n + steps) - 1
            if len(pos) and pos.min() < 0:
                return None
            copy = by_op[pos]
            if len(copy) and not np.array_equal(seq[copy], read):
                return None  # a read of a value not computed yet
        ends = everywhere.copy()
        np.maximum.at(ends, copy, steps)
        ends[latest[self.output_arr[ran]]] = n - 1
        recomputations = n - len(latest)
        size = self.nbytes[seq]
        delta = np.zeros(n + 1, dtype=np.int64)
        delta[:n] += size  # the copy made at step t is live from t
        np.add.at(delta, ends + 1, -size)
        curve = np.cumsum(delta[:n]) + self.fixed
        cont = np.zeros(n, dtype=bool)
        if n > 1:  # a projection right after an earlier one of its op continues the op's run
            g, k = self.group_arr[seq], self.gidx_arr[seq]
            cont[1:] = (g[1:] >= 0) & (g[1:] == g[:-1]) & (k[:-1] < k[1:])
        compute = np.where(cont, self.time_cont[seq], self.time_start[seq])
        curve = curve + np.where(cont, self.ws_cont[seq], self.ws_start[seq])
        cost = float(compute.sum())
        peak_step = int(np.argmax(curve))
        return SimulationResult(valid=True, error=None, peak_bytes=int(curve[peak_step]), peak_step=peak_step,
                                cost=cost, base_cost=self.base_cost, memory_curve=curve,
                                recomputations=recomputations)


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


#: Positions in the reference order within which the ops of one autograd node lie
NODE_SPAN = 4


def hold_node_inputs(graph: ComputeGraph) -> int:
    """Eager autograd's lifetimes in backward, on a captured step that eager autograd runs
    (module mode). A node of the autograd graph computes all its gradients before it
    lets go of what it read (its saved tensors, the gradient that arrived), whereas the
    captured backward splits it into ops that each free their inputs: ``MulBackward0``
    becomes two ``mul`` ops, and the factor the first reads would be freed before the
    second runs. So every op value that an op of a backward node (the ops that share an
    ``autograd_node``) reads is also read by the node's last op in the reference order:
    an edge to it, consistent with that order. A node's ops lie within
    :data:`NODE_SPAN` positions of each other in that order; ops that share a number
    further apart (the gradient-accumulating ``add`` ops, numbered alike across the
    whole backward) are separate runs.

    Returns
    -------
    int
        Edges added.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("a", bytes=4, phase="backward"); g.add_node("b", bytes=4, phase="backward")
    >>> for v in ("x", "y"): g.add_node(v, bytes=4, phase="backward", autograd_node=7)
    >>> g.add_edge("a", "x"); g.add_edge("b", "y"); g.add_edge("a", "b")
    >>> hold_node_inputs(g), g.nx.has_edge("a", "y")
    (1, True)
    """
    at = {v: i for i, v in enumerate(graph.order)}
    ops = graph.ops_set
    nodes: dict = {}
    for v in graph.ops:
        d = graph[v]
        if d["phase"] == "backward" and d.get("autograd_node") is not None and d.get("op") != "tangent":
            nodes.setdefault(d["autograd_node"], []).append(v)
    runs = []
    for members in nodes.values():
        members.sort(key=at.__getitem__)
        run = [members[0]]
        for v in members[1:]:
            if at[v] - at[run[-1]] > NODE_SPAN:
                runs.append(run)
                run = []
            run.append(v)
        runs.append(run)
    edges = []
    for run in runs:
        if len(run) < 2:
            continue
        last, inside = run[-1], set(run)
        for v in run[:-1]:
            for u in graph.nx.predecessors(v):
                if u in ops and u not in inside and not graph.nx.has_edge(u, last):
                    edges.append((u, last))
    for u, v in dict.fromkeys(edges):
        graph.add_edge(u, v)
    return len(dict.fromkeys(edges))


def hold_bound_values(graph: ComputeGraph, blocks: Sequence[str]) -> int:
    """Python's lifetimes in a module's forward, on a captured step whose forward eager
    code runs (module mode). A value that a name of a module's ``forward`` holds (node
    attribute ``held_by``: the module's path, :func:`graphs.frames.bound_until_return`)
    lives until that forward returns, and while a checkpointed block reruns its forward,
    until the rerun stops: every later forward op of the module's call reads it (an
    edge), so that it is live at whichever of them runs last. Only modules inside a
    layer block of ``blocks`` take part: a block's rerun is its own forward again, while
    a value held by a module around the blocks is not held into the backward.

    Returns
    -------
    int
        Edges added.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v in ("a", "b", "c", "d"): g.add_node(v, bytes=4, phase="forward", module="blk.0")
    >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("c", "d")
    >>> g["a"]["held_by"] = "blk.0"
    >>> hold_bound_values(g, ["blk.0"]), sorted(g.nx.successors("a"))
    (2, ['b', 'c', 'd'])
    """
    order = [v for v in graph.order if v in graph.ops_set and graph[v]["phase"] == "forward"]
    at = {v: i for i, v in enumerate(order)}
    added = 0
    for u in order:
        module = graph[u].get("held_by")
        if module is None or not any(_inside(module, b) for b in blocks):
            continue
        for v in order[at[u] + 1:]:
            if not _inside(graph[v].get("module") or "", module):
                break  # the module's call has returned
            if not graph.nx.has_edge(u, v):
                graph.add_edge(u, v)
                added += 1
    return added


def editable_copy(graph: ComputeGraph) -> ComputeGraph:
    """A copy of ``graph`` whose nodes and edges can change, with its capture."""
    g = ComputeGraph(graph.nx.copy(), name=graph.name, order=graph.order, meta=dict(graph.meta))
    g.fx, g.capture_info = graph.fx, graph.capture_info
    return g


def checkpoint_view(graph: ComputeGraph, blocks: Sequence[str]) -> ComputeGraph:
    """The graph as eager layer-level checkpointing sees it.

    Random ops inside the blocks are recomputable, since ``torch.utils.checkpoint``
    restores the RNG state and draws the same numbers again
    (``preserve_rng_state=True``)."""
    g = editable_copy(graph)
    for v in g.ops:
        d = g[v]
        if not d["recomputable"] and d["op"] != "tangent" and d["phase"] == "forward":
            if any(_inside(d.get("module") or "", b) for b in blocks):
                d["recomputable"] = True
    return g


def _dropped(graph: ComputeGraph, nodes: tuple[list, list], action: str) -> list:
    fwd, bwd = nodes
    own = set(fwd) | set(bwd)
    drop = []
    for v in fwd:
        if saves_output(action, graph[v]["op"]):
            continue
        # internal to the block: only the block itself reads it (its output, read by
        # the next layer, is what the next layer or the next checkpoint saves)
        if all(r in own for r in graph.nx.successors(v) if graph.is_op(r) and graph[r]["op"] != "tangent"):
            drop.append(v)
    return drop


def keep_for_plan(graph: ComputeGraph, actions: Mapping[str, str], *, index: BlockIndex | None = None) -> set:
    """Forward values a plan keeps: all but those that only a checkpointed block itself
    reads, in forward or backward (minus the matmul outputs of a selective block).
    ``index``: a :class:`BlockIndex` of ``graph`` (same answer, faster)."""
    if index is not None:
        drop = set()
        for block, action in actions.items():
            if action != LayerAction.NONE:
                drop.update(index.dropped(block, action))
        return set(index.forward() - drop)
    forward = set(graph.forward_nodes())
    drop = set()
    for block, action in actions.items():
        if action == LayerAction.NONE:
            continue
        drop.update(_dropped(graph, block_nodes(graph, block), action))
    return forward - drop


def checkpoint_sequence(graph: ComputeGraph, sequence: Sequence[Hashable], actions: Mapping[str, str], *,
                        index: BlockIndex | None = None) -> list:
    """The order in which non-reentrant ``torch.utils.checkpoint`` recomputes.

    A checkpointed block reruns its whole forward at the first read of one of its
    dropped values in backward, not value by value; so every recomputation of a block's
    forward ops moves to the first of them, in the order the forward ran them. The result is valid
    when ``sequence`` is (moved ops read only kept values or earlier moved ones).

    Parameters
    ----------
    graph : ComputeGraph
    sequence : sequence of node ids
        E.g. :func:`solver.plans.sequence_from_keep` of a module plan.
    actions : mapping
        Block -> a :class:`graphs.actions.LayerAction` value.
    index : BlockIndex, optional
        Of ``graph``: the same sequence in one pass.

    Returns
    -------
    list

    Notes
    -----
    O(len(sequence) x number of blocks); O(len(sequence)) with an ``index`` of blocks
    that do not nest.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(2)
    >>> checkpoint_sequence(g, ["f0", "f1", "loss", "b1", "b0"], {})
    ['f0', 'f1', 'loss', 'b1', 'b0']
    """
    out = list(sequence)
    forward = index.forward() if index is not None else None
    try:
        first_bwd = next(i for i, v in enumerate(out) if (v not in forward if forward is not None else
                                                           graph[v]["phase"] == "backward"))
    except StopIteration:
        return out
    if index is not None and not index.nested:
        return _gather_recomputations(out, first_bwd, actions, index)
    for block, action in actions.items():
        if action == LayerAction.NONE:
            continue
        fwd = set(index.nodes(block)[0] if index is not None else block_nodes(graph, block)[0])
        pos = [i for i, v in enumerate(out) if i > first_bwd and v in fwd]
        if len(pos) < 2:
            continue
        moved = _projections_together(graph, _forward_order([out[i] for i in pos], out[:first_bwd]))
        drop = set(pos)
        rest = [v for i, v in enumerate(out) if i not in drop]
        out = rest[: pos[0]] + moved + rest[pos[0]:]
    return out


def _gather_recomputations(out: list, first_bwd: int, actions: Mapping[str, str], index: BlockIndex) -> list:
    """:func:`checkpoint_sequence` for blocks that share no node, in one pass: moving one
    block's recomputations to its first one keeps the relative order of every other
    step, so the moves commute and each block's steps after ``first_bwd`` can be
    gathered at the first of them at once."""
    member: dict[Hashable, str] = {}
    for block, action in actions.items():
        if action != LayerAction.NONE:
            for v in index.nodes(block)[0]:
                member[v] = block
    if not member:
        return out
    steps: dict[str, list] = {}
    for v in out[first_bwd + 1:]:
        b = member.get(v)
        if b is not None:
            steps.setdefault(b, []).append(v)
    result = out[: first_bwd + 1]
    gathered: set = set()
    for v in out[first_bwd + 1:]:
        b = member.get(v)
        if b is None or len(steps[b]) < 2:
            result.append(v)
        elif b not in gathered:
            gathered.add(b)
            result.extend(_projections_together(index.graph, _forward_order(steps[b], out[:first_bwd])))
    return result


def _forward_order(steps: list, forward: Sequence[Hashable]) -> list:
    """``steps`` (one block's recomputation) in the order of their first run in
    ``forward``, as the block's forward runs them again: a recomputation built value by
    value may run an op early (a tensor's copy before an unrelated matmul, freeing what
    it copies) where torch's rerun of the forward holds it longer. Stable: a step not in
    ``forward``, or repeated, keeps its place among its equals.

    Examples
    --------
    >>> _forward_order(["c", "a", "b"], ["a", "b", "c"])
    ['a', 'b', 'c']
    """
    first: dict = {}
    for i, v in enumerate(forward):
        first.setdefault(v, i)
    end = len(first)
    return sorted(steps, key=lambda v: first.get(v, end))


def _projections_together(graph: ComputeGraph, steps: list) -> list:
    """``steps`` (one block's recomputation, as its forward runs it again) with the
    projections of a multi-output op (node attribute ``group``) computed together, at
    the first of them: the block's forward runs the op once and gets them all (a
    ``native_dropout``'s result and mask), where apart the simulator would charge a run
    of the op for each. A projection that appears more than once stays where it is.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("x", bytes=1); g.add_node("p0", bytes=1, group="t", group_index=0)
    >>> g.add_node("y", bytes=1); g.add_node("p1", bytes=1, group="t", group_index=1)
    >>> _projections_together(g, ["x", "p0", "y", "p1"])
    ['x', 'p0', 'p1', 'y']
    """
    nodes = graph.nx.nodes
    count: dict = {}
    for v in steps:
        count[v] = count.get(v, 0) + 1
    groups: dict = {}
    for v in steps:
        grp = nodes[v].get("group")
        if grp is not None and count[v] == 1:
            groups.setdefault(grp, []).append(v)
    follow = {vs[0]: vs[1:] for vs in groups.values() if len(vs) > 1}
    if not follow:
        return steps
    later = {v for vs in follow.values() for v in vs}
    out: list = []
    for v in steps:
        if v not in later:
            out.append(v)
            out.extend(follow.get(v, ()))
    return out


def _offloads(graph: ComputeGraph, sequence: list, blocks: Sequence[str]) -> list:
    """Every value of the offloaded blocks that their backward reads goes to the host right
    after its last forward use and comes back just before its first backward use."""
    from solver.methods.offload import offload_windows

    first_bwd = next(i for i, v in enumerate(sequence) if graph[v]["phase"] == "backward")
    offs = []
    for w in offload_windows(graph, sequence):
        mod = graph[w.node].get("module") or ""
        if graph[w.node]["phase"] != "forward" or not any(_inside(mod, b) for b in blocks):
            continue
        if w.out_first < first_bwd <= w.in_last:
            offs.append(w.offload(w.out_first, w.in_last))
    return offs


SELECTIVE_ACTIONS = (LayerAction.SELECTIVE, LayerAction.SAVE_MATMULS)


def _storage_owner(graph: ComputeGraph, v: Hashable) -> Hashable:
    """The node whose storage ``v`` aliases (``v`` itself when it owns its storage)."""
    seen = {v}
    while graph[v].get("alias_of") in graph.nx and graph[v]["alias_of"] not in seen:
        v = graph[v]["alias_of"]
        seen.add(v)
    return v


def sac_view(graph: ComputeGraph, actions: Mapping[str, str], sequence: Sequence[Hashable], *,
             index: BlockIndex | None = None) -> ComputeGraph:
    """The graph as selective checkpointing runs ``actions``: torch's SAC caches the
    output of every op its rule saves (:func:`graphs.actions.saves_output`) from the
    forward until the block's recomputation, whether or not backward reads it. Each such
    value reads as an input of the block's first backward op in ``sequence``, so the
    simulator holds it (and the storage it aliases) that long. Without a selective
    block, ``graph`` itself.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v, op, ph in [("a", "aten.add.Tensor", "forward"), ("b", "aten.bmm.default", "forward"),
    ...                   ("gb", "aten.mm.default", "backward")]:
    ...     g.add_node(v, op=op, phase=ph, module="layer", bytes=4)
    >>> g.add_edge("a", "b"); g.add_edge("b", "gb")
    >>> sorted(sac_view(g, {"layer": "selective"}, ["a", "b", "gb"]).nx.predecessors("gb"))
    ['a', 'b']
    """
    edges = _sac_edges(graph, actions, sequence, index=index)
    if edges is None:
        return graph
    g = editable_copy(graph)
    g.nx.add_edges_from(edges)
    g._invalidate()
    return g


def _sac_edges(graph: ComputeGraph, actions: Mapping[str, str], sequence: Sequence[Hashable], *,
               index: BlockIndex | None = None) -> list | None:
    """The edges that :func:`sac_view` adds to ``graph`` (None without a selective block)."""
    sac = {b: a for b, a in actions.items() if a in SELECTIVE_ACTIONS}
    if not sac:
        return None
    at = {v: i for i, v in reversed(list(enumerate(sequence)))}
    edges: dict = {}
    for block, action in sac.items():
        fwd, bwd = index.nodes(block) if index is not None else block_nodes(graph, block)
        bwd = [v for v in bwd if v in at]
        if not bwd:
            continue
        first = min(bwd, key=at.__getitem__)
        for v in fwd:
            if graph[v]["op"] == "tangent" or not saves_output(action, graph[v]["op"]):
                continue
            owner = _storage_owner(graph, v)  # a cached view holds its base's storage
            for u in {v, owner}:
                if graph.is_op(u) and not graph.nx.has_edge(u, first):
                    edges[(u, first)] = None
    return list(edges)


@contextlib.contextmanager
def _with_edges(graph: ComputeGraph, edges: list | None):
    """``graph`` with ``edges`` (none of them in it) for the length of the block."""
    if not edges:
        yield graph
        return
    graph.nx.add_edges_from(edges)
    try:
        yield graph
    finally:
        graph.nx.remove_edges_from(edges)


def plan_schedule(graph: ComputeGraph, actions: Mapping[str, str], *, bandwidth: float | None = None,
                  index: BlockIndex | None = None):
    """The schedule that a per-block plan runs, and its simulation.

    Checkpointed blocks drop what :func:`keep_for_plan` drops and recompute it at the
    start of their backward (as torch does); offloaded blocks move their saved values to
    the host (needs ``bandwidth``, bytes per graph time unit). ``index``: a
    :class:`BlockIndex` of ``graph`` over the plan's blocks, for pricing many plans.

    Returns
    -------
    (Schedule, SimulationResult)
    """
    ckpt = {b: a for b, a in actions.items() if a in CHECKPOINTED}
    keep = keep_for_plan(graph, ckpt, index=index)
    seq = checkpoint_sequence(graph, sequence_from_keep(graph, keep) if index is None else
                              index.sequence_from_keep(keep), ckpt, index=index)
    off_blocks = [b for b, a in actions.items() if a == LayerAction.OFFLOAD]
    offs = []
    if off_blocks:
        if not bandwidth:
            raise NoScheduleFound("offloading a block needs a host bandwidth")
        offs = _offloads(graph, seq, off_blocks)
    sched = Schedule(sequence=seq, offloads=offs, bandwidth=bandwidth if offs else None, method="module_plan",
                     info={"order": "fixed", "actions": dict(actions)})
    if index is None:
        res = simulate(sac_view(graph, ckpt, seq), sched)
    else:  # the same edges, read as the graph's, instead of a copy of it with them
        edges = _sac_edges(graph, ckpt, seq, index=index)
        res = None if offs else index.simulate(seq, edges)
        if res is None:
            with _with_edges(graph, edges) as view:
                res = simulate(view, sched)
    if not res.valid:  # pragma: no cover - the builders make valid sequences
        raise NoScheduleFound(f"plan {dict(actions)} gives an invalid sequence: {res.error}")
    sched.peak_bytes, sched.cost, sched.base_cost = res.peak_bytes, res.cost, res.base_cost
    return sched, res


def plan_modules(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    blocks: Sequence[str],
    actions: Iterable[str] = DEFAULT_ACTIONS,
    bandwidth: float | None = None,
    time_limit: float | None = None,
    measured: Mapping[str, float] | None = None,
) -> ModulePlan:
    """Choose an action per block so that the step fits with the least extra cost.

    Parameters
    ----------
    graph : ComputeGraph
        Nodes carry ``module`` (set by :func:`graphs.capture`).
    budget_bytes : int
    blocks : sequence of str
        Candidate module paths (e.g. the layers of a transformer); not nested.
    actions : iterable of str
        Allowed actions, in order of strength (``"none"`` is always allowed; add
        ``"offload"`` with a ``bandwidth``).
    bandwidth : float, optional
        Host link bytes per graph time unit, for offload.
    time_limit : float, optional
        Seconds for the search.
    measured : mapping of str to float, optional
        Seconds of one block's forward and backward under each action, measured
        (:func:`graphs.module_mode.measure_block_actions`; ``"none"`` and ``"full"``
        needed). A measured action costs a block what checkpointing it whole costs on
        the graph, times the measured ratio of their extra seconds: what a selective
        policy's dispatch costs, which the graph's op times leave out, is priced in, and
        a policy that measures slower than checkpointing the block whole is never
        chosen over it.

    Returns
    -------
    ModulePlan
        Its schedule refers to :func:`checkpoint_view` of ``graph``; with ``measured``,
        ``schedule.info["priced_cost"]`` is the cost the search compared.

    Raises
    ------
    InfeasibleBudget
        No plan found fits; carries the smallest peak of the plans that apply one action
        to every block.

    Notes
    -----
    Greedy: each round simulates every stronger action of every block and takes the one
    that lowers the peak most per unit of extra cost (or the cheapest that fits); once
    the step fits, blocks are downgraded again while it still fits. O(rounds x blocks x
    actions) simulations, each O(graph).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=8)
    >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
    >>> p = plan_modules(g, 40, blocks=["layers.0", "layers.1"])
    >>> p.schedule.peak_bytes <= 40
    True
    """
    graph = checkpoint_view(graph, blocks)
    index = BlockIndex(graph, blocks)
    fast = [True]

    simulated: dict[tuple, float] = {}

    def price(plan: dict) -> tuple:
        res = index.price(plan) if fast[0] else None
        if res is not None:
            out = res.peak_bytes, res.cost, None
        else:
            sched, res = plan_schedule(graph, plan, bandwidth=bandwidth, index=index)
            out = res.peak_bytes, res.cost, sched
        simulated[tuple(plan.get(b, LayerAction.NONE.value) for b in blocks)] = out[1]
        return out

    if measured:
        price = _measured_pricing(price, blocks, measured)
    plan, (peak, cost, sched), smallest, evaluations = greedy_block_plan(
        blocks, actions, budget_bytes, price, time_limit=time_limit)
    if measured:
        priced, cost = cost, simulated[tuple(plan[b] for b in blocks)]
    if sched is None:  # priced from its pieces: the schedule itself, graded again
        sched, res = plan_schedule(graph, plan, bandwidth=bandwidth, index=index)
        if (res.peak_bytes, res.cost) != (peak, cost):  # pragma: no cover - tested equal
            log.warning("per-block pricing disagrees with the simulator on %s; searching again without it", plan)
            fast[0] = False
            plan, (peak, cost, sched), smallest, evaluations = greedy_block_plan(
                blocks, actions, budget_bytes, price, time_limit=time_limit)
    if peak > budget_bytes:
        raise InfeasibleBudget(budget_bytes, smallest, what="peak with per-block checkpointing")
    if measured:
        sched.info = dict(sched.info, priced_cost=priced, measured=dict(measured))
    return ModulePlan(actions=plan, schedule=sched, evaluations=evaluations, blocks=list(blocks), graph=graph)


def _measured_pricing(price, blocks: Sequence[str], measured: Mapping[str, float]):
    """``price`` with the extra cost of each measured action on a block replaced by the
    graph's extra cost of checkpointing that block whole, times the measured ratio of
    the action's extra seconds to checkpointing's (see :func:`plan_modules`); actions
    not measured keep the graph's."""
    none, full = LayerAction.NONE.value, LayerAction.FULL.value
    if none not in measured or full not in measured:
        raise ValueError(f"measured needs the seconds of 'none' and 'full', got {sorted(measured)}")
    span = float(measured[full]) - float(measured[none])
    ratio = {a: (max(0.0, float(t) - float(measured[none])) / span if span > 0 else (1.0 if a == full else 0.0))
             for a, t in measured.items()}
    ratio[full] = 1.0
    plain = {b: none for b in blocks}
    base = price(plain)[1]
    extra: dict[tuple[str, str], float] = {}

    def alone(b: str, a: str) -> float:
        """The graph's extra cost of ``a`` on block ``b`` alone."""
        if (b, a) not in extra:
            extra[(b, a)] = price(dict(plain, **{b: a}))[1] - base
        return extra[(b, a)]

    def priced(plan: dict) -> tuple:
        peak, cost, payload = price(plan)
        if any(a in ratio and a != full for a in plan.values()):
            cost = cost + sum((alone(b, full) * ratio[a] - alone(b, a)) for b, a in plan.items()
                              if a in ratio and a not in (none, full))
        return peak, cost, payload

    return priced


def greedy_block_plan(blocks: Sequence[str], actions: Iterable[str], budget_bytes: int, price, *,
                      time_limit: float | None = None) -> tuple[dict, tuple, int, int]:
    """The per-block search of :func:`plan_modules`, for any pricing of a plan.

    From "none" everywhere, upgrade (in the order of ``actions``) the block whose
    upgrade fits, else saves the most peak per unit of extra cost, until the plan fits;
    then downgrade every block the budget no longer needs. O(blocks^2 x actions) prices.

    Parameters
    ----------
    blocks : sequence of str
    actions : iterable of str
        From cheapest to most memory-saving; "none" is always allowed.
    budget_bytes : int
    price : callable
        ``plan -> (peak_bytes, cost, payload)``; called once per distinct plan.
    time_limit : float, optional
        Seconds for the upgrade phase.

    Returns
    -------
    plan, (peak_bytes, cost, payload), smallest_peak, evaluations
        ``smallest_peak`` is the least peak of a uniform plan or the plan found (what an
        infeasible budget should name).

    Examples
    --------
    >>> peaks = {"none": 10, "full": 4}
    >>> price = lambda plan: (sum(peaks[a] for a in plan.values()), sum(a == "full" for a in plan.values()), None)
    >>> greedy_block_plan(["a", "b"], ["none", "full"], 14, price)[0]
    {'a': 'full', 'b': 'none'}
    """
    blocks = list(blocks)
    allowed = [LayerAction.NONE.value] + [a for a in actions if a != LayerAction.NONE]
    rank = {a: i for i, a in enumerate(allowed)}
    cache: dict[tuple, tuple] = {}

    def evaluate(plan: dict) -> tuple:
        key = tuple(plan[b] for b in blocks)
        if key not in cache:
            cache[key] = price(plan)
        return cache[key]

    t0 = time.perf_counter()
    plan = {b: LayerAction.NONE.value for b in blocks}
    cur = evaluate(plan)
    while cur[0] > budget_bytes:
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
        best = None
        for b in blocks:
            for a in allowed[rank[plan[b]] + 1:]:
                trial = dict(plan, **{b: a})
                new = evaluate(trial)
                gain = cur[0] - new[0]
                fits = new[0] <= budget_bytes
                if gain <= 0 and not fits:
                    continue
                extra = max(new[1] - cur[1], 1e-12 * max(1.0, cur[1]))
                key = (fits, -new[1] if fits else gain / extra)
                if best is None or key > best[0]:
                    best = (key, trial, new)
        if best is None:
            break
        _, plan, cur = best
    if cur[0] > budget_bytes:
        # the greedy path can miss a uniform plan that fits: the smallest peak named to
        # the caller is one of them, and asking for it must succeed
        uniform = [({b: a for b in blocks}, evaluate({b: a for b in blocks})) for a in allowed]
        fitting = [(p, c) for p, c in uniform if c[0] <= budget_bytes]
        if not fitting:
            return plan, cur, min(min(c[0] for _, c in uniform), cur[0]), len(cache)
        plan, cur = min(fitting, key=lambda pc: pc[1][1])
    improved = True
    while improved:  # downgrade what the budget no longer needs
        improved = False
        for b in sorted(blocks, key=lambda b: -rank[plan[b]]):
            for a in allowed[: rank[plan[b]]]:
                trial = dict(plan, **{b: a})
                new = evaluate(trial)
                if new[0] <= budget_bytes and new[1] < cur[1]:
                    plan, cur, improved = trial, new, True
                    break
    return plan, cur, cur[0], len(cache)

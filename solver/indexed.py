"""The op nodes of a :class:`graphs.ComputeGraph` as integers, and the store-all peak of
an order on them: the shared infrastructure of the heuristic and exact methods.

An :class:`IndexedGraph` numbers the ops ``0..n-1`` in the reference order with their
bytes, workspaces, predecessors and successors as lists, so that inner loops of the
methods (:mod:`solver.methods.eviction`, :mod:`solver.methods.minpeak`,
:mod:`solver.methods.auto`) run on plain integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphs import ComputeGraph

__all__ = ["IndexedGraph", "order_peak", "peak_profile", "ancestry_masks"]


@dataclass
class IndexedGraph:
    """The op nodes of a :class:`ComputeGraph` as integers ``0..n-1`` (reference order).

    Attributes
    ----------
    ids : list
        Node id of each index.
    preds, succs : list of list of int
        Op inputs and op readers of each index (deduplicated).
    nbytes : list of int
    time : list of float
    workspace : list of int
    output : list of bool
        Values that stay resident until the end once computed.
    pinned : list of bool
        Values that must never be evicted (outputs and non-recomputable ops).
    fixed : int
        Bytes resident for the whole step.
    recomputable : list of bool
        ``False`` for ops that must run exactly once (random ops).
    after : list of list of int
        Extra ordering predecessors: ops whose first run must come before (from
        ``graph.meta["ordered"]``, consecutive entries).
    """

    ids: list
    preds: list
    succs: list
    nbytes: list
    time: list
    workspace: list
    output: list
    pinned: list
    fixed: int
    recomputable: list = None
    after: list = None

    def __post_init__(self):
        if self.recomputable is None:
            self.recomputable = [True] * len(self.ids)
        if self.after is None:
            self.after = [[] for _ in self.ids]
        self.before = [[] for _ in self.ids]
        for v, ps in enumerate(self.after):
            for p in ps:
                self.before[p].append(v)

    @classmethod
    def of(cls, graph: ComputeGraph) -> "IndexedGraph":
        """Index ``graph`` (O(nodes + edges))."""
        ids = list(graph.order)
        index = {v: i for i, v in enumerate(ids)}
        preds = [sorted({index[u] for u in graph.op_preds(v)}) for v in ids]
        succs: list[list[int]] = [[] for _ in ids]
        for i, ps in enumerate(preds):
            for p in ps:
                succs[p].append(i)
        nodes = graph.nx.nodes
        output = [bool(nodes[v].get("output", False)) for v in ids]
        recomputable = [bool(nodes[v].get("recomputable", True)) for v in ids]
        pinned = [o or not r for r, o in zip(recomputable, output)]
        after: list[list[int]] = [[] for _ in ids]
        chain = [index[v] for v in graph.meta.get("ordered") or () if v in index]
        for a, b in zip(chain, chain[1:]):
            if a != b:
                after[b].append(a)
        return cls(
            ids=ids,
            preds=preds,
            succs=succs,
            nbytes=[int(nodes[v]["bytes"]) for v in ids],
            time=[float(nodes[v]["time"]) for v in ids],
            workspace=[int(nodes[v].get("workspace", 0)) for v in ids],
            output=output,
            pinned=pinned,
            fixed=graph.fixed_bytes,
            recomputable=recomputable,
            after=after,
        )

    def order_preds(self, v: int) -> list[int]:
        """Ops that must run before ``v`` first runs: data inputs and ordering constraints."""
        return self.preds[v] + self.after[v] if self.after[v] else self.preds[v]

    def order_succs(self, v: int) -> list[int]:
        """Ops that must first run after ``v``: data readers and ordering constraints."""
        return self.succs[v] + self.before[v] if self.before[v] else self.succs[v]

    def is_order(self, order: Sequence[int]) -> bool:
        """Whether ``order`` runs every op once, inputs and ordering constraints first."""
        if len(order) != self.n:
            return False
        pos = [-1] * self.n
        for i, v in enumerate(order):
            if pos[v] >= 0:
                return False
            pos[v] = i
        return all(pos[p] < pos[v] for v in range(self.n) for p in self.order_preds(v))

    @property
    def n(self) -> int:
        return len(self.ids)

    def footprint_bound(self) -> int:
        """Largest bytes any op needs resident by itself (inputs, output, workspace)."""
        best = 0
        for v in range(self.n):
            f = self.nbytes[v] + self.workspace[v] + sum(self.nbytes[p] for p in self.preds[v])
            best = max(best, f)
        return best


def ancestry_masks(preds: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Strict ancestors and descendants of every op, as bit masks over op indices.

    ``preds[i]`` lists the ops that op ``i`` depends on; the indices must be a
    topological order (the reference order is). O(edges x ops / word size).

    Examples
    --------
    >>> ancestry_masks([[], [0], [1]])
    ([0, 1, 3], [6, 4, 0])
    """
    n = len(preds)
    anc = [0] * n
    for i in range(n):
        a = 0
        for j in preds[i]:
            a |= anc[j] | (1 << j)
        anc[i] = a
    desc = [0] * n
    for i in reversed(range(n)):
        for j in preds[i]:
            desc[j] |= desc[i] | (1 << i)
    return anc, desc


def order_peak(ix: IndexedGraph, order: Sequence[int]) -> int:
    """Peak bytes (fixed bytes excluded) of running ``order`` once, store-all.

    Same memory model as :func:`solver.simulate` for a sequence without repeats.
    O(nodes + edges).

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> ix = IndexedGraph.of(chain(3, bytes=[1, 2, 3]))
    >>> order_peak(ix, [0, 1, 2])
    5
    """
    return max(peak_profile(ix, order), default=0)


def peak_profile(ix: IndexedGraph, order: Sequence[int]) -> list[int]:
    """Bytes in use at each step of ``order`` run once, store-all (fixed bytes excluded)."""
    pending = [len(s) for s in ix.succs]
    nb, preds, out, ws = ix.nbytes, ix.preds, ix.output, ix.workspace
    mem = 0
    prof = []
    for v in order:
        prof.append(mem + nb[v] + ws[v])
        mem += nb[v]
        for p in preds[v]:
            pending[p] -= 1
            if pending[p] == 0 and not out[p]:
                mem -= nb[p]
        if pending[v] == 0 and not out[v]:
            mem -= nb[v]
    return prof

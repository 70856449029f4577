"""Exact search by layer blocks: solve each distinct block exactly, compose by a DP.

A training graph of a layered model is a chain of blocks: the forward pass cut at its
articulation points (:func:`solver.plans.forward_stages`), each block with the backward
ops that work on it. Values that every layer reads (an attention mask, rotary tables)
would hide the cuts; :func:`block_chain` sets such *shared* values aside (they stay
resident for the whole step) when that reveals a longer chain.

The family searched: every block keeps a subset of its forward values for its backward;
a value it does not keep is computed again, with its missing ancestors from the nearest
kept ones, right before the first backward op of the block that reads it
(:func:`solver.plans.sequence_from_keep` with one region per block). A block may also
drop its output (the next block's input): the next block's backward computes it again,
from values the block keeps or from the block's input when the block below keeps that.

1. **Distinct blocks.** Blocks with the same structure (op names, bytes and edges, in
   order; the repeated layers of a model) are solved once.
2. **Exact per block.** For a distinct block, the Pareto front of (kept bytes, time of
   what is computed again) is found by a small MILP (SCIP) at a series of kept-bytes
   limits -- or by enumeration when the block has at most :data:`ENUMERATE_MAX` free
   choices. Each point of the front is one option of the block, with its forward and
   backward peaks replayed under the simulator's rules.
3. **Composition.** A DP over the chain of blocks picks one option per block: state the
   bytes kept by the blocks below (in slots) and whether the block below keeps its
   output; constraints the forward peak of each block and the peak of its backward
   (kept bytes below, the gradients passing through, the block's own replay with its
   incoming gradients and just-in-time recomputation); cost the sum of the options'
   recomputation. It is exact for that additive model; on small layered chains it
   matches the enumerated optimum of the family.
4. **The judge.** The sequences of the DP's best answers at the budget and at a few
   lower internal limits are graded by :func:`solver.simulate`; the cheapest that fits
   wins. The method's own cost is never trusted.

Rockmate (Zhao et al., ICML 2023) solves blocks with an ILP and composes them with the
rotor DP; here the composition keeps every block's forward run once (no nested
recomputation of whole blocks), which is the regime of moderate budgets. Complexity:
O(distinct blocks x levels) small MILPs, then O(blocks x options x slots).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from graphs import ComputeGraph
from solver.errors import NoScheduleFound
from solver.methods.chain import local_peak
from solver.plans import Stage, forced_keep, forward_stages, has_backward, sequence_from_keep, stage_regions
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["Block", "BlockChain", "BlockOption", "block_chain", "block_options", "block_dp", "per_block_schedule", "per_block",
           "ENUMERATE_MAX", "LEVELS", "SLOTS"]

log = logging.getLogger(__name__)

#: Blocks with at most this many free keep/recompute choices are solved by enumeration.
ENUMERATE_MAX = 8
#: Kept-bytes limits at which a block's MILP is solved (points of its Pareto front).
LEVELS = 24
#: Memory resolution of the composition DP.
SLOTS = 800
#: Shared values (read across blocks) set aside may add up to at most this fraction of
#: the forward values' bytes.
SHARED_FRACTION = 0.05


@dataclass
class BlockOption:
    """One way to run a block: what it keeps and what its backward computes again.

    Attributes
    ----------
    keep : frozenset
        Forward values of the block kept from their first computation to their backward.
    again : frozenset
        Forward values of the block computed again in the backward (its own, and the
        next block's when the block drops its output).
    kept_bytes : int
    cost : float
        Time of what is computed again.
    fwd_peak, bwd_peak : int
        Peaks of the block's forward run and backward (recomputation included), the
        blocks below and the gradients still to be read not counted.
    next_peak : int
        Peak of computing the block's output again for the next block's backward (0
        when the block keeps it).
    needs_prev : bool
        That recomputation starts from the block's input, which the block below must
        keep.
    keeps_output : bool
    """

    keep: frozenset
    again: frozenset
    kept_bytes: int
    cost: float
    fwd_peak: int = 0
    bwd_peak: int = 0
    next_peak: int = 0
    needs_prev: bool = False
    keeps_output: bool = True


@dataclass
class Block:
    """One link of the block chain: a stage and the options found for it."""

    stage: Stage
    signature: tuple
    options: list = field(default_factory=list)
    exact: bool = True


@dataclass
class BlockChain:
    """The chain of blocks of a training graph.

    Attributes
    ----------
    blocks : list of Block
    shared : frozenset
        Forward values set aside as resident for the whole step.
    grad : list of int
        ``grad[i]``: bytes of backward values made by blocks above ``i`` and read only
        below it (or step outputs): resident through block ``i``'s backward;
        ``grad[len(blocks)] = 0``.
    incoming : list of list
        ``incoming[i]``: backward values made by blocks above ``i`` whose last reader is
        in block ``i``'s backward.
    distinct : int
        How many distinct block structures there are.
    """

    blocks: list
    shared: frozenset
    grad: list
    incoming: list = field(default_factory=list)
    distinct: int = 0

    @property
    def stages(self) -> list:
        return [b.stage for b in self.blocks]

    @property
    def repeats(self) -> int:
        """How many blocks share the most common structure."""
        counts: dict = {}
        for b in self.blocks:
            counts[b.signature] = counts.get(b.signature, 0) + 1
        return max(counts.values(), default=0)


def _cut_count(fwd: list, succs: dict, pos: dict, shared: set) -> int:
    cuts, reach = 0, -1
    for i, v in enumerate(fwd):
        if reach <= i:
            cuts += 1
        if v in shared:
            continue
        reach = max(reach, max((pos[w] for w in succs[v]), default=i))
    return cuts


def _shared_values(graph: ComputeGraph, fwd: list, deadline=None) -> set:
    """Forward values whose readers span far, set aside when that reveals more cuts.

    The values are taken longest span first; the prefix that gives the most cuts within
    :data:`SHARED_FRACTION` of the forward bytes (the smallest such prefix) is kept; once
    ``deadline`` (a :class:`~solver.deadline.Deadline`) has passed, the best prefix so far
    (each count reads every forward edge)."""
    fset = set(fwd)
    pos = {v: i for i, v in enumerate(fwd)}
    succs = {v: [w for w in graph.op_succs(v) if w in fset] for v in fwd}
    span = {v: max((pos[w] for w in succs[v]), default=pos[v]) - pos[v] for v in fwd}
    wide = sorted((v for v in fwd if span[v] > max(4, len(fwd) // 16)), key=lambda v: -span[v])[:64]
    total = sum(int(graph[v]["bytes"]) for v in fwd)
    best, best_cuts = set(), _cut_count(fwd, succs, pos, set())
    chosen: set = set()
    spent = 0
    for v in wide:
        spent += int(graph[v]["bytes"])
        if spent > SHARED_FRACTION * total or (deadline is not None and deadline.expired()):
            break
        chosen.add(v)
        c = _cut_count(fwd, succs, pos, chosen)
        if c > best_cuts + 1:  # one more cut is noise; shared values reveal many
            best, best_cuts = set(chosen), c
    return best


def _signature(graph: ComputeGraph, st: Stage, prev: Hashable | None, shared: set) -> tuple:
    local = {v: i for i, v in enumerate(st.forward)}
    blocal = {v: i for i, v in enumerate(st.backward)}
    rows = []
    for v in st.forward:
        d = graph[v]
        ins = tuple(sorted(local[u] if u in local else (-1 if u == prev else -2)
                           for u in graph.op_preds(v) if u in local or u == prev or u in shared))
        readers = tuple(sorted(blocal[w] for w in graph.op_succs(v) if w in blocal))
        rows.append((str(d.get("op")), int(d["bytes"]), int(d.get("workspace", 0)), ins, readers,
                     bool(d.get("recomputable", True)), bool(d.get("output", False))))
    for v in st.backward:
        d = graph[v]
        rows.append((str(d.get("op")), int(d["bytes"]), int(d.get("workspace", 0))))
    return tuple(rows)


def _repeats(ids: list) -> list[tuple[int, int]]:
    """Cut a list of stage structure ids into runs: ``(start, length)`` of each group,
    a repeated period (a layer) where consecutive copies of one appear, single stages
    elsewhere. The period covering most stages wins (the shorter on ties); the parts
    before and after it are cut the same way."""
    n = len(ids)
    best = None  # (coverage, -p, start, p, copies)
    for p in range(1, min(64, n // 2) + 1):
        # run[i]: how many of ids[i], ids[i+1], ... equal the id p places on; the copies
        # of ids[start:start+p] that follow it are run[start] // p (O(n) per period)
        run = [0] * (n - p + 1)
        for i in range(n - p - 1, -1, -1):
            run[i] = run[i + 1] + 1 if ids[i] == ids[i + p] else 0
        for start in range(0, n - 2 * p + 1):
            copies = 1 + run[start] // p
            if copies >= 2 and (best is None or (p * copies, -p) > best[:2]):
                best = (p * copies, -p, start, p, copies)
    if best is None:
        return [(i, 1) for i in range(n)]
    _, _, start, p, copies = best
    head = _repeats(ids[:start])
    tail = [(start + p * copies + a, b) for a, b in _repeats(ids[start + p * copies:])]
    return head + [(start + j * p, p) for j in range(copies)] + tail


def _merge(stages: list, runs: list[tuple[int, int]]) -> list:
    out = []
    for k, (a, p) in enumerate(runs):
        st = Stage(index=k)
        for s in stages[a:a + p]:
            st.forward.extend(s.forward)
        for s in reversed(stages[a:a + p]):  # the backward runs from the last stage down
            st.backward.extend(s.backward)
        out.append(st)
    return out


def block_chain(graph: ComputeGraph, *, layers: bool = True, deadline=None) -> BlockChain:
    """Find the chain of blocks of a training graph (no options yet).

    Parameters
    ----------
    graph : ComputeGraph
    layers : bool
        Merge the stages of each repeated layer into one block (default); ``False``
        keeps one block per stage.
    deadline : solver.deadline.Deadline, optional
        Checked between the passes over the graph (on dense graphs of thousands of ops,
        each takes a second or more).

    Returns
    -------
    BlockChain

    Raises
    ------
    NoScheduleFound
        The graph has no backward or no chain of at least two blocks (forward and
        backward interleaved, or no articulation point even with shared values set
        aside); use a general method such as ``eviction``.
    solver.deadline.OutOfTime
        ``deadline`` passed before the chain was found.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> c = block_chain(training_chain(3), layers=False)
    >>> [b.stage.forward for b in c.blocks], c.distinct
    ([['f0'], ['f1'], ['f2', 'loss']], 3)
    """
    if not has_backward(graph):
        raise NoScheduleFound(f"block_dp: {graph.name or 'the graph'} has no backward; "
                              "use a general method such as 'eviction' or 'order_search'")
    from solver.deadline import Deadline

    deadline = deadline or Deadline(None)
    fwd = [v for v in graph.order if graph.is_op(v) and graph[v]["phase"] == "forward"]
    shared = _shared_values(graph, fwd, deadline)
    deadline.check("looking for the chain of blocks")
    # output gradients (``op="tangent"``) read the step's outputs only to come after them
    # (updated buffers, say); the outputs stay resident anyway, so those reads tie no
    # block to another
    tied = [(u, w) for w in graph.ops if graph[w].get("op") == "tangent" for u in graph.op_preds(w)]
    view = graph
    if shared or tied:
        view = graph.without_edges([(u, w) for u in shared for w in graph.nx.successors(u)] + tied)
    stages = forward_stages(view)  # NoScheduleFound when forward reads backward values
    deadline.check("looking for the chain of blocks")
    if len(stages) < 2:
        raise NoScheduleFound(f"block_dp: {graph.name or 'the graph'} is one block (no articulation point "
                              "between forward and backward); use a general method such as 'eviction'")
    if layers:
        sigs: dict = {}
        ids = [sigs.setdefault(_signature(graph, st, stages[st.index - 1].boundary if st.index else None, shared),
                               len(sigs)) for st in stages]
        deadline.check("looking for the chain of blocks")
        stages = _merge(stages, _repeats(ids))
    stage_of_b = {v: st.index for st in stages for v in st.backward}
    L = len(stages)
    grad = [0] * (L + 1)
    incoming: list = [[] for _ in range(L)]
    for v, s in stage_of_b.items():
        readers = [stage_of_b.get(w, s) for w in graph.op_succs(v)]
        low = -1 if graph[v].get("output", False) else min(readers, default=s)
        for i in range(low + 1, s):
            grad[i] += int(graph[v]["bytes"])
        if 0 <= low < s:
            incoming[low].append(v)
    blocks = []
    for st in stages:
        prev = stages[st.index - 1].boundary if st.index else None
        blocks.append(Block(stage=st, signature=_signature(graph, st, prev, shared)))
    return BlockChain(blocks=blocks, shared=frozenset(shared), grad=grad, incoming=incoming,
                      distinct=len({b.signature for b in blocks}))


# ------------------------------------------------------------------- one block
class _Problem:
    """The keep / compute-again choice of one block, in block-local indices."""

    def __init__(self, graph: ComputeGraph, chain: BlockChain, k: int, forced: set):
        st = chain.blocks[k].stage
        self.ops = list(st.forward)
        local = {v: i for i, v in enumerate(self.ops)}
        nodes = graph.nx.nodes
        n = len(self.ops)
        self.size = [int(nodes[v]["bytes"]) for v in self.ops]
        self.time = [float(nodes[v]["time"]) for v in self.ops]
        own = set(st.backward)
        nxt = set(chain.blocks[k + 1].stage.backward) if k + 1 < len(chain.blocks) else set()
        self.fixed = [False] * n  # always kept (zero bytes, not recomputable, outputs, shared)
        self.need1 = [False] * n  # read by this block's backward
        self.need2 = [False] * n  # read by the next block's backward
        self.preds = []
        self.from_prev = [False] * n  # reads the block's input
        for i, v in enumerate(self.ops):
            self.fixed[i] = self.size[i] == 0 or v in forced or v in chain.shared
            readers = set(graph.op_succs(v))
            self.need1[i] = bool(readers & own)
            self.need2[i] = bool(readers & nxt)
            if any(nodes[w]["phase"] == "backward" and w not in own and w not in nxt for w in readers):
                self.fixed[i] = True  # read by a farther backward: keep it (outside the family)
            ps = []
            for u in graph.op_preds(v):
                if u in local:
                    ps.append(local[u])
                elif u not in chain.shared:
                    self.from_prev[i] = True
            self.preds.append(ps)
        # the values worth deciding: those needed and their ancestors in the block
        a, b, _ = self.closure(set())
        self.free = sorted(a | b)

    def closure(self, keep: set) -> tuple[set, set, bool]:
        """What the backward computes again with ``keep`` kept: (for this block, for the
        next block, whether the latter reads the block's input)."""
        def walk(targets):
            out, stack = set(), list(targets)
            while stack:
                i = stack.pop()
                if i in out or i in keep or self.fixed[i]:
                    continue
                out.add(i)
                stack.extend(self.preds[i])
            return out
        a = walk([i for i in range(len(self.ops)) if self.need1[i]])
        b = walk([i for i in range(len(self.ops)) if self.need2[i]])
        return a, b, any(self.from_prev[i] for i in b)

    def cost_of(self, keep: set) -> tuple[float, set, set, bool]:
        a, b, prev = self.closure(keep)
        return sum(self.time[i] for i in a) + sum(self.time[i] for i in b), a, b, prev

    def kept_bytes(self, keep: set) -> int:
        return sum(self.size[i] for i in set(keep) | {i for i in range(len(self.ops)) if self.fixed[i]})


def _enumerate(p: _Problem, allow_prev: bool) -> list[set]:
    """Every keep set of the free values (those whose recomputation for the next block
    reads the block's input only if ``allow_prev``); :func:`_undominated` reduces them
    once their peaks are replayed."""
    out = []
    for bits in itertools.product((0, 1), repeat=len(p.free)):
        keep = {i for i, b in zip(p.free, bits) if b}
        if p.cost_of(keep)[3] == allow_prev:
            out.append(keep)
    return out


def _front(points: list) -> list[set]:
    points.sort(key=lambda x: (x[0], x[1]))
    out, best = [], math.inf
    for nb, cost, keep in points:
        if cost < best - 1e-12:
            out.append(keep)
            best = cost
    return out


def _milp_front(p: _Problem, *, allow_prev: bool, levels: int, deadline) -> tuple[list[set], bool]:
    """The Pareto front at ``levels`` kept-bytes limits, each by an exact MILP (the next
    block's recomputation may read the block's input only if ``allow_prev``)."""
    from solver.lp_backend import create_solver, solve_quietly

    n = len(p.ops)
    lo = p.kept_bytes(set())
    hi = p.kept_bytes(set(p.free))
    points, exact = [], True
    limits = sorted({int(lo + (hi - lo) * j / max(1, levels - 1)) for j in range(levels)}, reverse=True)
    s = create_solver("SCIP")
    keep = {i: s.BoolVar("") for i in p.free}
    r1 = [s.NumVar(0.0, 1.0, "") for _ in range(n)]
    r2 = [s.NumVar(0.0, 1.0 if allow_prev or not p.from_prev[i] else 0.0, "") for i in range(n)]
    for i in range(n):
        if deadline is not None and i % 256 == 0 and deadline.expired():
            return [], False  # building the model alone ran out of time (dense blocks)
        k = keep.get(i)
        for r, need in ((r1, p.need1[i]), (r2, p.need2[i])):
            if p.fixed[i]:
                r[i].SetUb(0.0)
                continue
            if need:  # r >= 1 - keep
                c = s.Constraint(1.0, s.infinity())
                c.SetCoefficient(r[i], 1.0)
                if k is not None:
                    c.SetCoefficient(k, 1.0)
            for j in p.preds[i]:  # r_j >= r_i - keep_j
                if p.fixed[j]:
                    continue
                c = s.Constraint(0.0, s.infinity())
                c.SetCoefficient(r[j], 1.0)
                c.SetCoefficient(r[i], -1.0)
                kj = keep.get(j)
                if kj is not None:
                    c.SetCoefficient(kj, 1.0)
    mem = s.Constraint(-s.infinity(), float(hi - lo))
    for i, k in keep.items():
        mem.SetCoefficient(k, float(p.size[i]))
    obj = s.Objective()
    for i in range(n):
        obj.SetCoefficient(r1[i], p.time[i])
        obj.SetCoefficient(r2[i], p.time[i])
    obj.SetMinimization()
    for limit in limits:  # the same model at each kept-bytes limit, largest first
        if deadline is not None and deadline.expired():
            exact = False
            break
        mem.SetUb(float(limit - lo))
        if deadline is not None and math.isfinite(deadline.left()):
            s.SetTimeLimit(max(1, int(1000 * deadline.left())))
        status = solve_quietly(s)
        if status not in (s.OPTIMAL, s.FEASIBLE):
            continue
        exact = exact and status == s.OPTIMAL
        chosen = {i for i, k in keep.items() if k.solution_value() > 0.5}
        cost, _, _, prev = p.cost_of(chosen)
        if prev == allow_prev:
            points.append((p.kept_bytes(chosen), cost, chosen))
    return _front(points), exact


def block_options(graph: ComputeGraph, chain: BlockChain, *, levels: int = LEVELS,
                  time_limit: float | None = None) -> BlockChain:
    """Fill each block's options: the exact Pareto front of its distinct structure.

    Parameters
    ----------
    graph : ComputeGraph
    chain : BlockChain
        From :func:`block_chain`; its blocks get ``options`` (and ``exact``).
    levels : int
        Kept-bytes limits at which a block too large to enumerate is solved.
    time_limit : float, optional
        Seconds for all the blocks' solves; a block whose front is cut short by it is
        marked ``exact = False``.

    Returns
    -------
    BlockChain
        The same object.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3)
    >>> c = block_options(g, block_chain(g))
    >>> [len(b.options) for b in c.blocks]  # keep the layer's output or compute it again
    [2, 2, 4]
    """
    from solver.deadline import Deadline

    deadline = Deadline(time_limit)
    fronts: dict = {}
    nodes = graph.nx.nodes
    forced = forced_keep(graph)
    for k, blk in enumerate(chain.blocks):
        p = _Problem(graph, chain, k, forced)
        key = (blk.signature, tuple(p.need2), tuple(p.fixed))
        if key not in fronts:
            keeps, exact = [], True
            for allow_prev in ((False, True) if any(p.need2) and any(p.from_prev) else (False,)):
                if len(p.free) <= ENUMERATE_MAX:
                    keeps += _enumerate(p, allow_prev)
                else:
                    front, proven = _milp_front(p, allow_prev=allow_prev, levels=levels, deadline=deadline)
                    keeps += front
                    exact = exact and proven
            fronts[key] = (keeps or [set(p.free)], exact)
        keeps, exact = fronts[key]
        blk.exact = exact
        st = blk.stage
        blk.options = []
        own_bwd = set(st.backward)
        outgoing = {v for v in st.backward
                    if nodes[v].get("output", False) or any(w not in own_bwd for w in graph.op_succs(v))}
        for keep in keeps:
            cost, own, nxt, prev = p.cost_of(keep)
            kept = {p.ops[i] for i in set(keep) | {i for i in range(len(p.ops)) if p.fixed[i]}}
            fwd_peak = local_peak(graph, st.forward, [], kept | {st.boundary})
            kept_in = [v for v in kept if nodes[v]["bytes"]]
            bwd_peak = local_peak(graph, _just_in_time(graph, [p.ops[i] for i in sorted(own)], st.backward),
                                   kept_in + chain.incoming[k], outgoing)
            redo_next = [p.ops[i] for i in sorted(nxt)]
            next_peak = local_peak(graph, redo_next, kept_in, {st.boundary}) if redo_next else 0
            blk.options.append(BlockOption(keep=frozenset(kept), again=frozenset(p.ops[i] for i in own | nxt),
                                           kept_bytes=p.kept_bytes(keep), cost=cost, fwd_peak=int(fwd_peak),
                                           bwd_peak=int(bwd_peak), next_peak=int(next_peak), needs_prev=prev,
                                           keeps_output=st.boundary in kept))
        if len(p.free) <= ENUMERATE_MAX:
            blk.options = _undominated(blk.options)
        # on ties the DP keeps the first: the options that keep their output (the best
        # modelled) come first
        blk.options.sort(key=lambda o: (not o.keeps_output, o.needs_prev))
    return chain


def _just_in_time(graph: ComputeGraph, redo: list, backward: list) -> list:
    """The block's backward with each recomputation (``redo``, in forward order) right
    before the first backward op that needs it, as :func:`~solver.plans.sequence_from_keep`
    places them."""
    pos = {v: i for i, v in enumerate(redo)}
    placed: set = set()
    out: list = []

    def bring(v) -> None:
        todo, stack = set(), [v]
        while stack:
            u = stack.pop()
            if u in pos and u not in placed and u not in todo:
                todo.add(u)
                stack.extend(graph.op_preds(u))
        for u in sorted(todo, key=pos.get):
            placed.add(u)
            out.append(u)

    for b in backward:
        for u in graph.op_preds(b):
            bring(u)
        out.append(b)
    return out


def _undominated(options: list) -> list:
    """The options that no other beats or equals on every figure the DP reads."""
    def figures(o):
        return (o.kept_bytes, o.cost, o.fwd_peak, o.bwd_peak, o.next_peak, o.needs_prev, not o.keeps_output)

    out = []
    for o in options:
        f = figures(o)
        if not any(all(a <= b for a, b in zip(figures(q), f)) and figures(q) != f for q in options):
            if all(figures(q) != f for q in out):
                out.append(o)
    return out


# ------------------------------------------------------------------ composition
def _compose(chain: BlockChain, room: int, slots: int) -> list | None:
    """The options (one per block) of least total cost whose modelled peaks fit ``room``,
    or None. State: the bytes the blocks below keep (in slots, rounded up) and whether
    the block below keeps its output."""
    unit = max(1, math.ceil(room / slots))
    top = room // unit
    L = len(chain.blocks)
    f = np.full((2, top + 1), np.inf)
    f[1, 0] = 0.0  # nothing below the first block: its input is always there
    cols = np.arange(top + 1)
    choice = []
    for k, blk in enumerate(chain.blocks):
        g = np.full((2, top + 1), np.inf)
        arg = np.full((2, top + 1, 3), -1, dtype=np.int64)
        for o, opt in enumerate(blk.options):
            kept = math.ceil(opt.kept_bytes / unit)
            # the prefix must leave room for the forward run, the backward and the
            # recomputation of the output for the next block's backward
            cap = min(room - opt.fwd_peak, room - chain.grad[k] - opt.bwd_peak,
                      room - chain.grad[k] - opt.next_peak - opt.kept_bytes)
            mmax = min(top - kept, cap // unit) if cap >= 0 else -1
            if mmax < 0:
                continue
            nb = int(opt.keeps_output)
            for bit in ((1,) if opt.needs_prev else (0, 1)):
                src = f[bit, :mmax + 1] + opt.cost
                dst = cols[:mmax + 1] + kept
                better = src < g[nb, dst]
                g[nb, dst[better]] = src[better]
                arg[nb, dst[better]] = np.stack([np.full(better.sum(), o), cols[:mmax + 1][better],
                                                 np.full(better.sum(), bit)], axis=1)
        choice.append(arg)
        f = g
    if not np.isfinite(f).any():
        return None
    bit, m = np.unravel_index(int(np.argmin(f)), f.shape)
    picks = [0] * L
    for k in reversed(range(L)):
        o, prev, pbit = choice[k][bit, m]
        picks[k] = int(o)
        m, bit = int(prev), int(pbit)
    return picks


def _search(graph: ComputeGraph, chain: BlockChain, budget: int, slots: int, deadline):
    """Grade the DP's answers at the budget, then at lower internal limits until one fits,
    then at a few higher ones (the model is conservative): ``(best, smallest peak, tries)``
    with ``best = (sequence, SimulationResult, model cost)`` or None."""
    nodes = graph.nx.nodes
    room = budget - graph.fixed_bytes - sum(int(nodes[v]["bytes"]) for v in chain.shared)
    if room <= 0:
        return None, None, 0
    regions = stage_regions(graph, chain.stages)
    tried: dict = {}
    best, best_peak = None, None

    def attempt(limit: int):
        nonlocal best, best_peak
        picks = _compose(chain, limit, slots)
        if picks is None:
            return None
        key = tuple(picks)
        if key in tried:
            return tried[key]
        keep = set(chain.shared)
        for blk, o in zip(chain.blocks, picks):
            keep |= blk.options[o].keep
        seq = sequence_from_keep(graph, keep, regions=regions)
        r = simulate(graph, seq)
        tried[key] = r
        model = sum(blk.options[o].cost for blk, o in zip(chain.blocks, picks))
        if r.valid:
            best_peak = r.peak_bytes if best_peak is None else min(best_peak, r.peak_bytes)
            if r.peak_bytes <= budget and (best is None or r.cost < best[1].cost):
                best = (seq, r, model)
        return r

    limit = room
    for _ in range(32):
        r = attempt(limit)
        if r is None or (r.valid and r.peak_bytes <= budget) or deadline.expired():
            break
        over = (r.peak_bytes - budget) if r.valid else limit // 50
        limit -= max(int(over) // 2, limit // 1000, 1)
        if limit <= 0:
            break
    for j in range(1, 9):  # the model is conservative: higher limits may fit too
        if deadline.expired():
            break
        attempt(int(room * (1 + 0.04 * j)))
    return best, best_peak, len(tried)


@register("block_dp", family="large", order="fixed")
def block_dp(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
             levels: int = LEVELS, slots: int = SLOTS, min_repeats: int = 0) -> Schedule:
    """Solve each distinct layer block exactly, compose the blocks by a DP (module docstring).

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
        Peak bytes allowed, fixed bytes included.
    time_limit : float, optional
        Seconds for the blocks' exact solves (the DP and the grading take milliseconds
        to a second more).
    levels : int
        Kept-bytes limits per block MILP (points of each block's Pareto front).
    slots : int
        Memory resolution of the composition DP.
    min_repeats : int
        Refuse (``NoScheduleFound``) a chain whose most common block structure repeats
        fewer times: where the layers are few, the heuristics tend to do better.

    Returns
    -------
    Schedule
        ``info``: ``blocks``, ``distinct_blocks``, ``shared`` (values set aside),
        ``blocks_exact`` (every block's front proven), ``model_cost`` (the DP's own
        figure, never used to grade).

    Raises
    ------
    NoScheduleFound
        No chain of blocks (see :func:`block_chain`), or no composition fits.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver import simulate
    >>> g = training_chain(4)
    >>> s = block_dp(g, 100)
    >>> simulate(g, s).valid, s.info["blocks"]
    (True, 4)
    """
    from solver.deadline import Deadline, OutOfTime

    deadline = Deadline(time_limit)
    best, best_peak, tried, chains = None, None, 0, []
    for layers in (True, False):
        if chains and time_limit is not None and deadline.left() < 0.5 * float(time_limit):
            break  # the per-stage chain only when time is left
        try:
            chain = block_chain(graph, layers=layers, deadline=deadline)
        except OutOfTime as exc:
            if not chains:
                raise OutOfTime(f"block_dp: {exc} of {graph.name or 'the graph'}; give more time or use "
                                "a general method such as 'eviction'") from exc
            break
        if not chains and chain.repeats < min_repeats:
            raise NoScheduleFound(f"block_dp: no block of {graph.name or 'the graph'} repeats {min_repeats} "
                                  f"times (at most {chain.repeats}); pass min_repeats=0 to run it anyway")
        if chains and [b.stage.forward for b in chain.blocks] == [b.stage.forward for b in chains[0].blocks]:
            continue
        chains.append(chain)
        share = None if time_limit is None else max(0.0, 0.4 * deadline.left())
        block_options(graph, chain, levels=levels, time_limit=share)
        found, peak, n = _search(graph, chain, int(budget_bytes), slots, deadline)
        tried += n
        if peak is not None:
            best_peak = peak if best_peak is None else min(best_peak, peak)
        if found is not None and (best is None or found[1].cost < best[1].cost):
            best = found + (chain,)
    if best is None:
        raise NoScheduleFound(
            f"block_dp: no composition of the {len(chains[-1].blocks)} blocks fits {budget_bytes} B"
            + (f" (its smallest simulated peak is {best_peak} B)" if best_peak is not None else "")
            + "; use a general method such as 'eviction' or 'checkmate_milp'", best_peak=best_peak)
    seq, r, model, chain = best
    return Schedule(sequence=seq, method="block_dp",
                    info={"order": "fixed", "plan": "block_dp", "blocks": len(chain.blocks),
                          "distinct_blocks": chain.distinct, "shared": len(chain.shared),
                          "blocks_exact": all(b.exact for b in chain.blocks), "model_cost": float(model),
                          "options": sum(len(b.options) for b in chain.blocks), "candidates": tried})


def per_block_schedule(graph: ComputeGraph, *, blocks=None) -> Schedule | None:
    """The schedule that checkpointing every layer block runs (``torch.utils.checkpoint``
    around each block, non-reentrant), graded by the simulator: each block keeps its
    input and what code outside it reads, drops what only the block itself reads, and
    computes that again for its backward. Of the two ways to place the recomputation,
    all of a block's at its first backward read (as torch does) or each value just
    before its first backward read, the one with the lower simulated peak (then the
    lower cost). A value the graph marks not recomputable (a random op the rewrite does
    not replay) stays kept.

    It is what a user gets with one line, so it is a floor for every plan: ``auto``
    starts from it, and a budget it meets is never called infeasible.

    Parameters
    ----------
    graph : ComputeGraph
        Op nodes carry the innermost ``module`` that ran them (as captured).
    blocks : sequence of str, optional
        Module paths of the layers; default ``graph.meta["layer_blocks"]`` where a
        planner recorded the model's, else those the DAG shows
        (:func:`graphs.layers.graph_layer_blocks`).

    Returns
    -------
    Schedule or None
        ``peak_bytes``, ``cost`` and ``base_cost`` filled; ``info["blocks"]`` the block
        paths. None without a backward or without two blocks.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=8)
    >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
    >>> s = per_block_schedule(g)
    >>> s.info["blocks"], s.peak_bytes < simulate(g, g.order).peak_bytes
    (['layers.0', 'layers.1'], True)
    """
    from graphs.layers import graph_layer_blocks
    from solver.module_plan import BlockIndex, checkpoint_sequence, keep_for_plan

    if not has_backward(graph):
        return None
    if blocks is None:
        blocks = graph.meta.get("layer_blocks") or graph_layer_blocks(graph)
    blocks = [b for b in blocks if b]
    if len(blocks) < 2:
        return None
    actions = {b: "full" for b in blocks}
    index = BlockIndex(graph, blocks)
    if not any(index.nodes(b)[0] for b in blocks):
        return None
    keep = keep_for_plan(graph, actions, index=index)
    plain = sequence_from_keep(graph, keep)
    best = None
    for seq in (checkpoint_sequence(graph, plain, actions, index=None if index.nested else index), plain):
        r = simulate(graph, seq)
        if r.valid and (best is None or (r.peak_bytes, r.cost) < (best[1].peak_bytes, best[1].cost)):
            best = (seq, r)
    if best is None:  # pragma: no cover - sequence_from_keep builds valid sequences
        return None
    seq, r = best
    sched = Schedule(sequence=list(seq), method="per_block",
                     info={"order": "fixed", "plan": "per_block", "blocks": list(blocks)})
    sched.peak_bytes, sched.cost, sched.base_cost = r.peak_bytes, r.cost, r.base_cost
    return sched


@register("per_block", family="baseline", order="fixed")
def per_block(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None, blocks=None) -> Schedule:
    """Checkpoint every layer block (:func:`per_block_schedule`).

    Raises
    ------
    NoScheduleFound
        The graph shows no layer blocks, or the schedule does not fit (its peak is the
        error's ``best_peak``).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(4, fwd_bytes=8)
    >>> for i in range(4): g[f"f{i}"]["module"] = g[f"b{i}"]["module"] = f"layers.{i // 2}"
    >>> per_block(g, 1000).method
    'per_block'
    """
    sched = per_block_schedule(graph, blocks=blocks)
    if sched is None:
        raise NoScheduleFound(f"per_block: {graph.name or 'the graph'} shows no layer blocks (ops whose module "
                              "paths repeat); pass blocks=")
    if sched.peak_bytes > budget_bytes:
        raise NoScheduleFound(f"per_block: checkpointing every block peaks at {sched.peak_bytes} B, over "
                              f"{budget_bytes} B", best_peak=sched.peak_bytes)
    return sched

"""How little memory a step can possibly run in.

``peak_lower_bound`` is the classic bound: every op needs its inputs, its output and its
workspace resident at once, on top of the fixed bytes. It is exact for chains and for the
public CNN graphs; :func:`smallest_feasible_peak` pairs it with a schedule that reaches it
(or the best one found), which is what :class:`~solver.InfeasibleBudget` reports.

``run_once_peak_bound`` adds what ops that run only once force (random ops such as a
dropout's mask, the loss's tangent): at the first run of an op ``v``, a run-once value
``x`` computed before it, with readers after it, cannot be made again, so every path of
data from ``x`` to a value read after ``v`` (or to a step output) passes through a copy
resident while ``v`` runs. The resident bytes beside ``v``'s own footprint are at least
the flow that those paths carry with each value's bytes as its capacity, summed over the
run-once values (a multicommodity flow is at most any cut of it). On a captured 4-layer
GPT with dropout it raises the bound from 0.14x to 0.33x the store-all peak. It holds
for schedules that recompute, not for those that offload (an offloaded copy is not
resident); the footprint bound holds for both.

``last_computed_peak_bound`` looks further back than one op. A set of values resident
together at some step was made by steps before it: the value among them computed last
ran while all the others were already resident, with its own inputs and workspace. So
the set ``S`` resident at a step forces the set ``S - {x} | inputs(x)`` at an earlier
step, for whichever ``x`` the schedule computed last, and each of those steps needs its
bytes. A budget is ruled out when, from some op's inputs, every way back to the step's
inputs (the empty set) passes a step above it: a search over these sets (the black
pebble game played backward), exhaustive where it proves. On a captured ResNet it
raises the bound from 0.445x to 0.53x the store-all peak, where 0.536x is reached:
in every order some convolution backward of the first block runs with its 8 MiB
workspace while a gradient of the other branch is held. Like the run-once bound it is for schedules
that recompute, not for those that offload.
"""

from __future__ import annotations

import time as _time
from typing import Hashable

from graphs import ComputeGraph
from graphs.units import format_bytes

__all__ = ["peak_lower_bound", "op_footprint", "least_workspaces", "run_once_peak_bound", "run_once_held",
           "last_computed_peak_bound", "last_computed_rules_out", "bisect_peak_bound"]


def op_footprint(graph: ComputeGraph, node: Hashable) -> int:
    """Bytes that must be resident while ``node`` runs: its op inputs, output, workspace.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("a", bytes=3); g.add_node("b", bytes=5); g.add_edge("a", "b")
    >>> op_footprint(g, "b")
    8
    """
    d = graph[node]
    return int(
        sum(graph[u]["bytes"] for u in graph.op_preds(node)) + d["bytes"] + d.get("workspace", 0)
    )


def least_workspaces(graph: ComputeGraph, ix) -> list[int]:
    """Each op's workspace (by index of ``ix``, an :class:`~solver.indexed.IndexedGraph`
    of ``graph``) at its least: a projection of a multi-output op that continues a run
    is charged its ``run_workspace``.

    Examples
    --------
    >>> from solver.indexed import IndexedGraph
    >>> g = ComputeGraph()
    >>> g.add_node("a", bytes=1, workspace=8, run_workspace=2)
    >>> least_workspaces(g, IndexedGraph.of(g))
    [2]
    """
    nodes = graph.nx.nodes
    return [min(ix.workspace[v], int(nodes[ix.ids[v]].get("run_workspace", ix.workspace[v]))) for v in range(ix.n)]


def peak_lower_bound(graph: ComputeGraph) -> tuple[int, Hashable | None]:
    """A peak no schedule can go below, and the op that forces it.

    ``fixed_bytes + max(max over ops of op_footprint, bytes of all step outputs)``.
    O(edges).

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i, b in enumerate([2, 6, 1]): g.add_node(i, bytes=b)
    >>> g.add_edge(0, 1); g.add_edge(1, 2)
    >>> peak_lower_bound(g)
    (8, 1)
    """
    best, culprit = 0, None
    for v in graph.ops:
        f = op_footprint(graph, v)
        if f > best:
            best, culprit = f, v
    # every output of the step is resident together at the last step
    outputs = sum(graph[v]["bytes"] for v in graph.ops if graph[v]["output"])
    if outputs > best:
        best, culprit = outputs, None
    return graph.fixed_bytes + best, culprit


def run_once_peak_bound(graph: ComputeGraph, *, time_limit: float | None = 1.0) -> tuple[int, Hashable | None, int]:
    """A peak no recomputing schedule goes below, counting what ops that run once force.

    At the first run of an op ``v``: its inputs, output and workspace, the fixed bytes,
    and for each value ``x`` of an op that must not run twice (``recomputable=False``)
    that is computed before ``v`` (an ancestor of ``v``, by data or by the random ops'
    required order) the bytes that must hold ``x``'s information for later: every path of
    data edges from ``x`` to a value that an op after ``v`` (a descendant) reads, or to a
    step output, passes through a resident copy, since nothing after ``v`` can make ``x``
    again. A flow along such paths, each value carrying at most its bytes and the
    values of ``v``'s footprint carrying nothing (they are counted already), is at most
    those bytes; the flows of the run-once values are packed greedily, one after the
    other, in what capacity the earlier ones left. Ops are tried in order of a cheap
    over-estimate, largest first, until it cannot beat the best or ``time_limit`` runs
    out (the best so far is a bound at every point). Not a bound for schedules that
    offload (an offloaded copy is not resident).

    Parameters
    ----------
    graph : ComputeGraph
    time_limit : float or None
        Seconds at most (None: no limit).

    Returns
    -------
    bound : int
        At least :func:`peak_lower_bound`'s bound (fixed bytes included).
    culprit : hashable or None
        The op at whose first run the bound holds.
    held : int
        Bytes beyond that op's own footprint that hold run-once values (0 when the
        bound is the footprint bound).

    Examples
    --------
    A dropout mask ``m`` (run once) is read by ``d``, which the backward op ``b`` reads
    after the big op ``v``: while ``v`` runs, ``m`` or ``d`` is resident besides ``v``'s
    footprint.

    >>> g = ComputeGraph()
    >>> g.add_node("m", bytes=4, recomputable=False)
    >>> for name, size in [("d", 4), ("f", 2), ("v", 10)]: g.add_node(name, bytes=size)
    >>> g.add_node("b", bytes=1, output=True)
    >>> for e in [("m", "d"), ("d", "f"), ("f", "v"), ("v", "b"), ("d", "b")]: g.add_edge(*e)
    >>> peak_lower_bound(g)[0], run_once_peak_bound(g)
    (15, (16, 'v', 4))
    """
    from solver.indexed import IndexedGraph, ancestry_masks

    lb, culprit = peak_lower_bound(graph)
    ix = IndexedGraph.of(graph)
    n = ix.n
    once = [x for x in range(n) if not ix.recomputable[x] and ix.nbytes[x] > 0]
    if not once:
        return lb, culprit, 0
    deadline = None if time_limit is None else _time.perf_counter() + float(time_limit)
    ws = least_workspaces(graph, ix)
    foot = [ix.nbytes[v] + ws[v] + sum(ix.nbytes[p] for p in ix.preds[v]) for v in range(n)]
    # ancestors and descendants (by data and the random ops' required order) as bit
    # sets, and each value's readers
    anc, desc = ancestry_masks([ix.order_preds(v) for v in range(n)])
    readers = [sum(1 << s for s in ix.succs[v]) for v in range(n)]
    # an over-estimate of what an op holds: every run-once ancestor outside its footprint
    runs_once = sum(1 << x for x in once)
    weight: dict[int, int] = {}
    extra = [0] * n
    for v in range(n):
        a = anc[v] & runs_once
        for p in ix.preds[v]:
            a &= ~(1 << p)
        if a not in weight:
            weight[a] = sum(ix.nbytes[x] for x in once if (a >> x) & 1)
        extra[v] = weight[a]
    best, best_v, best_held = lb - ix.fixed, None, 0
    for v in sorted(range(n), key=lambda v: -(foot[v] + extra[v])):
        if foot[v] + extra[v] <= best or (deadline is not None and _time.perf_counter() > deadline):
            break
        held = _held_bytes(ix, v, [x for x in once if (anc[v] >> x) & 1], desc, readers)
        if foot[v] + held > best:
            best, best_v, best_held = foot[v] + held, v, held
    if best_v is None:
        return lb, culprit, 0
    return ix.fixed + best, ix.ids[best_v], best_held


def _held_bytes(ix, v: int, once: list[int], desc: list[int], readers: list[int],
                record: dict[int, int] | None = None) -> int:
    """The greedy multicommodity flow of :func:`run_once_peak_bound` at the first run of
    ``v``: from each of ``v``'s run-once ancestors ``once`` to the values read after
    ``v`` or output. ``record``: filled with the flow of each run-once value that
    carries some."""
    cap = list(ix.nbytes)  # capacity left; v's footprint is counted already
    for u in ix.preds[v]:
        cap[u] = 0
    cap[v] = 0
    after, output, succs = desc[v], ix.output, ix.succs
    parent = [-2] * ix.n  # -2: not reached in this search
    total = 0
    for x in once:
        while cap[x] > 0:
            # breadth-first to the nearest value read after v (or an output), through
            # values with capacity left
            parent[x] = -1
            queue, head, sink = [x], 0, -1
            while head < len(queue):
                u = queue[head]
                head += 1
                if output[u] or readers[u] & after:
                    sink = u
                    break
                for w in succs[u]:
                    if parent[w] == -2 and cap[w] > 0:
                        parent[w] = u
                        queue.append(w)
            path, u = [], sink
            while sink >= 0 and u >= 0:
                path.append(u)
                u = parent[u]
            for u in queue:
                parent[u] = -2
            if sink < 0:
                break
            push = min(cap[u] for u in path)
            for u in path:
                cap[u] -= push
            total += push
            if record is not None:
                record[x] = record.get(x, 0) + push
    return total


def run_once_held(graph: ComputeGraph, culprit: Hashable) -> str | None:
    """What :func:`run_once_peak_bound` holds beside ``culprit``'s own footprint, in
    words: the kinds of run-once values whose information must stay resident (the
    model's outputs the caller holds, the output gradients that arrive once, random
    ops' results, other ops that run once), each with its bytes; None when nothing is
    held.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("m", bytes=4, recomputable=False, op="aten.bernoulli")
    >>> for name, size in [("d", 4), ("f", 2), ("v", 10)]: g.add_node(name, bytes=size)
    >>> g.add_node("b", bytes=1, output=True)
    >>> for e in [("m", "d"), ("d", "f"), ("f", "v"), ("v", "b"), ("d", "b")]: g.add_edge(*e)
    >>> g.meta["ordered"] = ["m"]
    >>> print(run_once_held(g, "v"))
    random ops' results, which are not drawn again (aten.bernoulli: 4 B)
    """
    from solver.indexed import IndexedGraph, ancestry_masks

    ix = IndexedGraph.of(graph)
    if culprit not in ix.ids:
        return None
    v = ix.ids.index(culprit)
    anc, desc = ancestry_masks([ix.order_preds(u) for u in range(ix.n)])
    once = [x for x in range(ix.n) if not ix.recomputable[x] and ix.nbytes[x] > 0 and (anc[v] >> x) & 1]
    readers = [sum(1 << s for s in ix.succs[u]) for u in range(ix.n)]
    record: dict[int, int] = {}
    _held_bytes(ix, v, once, desc, readers, record)
    drawn = set(graph.meta.get("ordered") or ())  # random ops, drawn in a required order
    kinds: dict[str, list] = {}
    for x, held in record.items():
        node = graph[ix.ids[x]]
        if node.get("op") == "tangent":
            kind = "the gradients of the model's outputs, which arrive once"
        elif node.get("output") and node.get("phase", "forward") == "forward":
            kind = "the model's outputs, which the caller holds until the step ends"
        elif ix.ids[x] in drawn:
            kind = "random ops' results, which are not drawn again"
        else:
            kind = "the results of ops that are not run again"
        ops = kinds.setdefault(kind, [0, set()])
        ops[0] += held
        ops[1].add(str(node.get("op") or ix.ids[x]).replace(".default", ""))
    if not kinds:
        return None
    return "; ".join(f"{kind} ({', '.join(sorted(ops)[:3])}{', ...' if len(ops) > 3 else ''}: {format_bytes(held)})"
                     for kind, (held, ops) in sorted(kinds.items(), key=lambda kv: -kv[1][0]))


#: Seconds at most for one budget's search in :func:`last_computed_peak_bound` (one
#: that runs out proves nothing).
PROBE_SECONDS = 0.5
#: Graphs with more ops than this are not searched by :func:`last_computed_peak_bound`
#: (nothing is proven): the sets the search holds grow past what a time limit stops
#: (docs/tuning.md).
LAST_COMPUTED_MAX_OPS = 2000


def last_computed_peak_bound(graph: ComputeGraph, *, lower: int, upper: int, first: int | None = None,
                             time_limit: float = 1.0) -> tuple[int, Hashable | None]:
    """A peak no recomputing schedule goes below, raised from ``lower`` by following what
    each op's inputs need back to the step's inputs.

    At the step an op ``x`` runs, its inputs, its output and its workspace are resident
    (:func:`op_footprint`). Of a set ``S`` of values resident together, the one the
    schedule computed last ran while the rest of ``S`` was resident, so that step needs
    ``S | inputs(x)`` and its workspace, and the set ``S - {x} | inputs(x)`` was resident
    then. A budget is ruled out when, for some op, every way back from its inputs to the
    empty set passes a step above the budget. The sets are searched depth first,
    smallest next set first, with what is known to lead back (or not) shared between
    ops; the search ends, as every set of a way back is earlier in the reference order
    than the one it came from. Values of no bytes are left out of the sets (a smaller set
    needs no more). Budgets are bisected between ``lower`` and ``upper`` to 0.1 % of
    ``upper``; a budget whose search runs out of :data:`PROBE_SECONDS` proves nothing,
    and graphs of more than :data:`LAST_COMPUTED_MAX_OPS` ops are not searched. Not a
    bound for schedules that offload.

    Parameters
    ----------
    graph : ComputeGraph
    lower : int
        A proven lower bound on the peak, fixed bytes included (:func:`peak_lower_bound`).
    upper : int
        A peak that some schedule reaches.
    first : int, optional
        The budget to probe first (one a caller asks about).
    time_limit : float
        Seconds in all.

    Returns
    -------
    bound : int
        At least ``lower``, at most ``upper``: no recomputing schedule peaks below it.
    culprit : hashable or None
        An op whose inputs cannot be made resident below the bound (None where the bound
        did not rise).

    Examples
    --------
    ``c`` reads ``a`` and ``b``, and making either needs 4 B of workspace: whichever
    is made last, the other one is held beside it, so no schedule peaks below 10 B,
    where each op alone needs at most 8 B.

    >>> g = ComputeGraph()
    >>> for name, ws in [("x", 0), ("a", 4), ("b", 4), ("c", 0)]:
    ...     g.add_node(name, bytes=2, workspace=ws)
    >>> for e in [("x", "a"), ("x", "b"), ("a", "c"), ("b", "c")]: g.add_edge(*e)
    >>> g["c"]["output"] = True
    >>> lb = peak_lower_bound(g)[0]
    >>> lb, last_computed_peak_bound(g, lower=lb, upper=12)
    (8, (10, 'c'))
    """
    if not graph.ops or len(graph.ops) > LAST_COMPUTED_MAX_OPS:
        return int(lower), None
    rules_out = _last_computed_probe(graph)
    return bisect_peak_bound(rules_out, lower=lower, upper=upper, first=first, time_limit=time_limit,
                             probe_seconds=PROBE_SECONDS, resolution=1000)


def last_computed_rules_out(graph: ComputeGraph, budget: int, *, time_limit: float = PROBE_SECONDS) -> Hashable | None:
    """An op whose inputs no recomputing schedule makes resident within ``budget`` bytes
    (fixed bytes included), or None where none is found in ``time_limit`` seconds: one
    probe of :func:`last_computed_peak_bound`.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for name, ws in [("x", 0), ("a", 4), ("b", 4), ("c", 0)]:
    ...     g.add_node(name, bytes=2, workspace=ws)
    >>> for e in [("x", "a"), ("x", "b"), ("a", "c"), ("b", "c")]: g.add_edge(*e)
    >>> last_computed_rules_out(g, 9), last_computed_rules_out(g, 10)
    ('c', None)
    """
    from solver.deadline import Deadline

    if not graph.ops or len(graph.ops) > LAST_COMPUTED_MAX_OPS:
        return None
    return _last_computed_probe(graph)(int(budget), Deadline(time_limit))


def _last_computed_probe(graph: ComputeGraph):
    """``rules_out(budget, deadline)`` for :func:`bisect_peak_bound`: the op (its id) whose
    inputs cannot be made resident within ``budget``, or None (also when the deadline
    passes)."""
    from solver.deadline import OutOfTime
    from solver.indexed import IndexedGraph

    ix = IndexedGraph.of(graph)
    ws = least_workspaces(graph, ix)
    nb = ix.nbytes
    # (the same for every budget probed) each op's inputs of some bytes, as a list and a
    # bit set, and its own step's bytes
    preds = [[p for p in ix.preds[v] if nb[p] > 0] for v in range(ix.n)]
    masks = [sum(1 << p for p in ps) for ps in preds]
    steps = sorted(((nb[v] + ws[v] + sum(nb[p] for p in preds[v]), v) for v in range(ix.n)), reverse=True)

    def rules_out(budget: int, deadline) -> Hashable | None:
        try:
            v = _no_way_back(nb, ws, preds, masks, steps, budget - ix.fixed, deadline)
        except OutOfTime:
            return None
        return None if v is None else ix.ids[v]

    return rules_out


def bisect_peak_bound(rules_out, *, lower: int, upper: int, first: int | None, time_limit: float,
                      probe_seconds: float, resolution: int):
    """The least peak not ruled out, by bisection between ``lower`` (no schedule peaks
    below it) and ``upper`` (a schedule reaches it), to ``upper / resolution``.

    ``rules_out(budget, deadline)`` proves that no schedule peaks at or below ``budget``
    by returning a witness (anything but None) before the
    :class:`~solver.deadline.Deadline` of at most ``probe_seconds`` passes, or returns
    None (nothing proven). ``first``: the budget probed first. Returns the raised bound
    and the witness of the highest budget ruled out (None where none was).

    Examples
    --------
    >>> bisect_peak_bound(lambda b, d: "why" if b < 70 else None, lower=10, upper=100,
    ...                   first=None, time_limit=1.0, probe_seconds=0.1, resolution=100)
    (70, 'why')
    """
    from solver.deadline import Deadline

    deadline = Deadline(time_limit)
    lo, hi = int(lower), max(int(lower), int(upper))  # every peak is >= lo; hi is not ruled out
    witness = None
    probe = first if first is not None and lo <= first < hi else (lo + hi) // 2
    while hi - lo > max(1, hi // resolution) and deadline.left() > 0.05:
        found = rules_out(probe, Deadline(min(probe_seconds, deadline.left())))
        if found is not None:
            lo, witness = probe + 1, found  # no schedule peaks at or below the probe
        else:
            hi = probe  # not ruled out: the bound stays below it
        probe = (lo + hi) // 2
    return lo, witness


def _no_way_back(nb: list[int], ws: list[int], preds: list[list[int]], masks: list[int],
                 steps: list[tuple[int, int]], cap: int, deadline) -> int | None:
    """An op whose inputs cannot be made resident within ``cap`` bytes (beyond the fixed
    ones), None if every op's can (see :func:`last_computed_peak_bound`). ``preds`` and
    ``masks``: each op's inputs of some bytes, as lists and bit sets; ``steps``: each
    op's own step bytes with the op, largest first. Raises
    :class:`~solver.deadline.OutOfTime`."""
    if steps and steps[0][0] > cap:
        return steps[0][1]
    good: set[int] = {0}   # sets with a way back within cap
    bad: set[int] = set()  # sets without one
    count = 0

    def after(s: int, held: int) -> list[tuple[int, int]]:
        """The sets one step back from ``s`` (of ``held`` bytes) whose step fits."""
        out = []
        rest = s
        k = 0
        while rest:
            k += 1
            if k & 63 == 0:  # (a set of thousands of values takes long to step back from)
                deadline.check("bounding the peak")
            low = rest & -rest
            rest ^= low
            x = low.bit_length() - 1
            new = sum(nb[p] for p in preds[x] if not (s >> p) & 1)
            if held + new + ws[x] <= cap:
                out.append((held - nb[x] + new, (s ^ low) | masks[x]))
        out.sort()
        return out

    for _, v in steps:
        start = masks[v]
        if start in good:
            continue
        if start in bad:
            return v
        held = sum(nb[p] for p in preds[v])
        stack = [(start, iter(after(start, held)))]
        while stack:
            count += 1
            if count & 15 == 0:
                deadline.check("bounding the peak")
            s, nexts = stack[-1]
            for held2, s2 in nexts:
                if s2 in good:
                    good.update(t for t, _ in stack)
                    stack = []
                    break
                if s2 not in bad:
                    stack.append((s2, iter(after(s2, held2))))
                    break
            else:
                bad.add(s)
                stack.pop()
        if start in bad:
            return v
    return None

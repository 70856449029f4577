"""Shared pieces of checkpointing plans: the stage chain of a training graph, and the
"checkpoint set -> sequence" builder.

Two views of the same idea (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"):

* :func:`forward_stages` cuts the forward pass at its *cut vertices* (articulation points
  of the forward graph in the reference order: every edge that leaves the ops before
  the vertex starts at the vertex itself) into a chain of stages, and gives each stage
  the backward ops that work on it. Chain algorithms (every-k, Chen, revolve, the chain
  dynamic program) see only this chain.
* :func:`sequence_from_keep` turns a set of kept forward values into a sequence in the
  style of ``torch.utils.checkpoint``: forward values that are not kept are recomputed,
  with their missing forward ancestors, right before the first backward op that needs
  them, and the recomputed copy then serves the following backward ops.

Pure graph math; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Iterable, Sequence

from graphs import BACKWARD_START, ComputeGraph
from solver.errors import NoScheduleFound
from solver.simulate import simulate

if TYPE_CHECKING:
    from solver.deadline import Deadline

__all__ = [
    "group_projection_runs",
    "tangents_together",
    "views_just_in_time",
    "Stage",
    "forward_stages",
    "forced_keep",
    "has_backward",
    "sequence_from_keep",
    "stage_regions",
    "cheapest_fitting",
    "recompute_missing",
]

_KEPT = -1  # region tag of a copy that serves every later consumer


@dataclass
class Stage:
    """One link of the stage chain.

    Attributes
    ----------
    index : int
        Position in the chain (0 = first forward stage).
    forward : list
        The stage's forward ops, in the reference order.
    backward : list
        The backward ops that work on this stage, in the reference order.
    boundary : hashable
        The stage's last forward op, a cut vertex: the only value that later stages
        read (its "checkpoint").
    """

    index: int
    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)

    @property
    def boundary(self) -> Hashable:
        return self.forward[-1]


def has_backward(graph: ComputeGraph) -> bool:
    """True when the graph has at least one backward op.

    Examples
    --------
    >>> from solver.synthetic import chain, training_chain
    >>> has_backward(chain(3)), has_backward(training_chain(2))
    (False, True)
    """
    return any(graph[v]["phase"] == "backward" for v in graph.ops)


def forced_keep(graph: ComputeGraph) -> set:
    """Forward values no plan may recompute: non-recomputable ops and step outputs.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(2); g["f0"]["recomputable"] = False
    >>> sorted(forced_keep(g))
    ['f0']
    """
    return {
        v
        for v in graph.ops
        if graph[v]["phase"] == "forward"
        and (not graph[v].get("recomputable", True) or graph[v].get("output", False))
    }


def forward_stages(graph: ComputeGraph, *, order: Sequence[Hashable] | None = None) -> list[Stage]:
    """Cut the forward pass into a chain of stages at its cut vertices.

    A forward op ``v`` closes a stage when every edge from an earlier forward op (in the
    reference order) to a later one starts at ``v`` itself, so ``v`` is the only value
    that crosses the cut. Each backward op is then given to the stage whose values it
    reads: the backward of stage ``i`` may read stage ``i``'s values and the boundary
    of stage ``i - 1`` (its input). Stages are merged until every backward op has such a
    stage and the stages of the backward ops do not increase along the reference order,
    so running the stages' backward from the last stage to the first keeps the
    reference order of the backward ops. Backward ops that read no forward value go
    with the stage of the next backward op (the first stage when none follows).

    Parameters
    ----------
    graph : ComputeGraph
    order : sequence of node ids, optional
        The reference order (default ``graph.order``).

    Returns
    -------
    list of Stage

    Raises
    ------
    NoScheduleFound
        A forward op reads a backward value (forward and backward are interleaved), so
        the graph has no stage chain.

    Notes
    -----
    O((V + E) x number of merges); the merges are few on real training graphs.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> [(s.forward, s.backward) for s in forward_stages(training_chain(3))]
    [(['f0'], ['b0']), (['f1'], ['b1']), (['f2', 'loss'], ['b2'])]
    """
    order = list(graph.order if order is None else order)
    fwd = [v for v in order if graph[v]["phase"] == "forward" and graph.is_op(v)]
    bwd = [v for v in order if graph[v]["phase"] == "backward" and graph.is_op(v)]
    if not fwd:
        return []
    fset = set(fwd)
    for v in fwd:
        for u in graph.op_preds(v):
            if u not in fset:
                raise NoScheduleFound(
                    f"forward op {v!r} reads the backward value {u!r}: the graph has no stage "
                    "chain; use a general method (e.g. 'eviction' or 'checkmate_milp')"
                )
    pos = {v: i for i, v in enumerate(fwd)}
    # cut vertices of the forward order
    cuts = []
    reach = -1
    for i, v in enumerate(fwd):
        if reach <= i:
            cuts.append(i)
        last = max((pos[w] for w in graph.op_succs(v) if w in fset), default=i)
        reach = max(reach, last)
    # ends[k] = position of the last op of stage k
    ends = sorted(set(cuts))
    if ends[-1] != len(fwd) - 1:
        ends.append(len(fwd) - 1)

    while True:
        stage_of, boundary = _label(fwd, ends)
        merge = _attribute(graph, bwd, fset, stage_of, boundary)
        if merge is None:
            break
        lo, hi = merge
        # merging stages lo..hi removes the ends of stages lo..hi-1
        ends = ends[:lo] + ends[hi:]
    stages = [Stage(index=k) for k in range(len(ends))]
    for v in fwd:
        stages[stage_of[v]].forward.append(v)
    for b, k in _assignment(graph, bwd, fset, stage_of, boundary):
        stages[k].backward.append(b)
    return stages


def _label(fwd: list, ends: list[int]) -> tuple[dict, set]:
    stage_of = {}
    k = 0
    for i, v in enumerate(fwd):
        while ends[k] < i:
            k += 1
        stage_of[v] = k
    boundary = {fwd[e] for e in ends}
    return stage_of, boundary


def _intervals(graph, bwd, fset, stage_of, boundary):
    for b in bwd:
        lo, hi = -1, 10**9
        for u in graph.op_preds(b):
            if u in fset:
                s = stage_of[u]
                lo = max(lo, s)
                hi = min(hi, s + 1 if u in boundary else s)
        yield b, lo, hi


def _attribute(graph, bwd, fset, stage_of, boundary) -> tuple[int, int] | None:
    """The first pair of stages (lo, hi) to merge, or None when the chain is consistent."""
    running = -1
    for b, lo, hi in reversed(list(_intervals(graph, bwd, fset, stage_of, boundary))):
        if lo > hi:
            return hi, lo
        k = max(lo, running)
        if k > hi:
            return hi, k
        running = k
    return None


def _assignment(graph, bwd, fset, stage_of, boundary):
    running = -1
    out = []
    for b, lo, hi in reversed(list(_intervals(graph, bwd, fset, stage_of, boundary))):
        running = max(lo, running)
        out.append((b, max(running, 0)))
    out.reverse()
    return out


def stage_regions(graph: ComputeGraph, stages: Sequence[Stage]) -> dict[Hashable, int]:
    """Regions for :func:`sequence_from_keep` that expire recomputed copies per stage.

    Forward ops are region 0; the backward ops of stage ``i`` (run from the last stage
    to the first) share one region, so a value recomputed for one stage's backward is
    recomputed again for the next stage.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(2)
    >>> stage_regions(g, forward_stages(g))["b0"]
    2
    """
    regions: dict[Hashable, int] = {}
    n = len(stages)
    for st in stages:
        for v in st.forward:
            regions[v] = 0
        for v in st.backward:
            regions[v] = n - st.index
    return regions


def sequence_from_keep(
    graph: ComputeGraph,
    keep: Iterable[Hashable],
    *,
    order: Sequence[Hashable] | None = None,
    regions: dict[Hashable, int] | None = None,
    deadline: "Deadline | None" = None,
) -> list:
    """Build a sequence that keeps ``keep`` and recomputes the other forward values.

    Runs the reference order. A forward value in ``keep`` (or forced: not recomputable,
    or a step output) has one copy that serves every consumer. Any other forward value
    serves only the consumers of its own *region*; before the first op of a later region
    that reads it, it is recomputed (with its missing forward ancestors, from the nearest
    kept values), and that copy serves the rest of that region. By default the forward
    ops form one region and all backward ops another (``torch.utils.checkpoint`` style:
    a segment is recomputed once and then serves the following backward ops), so the
    forward copy of a value that is not kept dies after its last forward consumer.
    Backward values are never recomputed.

    Parameters
    ----------
    graph : ComputeGraph
    keep : iterable of node ids
        Forward values to keep from their first computation to their last use.
    order : sequence of node ids, optional
        The op order to follow (default ``graph.order``).
    regions : dict, optional
        Node -> non-decreasing region number along ``order`` (default: 0 before the
        first backward op, 1 from it on). See :func:`stage_regions`.
    deadline : solver.deadline.Deadline, optional
        Checked as the sequence grows (:class:`~solver.deadline.OutOfTime` once past):
        the sequence of a plan that recomputes much is long (O(n^2) for a chain of n
        stages that keeps nothing).

    Returns
    -------
    list
        Node ids, recomputations repeated. Liveness is the simulator's business.

    Notes
    -----
    O(len(result) x mean in-degree).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3)
    >>> sequence_from_keep(g, {"f0"})
    ['f0', 'f1', 'f2', 'loss', 'f1', 'f2', 'loss', 'b2', 'b1', 'b0']
    """
    order = list(graph.order if order is None else order)
    kept = set(keep) | forced_keep(graph)
    if regions is None:
        regions = {}
        r = 0
        for v in order:
            if graph[v]["phase"] == "backward":
                r = 1
            regions[v] = r
    nodes = graph.nx.nodes
    avail: dict[Hashable, int] = {}
    seq: list = []

    def tag(v: Hashable, r: int) -> int:
        if v in kept or nodes[v]["phase"] != "forward":
            return _KEPT
        return r

    for v in order:
        r = regions[v]
        missing = [u for u in graph.op_preds(v) if avail.get(u) not in (_KEPT, r)]
        if missing:
            if deadline is not None:
                deadline.check("building a plan's sequence")
            _recompute(graph, missing, r, avail, seq)
        seq.append(v)
        avail[v] = tag(v, r)
    return seq


def _recompute(graph: ComputeGraph, targets: list, r: int, avail: dict, seq: list) -> None:
    """Append recomputations of ``targets`` (and missing ancestors) in a topological order."""
    recompute_missing(targets, r, avail, seq, preds=graph.op_preds,
                      forward=lambda v: graph[v]["phase"] == "forward", name=lambda v: v)


def recompute_missing(targets: list, r: int, avail: dict, seq: list, *, preds, forward, name) -> None:
    """:func:`sequence_from_keep`'s recomputation on any numbering of the ops: append
    ``targets`` and their missing ancestors to ``seq``, preds before the node.

    Parameters
    ----------
    targets : list
        Ops whose values are needed now.
    r : int
        Region tag of the recomputed copies.
    avail : dict
        Node -> region tag of its live copy (``-1``: serves every region); updated.
    seq : list
        The sequence so far; the recomputations are appended.
    preds : callable
        ``preds(v)``: the op inputs of ``v``, in the graph's order.
    forward : callable
        ``forward(v)``: whether ``v`` is a forward op (only those can be recomputed).
    name : callable
        ``name(v)``: its node id, for the error.

    Raises
    ------
    NoScheduleFound
        A backward value is needed but no longer resident.

    Examples
    --------
    >>> seq, avail = ["a", "b", "c"], {"a": -1}
    >>> recompute_missing(["c"], 1, avail, seq, preds={"b": ["a"], "c": ["b"]}.__getitem__,
    ...                   forward=lambda v: True, name=str)
    >>> seq
    ['a', 'b', 'c', 'b', 'c']
    """
    # iterative post-order DFS: preds before the node
    done: set = set()
    for t in targets:
        if t in done or avail.get(t) in (_KEPT, r):
            continue
        stack = [(t, False)]
        while stack:
            v, expanded = stack.pop()
            if v in done:
                continue
            if expanded:
                done.add(v)
                seq.append(v)
                avail[v] = r
                continue
            if not forward(v):
                raise NoScheduleFound(f"backward value {name(v)!r} is needed but no longer resident")
            stack.append((v, True))
            for u in preds(v):
                if u not in done and avail.get(u) not in (_KEPT, r):
                    stack.append((u, False))


def cheapest_fitting(
    graph: ComputeGraph,
    candidates: Iterable[tuple[list, dict]],
    budget_bytes: int,
    *,
    method: str,
    deadline: "Deadline | None" = None,
) -> tuple[list, dict]:
    """The cheapest candidate sequence whose simulated peak fits the budget.

    Every candidate is graded by :func:`solver.simulate`; ties go to the lower peak.
    With a ``deadline``, the candidates are taken until it passes (a candidate that
    builds its sequence with the same deadline stops there too), and the cheapest that
    fits among those is the answer.

    Parameters
    ----------
    graph : ComputeGraph
    candidates : iterable of (sequence, info)
        ``info`` describes the setting that produced the sequence (kept in the schedule).
    budget_bytes : int
    method : str
        Named in the error message.
    deadline : solver.deadline.Deadline, optional
        When to stop taking candidates.

    Returns
    -------
    (sequence, info)
        ``info`` gains ``"candidates"``, the number of settings tried, and with a
        deadline that passed first, ``"complete": False``.

    Raises
    ------
    NoScheduleFound
        No candidate is valid and within the budget; ``best_peak`` is the smallest
        valid peak seen. When the deadline passed first, the message says so.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3)
    >>> seq, info = cheapest_fitting(g, [(list(g.order), {"k": 0})], 100, method="demo")
    >>> info["k"], info["candidates"]
    (0, 1)
    """
    from solver.deadline import OutOfTime

    best = None
    best_peak = None
    tried = 0
    timed_out = False
    it = iter(candidates)
    while True:
        try:
            if deadline is not None:
                deadline.check("trying settings")
            item = next(it, None)
            if item is None:
                break
            seq, info = item
            tried += 1
            r = simulate(graph, seq, deadline=deadline)
        except OutOfTime:
            timed_out = True
            break
        if not r.valid:
            continue
        if best_peak is None or r.peak_bytes < best_peak:
            best_peak = r.peak_bytes
        if r.peak_bytes <= budget_bytes:
            key = (r.cost, r.peak_bytes)
            if best is None or key < best[0]:
                best = (key, seq, info)
    if best is None:
        raise NoScheduleFound(
            f"{method}: none of its {tried} settings fits {budget_bytes} B"
            + (" (the time limit passed before it could try more)" if timed_out else "")
            + (f" (its smallest peak is {best_peak} B)" if best_peak is not None else "")
            + ("; give a longer time_limit, raise the budget or use a general method such as 'eviction'"
               if timed_out else "; raise the budget or use a general method such as 'eviction' or 'checkmate_milp'"),
            best_peak=best_peak,
        )
    _, seq, info = best
    info = dict(info)
    info["candidates"] = tried
    if timed_out:
        info["complete"] = False
    return seq, info


def tangents_together(graph: ComputeGraph, sequence: Sequence[Hashable]) -> list:
    """Move every output gradient (``op="tangent"``) to just before the step where the
    backward starts (:data:`graphs.BACKWARD_START`), the ops between them to before them.

    A step's output gradients all arrive at once, when the backward starts; a schedule
    that runs forward ops between two of them would count the later ones as arriving
    later. Tangents only start later here, so no step uses more memory than before.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v, op in [("y", "mm"), ("t1", "tangent"), ("z", "mm"), ("t2", "tangent"),
    ...               (BACKWARD_START, BACKWARD_START), ("gy", "mm")]:
    ...     g.add_node(v, op=op, bytes=1)
    >>> tangents_together(g, ["y", "t1", "z", "t2", BACKWARD_START, "gy"])
    ['y', 'z', 't1', 't2', '<backward>', 'gy']
    """
    seq = list(sequence)
    if BACKWARD_START not in graph.nx or BACKWARD_START not in seq:
        return seq
    nodes = graph.nx.nodes
    cut = seq.index(BACKWARD_START)
    head = seq[:cut]
    tangents = [v for v in head if v in nodes and nodes[v].get("op") == "tangent"]
    others = [v for v in head if not (v in nodes and nodes[v].get("op") == "tangent")]
    return others + tangents + seq[cut:]


def _is_view(graph: ComputeGraph, v: Hashable) -> bool:
    """A zero-byte alias that a rewrite can derive again at no cost (a view or
    ``detach``; not an in-place op, whose ATen name ends in ``_``)."""
    d = graph.nx.nodes[v] if v in graph.nx else None
    if d is None or d.get("alias_of") is None or d.get("bytes", 0) or d.get("group") is not None:
        return False
    name = str(d.get("op", "")).split(".")
    return not (len(name) > 1 and name[1].endswith("_"))


def views_just_in_time(graph: ComputeGraph, sequence: Sequence[Hashable]) -> list:
    """Run every view (a zero-byte alias, :func:`_is_view`) right before its first reader,
    and drop a view's run that nothing reads before the view runs again.

    A rewrite derives views from the current copy of their base when they are read;
    a view run early would read an older copy of the base and, in the simulator, keep
    that copy alive until then. Only view steps move, so no step needs more memory; a
    view that nothing reads keeps its place.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for v in ["a", "b", "c"]: g.add_node(v, bytes=4)
    >>> g.add_node("va", bytes=0, alias_of="a", op="aten.view.default")
    >>> g.add_edge("a", "va"); g.add_edge("va", "c"); g.add_edge("a", "c"); g.add_edge("a", "b")
    >>> views_just_in_time(g, ["a", "va", "b", "c"])
    ['a', 'b', 'va', 'c']
    >>> views_just_in_time(g, ["a", "va", "b", "va", "c"])
    ['a', 'b', 'va', 'c']
    """
    nx_graph = graph.nx
    out: list = []
    pending: dict = {}  # view -> index in ``out`` of its placeholder slot (None: not yet placed)
    held: list = []     # pending views in the order they ran

    def place(v) -> None:
        for u in nx_graph.predecessors(v):
            if u in pending:
                place(u)
        if v in pending:
            del pending[v]
            held.remove(v)
            out.append(v)

    for v in sequence:
        if _is_view(graph, v):
            if v in pending:       # the earlier run was never read: only this one counts
                held.remove(v)
            pending[v] = True
            held.append(v)
            continue
        for u in nx_graph.predecessors(v):
            if u in pending:
                place(u)
        out.append(v)
    if held:  # views nobody read after their run: back where they were
        return _with_unread_views(graph, sequence, out, held)
    return out


def _with_unread_views(graph: ComputeGraph, sequence: Sequence[Hashable], out: list, unread: list) -> list:
    """Put the last run of each unread view back after the same non-view steps as in
    ``sequence`` (after the views put back there before it, before the views that
    ``out`` runs there). O(len(sequence) + len(out))."""
    views: dict = {}

    def is_view(s: Hashable) -> bool:
        if s not in views:
            views[s] = _is_view(graph, s)
        return views[s]

    wanted = set(unread)
    before: dict = {}  # unread view -> non-view steps before its last run
    count = 0
    for s in sequence:
        if s in wanted:
            before[s] = count
        if not is_view(s):
            count += 1
    # the steps of ``out`` split at its non-view steps: segment k holds the views
    # between the k-th non-view step and the next one
    heads: list = []
    segments: list[list] = [[]]
    for s in out:
        if is_view(s):
            segments[-1].append(s)
        else:
            heads.append(s)
            segments.append([])
    back: set = set()
    for v in unread:  # in the order they ran
        seg = segments[before[v]]
        pos = 0
        while pos < len(seg) and seg[pos] in back:  # after views put back there before
            pos += 1
        seg.insert(pos, v)
        back.add(v)
    result = list(segments[0])
    for head, seg in zip(heads, segments[1:]):
        result.append(head)
        result.extend(seg)
    return result


def group_projection_runs(graph: ComputeGraph, sequence: Sequence[Hashable]) -> list:
    """Move the first computation of every projection of a multi-output op (node
    attribute ``group``) next to its first-computed sibling, in group order, so that one
    run of the op yields them all instead of running it again for each.

    The result has the same steps; whether it still fits is the simulator's call.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> g.add_node("x", bytes=1); g.add_node("p0", bytes=1, group="t", group_index=0)
    >>> g.add_node("y", bytes=1); g.add_node("p1", bytes=1, group="t", group_index=1)
    >>> g.add_edge("x", "p0"); g.add_edge("x", "p1"); g.add_edge("x", "y")
    >>> group_projection_runs(g, ["x", "p0", "y", "p1"])
    ['x', 'p0', 'p1', 'y']
    """
    nodes = graph.nx.nodes
    seen: set = set()
    first_index: dict = {}
    for i, v in enumerate(sequence):
        if v not in seen:
            seen.add(v)
            first_index[v] = i
    members: dict = {}
    for v in first_index:
        grp = nodes[v].get("group") if v in nodes else None
        if grp is not None:
            members.setdefault(grp, []).append(v)
    moved: dict = {}  # step index of the anchor -> siblings to emit right after it
    skip: set = set()
    for grp, vs in members.items():
        if len(vs) < 2:
            continue
        vs.sort(key=lambda v: nodes[v].get("group_index", 0))
        anchor = min(first_index[v] for v in vs)
        skip.update(first_index[v] for v in vs)
        moved[anchor] = vs
    out = []
    for i, v in enumerate(sequence):
        if i in moved:
            out.extend(moved[i])
        elif i not in skip:
            out.append(v)
    return out

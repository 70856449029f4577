"""Large graphs: coarsen, solve the small graph, expand the schedule back.

:func:`coarsen` fuses *linear runs*: ``u -> v`` where ``v`` is ``u``'s only reader and
``u`` is ``v``'s only op input (views, zero-byte nodes and pointwise chains produce them).
A fused node runs its members back to back; its output is the last member's, its time the
sum, and its workspace covers the members' transient outputs, so the simulator never
charges an expanded schedule more than the coarse one (a member's value is read only by
the next member, so nothing else needs it resident). Outputs, non-recomputable ops and
values read by anything else are never fused.

The ``hierarchical`` method coarsens, solves the coarse graph with ``method="auto"``
(``chain_dp`` on stage chains, the heuristics, an exact method on small graphs) and
expands; the coarse solve is a whole-graph solve. The DP over blocks between forward
articulation points with an exact solver inside each block is ``block_dp``
(:mod:`solver.methods.blocks`), which ``auto`` also runs on training graphs.
"""

from __future__ import annotations

import logging
from typing import Hashable

import networkx as nx

from graphs import ComputeGraph
from solver.registry import register
from solver.schedule import Schedule

__all__ = ["Coarsening", "coarsen", "expand", "hierarchical", "COARSE_SHARE"]

log = logging.getLogger(__name__)

#: The share of ``time_limit`` that :func:`hierarchical` gives the coarse solve (its fused
#: workspaces are conservative: where it finds nothing, the original graph is solved in
#: the rest of the time).
COARSE_SHARE = 0.6


class Coarsening:
    """A coarse graph and, per coarse node, the original ops it runs (in order)."""

    def __init__(self, graph: ComputeGraph, members: dict[Hashable, list[Hashable]]):
        self.graph = graph
        self.members = members

    @property
    def fused(self) -> int:
        """How many original ops disappeared into others."""
        return sum(len(m) - 1 for m in self.members.values())


def coarsen(graph: ComputeGraph, *, max_run: int = 64) -> Coarsening:
    """Fuse linear runs of ``graph`` into single nodes.

    Parameters
    ----------
    graph : ComputeGraph
    max_run : int
        Longest run fused into one node.

    Returns
    -------
    Coarsening
        The coarse graph keeps the id of each run's last member; ``members`` maps it to
        the run. Where no run has two ops, the coarse graph is ``graph`` itself.

    Notes
    -----
    O(nodes + edges).

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> c = coarsen(chain(4))
    >>> list(c.members.values())
    [[0, 1, 2, 3]]
    """
    g = graph.nx
    nodes = g.nodes
    order = graph.order

    def fusable(u: Hashable) -> Hashable | None:
        du = nodes[u]
        if du["output"] or not du.get("recomputable", True):
            return None
        succ = list(g.successors(u))
        if len(succ) != 1:
            return None
        v = succ[0]
        dv = nodes[v]
        if dv["kind"] != "op" or not dv.get("recomputable", True):
            return None
        if any(p != u for p in graph.op_preds(v)):
            return None
        return v

    nxt: dict[Hashable, Hashable] = {}
    has_prev: set = set()
    for u in order:
        v = fusable(u)
        if v is not None:
            nxt[u] = v
            has_prev.add(v)
    if not nxt:  # nothing to fuse: the graph is its own coarse graph
        return Coarsening(graph, {v: [v] for v in order})
    members: dict[Hashable, list[Hashable]] = {}
    head_of: dict[Hashable, Hashable] = {}
    for u in order:
        if u in has_prev and u in head_of:
            continue
        if u in head_of:
            continue
        run = [u]
        while run[-1] in nxt and len(run) < max_run:
            run.append(nxt[run[-1]])
        for x in run:
            head_of[x] = run[-1]
        members[run[-1]] = run
    cg = nx.DiGraph()
    for s in graph.sources:
        cg.add_node(s, **dict(nodes[s]))
    for last, run in members.items():
        data = dict(nodes[last])
        data["time"] = float(sum(nodes[x]["time"] for x in run))
        # transient bytes above the coarse charge (inputs + last output) at each member step
        extra = 0
        for k, x in enumerate(run):
            held = (nodes[run[k - 1]]["bytes"] if k else 0) + nodes[x]["bytes"] + nodes[x].get("workspace", 0)
            extra = max(extra, held - nodes[last]["bytes"])
        data["workspace"] = int(extra)
        if len(run) > 1:
            # other members run between the projections of a multi-output op: charge the
            # fused node its full workspace, never the cheaper ``run_workspace``
            for key in ("group", "group_index", "run_workspace"):
                data.pop(key, None)
        data["members"] = len(run)
        cg.add_node(last, **data)
    cg.add_edges_from((cu, cv) for cu, cv in ((head_of.get(u, u), head_of.get(v, v)) for u, v in g.edges)
                      if cu != cv)
    corder = [head_of[v] for v in order if head_of[v] == v]
    coarse = ComputeGraph(cg, name=f"{graph.name}/coarse", order=corder, meta=dict(graph.meta))
    return Coarsening(coarse, members)


def expand(coarsening: Coarsening, sequence: list) -> list:
    """The original-node sequence of a coarse sequence (each fused node runs its run).

    Examples
    --------
    >>> from solver.synthetic import chain
    >>> c = coarsen(chain(3))
    >>> expand(c, [2])
    [0, 1, 2]
    """
    out: list = []
    for v in sequence:
        out.extend(coarsening.members.get(v, [v]))
    return out


@register("hierarchical", family="large", order="free")
def hierarchical(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None,
                 exact: bool | None = None, bound: bool = True, drop: bool = True,
                 gap_tolerance: float | None = None) -> Schedule:
    """Coarsen linear runs, solve the coarse graph with ``auto``, expand the schedule.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds in all: the coarse solve gets :data:`COARSE_SHARE` of those left after
        coarsening, and where it finds nothing, the solve of the original graph the rest.
    exact, bound, drop, gap_tolerance
        ``auto``'s options (:func:`~solver.methods.auto.solve_auto`; ``gap_tolerance``
        None: its default), passed to its solves; the coarse solve never computes a
        bound (one on the coarse graph is no bound on the original).

    Returns
    -------
    Schedule
        ``info["coarse_ops"]``, ``info["fused"]`` and the coarse solve's ``info``.

    Raises
    ------
    NoScheduleFound
        Neither the coarse solve nor, in the time left after it, the solve of the
        original graph found a schedule.

    Notes
    -----
    Coarsening is O(nodes + edges); the coarse solve is ``auto``'s.

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> from solver import simulate
    >>> g = training_chain(4)
    >>> s = hierarchical(g, 7)
    >>> simulate(g, s).valid
    True
    """
    from solver.methods.auto import solve_auto
    from solver.grading import grade

    from solver.deadline import Deadline, OutOfTime
    from solver.errors import NoScheduleFound, SolverError

    options = {"exact": exact, "bound": bound, "drop": drop}
    if gap_tolerance is not None:
        options["gap_tolerance"] = gap_tolerance
    deadline = Deadline(time_limit)
    c = coarsen(graph)
    if c.fused:
        try:
            # a bound on the coarse graph is no bound on the original: skip it
            inner = solve_auto(c.graph, int(budget_bytes),
                               time_limit=None if time_limit is None else COARSE_SHARE * max(0.0, deadline.left()),
                               **{**options, "bound": False})
            grade(c.graph, inner, int(budget_bytes))
        except (NoScheduleFound, SolverError) as exc:
            if deadline.expired():
                raise  # nothing of the limit is left for the original graph
            # the fused workspaces are conservative: fall back to the original graph
            log.debug("coarse solve of %s failed (%s); solving the original graph", graph.name, exc)
            c = Coarsening(graph, {v: [v] for v in graph.order})
    if c.fused == 0:
        if deadline.expired():
            raise OutOfTime(f"hierarchical: the time limit passed while coarsening {graph.name or 'the graph'}; "
                            "give more time")
        inner = solve_auto(graph, int(budget_bytes),
                           time_limit=None if time_limit is None else max(0.1, deadline.left()), **options)
        seq = list(inner.sequence)
    else:
        seq = expand(c, inner.sequence)
    info = {k: v for k, v in inner.info.items() if k != "auto"}
    info.update({"coarse_ops": len(c.graph.ops), "fused": c.fused, "inner": inner.method,
                 "order": "free"})
    lb = inner.lower_bound if c.fused == 0 else None
    return Schedule(sequence=seq, method="hierarchical", lower_bound=lb, info=info)

"""Capture a model of many identical layers by capturing four and repeating one.

Tracing costs time per op: a 32-layer transformer's training step is eight times the
ops of a 4-layer one. Its middle layers are the same computation on the same shapes, so
their parts of the DAG are copies of one another. :func:`capture_repeated` captures the
model with its layer list cut to the first three layers and the last one, checks that
the second and third layers' parts of the DAG are the same (ops, bytes, FLOPs, times,
edges), and writes the DAG of the whole model: the third layer repeated as every middle
layer, wired to its neighbours as the second layer is wired to the third, and the last
layer after them. Node ids of the copies are the template's with ``@<layer>``; the
copies' ``module`` and ``name`` name their own layer.

The result is a DAG for pricing (the solvers, the trainer policies, ``estimate``): it
has no fx graph to run (``cg.fx`` and ``cg.capture_info`` are None). What must run (op
times and workspaces measured on real tensors) runs on the cut model's capture, which
:func:`capture_cut` keeps beside the whole DAG, and its figures are copied onto it.

Graph mode runs the step's joint graph itself. ``capture_cut(..., runnable=True)``
writes that graph too (:func:`stitch_joint`): layer 2's nodes of the cut capture's joint
graph are copied for every middle layer, each copy reading its own parameters, and the
DAG is built from the written graph as a capture builds it. The written graph runs in
an autograd function of its own (:class:`graphs.graph_mode.ScheduledStep`), which is
why only joints that need none of AOTAutograd's runtime wrappers are written (no
mutated inputs, no aliased outputs: :func:`graphs.torch_internals.joint_is_plain`).
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from graphs.compute_graph import BACKWARD_START, ComputeGraph

__all__ = ["capture_repeated", "capture_cut", "CutCapture", "repeated_layers", "repeat_layers", "stitch_joint",
           "Stitched"]

log = logging.getLogger(__name__)

#: layers captured: the first, two middle ones (the template and its check), the last
_KEPT = 4
#: node attributes that two copies of a layer share
_SAME = ("kind", "phase", "op", "bytes", "flops", "time", "workspace", "run_workspace", "output", "recomputable",
         "group_index", "group_time")


def _parent_and_index(block: str) -> tuple[str, int] | None:
    parent, _, idx = block.rpartition(".")
    return (parent, int(idx)) if idx.isdigit() else None


def repeated_layers(model: torch.nn.Module, blocks: Sequence[str]) -> tuple[str, torch.nn.ModuleList] | None:
    """The layer list that ``blocks`` are, when its middle layers are alike, else None.

    Alike: the blocks are the items ``0 .. L-1`` of one ``nn.ModuleList`` (or
    ``Sequential``) with ``L > 4``, and every middle layer has the type, submodule
    types, parameter and buffer shapes, dtypes and ``requires_grad`` of layer 1, and
    the same training flag; an HF config's ``layer_types`` (per-layer attention kinds)
    are all the same.

    Returns
    -------
    (parent path, layer list) or None

    Examples
    --------
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    >>> repeated_layers(net, [str(i) for i in range(6)])[0]
    ''
    >>> repeated_layers(net, [str(i) for i in range(4)]) is None
    True
    """
    got = [_parent_and_index(b) if "." in b else ("", int(b)) if b.isdigit() else None for b in blocks]
    if len(blocks) <= _KEPT + 1 or any(g is None for g in got):
        return None
    parents = {p for p, _ in got}
    if len(parents) != 1 or [i for _, i in got] != list(range(len(blocks))):
        return None
    parent = parents.pop()
    try:
        layers = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    if not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)) or len(layers) != len(blocks):
        return None
    config = getattr(model, "config", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and len(set(map(str, kinds))) > 1:
        return None
    ref = _signature(layers[1])
    if any(_signature(layers[i]) != ref for i in range(2, len(layers) - 1)):
        return None
    return parent, layers


def _signature(layer: torch.nn.Module) -> tuple:
    mods = tuple((name, type(m).__name__, m.training) for name, m in layer.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in layer.named_buffers())
    return mods, params, buffers


def _with_layers(model: torch.nn.Module, parent: str, layers: list) -> torch.nn.Module:
    """A shallow copy of ``model`` whose layer list at ``parent`` holds ``layers`` (the
    layer modules themselves, shared with ``model``)."""
    def with_children(module: torch.nn.Module, children: dict) -> torch.nn.Module:
        out = copy.copy(module)
        out._modules = children
        return out

    short = {str(i): m for i, m in enumerate(layers)}
    if not parent:
        return with_children(model, short)
    names = parent.split(".")
    path = [model]
    for name in names:
        path.append(path[-1]._modules[name])
    node = with_children(path[-1], short)
    for module, name in zip(reversed(path[:-1]), reversed(names)):
        node = with_children(module, dict(module._modules, **{name: node}))
    return node


def capture_repeated(model: torch.nn.Module, example_inputs: Any, *, blocks: Sequence[str],
                     capture: Callable[..., ComputeGraph], **options: Any) -> ComputeGraph | None:
    """The DAG of ``model``'s training step from a capture of four of its layers.

    Parameters
    ----------
    model : torch.nn.Module
    example_inputs : tuple or dict
    blocks : sequence of str
        Module paths of its layers (:func:`graphs.module_mode.layer_blocks`).
    capture : callable
        :func:`graphs.capture.capture`.
    **options
        Passed on to ``capture``.

    Returns
    -------
    ComputeGraph or None
        None when the layers are not alike (:func:`repeated_layers`), their captured
        parts differ, or the model cut to four layers does not capture: capture the
        whole model then.

    Examples
    --------
    >>> from graphs.capture import capture
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    >>> cg = capture_repeated(net, (torch.randn(2, 8),), blocks=[str(i) for i in range(6)], capture=capture,
    ...                       measure_time=False)
    >>> len(cg.ops) == len(capture(net, (torch.randn(2, 8),), measure_time=False).ops)
    True
    """
    cut = capture_cut(model, example_inputs, blocks=blocks, capture=capture, **options)
    return None if cut is None else cut.whole


#: the op figures that measuring a capture writes (:func:`graphs.capture.set_op_costs`)
_MEASURED = ("time", "workspace", "run_workspace", "group_time")


@dataclass
class CutCapture:
    """A capture of a model cut to four of its layers, and the DAG of the whole model
    written from it (:func:`repeat_layers`).

    Attributes
    ----------
    cut : ComputeGraph
        The cut model's capture: it runs (``cut.fx``, ``cut.capture_info``), on the
        model's own parameters.
    whole : ComputeGraph
        The whole model's DAG, for pricing.
    """

    cut: ComputeGraph
    whole: ComputeGraph
    template: dict | None = None

    @property
    def resident_gap(self) -> int:
        """Bytes of the sources (parameters, buffers, inputs) that the whole model's step
        holds beyond the cut one's: the layers that were not captured."""
        def held(g: ComputeGraph) -> int:
            return int(sum(g.nx.nodes[v]["bytes"] for v in g.sources))

        return held(self.whole) - held(self.cut)

    def copy_costs(self) -> int:
        """Write the cut capture's op figures (times, workspaces: measured on it, say)
        onto the whole DAG, each copy of the template layer taking its template's, and
        the figures' sources (``meta["time_source"]``, ``["workspace_source"]``).

        Returns
        -------
        int
            Op nodes of the whole DAG written.
        """
        cut, whole = self.cut.nx.nodes, self.whole.nx.nodes
        written = 0
        for w in self.whole.ops:
            if w == BACKWARD_START:  # it carries the step's loss (graphs.loss), which the cut's does not
                continue
            v = self.template.get(w, w) if self.template is not None else w if w in cut else str(w).rpartition("@")[0]
            if v not in cut:  # pragma: no cover - repeat_layers names every copy so
                raise KeyError(f"{w!r} has no template node in the cut capture")
            for key in _MEASURED:
                if key in cut[v]:
                    whole[w][key] = cut[v][key]
            written += 1
        for key in ("time_source", "workspace_source"):
            if key in self.cut.meta:
                self.whole.meta[key] = self.cut.meta[key]
        return written


def capture_cut(model: torch.nn.Module, example_inputs: Any, *, blocks: Sequence[str],
                capture: Callable[..., ComputeGraph], runnable: bool = False, **options: Any) -> CutCapture | None:
    """:func:`capture_repeated`, keeping the capture of the cut model beside the DAG.

    Parameters
    ----------
    model, example_inputs, blocks, capture, **options
        As for :func:`capture_repeated`.
    runnable : bool
        Write the whole step's joint graph too (:func:`stitch_joint`; captured with
        ``backward="outputs"``): the DAG is then that graph's, with ``fx`` and a
        ``capture_info`` whose ``stitched`` says how it runs
        (:class:`graphs.graph_mode.ScheduledStep`); copies of layer 2 are named
        ``<node>_l<layer>``. None where it cannot be written.

    Returns
    -------
    CutCapture or None
        None where :func:`capture_repeated` gives None.

    Examples
    --------
    >>> from graphs.capture import capture
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    >>> cc = capture_cut(net, (torch.randn(2, 8),), blocks=[str(i) for i in range(6)], capture=capture,
    ...                  measure_time=False)
    >>> len(cc.cut.ops) < len(cc.whole.ops), cc.resident_gap == 2 * (8 * 8 + 8) * 4
    (True, True)
    """
    found = repeated_layers(model, blocks)
    if found is None:
        return None
    parent, layers = found
    n = len(layers)
    short = _with_layers(model, parent, [layers[0], layers[1], layers[2], layers[n - 1]])
    try:
        cg = capture(short, example_inputs, **options)
    except Exception as exc:  # the cut model may not run where the whole one does: capture that
        return _differ(f"the model cut to {_KEPT} layers does not capture ({type(exc).__name__}: {exc})")
    whole = repeat_layers(cg, parent=parent, count=n)
    if whole is None or not runnable:
        return None if whole is None else CutCapture(cut=cg, whole=whole)
    return _runnable_cut(cg, model, parent=parent, count=n, repeated=whole.meta["repeated"])


def _runnable_cut(cg: ComputeGraph, model: torch.nn.Module, *, parent: str, count: int,
                  repeated: dict) -> CutCapture | None:
    """The cut capture and the DAG of its written joint graph (:func:`stitch_joint`)."""
    from dataclasses import replace

    from graphs.capture import graph_of_joint, plain_state

    info = cg.capture_info
    if info is None or info.backward != "outputs":
        return _differ("a runnable step needs a capture with backward='outputs'")
    got = stitch_joint(cg, model, parent=parent, count=count)
    if got is None:
        return None
    gm, stitched = got
    state = torch.nn.Module()
    state.add_module(stitched.params_spec[0].split(".")[0] if stitched.params_spec else "gm", model)
    # what the capture says of itself; the rest (the random ops' order, ...) is the written graph's own
    said = {k: cg.meta[k] for k in ("captured_with", "time_source", "torch", "autocast") if k in cg.meta}
    whole = graph_of_joint(gm, name=cg.name, state=state, meta=dict(said, repeated=repeated))
    # the step runs on the whole model: its own constants are what a later change is told from
    whole.capture_info = replace(info, stitched=stitched, state=plain_state(model))
    log.info("stitch_joint: %d layers from %d captured (%d nodes)", count, _KEPT, len(whole))
    return CutCapture(cut=cg, whole=whole, template=stitched.template)


def _renamed(text: Any, parent: str, i: int, j: int) -> Any:
    """``text`` (a module path) with layer ``i`` of the list at ``parent`` made layer ``j``."""
    if not isinstance(text, str):
        return text
    old = f"{parent}.{i}" if parent else str(i)
    new = f"{parent}.{j}" if parent else str(j)
    return re.sub(r"(^|[^\w.])" + re.escape(old) + r"(?=\.|$|[^\w])", lambda m: m.group(1) + new, text)


def _differ(why: str) -> None:
    log.info("repeat_layers: capturing every layer: %s", why)
    return None


def _member(graph: ComputeGraph, parent: str) -> dict[Hashable, int]:
    """Node -> index of the captured layer it belongs to: ops by ``module``, sources by
    their parameter's name; an op without a module (the backward's gradient sums) by
    the next op of its phase that has one, when it runs between two layers' ops."""
    pat = re.compile(r"^" + (re.escape(parent) + r"\." if parent else "") + r"(\d+)(\.|$)")
    out: dict[Hashable, int] = {}
    for v, d in graph.nx.nodes(data=True):
        text = d.get("module") if d["kind"] == "op" else d.get("name")
        m = pat.match(text or "")
        if m is not None:
            out[v] = int(m.group(1))
    for phase in ("forward", "backward"):
        ops = [v for v in graph.order if graph[v]["phase"] == phase]
        waiting: list = []
        seen_layer = False
        for v in ops:
            if v in out:
                if seen_layer:
                    out.update({u: out[v] for u in waiting})
                waiting, seen_layer = [], True
            elif not graph[v].get("module") and graph[v]["op"] not in ("tangent", BACKWARD_START):
                waiting.append(v)
    return out


def repeat_layers(graph: ComputeGraph, *, parent: str, count: int) -> ComputeGraph | None:
    """The DAG of ``count`` layers from the DAG of four (layers 0, 1, 2 and the last).

    Layer 2 is repeated as layers ``2 .. count-2``; layer 3 becomes layer ``count-1``.
    None when layers 1 and 2 are not copies of one another, or a layer's ops are not
    one run of the reference order in forward and in backward.

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(4):
    ...     g.add_node(f"f{i}", module=f"l.{i}", bytes=4)
    >>> for i in reversed(range(4)):
    ...     g.add_node(f"b{i}", module=f"l.{i}", phase="backward", bytes=4)
    >>> for i in range(3):
    ...     g.add_edge(f"f{i}", f"f{i + 1}"); g.add_edge(f"b{i + 1}", f"b{i}")
    >>> for i in range(4):
    ...     g.add_edge(f"f{i}", f"b{i}")
    >>> g.add_edge("f3", "b3")
    >>> big = repeat_layers(g, parent="l", count=6)
    >>> big.ops
    ['f0', 'f1', 'f2', 'f2@3', 'f2@4', 'f3', 'b3', 'b2@4', 'b2@3', 'b2', 'b1', 'b0']
    >>> sorted(big.nx.predecessors("b2@4"))
    ['b3', 'f2@4']
    """
    try:
        match = _match_layers(graph, parent)
        w2 = _middle_wiring(match)
        _one_run_per_layer(match)
        aliases = _alias_roles(match)
    except _NotCopies as exc:
        return _differ(str(exc))
    g = ComputeGraph(graph.nx.copy(), name=graph.name, meta=dict(graph.meta))
    copies = _Copies(parent=parent, count=count)
    _add_copies(g, match, w2, aliases, copies)
    _attach_last_layer(g, match, aliases, copies)
    out = _repeated_order(match, copies)
    g.order = out
    from graphs.capture import random_order

    g.meta["ordered"] = random_order(g, out)
    g.meta["repeated"] = {"layers": count, "template": f"{parent}.2" if parent else "2", "captured": _KEPT}
    log.info("repeat_layers: %d layers from %d captured (%d nodes)", count, _KEPT, len(g))
    return g.validate()


class _NotCopies(Exception):
    """The captured layers are not copies of one another; the message says how."""


@dataclass
class _LayerMatch:
    """Layers 1 and 2 of a captured DAG, node for node (:func:`_match_layers`)."""

    graph: ComputeGraph
    member: dict  # node -> captured layer (:func:`_member`)
    layer: dict  # captured layer -> its nodes
    pos: dict  # op -> its place in the reference order
    one: list  # layer 1's nodes, ops in the reference order, then sources
    two: list  # layer 2's, in the same order
    phi: dict  # layer 1's node -> layer 2's

    def role(self, u: Hashable, of: int) -> tuple:
        """Where ``u`` sits for layer ``of`` (1 or 2): ``(kind, node)``, with the nodes of
        the middle layers named by their layer-2 node."""
        i = self.member.get(u)
        if i is None:
            return ("shared", u)
        if i == of:
            return ("same", self.phi[u] if of == 1 else u)
        if i == of - 1:
            return ("prev", self.phi[u] if of == 2 else u)
        if i == of + 1:
            return ("next", u)
        return ("far", u)

    def wiring(self, of: int) -> set:
        """Layer ``of``'s edges, ``(direction, its node as layer 2's, role of the other end)``."""
        edges = set()
        for v in (self.one if of == 1 else self.two):
            me = self.phi[v] if of == 1 else v
            edges.update(("in", me, self.role(u, of)) for u in self.graph.nx.predecessors(v))
            edges.update(("out", me, self.role(w, of)) for w in self.graph.nx.successors(v))
        return edges


def _match_layers(graph: ComputeGraph, parent: str) -> _LayerMatch:
    """:func:`repeat_layers`'s first phase: the captured layers' nodes, layer 1's matched
    to layer 2's in the reference order, with the same costs."""
    member = _member(graph, parent)
    layer = {i: [v for v in graph.nx.nodes if member.get(v) == i] for i in range(_KEPT)}
    if any(not layer[i] for i in range(_KEPT)) or len(layer[1]) != len(layer[2]):
        raise _NotCopies('a layer has no node, or layers 1 and 2 differ in size')
    pos = {v: i for i, v in enumerate(graph.order)}
    nodes = graph.nx.nodes

    def ranked(vs: list) -> list:  # ops in the reference order, then sources in node order
        return sorted((v for v in vs if v in pos), key=pos.__getitem__) + [v for v in vs if v not in pos]

    one, two = ranked(layer[1]), ranked(layer[2])
    phi = dict(zip(one, two))
    for a, b in phi.items():
        if any(nodes[a].get(k) != nodes[b].get(k) for k in _SAME) or (
                (nodes[a].get("group") is None) != (nodes[b].get("group") is None)):
            raise _NotCopies("layers 1 and 2 differ in a node's costs")
    return _LayerMatch(graph=graph, member=member, layer=layer, pos=pos, one=one, two=two, phi=phi)


def _middle_wiring(match: _LayerMatch) -> set:
    """:func:`repeat_layers`'s second phase: layer 2's edges (:meth:`_LayerMatch.wiring`),
    checked to be layer 1's: one wiring serves every pair of middle layers."""
    w1, w2 = match.wiring(1), match.wiring(2)
    if any(r[0] == "far" for _, _, r in w1 | w2):
        raise _NotCopies('a layer reads a layer that is not its neighbour')
    # layer 2 has layer 1's own and shared edges, and reads (is read by) layer 1 as
    # layer 1 is read by (reads) layer 2
    inner = lambda w: {e for e in w if e[2][0] in ("same", "shared")}  # noqa: E731
    down = {(d, me, r[1]) for d, me, r in w2 if r[0] == "prev"}
    up = {("in" if d == "out" else "out", r[1], me) for d, me, r in w1 if r[0] == "next"}
    if inner(w1) != inner(w2) or down != up:
        raise _NotCopies('layers 1 and 2 are wired differently')
    return w2


def _one_run_per_layer(match: _LayerMatch) -> None:
    """:func:`repeat_layers`'s third phase: each layer's ops are one run of the
    reference order in forward and one in backward."""
    nodes, pos = match.graph.nx.nodes, match.pos
    for i in range(1, _KEPT):
        for phase in ("forward", "backward"):
            ran = sorted(pos[v] for v in match.layer[i] if v in pos and nodes[v]["phase"] == phase)
            if ran and ran[-1] - ran[0] + 1 != len(ran):
                raise _NotCopies("a layer's ops are not one run of the order")


def _alias_roles(match: _LayerMatch) -> dict:
    """:func:`repeat_layers`'s fourth phase: layer-2 node -> what its alias is, in the
    terms of :meth:`_LayerMatch.role`; a view of the next layer (a gradient flowing
    down) as layer 1's view of layer 2."""
    nodes = match.graph.nx.nodes
    inv = {b: a for a, b in match.phi.items()}

    def alias_role(v: Hashable) -> tuple | None:
        r = match.role(nodes[v]["alias_of"], 2)
        if r[0] != "next":
            return r if r[0] != "far" else None
        r1 = match.role(nodes[inv[v]].get("alias_of"), 1) if nodes[inv[v]].get("alias_of") is not None else None
        return ("next", r1[1], r[1]) if r1 is not None and r1[0] == "next" else None

    aliases = {v: alias_role(v) for v in match.two if nodes[v].get("alias_of") is not None}
    if any(r is None for r in aliases.values()):
        raise _NotCopies("layers 1 and 2 alias the storage of other layers differently")
    return aliases


@dataclass
class _Copies:
    """The middle layers written as copies of layer 2: ``3 .. count-2``."""

    parent: str
    count: int

    @property
    def last(self) -> int:
        return self.count - 1

    @property
    def layers(self) -> list:
        return list(range(3, self.last))  # layer 2 is the first copy of itself

    def rename(self, text: Any, i: int, j: int) -> Any:
        return _renamed(text, self.parent, i, j)

    @staticmethod
    def at(j: int, v: Hashable) -> Hashable:
        """The node of middle layer ``j`` that is ``v`` (a node of layer 2) there."""
        return v if j == 2 else f"{v}@{j}"

    def node_of(self, r: tuple, j: int) -> Hashable:
        """The node that role ``r`` (:meth:`_LayerMatch.role` of layer 2) is for layer ``j``."""
        kind, u = r[0], r[1]
        if kind == "shared":
            return u
        if kind == "next":  # (next, layer-2 node as layer 1 sees it, the last layer's node)
            return r[2] if j == self.last - 1 else self.at(j + 1, u)
        return self.at(j, u) if kind == "same" else self.at(j - 1, u)  # "prev": layer j - 1


def _add_copies(g: ComputeGraph, match: _LayerMatch, w2: set, aliases: dict, copies: _Copies) -> None:
    """:func:`repeat_layers`'s fifth phase: layer 2's nodes and edges written into ``g``
    for every middle layer, naming their own layer."""
    nodes, at = match.graph.nx.nodes, copies.at
    for j in copies.layers:
        for v in match.two:
            d = dict(nodes[v])
            for key in ("module", "name"):
                if key in d:
                    d[key] = copies.rename(d[key], 2, j)
            if d.get("group") is not None:
                d["group"] = f"{d['group']}@{j}"
            if v in aliases:
                d["alias_of"] = copies.node_of(aliases[v], j)
            g.nx.add_node(at(j, v), **d)
    for j in copies.layers:
        for d, me, r in w2:
            if r[0] != "next":
                u = copies.node_of(r, j)
                g.nx.add_edge(*((u, at(j, me)) if d == "in" else (at(j, me), u)))


def _attach_last_layer(g: ComputeGraph, match: _LayerMatch, aliases: dict, copies: _Copies) -> None:
    """:func:`repeat_layers`'s sixth phase: the last layer reads (and is read by) the
    last middle layer instead of layer 2, and names itself layer ``count - 1``."""
    graph, member, nodes = match.graph, match.member, match.graph.nx.nodes
    last, at = copies.last, copies.at
    for v in match.two:
        for u in [u for u in graph.nx.predecessors(v) if member.get(u) == 3]:
            g.nx.remove_edge(u, v)
            g.nx.add_edge(u, at(last - 1, v))
        for w in [w for w in graph.nx.successors(v) if member.get(w) == 3]:
            g.nx.remove_edge(v, w)
            g.nx.add_edge(at(last - 1, v), w)
    for v, r in aliases.items():  # layer 2's views of the next layer: of copy 3 now
        if r[0] == "next":
            g.nx.nodes[v]["alias_of"] = copies.node_of(r, 2)
    for v in match.layer[3]:
        a = nodes[v].get("alias_of")
        if a is not None and member.get(a) == 2:
            g.nx.nodes[v]["alias_of"] = at(last - 1, a)
    for v in match.layer[3]:
        d = g.nx.nodes[v]
        for key in ("module", "name"):
            if key in d:
                d[key] = copies.rename(d[key], 3, last)


def _repeated_order(match: _LayerMatch, copies: _Copies) -> list:
    """:func:`repeat_layers`'s last phase: the reference order, the copies' forward
    after layer 2's, their backward before it."""
    graph, member, nodes, at = match.graph, match.member, match.graph.nx.nodes, copies.at
    order = list(graph.order)
    fwd2 = [v for v in order if member.get(v) == 2 and nodes[v]["phase"] == "forward"]
    bwd2 = [v for v in order if member.get(v) == 2 and nodes[v]["phase"] == "backward"]
    out: list = []
    for v in order:
        out.append(v)
        if fwd2 and v == fwd2[-1]:
            for j in copies.layers:
                out.extend(at(j, u) for u in fwd2)
        if bwd2 and v == bwd2[0]:
            out.pop()
            for j in reversed(copies.layers):
                out.extend(at(j, u) for u in bwd2)
            out.append(v)
    return out


@dataclass
class Stitched:
    """How a joint graph written from a cut capture runs (:func:`stitch_joint`).

    Attributes
    ----------
    params_spec, buffers_spec : list of str
        The parameters and buffers its inputs are, in order (names as the export's:
        ``"gm."`` and the model's own name).
    num_fwd_outputs : int
        How many of its outputs the forward returns (the rest are gradients).
    template : dict
        Each node of the written graph -> the node of the cut capture's it copies.
    """

    params_spec: list
    buffers_spec: list
    num_fwd_outputs: int
    template: dict


def _fx_members(cut: ComputeGraph, parent: str) -> dict:
    """fx node of the cut capture's joint -> captured layer, by :func:`_member`; a
    multi-output op (folded into its projections in the DAG) by its projections."""
    by_name = _member(cut, parent)
    member = {}
    for n in cut.fx.graph.nodes:
        if n.name in by_name:
            member[n] = by_name[n.name]
    for n in cut.fx.graph.nodes:
        if n not in member and n.op == "call_function" and n.users:
            layers = {member.get(u) for u in n.users}
            if len(layers) == 1 and None not in layers:
                member[n] = layers.pop()
    return member


def stitch_joint(cut: ComputeGraph, model: torch.nn.Module, *, parent: str, count: int) -> tuple | None:
    """The joint graph of ``model``'s training step (``count`` layers) written from the
    joint graph of its capture cut to four layers (layers 0, 1, 2 and the last).

    Layer 2's forward ops are copied after it as layers ``3 .. count-2``, and its
    backward ops before it, in reverse; each copy reads its own parameters (new inputs,
    in the model's parameter order), the layer before it as layer 2 reads layer 1, and
    the layer after it as layer 1 reads layer 2; the last layer reads the last copy.
    The copies' gradients join the outputs after layer 2's. Every op of layer 2 is
    checked against its counterpart in layer 1 (the same op, the same constants, its
    inputs in the same places), and the parameters of the result against ``model``'s.

    Parameters
    ----------
    cut : ComputeGraph
        The capture of the model cut to four layers (:func:`capture_cut`), with
        ``backward="outputs"``.
    model : torch.nn.Module
        The whole model (its parameter names are checked against the result's inputs).
    parent : str
        Module path of the layer list.
    count : int
        Layers of the whole model.

    Returns
    -------
    (torch.fx.GraphModule, Stitched) or None
        None where the layers are not written this way (the check fails, or the cut
        joint needs AOTAutograd's runtime: mutated inputs, aliased outputs).

    Examples
    --------
    >>> from graphs.capture import capture
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    >>> cc = capture_cut(net, (torch.randn(2, 8),), blocks=[str(i) for i in range(6)], capture=capture,
    ...                  backward="outputs", measure_time=False)
    >>> gm, how = stitch_joint(cc.cut, net, parent="", count=6)
    >>> len(how.params_spec), how.num_fwd_outputs
    (12, 1)
    """
    from graphs.torch_internals import joint_is_plain, lazy_graph_module

    info = cut.capture_info
    if cut.fx is None or info is None or not joint_is_plain(info.joint):
        return _differ("the cut capture's joint graph needs AOTAutograd's runtime")
    gm = cut.fx
    try:
        layers = _joint_layers(cut, parent, count)
        roles = _input_roles(layers)
        _only_neighbours_read(layers, roles)
        writer = _JointWriter(layers, roles)
        writer.write_steps()
        n_fwd, written = writer.write_outputs()
        written_gm = lazy_graph_module(gm, writer.graph)  # its code is generated only if it is run or read
        written_gm.meta.update(gm.meta)
        params, buffers = _model_inputs(written, layers.prefix, model)
    except _NotCopies as exc:
        return _differ(str(exc))
    return written_gm, Stitched(params_spec=params, buffers_spec=buffers, num_fwd_outputs=n_fwd,
                                template=writer.template)


@dataclass
class _JointLayers:
    """Layers 1 and 2 of a cut capture's joint graph, node for node (:func:`_joint_layers`)."""

    nodes: list  # the joint graph's nodes
    member: dict  # fx node -> captured layer (:func:`_fx_members`)
    prefix: str  # the export's prefix of parameter names ("gm.")
    two: list  # layer 2's nodes
    phi: dict  # layer 1's node -> layer 2's
    parent: str
    count: int

    @property
    def out_node(self) -> torch.fx.Node:
        return self.nodes[-1]

    @property
    def last(self) -> int:
        return self.count - 1

    @property
    def copies(self) -> list:
        return list(range(3, self.last))

    def rename(self, text: Any, i: int, j: int) -> Any:
        return _renamed(text, self.parent, i, j)


def _joint_layers(cut: ComputeGraph, parent: str, count: int) -> _JointLayers:
    """:func:`stitch_joint`'s first phase: the joint graph's nodes of each captured
    layer, layer 1's matched to layer 2's in graph order."""
    info = cut.capture_info
    nodes = list(cut.fx.graph.nodes)
    member = _fx_members(cut, parent)
    # the export's names of parameters: "gm." (the step's attribute) and the model's own
    prefix = info.joint.params_spec[0].split(".")[0] + "." if info.joint.params_spec else ""
    one = [n for n in nodes if member.get(n) == 1]
    two = [n for n in nodes if member.get(n) == 2]
    if len(one) != len(two) or not two:
        raise _NotCopies("layers 1 and 2 differ in their graph nodes")
    return _JointLayers(nodes=nodes, member=member, prefix=prefix, two=two, phi=dict(zip(one, two)), parent=parent,
                        count=count)


def _same_constant(x: Any, y: Any) -> bool:
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # tensors and the like: not constants of an op here
        return x is y


def _input_roles(layers: _JointLayers) -> dict:
    """:func:`stitch_joint`'s second phase: the role of every input of every layer-2
    node, read off its layer-1 counterpart (the same op, the same constants, its inputs
    in the same places): layer-2 node -> (roles of its flat arguments, their spec)."""
    from graphs.torch_internals import tree_flatten

    member, phi = layers.member, layers.phi
    inv = {b: a for a, b in phi.items()}
    roles: dict[torch.fx.Node, tuple] = {}
    for b in layers.two:
        a = inv[b]
        if a.op != b.op or (a.op != "placeholder" and a.target != b.target):
            raise _NotCopies(f"layers 1 and 2 run different ops ({a.name}, {b.name})")
        la, sa = tree_flatten((a.args, a.kwargs))
        lb, sb = tree_flatten((b.args, b.kwargs))
        if sa != sb or len(la) != len(lb):
            raise _NotCopies(f"layers 1 and 2 call {b.name} differently")
        got = []
        for x1, x2 in zip(la, lb):
            if not isinstance(x2, torch.fx.Node):
                if isinstance(x1, torch.fx.Node) or not _same_constant(x1, x2):
                    raise _NotCopies(f"layers 1 and 2 call {b.name} with other constants")
                got.append(("const", x2))
                continue
            if not isinstance(x1, torch.fx.Node):
                raise _NotCopies(f"layers 1 and 2 call {b.name} differently")
            m1, m2 = member.get(x1), member.get(x2)
            if m2 == 2 and m1 == 1 and phi.get(x1) is x2:
                got.append(("same", x2))
            elif m2 == 1 and m1 == 0:
                got.append(("prev", phi[x2]))
            elif m2 == 3 and m1 == 2:
                got.append(("next", x1, x2))
            elif m2 is None and x1 is x2:
                got.append(("shared", x2))
            else:
                raise _NotCopies(f"layer 2's {b.name} reads {x2.name} where layer 1's reads {x1.name}")
        roles[b] = (got, sb)
    return roles


def _only_neighbours_read(layers: _JointLayers, roles: dict) -> None:
    """:func:`stitch_joint`'s third phase: outside layer 2, only layer 1 (its backward),
    layer 3 (the last) and the outputs read it."""
    for n in layers.nodes:
        if n in roles or n is layers.out_node:
            continue
        if any(layers.member.get(x) == 2 for x in n.all_input_nodes) and layers.member.get(n) not in (1, 3):
            raise _NotCopies(f"{n.name}, outside the layers, reads layer 2")


class _JointWriter:
    """Writes :func:`stitch_joint`'s graph: the cut joint's nodes in their order with
    layer 2's copied for every middle layer (:meth:`write_steps`), then the outputs
    (:meth:`write_outputs`)."""

    def __init__(self, layers: _JointLayers, roles: dict) -> None:
        self.layers, self.roles = layers, roles
        self.graph = torch.fx.Graph()
        self.env: dict = {}  # cut node -> its node in the written graph (layer 2 is copy 2 of itself)
        self.copy_env: dict[int, dict] = {j: {} for j in layers.copies}
        self.template: dict[str, str] = {}

    def at(self, j: int, x: torch.fx.Node) -> torch.fx.Node:
        return self.env[x] if j == 2 else self.copy_env[j][x]

    def resolve(self, role: tuple, j: int) -> Any:
        """The value that an input of role ``role`` (:func:`_input_roles`) is for copy ``j``."""
        kind = role[0]
        if kind == "const":
            return role[1]
        if kind == "shared":
            return self.env[role[1]]
        if kind == "same":
            return self.at(j, role[1])
        if kind == "prev":
            return self.at(j - 1, role[1])
        # next: layer 2 reads the last layer; every other copy reads the copy after it
        return self.env[role[2]] if j + 1 == self.layers.last else self.at(j + 1, role[1])

    def meta_of(self, b: torch.fx.Node, i: int, j: int) -> dict:
        """``b``'s metadata, its module paths (and parameter's name) of layer ``i`` made layer ``j``'s."""
        from graphs.torch_internals import renamed_input

        rename, prefix = self.layers.rename, self.layers.prefix
        meta = dict(b.meta)
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            if isinstance(meta.get(key), dict):
                meta[key] = {k: tuple(rename(x, i, j) for x in v) if isinstance(v, tuple) else rename(v, i, j)
                             for k, v in meta[key].items()}
        target = getattr(meta.get("desc"), "target", None)
        if b.op == "placeholder" and isinstance(target, str):
            head, dot, rest = target.partition(".") if target.startswith(prefix) else ("", "", target)
            meta["desc"] = renamed_input(meta["desc"], head + dot + rename(rest, i, j))
        return meta

    def emit_copy(self, b: torch.fx.Node, j: int) -> None:
        """Write layer-2 node ``b`` as copy ``j``'s."""
        from graphs.torch_internals import tree_unflatten

        got, spec = self.roles[b]
        args, kwargs = tree_unflatten([self.resolve(r, j) for r in got], spec)
        new = self.graph.create_node(b.op, b.target, args, kwargs, name=f"{b.name}_l{j}")
        new.meta = self.meta_of(b, 2, j)
        if b.op == "placeholder":  # an input of its own, named as its node
            new.target = new.name
        self.copy_env[j][b] = new
        self.template[new.name] = b.name

    def emit(self, n: torch.fx.Node) -> None:
        """Write node ``n`` of the cut joint."""
        from graphs.torch_internals import tree_flatten, tree_unflatten

        layers, env, copies = self.layers, self.env, self.layers.copies
        member = layers.member

        def arg(x: torch.fx.Node) -> torch.fx.Node:
            if copies and member.get(n) == 3 and member.get(x) == 2:
                return self.copy_env[layers.last - 1][x]  # the last layer reads the last copy
            return env[x]
        if copies and n in self.roles:  # layer 2 reads the first copy where it read the last layer
            got, spec = self.roles[n]
            leaves = tree_flatten((n.args, n.kwargs))[0]
            args, kwargs = tree_unflatten([self.at(3, r[1]) if r[0] == "next" else env[x]
                                           if isinstance(x, torch.fx.Node) else x for r, x in zip(got, leaves)], spec)
            new = self.graph.create_node(n.op, n.target, args, kwargs, name=n.name)
        else:
            new = self.graph.node_copy(n, arg)
        new.meta = self.meta_of(n, 3, layers.last) if member.get(n) == 3 else dict(n.meta)
        env[n] = new
        self.template[new.name] = n.name

    @staticmethod
    def is_backward(n: torch.fx.Node) -> bool:
        return n.meta.get("partitioner_tag") == "is_backward"

    def write_steps(self) -> None:
        """:func:`stitch_joint`'s fourth phase: every node but the output, the copies'
        inputs after layer 2's of their kind, their forward after layer 2's forward and
        their backward, in reverse, before layer 2's backward."""
        layers, copies, two = self.layers, self.layers.copies, self.layers.two
        kinds = {}
        for b in two:
            if b.op == "placeholder":
                kinds.setdefault(type(b.meta.get("desc")).__name__, []).append(b)
        after = {group[-1]: group for group in kinds.values()}
        fwd2 = [b for b in two if b.op != "placeholder" and not self.is_backward(b)]
        bwd2 = [b for b in two if b.op != "placeholder" and self.is_backward(b)]
        first_bwd = bwd2[0] if bwd2 else None
        last_fwd = fwd2[-1] if fwd2 else None
        try:
            for n in layers.nodes:
                if n is layers.out_node:
                    break
                if n is first_bwd:
                    for j in reversed(copies):
                        for b in bwd2:
                            self.emit_copy(b, j)
                self.emit(n)
                if n in after:
                    for j in copies:
                        for b in after[n]:
                            self.emit_copy(b, j)
                if n is last_fwd:
                    for j in copies:
                        for b in fwd2:
                            self.emit_copy(b, j)
        except KeyError as exc:  # a copy read a node not written yet: the layers do not run in turn
            raise _NotCopies(f"a layer reads a value that is written after it ({exc})") from None

    def write_outputs(self) -> tuple[int, list]:
        """:func:`stitch_joint`'s fifth phase: the outputs, the forward's, then a gradient
        per input, the copies' after layer 2's; returns how many are the forward's, and
        the written graph's inputs."""
        from torch.fx.node import map_aggregate

        from graphs.rewrite import is_tangent

        layers, env, copy_env = self.layers, self.env, self.copy_env
        nodes, out_node = layers.nodes, layers.out_node
        placeholders = [n for n in nodes if n.op == "placeholder" and not is_tangent(n)]
        outputs = list(out_node.args[0])
        n_fwd = len(outputs) - len(placeholders)
        grad_of = dict(zip(placeholders, outputs[n_fwd:]))
        new_outputs = [map_aggregate(o, lambda x: env[x] if isinstance(x, torch.fx.Node) else x)
                       for o in outputs[:n_fwd]]
        written = [n for n in self.graph.nodes if n.op == "placeholder" and not is_tangent(n)]
        source = {v: k for k, v in env.items() if k.op == "placeholder"}
        for j in layers.copies:
            source.update({v: (k, j) for k, v in copy_env[j].items() if k.op == "placeholder"})
        for p in written:
            src = source[p]
            if isinstance(src, tuple):
                g = grad_of[src[0]]
                if g is not None and layers.member.get(g) != 2:
                    raise _NotCopies(f"the gradient of {src[0].name} is not made in its layer")
                new_outputs.append(None if g is None else copy_env[src[1]][g])
            else:
                g = grad_of[src]
                new_outputs.append(None if g is None else env[g])
        self.graph.output(tuple(new_outputs))
        return n_fwd, written


def _model_inputs(written: list, prefix: str, model: torch.nn.Module) -> tuple[list, list]:
    """:func:`stitch_joint`'s last phase: the written graph's inputs, checked to be the
    model's parameters and buffers in the model's order; returns their names."""
    targets = [getattr(p.meta.get("desc"), "target", None) for p in written]
    kind = [type(p.meta.get("desc")).__name__ for p in written]
    params = [t for t, k in zip(targets, kind) if k == "ParamAOTInput"]
    buffers = [t for t, k in zip(targets, kind) if k == "BufferAOTInput"]
    want_params = [prefix + n for n, _ in model.named_parameters(remove_duplicate=False)]  # tied ones too
    want_buffers = [prefix + n for n, _ in model.named_buffers(remove_duplicate=False)]
    if params != want_params or buffers != want_buffers:
        raise _NotCopies("the written graph's inputs are not the model's parameters in order")
    return params, buffers

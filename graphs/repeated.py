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
    member = _member(graph, parent)
    layer = {i: [v for v in graph.nx.nodes if member.get(v) == i] for i in range(_KEPT)}
    if any(not layer[i] for i in range(_KEPT)) or len(layer[1]) != len(layer[2]):
        return _differ('a layer has no node, or layers 1 and 2 differ in size')
    pos = {v: i for i, v in enumerate(graph.order)}
    nodes = graph.nx.nodes

    def ranked(vs: list) -> list:  # ops in the reference order, then sources in node order
        return sorted((v for v in vs if v in pos), key=pos.__getitem__) + [v for v in vs if v not in pos]

    one, two = ranked(layer[1]), ranked(layer[2])
    phi = dict(zip(one, two))
    for a, b in phi.items():
        if any(nodes[a].get(k) != nodes[b].get(k) for k in _SAME) or (
                (nodes[a].get("group") is None) != (nodes[b].get("group") is None)):
            return _differ("layers 1 and 2 differ in a node's costs")

    def role(u: Hashable, of: int) -> tuple:
        """Where ``u`` sits for layer ``of`` (1 or 2): ``(kind, node)``, with the nodes of
        the middle layers named by their layer-2 node."""
        i = member.get(u)
        if i is None:
            return ("shared", u)
        if i == of:
            return ("same", phi[u] if of == 1 else u)
        if i == of - 1:
            return ("prev", phi[u] if of == 2 else u)
        if i == of + 1:
            return ("next", u)
        return ("far", u)

    def wiring(of: int) -> set:
        edges = set()
        for v in (one if of == 1 else two):
            me = phi[v] if of == 1 else v
            edges.update(("in", me, role(u, of)) for u in graph.nx.predecessors(v))
            edges.update(("out", me, role(w, of)) for w in graph.nx.successors(v))
        return edges

    w1, w2 = wiring(1), wiring(2)
    if any(r[0] == "far" for _, _, r in w1 | w2):
        return _differ('a layer reads a layer that is not its neighbour')
    # layer 2 has layer 1's own and shared edges, and reads (is read by) layer 1 as
    # layer 1 is read by (reads) layer 2: one wiring serves every pair of middle layers
    inner = lambda w: {e for e in w if e[2][0] in ("same", "shared")}  # noqa: E731
    down = {(d, me, r[1]) for d, me, r in w2 if r[0] == "prev"}
    up = {("in" if d == "out" else "out", r[1], me) for d, me, r in w1 if r[0] == "next"}
    if inner(w1) != inner(w2) or down != up:
        return _differ('layers 1 and 2 are wired differently')
    # one run of the order per layer and phase
    for i in range(1, _KEPT):
        for phase in ("forward", "backward"):
            ran = sorted(pos[v] for v in layer[i] if v in pos and nodes[v]["phase"] == phase)
            if ran and ran[-1] - ran[0] + 1 != len(ran):
                return _differ("a layer's ops are not one run of the order")
    inv = {b: a for a, b in phi.items()}

    def alias_role(v: Hashable) -> tuple | None:
        """What the alias of layer-2 node ``v`` is, in the terms of :func:`role`; a view
        of the next layer (a gradient flowing down) as layer 1's view of layer 2."""
        r = role(nodes[v]["alias_of"], 2)
        if r[0] != "next":
            return r if r[0] != "far" else None
        r1 = role(nodes[inv[v]].get("alias_of"), 1) if nodes[inv[v]].get("alias_of") is not None else None
        return ("next", r1[1], r[1]) if r1 is not None and r1[0] == "next" else None

    aliases = {v: alias_role(v) for v in two if nodes[v].get("alias_of") is not None}
    if any(r is None for r in aliases.values()):
        return _differ("layers 1 and 2 alias the storage of other layers differently")

    g = ComputeGraph(graph.nx.copy(), name=graph.name, meta=dict(graph.meta))
    last = count - 1
    copies = list(range(3, last))  # layer 2 is the first copy of itself

    def rename(text: Any, i: int, j: int) -> Any:
        return _renamed(text, parent, i, j)

    def at(j: int, v: Hashable) -> Hashable:
        """The node of middle layer ``j`` that is ``v`` (a node of layer 2) there."""
        return v if j == 2 else f"{v}@{j}"

    def node_of(r: tuple, j: int) -> Hashable:
        kind, u = r[0], r[1]
        if kind == "shared":
            return u
        if kind == "next":  # (next, layer-2 node as layer 1 sees it, the last layer's node)
            return r[2] if j == last - 1 else at(j + 1, u)
        return at(j, u) if kind == "same" else at(j - 1, u)  # "prev": layer j - 1

    for j in copies:
        for v in two:
            d = dict(nodes[v])
            for key in ("module", "name"):
                if key in d:
                    d[key] = rename(d[key], 2, j)
            if d.get("group") is not None:
                d["group"] = f"{d['group']}@{j}"
            if v in aliases:
                d["alias_of"] = node_of(aliases[v], j)
            g.nx.add_node(at(j, v), **d)
    for j in copies:
        for d, me, r in w2:
            if r[0] != "next":
                u = node_of(r, j)
                g.nx.add_edge(*((u, at(j, me)) if d == "in" else (at(j, me), u)))
    # the last layer reads (and is read by) the last middle layer instead of layer 2
    for v in two:
        for u in [u for u in graph.nx.predecessors(v) if member.get(u) == 3]:
            g.nx.remove_edge(u, v)
            g.nx.add_edge(u, at(last - 1, v))
        for w in [w for w in graph.nx.successors(v) if member.get(w) == 3]:
            g.nx.remove_edge(v, w)
            g.nx.add_edge(at(last - 1, v), w)
    for v, r in aliases.items():  # layer 2's views of the next layer: of copy 3 now
        if r[0] == "next":
            g.nx.nodes[v]["alias_of"] = node_of(r, 2)
    for v in layer[3]:
        a = nodes[v].get("alias_of")
        if a is not None and member.get(a) == 2:
            g.nx.nodes[v]["alias_of"] = at(last - 1, a)
    for v in layer[3]:
        d = g.nx.nodes[v]
        for key in ("module", "name"):
            if key in d:
                d[key] = rename(d[key], 3, last)
    # the reference order: copies' forward after layer 2's, their backward before it
    order = list(graph.order)
    fwd2 = [v for v in order if member.get(v) == 2 and nodes[v]["phase"] == "forward"]
    bwd2 = [v for v in order if member.get(v) == 2 and nodes[v]["phase"] == "backward"]
    out: list = []
    for v in order:
        out.append(v)
        if fwd2 and v == fwd2[-1]:
            for j in copies:
                out.extend(at(j, u) for u in fwd2)
        if bwd2 and v == bwd2[0]:
            out.pop()
            for j in reversed(copies):
                out.extend(at(j, u) for u in bwd2)
            out.append(v)
    g.order = out
    from graphs.capture import random_order

    g.meta["ordered"] = random_order(g, out)
    g.meta["repeated"] = {"layers": count, "template": f"{parent}.2" if parent else "2", "captured": _KEPT}
    log.info("repeat_layers: %d layers from %d captured (%d nodes)", count, _KEPT, len(g))
    return g.validate()


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
    from torch.fx.node import map_aggregate

    from graphs.rewrite import is_tangent
    from graphs.torch_internals import (joint_is_plain, lazy_graph_module, renamed_input, tree_flatten,
                                         tree_unflatten)

    info = cut.capture_info
    if cut.fx is None or info is None or not joint_is_plain(info.joint):
        return _differ("the cut capture's joint graph needs AOTAutograd's runtime")
    gm = cut.fx
    nodes = list(gm.graph.nodes)
    member = _fx_members(cut, parent)
    # the export's names of parameters: "gm." (the step's attribute) and the model's own
    prefix = info.joint.params_spec[0].split(".")[0] + "." if info.joint.params_spec else ""
    one = [n for n in nodes if member.get(n) == 1]
    two = [n for n in nodes if member.get(n) == 2]
    if len(one) != len(two) or not two:
        return _differ("layers 1 and 2 differ in their graph nodes")
    phi = dict(zip(one, two))
    inv = {b: a for a, b in phi.items()}
    last = count - 1
    copies = list(range(3, last))

    def rename(text: Any, i: int, j: int) -> Any:
        return _renamed(text, parent, i, j)

    def same_constant(x: Any, y: Any) -> bool:
        try:
            return type(x) is type(y) and bool(x == y)
        except Exception:  # tensors and the like: not constants of an op here
            return x is y

    # the role of every input of every layer-2 node, read off its layer-1 counterpart
    roles: dict[torch.fx.Node, list] = {}
    for b in two:
        a = inv[b]
        if a.op != b.op or (a.op != "placeholder" and a.target != b.target):
            return _differ(f"layers 1 and 2 run different ops ({a.name}, {b.name})")
        la, sa = tree_flatten((a.args, a.kwargs))
        lb, sb = tree_flatten((b.args, b.kwargs))
        if sa != sb or len(la) != len(lb):
            return _differ(f"layers 1 and 2 call {b.name} differently")
        got = []
        for x1, x2 in zip(la, lb):
            if not isinstance(x2, torch.fx.Node):
                if isinstance(x1, torch.fx.Node) or not same_constant(x1, x2):
                    return _differ(f"layers 1 and 2 call {b.name} with other constants")
                got.append(("const", x2))
                continue
            if not isinstance(x1, torch.fx.Node):
                return _differ(f"layers 1 and 2 call {b.name} differently")
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
                return _differ(f"layer 2's {b.name} reads {x2.name} where layer 1's reads {x1.name}")
        roles[b] = (got, sb)
    # outside layer 2, only layer 1 (its backward), layer 3 (the last) and the outputs read it
    out_node = nodes[-1]
    for n in nodes:
        if n in roles or n is out_node:
            continue
        if any(member.get(x) == 2 for x in n.all_input_nodes) and member.get(n) not in (1, 3):
            return _differ(f"{n.name}, outside the layers, reads layer 2")

    graph = torch.fx.Graph()
    env: dict = {}  # cut node -> its node in the written graph (layer 2 is copy 2 of itself)
    copy_env: dict[int, dict] = {j: {} for j in copies}
    template: dict[str, str] = {}

    def at(j: int, x: torch.fx.Node) -> torch.fx.Node:
        return env[x] if j == 2 else copy_env[j][x]

    def resolve(role: tuple, j: int) -> Any:
        kind = role[0]
        if kind == "const":
            return role[1]
        if kind == "shared":
            return env[role[1]]
        if kind == "same":
            return at(j, role[1])
        if kind == "prev":
            return at(j - 1, role[1])
        # next: layer 2 reads the last layer; every other copy reads the copy after it
        return env[role[2]] if j + 1 == last else at(j + 1, role[1])

    def meta_of(b: torch.fx.Node, i: int, j: int) -> dict:
        """``b``'s metadata, its module paths (and parameter's name) of layer ``i`` made layer ``j``'s."""
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

    def emit_copy(b: torch.fx.Node, j: int) -> None:
        got, spec = roles[b]
        args, kwargs = tree_unflatten([resolve(r, j) for r in got], spec)
        new = graph.create_node(b.op, b.target, args, kwargs, name=f"{b.name}_l{j}")
        new.meta = meta_of(b, 2, j)
        if b.op == "placeholder":  # an input of its own, named as its node
            new.target = new.name
        copy_env[j][b] = new
        template[new.name] = b.name

    def emit(n: torch.fx.Node) -> None:
        def arg(x: torch.fx.Node) -> torch.fx.Node:
            if copies and member.get(n) == 3 and member.get(x) == 2:
                return copy_env[last - 1][x]  # the last layer reads the last copy
            return env[x]
        if copies and n in roles:  # layer 2 reads the first copy where it read the last layer
            got, spec = roles[n]
            leaves = tree_flatten((n.args, n.kwargs))[0]
            args, kwargs = tree_unflatten([at(3, r[1]) if r[0] == "next" else env[x] if isinstance(x, torch.fx.Node)
                                           else x for r, x in zip(got, leaves)], spec)
            new = graph.create_node(n.op, n.target, args, kwargs, name=n.name)
        else:
            new = graph.node_copy(n, arg)
        new.meta = meta_of(n, 3, last) if member.get(n) == 3 else dict(n.meta)
        env[n] = new
        template[new.name] = n.name

    def is_backward(n: torch.fx.Node) -> bool:
        return n.meta.get("partitioner_tag") == "is_backward"

    kinds = {}
    for b in two:
        if b.op == "placeholder":
            kinds.setdefault(type(b.meta.get("desc")).__name__, []).append(b)
    after = {group[-1]: group for group in kinds.values()}
    fwd2 = [b for b in two if b.op != "placeholder" and not is_backward(b)]
    bwd2 = [b for b in two if b.op != "placeholder" and is_backward(b)]
    first_bwd = bwd2[0] if bwd2 else None
    last_fwd = fwd2[-1] if fwd2 else None
    try:
        for n in nodes:
            if n is out_node:
                break
            if n is first_bwd:
                for j in reversed(copies):
                    for b in bwd2:
                        emit_copy(b, j)
            emit(n)
            if n in after:
                for j in copies:
                    for b in after[n]:
                        emit_copy(b, j)
            if n is last_fwd:
                for j in copies:
                    for b in fwd2:
                        emit_copy(b, j)
    except KeyError as exc:  # a copy read a node not written yet: the layers do not run in turn
        return _differ(f"a layer reads a value that is written after it ({exc})")
    # outputs: the forward's, then a gradient per input, the copies' after layer 2's
    placeholders = [n for n in nodes if n.op == "placeholder" and not is_tangent(n)]
    outputs = list(out_node.args[0])
    n_fwd = len(outputs) - len(placeholders)
    grad_of = dict(zip(placeholders, outputs[n_fwd:]))
    new_outputs = [map_aggregate(o, lambda x: env[x] if isinstance(x, torch.fx.Node) else x) for o in outputs[:n_fwd]]
    written = [n for n in graph.nodes if n.op == "placeholder" and not is_tangent(n)]
    source = {v: k for k, v in env.items() if k.op == "placeholder"}
    for j in copies:
        source.update({v: (k, j) for k, v in copy_env[j].items() if k.op == "placeholder"})
    for p in written:
        src = source[p]
        if isinstance(src, tuple):
            g = grad_of[src[0]]
            if g is not None and member.get(g) != 2:
                return _differ(f"the gradient of {src[0].name} is not made in its layer")
            new_outputs.append(None if g is None else copy_env[src[1]][g])
        else:
            g = grad_of[src]
            new_outputs.append(None if g is None else env[g])
    graph.output(tuple(new_outputs))
    written_gm = lazy_graph_module(gm, graph)  # its code is generated only if it is run or read
    written_gm.meta.update(gm.meta)
    # the inputs must be the model's parameters and buffers, in the model's order
    targets = [getattr(p.meta.get("desc"), "target", None) for p in written]
    kind = [type(p.meta.get("desc")).__name__ for p in written]
    params = [t for t, k in zip(targets, kind) if k == "ParamAOTInput"]
    buffers = [t for t, k in zip(targets, kind) if k == "BufferAOTInput"]
    want_params = [prefix + n for n, _ in model.named_parameters(remove_duplicate=False)]  # tied ones too
    want_buffers = [prefix + n for n, _ in model.named_buffers(remove_duplicate=False)]
    if params != want_params or buffers != want_buffers:
        return _differ("the written graph's inputs are not the model's parameters in order")
    return written_gm, Stitched(params_spec=params, buffers_spec=buffers, num_fwd_outputs=n_fwd, template=template)

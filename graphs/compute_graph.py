"""The cost-annotated DAG of one training step: the solver's only input.

A :class:`ComputeGraph` wraps a :class:`networkx.DiGraph`. Every node is one value of
the training step (a parameter, a buffer, an input, or the output of one op); an edge
``u -> v`` means that ``v`` reads ``u``'s storage. Node attributes:

``kind``
    ``"param"``, ``"buffer"``, ``"input"`` (sources, resident for the whole step) or
    ``"op"`` (computed by the schedule, possibly several times).
``phase``
    ``"forward"`` or ``"backward"``.
``op``
    the ATen op (``"aten.mm.default"``) or the kind for sources.
``bytes``
    bytes of the node's *own* output storage. A view or an in-place result shares its
    base's storage: it carries 0 bytes, and every reader of the alias also gets an edge
    from the base, so the base stays live as long as the alias is read.
``flops``, ``time``
    floating point operations and seconds (or the benchmark graphs' time units).
``output``
    the value is an output of the step (loss, parameter gradients): once computed it
    stays resident until the step ends.
``recomputable``
    ``False`` for values that must not be computed twice (random ops): a schedule
    computes them once and keeps them until their last use.
``workspace``
    extra bytes the op needs while it runs (default 0).
``module``, ``autograd_node``
    set by capture: the module path that ran the op, and the autograd node (sequence
    number) it belongs to.
``group``, ``group_index``, ``run_workspace``
    set on the outputs of a multi-output op (its projections): computing one runs the
    whole op; projections that follow each other in ``group_index`` order are one run,
    and a later one needs only ``run_workspace`` (see :mod:`solver.simulate`).

A captured step has two more kinds of op node: each gradient of an output that arrives
from outside (``op="tangent"``, reading the forward outputs), and one zero-byte node
``BACKWARD_START`` that reads every tangent and that every first backward op reads, so
that all output gradients arrive together before any backward op runs, as they do.

The graph attribute ``order`` is the reference topological order of the op nodes, the
order that a store-all step runs them in. ``meta["ordered"]`` (optional) lists nodes
that every schedule must first run in that relative order (random ops).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections import Counter
from typing import Any, Hashable, Iterable

import networkx as nx
import numpy as np

from graphs.errors import GraphFormatError
from graphs.units import format_bytes as _fmt_bytes, format_count as _fmt_num

__all__ = ["ComputeGraph", "SCHEMA_VERSION", "BACKWARD_START", "repeated_note", "validated"]

SCHEMA_VERSION = 1
#: Node id (and ``op``) of the step where the backward starts; it has no fx node.
BACKWARD_START = "<backward>"

SOURCE_KINDS = ("param", "buffer", "input")
KINDS = ("op",) + SOURCE_KINDS
PHASES = ("forward", "backward")
#: numeric node attributes: finite and non-negative
_AMOUNTS = ("bytes", "flops", "time", "workspace", "run_workspace", "group_time")
#: Of :data:`_AMOUNTS`, those counted in bytes (whole numbers).
_BYTE_AMOUNTS = ("bytes", "workspace", "run_workspace")
#: What :meth:`ComputeGraph.validate` reads for an attribute a node does not have.
_ABSENT = object()
#: Node attributes that are true or false.
_FLAGS = ("output", "recomputable")
_DEFAULTS: dict[str, Any] = {
    "kind": "op",
    "phase": "forward",
    "op": "",
    "bytes": 0,
    "flops": 0,
    "time": 0.0,
    "output": False,
    "recomputable": True,
    "workspace": 0,
}


class ComputeGraph:
    """A cost-annotated DAG of a training step.

    Parameters
    ----------
    graph : networkx.DiGraph, optional
        Nodes with the attributes described in the module docstring; missing attributes
        take their defaults.
    name : str, optional
        A label for reports.
    order : sequence of node ids, optional
        Reference topological order of the ``op`` nodes; default: a topological sort
        that breaks ties by insertion order.

    Examples
    --------
    >>> g = ComputeGraph(name="chain")
    >>> for i, b in enumerate([4, 8, 8, 4]):
    ...     g.add_node(i, bytes=b, time=1.0, phase="forward" if i < 2 else "backward")
    >>> g.add_edge(0, 1); g.add_edge(1, 2); g.add_edge(0, 3); g.add_edge(2, 3)
    >>> g.ops
    [0, 1, 2, 3]
    >>> g.saved_bytes()
    12
    """

    def __init__(
        self,
        graph: nx.DiGraph | None = None,
        *,
        name: str = "",
        order: Iterable[Hashable] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.nx: nx.DiGraph = graph if graph is not None else nx.DiGraph()
        for _, data in self.nx.nodes(data=True):
            for key, value in _DEFAULTS.items():
                data.setdefault(key, value)
        self.name = name or str(self.nx.graph.get("name", ""))
        self.meta: dict[str, Any] = dict(meta or {})
        self._order: list[Hashable] | None = _order_list(order, name) if order is not None else None
        self._cache: dict[str, Any] = {}
        #: the joint torch.fx graph and capture details, when captured from a model
        #: (in memory only; not saved to JSON)
        self.fx = None
        self.capture_info = None

    # ------------------------------------------------------------------ building
    def add_node(self, node: Hashable, **attrs: Any) -> None:
        """Add a node; attributes not given take their defaults."""
        data = dict(_DEFAULTS)
        data.update(attrs)
        self.nx.add_node(node, **data)
        self._invalidate()

    def add_edge(self, u: Hashable, v: Hashable) -> None:
        """Add the edge ``u -> v`` (``v`` reads ``u``'s storage)."""
        self.nx.add_edge(u, v)
        self._invalidate()

    def _invalidate(self) -> None:
        self._cache.clear()

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return self.nx.number_of_nodes()

    def __contains__(self, node: Hashable) -> bool:
        return node in self.nx

    def __getitem__(self, node: Hashable) -> dict[str, Any]:
        return self.nx._node[node]  # the node's attribute dict (what ``nx.nodes[node]`` gives, without the view)

    def __repr__(self) -> str:
        return f"ComputeGraph(name={self.name!r}, nodes={len(self)}, ops={len(self.ops)})"

    @property
    def order(self) -> list[Hashable]:
        """Reference topological order of the ``op`` nodes (a store-all step)."""
        if "order" not in self._cache:
            if self._order is not None:
                order = [n for n in self._order if n in self.nx and self.is_op(n)]
                if len(order) != len(self.ops_set):
                    raise GraphFormatError(
                        f"graph {self.name!r}: the reference order names {len(order)} of "
                        f"{len(self.ops_set)} op nodes; give every op node exactly once"
                    )
            else:
                index = {n: i for i, n in enumerate(self.nx.nodes)}
                order = [
                    n
                    for n in nx.lexicographical_topological_sort(self.nx, key=index.__getitem__)
                    if self.is_op(n)
                ]
            self._cache["order"] = order
        return self._cache["order"]

    @order.setter
    def order(self, value: Iterable[Hashable]) -> None:
        self._order = _order_list(value, self.name)
        self._invalidate()

    @property
    def ops(self) -> list[Hashable]:
        """The op nodes in the reference order."""
        return self.order

    @property
    def ops_set(self) -> frozenset:
        if "ops_set" not in self._cache:
            self._cache["ops_set"] = frozenset(
                n for n, k in self.nx.nodes(data="kind") if k == "op"
            )
        return self._cache["ops_set"]

    @property
    def sources(self) -> list[Hashable]:
        """Parameters, buffers and inputs: resident for the whole step."""
        return [n for n, k in self.nx.nodes(data="kind") if k in SOURCE_KINDS]

    def is_op(self, node: Hashable) -> bool:
        return self.nx._node[node]["kind"] == "op"

    @property
    def node_data(self) -> dict[Hashable, dict[str, Any]]:
        """Node id -> its attribute dict: networkx's own map, to be read only (the
        simulator reads it once per step, where ``nx.nodes[v]`` costs a view lookup).

        Examples
        --------
        >>> g = ComputeGraph()
        >>> g.add_node("a", bytes=4, time=1.0)
        >>> g.node_data["a"]["bytes"]
        4
        """
        return self.nx._node

    @property
    def pred_map(self) -> dict[Hashable, dict]:
        """Node id -> the nodes it reads (the keys of its map): networkx's own map, to
        be read only.

        Examples
        --------
        >>> g = ComputeGraph()
        >>> for v in "ab": g.add_node(v, bytes=1, time=1.0)
        >>> g.add_edge("a", "b")
        >>> list(g.pred_map["b"]), list(g.pred_map["a"])
        (['a'], [])
        """
        return self.nx._pred

    # the solvers call these hundreds of thousands of times on a captured step: they read
    # networkx's adjacency dicts directly rather than through its views
    def op_preds(self, node: Hashable) -> list[Hashable]:
        """The op nodes that ``node`` reads (sources are always resident)."""
        data = self.nx._node
        return [u for u in self.nx._pred[node] if data[u]["kind"] == "op"]

    def op_succs(self, node: Hashable) -> list[Hashable]:
        data = self.nx._node
        return [v for v in self.nx._succ[node] if data[v]["kind"] == "op"]

    def without_edges(self, edges: Iterable[tuple[Hashable, Hashable]]) -> "ComputeGraph":
        """The graph without ``edges``, to be read only.

        It shares the node data, and the neighbour maps of the nodes no removed edge
        touches, with this graph: O(nodes + the touched nodes' degrees), where a copy
        is O(nodes + edges) (seconds on dense graphs of thousands of ops).

        Examples
        --------
        >>> g = ComputeGraph()
        >>> for v in "abc": g.add_node(v, bytes=1, time=1.0)
        >>> g.add_edge("a", "b"); g.add_edge("b", "c"); g.add_edge("a", "c")
        >>> h = g.without_edges([("a", "c")])
        >>> h.op_preds("c"), g.op_preds("c")
        (['b'], ['b', 'a'])
        """
        out: dict[Hashable, set] = {}
        into: dict[Hashable, set] = {}
        for u, v in edges:
            out.setdefault(u, set()).add(v)
            into.setdefault(v, set()).add(u)
        g = nx.DiGraph()
        g.graph.update(self.nx.graph)
        succ, pred = dict(self.nx._succ), dict(self.nx._pred)
        for u, gone in out.items():
            succ[u] = {w: d for w, d in succ[u].items() if w not in gone}
        for v, gone in into.items():
            pred[v] = {w: d for w, d in pred[v].items() if w not in gone}
        g._node, g._adj, g._succ, g._pred = self.nx._node, succ, succ, pred
        return ComputeGraph(g, name=self.name, order=list(self.order), meta=dict(self.meta))

    @property
    def fixed_bytes(self) -> int:
        """Bytes resident for the whole step: sources plus ``meta['extra_fixed_bytes']``
        (the total of :class:`graphs.fixed.FixedCharges`)."""
        return int(
            sum(self.nx.nodes[n]["bytes"] for n in self.sources)
            + self.meta.get("extra_fixed_bytes", 0)
        )

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters (sources of kind ``param``)."""
        return int(sum(self.nx.nodes[n]["bytes"] for n in self.sources if self.nx.nodes[n].get("kind") == "param"))

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradients (the step's backward outputs)."""
        return int(sum(self.nx.nodes[n]["bytes"] for n in self.ops
                       if self.nx.nodes[n]["output"] and self.nx.nodes[n]["phase"] == "backward"))

    def forward_nodes(self) -> list[Hashable]:
        return [n for n in self.ops if self.nx.nodes[n]["phase"] == "forward"]

    def backward_nodes(self) -> list[Hashable]:
        return [n for n in self.ops if self.nx.nodes[n]["phase"] == "backward"]

    def saved_for_backward(self) -> list[Hashable]:
        """Forward values (inputs included, parameters and buffers excluded) that backward reads."""
        saved = []
        for n, data in self.nx.nodes(data=True):
            if data["kind"] in ("param", "buffer"):
                continue
            if data["kind"] == "input" and data["phase"] == "backward":  # tangents
                continue
            if data["kind"] == "op" and data["phase"] != "forward":
                continue
            if any(self.nx.nodes[s]["phase"] == "backward" and self.is_op(s)
                   for s in self.nx.successors(n)):
                saved.append(n)
        return saved

    def saved_bytes(self) -> int:
        """Bytes that a store-all step keeps from forward for backward.

        Storage-deduplicated (aliases carry 0 bytes and their base is itself saved),
        inputs included, parameters and buffers excluded.
        """
        return int(sum(self.nx.nodes[n]["bytes"] for n in self.saved_for_backward()))

    def total(self, attr: str, nodes: Iterable[Hashable] | None = None) -> float:
        nodes = self.ops if nodes is None else nodes
        return sum(self.nx.nodes[n][attr] for n in nodes)

    # ------------------------------------------------------------------ checks
    def validate(self) -> "ComputeGraph":
        """Check that the graph means what a schedule needs; raise on the first fault.

        Checked: every node has the attributes a schedule reads (:meth:`add_node` and
        the constructor fill in their defaults); its ``kind`` and ``phase`` are known;
        ``bytes``, ``flops``, ``time``, ``workspace``, ``run_workspace`` and
        ``group_time`` are finite non-negative numbers (not strings or booleans), and
        so is ``meta["extra_fixed_bytes"]``; the graph has no cycle and no node reads
        itself; the reference order names every op node once, nothing unknown, and runs
        every op after the ops it reads. :meth:`load`, :meth:`from_dict` and
        :func:`solver.solve` (through :func:`validated`) call it.

        Returns
        -------
        ComputeGraph
            ``self``, so that ``ComputeGraph(g).validate()`` chains.

        Raises
        ------
        GraphFormatError
            Naming the node at fault and what to change.

        Examples
        --------
        >>> g = ComputeGraph(name="g"); g.add_node("a", bytes=4); g.add_node("b", bytes=-1)
        >>> g.validate()
        Traceback (most recent call last):
          ...
        graphs.errors.GraphFormatError: graph 'g': node 'b' has bytes=-1; give a finite number >= 0
        """
        where = f"graph {self.name!r}: " if self.name else ""
        required = _DEFAULTS.keys()
        for n, data in self.nx._node.items():
            if not required <= data.keys():
                key = next(k for k in _DEFAULTS if k not in data)
                raise GraphFormatError(f"{where}{self._label(n)} has no {key!r}; add nodes with "
                                       f"ComputeGraph.add_node, or pass the networkx graph to ComputeGraph(...), "
                                       f"which fill in the defaults")
            if data["kind"] not in KINDS:
                raise GraphFormatError(f"{where}{self._label(n)} has unknown kind {data['kind']!r}; "
                                       f"use one of {', '.join(KINDS)}")
            if data["phase"] not in PHASES:
                raise GraphFormatError(f"{where}{self._label(n)} has unknown phase {data['phase']!r}; "
                                       f"use 'forward' or 'backward'")
            for key in _AMOUNTS:
                value = data.get(key, _ABSENT)
                if value is _ABSENT:
                    continue
                kind = type(value)
                # (the common cases without a call: graphs of 10^4 nodes are checked on every solve)
                if (kind is int or (kind is float and key not in _BYTE_AMOUNTS)) and 0 <= value < math.inf:
                    continue
                _check_amount(value, key, f"{where}{self._label(n)}")
            for key in _FLAGS:
                if type(data[key]) is not bool and not isinstance(data[key], np.bool_):
                    raise GraphFormatError(f"{where}{self._label(n)} has {key}={data[key]!r}; "
                                           f"give true or false")
        if "extra_fixed_bytes" in self.meta:
            _check_amount(self.meta["extra_fixed_bytes"], 'meta["extra_fixed_bytes"]', f"{where}the graph",
                          whole=True)
        loops = list(nx.nodes_with_selfloops(self.nx))
        if loops:
            raise GraphFormatError(f"{where}{self._label(loops[0])} reads itself (an edge from it to itself); "
                                   f"a training step is a DAG: remove the edge")
        if not nx.is_directed_acyclic_graph(self.nx):
            cycle = [u for u, _ in nx.find_cycle(self.nx)]
            shown = " -> ".join(repr(u) for u in cycle[:6]) + (" ..." if len(cycle) > 6 else "")
            raise GraphFormatError(f"{where}the graph has a cycle through {self._label(cycle[0])} "
                                   f"({shown} -> {cycle[0]!r}); a training step is a DAG")
        if self._order is not None:
            self._check_order(where)
        return self

    def _check_order(self, where: str) -> None:
        position: dict[Hashable, int] = {}
        for i, n in enumerate(self._order):
            try:
                known = n in self.nx
            except TypeError:  # an unhashable id (a JSON list)
                known = False
            if not known:
                raise GraphFormatError(f"{where}the reference order names {n!r}, which is not a node")
            if n in position:
                raise GraphFormatError(f"{where}the reference order names {self._label(n)} twice; "
                                       f"give every op node exactly once")
            if self.is_op(n):
                position[n] = i
        missing = [n for n in self.ops_set if n not in position]
        if missing:
            raise GraphFormatError(f"{where}the reference order leaves out {self._label(missing[0])} "
                                   f"({len(missing)} op nodes in all); give every op node exactly once")
        for u, v in self.nx.edges:
            if u in position and v in position and position[u] > position[v]:
                raise GraphFormatError(
                    f"{where}the reference order is not topological: {self._label(v)} comes before "
                    f"{self._label(u)}, which it reads (the edge {u!r} -> {v!r}); give an order that runs every "
                    f"op after its inputs"
                )

    def _label(self, n: Hashable) -> str:
        name = self.nx.nodes[n].get("name") if n in self.nx else None
        return f"node {n!r}" + (f" ({name!r})" if name and name != n else "")

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        data = nx.node_link_data(self.nx, edges="links")
        data["graph"] = {
            "name": self.name,
            "remat_schema": SCHEMA_VERSION,
            "order": list(self.order),
            "meta": self.meta,
        }
        return data

    def save(self, path: str | os.PathLike) -> None:
        """Write the graph as node-link JSON with a schema version.

        Examples
        --------
        >>> import tempfile, pathlib
        >>> g = ComputeGraph(); g.add_node("a", bytes=4); g.add_node("b", bytes=4)
        >>> g.add_edge("a", "b")
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "g.json"
        >>> g.save(p); ComputeGraph.load(p).ops
        ['a', 'b']
        """
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, default=_json_default)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str = "") -> "ComputeGraph":
        """Build a graph from node-link data (remat's schema or a benchmark graph) and
        :meth:`validate` it.

        Raises
        ------
        GraphFormatError
            The data is not a node-link graph, a node lacks ``bytes`` (or ``time`` for an
            op), an edge names an unknown node, or :meth:`validate` fails.

        Examples
        --------
        >>> ComputeGraph.from_dict([1, 2])
        Traceback (most recent call last):
          ...
        graphs.errors.GraphFormatError: not a node-link graph: the top level is a list, not an object with 'nodes' and 'links'
        """
        if not isinstance(data, dict):
            raise GraphFormatError(f"not a node-link graph: the top level is a {type(data).__name__}, "
                                   f"not an object with 'nodes' and 'links'")
        graph_attrs = data.get("graph", {}) or {}
        if not isinstance(graph_attrs, dict):
            raise GraphFormatError(f"not a node-link graph: 'graph' is a {type(graph_attrs).__name__}, "
                                   f"not an object of graph attributes")
        graph_attrs = dict(graph_attrs)  # networkx may adopt (and we clear) the original
        nodes, links = _node_link_lists(data)
        if "remat_schema" in graph_attrs:
            version = graph_attrs["remat_schema"]
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise GraphFormatError(
                    f"graph schema version {version!r} is newer than this remat "
                    f"({SCHEMA_VERSION}); upgrade remat to read it"
                )
            for n in nodes:
                required = ("bytes", "time") if n.get("kind", "op") == "op" else ("bytes",)
                for key in required:
                    if key not in n:
                        raise GraphFormatError(f"node {n['id']!r} has no {key!r}; every node needs its "
                                               f"bytes and every op node its time")
            g = nx.node_link_graph(data, edges="links", directed=True, multigraph=False)
            g.graph.clear()
            graph = cls(
                g,
                name=name or graph_attrs.get("name", ""),
                order=graph_attrs.get("order"),
                meta=graph_attrs.get("meta", {}),
            )
        else:
            graph = _from_benchmark(cls, data, nodes, links, name=name)
        return graph.validate()

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ComputeGraph":
        """Read a graph saved by :meth:`save`, or a public benchmark graph.

        Benchmark graphs (node-link JSON) come in two dialects: Checkmate's training
        graphs (``cost_cpu``, ``cost_ram``, ``backward``) and the random layered graphs
        (``duration``, ``out_cost``, graph attribute ``order``). Node ids are kept. The
        graph is checked by :meth:`validate`.

        Raises
        ------
        FileNotFoundError
            No such file.
        GraphFormatError
            The file is not JSON, not a node-link graph, or fails :meth:`validate`; the
            message starts with the path and names the node at fault.
        """
        with open(path) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise GraphFormatError(f"{path}: not JSON ({exc})") from exc
        name = os.path.splitext(os.path.basename(str(path)))[0]
        try:
            return cls.from_dict(data, name=name)
        except GraphFormatError as exc:
            raise GraphFormatError(f"{path}: {exc}") from None

    # ------------------------------------------------------------------ reports
    def summary(self, *, top: int = 5) -> str:
        """A readable table: nodes by phase and kind, FLOPs, time, store-all bytes."""
        counts = Counter(
            (d["kind"], d["phase"] if d["kind"] == "op" else "-")
            for _, d in self.nx.nodes(data=True)
        )
        lines = [f"ComputeGraph {self.name!r}: {len(self)} nodes, {self.nx.number_of_edges()} edges"]
        lines.append(f"  {'kind':<8} {'phase':<9} {'count':>7}")
        for (kind, phase), c in sorted(counts.items()):
            lines.append(f"  {kind:<8} {phase:<9} {c:>7}")
        fwd, bwd = self.forward_nodes(), self.backward_nodes()
        lines.append(
            f"  FLOPs: forward {_fmt_num(self.total('flops', fwd))}, "
            f"backward {_fmt_num(self.total('flops', bwd))}"
        )
        lines.append(
            f"  time:  forward {self.total('time', fwd):.4g}, backward {self.total('time', bwd):.4g}"
        )
        param_bytes = sum(self[n]["bytes"] for n in self.sources if self[n]["kind"] == "param")
        lines.append(f"  parameters: {_fmt_bytes(param_bytes)}; fixed (sources): {_fmt_bytes(self.fixed_bytes)}")
        lines.append(f"  store-all activations saved for backward: {_fmt_bytes(self.saved_bytes())}")
        biggest = sorted(self.ops, key=lambda n: -self[n]["bytes"])[:top]
        if biggest:
            lines.append("  biggest tensors:")
            for n in biggest:
                d = self[n]
                lines.append(f"    {str(n):<24} {d['phase']:<9} {d['op']:<36} {_fmt_bytes(d['bytes'])}")
        return "\n".join(lines)


def _order_list(order: Any, name: str) -> list:
    """``order`` as a list of node ids; a string, a mapping or a non-iterable is refused
    (``list("f0")`` would read as the nodes ``'f'`` and ``'0'``)."""
    if isinstance(order, (str, bytes, dict)) or not isinstance(order, Iterable):
        where = f"graph {name!r}: " if name else ""
        raise GraphFormatError(f"{where}the reference order is a {type(order).__name__}; give a list of node ids")
    return list(order)


def _check_amount(value: Any, key: str, what: str, *, whole: bool | None = None) -> None:
    """Refuse ``value`` unless it is a finite number >= 0 (a whole one for bytes)."""
    kind = type(value)
    if kind is not int and kind is not float:  # (the common cases first: graphs of 10^4 nodes)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise GraphFormatError(f"{what} has {key}={value!r}; give a finite number >= 0")
    if not value >= 0 or not math.isfinite(value):
        raise GraphFormatError(f"{what} has {key}={value!r}; give a finite number >= 0")
    if (key in _BYTE_AMOUNTS if whole is None else whole) and kind is not int and value != int(value):
        raise GraphFormatError(f"{what} has {key}={value!r}; give a whole number of bytes")


def validated(graph: Any, *, caller: str = "solve") -> ComputeGraph:
    """``graph`` checked as :meth:`ComputeGraph.load` checks a file: a
    :class:`ComputeGraph` with at least one op node that passes
    :meth:`ComputeGraph.validate`.

    Parameters
    ----------
    graph : object
        What the caller was given.
    caller : str
        The function named in the message (``"solve"``: ``solve() takes ...``).

    Returns
    -------
    ComputeGraph
        ``graph`` itself.

    Raises
    ------
    GraphFormatError
        Something else than a :class:`ComputeGraph` (a path, a networkx graph, None,
        ...: the message says how to make one), a graph without op nodes, or one that
        :meth:`ComputeGraph.validate` refuses.

    Examples
    --------
    >>> validated("g.json")
    Traceback (most recent call last):
      ...
    graphs.errors.GraphFormatError: solve() takes a ComputeGraph, got the str 'g.json'; read a graph file with ComputeGraph.load(path)
    >>> g = ComputeGraph(); g.add_node("a", bytes=4, time=1.0)
    >>> validated(g) is g
    True
    """
    # (by name as well: a ComputeGraph of a second copy of this module, as a reload or
    # an import by path makes, is one too)
    if not isinstance(graph, ComputeGraph) and type(graph).__name__ != "ComputeGraph":
        if graph is None:
            got, how = "None", ("pass the step's graph: graphs.capture(model, ...), ComputeGraph.load(path), "
                                "or one built with ComputeGraph().add_node(...)/.add_edge(...)")
        elif isinstance(graph, (str, os.PathLike)):
            got, how = f"the {type(graph).__name__} {str(graph)!r}", "read a graph file with ComputeGraph.load(path)"
        elif isinstance(graph, nx.Graph):
            got = f"a networkx {type(graph).__name__} of {graph.number_of_nodes()} nodes"
            how = ("wrap a networkx DiGraph as ComputeGraph(g) (nodes with bytes and time, edges from what "
                   "each node reads)")
        elif isinstance(graph, dict):
            got, how = "a dict", "read node-link data with ComputeGraph.from_dict(data)"
        else:
            got, how = f"a {type(graph).__name__}", ("pass a ComputeGraph: graphs.capture(model, ...), "
                                                    "ComputeGraph.load(path) or ComputeGraph(networkx_digraph)")
        raise GraphFormatError(f"{caller}() takes a ComputeGraph, got {got}; {how}")
    graph.validate()
    if not graph.ops_set:
        where = f"graph {graph.name!r}" if graph.name else "the graph"
        raise GraphFormatError(f"{where} has no op nodes ({len(graph)} nodes in all): nothing to schedule; "
                               f"add the step's ops (kind='op') with ComputeGraph.add_node")
    return graph


def _node_link_lists(data: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The node and link records of node-link data, checked for ids and known endpoints."""
    nodes = data.get("nodes")
    if not nodes or not isinstance(nodes, list):
        raise GraphFormatError("not a node-link graph: no list of 'nodes'")
    links = data.get("links", data.get("edges"))
    if not isinstance(links, list):
        raise GraphFormatError("not a node-link graph: no list of 'links'")
    ids = set()
    for k, n in enumerate(nodes):
        if not isinstance(n, dict) or "id" not in n:
            raise GraphFormatError(f"node record {k} has no 'id'")
        try:
            if n["id"] in ids:
                raise GraphFormatError(f"node record {k} repeats the id {n['id']!r}; give every node "
                                       f"its own id")
            ids.add(n["id"])
        except TypeError:
            raise GraphFormatError(f"node record {k} has id {n['id']!r}; use a string or a number") from None
    for k, e in enumerate(links):
        if not isinstance(e, dict) or "source" not in e or "target" not in e:
            raise GraphFormatError(f"link record {k} needs a 'source' and a 'target'")
        for end in ("source", "target"):
            try:
                known = e[end] in ids
            except TypeError:
                known = False
            if not known:
                raise GraphFormatError(f"link {e['source']!r} -> {e['target']!r} names {e[end]!r}, "
                                       f"which is not a node")
    return nodes, links


def _require(n: dict[str, Any], keys: tuple[str, ...], dialect: str) -> None:
    for key in keys:
        if key not in n:
            raise GraphFormatError(f"node {n['id']!r} has no {key!r}; every node of a {dialect} graph needs "
                                   f"{' and '.join(repr(k) for k in keys)}")


def _number(n: dict[str, Any], key: str, kind: type = float) -> Any:
    """``n[key]`` as ``kind`` when finite (else as it is, for :meth:`ComputeGraph.validate`)."""
    value = n[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GraphFormatError(f"node {n['id']!r} has {key}={value!r}; give a finite number >= 0")
    return kind(value) if math.isfinite(value) else value


def _from_benchmark(cls, data: dict[str, Any], nodes: list[dict], links: list[dict], *,
                    name: str) -> ComputeGraph:
    g = nx.DiGraph()
    first = nodes[0]
    if "cost_ram" in first:  # Checkmate training graphs
        for n in nodes:
            _require(n, ("cost_ram", "cost_cpu"), "Checkmate")
            g.add_node(
                n["id"],
                kind="op",
                phase="backward" if n.get("backward") else "forward",
                op=n.get("name", ""),
                name=n.get("name", ""),
                bytes=_number(n, "cost_ram", int),
                time=_number(n, "cost_cpu"),
            )
    elif "out_cost" in first:  # random layered graphs
        for n in nodes:
            _require(n, ("out_cost", "duration"), "random layered")
            g.add_node(
                n["id"],
                kind="op",
                phase="forward",
                op="node",
                bytes=_number(n, "out_cost", int),
                time=_number(n, "duration"),
            )
    else:
        raise GraphFormatError(
            "unknown graph format: expected remat's schema, Checkmate's "
            "(cost_cpu/cost_ram) or random layered (duration/out_cost) node attributes"
        )
    for e in links:
        g.add_edge(e["source"], e["target"])
    order = None
    gattr = data.get("graph", {}) or {}
    if "order" in gattr:
        raw = gattr["order"]
        # stored as (len, list) by the generator
        if isinstance(raw, (list, tuple)) and len(raw) == 2 and isinstance(raw[1], list):
            raw = raw[1]
        order = list(raw)
    return cls(g, name=name or str(gattr.get("name", "")), order=order,
               meta={"source_format": "checkmate" if "cost_ram" in first else "random_layered"})


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def repeated_note(graph: ComputeGraph) -> str | None:
    """What a report says of a DAG written by :func:`graphs.repeated.repeat_layers` (None for another).

    Examples
    --------
    >>> g = ComputeGraph(); g.meta["repeated"] = {"layers": 32, "template": "layers.2", "captured": 4}
    >>> repeated_note(g)
    'captured 4 of the 32 layers; layers.2 repeated as every middle layer (they are alike)'
    """
    r = graph.meta.get("repeated")
    if not r:
        return None
    return f"captured {r['captured']} of the {r['layers']} layers; {r['template']} repeated as every middle layer " \
           "(they are alike)"

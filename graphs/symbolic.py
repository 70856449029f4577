"""One capture for every size: a step captured with symbolic sizes
(:func:`graphs.capture.capture`'s ``symbolic_sizes``) runs, as one joint graph and one
rewrite of it, at every size of the dimensions it names; this module reads those sizes
off a call (:func:`call_sizes`) and gives the DAG's figures at them (:func:`at_sizes`),
so that a schedule is judged, or solved again, at a new size without a capture.

A call's sizes are the capture's only where they are consistent (one value per size
symbol, and every other dimension as captured), within the range ``torch.export``
allows, and where every condition the trace assumed of the sizes holds (a
decomposition that branched on a size): else :func:`call_sizes` says None and the call
is captured on its own.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import sympy

from graphs.compute_graph import ComputeGraph
from graphs.torch_internals import tree_leaves

__all__ = ["call_sizes", "at_sizes", "is_symbolic"]


def is_symbolic(cg: ComputeGraph) -> bool:
    """Whether ``cg`` was captured with symbolic sizes.

    Examples
    --------
    >>> is_symbolic(ComputeGraph())
    False
    """
    return bool(getattr(cg, "sizes", None))


def call_sizes(cg: ComputeGraph, args: tuple, kwargs: dict) -> dict | None:
    """The values of ``cg``'s size symbols in the call ``(args, kwargs)``, or None where
    the capture does not run it as traced.

    Parameters
    ----------
    cg : ComputeGraph
        Captured with symbolic sizes (:func:`is_symbolic`).
    args, kwargs
        A call of the captured forward with the same structure, ranks and dtypes.

    Returns
    -------
    dict or None
        ``{symbol: size}``.
    """
    flat = [t for t in tree_leaves((args, kwargs))]
    info = cg.capture_info
    traced = cg.meta.get("input_shapes", [])
    values: dict = {}
    checks = []
    for (i, d), (expr, bounds) in cg.sizes.items():
        if i >= len(flat) or not hasattr(flat[i], "shape") or d >= flat[i].dim():
            return None
        n = int(flat[i].shape[d])
        if isinstance(expr, sympy.Symbol):
            if values.setdefault(expr, n) != n:
                return None
        else:
            checks.append((expr, n))
        if bounds is not None and not (_within(n, bounds)):
            return None
    for expr, n in checks:
        if not expr.free_symbols <= values.keys() or int(expr.xreplace(values)) != n:
            return None
    symbolic = {(i, d) for i, d in cg.sizes}
    for k, shape in enumerate(traced):  # every other dimension as captured
        i = info.input_indices[k] if info is not None and k < len(info.input_indices) else k
        if shape is None or i >= len(flat) or not hasattr(flat[i], "shape"):
            continue
        if flat[i].dim() != len(shape):
            return None
        for d, n in enumerate(shape):
            if (i, d) not in symbolic and int(flat[i].shape[d]) != n:
                return None
    for guard in getattr(cg, "size_guards", []):
        if not guard.free_symbols <= values.keys() or not bool(guard.xreplace(values)):
            return None
    return values


def _hints(cg: ComputeGraph) -> dict:
    """The size symbols' values at the sizes ``cg`` was traced at."""
    shapes = cg.meta.get("input_shapes", [])
    info = cg.capture_info
    out = {}
    for (i, d), (expr, _) in cg.sizes.items():
        k = info.input_indices.index(i) if info is not None and i in info.input_indices else i
        if isinstance(expr, sympy.Symbol) and k < len(shapes) and shapes[k] is not None:
            out[expr] = shapes[k][d]
    return out


def _within(n: int, bounds: tuple) -> bool:
    lower, upper = bounds
    return (lower is None or not (n < lower)) and (upper is None or not (n > upper))


def at_sizes(cg: ComputeGraph, values: dict) -> ComputeGraph:
    """``cg`` (captured with symbolic sizes) with every node's bytes and FLOPs at the
    sizes ``values`` (:func:`call_sizes`); the same nodes, edges, order and metadata,
    the joint graph and capture details shared. Times and workspaces are ``cg``'s:
    :func:`graphs.measured.carry_costs` scales them.

    Examples
    --------
    >>> import torch
    >>> from graphs.capture import capture
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    >>> cg = capture(mlp, (torch.randn(4, 6),), symbolic_sizes={0: (0,)}, backward="outputs",
    ...              measure_time=False, measure_workspace=False)
    >>> big = at_sizes(cg, call_sizes(cg, (torch.randn(12, 6),), {}))
    >>> big["tanh"]["bytes"] == 3 * cg["tanh"]["bytes"]
    True
    """
    g = nx.DiGraph()
    g.graph.update(cg.nx.graph)
    nodes = {v: dict(d) for v, d in cg.nx._node.items()}
    cache: dict = {}

    def value(expr: Any) -> int:
        if expr not in cache:
            cache[expr] = int(expr.xreplace(values))
        return cache[expr]

    for v, expr in cg.sized_bytes.items():
        if v in nodes:
            nodes[v]["bytes"] = value(expr)
    for v, expr in cg.sized_flops.items():
        if v in nodes:
            nodes[v]["flops"] = value(expr)
    for d in nodes.values():  # a projection of a multi-output op: its share of the op's FLOPs
        parent = d.get("group")
        if parent in cg.sized_flops and parent not in nodes and d.get("flops"):
            was = cg.sized_flops[parent].xreplace(_hints(cg))
            d["flops"] = int(round(d["flops"] * value(cg.sized_flops[parent]) / int(was))) if int(was) else d["flops"]
    g._node, g._adj, g._succ, g._pred = nodes, cg.nx._succ, cg.nx._succ, cg.nx._pred
    out = ComputeGraph(g, name=cg.name, order=list(cg.order), meta=dict(cg.meta))
    out.fx, out.capture_info = cg.fx, cg.capture_info
    out.sizes, out.size_guards = cg.sizes, getattr(cg, "size_guards", [])
    out.sized_bytes, out.sized_flops = cg.sized_bytes, cg.sized_flops
    return out

"""Python's lifetimes in an eager forward: a tensor bound to a name in a module's
``forward`` stays alive until that forward returns, where the captured graph frees it
after its last reader.

Module mode runs the model's own forward, so its memory follows Python's names: in

.. code-block:: python

    def forward(self, x):
        q, k, v = self.qkv(x).split(d, dim=2)    # views of one projection
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a)
        return x + self.mlp(x)

``q``, ``k``, ``v`` (and so the whole projection they view) and ``a`` are held through
the MLP, and through its recomputation when the block is checkpointed (torch reruns the
forward, names included, up to its last saved tensor). :func:`bound_until_return` finds
such values from the captured graph's ``module`` and ``source`` attributes and the
forward's source code; :func:`solver.module_plan.hold_bound_locals` turns them into
edges of module mode's DAG.

What counts as bound: a value computed by an op that the module's ``forward`` runs itself
(not inside a submodule or a helper function), in an assignment statement outside any
loop whose names are not assigned again later in the forward, and read by an op of a
later statement of that forward. A value that enters the forward from a submodule and is
bound there is not found (its statement is not known); a name assigned again frees its
value at that statement, which the graph's own edges already say.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import textwrap
from typing import Any, Mapping

from graphs.compute_graph import ComputeGraph

__all__ = ["bound_until_return", "held_statements"]

_COMPOUND = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef,
             ast.AsyncFunctionDef, ast.ClassDef) + ((ast.Match,) if hasattr(ast, "Match") else ())
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _names(target: ast.AST) -> set[str]:
    """The plain names an assignment target binds (``a``, ``a, (b, *c)``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _names(target.value)
    return set()


def _bound_by(stmt: ast.AST) -> set[str]:
    if isinstance(stmt, ast.Assign):
        return set().union(*(_names(t) for t in stmt.targets))
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _names(stmt.target)
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return _names(stmt.target)
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return set().union(*(_names(i.optional_vars) for i in stmt.items if i.optional_vars is not None))
    if isinstance(stmt, ast.Delete):
        return set().union(*(_names(t) for t in stmt.targets))
    return set()


def held_statements(source: str, first_line: int = 1) -> tuple[dict[int, tuple[int, int]], set[tuple[int, int]]]:
    """The simple statements of a function's source, and those whose names hold their
    value until the function returns.

    Parameters
    ----------
    source : str
        The function's source (``inspect.getsourcelines``), decorators included.
    first_line : int
        The file's line number of the source's first line.

    Returns
    -------
    lines : dict
        File line -> the (first, last) lines of the innermost simple statement on it.
    held : set
        The statements (first, last) that assign names outside any loop, none of which
        is assigned again (or deleted) by a later statement.

    Examples
    --------
    >>> src = '''def forward(self, x):
    ...     q, k = x.split(2)
    ...     y = q * k
    ...     y = y + 1
    ...     return y
    ... '''
    >>> lines, held = held_statements(src)
    >>> sorted(held), lines[3]  # q, k = ... and the last y = ...; not the first y = ...
    ([(2, 2), (4, 4)], (3, 3))
    """
    tree = ast.parse(textwrap.dedent(source))
    fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None:
        return {}, set()
    shift = first_line - 1
    lines: dict[int, tuple[int, int]] = {}
    assigned: list[tuple[int, set[str]]] = []  # (line, names) of every binding statement
    candidates: list[tuple[tuple[int, int], set[str]]] = []

    def visit(body: list, in_loop: bool) -> None:
        for stmt in body:
            span = (stmt.lineno + shift, (stmt.end_lineno or stmt.lineno) + shift)
            names = _bound_by(stmt)
            if names:
                assigned.append((span[0], names))
            if isinstance(stmt, _COMPOUND):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue  # a nested definition: its statements run in another frame
                loop = in_loop or isinstance(stmt, _LOOPS)
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, field, None) or [], loop)
                for handler in getattr(stmt, "handlers", None) or []:
                    visit(handler.body, loop)
                for case in getattr(stmt, "cases", None) or []:
                    visit(case.body, loop)
                continue
            for line in range(span[0], span[1] + 1):
                lines[line] = span
            if names and not in_loop and isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                candidates.append((span, names))

    visit(fn.body, False)
    held = {span for span, names in candidates
            if not any(line > span[1] and names & again for line, again in assigned)}
    return lines, held


@functools.lru_cache(maxsize=256)
def _forward_statements(cls: type) -> tuple[str, dict, frozenset] | None:
    """(file name, line -> statement, held statements) of ``cls.forward``; None where
    its source cannot be read."""
    fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    try:
        path = inspect.getsourcefile(fn)
        source, start = inspect.getsourcelines(fn)
        lines, held = held_statements("".join(source), start)
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    if path is None:
        return None
    return os.path.basename(path), lines, frozenset(held)


def _statement(d: Mapping[str, Any], stmts: Mapping[str, Any]) -> tuple[int, int] | None:
    """The statement of the module's forward that runs op ``d`` itself, or None where a
    submodule or a helper function runs it."""
    info = stmts.get(d.get("module") or "")
    source = d.get("source") or ""
    if info is None or ":" not in source:
        return None
    name, _, line = source.rpartition(":")
    if name != info[0] or not line.isdigit():
        return None
    return info[1].get(int(line))


def bound_until_return(graph: ComputeGraph, model: Any) -> dict[Any, str]:
    """The forward values that a name in a module's ``forward`` holds until it returns.

    Parameters
    ----------
    graph : ComputeGraph
        A captured step (op nodes with ``module`` and ``source``).
    model : torch.nn.Module
        The captured model: its modules' ``forward`` source is read.

    Returns
    -------
    dict
        Node -> the path of the module whose forward holds it: the storage's owner (a
        view's base) of every value bound there and read by a later statement.

    Examples
    --------
    >>> import torch
    >>> from examples import models
    >>> from graphs.capture import capture
    >>> model, (idx, _) = models.gpt(n_layer=1, d=16, seq=8, batch=2, vocab=32)
    >>> g = capture(model, (idx,), backward="outputs", measure_time=False)
    >>> held = bound_until_return(g, model)
    >>> sorted(g[v]["op"] for v, m in held.items() if m == "blocks.0")  # the projection q, k, v view, a, x
    ['aten.add.Tensor', 'aten.addmm.default', 'aten.bmm.default']
    """
    stmts: dict[str, Any] = {}
    for path in {graph[v].get("module") or "" for v in graph.ops}:
        try:
            sub = model.get_submodule(path)
        except AttributeError:
            continue
        info = _forward_statements(type(sub))
        if info is not None:
            stmts[path] = info
    out: dict[Any, str] = {}
    forward = [v for v in graph.ops if graph[v]["phase"] == "forward"]
    for c in forward:
        dc = graph[c]
        at = _statement(dc, stmts)
        if at is None:
            continue
        module = dc.get("module") or ""
        for u in graph.nx.predecessors(c):
            du = graph[u]
            if du.get("kind") != "op" or du["phase"] != "forward" or (du.get("module") or "") != module:
                continue
            made = _statement(du, stmts)
            if made is None or made == at or made not in stmts[module][2]:
                continue
            owner = du.get("alias_of") or u
            out.setdefault(owner, module)
    return out

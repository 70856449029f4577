"""A model's repeated layers, found by structure and weight, from the model or its DAG.

Per-block checkpointing (and module mode's plans) acts on a model's *layers*: a
transformer's decoder layers (HF ``model.layers``, ``transformer.h``,
``encoder.layer``; torchvision's ``encoder.layers``), a ResNet's residual blocks in all
of its stages. :func:`pick_layers` chooses them from a tree of module paths, each with a
kind (alike modules share it) and a weight (parameters, or the compute its ops take):

1. candidates: the children of a list-like container (``ModuleList``, ``Sequential``),
   and the groups of two or more alike children of any other module; a candidate whose
   members are all list-like containers (a ResNet's stages) stands for their children;
2. a candidate whose members have submodules of their own (layers, not single ops)
   beats one of leaves; then the share of the model's weight it covers; then more
   members;
3. alike attributes of a module that is not a list (an encoder and a decoder) whose
   members each hold a candidate of layers give way to those layers (T5's blocks, not
   its two stacks);
4. where the winner's members are layers, every other module of their kind that
   overlaps none chosen joins them (a ConvNeXt's lighter stages, a stage of one block);
5. further candidates that hold as much as a fifth of the winner's weight and overlap
   none chosen join it (an encoder's and a decoder's layers).

The same rule runs on a model (:func:`graphs.module_mode.layer_blocks`, kinds from
classes, weights from parameters) and on a captured DAG (:func:`graph_layer_blocks`,
kinds from the module paths below each module, weights from op times), whose op nodes
carry the innermost ``module`` that ran them (:func:`graphs.capture.capture` records it
from each fx node's ``nn_module_stack``). This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from graphs.compute_graph import ComputeGraph

__all__ = ["ModuleInfo", "pick_layers", "graph_layer_blocks", "node_blocks", "JOIN_SHARE"]

#: A further candidate joins the winner when it holds at least this share of its weight.
JOIN_SHARE = 0.2


@dataclass(frozen=True)
class ModuleInfo:
    """What :func:`pick_layers` knows of one module.

    Attributes
    ----------
    kind : hashable
        Equal for modules that are alike (their class; their structure).
    weight : float
        Parameters, or the time of the ops the module runs (its submodules included).
    listlike : bool
        A container of layers run in sequence (``nn.ModuleList``, ``nn.Sequential``).
    """

    kind: Hashable
    weight: float
    listlike: bool = False


def _parent(path: str) -> str | None:
    if path == "":
        return None
    return path.rsplit(".", 1)[0] if "." in path else ""


def _inside(a: str, b: str) -> bool:
    """Whether path ``a`` lies strictly inside path ``b``."""
    return b == "" and a != "" or a.startswith(b + ".")


def _nested(a: str, b: str) -> bool:
    """Whether one of the paths lies inside the other (or they are equal)."""
    return a == b or a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + ".")


def pick_layers(modules: Mapping[str, ModuleInfo]) -> list[str]:
    """The paths of the repeated layers among ``modules`` (see the module's text).

    Parameters
    ----------
    modules : mapping of str to ModuleInfo
        Every module by path (``""``: the root), parents before children, children in
        the order they run.

    Returns
    -------
    list of str
        In the order of ``modules``; empty when no module has two children.

    Examples
    --------
    >>> m = {"": ModuleInfo("Net", 10), "emb": ModuleInfo("Emb", 2), "h": ModuleInfo("List", 8, True),
    ...      "h.0": ModuleInfo("Block", 4), "h.0.fc": ModuleInfo("Linear", 4),
    ...      "h.1": ModuleInfo("Block", 4), "h.1.fc": ModuleInfo("Linear", 4)}
    >>> pick_layers(m)
    ['h.0', 'h.1']
    """
    children: dict[str, list[str]] = {p: [] for p in modules}
    for p in modules:
        up = _parent(p)
        if up is not None and up in children:
            children[up].append(p)
    total = modules[""].weight if "" in modules else sum(i.weight for p, i in modules.items() if "." not in p)
    total = total or 1.0

    def expand(members: list[str]) -> list[str]:
        if all(modules[m].listlike and children[m] for m in members):
            return [c for m in members for c in children[m]]
        return members

    candidates: list[tuple[tuple, list[str]]] = []
    for p, kids in children.items():
        if len(kids) < 2:
            continue
        if modules[p].listlike:
            groups = [kids]
        else:
            by_kind: dict[Hashable, list[str]] = {}
            for k in kids:
                by_kind.setdefault(modules[k].kind, []).append(k)
            groups = [g for g in by_kind.values() if len(g) >= 2]
        for g in groups:
            members = expand(g)
            if len(members) < 2:
                continue
            composite = all(children[m] for m in members)
            weight = sum(modules[m].weight for m in members)
            candidates.append(((composite, weight / total, len(members)), members, modules[p].listlike))
    # alike attributes (an encoder and a decoder) whose every member holds layers of its
    # own give way to those layers
    inner = [members for (composite, _, _), members, _ in candidates if composite]
    candidates = [(key, members) for key, members, listed in candidates
                  if listed or not all(any(_inside(x, m) for layers in inner for x in layers) for m in members)]
    if not candidates:
        return []
    candidates.sort(key=lambda c: c[0], reverse=True)
    (composite, share, _), chosen = candidates[0]
    chosen = list(chosen)
    if composite and not any(modules[m].listlike for m in chosen):
        # the same layer elsewhere is a layer too, however light (a ConvNeXt's or an
        # EfficientNet's earlier stages, a stage of one block)
        kinds = {modules[m].kind for m in chosen}
        chosen.extend(p for p in modules if p not in chosen and children[p] and modules[p].kind in kinds
                      and not any(_nested(p, c) for c in chosen))
    for (comp, s, _), members in candidates[1:]:
        if comp != composite or s < JOIN_SHARE * share:
            continue
        if any(_nested(a, b) for a in members for b in chosen):
            continue
        chosen.extend(members)
    order = {p: i for i, p in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def graph_layer_blocks(graph: ComputeGraph) -> list[str]:
    """The repeated layers of a captured step, from the ``module`` its op nodes carry:
    :func:`pick_layers` with a module's kind the set of paths below it (the ``module``
    of its ops, relative to it), a module list-like when its children are numbered, and
    its weight the forward ops' time (their count where no time is known).

    Examples
    --------
    >>> g = ComputeGraph()
    >>> for i in range(3):
    ...     for part in ("attn", "mlp"):
    ...         g.add_node(f"{i}{part}", module=f"layers.{i}.{part}", phase="forward", time=1.0)
    >>> g.add_node("head", module="head", phase="forward", time=1.0)
    >>> graph_layer_blocks(g)
    ['layers.0', 'layers.1', 'layers.2']
    """
    weight: dict[str, float] = {"": 0.0}
    below: dict[str, set] = {"": set()}
    for v in graph.ops:
        d = graph[v]
        if d.get("phase") != "forward":
            continue
        mod = str(d.get("module") or "")
        w = float(d.get("time") or 0.0) or 1.0
        parts = mod.split(".") if mod else []
        for k in range(len(parts) + 1):
            p = ".".join(parts[:k])
            weight[p] = weight.get(p, 0.0) + w
            below.setdefault(p, set()).add(".".join(parts[k:]))
    first: dict[str, int] = {}
    for i, v in enumerate(graph.order):
        mod = str(graph[v].get("module") or "") if graph.is_op(v) else ""
        parts = mod.split(".") if mod else []
        for k in range(len(parts) + 1):
            first.setdefault(".".join(parts[:k]), i)
    # in the order they first run, each parent before its children
    paths = sorted(weight, key=lambda p: (first.get(p, 0), p.count(".") if p else -1))
    kids: dict[str, list[str]] = {}
    for p in paths:
        up = _parent(p)
        if up is not None:
            kids.setdefault(up, []).append(p)
    modules: dict[str, ModuleInfo] = {}
    for p in paths:
        names = [k.rsplit(".", 1)[-1] for k in kids.get(p, [])]
        listlike = bool(names) and all(n.isdigit() for n in names)
        # (list-like containers of layers are alike whatever their layers: a ResNet's
        # stages; a list of single ops is not one of them)
        kind = ("list", all(k in kids for k in kids.get(p, []))) if listlike else frozenset(below[p])
        modules[p] = ModuleInfo(kind, weight[p], listlike)
    return pick_layers(modules)


def node_blocks(graph: ComputeGraph, blocks: Sequence[str]) -> dict[Hashable, str]:
    """The block (of ``blocks``, module paths that do not nest) that ran each op node of
    ``graph``: the one its ``module`` lies in. Ops outside every block are left out.

    Examples
    --------
    >>> g = ComputeGraph(); g.add_node("a", module="h.0.mlp"); g.add_node("b", module="ln_f")
    >>> node_blocks(g, ["h.0", "h.1"])
    {'a': 'h.0'}
    """
    wanted = set(blocks)
    out: dict[Hashable, str] = {}
    for v in graph.ops:
        mod = str(graph[v].get("module") or "")
        while True:
            if mod in wanted:
                out[v] = mod
                break
            if "." not in mod:
                break
            mod = mod.rsplit(".", 1)[0]
    return out

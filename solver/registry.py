"""The table of named solver methods: :func:`register` fills it, :func:`registered` reads it.

Every method is a function ``fn(graph, budget_bytes, *, time_limit=None, **options) ->
Schedule`` that returns at least ``sequence`` (and ``offloads``, ``lower_bound``,
``info`` where it has them), registered by its module in :mod:`solver.methods`
(importing any method module imports them all). This module imports no method: the
methods import it, and :func:`solver.solving.solve` (which loads them) calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from solver.schedule import Schedule

__all__ = ["MethodInfo", "register", "registered"]

MethodFn = Callable[..., Schedule]


@dataclass(frozen=True)
class MethodInfo:
    """A registered method.

    Attributes
    ----------
    name : str
    fn : callable
    family : str
        ``baseline``, ``heuristic``, ``chain``, ``exact``, ``large``, ``offload`` or
        ``search`` (improves a schedule until its time limit runs out: portfolios that
        give a method the time left, as offload's, leave it out).
    exact : bool
        Returns a proven optimum (for its order freedom) when it finishes in time.
    order : str
        ``"fixed"`` keeps the graph's reference order and only adds recomputation;
        ``"free"`` may reorder.
    description : str
    """

    name: str
    fn: MethodFn
    family: str
    exact: bool
    order: str
    description: str


_REGISTRY: dict[str, MethodInfo] = {}


def register(
    name: str, *, family: str, exact: bool = False, order: str = "fixed", description: str = ""
) -> Callable[[MethodFn], MethodFn]:
    """Register ``fn`` as the method ``name`` (decorator)."""

    def deco(fn: MethodFn) -> MethodFn:
        known = _REGISTRY.get(name)
        if known is not None and (known.fn.__module__.rsplit(".", 1)[-1], known.fn.__qualname__) != (
            fn.__module__.rsplit(".", 1)[-1], fn.__qualname__
        ):
            raise ValueError(f"method {name!r} is registered twice")
        doc = description or ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        _REGISTRY[name] = MethodInfo(name, fn, family, exact, order, doc)
        return fn

    return deco


def registered() -> dict[str, MethodInfo]:
    """The methods registered so far, by name (:func:`solver.methods` loads them all
    first; inside a method module they are all loaded).

    Examples
    --------
    >>> import solver.methods.baselines
    >>> registered()["store_all"].family
    'baseline'
    """
    return dict(sorted(_REGISTRY.items()))

"""The table of named solver methods: :func:`register` fills it, :func:`registered` reads it.

Every method is a function ``fn(graph, budget_bytes, *, time_limit=None, <options>) ->
Schedule`` that returns at least ``sequence`` (and ``offloads``, ``lower_bound``,
``info`` where it has them), registered by its module in :mod:`solver.methods`
(importing any method module imports them all). This module imports no method: the
methods import it, and :func:`solver.solving.solve` (which loads them) calls them.

The contract of options: a method names every keyword option it takes in its signature
(no catch-all ``**kwargs``), so that an option it does not take is an error, never
silently ignored. :meth:`MethodInfo.check_options` raises :class:`OptionError` for one,
naming the method, the option and the options it takes; :func:`solver.solve` calls it
before any work.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from solver.errors import OptionError
from solver.schedule import Schedule

__all__ = ["MethodInfo", "OptionError", "register", "registered"]


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
    options : tuple of str or None
        The keyword options it takes besides ``time_limit``, read from its signature
        (None: it takes any, as a method registered with a ``**kwargs`` catch-all does).
    """

    name: str
    fn: MethodFn
    family: str
    exact: bool
    order: str
    description: str
    options: tuple[str, ...] | None = None

    def check_options(self, options: Mapping[str, object] | Iterable[str]) -> None:
        """Raise :class:`OptionError` for an option that this method does not take.

        Examples
        --------
        >>> from solver import get_method
        >>> get_method("every_k").check_options({"kk": 2})
        Traceback (most recent call last):
          ...
        solver.errors.OptionError: method 'every_k' takes no option 'kk' (did you mean 'k'?); its options: k (and time_limit)
        """
        if self.options is None:
            return
        unknown = [k for k in options if k not in self.options and k != "time_limit"]
        if not unknown:
            return
        near = difflib.get_close_matches(unknown[0], self.options, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        takes = f"its options: {', '.join(self.options)} (and time_limit)" if self.options else \
            "it takes no option but time_limit"
        names = " and ".join(repr(k) for k in unknown) if len(unknown) <= 3 else f"{unknown[0]!r} and {len(unknown) - 1} more"
        raise OptionError(f"method {self.name!r} takes no option{'s' if len(unknown) > 1 else ''} {names}{hint}; {takes}")


def _options_of(fn: MethodFn) -> tuple[str, ...] | None:
    """The keyword options of a method's signature besides the graph, the budget and
    ``time_limit`` (None where a ``**kwargs`` catch-all takes any)."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params[2:]
                 if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "time_limit")


_REGISTRY: dict[str, MethodInfo] = {}


def register(
    name: str, *, family: str, exact: bool = False, order: str = "fixed", description: str = ""
) -> Callable[[MethodFn], MethodFn]:
    """Register ``fn`` as the method ``name`` (decorator).

    ``fn`` takes ``(graph, budget_bytes, *, time_limit=None, <options>)``; name every
    option in the signature (see the module docstring): a ``**kwargs`` catch-all leaves
    its options unchecked.
    """

    def deco(fn: MethodFn) -> MethodFn:
        known = _REGISTRY.get(name)
        if known is not None and (known.fn.__module__.rsplit(".", 1)[-1], known.fn.__qualname__) != (
            fn.__module__.rsplit(".", 1)[-1], fn.__qualname__
        ):
            raise ValueError(f"method {name!r} is registered twice")
        doc = description or ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        _REGISTRY[name] = MethodInfo(name, fn, family, exact, order, doc, _options_of(fn))
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

"""Exception types of remat (the solver package reuses :class:`RematError`)."""

from __future__ import annotations

__all__ = ["RematError", "GraphFormatError", "CaptureError"]


class RematError(Exception):
    """Base class of every error that remat raises on purpose."""


class GraphFormatError(RematError, ValueError):
    """A graph file or graph object that remat cannot read."""


class CaptureError(RematError):
    """A model whose training step could not be captured as a graph.

    The message names the op or source line that failed and what to do instead.
    """

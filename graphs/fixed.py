"""What a training step holds besides its graph's tensors: a typed record, one writer.

A :class:`graphs.ComputeGraph` charges its sources (parameters, buffers, inputs) as
resident for the whole step, and its backward outputs (the gradients) from the op that
makes them on. Everything else a step holds for its whole length is a *fixed charge*:
the optimizer state, the gradient seed of ``loss.backward()``, the generator states a
replayed random op keeps, DDP's gradient buckets, the gradients accumulated before it. Each has one owner that sets it with
:func:`charge` (a field is set, never added to), so the total does not depend on the
order the owners run in; the total is ``meta["extra_fixed_bytes"]``, the figure
:attr:`graphs.ComputeGraph.fixed_bytes` reads and a graph's JSON carries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["FixedCharges", "charge", "fixed_charges", "kept_states", "states_not_sure", "REPLAY_KEY"]

#: ``graph.meta`` key of the record of the random ops a rewrite replays
#: (:class:`graphs.rewrite.RandomReplay`, one writer: :func:`graphs.rewrite.replay_random_ops`)
REPLAY_KEY = "random_replay"

_KEY = "fixed_charges"


@dataclass(frozen=True)
class FixedCharges:
    """Bytes a step holds for its whole length beyond the graph's sources.

    Attributes
    ----------
    optimizer : int
        Optimizer state (0 where a per-rank model shards and charges it itself).
    seed : int
        The scalars autograd creates outside the graph (the gradient seed).
    rng_states : int
        Generator states kept to replay random ops (:func:`graphs.rewrite.replay_random_ops`).
    buckets : int
        DDP's gradient buckets.
    grads : int
        Gradients the parameters already hold when the step starts (accumulated over
        micro-batches, or not set to None between steps): resident for its whole length.
    other : int
        Charged by whoever wrote the graph (a loaded graph's ``extra_fixed_bytes``).

    Examples
    --------
    >>> FixedCharges(optimizer=160, seed=64).total
    224
    """

    optimizer: int = 0
    seed: int = 0
    rng_states: int = 0
    buckets: int = 0
    grads: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        """All fixed charges together (``meta["extra_fixed_bytes"]``)."""
        return self.optimizer + self.seed + self.rng_states + self.buckets + self.grads + self.other

    @property
    def untracked(self) -> int:
        """What a live-tensor tracker cannot see in a step of the bare model: the
        optimizer state, not yet created, and DDP's buckets, not yet made."""
        return self.optimizer + self.buckets


def fixed_charges(graph: Any) -> FixedCharges:
    """The graph's fixed charges.

    Examples
    --------
    >>> from graphs import ComputeGraph
    >>> g = ComputeGraph(meta={"extra_fixed_bytes": 100})
    >>> fixed_charges(g)
    FixedCharges(optimizer=0, seed=0, rng_states=0, buckets=0, grads=0, other=100)
    """
    fields = graph.meta.get(_KEY)
    if fields is None:
        return FixedCharges(other=int(graph.meta.get("extra_fixed_bytes", 0)))
    return FixedCharges(**fields)


def charge(graph: Any, **fields: int) -> FixedCharges:
    """Set some fixed charges of ``graph`` (the others are kept) and return them all.

    Examples
    --------
    >>> from graphs import ComputeGraph
    >>> g = ComputeGraph()
    >>> _ = charge(g, optimizer=160, seed=64); _ = charge(g, optimizer=0)
    >>> g.meta["extra_fixed_bytes"], g.fixed_bytes
    (64, 64)
    """
    unknown = set(fields) - {f.name for f in dataclasses.fields(FixedCharges)}
    if unknown:
        raise TypeError(f"unknown fixed charges {sorted(unknown)}")
    charges = dataclasses.replace(fixed_charges(graph), **{k: int(v) for k, v in fields.items()})
    graph.meta[_KEY] = dataclasses.asdict(charges)
    graph.meta["extra_fixed_bytes"] = charges.total
    return charges


def kept_states(graph: Any) -> tuple[dict, int]:
    """The random ops whose generator states ``FixedCharges.rng_states`` charges for the
    whole step, each mapped to the op that draws (a multi-output op's projections share
    their ``group``'s state), and the bytes of one state: 0 where the states live outside
    the budget's memory (CUDA's) or the graph's record predates the figure. A schedule
    holds an op's state only from its first run to its last, and only where it runs the
    op more than once (:func:`solver.simulate.simulate` gives back the rest).

    Examples
    --------
    >>> from graphs import ComputeGraph
    >>> g = ComputeGraph(); g.add_node("mask", bytes=64)
    >>> g.meta[REPLAY_KEY] = {"ops": ["mask"], "state_bytes": 10112, "per_state": 5056}
    >>> kept_states(g)
    ({'mask': 'mask'}, 5056)
    """
    record = graph.meta.get(REPLAY_KEY)
    per = int(record.get("per_state", 0)) if isinstance(record, dict) else 0
    if not per:
        return {}, 0
    return {v: graph[v].get("group") or v for v in record["ops"] if v in graph.nx}, per


def states_not_sure(graph: Any) -> int:
    """Bytes of the fixed charge that a schedule may not hold: every generator state of
    :func:`kept_states` and the replay's one more. A lower bound on the peak counts the
    fixed bytes less these.

    Examples
    --------
    >>> from graphs import ComputeGraph
    >>> g = ComputeGraph(); g.add_node("mask", bytes=64)
    >>> g.meta[REPLAY_KEY] = {"ops": ["mask"], "state_bytes": 10112, "per_state": 5056}
    >>> states_not_sure(g)
    10112
    """
    ops, per = kept_states(graph)
    return (len(set(ops.values())) + 1) * per if per else 0

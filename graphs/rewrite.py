"""Schedule -> runnable forward and backward fx graphs (the exact, tensor-level rewrite).

The joint ATen graph of a training step (AOTAutograd's, placeholders ``primals_*`` and
``tangents_*``, outputs = forward outputs then gradients) is cut in two by a schedule:

* the **forward graph** runs the schedule's steps up to the last step that the forward
  outputs need, and returns the forward outputs plus the values that backward reads
  before computing them again: exactly the tensors the schedule stores;
* the **backward graph** runs the remaining steps in the schedule's order: gradients,
  with every recomputation placed where the schedule puts it (a node computed twice is
  simply copied twice).

Both graphs use the boxed calling convention, so an input is released as soon as the
graph no longer needs it, and fx's code generation frees every value after its last use.
AOTAutograd's runtime runs the pair as one autograd function.

A random op (dropout's ``bernoulli``, CUDA's ``native_dropout``, a fused attention with
``dropout_p > 0``) that the schedule runs more than once draws the same numbers every
time: before its first run the graph takes a copy of the device's generator state (a
small tensor, saved for backward like any value), and every later run sets that state,
runs the op and puts the generator back as it was, so the draws of the step as a whole
are those of eager. A multi-output random op is run by its projections: a projection
that starts a run of the op replays the state, one that continues the run does not.

An offload (:class:`Transfer`, from a schedule's windows by :func:`transfers`) runs as the
simulator (:mod:`solver.simulate`) counts it: the copy to the host starts before the op
of its transfer-out step and the device copy is dropped after that op (the op may still
read it); the copy back starts before the op of its transfer-in step and is the value
that later ops read from after that op. Between the two, no op reads the value: the
rewrite refuses a schedule that would (:class:`RewriteError`). The host copy is a
value of the graphs like any other, saved for backward when the window spans the end of
the forward; views of an offloaded value are derived again from the copy that comes
back. The transfers themselves are :mod:`graphs.host_pool`'s (side stream and events on
CUDA, an emulated host on CPU).

A schedule names the ops of a :class:`~graphs.ComputeGraph` whose node ids are the joint
graph's node names. Joint nodes the schedule does not name (``getitem`` projections of a
multi-output op, symbolic-size nodes) are recomputed on demand next to their user.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import torch
import torch.fx as fx

from graphs import host_pool
from graphs.capture import node_draws
from graphs.errors import RematError
from graphs.fixed import REPLAY_KEY, charge
from graphs.torch_internals import (FakeTensorMode, boxed_codegen, detect_fake_mode, fake_value, is_op_overload,
                                     lazy_graph_module, op_schema)

__all__ = ["RewriteError", "partition_by_schedule", "schedule_graphs", "boxed", "rng_state_bytes", "replay_random_ops", "RandomReplay",
           "random_replay", "Transfer", "transfers"]

log = logging.getLogger(__name__)


class RewriteError(RematError):
    """A schedule that cannot be turned into runnable graphs."""


def rng_state(device: torch.device) -> torch.Tensor:
    """A copy of the generator state of ``device``.

    Examples
    --------
    >>> s = rng_state(torch.device("cpu")); a = torch.rand(2)
    >>> _ = rng_swap(s, torch.device("cpu")); torch.equal(torch.rand(2), a)
    True
    """
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@fx.node.has_side_effect
def rng_swap(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Set the generator of ``device`` to ``state``; return the state it had
    (:func:`rng_state` shows both)."""
    prev = rng_state(device)
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
    return prev


@fx.node.has_side_effect
def _rng_restore(prev: torch.Tensor, device: torch.device, after: object = None) -> None:
    """Put back the generator state that :func:`rng_swap` returned (``after``: the op's
    result, so that the restore follows the draw)."""
    rng_swap(prev, device)


@fx.node.has_side_effect
def _drawn(value: object) -> None:
    """Keep a random op's first run (and its draws) in a graph that never reads its
    result: dead-code elimination removes what nothing reads."""


def rng_state_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of one saved generator state of ``device`` (what replaying one random op
    costs).

    Examples
    --------
    >>> rng_state_bytes("cpu") > 0
    True
    """
    device = torch.device(device)
    return int(rng_state(device).numel())


_RNG_KEY = "rng:"  # env key of the generator state kept for a random op




@dataclass(frozen=True)
class RandomReplay:
    """What :func:`replay_random_ops` did to a graph (its record, kept in the graph's
    ``meta`` so that copies and graph files carry it).

    Attributes
    ----------
    ops : tuple
        The random ops it made recomputable.
    state_bytes : int
        Bytes of the generator states it charged (``FixedCharges.rng_states``; 0 when
        the states live on CUDA, outside the budget's memory): one per op, and one
        more for the state a replay swaps out while the op runs.
    per_state : int
        Bytes of one state (0 on CUDA): :func:`graphs.fixed.kept_states`.

    Examples
    --------
    >>> RandomReplay(ops=("mask",), state_bytes=10112, per_state=5056).ops
    ('mask',)
    """

    ops: tuple = ()
    state_bytes: int = 0
    per_state: int = 0


def random_replay(graph) -> RandomReplay | None:
    """The :class:`RandomReplay` record of ``graph``; None until :func:`replay_random_ops`
    has run on it.

    Examples
    --------
    >>> from graphs import ComputeGraph
    >>> random_replay(ComputeGraph()) is None
    True
    """
    got = graph.meta.get(REPLAY_KEY)
    if got is None:
        return None
    if got is True:  # a graph file written when the record was a bare flag
        return RandomReplay()
    return RandomReplay(ops=tuple(got["ops"]), state_bytes=int(got["state_bytes"]),
                        per_state=int(got.get("per_state", 0)))


def replay_random_ops(graph) -> int:
    """Let schedules of ``graph`` run its random ops more than once.

    :func:`partition_by_schedule` replays a random op's generator state, so its draws
    are the same on every run: the ops become ``recomputable`` (the simulator still
    keeps their first runs in the reference order, ``meta["ordered"]``). Each kept
    state (one per op: the projections of a multi-output op such as ``native_dropout``
    share theirs), and one more that a replay swaps out while its op runs, is charged to
    the fixed bytes when it lives on the device (on CPU): the most a schedule can hold; the
    simulator gives back what a schedule does not hold (:func:`graphs.fixed.kept_states`). What it
    did is the graph's :class:`RandomReplay` record (:func:`random_replay`); a graph
    that has one is left as it is, so calling it again changes nothing.

    Returns
    -------
    int
        How many random ops became recomputable.

    Examples
    --------
    >>> from graphs import ComputeGraph
    >>> g = ComputeGraph(); g.add_node("mask", bytes=64, recomputable=False)
    >>> g.meta["ordered"] = ["mask"]
    >>> replay_random_ops(g), g["mask"]["recomputable"], random_replay(g).ops
    (1, True, ('mask',))
    >>> import json  # a graph file carries the record: a loaded graph is not charged again
    >>> loaded = ComputeGraph.from_dict(json.loads(json.dumps(g.to_dict())))
    >>> replay_random_ops(g), replay_random_ops(loaded), random_replay(loaded) == random_replay(g)
    (0, 0, True)
    """
    if random_replay(graph) is not None:
        return 0
    # (a forward output stays as it is: the caller holds the forward's copy to the end)
    random = [v for v in graph.meta.get("ordered", ()) if v in graph.nx and not graph[v]["recomputable"]
              and not (graph[v]["output"] and graph[v]["phase"] == "forward")]
    for v in random:
        graph[v]["recomputable"] = True
    # one state per op that draws: the projections of a multi-output op share their op's
    states = len({graph[v].get("group") or v for v in random})
    # CPU generator states live in the same (host) memory as the tensors; CUDA ones do not
    info = graph.capture_info
    inputs = getattr(info, "flat_inputs", None) or []
    on_cpu = not any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in inputs)
    per = rng_state_bytes("cpu") if on_cpu and states else 0
    extra = (states + 1) * per if per else 0
    charge(graph, rng_states=extra)
    graph.meta[REPLAY_KEY] = dataclasses.asdict(RandomReplay(ops=tuple(random), state_bytes=extra, per_state=per))
    graph._invalidate()
    return len(random)


_HOST_KEY = "host:"  # env key of the host copy of an offloaded value


@dataclass(frozen=True)
class Transfer:
    """One offload as the rewrite runs it, in *slots* of the rewritten sequence (slot
    ``2 i`` is just before the op of step ``i``, slot ``2 i + 1`` just after it, slot
    ``2 len(sequence)`` the end).

    Attributes
    ----------
    node : str
        The offloaded value.
    send, release : int
        Slots where the copy to the host starts and where the device copy is dropped.
    fetch, arrive : int
        Slots where the copy back starts and where ops may read it again.

    Examples
    --------
    >>> Transfer("relu", send=4, release=5, fetch=10, arrive=11).window
    (5, 11)
    """

    node: str
    send: int
    release: int
    fetch: int
    arrive: int

    @property
    def window(self) -> tuple[int, int]:
        """The slots between which no op reads the value (exclusive, inclusive)."""
        return self.release, self.arrive


def transfers(sequence: Sequence[Hashable], offloads: Iterable, *,
              skip: Iterable[Hashable] = ()) -> tuple[list[str], list[Transfer]]:
    """A schedule's sequence without the steps that have no op to run (``skip``, such as
    :data:`graphs.compute_graph.BACKWARD_START`), and its offloads as :class:`Transfer`
    slots of that sequence.

    An :class:`~solver.schedule.Offload` ``(node, after, before)`` sends during step
    ``after + 1`` and fetches during step ``before - 1``, as :mod:`solver.simulate`
    charges it: the send starts before that step's op and the device copy is dropped
    after it; the fetch starts before its step's op and the value is read from after
    it. A send at a skipped step happens after the op before it (the value leaves no
    later than the simulator says); a fetch at a skipped step before the op after it
    (it arrives no earlier than needed, and before that op reads it).

    Raises
    ------
    RewriteError
        An offload's steps are out of the sequence, or it names a skipped step.

    Examples
    --------
    >>> from types import SimpleNamespace as Off
    >>> seq, ts = transfers(["a", "b", "<bw>", "c", "d"], [Off(node="a", after=0, before=4)], skip={"<bw>"})
    >>> seq, ts
    (['a', 'b', 'c', 'd'], [Transfer(node='a', send=2, release=3, fetch=4, arrive=5)])
    >>> transfers(["a", "b", "<bw>", "c", "d"], [Off(node="a", after=1, before=4)], skip={"<bw>"})[1]
    [Transfer(node='a', send=3, release=3, fetch=4, arrive=5)]
    """
    skip = set(skip)
    full = list(sequence)
    index: list[int | None] = []
    kept: list[str] = []
    for s in full:
        if s in skip:
            index.append(None)
        else:
            index.append(len(kept))
            kept.append(str(s))
    out = []
    for off in offloads:
        node, after, before = off.node, int(off.after), int(off.before)
        if not (0 <= after and after + 1 < before <= len(full)):
            raise RewriteError(f"the offload of {node!r} needs 0 <= after < before - 1 < {len(full)} (the "
                               f"sequence's length), got after={after}, before={before}")
        if node in skip:
            raise RewriteError(f"the offload names {node!r}, a step without a value")
        out_step, in_step = after + 1, before - 1
        if index[out_step] is not None:
            send, release = 2 * index[out_step], 2 * index[out_step] + 1
        else:
            prev = next((index[t] for t in range(out_step, -1, -1) if index[t] is not None), None)
            send = release = 0 if prev is None else 2 * prev + 1
        if index[in_step] is not None:
            fetch, arrive = 2 * index[in_step], 2 * index[in_step] + 1
        else:
            nxt = next((index[t] for t in range(in_step, len(full)) if index[t] is not None), len(kept))
            fetch = arrive = 2 * nxt
        out.append(Transfer(str(node), send, release, fetch, arrive))
    return kept, out


def _drawing_op(node: fx.Node) -> fx.Node | None:
    """The op whose run draws random numbers when ``node`` runs: ``node`` itself, or for
    a projection (``getitem``) the multi-output op it runs; None if nothing draws."""
    if _is_projection(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if node_draws(node) else None


def _draw_device(op: fx.Node) -> torch.device:
    """The device whose generator ``op`` draws from: that of its first tensor input (a
    fused attention's seed and offset outputs may live on the host)."""
    for u in op.all_input_nodes:
        val = u.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    val = op.meta.get("val")
    first = next((v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)), None)
    return first.device if first is not None else torch.device("cpu")


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """Switch ``gm`` to the boxed calling convention (inputs as one list that the graph
    clears, so each input is freed after its last use)."""
    gm.graph.set_codegen(boxed_codegen())
    gm.recompile()
    return gm


def is_tangent(node: fx.Node) -> bool:
    """Whether a placeholder of a joint graph is an output's gradient (a tangent)."""
    return node.op == "placeholder" and (
        node.name.startswith("tangents") or node.meta.get("partitioner_tag") == "is_backward"
    )


def partition_by_schedule(
    joint: fx.GraphModule,
    sequence: Sequence[Hashable],
    *,
    num_fwd_outputs: int,
    offloads: Sequence[Transfer] = (),
) -> tuple[fx.GraphModule, fx.GraphModule, list[str]]:
    """Cut a joint graph into forward and backward graphs that run ``sequence``.

    Parameters
    ----------
    joint : torch.fx.GraphModule
        AOTAutograd's joint graph.
    sequence : sequence of node names
        The schedule's steps (op nodes only; a repeated name is a recomputation).
    num_fwd_outputs : int
        How many of the joint graph's outputs belong to the forward.
    offloads : sequence of Transfer
        The offloads to run, in slots of ``sequence`` (:func:`transfers`).

    Returns
    -------
    forward, backward : torch.fx.GraphModule
        In the layout AOTAutograd expects: forward returns ``(*fwd_outputs, *saved)``,
        backward takes ``(*saved, *tangents)`` and returns the gradients.
    saved : list of str
        The names of the saved values, in order.

    Raises
    ------
    RewriteError
        A step reads a value that no earlier step made, or that is on the host.
    """
    fg, bg, saved = schedule_graphs(joint, sequence, num_fwd_outputs=num_fwd_outputs, offloads=offloads)
    # AOTAutograd's runtime passes the saved sizes to the backward before the saved tensors
    kept = [n for n in bg.nodes if n.op == "placeholder"][:len(saved)]
    anchor = next((n for n in kept if not _is_size(n)), None)
    if anchor is not None:
        for ph in [n for n in kept if _is_size(n)]:
            anchor.prepend(ph)
    # their code is generated once, when first run
    return lazy_graph_module(joint, fg), lazy_graph_module(joint, bg), saved


def schedule_graphs(
    joint: fx.GraphModule,
    sequence: Sequence[Hashable],
    *,
    num_fwd_outputs: int,
    offloads: Sequence[Transfer] = (),
) -> tuple[fx.Graph, fx.Graph, list[str]]:
    """:func:`partition_by_schedule`'s forward and backward as bare ``fx.Graph`` objects,
    without their Python code: what an ``fx.Interpreter`` runs
    (``Interpreter(joint, graph=forward)``) needs no more."""
    writer = _ScheduleWriter(joint, sequence, num_fwd_outputs=num_fwd_outputs, offloads=offloads)
    writer.write_forward()
    writer.write_backward()
    return writer.finish()


class _ScheduleWriter:
    """Writes :func:`schedule_graphs`'s two graphs: the schedule's steps read off the
    joint graph and cut where the forward ends (:meth:`__init__`), the forward's steps
    (:meth:`write_forward`), the backward's, whose values saved by the forward become
    its inputs on first read (:meth:`write_backward`), then both graphs' outputs
    (:meth:`finish`)."""

    def __init__(self, joint: fx.GraphModule, sequence: Sequence[Hashable], *, num_fwd_outputs: int,
                 offloads: Sequence[Transfer]) -> None:
        self.nodes = nodes = {n.name: n for n in joint.graph.nodes}
        self.placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
        self.primals = [n for n in self.placeholders if not is_tangent(n)]
        self.tangents = [n for n in self.placeholders if is_tangent(n)]
        out_node = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
        outputs = list(out_node.args[0])
        self.fwd_outs, self.grads = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]

        self.seq = seq = [str(s) for s in sequence]
        unknown = [s for s in seq if s not in nodes]
        if unknown:
            raise RewriteError(f"the schedule names {unknown[0]!r}, which is not a node of the joint graph")
        split = self._split()
        self.fwd_steps, self.bwd_steps = seq[: split + 1], seq[split + 1 :]
        self.scheduled = set(seq)

        self.fg = fx.Graph()
        self.fenv: dict[str, fx.Node] = {}
        for p in self.primals:
            self.fenv[p.name] = _copy_placeholder(self.fg, p)
        self.away: set[str] = set()  # offloaded values not back yet

        # random ops that run more than once replay the draws of their first run
        self.run_of = _runs(seq, nodes, self.scheduled)
        self.drawer = [_drawing_op(nodes[s]) for s in seq]
        runs: dict[str, int] = {}
        for i, d in enumerate(self.drawer):
            if d is not None and not self.run_of[i]:
                runs[d.name] = runs.get(d.name, 0) + 1
        self.replayed = {d for d, c in runs.items() if c > 1}
        self.runs_so_far: dict[str, int] = {}

        self.events = _transfer_events(offloads, nodes, self.fwd_outs, len(seq))
        self.pending: dict[tuple, fx.Node] = {}

        # the backward graph: its inputs are the tangents, and the saved values before them
        self.bg = fx.Graph()
        self.benv: dict[str, fx.Node] = {}
        self.saved: list[str] = []
        self.saved_ph: dict[str, fx.Node] = {}
        for t in self.tangents:
            self.benv[t.name] = _copy_placeholder(self.bg, t)
        self.first_tangent = next(iter(self.bg.nodes), None)

    def _split(self) -> int:
        """The last step of the forward segment: the last step that the forward outputs
        need, or the step before the first output gradient, when the schedule says where
        they arrive (the forward graph then runs every step before it, as the schedule
        counts them)."""
        nodes, seq = self.nodes, self.seq
        needed_fwd = _ancestors([o for o in self.fwd_outs if isinstance(o, fx.Node)])
        first_pos: dict[str, int] = {}
        for i, s in enumerate(seq):
            first_pos.setdefault(s, i)
        split = -1
        for name in needed_fwd:
            if nodes[name].op == "call_function" and name in first_pos:
                split = max(split, first_pos[name])
        arrival = next((i for i, s in enumerate(seq) if nodes[s].op == "placeholder"), None)
        if arrival is not None:
            split = max(split, arrival - 1)
        return split

    def run_step(self, g: fx.Graph, env: dict, i: int, s: str, resolve, saved_state) -> None:
        """Write step ``i`` (node ``s``) into ``g``; a replayed random op draws from the
        generator state of its first run."""
        node = self.nodes[s]
        _start_run(node, env, self.run_of[i], self.scheduled)
        op = self.drawer[i]
        if op is None or op.name not in self.replayed or self.run_of[i]:
            new = _emit(g, node, env, self.scheduled, resolve)
        else:  # the same draws every run: keep the generator state of the first, replay it
            s = op.name
            key, dev = _RNG_KEY + s, _draw_device(op)
            if not self.runs_so_far.get(s):
                env[key] = g.call_function(rng_state, (dev,))
                env[key].meta["val"] = fake_value(rng_state(dev), like=self.placeholders)
                new = _emit(g, node, env, self.scheduled, resolve)
                # the first run draws even where a later run's copy is the one read:
                # without it, every later draw of the step would come from another state
                g.call_function(_drawn, (new,))
            else:
                prev = g.call_function(rng_swap, (env[key] if key in env else saved_state(key), dev))
                new = _emit(g, node, env, self.scheduled, resolve)
                g.call_function(_rng_restore, (prev, dev, new))
            self.runs_so_far[s] = self.runs_so_far.get(s, 0) + 1
        new.meta["remat_step"] = i

    def fire(self, g: fx.Graph, env: dict, slot: int, resolve, saved_state) -> None:
        """Write the transfers of ``slot`` into ``g``."""
        for kind, k, tr in self.events.get(slot, ()):
            _fire(g, env, kind, k, tr, nodes=self.nodes, scheduled=self.scheduled, pending=self.pending,
                  away=self.away, resolve=resolve, saved_state=saved_state, like=self.placeholders)

    # ---- forward graph
    def resolve_forward(self, u: fx.Node) -> fx.Node:
        """An input of a forward step that no step made: a view or an unscheduled op,
        written where it is read."""
        _not_away(u, self.away, self.fenv)
        if u.op == "call_function" and (u.name not in self.scheduled or is_view(u)):
            return _emit(self.fg, u, self.fenv, self.scheduled, self.resolve_forward)
        raise RewriteError(f"forward reads {u.name!r} before the schedule computes it")

    @staticmethod
    def no_saved_state(key: str) -> fx.Node:
        """The forward has no earlier graph to take a generator state from."""
        raise RewriteError(f"{key[len(_RNG_KEY):]!r} runs again before it first ran")

    def write_forward(self) -> None:
        """The forward's steps and transfers, then what its outputs still need."""
        fg, fenv = self.fg, self.fenv
        for i, s in enumerate(self.fwd_steps):
            if self.nodes[s].op == "placeholder":
                raise RewriteError(f"the schedule runs {s!r} (an input of backward) before the forward outputs")
            self.fire(fg, fenv, 2 * i, self.resolve_forward, self.no_saved_state)
            self.run_step(fg, fenv, i, s, self.resolve_forward, self.no_saved_state)
            self.fire(fg, fenv, 2 * i + 1, self.resolve_forward, self.no_saved_state)
        for o in self.fwd_outs:
            if isinstance(o, fx.Node) and o.name not in fenv:
                self.resolve_forward(o)

    # ---- backward graph: saved values become placeholders (before the tangents) on first read
    def from_forward(self, u: fx.Node | str) -> fx.Node:
        """A value of the forward read in backward: saved, an input of the backward."""
        name = u if isinstance(u, str) else u.name
        if name not in self.fenv:
            raise RewriteError(f"backward reads {name!r} before the schedule computes it")
        self.saved.append(name)
        if self.first_tangent is not None:
            with self.bg.inserting_before(self.first_tangent):
                ph = self.bg.placeholder(_placeholder_name(name))
        else:
            ph = self.bg.placeholder(_placeholder_name(name))
        ph.meta = dict(self.fenv[name].meta)
        self.benv[name] = ph
        self.saved_ph[name] = ph
        return ph

    def resolve_backward(self, u: fx.Node) -> fx.Node:
        """An input of a backward step that no backward step made: written here where it
        may be, saved by the forward otherwise."""
        bg, benv, fenv, scheduled = self.bg, self.benv, self.fenv, self.scheduled
        _not_away(u, self.away, benv)
        if u.op == "call_function" and u.name not in scheduled:
            if _is_multi_output(u) or all(w.name in benv for w in u.all_input_nodes) or u.name not in fenv:
                return _emit(bg, u, benv, scheduled, self.resolve_backward)
        if is_view(u) and _derivable(u, benv):
            return _emit(bg, u, benv, scheduled, self.resolve_backward)
        if u.name in fenv:
            return self.from_forward(u)
        if is_view(u) and _derivable(u, fenv.keys() | benv.keys()):
            # the forward dropped its copy when its base ran again there: the view is
            # derived here from the base's latest copy (the same storage's bytes)
            return _emit(bg, u, benv, scheduled, self.resolve_backward)
        raise RewriteError(f"backward reads {u.name!r} before the schedule computes it")

    def write_backward(self) -> None:
        """The backward's steps and transfers; every offload must have completed."""
        bg, benv = self.bg, self.benv
        for i, s in enumerate(self.bwd_steps, start=len(self.fwd_steps)):
            self.fire(bg, benv, 2 * i, self.resolve_backward, self.from_forward)
            if self.nodes[s].op != "placeholder":  # (a tangent is an input of the backward graph)
                self.run_step(bg, benv, i, s, self.resolve_backward, self.from_forward)
            self.fire(bg, benv, 2 * i + 1, self.resolve_backward, self.from_forward)
        self.fire(bg, benv, 2 * len(self.seq), self.resolve_backward, self.from_forward)
        if self.pending:
            raise RewriteError(f"the offload of {next(iter(self.pending.values())).name!r} never completes")

    # ---- outputs
    def finish(self) -> tuple[fx.Graph, fx.Graph, list[str]]:
        """Both graphs' outputs: the backward's gradients, the forward's outputs and the
        values it saves; what is saved for nothing is dropped."""
        fg, bg, fenv, benv, nodes, saved = self.fg, self.bg, self.fenv, self.benv, self.nodes, self.saved
        grad_out = []
        for g in self.grads:
            if isinstance(g, fx.Node):
                grad_out.append(benv[g.name] if g.name in benv else self.resolve_backward(g))
            else:
                grad_out.append(g)
        bg.output(tuple(grad_out))
        # A value saved for an op that turns out dead (a ``detach`` nobody reads) would stay
        # alive, unread, through the whole backward: it is not saved at all.
        bg.eliminate_dead_code(is_impure_node=_kept_unread)
        for name in list(saved):
            if not self.saved_ph[name].users:
                bg.erase_node(self.saved_ph[name])
                saved.remove(name)

        # Sizes saved for the backward (a graph captured with symbolic sizes) come after
        # the saved tensors, in the forward's outputs and the backward's inputs alike
        sizes = [name for name in saved if _is_size(self.saved_ph[name])]
        if sizes:
            saved[:] = [name for name in saved if name not in sizes] + sizes
            ours = {self.saved_ph[name] for name in saved}
            anchor = next(n for n in bg.nodes if n.op != "placeholder")
            for ph in ([self.saved_ph[name] for name in saved]
                       + [n for n in bg.nodes if n.op == "placeholder" and n not in ours]):
                anchor.prepend(ph)

        # A buffer that the step mutates (BatchNorm running statistics) is written back
        # after the forward, which would invalidate a saved reference: save a copy of
        # buffers instead (they are small).
        saved_out = []
        for name in saved:
            value = fenv[name]
            if (name in nodes and nodes[name].op == "placeholder"
                    and type(nodes[name].meta.get("desc")).__name__ == "BufferAOTInput"):
                value = fg.call_function(torch.ops.aten.clone.default, (value,))
                value.meta = dict(nodes[name].meta)
            saved_out.append(value)
        fg.output(tuple([fenv[o.name] if isinstance(o, fx.Node) else o for o in self.fwd_outs] + saved_out))
        # A placeholder whose name was taken by an earlier node is renamed, and fx's code then
        # rebinds ``name = target`` at the top of the function; such rebinds can chain
        # (``add_10 = add_9; add_11 = add_10``) and hand a value to the wrong input. Every
        # placeholder takes its own unique name as its argument name.
        for g in (fg, bg):
            for n in g.nodes:
                if n.op == "placeholder":
                    n.target = n.name
        fg.eliminate_dead_code(is_impure_node=_kept_unread)  # (erasing unread placeholders left none in backward)
        return fg, bg, saved


def _is_size(node: fx.Node) -> bool:
    """Whether ``node``'s value is a symbolic size (an int, float or bool of a graph
    captured with symbolic sizes), not a tensor."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _kept_unread(node: fx.Node) -> bool:
    """Whether dead-code elimination keeps ``node`` though nothing reads it: fx's side
    effects, and ops that draw random numbers (a later draw depends on theirs). An op
    tagged random that draws nothing (a fused attention without dropout) goes: an
    unread copy of it, run where a schedule lists its outputs out of order, would
    hold all of its outputs to the end of the graph."""
    return node.is_impure(impure_random=False) or node_draws(node)


def _ancestors(roots: Iterable[fx.Node]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        stack.extend(n.all_input_nodes)
    return seen


def _is_multi_output(node: fx.Node) -> bool:
    return node.op == "call_function" and bool(node.users) and all(_is_projection(u) for u in node.users)


def _runs(seq: Sequence[str], nodes: dict[str, fx.Node], scheduled: set[str]) -> list[bool]:
    """For each step: does it continue a run of its multi-output op (it directly follows
    an earlier projection of the same op)? Otherwise a projection re-runs the op."""
    index: dict[str, int] = {}
    for n in nodes.values():
        if _is_multi_output(n):
            for i, u in enumerate(u for u in n.users if u.name in scheduled):
                index[u.name] = i
    out = []
    for i, s in enumerate(seq):
        node = nodes[s]
        cont = False
        if i and s in index and seq[i - 1] in index:
            prev = nodes[seq[i - 1]]
            cont = prev.args[0] is node.args[0] and index[seq[i - 1]] < index[s]
        out.append(cont)
    return out


def _start_run(node: fx.Node, env: dict[str, fx.Node], continues: bool, scheduled: set[str]) -> None:
    """Before a projection that starts a new run, forget the op's earlier copy so that it
    runs again (a stale tuple would keep all of its outputs alive)."""
    if _is_projection(node) and not continues:
        parent = node.args[0]
        if isinstance(parent, fx.Node) and parent.name not in scheduled:
            env.pop(parent.name, None)


def _is_projection(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _copy_placeholder(g: fx.Graph, p: fx.Node) -> fx.Node:
    new = g.placeholder(p.name)
    new.meta = dict(p.meta)
    return new


def _emit(g: fx.Graph, node: fx.Node, env: dict[str, fx.Node], scheduled: set[str], resolve) -> fx.Node:
    """Copy ``node`` into ``g``; inputs missing from ``env`` come from ``resolve``. ``env``
    maps a name to its latest copy, so a repeated step reads the values current then."""
    for u in node.all_input_nodes:
        if u.name not in env:
            resolve(u)
    new = g.node_copy(node, lambda n: env[n.name])
    new.meta["remat_source"] = node.name
    env[node.name] = new
    _forget_derived(node, env, scheduled)
    return new


def _forget_derived(node: fx.Node, env: dict[str, fx.Node], scheduled: set[str]) -> None:
    """Drop from ``env`` the views and unscheduled projections of ``node``'s copy: ops
    that read them next derive them from its new copy (a view of an older copy would
    keep that copy's storage alive). A view that only reads a size of ``node`` (a
    symbolic size, an int) is not derived from its storage and stays."""
    stack = [(node, user) for user in node.users]
    while stack:
        parent, user = stack.pop()
        if _is_projection(user) and user.name not in scheduled or is_view(user) and _view_base(user) is parent:
            if env.pop(user.name, None) is not None and is_view(user):
                stack.extend((user, u) for u in user.users)


def _view_base(view: fx.Node) -> fx.Node | None:
    """The value whose storage ``view`` shares: its first input that is not a size."""
    return next((u for u in view.all_input_nodes if not _is_size(u)), None)


def _not_away(u: fx.Node, away: set[str], env: dict[str, fx.Node]) -> None:
    """Refuse to read ``u`` (or a view of it) while it is on the host (and not computed
    again here)."""
    base = u
    while is_view(base) and base.all_input_nodes:
        base = base.all_input_nodes[0]
    if base.name in away and base.name not in env:
        raise RewriteError(f"an op reads {u.name!r} while {base.name!r} is on the host (between its offload "
                           "and its fetch); the schedule's offload windows must not contain its reads")


def _placeholder_name(key: str) -> str:
    """The backward graph's input name of a saved value's env key."""
    return key.replace(_RNG_KEY, "rng_state_").replace(_HOST_KEY, "host_")


# the order of the events at one slot: a fetch before its arrival, a value back before it
# leaves again, a send before its release (a release sits after an op, a fetch before one)
_EVENT_ORDER = {"fetch": 0, "arrive": 1, "send": 2, "release": 3}


def _transfer_events(offloads: Sequence[Transfer], nodes: dict[str, fx.Node], fwd_outs: Sequence,
                     n_steps: int) -> dict[int, list[tuple[str, int, Transfer]]]:
    """The events of ``offloads`` by slot, in the order they run at a slot."""
    held = {o.name for o in fwd_outs if isinstance(o, fx.Node)}
    events: dict[int, list[tuple[str, int, Transfer]]] = {}
    for k, tr in enumerate(offloads):
        node = nodes.get(tr.node)
        if node is None or node.op != "call_function":
            raise RewriteError(f"the schedule offloads {tr.node!r}, which is not an op of the joint graph")
        if tr.node in held:
            raise RewriteError(f"the schedule offloads {tr.node!r}, an output of the forward that the caller "
                               "holds: its memory cannot be freed; plan it without that offload")
        if not 0 <= tr.send <= tr.release < tr.fetch <= tr.arrive <= 2 * n_steps:
            raise RewriteError(f"the offload of {tr.node!r} has its slots out of order: {tr}")
        for kind in _EVENT_ORDER:
            events.setdefault(getattr(tr, kind), []).append((kind, k, tr))
    for evs in events.values():
        evs.sort(key=lambda e: (_EVENT_ORDER[e[0]], e[1]))
    return events


def _fire(g: fx.Graph, env: dict[str, fx.Node], kind: str, k: int, tr: Transfer, *, nodes: dict[str, fx.Node],
          scheduled: set[str], pending: dict, away: set[str], resolve, saved_state,
          like: Sequence[fx.Node]) -> None:
    """Emit one event of an offload into ``g`` (``env``: that graph's values)."""
    name, node = tr.node, nodes[tr.node]
    key = f"{_HOST_KEY}{k}:{name}"
    if kind == "send":
        x = env[name] if name in env else resolve(node)
        host = g.call_function(host_pool.send, (x,))
        host.meta["val"] = _host_value(node.meta.get("val"), like)
        host.meta["remat_transfer"] = ("send", name, k)
        env[key] = host
        pending[("sent", k)] = x
    elif kind == "release":
        x = pending.pop(("sent", k))
        g.call_function(host_pool.sent, (x,)).meta["remat_transfer"] = ("release", name, k)
        if env.get(name) is x:  # (not when the step between ran the op again: that copy stays)
            del env[name]
            _forget_derived(node, env, scheduled)
            away.add(name)
    elif kind == "fetch":
        host = env.pop(key) if key in env else saved_state(key)
        val = node.meta.get("val")
        device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
        y = g.call_function(host_pool.fetch, (host, device))
        y.meta["val"] = val
        y.meta["remat_transfer"] = ("fetch", name, k)
        pending[("fetch", k)] = y
    else:  # arrive
        y = g.call_function(host_pool.arrived, (pending.pop(("fetch", k)),))
        y.meta["val"] = node.meta.get("val")
        y.meta["remat_transfer"] = ("arrive", name, k)
        if name not in env:  # (a copy computed again while this one was away is the later one)
            env[name] = y
            _forget_derived(node, env, scheduled)
        away.discard(name)


def _host_value(val: object, like: Sequence[fx.Node]) -> object:
    """The fake value of a host copy of ``val`` (same shape, strides and dtype, on the
    CPU), in the graph's fake mode: AOTAutograd counts a saved value as a tensor by it."""
    if not isinstance(val, torch.Tensor):
        return None
    mode = detect_fake_mode([n.meta.get("val") for n in like]) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="cpu")


def _derivable(node: fx.Node, env: dict[str, fx.Node]) -> bool:
    """Can a view be re-derived here from values this graph already has (through a chain
    of views; a symbolic size it reads is an int the forward saves)? Then it should be,
    rather than pinning an older copy of its base."""
    return all(w.name in env or _is_size(w) or (is_view(w) and _derivable(w, env)) for w in node.all_input_nodes)


# ops whose output shares its input's storage although their schema does not say so
_UNDECLARED_VIEWS = ("_unsafe_view", "_reshape_alias", "alias")


def is_view(node: fx.Node) -> bool:
    """An op whose output aliases an input (a view, ``detach``...): free to run again.

    Examples
    --------
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> aten = torch.ops.aten
    >>> is_view(g.call_function(aten.t.default, (x,))), is_view(g.call_function(aten.relu.default, (x,)))
    (True, False)
    """
    target = node.target
    if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], fx.Node):
        return is_view(node.args[0])  # a piece of split / unbind / chunk
    if node.op != "call_function" or not is_op_overload(target):
        return False
    if target.overloadpacket.__name__ in _UNDECLARED_VIEWS:
        return True
    returns = op_schema(target).returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )

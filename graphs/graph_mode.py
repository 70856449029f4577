"""Run a model's training step as the forward and backward graphs of a schedule.

:class:`ScheduledStep` compiles one captured step (``graphs.capture(...,
backward="outputs")``) with AOTAutograd's runtime, cutting the joint graph with
:func:`graphs.rewrite.partition_by_schedule`: the forward keeps exactly the tensors the
schedule stores and the backward recomputes the rest where the schedule says. Both graphs
are plain fx code (boxed, freeing every value after its last use), run eagerly, or, with
``compiler="inductor"``, compiled by torch inductor after the cut (inductor never sees the
joint graph, so it cannot move a value across it). A graph is cut into segments: random
ops and the generator-state steps that replay them run as plain fx code, so every draw is
eager's, and a segment ends where inductor, which fuses and reorders inside it, could go
above the plain code's peak plus a headroom. The headroom is the planner's, from the
solver's simulator (the one judge: budget less the schedule's simulated peak);
:func:`memory_profile` only says where inside one partitioned graph that headroom runs
out. Each segment is decomposed with inductor's
decomposition table and compiled with ``compile_fx_inner``; its buffers are allocated
through the dispatcher, so :class:`graphs.memory.MemoryTracker` sees them.

:func:`wrap_graph_mode` returns the drop-in module of :func:`graphs.planned.wrap_planned`
(the one lazy wrapper of both modes) running scheduled steps.
"""

from __future__ import annotations

import logging
import operator
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from graphs.autocast import no_autocast
from graphs.capture import is_random_op, plain_state
from graphs.compute_graph import BACKWARD_START, ComputeGraph
from graphs.costs import annotate_storage, tensor_storage_bytes
from graphs.errors import RematError
from graphs.planned import Planner, input_signature, wrap_planned
from graphs.rewrite import boxed, is_view, partition_by_schedule, transfers
from graphs.torch_internals import (FakeTensorMode, aot_compile_joint, clear_saved_tensors, detect_fake_mode,
                                     inductor_compile, is_op_overload, tree_flatten, tree_unflatten)

__all__ = ["ScheduledStep", "wrap_graph_mode", "input_signature", "memory_profile", "COMPILERS"]

log = logging.getLogger(__name__)


#: the ways :class:`ScheduledStep` runs its forward and backward graphs
COMPILERS = ("eager", "inductor")


def _compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    return boxed(gm)


def _runs_eagerly(node: torch.fx.Node) -> bool:
    """Random ops and plain Python calls (the generator-state steps of a replayed random
    op) stay outside inductor: they draw from, or set, the device's global generator in
    the graph's order."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if not is_op_overload(node.target):
        return True
    return is_random_op(node)


#: a run of fewer deterministic ops than this runs eagerly (an inductor compile costs
#: about a second on CPU; a few ops gain nothing from it)
_MIN_SEGMENT_OPS = 4


def memory_profile(gm: torch.fx.GraphModule, *, is_backward: bool) -> tuple[list[torch.fx.Node], list[int], list[int]]:
    """Bytes live before each op of a boxed graph and bytes each op allocates.

    Only :func:`_segments` reads it, to place the cuts of a graph that inductor compiles;
    it judges no plan. It exists beside the solver's simulator because the graphs it
    reads are not the DAG the simulator runs: AOTAutograd's partitioned forward and
    backward graphs hold copies of recomputed ops, the generator-state steps of
    replayed random ops and ``getitem`` projections made on demand, with names of their
    own. Its rules are the simulator's (a value lives from the op that makes it through
    its last use; an op's output counts while it runs; aliases share one storage,
    charged once), on the storage records the capture prices the DAG with
    (:func:`graphs.costs.annotate_storage`), and it is used only relative to itself: a
    segment may add the simulator's headroom to this graph's own peak.

    A view (or a ``getitem`` of a multi-output op) shares its base's storage, which lives
    until the last use of any alias; a graph output lives to the end. Inputs of a forward
    graph, and the parameters and user inputs a backward graph reads, are held outside the
    graph and never freed; every other input (saved values, output gradients) is freed
    after its last use, as the boxed calling convention does.

    Returns
    -------
    ops : list of torch.fx.Node
        The graph's call nodes, in order.
    live_before : list of int
        Bytes live when each op starts (its inputs included, its output not).
    alloc : list of int
        Bytes each op's output adds (0 for views and projections).

    Examples
    --------
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: ((x * 2).relu(),))(torch.randn(4))
    >>> ops, live_before, alloc = memory_profile(gm, is_backward=False)
    >>> [n.name for n in ops], live_before, alloc
    (['mul', 'relu'], [16, 32], [16, 16])
    """
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    end = len(nodes)
    records = annotate_storage(gm)

    def last_use(n: torch.fx.Node) -> int:
        held = n.op == "placeholder" and (not is_backward or n.name.startswith("primals"))
        if held or any(u.op == "output" for u in n.users):
            return end
        return max((index[u] for u in n.users), default=index[n])

    # storages by owner: made when the op that computes them runs, live through the
    # last use of any alias; a multi-output op owns the outputs no projection takes
    made: dict[torch.fx.Node, int] = {}
    size: dict[torch.fx.Node, int] = {}
    for n in nodes:
        rec = records[n]
        if rec.alias:
            continue
        if n.target is operator.getitem:
            made[n], size[n] = index[n.args[0]], rec.bytes
        elif isinstance(n.meta.get("val"), (tuple, list)):
            taken = {g.args[1]: records[g].bytes for g in n.users if g.target is operator.getitem}
            made[n], size[n] = index[n], max(0, tensor_storage_bytes(n.meta["val"]) - sum(taken.values()))
        else:
            made[n], size[n] = index[n], rec.bytes
    last = dict(made)
    for n in nodes:
        owner = by_name[records[n].base]
        if owner in last:
            last[owner] = max(last[owner], last_use(n))
        if n in size and n.target is operator.getitem:  # the tuple holds it until its last projection
            last[n] = max(last[n], last_use(n.args[0]))
    delta = [0] * (end + 2)
    for owner, b in size.items():
        delta[made[owner] + 1] += b  # live from the step after it is made ...
        delta[last[owner] + 1] -= b  # ... through its last use
    ops, live_before, alloc, live = [], [], [], 0
    for i, n in enumerate(nodes):
        live += delta[i]
        if n.op == "placeholder":
            continue
        ops.append(n)
        live_before.append(live)
        multi = isinstance(n.meta.get("val"), (tuple, list)) and not records[n].alias
        alloc.append(tensor_storage_bytes(n.meta["val"]) if multi else
                     0 if n.target is operator.getitem else records[n].bytes)
    return ops, live_before, alloc


def _segments(gm: torch.fx.GraphModule, *, is_backward: bool = False,
              headroom: int | None = None) -> tuple[dict[torch.fx.Node, int], set[int]]:
    """Cut a graph into runs that inductor compiles and runs that run eagerly.

    Random ops and plain Python calls run eagerly. With ``headroom`` (bytes, the
    planner's: the budget less the simulator's peak of the schedule), a compiled run is
    also cut wherever inductor could otherwise go above the graph's eager peak
    (:func:`memory_profile`) plus ``headroom``: inductor fuses and reorders inside a run, so a run is taken as
    holding everything it allocates until it ends, on top of what is live when it starts.
    Runs of fewer than ``_MIN_SEGMENT_OPS`` ops run eagerly. A ``getitem`` goes with the op
    it projects; a view joins the segment being built (it allocates nothing).

    Returns
    -------
    part : dict
        Node to segment number (ascending in graph order).
    compiled : set of int
        The segment numbers that inductor compiles.
    """
    ops, live_before, alloc = memory_profile(gm, is_backward=is_backward)
    ceiling = None
    if headroom is not None and ops:
        ceiling = max(b + a for b, a in zip(live_before, alloc)) + max(0, int(headroom))
    runs: list[list[int]] = []  # op indices of each segment
    kinds: list[bool] = []      # segment compiled?
    seg_of: dict[torch.fx.Node, int] = {}
    start_live = used = 0
    for i, node in enumerate(ops):
        src = node.args[0] if node.target is operator.getitem and node.args else None
        compiled = not _runs_eagerly(node)
        if src in seg_of:  # a projection goes with its op
            k = seg_of[src]
        elif runs and alloc[i] == 0 and is_view(node):  # a view costs nothing where it runs
            k = len(runs) - 1
        elif runs and compiled == kinds[-1] and (
                not compiled or ceiling is None or start_live + used + alloc[i] <= ceiling):
            k = len(runs) - 1
            used += alloc[i]
        else:
            runs.append([])
            kinds.append(compiled)
            k = len(runs) - 1
            start_live, used = live_before[i], alloc[i]
        runs[k].append(i)
        seg_of[node] = k
    part: dict[torch.fx.Node, int] = {}
    chosen: set[int] = set()
    for k, (run, compiled) in enumerate(zip(runs, kinds)):
        n_ops = sum(1 for i in run if ops[i].target is not operator.getitem and alloc[i] > 0)
        if compiled and n_ops >= _MIN_SEGMENT_OPS:
            chosen.add(k)
        for i in run:
            part[ops[i]] = k
    return part, chosen


def _layout(args: Sequence) -> tuple:
    """The sizes and strides of a call's tensor inputs: what inductor's code asserts."""
    return tuple((tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else None for a in args)


class _ByLayout:
    """A graph compiled by inductor for the strides its inputs arrive with (boxed: it
    frees each input after its last use). Inductor's code asserts its inputs' sizes and
    strides; a value may come with other strides than the capture recorded (a
    recomputed view made contiguous, a saved slice of a larger tensor), so a call with
    a new layout compiles the graph again for it, once."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, fake_mode: Any, *,
                 is_backward: bool, segment: bool) -> None:
        self.gm, self.fake_mode, self.is_backward, self.segment = gm, fake_mode, is_backward, segment
        self.compiled = {_layout(example_inputs): inductor_compile(gm, example_inputs, is_backward=is_backward,
                                                                    segment=segment)}

    def __call__(self, args: list) -> Any:
        layout = _layout(args)
        fn = self.compiled.get(layout)
        if fn is None:
            with self.fake_mode:
                like = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                        if isinstance(a, torch.Tensor) else a for a in args]
            log.info("compiler='inductor': a graph compiled again for inputs of other strides")
            fn = self.compiled[layout] = inductor_compile(self.gm, like, is_backward=self.is_backward,
                                                          segment=self.segment)
        return fn(args)


class _Compiled(nn.Module):
    """A graph compiled by inductor (boxed: it frees each input after its last use)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(list(args))


def _fake_inputs(gm: torch.fx.GraphModule, fake_mode: Any) -> list:
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise RematError(f"compiler='inductor': the graph input {node.name!r} has no tensor metadata; "
                             "use compiler='eager'")
        with fake_mode:
            out.append(torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                           device=val.device))
    return out


def _inductor_compiler(is_backward: bool, compiled: dict[str, int], headroom: int | None) -> Callable:
    """AOTAutograd's ``fw_compiler``/``bw_compiler`` for one of the partitioned graphs:
    inductor for the segments :func:`_segments` gives it, plain fx code for the rest (the
    number of inductor graphs goes to ``compiled[which]``)."""
    which = "backward" if is_backward else "forward"

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Any:
        try:
            part, chosen = _segments(gm, is_backward=is_backward, headroom=headroom)
            if len(set(part.values())) == 1 and chosen:
                compiled[which] = 1
                fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
                return _ByLayout(gm, example_inputs, fake_mode, is_backward=is_backward, segment=False)
            return boxed(_fuse_segments(gm, part, chosen, example_inputs, is_backward, compiled, which))
        except RematError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise RematError(
                f"inductor could not compile the {which} graph of the schedule ({type(exc).__name__}: {first}); "
                "on CPU inductor needs a working C++ compiler. Run with compiler='eager' (plain fx code, "
                "the same schedule)"
            ) from exc

    return compile_graph


def _fuse_segments(gm: torch.fx.GraphModule, part: dict[torch.fx.Node, int], chosen: set[int],
                   example_inputs: Sequence, is_backward: bool, compiled: dict[str, int],
                   which: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which each chosen segment is one call of its inductor-compiled
    graph, made where the segment's first node was; every other node stays plain fx
    code, in its place."""
    members: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if part.get(node) in chosen:
            members.setdefault(part[node], []).append(node)
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    root = nn.Module()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        k = part.get(node)
        if k not in chosen:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        group = members[k]
        if node is not group[0]:
            continue  # made with its segment
        inside = set(group)
        inputs = list(dict.fromkeys(a for n in group for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in group if any(u not in inside for u in n.users)]
        if any(a not in env for a in inputs):
            raise RematError(f"compiler='inductor': a segment of the {which} graph reads a value made after "
                             "its first op; use compiler='eager'")
        sub = torch.fx.Graph()
        sub_env: dict[torch.fx.Node, torch.fx.Node] = {}
        for a in inputs:
            sub_env[a] = sub.placeholder(a.name)
            sub_env[a].meta = dict(a.meta)
        for n in group:
            sub_env[n] = sub.node_copy(n, lambda x: sub_env[x])
        sub.output(tuple(sub_env[n] for n in outputs))
        sub_gm = torch.fx.GraphModule(gm, sub)
        fn = _ByLayout(sub_gm, _fake_inputs(sub_gm, fake_mode), fake_mode, is_backward=is_backward, segment=True)
        name = f"inductor_{len(list(root.children()))}"
        root.add_module(name, _Compiled(fn))
        call = graph.call_module(name, tuple(env[a] for a in inputs))
        for i, n in enumerate(outputs):
            env[n] = graph.call_function(operator.getitem, (call, i))
            env[n].meta = dict(n.meta)
        compiled[which] = compiled.get(which, 0) + 1
    eager_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function" and part.get(n) not in chosen)
    log.info("compiler='inductor': %d segments of the %s graph compiled, %d ops run eagerly",
             compiled.get(which, 0), which, eager_ops)
    return torch.fx.GraphModule(root, graph)


class ScheduledStep:
    """One captured step compiled to run ``sequence``.

    Parameters
    ----------
    graph : ComputeGraph
        Captured with ``backward="outputs"`` (it carries ``capture_info``).
    sequence : sequence of node ids
        The schedule's steps.
    compiler : {"eager", "inductor"}
        How the forward and backward graphs run: ``"eager"``, as plain fx code;
        ``"inductor"``, compiled by torch inductor after the same cut (the forward keeps
        exactly the stored values), in segments: random ops run eagerly between them so
        that recomputed draws are the first run's, and a segment ends where inductor's
        fusion and reordering could take the graph over its limit (see ``headroom``).
        Compiling takes seconds to minutes on CPU and needs a C++ compiler there.
    headroom : int, (int, int) or None
        With ``compiler="inductor"``: bytes a compiled segment may add to the peak of
        the plain fx code of its graph (one figure, or one for the forward and one for
        the backward graph). A segment is taken to hold everything it allocates until
        it ends, on top of what is live when it starts, and is cut where that would go
        over; runs of fewer than four ops run eagerly. ``None``: no limit (whole graphs
        compile; fastest, but the peak is inductor's, not the schedule's).
    offloads : sequence of solver.schedule.Offload
        The schedule's offloads (indices into ``sequence``): each value goes to host
        memory and comes back as :mod:`solver.simulate` counts it
        (:func:`graphs.rewrite.transfers`, :mod:`graphs.host_pool`: pinned memory and a
        side stream on CUDA, an emulated host outside the allocator on CPU).

    A joint graph written from a capture of four alike layers
    (``graph.capture_info.stitched``, :func:`graphs.repeated.stitch_joint`) is cut the
    same way and runs as plain fx code in an autograd function of its own, which frees
    saved values and output gradients as AOTAutograd's runtime does.

    Raises
    ------
    RematError
        The graph was not captured with ``backward="outputs"``, ``compiler`` is unknown
        (or not ``"eager"`` for a written joint graph), or inductor failed to compile a
        graph (the message suggests ``compiler="eager"``).

    Examples
    --------
    >>> from graphs.capture import capture, default_loss
    >>> net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    >>> x = torch.randn(4, 8)
    >>> cg = capture(net, (x,), backward="outputs", inplace="functional", measure_time=False)
    >>> step = ScheduledStep(cg, cg.order)
    >>> loss = default_loss(step(net, (x,), {}))
    >>> torch.allclose(loss, default_loss(net(x)))
    True

    Attributes
    ----------
    saved : list of str
        The values the forward keeps for backward (``host:...``: host copies).
    transfers : list of graphs.rewrite.Transfer
        The offloads it runs.
    inductor_graphs : dict
        With ``compiler="inductor"``: how many segments inductor compiled for the
        ``"forward"`` and the ``"backward"`` graph.
    """

    def __init__(self, graph: ComputeGraph, sequence: Sequence[Hashable], *, compiler: str = "eager",
                 headroom: int | tuple[int, int] | None = 0, offloads: Sequence[Any] = ()) -> None:
        if compiler not in COMPILERS:
            raise RematError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        info = graph.capture_info
        if info is None or info.backward != "outputs":
            raise RematError("ScheduledStep needs a graph captured with backward='outputs'")
        self.compiler = compiler
        self.inductor_graphs: dict[str, int] = {}
        # steps without an fx node (where the backward starts) only constrain the order
        self.sequence, self.transfers = transfers(sequence, offloads, skip=(BACKWARD_START,))
        self.saved: list[str] = []
        self.info = info
        self._warned = False  # of a model changed since its capture
        fw_comp = bw_comp = _compiler
        if compiler == "inductor":
            fw_room, bw_room = headroom if isinstance(headroom, tuple) else (headroom, headroom)
            fw_comp, bw_comp = (_inductor_compiler(False, self.inductor_graphs, fw_room),
                                _inductor_compiler(True, self.inductor_graphs, bw_room))
        if info.stitched is not None:  # a joint written from a cut capture runs itself
            if compiler != "eager":
                raise RematError("a step written from a capture of fewer layers runs as plain fx code only; "
                                 "compiler='inductor' plans on a capture of the whole step")
            written = info.stitched
            self.params_spec, self.buffers_spec = list(written.params_spec), list(written.buffers_spec)
            fw, bw, self.saved = partition_by_schedule(graph.fx, self.sequence, offloads=self.transfers,
                                                        num_fwd_outputs=written.num_fwd_outputs)
            self.fn = _plain_step(boxed(fw), boxed(bw), written.num_fwd_outputs)
            return
        jd = info.joint  # the capture's own export: each compile copies what it writes into
        self.params_spec = list(jd.params_spec)
        self.buffers_spec = list(jd.buffers_spec)
        self.fn = aot_compile_joint(jd, partition_fn=self._partition, fw_compiler=fw_comp, bw_compiler=bw_comp)

    def _partition(self, joint, joint_inputs, *, num_fwd_outputs, **_):
        fw, bw, saved = partition_by_schedule(joint, self.sequence, num_fwd_outputs=num_fwd_outputs,
                                              offloads=self.transfers)
        self.saved = saved
        return fw, bw

    def changed(self, model: nn.Module) -> list[str]:
        """The module paths of ``model`` whose class or plain attributes differ from the
        model's when it was captured (:func:`graphs.capture.plain_state`): the graphs
        hold the captured values as constants. Modules the capture did not see (layers
        of a step written from four alike ones) are not compared."""
        then = self.info.state
        if not then:
            return []
        now = plain_state(model)
        return [path or "(the model)" for path, was in then.items() if path in now and now[path] != was]

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        changed = self.changed(model)
        if changed:
            if not self._warned:
                warnings.warn(f"{type(model).__name__} changed since its step was captured ({', '.join(changed[:5])}: "
                              "a plain attribute or a submodule was set), and the captured graph holds the old "
                              "values: this step runs the model's own forward, without the plan's memory savings. "
                              "Optimize the model again as it is now to plan for it.", stacklevel=3)
                self._warned = True
            return type(model).forward(model, *args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        user = [flat[i] for i in self.info.input_indices]
        params = [model.get_parameter(_fqn(n)) for n in self.params_spec]
        buffers = [model.get_buffer(_fqn(n)) for n in self.buffers_spec]
        with no_autocast():  # the graphs hold the casts of the autocast state they were captured in
            out = self.fn(*params, *buffers, *user)
        return tree_unflatten(list(out), self.info.out_spec)


_SAVED = object()  # a saved value that went to save_for_backward


def _plain_step(fw: Callable, bw: Callable, num_fwd_outputs: int) -> Callable:
    """The autograd function of a joint graph's forward and backward graphs (boxed), for
    a joint that needs none of AOTAutograd's runtime wrappers
    (:func:`graphs.torch_internals.joint_is_plain`): the forward keeps what the forward
    graph saves, and the backward hands it over in the list that its graph clears as it
    goes, so each saved value is freed after its last use, as AOTAutograd's runtime does.

    The output gradients go into that list too: the engine hands them over in a list
    of their own (``boxed_grads_call``, torch 2.15) that the backward empties, so
    nothing but the backward graph holds one (the logits' gradient is freed after its
    last reader, not at the end of the backward), as the plan counts them. With a torch
    that passes them as arguments, the engine holds them until the backward ends."""

    class _Step(torch.autograd.Function):
        boxed_grads_call = True  # the output gradients arrive in one list that backward may empty

        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            out = fw(list(args))
            kept = list(out[num_fwd_outputs:])
            tensors = [isinstance(v, torch.Tensor) for v in kept]
            ctx.save_for_backward(*[v for v, t in zip(kept, tensors) if t])
            ctx.others = [_SAVED if t else v for v, t in zip(kept, tensors)]
            # an output the loss does not read gets no gradient: its zeros are made in the
            # list the backward graph clears, not held by the caller through the backward
            ctx.set_materialize_grads(False)
            ctx.outputs = [(o.shape, o.dtype, o.device) for o in out[:num_fwd_outputs]]
            return tuple(out[:num_fwd_outputs])

        @staticmethod
        def backward(ctx: Any, *args: Any) -> Any:
            boxed = len(args) == 1 and isinstance(args[0], list)
            grads = args[0] if boxed else list(args)
            del args
            tensors = iter(ctx.saved_tensors)
            kept = [next(tensors) if v is _SAVED else v for v in ctx.others]
            del tensors
            clear_saved_tensors(ctx)
            kept.extend(torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                        for g, (shape, dtype, device) in zip(grads, ctx.outputs))
            grads.clear()  # the backward graph's list holds them now, and frees each after its last use
            with no_autocast():  # the graph holds the casts of the autocast state it was captured in
                return tuple(bw(kept))

    return _Step.apply


def _fqn(name: str) -> str:
    return name[3:] if name.startswith("gm.") else name


def wrap_graph_mode(model: nn.Module, planner: Planner) -> nn.Module:
    """:func:`graphs.planned.wrap_planned` with a planner that returns a
    :class:`ScheduledStep` (``planner(model, args, kwargs)``: it captures, solves and
    compiles)."""
    return wrap_planned(model, planner)

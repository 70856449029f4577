"""Measured steps of a plan on the example batch: its peak, whether it reproduces the
model's gradients, and the replan loop when it measures over the budget.

Every step measured here leaves the model as found (:func:`step_undone`): gradients,
buffers (BatchNorm statistics) and the random generators.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from graphs import RematError
from graphs.autocast import autocast_state
from graphs.capture import default_loss
from graphs.torch_internals import tree_leaves
from graphs.memory import AllocatorPeak, generators_kept, judge_available, resident_bytes, storage_address
from graphs.units import format_bytes
from solver.errors import InfeasibleBudget, SolverError
from solver.join.fixed import untracked_bytes
from solver.report import Report

__all__ = ["Session", "PlanningInputs", "Reproduction", "buffers_kept", "forwards_kept", "GradientPrint", "Tolerance", "EAGER", "HALF", "COMPILED", "check_tolerance", "fit_measured", "measured_peak", "reproduces", "self_check", "step_undone"]


@dataclass
class Session:
    """The planning state of one :func:`solver.optimize` call: the latest plan's report
    and the modules that show it as ``.report``."""

    report: Report | None = None
    modules: list = field(default_factory=list)
    loss_fn: Callable[[Any], Any] | None = None  # the user's loss, when optimize was given one
    planning_peak: int | None = None  # the highest allocator peak of planning's own runs
    inputs: "PlanningInputs | None" = None  # the copies of the example inputs that planning runs on
    #: where the loss is computed outside the model: the most a real step measured beyond
    #: its plan's prediction, per byte of the model's outputs (:meth:`saw_step`)
    beyond_per_output: float = 0.0
    #: per size family (:func:`graphs.planned.size_family`), graph mode's plans of a capture
    #: with symbolic sizes (:class:`solver.join.families.SymbolicFamily`)
    families: dict = field(default_factory=dict)

    def saw(self, peak: int | None) -> None:
        """Count the allocator's peak of one of planning's runs (None: not measured),
        with what planning holds beside the run's own roots: the user's example inputs,
        beside the copies the run uses."""
        if peak is not None:
            beside = self.inputs.beside_bytes if self.inputs is not None else 0
            self.planning_peak = max(self.planning_peak or 0, int(peak) + beside)

    def saw_step(self, peak: int, report: Report) -> None:
        """Count a real step of the plan ``report`` whose allocator peak was ``peak``: where
        the model returns no scalar loss, what it measured beyond the plan's prediction
        is what the loss computed outside the model allocates, and grows with the outputs
        the loss reads (:meth:`held_for_loss`)."""
        outputs = outputs_outside_loss(report.graph) if report.graph is not None else 0
        if outputs and report.predicted_peak_bytes is not None:
            beyond = int(peak) - report.predicted_peak_bytes
            self.beyond_per_output = max(self.beyond_per_output, beyond / outputs)

    def held_for_loss(self, cg: Any) -> int:
        """Bytes a new plan of ``cg`` holds back for a loss computed outside the model,
        in proportion to its outputs, as a real step of an earlier plan measured it
        (:meth:`saw_step`); 0 where none has, or where ``cg`` returns its loss."""
        return int(self.beyond_per_output * outputs_outside_loss(cg))

    def publish(self) -> None:
        """Show the latest report on every module of the call."""
        if self.report is not None and self.planning_peak is not None:
            self.report.planning_peak_bytes = self.planning_peak
        for m in self.modules:
            m.report = self.report


def loss_tangents(cg: Any) -> tuple[list, list]:
    """The tangents of a captured step's scalar outputs (losses), and all its tangents."""
    tangents = [v for v in cg.ops if cg[v]["op"] == "tangent"]
    return [t for t in tangents if cg[t].get("grad_of") in cg.nx and cg[cg[t]["grad_of"]]["bytes"] <= 8], tangents


def outputs_outside_loss(cg: Any) -> int:
    """Bytes of the outputs whose gradients start a captured step's backward, where none
    of them is a scalar loss (the loss is computed outside the model, from them); 0
    where the step returns its loss."""
    scalar, tangents = loss_tangents(cg)
    if scalar:
        return 0
    return sum(int(cg[cg[t]["grad_of"]]["bytes"]) for t in tangents if cg[t].get("grad_of") in cg.nx)


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Positional and keyword arguments of the example inputs."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def not_real(args: tuple, kwargs: dict) -> bool:
    """Whether the example inputs are meta or fake tensors (nothing can run on them)."""
    flat = [t for t in (list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
    return any(t.device.type == "meta" or type(t).__name__ == "FakeTensor" for t in flat)


def _copy_of(t: torch.Tensor) -> torch.Tensor:
    """A leaf copy of ``t`` with its ``requires_grad``, sharing its memory until written."""
    from graphs.torch_internals import lazy_copy

    c = lazy_copy(t.detach())
    c.requires_grad_(t.requires_grad)
    return c


def _shares_memory(c: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether planning's copy ``c`` of the user's ``t`` still holds no memory of its own."""
    from graphs.memory import storage_address
    from graphs.torch_internals import is_lazy_copy

    return (is_lazy_copy(c) and c.shape == t.shape and c.dtype == t.dtype
            and storage_address(c) == storage_address(t))


class PlanningInputs:
    """Copies of the example inputs for planning's runs, so that the user's tensors are
    never changed: not their values (a model that writes into its input in place), not
    their ``.grad`` (an input that requires a gradient), not their version counters.
    A copy shares the user's memory until a run writes into it (copy-on-write), so that
    planning holds no more than the user's inputs.
    :meth:`reset` gives every run the user's values again; :meth:`release` frees the
    copies' memory once planning is done (whatever still refers to them, such as a
    captured graph kept for the report, then holds no memory). Meta and fake inputs
    are used as they are (nothing runs on them).

    Examples
    --------
    >>> x = torch.ones(3, requires_grad=True)
    >>> inputs = PlanningInputs((x,), {})
    >>> (c,), _ = inputs.args, inputs.kwargs
    >>> c is not x and c.requires_grad and c.is_leaf
    True
    >>> (c * 2).sum().backward(); x.grad is None
    True
    >>> inputs.reset(); c.grad is None
    True
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        from graphs.torch_internals import tree_flatten, tree_unflatten

        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not_real(args, kwargs):
            self.args, self.kwargs = args, kwargs
            return
        flat, spec = tree_flatten((args, kwargs))
        out, made = [], {}
        for t in flat:
            if isinstance(t, torch.Tensor):
                if id(t) not in made:  # one copy of a tensor passed twice
                    made[id(t)] = c = _copy_of(t)
                    self.pairs.append((c, t))
                t = made[id(t)]
            out.append(t)
        self.args, self.kwargs = tree_unflatten(out, spec)

    @property
    def beside_bytes(self) -> int:
        """Bytes of the user's tensors held beside the copies: those whose copy no longer
        shares their memory (a run wrote into it, or torch made a whole copy)."""
        return resident_bytes([t for c, t in self.pairs if not _shares_memory(c, t)])

    def reset(self) -> None:
        """The copies as the user's tensors are (values, ``requires_grad``), no gradients.
        A copy that a run wrote into shares the user's memory again."""
        with torch.no_grad():
            for c, t in self.pairs:
                if not _shares_memory(c, t):
                    fresh = _copy_of(t)
                    c.set_(fresh.untyped_storage(), fresh.storage_offset(), fresh.shape, fresh.stride())
                c.grad = None
                if c.is_leaf:
                    c.requires_grad_(t.requires_grad)

    def release(self) -> None:
        """Free the copies' memory (each keeps its object, with no elements)."""
        with torch.no_grad():
            for c, _ in self.pairs:
                c.grad = None
                c.set_(torch.empty(0, dtype=c.dtype, device=c.device))
        self.pairs = []


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Put the model's buffers (BatchNorm statistics) back as found after the block;
    yields the copies it holds meanwhile. A copy shares its buffer's memory until the
    block writes into the buffer (copy-on-write): a buffer the step leaves alone (a
    rotary embedding's frequencies, position ids) costs nothing, and only one that it
    writes is put back."""
    buffers = [(b, _copy_of(b)) for b in model.buffers()]
    try:
        yield [v for _, v in buffers]
    finally:
        with torch.no_grad():
            for b, v in buffers:
                if not _shares_memory(v, b):
                    b.copy_(v)


@contextlib.contextmanager
def forwards_kept(model: nn.Module) -> Iterator[None]:
    """Put every submodule's own ``forward`` attribute back as found after the block
    (a step that wraps layer blocks, :func:`reference_step`'s, sets them)."""
    found = [(m, m.__dict__.get("forward")) for m in model.modules()]
    try:
        yield
    finally:
        for m, forward in found:
            if forward is not None:
                m.__dict__["forward"] = forward
            else:
                m.__dict__.pop("forward", None)


@contextlib.contextmanager
def step_undone(model: nn.Module, *, inputs: PlanningInputs | None = None,
                buffers: bool = True) -> Iterator[list[torch.Tensor]]:
    """Run a training step whose effects are undone afterwards: gradients start as None and
    are put back as found, buffers (BatchNorm statistics) are restored, the RNG forked;
    ``inputs`` (planning's copies of the example inputs) start as the user's. Yields the
    tensors it holds meanwhile (the gradients put aside, the buffers' copies), which
    count in a measured peak beside the model's own. ``buffers=False``: the caller keeps
    the buffers (:func:`buffers_kept`)."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    if inputs is not None:
        inputs.reset()
    try:
        for p in params:
            p.grad = None
        with buffers_kept(model) if buffers else contextlib.nullcontext([]) as copies, rng_forked() as states:
            yield [g for g in saved if g is not None] + copies + states
    finally:
        for p, g in zip(params, saved):
            p.grad = g


@contextlib.contextmanager
def rng_forked() -> Iterator[list[torch.Tensor]]:
    """The random generators (CPU, and CUDA once initialized) put back as found after
    the block, as ``torch.random.fork_rng``; their states are kept as host bytes
    (:func:`graphs.memory.generators_kept`), so the list of tensors it yields, what it
    holds in the allocator, is empty."""
    with generators_kept():
        yield []


def measured_peak(model: nn.Module, run: Callable[[], Any], args: tuple, kwargs: dict, *,
                  loss_fn: Callable[[Any], Any] | None = None, inputs: PlanningInputs | None = None) -> int | None:
    """Peak bytes of one training step ``run()`` (forward, ``loss_fn`` or the default
    loss, backward) of ``model``, by the allocator (:class:`graphs.memory.AllocatorPeak`,
    parameters, buffers and inputs included, and what :func:`step_undone` holds); None
    for meta or fake inputs, and on CPU inside another torch profiler. Gradients,
    buffers and the RNG are left as found; ``inputs``: reset first."""
    if not_real(args, kwargs) or not judge_available(model, (args, kwargs)):
        return None  # nothing real to run, or no judge
    with step_undone(model, inputs=inputs) as held, AllocatorPeak(model, (args, kwargs), held) as judge:
        out = run()  # held during backward, as verify does
        (loss_fn or default_loss)(out).backward()
        del out
    return int(judge.peak_bytes)


def fit_measured(model: nn.Module, *, make: Callable[[int], Any], run: Callable[[Any], Callable[[], Any]],
                 args: tuple, kwargs: dict, budget: int, session: Session, tries: int = 3,
                 loss_fn: Callable[[Any], Any] | None = None, held_back: int = 0, reserve: int = 0,
                 floors: Callable[..., Any] | None = None) -> Any:
    """Plan, measure one step of the plan, and plan again with a margin while the
    measured peak is over ``budget``.

    The simulator counts the captured graph's values. A real step can allocate more: an
    eager forward's temporaries that capture decomposes away, the buffers a compiled
    segment allocates inside it. The margin is what the step measured beyond its plan.
    ``make(margin)`` plans for ``budget - margin`` and sets ``session.report``;
    ``run(plan)`` is one step of a plan. ``held_back``: the margin to start from (what a
    real step measured beyond an earlier plan). ``reserve``: bytes more planned below the
    budget from the start, so that the step measured is within it (the prediction's own
    error) where a plan leaves room for it; a step is still judged against the whole
    budget. ``floors(actions=..., margin=...)``: module mode's planner restricted to
    some actions; a refusal measures its plans among the actions predicted exactly
    (:data:`FLOOR_ACTIONS`: the plain step, every block checkpointed, their mixes)
    instead of the smallest plan (:func:`_measured_smallest`).

    A budget that a refusal named (:data:`_NAMED`) is first met by the plan that
    measured the figure, so that planning there runs no plan that measured over it.
    """
    step = dict(make=make, run=run, args=args, kwargs=kwargs, loss_fn=loss_fn, floors=floors)
    if not held_back:
        again = _named_plan(model, budget=budget, session=session, **step)
        if again is not None:
            return again
    try:
        out, margin = make(held_back + reserve), held_back + reserve
    except InfeasibleBudget as tight:
        # as much of the reserve as the smallest plan leaves room for
        reserve = max(0, min(reserve, budget - tight.smallest_feasible_bytes - held_back))
        out = None
        if reserve:
            with contextlib.suppress(InfeasibleBudget):
                out, margin = make(held_back + reserve), held_back + reserve
        if out is None:
            reserve = 0
            try:
                out, margin = make(held_back), held_back
            except InfeasibleBudget as exc:
                raise (_measured_smallest(model, exc, budget=budget, session=session, **step) or exc) from exc
    seen: list[tuple[int, int]] = []  # (the allocator's peak of a plan's step, the margin it was planned with)
    for attempt in range(tries):
        report = session.report
        extra = untracked_bytes(report.graph)
        peak = report.checked_peak_bytes
        if peak is None:
            measured = measured_peak(model, run(out), args, kwargs, loss_fn=loss_fn, inputs=session.inputs)
            if measured is None:
                return out
            peak = report.checked_peak_bytes = measured + extra
            session.saw(peak)
        seen.append((peak, margin))
        if peak <= budget:
            if margin > reserve:
                report.notes.append(f"planned for {format_bytes(budget - margin)}: a step of the plan for the whole "
                                    f"budget measured {format_bytes(margin - reserve)} more than its prediction")
            return out
        if attempt == tries - 1:
            break
        margin = max(margin + peak - budget, peak - report.predicted_peak_bytes)
        try:
            out = make(margin)
        except InfeasibleBudget as exc:
            smallest = _smallest_that_fits(model, exc, make=make, run=run, args=args, kwargs=kwargs, budget=budget,
                                           session=session, loss_fn=loss_fn)
            if smallest is not None:
                return smallest
            # the figure named is one a step measured: the margin a plan's step measured
            # beyond its prediction need not be another plan's (an eager kernel the
            # capture decomposes holds more), so the smallest plan is measured itself;
            # only where no step can be measured, the smallest peak plus the margin
            named = _measured_smallest(model, exc, budget=budget, session=session, **step)
            if seen and (named is None or min(seen)[0] < named.smallest_feasible_bytes):
                # no smaller plan can be made, or none measured less: the least a plan of this call measured
                named = _seen_smallest(model, exc, seen, budget=budget, session=session, args=args, kwargs=kwargs,
                                       floors=floors)
            raise (named or InfeasibleBudget(budget, exc.smallest_feasible_bytes + margin,
                                             lower_bound_bytes=exc.lower_bound_bytes + margin,
                                             what="measured peak", **_why(exc))) from exc
    raise SolverError(f"a step of the plan measured {format_bytes(peak)} over the budget {format_bytes(budget)} "
                      f"after {tries} plans with a margin for what the step allocates beyond the captured graph; "
                      "ask for a larger budget")


def _smallest_plan(model: nn.Module, exc: InfeasibleBudget, *, make: Callable[[int], Any],
                   run: Callable[[Any], Callable[[], Any]], args: tuple, kwargs: dict, budget: int,
                   session: Session, loss_fn: Callable[[Any], Any] | None) -> tuple[Any, int] | None:
    """The plan for the smallest peak ``exc`` names and the allocator's peak of one step
    of it (untracked bytes included), or None where it cannot be made or measured."""
    try:
        plan = make(budget - exc.smallest_feasible_bytes)  # the margin that plans for the smallest peak
    except RematError:
        return None
    measured = measured_peak(model, run(plan), args, kwargs, loss_fn=loss_fn, inputs=session.inputs)
    if measured is None:
        return None
    peak = measured + untracked_bytes(session.report.graph)
    session.saw(peak)
    return plan, peak


def _smallest_that_fits(model: nn.Module, exc: InfeasibleBudget, *, budget: int, session: Session,
                        **step: Any) -> Any:
    """The plan for the smallest peak found, where no plan with a margin is feasible and
    a step of it measures within ``budget``; else None. A budget an error once named
    (what :func:`_measured_smallest` measured) is then met by that plan again, even when
    the plan for the whole budget measured over it. ``step``: ``make``, ``run``,
    ``args``, ``kwargs``, ``loss_fn`` as :func:`fit_measured` takes them."""
    smallest = exc.smallest_feasible_bytes
    found = _smallest_plan(model, exc, budget=budget, session=session, **step) if smallest <= budget else None
    if found is None or found[1] > budget:
        return None
    plan, session.report.checked_peak_bytes = found
    session.report.notes.append(f"planned for the smallest peak found, {format_bytes(smallest)}: a step of the plan "
                                "for the whole budget measured over it, and no plan left room for the difference")
    return plan


#: the figures refusals named, per model: ``(the inputs' shapes, budget, floors given)``
#: to the plan that measured the figure (``(kind, peak planned for, actions)``: module
#: mode's plan among some actions, ``"floor"``, or the plan for the smallest peak,
#: ``"smallest"``), which :func:`fit_measured` runs first when that budget is asked for
_NAMED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()

#: a refusal measures a floor's plan, or the smallest plan, only where predicted at
#: least this share below the least peak measured so far: module mode's predictions of
#: its exact actions are within about 1 %, so one predicted higher would not lower the
#: figure named, and its run could go over it
FLOOR_MARGIN = 0.01

#: module mode's actions whose memory is predicted within about 1 %: a block run as it
#: is, or checkpointed whole
FLOOR_ACTIONS = ("none", "full")


def inputs_key(args: tuple, kwargs: dict) -> tuple:
    """The shapes and dtypes of a step's inputs (other leaves by ``repr``): what tells two
    steps of one model apart for the figures remembered of it."""
    from graphs.torch_internals import tree_leaves

    return tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                 for t in tree_leaves((args, kwargs)))


def _named_key(args: tuple, kwargs: dict, budget: int, floors: Any) -> tuple:
    return inputs_key(args, kwargs), int(budget), floors is not None


def _floor_plan(floors: Callable[..., Any], actions: tuple[str, ...], budget: int) -> Any:
    """Module mode's plan among ``actions`` for the least peak they reach."""
    try:
        return floors(actions=actions, margin=0)
    except InfeasibleBudget as exc:
        return floors(actions=actions, margin=budget - exc.smallest_feasible_bytes)


def _measure(model: nn.Module, plan: Any, *, run: Callable[[Any], Callable[[], Any]], args: tuple, kwargs: dict,
             session: Session, loss_fn: Callable[[Any], Any] | None) -> int | None:
    """The allocator's peak of one step of ``plan`` (untracked bytes included; a graph
    plan's gradient check measured it already), counted in planning's peak."""
    report = session.report
    if report.checked_peak_bytes is not None:
        return report.checked_peak_bytes
    measured = measured_peak(model, run(plan), args, kwargs, loss_fn=loss_fn, inputs=session.inputs)
    if measured is None:
        return None
    report.checked_peak_bytes = peak = measured + untracked_bytes(report.graph)
    session.saw(peak)
    return peak


def _recipe_plan(recipe: tuple, *, make: Callable[[int], Any], floors: Callable[..., Any] | None,
                 budget: int) -> Any:
    """The plan ``recipe`` names, planned for the peak it was planned for before."""
    kind, target, actions = recipe
    if kind == "floor":
        return floors(actions=actions, margin=budget - target)
    return make(budget - target)


def _named_plan(model: nn.Module, *, budget: int, session: Session, make: Callable[[int], Any],
                run: Callable[[Any], Callable[[], Any]], args: tuple, kwargs: dict,
                loss_fn: Callable[[Any], Any] | None, floors: Callable[..., Any] | None) -> Any:
    """Where ``budget`` is a figure a refusal named for this model and inputs, the plan
    that measured it, when a step of it measures within the budget again; else None."""
    recipe = _NAMED.get(model, {}).get(_named_key(args, kwargs, budget, floors))
    if recipe is None:
        return None
    try:
        plan = _recipe_plan(recipe, make=make, floors=floors, budget=budget)
    except RematError:
        return None
    peak = _measure(model, plan, run=run, args=args, kwargs=kwargs, session=session, loss_fn=loss_fn)
    if peak is None or peak > budget:
        return None
    session.report.notes.append(f"planned for {format_bytes(budget)}, the smallest feasible peak named for this "
                                "model and inputs: the plan that measured it")
    return plan


def _measured_smallest(model: nn.Module, exc: InfeasibleBudget, *, budget: int, session: Session,
                       make: Callable[[int], Any], run: Callable[[Any], Callable[[], Any]], args: tuple,
                       kwargs: dict, loss_fn: Callable[[Any], Any] | None,
                       floors: Callable[..., Any] | None = None) -> InfeasibleBudget | None:
    """The error to raise for a budget below the smallest plan (None where no plan's
    step could be measured), naming a figure that a call for it meets: the least peak measured of the plan for the smallest peak
    ``exc`` names (graph mode; never below that peak) or, with ``floors`` (module
    mode), of the plans among :data:`FLOOR_ACTIONS` (the least peak of their mixes, no
    block checkpointed, every block checkpointed), and at least the peak of planning's
    own runs (the
    run that measures op workspaces runs the lowest-peak schedule, and runs it again
    when the figure named is asked for). The floors are measured first, from the lowest
    predicted, and a plan only where predicted :data:`FLOOR_MARGIN` below the least
    peak measured so far: a refusal runs no step far above the figure it names. The
    plan that measured the figure is remembered (:data:`_NAMED`)."""
    step = dict(run=run, args=args, kwargs=kwargs, session=session, loss_fn=loss_fn)
    candidates = []  # (predicted, recipe)
    if floors is None:
        candidates.append((exc.smallest_feasible_bytes, ("smallest", exc.smallest_feasible_bytes, None)))
    else:  # module mode: among the actions whose memory is predicted exactly (a selective plan's is not)
        for actions in (FLOOR_ACTIONS, ("none",), ("full",)):
            try:
                _floor_plan(floors, actions, budget)
            except RematError:
                continue
            predicted = session.report.predicted_peak_bytes
            candidates.append((predicted, ("floor", predicted, actions)))
    measured: list[tuple[int, tuple]] = []
    for predicted, recipe in sorted(candidates, key=lambda c: c[0]):
        least = min((m for m, _ in measured), default=None)
        if least is not None and predicted > (1 - FLOOR_MARGIN) * least:
            continue
        try:
            plan = _recipe_plan(recipe, make=make, floors=floors, budget=budget)
        except RematError:
            continue
        peak = _measure(model, plan, **step)
        if peak is not None:
            measured.append((peak, recipe))
    if not measured:
        return None
    least, recipe = min(measured, key=lambda m: m[0])
    named = max(least, session.planning_peak or 0)  # (the plan measured within it)
    if recipe[0] == "smallest":  # nor below the peak the search found: its plan is predicted within the figure
        named = max(named, exc.smallest_feasible_bytes)
    _NAMED.setdefault(model, {})[_named_key(args, kwargs, named, floors)] = recipe
    if named == exc.smallest_feasible_bytes:
        return exc
    return InfeasibleBudget(budget, named, lower_bound_bytes=min(exc.lower_bound_bytes, named), what="measured peak",
                            **_why(exc))


def _seen_smallest(model: nn.Module, exc: InfeasibleBudget, seen: list[tuple[int, int]], *, budget: int,
                   session: Session, args: tuple, kwargs: dict,
                   floors: Callable[..., Any] | None) -> InfeasibleBudget:
    """The error naming the least peak a step of one of this call's plans measured
    (``seen``: (peak, margin) pairs), where no plan below them can be made (a rewrite
    that fails its self-check, an eager kernel far above the capture's figures). A call
    for that figure is met by the plan that measured it (:data:`_NAMED`)."""
    least, margin = min(seen)
    named = max(least, session.planning_peak or 0)
    _NAMED.setdefault(model, {})[_named_key(args, kwargs, named, floors)] = ("smallest", budget - margin, None)
    return InfeasibleBudget(budget, named, lower_bound_bytes=min(exc.lower_bound_bytes, named), what="measured peak",
                            **_why(exc))


def _why(exc: InfeasibleBudget) -> dict:
    """What ``exc`` says forces its lower bound, for an error that names other figures."""
    return dict(culprit=exc.culprit, culprit_name=exc.culprit_name, held_bytes=exc.held_bytes,
                held_before=exc.held_before, held_what=exc.held_what)


@dataclass(frozen=True)
class Reproduction:
    """What :func:`reproduces` found.

    Attributes
    ----------
    same : bool
        The step gave the reference's loss and gradients (to float tolerance).
    peak_bytes : int or None
        The step's peak by the allocator (None for meta or fake inputs).
    reference_peak_bytes : int or None
        The reference's peak by the allocator, the prints of the step's gradients
        held beside it (see :func:`reproduces`).
    forward_peak_bytes : int or None
        The peak of the model's forward without autograd that checks the loss (with
        ``reference`` only).
    """

    same: bool
    peak_bytes: int | None = None
    reference_peak_bytes: int | None = None
    forward_peak_bytes: int | None = None


def reproduces(model: nn.Module, step: Callable, args: tuple, kwargs: dict, *,
               loss_fn: Callable[[Any], Any] | None = None, reference: Callable | None = None,
               inputs: PlanningInputs | None = None) -> Reproduction:
    """One step of the rewrite against a reference step on the example batch: whether it
    gives the same loss and gradients (to float tolerance), with both peaks by the
    allocator. The reference is :func:`reference_step`'s (eager's loss and gradients)
    unless ``reference`` is given: a step with the same call shape, whose loss is then
    also checked against the model's own forward run without autograd (which saves
    nothing). Gradients, buffers and the RNG are left as found; ``inputs``: planning's
    copies of the example inputs, reset before each run.

    No copy of the gradients is held from one run to the next: the step's gradient of
    each parameter is kept as a :class:`GradientPrint` (a sixteenth of it, or whole for a
    small one) and dropped, and the reference's gradient of that parameter is compared
    with it as backward produces it, and dropped: the reference holds no gradients."""
    if not_real(args, kwargs):
        return Reproduction(True)  # nothing real to run
    loss_fn = loss_fn or default_loss
    judged = judge_available(model, (args, kwargs))
    tolerance = check_tolerance(model, args, kwargs, compiled=getattr(step, "compiler", "eager") != "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    prints: dict[int, GradientPrint | None] = {}
    differ: list[int] = []

    def compare(i: int, p: torch.Tensor) -> None:
        found = prints.pop(i, None)
        if found is None or not found.matches(p.grad, tolerance=tolerance):
            differ.append(i)
        p.grad = None  # compared: the reference holds no gradient

    def run(fn: Callable, held: list) -> tuple[torch.Tensor, int | None]:
        with buffers_kept(model) as copies:
            if inputs is not None:
                inputs.reset()
            torch.manual_seed(1234)
            with AllocatorPeak(model, (args, kwargs), held, copies) if judged else contextlib.nullcontext() as judge:
                out = fn(model, args, kwargs)  # held during backward, as verify does
                loss = loss_fn(out)
                loss.backward()
                del out
        return loss.detach(), None if judge is None else int(judge.peak_bytes)

    with step_undone(model, inputs=inputs, buffers=False) as held:
        la, peak = run(step, held)
        for i, p in enumerate(params):
            if p.grad is not None:
                prints[i] = GradientPrint(p.grad, seed=i)
            p.grad = None
        hooks = [p.register_post_accumulate_grad_hook(functools.partial(compare, i)) for i, p in enumerate(params)]
        try:
            kept = [t for found in prints.values() for t in (found.whole, found.sums) if t is not None]
            with forwards_kept(model):  # the reference's block wrappers are not left on the model
                lb, reference_peak = run(reference or reference_step(model), held + kept + [la])
            del kept
        finally:
            for h in hooks:
                h.remove()
        # left in ``prints``: gradients of the step that the reference does not give
        same = not differ and not prints and _close(la, lb, tolerance)
    forward_peak = None
    if same and reference is not None:
        with step_undone(model, inputs=inputs) as held, torch.no_grad():
            torch.manual_seed(1234)
            with AllocatorPeak(model, (args, kwargs), held, la) if judged else contextlib.nullcontext() as judge:
                loss = loss_fn(type(model).forward(model, *args, **kwargs)).detach()
            forward_peak = None if judge is None else int(judge.peak_bytes)
            same = _close(la, loss, tolerance)
    return Reproduction(same, peak, reference_peak, forward_peak)


class GradientPrint:
    """A compact form of a gradient ``x`` that tells whether another, ``y``, equals it
    within the self-check's tolerance (:func:`_close`), read as ``y`` arrives.

    A gradient of at most :data:`WHOLE_ELEMENTS` elements is kept whole. A larger one is
    kept as the sums of its elements over blocks of :data:`PRINT_BLOCK`, each element
    times a pseudo-random sign (one sixteenth of it in float32). ``y`` matches where
    every block's sum differs from ``x``'s by at most the block's sum of the elements'
    tolerances ``atol + rtol |y|``: never a mismatch where the elements match, and a
    gradient off by a factor or by a systematic error fails as it does element by
    element. Steps compared by norm (compiled ones) use the blocks' differences, whose squares
    sum to ``|x - y|**2`` in expectation, with 20 % slack. The sums are made and read in
    chunks of at most :data:`CHUNK_ELEMENTS` elements or a 64th of the gradient, whichever
    is larger, and an eighth of it at the least: a few tensor ops per chunk, whose
    allocations the judge's profiler records one by one when the check is measured.

    Examples
    --------
    >>> g = torch.randn(10000)
    >>> print_ = GradientPrint(g, seed=0)
    >>> print_.matches(g * (1 + 1e-5), tolerance=EAGER), print_.matches(g / 10, tolerance=EAGER)
    (True, False)
    """

    def __init__(self, grad: torch.Tensor, *, seed: int) -> None:
        flat = grad.detach().reshape(-1)
        self.seed, self.shape, self.dtype = seed, tuple(grad.shape), grad.dtype
        self.whole = flat.clone() if flat.numel() <= WHOLE_ELEMENTS or not flat.is_floating_point() else None
        self.sums = None if self.whole is not None else torch.cat(list(self._block_sums(flat)))

    def _chunks(self, flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(chunk in float32, its signs)``, a whole number of blocks at a time."""
        n = flat.numel()
        size = max(WHOLE_ELEMENTS, n // 64, min(n // 8, CHUNK_ELEMENTS)) // PRINT_BLOCK * PRINT_BLOCK
        for k, start in enumerate(range(0, n, size)):
            chunk = flat[start:start + size].float()
            gen = torch.Generator(device=flat.device).manual_seed(self.seed * 1_000_003 + k)
            signs = torch.randint(0, 2, (chunk.numel(),), generator=gen, dtype=torch.int8, device=flat.device)
            yield chunk, signs

    def _block_sums(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        for chunk, signs in self._chunks(flat):
            signed = torch.where(signs.bool(), chunk, -chunk)
            yield _blocks(signed).sum(1)

    def matches(self, grad: torch.Tensor | None, *, tolerance: Tolerance) -> bool:
        """Whether ``grad`` equals the gradient printed, to ``tolerance``."""
        if grad is None or tuple(grad.shape) != self.shape:
            return False
        flat = grad.detach().reshape(-1)
        if self.whole is not None:
            return _close(self.whole, flat, tolerance)
        if not tolerance.by_norm:
            at = 0
            for chunk, signs in self._chunks(flat):
                theirs = _blocks(torch.where(signs.bool(), chunk, -chunk)).sum(1)
                mine = self.sums[at:at + theirs.numel()]
                at += theirs.numel()
                # the elements' tolerances summed over each block, and float32 rounding of the sums
                tol = _blocks(tolerance.atol + tolerance.rtol * chunk.abs()).sum(1) * (1 + 1e-4)
                if not bool(((mine - theirs).abs() <= tol).all()) and not bool(torch.isnan(mine).any()):
                    return False
            return True
        diff = norm = 0.0
        at = 0
        for chunk, signs in self._chunks(flat):
            theirs = _blocks(torch.where(signs.bool(), chunk, -chunk)).sum(1)
            diff += float(((self.sums[at:at + theirs.numel()] - theirs).double() ** 2).sum())
            norm += float((chunk.double() ** 2).sum())
            at += theirs.numel()
        return diff ** 0.5 <= 1.2 * (tolerance.rtol * norm ** 0.5) + tolerance.atol


#: a gradient of at most this many elements is kept whole by :class:`GradientPrint`
WHOLE_ELEMENTS = 256
#: elements per block summed by :class:`GradientPrint`
PRINT_BLOCK = 16
#: :class:`GradientPrint` reads a gradient in at most 64 chunks, at most 8 where its chunks
#: stay within this many elements (about 16 bytes each of transient memory)
CHUNK_ELEMENTS = 1 << 16


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as rows of :data:`PRINT_BLOCK` elements, the last padded with zeros."""
    pad = -flat.numel() % PRINT_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, PRINT_BLOCK)


def reference_step(model: nn.Module, *, offload: bool = False) -> Callable[[nn.Module, tuple, dict], Any]:
    """The step a rewrite's gradients are checked against: the model's own forward with
    every layer block under non-reentrant checkpointing, which gives eager's loss and
    gradients (the recomputation replays the generator state, and the model's custom
    ``autograd.Function``\\ s run their own backward) in a fraction of the plain step's
    memory, so that checking a plan does not need the memory the plan saves. A model
    without a ``ModuleList`` or ``Sequential`` of layers runs its plain forward.

    ``offload=True``: the plain forward, each tensor it saves for backward written to a
    temporary file and read back when backward needs it (:class:`_OnDisk`): eager's
    gradients while the device holds about what a forward without autograd holds,
    where checkpointed blocks would not fit.

    Examples
    --------
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> x = torch.randn(2, 4)
    >>> torch.equal(reference_step(net)(net, (x,), {}), net(x))
    True
    >>> out = reference_step(net, offload=True)(net, (x,), {})
    >>> out.sum().backward()
    >>> torch.equal(out, net(x)) and net[0].weight.grad is not None
    True
    """
    from graphs.module_mode import layer_blocks
    from graphs.planned import ModuleStep

    if offload:
        def on_disk(m: nn.Module, args: tuple, kwargs: dict) -> Any:
            store = _OnDisk(m, (args, kwargs))
            with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
                return type(m).forward(m, *args, **kwargs)
        return on_disk
    blocks = layer_blocks(model)
    parent = model.get_submodule(blocks[0].rpartition(".")[0]) if blocks else None
    if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
        return lambda m, args, kwargs: type(m).forward(m, *args, **kwargs)
    return ModuleStep(model, {b: "full" for b in blocks})


class _OnDisk:
    """Saved-tensor hooks that keep what a step saves for backward in files of a
    temporary folder (removed with the last reference to the store, which autograd's
    graph holds through the hooks); tensors that share a storage of a parameter, a
    buffer or an input (``inputs``: held by the caller anyway), and small ones, stay
    where they are."""

    SMALL = 512  # bytes: a scalar or a few elements, not worth a file

    def __init__(self, model: nn.Module, inputs: Any = ()) -> None:
        import shutil
        import tempfile
        import weakref

        from graphs.torch_internals import tree_leaves

        self.folder = tempfile.mkdtemp(prefix="remat-check-")
        weakref.finalize(self, shutil.rmtree, self.folder, True)
        held = list(model.parameters()) + list(model.buffers())
        held += [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        self.resident = {storage_address(t) for t in held if t.layout == torch.strided}
        self.count = 0

    def pack(self, t: torch.Tensor) -> Any:
        if (t.numel() * t.element_size() < self.SMALL or t.layout != torch.strided
                or storage_address(t) in self.resident):
            return t
        import os

        path = os.path.join(self.folder, f"{self.count}.pt")
        self.count += 1
        torch.save(t.detach(), path)
        return path, t.device

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        path, device = packed
        return torch.load(path, map_location=device, weights_only=True)


@dataclass(frozen=True)
class Tolerance:
    """How closely the self-check's step must give the reference's loss and gradients:
    element by element, ``|x - y| <= atol + rtol |y|``, or ``by_norm``,
    ``|x - y| <= rtol |y| + atol`` over the whole tensor."""

    rtol: float
    atol: float
    by_norm: bool = False


#: float32 arithmetic: the captured ops are eager's, and a reduction that torch itself
#: runs in another order from one run to the next (CPU embedding backward) differs in
#: its last bits
EAGER = Tolerance(rtol=1e-3, atol=1e-5)
#: 16-bit float arithmetic (autocast, or bfloat16/float16 weights or inputs): the
#: captured graph decomposes some of eager's fused kernels (their backward above all)
#: into ops that round their 16-bit results otherwise, a unit in the last place, and
#: what is computed from those moves with them; ``torch.testing``'s tolerance for
#: bfloat16 (the rewrite's recomputations run the captured ops again, bit for bit)
HALF = Tolerance(rtol=1.6e-2, atol=1e-5)
#: a compiled step reorders float reductions (fused batch norms over large batches): ten
#: times the gap torch.compile itself shows against eager on a CNN's gradients
COMPILED = Tolerance(rtol=1e-2, atol=1e-6, by_norm=True)


def check_tolerance(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *,
                    compiled: bool = False) -> Tolerance:
    """The self-check's :class:`Tolerance` for a step of ``model`` on ``(args, kwargs)``
    run now: :data:`COMPILED` for a compiled step, :data:`HALF` where autocast is on
    with a 16-bit dtype or the parameters or float inputs are 16-bit, else :data:`EAGER`.

    Examples
    --------
    >>> net = nn.Linear(4, 4)
    >>> check_tolerance(net) is EAGER
    True
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     check_tolerance(net) is HALF
    True
    """
    if compiled:
        return COMPILED
    floats = [t for t in list(model.parameters()) + tree_leaves((args, kwargs or {}))
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if any(dtype.itemsize <= 2 for _, dtype in autocast_state()) or any(t.element_size() <= 2 for t in floats):
        return HALF
    return EAGER


def _close(x: torch.Tensor | None, y: torch.Tensor | None, tolerance: Tolerance) -> bool:
    """Equal within ``tolerance``."""
    if x is None or y is None:
        return x is None and y is None
    if not tolerance.by_norm:
        return torch.allclose(x, y, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
    diff = torch.linalg.vector_norm((x - y).double())
    return bool(diff <= tolerance.rtol * torch.linalg.vector_norm(y.double()) + tolerance.atol)


def self_check(model: nn.Module, step: Callable, *, args: tuple, kwargs: dict, session: Session,
               loss_fn: Callable[[Any], Any] | None = None, reference: Callable | None = None) -> bool:
    """Whether the rewrite ``step`` reproduces the model's gradients on the example batch
    (against ``reference``, see :func:`reproduces`); its measured peak (the same step)
    goes to the session's report, both peaks to the session's planning peak.

    A step that raises while it is checked (a compiled segment that rejects its
    inputs, say) fails the check: the caller falls back as for wrong gradients, and
    the report's notes say what was raised."""
    try:
        found = reproduces(model, step, args, kwargs, loss_fn=loss_fn, reference=reference, inputs=session.inputs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        session.report.notes.append(f"the self-check of the rewrite raised {type(exc).__name__}: {first}; "
                                    "the rewrite was not used")
        return False
    extra = untracked_bytes(session.report.graph)
    if found.peak_bytes is not None:
        session.report.checked_peak_bytes = found.peak_bytes + extra
    for peak in (found.peak_bytes, found.reference_peak_bytes, found.forward_peak_bytes):
        session.saw(None if peak is None else peak + extra)
    return found.same

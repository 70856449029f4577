"""The rest of the drop-in contract: hooks fire (or the step is refused, naming them),
deep copies are independent modules, pickling is refused with what to do instead, the
returned module has its own module dicts and keeps the model's train/eval flag, the plan
cache is bounded, and a failing graph-mode rewrite falls back to module mode."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import solver
from examples import models
from graphs.capture import capture
from graphs.planned import PLAN_CACHE_SIZE, HookNotRun, ModuleStep, NotPicklable, wrap_planned
from graphs.units import GiB
from solver import simulate
from solver.errors import SolverError
REPO_ROOT = Path(__file__).resolve().parents[2]


def _budget(model, inputs, frac=None):
    """A budget below the store-all peak that graph and module mode can meet (the MLP's
    parameters and gradients are most of its peak)."""
    cg = capture(model, inputs, backward="outputs", measure_time=False, inplace="functional")
    if frac is None:
        frac = 0.9 if isinstance(model, nn.Sequential) else 0.6
    return frac * simulate(cg, cg.order).peak_bytes / GiB


def _mlp():
    return models.mlp(batch=512, d_in=32, hidden=256, depth=3)


def _gpt():
    return models.gpt(n_layer=2, d=32, seq=32, batch=8)


def _model(mode):
    """Graph mode plans the MLP below its store-all peak; per-block checkpointing of its
    Linear/ReLU children saves too little, so module mode plans the GPT."""
    return _gpt() if mode == "module" else _mlp()


def _step(model, inputs, *, seed=0):
    """Output and gradients of one step, the loss outside the model."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = model(*inputs)
    out.float().square().mean().backward()
    return out.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same_step(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.allclose(out_a, out_b, rtol=1e-5, atol=1e-6)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None and gb is None) or torch.allclose(ga, gb, rtol=1e-4, atol=1e-6)


class Counter:
    """A forward hook that counts its calls and scales the output (so a hook run twice,
    or baked into a captured graph and run again, changes the result)."""

    def __init__(self, scale=1.0):
        self.calls, self.scale = 0, scale

    def __call__(self, module, args, out):
        self.calls += 1
        return out * self.scale if self.scale != 1.0 else None


# ---------------------------------------------------------------- hooks

@pytest.mark.parametrize("mode", ["graph", "module"])
def test_a_hook_on_the_model_fires_once_per_call_and_is_not_baked_into_the_step(mode):
    model, inputs = _model(mode)
    ref = copy.deepcopy(model)
    hook, ref_hook = Counter(2.0), Counter(2.0)
    handle = model.register_forward_hook(hook)
    ref.register_forward_hook(ref_hook)
    fast = solver.optimize(model, _budget(model, inputs), inputs, mode=mode, measure_time=False)
    assert fast.report.mode == mode
    hook.calls = 0
    _assert_same_step(_step(fast, inputs), _step(ref, inputs))  # scaled once, as in eager
    assert hook.calls == ref_hook.calls == 1
    handle.remove()  # the model's hooks are the module's: removing it takes it off both
    torch.manual_seed(0)  # the GPT's dropout draws as in _step
    with torch.no_grad():
        want = type(model).forward(model, *inputs)
    out, _ = _step(fast, inputs)
    assert hook.calls == 1 and torch.allclose(out, want)


def test_a_hook_registered_on_the_returned_module_later_fires():
    model, inputs = _mlp()
    fast = solver.optimize(model, _budget(model, inputs), inputs, measure_time=False)
    hook = Counter(3.0)
    fast.register_forward_pre_hook(lambda module, args: None)
    fast.register_forward_hook(hook)
    with torch.no_grad():
        want = 3.0 * type(model).forward(model, *inputs)
    out, _ = _step(fast, inputs)
    assert hook.calls == 1 and torch.allclose(out, want)


def test_a_submodule_hook_in_pinned_graph_mode_is_refused_by_name():
    model, inputs = _mlp()

    def log_activation(module, args, out):
        pass

    model[2].register_forward_hook(log_activation)
    with pytest.raises(HookNotRun, match=r"2: forward hook .*log_activation.*mode='module'"):
        solver.optimize(model, _budget(model, inputs), inputs, mode="graph", measure_time=False)


def test_a_submodule_hook_by_default_plans_in_module_mode_where_it_fires():
    model, inputs = _gpt()
    ref = copy.deepcopy(model)
    budget = _budget(model, inputs)  # (its capture calls the model)
    hook, ref_hook = Counter(0.5), Counter(0.5)
    model.blocks[1].fc.register_forward_hook(hook)
    ref.blocks[1].fc.register_forward_hook(ref_hook)
    fast = solver.optimize(model, budget, inputs, measure_time=False)
    assert fast.report.mode == "module"
    assert any("module mode" in n and "hooks would not fire" in n for n in fast.report.notes)
    assert hook.calls == 0  # planning's own runs (capture, measurements, the step check) are not training steps
    _assert_same_step(_step(fast, inputs), _step(ref, inputs))  # scaled as in eager, recomputation too
    assert fast.remat_plan["blocks.1"] == "full"
    assert ref_hook.calls == 1 and hook.calls == 2  # the forward, and backward's recomputation of the block


def test_a_submodule_hook_added_after_graph_planning_is_refused_per_call_until_removed():
    model, inputs = _mlp()
    fast = solver.optimize(model, _budget(model, inputs), inputs, mode="graph", measure_time=False)
    assert fast.report.mode == "graph" and not isinstance(next(iter(fast.remat_steps.values())).step, ModuleStep)
    want = _step(copy.deepcopy(model), inputs)
    _assert_same_step(_step(fast, inputs), want)

    def probe(module, args):
        pass

    handle = model[4].register_forward_pre_hook(probe)
    with pytest.raises(HookNotRun, match=r"4: forward pre-hook .*probe"):
        fast(*inputs)
    with pytest.raises(HookNotRun):  # every call, not only the first after the registration
        fast(*inputs)
    handle.remove()
    _assert_same_step(_step(fast, inputs), want)
    with torch.no_grad():  # evaluation runs the original forward: the hook would fire there
        model[4].register_forward_pre_hook(probe)
        fast(*inputs)


def test_module_mode_hooks_inside_a_checkpointed_block_fire_again_in_backward():
    model, inputs = _gpt()
    ref = copy.deepcopy(model)
    counts = {}

    def counting(name):
        def hook(module, args, out):
            counts[name] = counts.get(name, 0) + 1
        return hook

    fast = solver.optimize(model, _budget(model, inputs), inputs, mode="module", measure_time=False)
    assert fast.remat_plan["blocks.0"] == "full"
    model.blocks[0].register_forward_hook(counting("block"))  # registered after planning: fires too
    model.blocks[0].fc.register_forward_hook(counting("inside"))
    _assert_same_step(_step(fast, inputs), _step(ref, inputs))
    # the block's own hook runs around its checkpoint; the one inside runs in the forward and
    # again when backward recomputes the block, as with torch.utils.checkpoint
    assert counts == {"block": 1, "inside": 2}


# ---------------------------------------------------------------- copies and saving

@pytest.mark.parametrize("mode", ["graph", "module"])
def test_a_deep_copy_trains_its_own_parameters_with_its_own_plan(mode):
    model, inputs = _model(mode)
    ref, ref_halved = copy.deepcopy(model), copy.deepcopy(model)
    fast = solver.optimize(model, _budget(model, inputs), inputs, mode=mode, measure_time=False)
    teacher = copy.deepcopy(fast)
    assert type(teacher) is type(model) and teacher.report is None and len(teacher.remat_steps) == 0
    own = list(teacher.parameters())
    assert len(own) == len(list(model.parameters()))
    assert not any(p is q for p, q in zip(own, model.parameters()))
    with torch.no_grad():
        for p in own + list(ref_halved.parameters()):
            p.mul_(0.5)  # the copy's weights differ from the original's from now on
    got = _step(teacher, inputs)
    assert all(p.grad is None for p in model.parameters())  # nothing landed on the original
    _assert_same_step(got, _step(ref_halved, inputs))
    assert teacher.report is not None and teacher.report is not fast.report and len(teacher.remat_steps) == 1
    assert teacher.report.mode == mode and fast.report.mode == mode
    _assert_same_step(_step(fast, inputs), _step(ref, inputs))  # the original is untouched


def test_torch_save_is_refused_with_what_to_save_and_the_state_dict_round_trips():
    model, inputs = _mlp()
    fast = solver.optimize(model, _budget(model, inputs), inputs, measure_time=False)
    with pytest.raises(NotPicklable, match=r"state_dict\(\)"):
        torch.save(fast, io.BytesIO())
    buf = io.BytesIO()
    torch.save(fast.state_dict(), buf)
    fresh, _ = _mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    shallow = copy.copy(fast)  # a shallow copy is still made
    assert type(shallow) is type(model) and next(shallow.parameters()) is next(model.parameters())


def test_deep_copying_a_reports_graph_leaves_the_process_sound():
    # the copy of a captured graph's AOTAutograd objects corrupted the heap (abort at exit)
    script = (
        "import copy, solver\n"
        "from examples import models\n"
        "model, inputs = models.mlp(batch=64, d_in=32, hidden=256, depth=3)\n"
        "fast = solver.optimize(model, 0.0012, inputs, measure_time=False)\n"
        "g = copy.deepcopy(fast.report.graph)\n"
        "r = copy.deepcopy(fast.report)\n"
        "assert g.fx is None and g.capture_info is None and g.order == fast.report.graph.order\n"
        "assert r.graph.fx is None and fast.report.graph.fx is not None\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ---------------------------------------------------------------- module dicts and flags

@pytest.mark.parametrize("mode", ["graph", "module"])
def test_train_and_eval_keep_the_model_consistent_and_submodules_stay_apart(mode):
    model, inputs = _gpt()  # its forward does not run every child (a Sequential would run the one added)
    fast = solver.optimize(model, _budget(model, inputs), inputs, mode=mode, measure_time=False)
    fast.eval()
    assert [m.training for m in model.modules()] == [False] * len(list(model.modules()))
    assert not fast.training
    fast.train()
    assert all(m.training for m in model.modules()) and fast.training
    fast.add_module("probe", nn.Linear(2, 2))
    fast.register_buffer("scale", torch.ones(1))
    assert "probe" not in model._modules and "scale" not in model._buffers
    assert "probe" in dict(fast.named_modules()) and "scale" not in model.state_dict()
    assert all(p is q for p, q in zip(model.parameters(), list(fast.parameters())[: len(list(model.parameters()))]))
    model.eval()  # the model set to eval by hand: the module runs the original forward
    with torch.no_grad():
        want = type(model).forward(model, *inputs)
    assert torch.equal(fast(*inputs), want)


# ---------------------------------------------------------------- the plan cache

def test_the_plan_cache_keeps_the_most_recently_used_plans_and_notes_a_plan_made_again():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    planned = []

    def planner(model, args, kwargs):
        planned.append(args[0].shape[0])
        return ModuleStep(model, {"0": "full"})

    fast = wrap_planned(net, planner)
    fast.report = types.SimpleNamespace(notes=[])
    batches = [torch.randn(n, 4) for n in range(1, PLAN_CACHE_SIZE + 2)]
    for x in batches[:PLAN_CACHE_SIZE]:
        fast(x)
    fast(batches[0])  # a hit: now the most recently used
    assert planned == list(range(1, PLAN_CACHE_SIZE + 1)) and fast.report.notes == []
    with pytest.warns(UserWarning, match=f"more than {PLAN_CACHE_SIZE} input signatures"):
        fast(batches[PLAN_CACHE_SIZE])  # drops batch size 2, the least recently used
    assert len(fast.remat_steps) == PLAN_CACHE_SIZE
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        fast(batches[0])  # still planned
        assert planned[-1] == PLAN_CACHE_SIZE + 1
        fast(batches[1])  # planned again, dropping batch size 3
    assert planned[-1] == 2 and len(fast.remat_steps) == PLAN_CACHE_SIZE
    assert len(fast.report.notes) == 1 and "made again" in fast.report.notes[0] and "dropped" in fast.report.notes[0]


# ---------------------------------------------------------------- self-check fallback

def _failing_self_check(monkeypatch):
    import solver.join.planning

    monkeypatch.setattr(solver.join.planning, "self_check", lambda *a, **k: False)


def test_a_rewrite_that_fails_the_self_check_falls_back_to_module_mode(monkeypatch):
    model, inputs = _gpt()
    ref = copy.deepcopy(model)
    _failing_self_check(monkeypatch)
    fast = solver.optimize(model, _budget(model, inputs), inputs, measure_time=False)
    assert fast.report.mode == "module" and isinstance(next(iter(fast.remat_steps.values())).step, ModuleStep)
    assert any("planned in module mode" in n and "did not reproduce" in n for n in fast.report.notes)
    assert fast.report.predicted_peak_bytes <= fast.report.budget_bytes
    _assert_same_step(_step(fast, inputs), _step(ref, inputs))


def test_pinned_graph_mode_raises_what_failed_and_suggests_module_mode(monkeypatch):
    model, inputs = _gpt()
    _failing_self_check(monkeypatch)
    with pytest.raises(SolverError, match="did not reproduce.*mode='module'") as err:
        solver.optimize(model, _budget(model, inputs), inputs, mode="graph", measure_time=False)
    assert "please report" not in str(err.value)
    assert "forward" not in model.__dict__


# ---------------------------------------------------------------- outputs

class _NoOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin(x)


@pytest.mark.parametrize("planned_now", [True, False])
def test_a_model_that_returns_nothing_is_told_to_pass_loss_fn(planned_now):
    from graphs import CaptureError

    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"loss_fn="):
        fast = solver.optimize(_NoOutput(), 1.0, (x,) if planned_now else None, measure_time=False)
        fast(x)

"""The shape of the packages: no import cycle among ``graphs`` and ``solver`` modules, the
solver's pure graph math free of torch, and the trainer policies reaching torch only
through their one join-side module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graphs", "solver")

#: the solver's pure graph math: schedules, the judge, the method table and every method
PURE = ["solver.schedule", "solver.simulate", "solver.registry", "solver.solving", "solver.grading",
        "solver.indexed", "solver.feasibility", "solver.synthetic", "solver.report", "solver.fixed"]

#: the trainer policies: they price plans on a DAG; a real module is captured, built or
#: changed by :data:`POLICY_JOIN` alone
TRAINER_POLICY = ["solver.analytic", "solver.policy", "solver.estimate", "solver.exporters"]
POLICY_JOIN = "solver.models"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def import_graph(mods: dict[str, Path]) -> nx.DiGraph:
    """Module -> module it imports (at module level or inside a function). ``from a
    import b`` names the submodule ``a.b`` when there is one, else ``a``."""
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                continue
            g.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return g


def test_the_import_graph_sees_the_imports():
    g = import_graph(_modules())
    assert g.has_edge("solver.methods.eviction", "solver.registry")
    assert g.has_edge("solver.solving", "solver.methods")  # the loader, inside a function
    assert g.has_edge("solver.policy", "solver.analytic")  # ``from solver import analytic``


def test_no_import_cycle_among_graphs_and_solver_modules():
    cycles = list(nx.simple_cycles(import_graph(_modules())))
    assert cycles == []


def test_graphs_never_imports_solver():
    g = import_graph(_modules())
    crossing = [(a, b) for a, b in g.edges if a.startswith("graphs") and b.startswith("solver")]
    assert crossing == []


def _imported_roots(path: Path) -> set[str]:
    """Top-level packages a file imports anywhere (module level or inside a function)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_trainer_policies_and_the_cli_never_import_torch_themselves():
    mods = _modules()
    found = {m: sorted(_imported_roots(mods[m]) & {"torch", "transformers"}) for m in TRAINER_POLICY}
    assert found == {m: [] for m in TRAINER_POLICY}
    assert "torch" not in _imported_roots(mods["solver.cli"])  # it reads HF configs; POLICY_JOIN builds models


def test_the_trainer_policies_reach_capture_only_through_their_join_module():
    g = import_graph(_modules())
    torch_side = {"graphs.capture", "graphs.graph_mode", "graphs.torch_internals", "graphs.planned",
                  "solver.planning", "solver.optimize_model"}
    crossing = [(a, b) for a in TRAINER_POLICY for b in g.successors(a) if b in torch_side]
    assert crossing == []
    assert g.has_edge("solver.policy", POLICY_JOIN) and g.has_edge(POLICY_JOIN, "graphs.capture")
    assert not set(g.successors(POLICY_JOIN)) & set(TRAINER_POLICY)  # it is called, it does not call back


def test_the_trainer_policies_import_without_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TRAINER_POLICY)
            + "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_pure_solver_and_every_method_import_without_torch():
    methods = sorted(m for m in _modules() if m.startswith("solver.methods."))
    assert "solver.methods.auto" in methods and "solver.methods.eviction" in methods
    code = ("import sys\n" + "".join(f"import {m}\n" for m in PURE + methods)
            + "import solver\nsolver.methods()\nprint(sorted(k for k in sys.modules if k.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_solver_methods_stays_the_function_after_a_method_module_is_imported():
    code = ("import solver\nimport solver.methods.eviction\nsolver.methods()\n"
            "print(callable(solver.methods), 'eviction' in solver.methods())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_auto_is_a_registered_method():
    code = "import solver\ninfo = solver.get_method('auto')\nprint(info.name, info.fn.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["auto", "solver.methods.auto"]

"""The shape of the packages: no import cycle among ``graphs`` and ``solver`` modules, the
solver's pure graph math free of torch, the trainer policies reaching torch only
through their one join-side module, and the house rules a reader relies on: functions
short enough to read (or saying why not), methods that refuse unknown options, and no
module reaching into another's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graphs", "solver")

#: the solver's pure graph math: schedules, the judge, the method table and every method
PURE = ["solver.schedule", "solver.simulate", "solver.registry", "solver.solving", "solver.grading",
        "solver.indexed", "solver.feasibility", "solver.synthetic", "solver.report"]

#: the trainer policies: they price plans on a DAG; a real module is captured, built or
#: changed by :data:`POLICY_JOIN` alone
TRAINER_POLICY = ["solver.analytic", "solver.policy", "solver.estimate", "solver.exporters"]
POLICY_JOIN = "solver.join.models"


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
                  "solver.join.planning", "solver.join.optimize_model"}
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


def test_torch_is_imported_by_the_join_package_alone():
    mods = _modules()
    outside = sorted(m for m in mods if m.startswith("solver") and not m.startswith("solver.join"))
    assert "solver.policy" in outside and "solver.join.planning" in mods
    importing = [m for m in outside if "torch" in _imported_roots(mods[m])]
    assert importing == []
    code = ("import sys\n" + "".join(f"import {m}\n" for m in outside)
            + "print(sorted(k for k in sys.modules if k.split('.')[0] == 'torch'))")
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


def test_the_graph_math_grades_without_calling_a_method():
    g = import_graph(_modules())
    reached = sorted(m for m in nx.descendants(g, "solver.grading") if m.startswith("solver.methods"))
    assert reached == []


#: Lines (``def`` to last line) a function of ``graphs`` or ``solver`` may span unless a
#: ``# long:`` comment, on the line above it or as its first body comment, says why.
MAX_FUNCTION_LINES = 120


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _says_why_long(lines: list[str], fn: ast.FunctionDef) -> bool:
    """A ``# long:`` comment with a reason just above the function (its decorators) or as
    the first comment of its body."""
    top = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    above = lines[top - 2] if top >= 2 else ""
    body = (line.strip() for line in lines[fn.lineno:fn.end_lineno])
    first_comment = next((line for line in body if line.startswith("#")), "")
    return any(c.strip().startswith("# long:") and c.strip()[len("# long:"):].strip()
               for c in (above, first_comment))


def long_functions(mods: dict[str, Path]) -> list[str]:
    """``module.function (lines)`` of every function over :data:`MAX_FUNCTION_LINES` that
    gives no reason."""
    found = []
    for name, path in sorted(mods.items()):
        text = path.read_text()
        lines = text.splitlines()
        for qual, fn in _functions(ast.parse(text, filename=str(path))):
            length = fn.end_lineno - fn.lineno + 1
            if length > MAX_FUNCTION_LINES and not _says_why_long(lines, fn):
                found.append(f"{name}.{qual} ({length})")
    return found


def test_long_functions_sees_long_functions_and_their_reasons(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    method = body.replace("    ", "        ")
    (tmp_path / "m.py").write_text(f"class C:\n    def f(self):\n{method}"
                                   f"# long: one table, read top to bottom\ndef g():\n{body}"
                                   f"def h():\n    # long: a generated case list\n{body}"
                                   f"def k():\n{body[:-len(body) // 2]}")
    assert long_functions({"m": tmp_path / "m.py"}) == [f"m.C.f ({MAX_FUNCTION_LINES + 1})"]


def test_no_function_is_long_without_saying_why():
    assert long_functions(_modules()) == []


def test_no_method_swallows_unknown_options():
    mods = _modules()
    swallowing = []
    for name in sorted(m for m in mods if m.startswith("solver.methods")):
        for qual, fn in _functions(ast.parse(mods[name].read_text(), filename=str(mods[name]))):
            if fn.args.kwarg is not None and fn.args.kwarg.arg.startswith("_"):
                swallowing.append(f"{name}.{qual}(**{fn.args.kwarg.arg})")
    assert swallowing == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(name: str, path: Path, mods: dict[str, Path]) -> list[str]:
    """Where module ``name`` (file ``path``) imports a private name of another module, or
    reads one as an attribute of a module of ``mods`` it imported; torch's private names
    are for ``graphs.torch_internals`` alone."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    modules_bound = {}  # local name -> module of ``mods`` it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if any(_private(part) for part in a.name.split(".")):
                    found.append(f"{name}:{node.lineno} import {a.name}")
                if a.name in mods:
                    modules_bound[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = "." * node.level + (node.module or "")
            for a in node.names:
                if f"{node.module}.{a.name}" in mods and node.level == 0:
                    modules_bound[a.asname or a.name] = f"{node.module}.{a.name}"
            private = [a.name for a in node.names if _private(a.name)]
            if any(_private(part) for part in source.split(".")):
                private = [a.name for a in node.names]
            if not private or (node.level == 0 and node.module == name):
                continue
            found.extend(f"{name}:{node.lineno} from {source} import {p}" for p in private)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and modules_bound.get(node.value.id, name) != name):
            found.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    torch_internals = name == "graphs.torch_internals"
    return [f for f in found if not (torch_internals and " torch" in f)]


def test_private_reaches_sees_imports_lazy_imports_and_module_attributes(tmp_path):
    mods = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    mods["pkg.a"].write_text("from pkg.b import (\n    public,\n    _helper,\n)\nfrom pkg.a import _own\n"
                             "def f():\n    from pkg import b\n    import torch._dynamo\n    return b._other\n")
    assert private_reaches("pkg.a", mods["pkg.a"], mods) == [
        "pkg.a:1 from pkg.b import _helper", "pkg.a:8 import torch._dynamo", "pkg.a:9 b._other"]


@pytest.mark.parametrize("package", ["solver", "graphs"])
def test_no_module_imports_a_private_name_of_another(package):
    mods = _modules()
    found = [f for name in sorted(mods) if name.split(".")[0] == package
             for f in private_reaches(name, mods[name], mods)]
    assert found == []

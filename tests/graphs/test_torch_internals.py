"""The seam to torch's private internals: the version check, and that no other module of
the library reaches past it."""

from __future__ import annotations

import ast
import re
import pathlib

import pytest
import torch

from graphs import torch_internals
from graphs.torch_internals import UnsupportedTorch, check_torch_version

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEAM = ROOT / "graphs" / "torch_internals.py"
#: the library and what ships beside it; tests may look inside torch to test the seam
SCANNED = ("graphs", "solver", "benchmarks", "examples")
#: private attributes of torch objects that are no ``torch.x._y`` path
PRIVATE_ATTRS = {"py_kernels", "_dispatch_cache", "_schema", "_cdata", "_local_tensor", "_BoxedCodeGen"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, text) of every private torch name that ``source`` imports or reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(_private(p) for p in parts):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".")
            if any(_private(p) for p in parts) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRS:
                found.append((node.lineno, ast.unparse(node)))
                continue
            dotted = _dotted(node)
            # torch.x._y, except the names of ops (torch.ops.aten._softmax is an op)
            if dotted and dotted[0] == "torch" and dotted[1:2] != ["ops"] and any(_private(p) for p in dotted[1:]):
                found.append((node.lineno, ".".join(dotted)))
    return sorted(set(found))


def test_the_scan_finds_private_names():
    src = ("import torch._dynamo\nfrom torch._subclasses import FakeTensorMode\nfrom torch.utils import _pytree\n"
           "x = torch._C.DispatchKey\nop.py_kernels.clear()\nst._cdata\ntorch.ops.aten._softmax.default\n"
           "torch.nn.functional.relu\n")
    lines = sorted({line for line, _ in private_torch_uses(src)})
    assert lines == [1, 2, 3, 4, 5, 6]


def test_no_module_outside_the_seam_uses_a_private_torch_name():
    offenders = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == SEAM:
                continue
            for line, text in private_torch_uses(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not offenders, "private torch names outside graphs/torch_internals.py:\n" + "\n".join(offenders)


def test_the_installed_torch_is_supported():
    check_torch_version()
    assert torch_internals.SUPPORTED[0] <= tuple(int(x) for x in torch.__version__.split(".")[:2])


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "3.0.0+cpu"])
def test_an_unsupported_torch_gets_one_clear_error(version, monkeypatch):
    monkeypatch.delenv("REMAT_ALLOW_UNTESTED_TORCH", raising=False)
    with pytest.raises(UnsupportedTorch, match=rf"remat supports torch 2\.13-2\.15; this is {re.escape(version)}"):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1+cpu", "2.15.0", "2.15.0+cu130"])
def test_every_release_of_the_range_is_accepted(version, monkeypatch):
    monkeypatch.delenv("REMAT_ALLOW_UNTESTED_TORCH", raising=False)
    assert check_torch_version(version) is None


def test_the_check_can_be_turned_into_a_warning(monkeypatch):
    monkeypatch.setenv("REMAT_ALLOW_UNTESTED_TORCH", "1")
    with pytest.warns(UserWarning, match="this is 2.16.0"):
        check_torch_version("2.16.0")


def test_the_explicit_option_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("REMAT_ALLOW_UNTESTED_TORCH", "1")
    with pytest.raises(UnsupportedTorch):
        check_torch_version("2.16.0", allow_untested=False)
    monkeypatch.delenv("REMAT_ALLOW_UNTESTED_TORCH")
    with pytest.warns(UserWarning):
        check_torch_version("2.16.0", allow_untested=True)


def test_the_pyproject_range_is_the_supported_range():
    text = (ROOT / "pyproject.toml").read_text()
    (a, b), (c, d) = torch_internals.SUPPORTED
    assert f'"torch>={a}.{b},<{c}.{d + 1}"' in text

"""The documentation holds to its runs: the benchmarks page is what the JSON results
render to, and the README stays short, with the two commands that CI and a newcomer run."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: the commands CI and a newcomer's script run, verbatim
COMMANDS = (
    "pip install -e . && python examples/quickstart.py",
    'pip install -e ".[dev]" && python -m pytest -q -n auto',
)


def _render_docs():
    spec = importlib.util.spec_from_file_location("_remat_render_docs", ROOT / "benchmarks" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_rendered_from_the_results():
    render_docs = _render_docs()
    page = ROOT / "docs" / "benchmarks.md"
    assert page.exists(), "docs/benchmarks.md is missing: run python benchmarks/render_docs.py"
    assert page.read_text() == render_docs.render(), (
        "docs/benchmarks.md is not what benchmarks/results/*.json render to: run python benchmarks/render_docs.py")
    assert render_docs.main(["--check"]) == 0


def test_benchmarks_page_check_notices_a_stale_page(tmp_path):
    render_docs = _render_docs()
    stale = tmp_path / "benchmarks.md"
    stale.write_text(render_docs.render().replace("| MobileNet @0.9 |", "| MobileNet @0.9 (edited) |"))
    assert not render_docs.is_current(stale)
    assert not render_docs.is_current(tmp_path / "missing.md")


def test_readme_is_short_and_has_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for command in COMMANDS:
        assert command in text, f"README.md lost the command {command!r}"


def test_readme_links_every_docs_page_and_every_link_resolves():
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} | {"CHANGELOG.md"}
    linked = set(re.findall(r"\]\(([^)#:]+)\)", README.read_text()))
    assert pages <= linked, f"README.md does not link {sorted(pages - linked)}"
    for doc in [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"

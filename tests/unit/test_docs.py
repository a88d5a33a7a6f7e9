"""The README (the map) and the manual in docs/: the tables that mirror code match it, every link resolves."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from celery_durable.config import SETTINGS
from tests.services import in_ci
from tests.unit.test_layering import LAYERS, PACKAGE

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or higher."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n")
    rest = text[start + len(heading) + 2:]
    ends = [m.start() for m in re.finditer(r"^(#+) ", rest, re.M) if len(m.group(1)) <= len(level)]
    return rest[:ends[0]] if ends else rest


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) and GitHub give a heading made of plain words and code."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_the_settings_table_lists_every_setting_and_nothing_else():
    page = (DOCS / "settings.md").read_text()
    table = re.findall(r"^\| `(durable_[a-z_]+)` \|", page, re.M)
    assert len(table) == len(set(table)), f"listed twice: {sorted({s for s in table if table.count(s) > 1})}"
    assert set(table) == set(SETTINGS), (f"missing: {sorted(set(SETTINGS) - set(table))}, "
                                         f"not a setting: {sorted(set(table) - set(SETTINGS))}")


def _parts(cell: str) -> set[str]:
    return {re.sub(r"(/|\.py)$", "", word.strip("`,")) for word in cell.split()}


def test_the_readmes_layers_are_the_layering_tests():
    block = section(README.read_text(), "## Layers")
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    # Each line: the layer's number, its parts (folders end in /, modules in .py), then what it is.
    rows = [re.match(r"\s*(\d+)\s+((?:[a-z_]+(?:/|\.py)\s+)+)", line) for line in block.splitlines()[1:]]
    assert all(rows), block
    layers = {int(row.group(1)): row.group(2) for row in rows if row}
    assert sorted(layers) == list(range(1, len(LAYERS) + 1)), "one line per layer, numbered from 1 at the bottom"
    for number, cell in layers.items():
        assert _parts(cell) == LAYERS[number - 1], f"README layer {number}: {cell!r} is not {LAYERS[number - 1]}"


def test_the_architecture_pages_layers_are_the_layering_tests():
    table = section((DOCS / "architecture.md").read_text(), "## Layers")
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", table, re.M)
    assert [int(number) for number, _ in rows] == list(range(1, len(LAYERS) + 1))
    for number, cell in rows:
        assert _parts(cell) == LAYERS[int(number) - 1], f"docs layer {number}: {cell!r}"


def test_every_link_in_the_readme_resolves():
    readme = README.read_text()
    links = [link for link in LINK.findall(readme) if not re.match(r"[a-z]+:", link)]
    assert links, "the README links to no page of the manual"
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(target), f"README links to {link}: {path} has no heading #{anchor}"


def test_every_module_the_rule_table_names_exists():
    table = section(README.read_text(), "## Where a rule lives")
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 10
    for row in rows:
        for path in re.findall(r"`([a-z_/]+(?:\.py|/))`", row[1]):
            assert (PACKAGE / path).exists(), f"'where a rule lives' names {path}, not in celery_durable/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(link.partition("#")[0]).name for link in LINK.findall(README.read_text())
              if link.startswith("docs/")}
    pages = {page.name for page in DOCS.glob("*.md")}
    assert pages <= linked, f"not on the README's map: {sorted(pages - linked)}"


def test_the_manual_builds_strict(tmp_path):
    # mkdocs comes with the test extra; --strict fails on a broken link or anchor and on a page not in the nav.
    if importlib.util.find_spec("mkdocs") is None:
        message = "mkdocs is not installed (pip install -e '.[docs]')"
        if in_ci():
            pytest.fail(f"{message}: under CI=true the manual must build")
        pytest.skip(message)
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "settings" / "index.html").exists()


def test_the_testing_pages_example_is_the_example_apps_own_test():
    # The snippet a user copies is the test the README's test command runs (examples/test_proj.py).
    page = (DOCS / "testing.md").read_text()
    snippet = page.split("```python\n", 1)[1].split("```", 1)[0]
    example = (ROOT / "examples" / "test_proj.py").read_text()
    assert snippet.strip() in example, "docs/testing.md's first example differs from examples/test_proj.py"

"""The API reference under ``docs/`` documents every public name, and builds offline without a warning.

The public names are read from the modules themselves (``__all__``), so a name added to a module and forgotten in
the docs fails here. The build test runs Sphinx in a fresh process, as CI does, and reads back the inventory it
writes (``objects.inv``: every object the reference documents).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# the modules whose public names (``__all__``) the reference must document in full
DOCUMENTED = [
    "lightprune.prune",
    "lightprune.export",
    "lightprune.structure",
    "lightprune.statistics",
    "lightprune.adapters",
    "lightprune.schedules",
    "lightprune.selection",
    "lightprune.metrics",
    "lightprune.registry",
    "lightprune.experiment.config",
]


def public_names(module_name: str) -> set[str]:
    """``module.name`` for every name of the module's ``__all__`` that does not start with an underscore.

    ``lightprune.prune`` keeps torch's private helpers (``_compute_norm``...) in ``__all__`` for drop-in use; they
    are torch's, not documented by torch either.
    """
    module = importlib.import_module(module_name)
    return {f"{module_name}.{name}" for name in module.__all__ if not name.startswith("_")}


def expected_objects() -> set[str]:
    names = set().union(*(public_names(module) for module in DOCUMENTED))
    return names | {
        "lightprune.__version__",
        "lightprune.PruningCallback",
        "lightprune.callback.METHODS",
        "lightprune.experiment.load_run",
    }


def read_inventory(path: Path) -> set[str]:
    """The names of the Python objects in a Sphinx ``objects.inv`` (four header lines, then zlib-compressed lines
    ``name domain:role priority uri display-name``)."""
    lines = path.read_bytes().split(b"\n", 4)
    assert lines[0] == b"# Sphinx inventory version 2", lines[0]
    entries = zlib.decompress(lines[4]).decode().splitlines()
    return {entry.split(" ")[0] for entry in entries if entry.split(" ")[1].startswith("py:")}


def test_listed_pages_name_every_public_name_of_the_engine() -> None:
    """``prune.rst`` lists the engine's names one by one (grouped by kind), so it must be kept in step by hand."""
    text = (DOCS / "api" / "prune.rst").read_text()
    listed = set(re.findall(r"^\.\. auto(?:function|class):: (\S+)$", text, flags=re.MULTILINE))
    assert listed == public_names("lightprune.prune")


def test_the_root_module_names_what_the_reference_documents() -> None:
    root = importlib.import_module("lightprune")
    # a new root name needs its entry in docs/api/lightprune.rst (prune has its own page)
    assert set(root.__all__) == {"PruningCallback", "__version__", "prune"}


@pytest.mark.slow
def test_docs_build_offline_without_warnings_and_document_every_public_name(tmp_path: Path) -> None:
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path / "html"
    command = ["-W", "--keep-going", "-q", "-b", "html", "-c", str(DOCS), str(ROOT), str(out)]  # as CONTRIBUTING.md
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", *command],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip() == "", result.stderr[-3000:]  # -q prints warnings only
    documented = read_inventory(out / "objects.inv")
    assert expected_objects() - documented == set()
    assert {"lightprune.PruningCallback", "lightprune.prune.global_unstructured"} <= documented
    # a signature Sphinx cannot parse is printed as raw text, with the "~" of its shortened annotations showing
    signatures = re.compile(r'<dt class="sig sig-object py"[^>]*>(.*?)</dt>', flags=re.DOTALL)
    raw = [
        re.sub(r"<[^>]+>", "", signature)[:200]
        for page in (out / "docs" / "api").glob("*.html")
        for signature in signatures.findall(page.read_text())
        if '<span class="pre">~' in signature
    ]
    assert raw == []


# ----------------------------------------------------------------------------------------------------------------------
# Markdown pages: the README, the root files, docs/ and the examples' READMEs
# ----------------------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.MULTILINE | re.DOTALL)


def markdown_pages() -> list[Path]:
    pages = [*ROOT.glob("*.md"), *DOCS.rglob("*.md"), *(ROOT / "examples").rglob("*.md")]
    return sorted(page for page in pages if "_build" not in page.parts)


def github_slug(heading: str) -> str:
    """The anchor GitHub (and MyST's ``myst_heading_anchors``) gives a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {github_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [link for link in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", link)]  # not http:, mailto:


def test_github_slugs() -> None:
    assert github_slug("Quality: accuracy at sparsity, against lightning's `ModelPruning`") == (
        "quality-accuracy-at-sparsity-against-lightnings-modelpruning"
    )
    assert github_slug("Criteria beyond magnitude (issue 22)") == "criteria-beyond-magnitude-issue-22"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no such heading in {target.name}")
    assert broken == []


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^# install and run the tests\n(.+)$", readme, flags=re.MULTILINE)
    assert command, "the README's test command, after '# install and run the tests', is gone"
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.startswith(command.group(1)) for line in ci_lines), command.group(1)

"""The engine's internal API: which of its submodules the rest of lightprune imports, as its docstring lists them.

Read from the sources with ``ast`` (nothing is imported but the engine), so the check runs with torch alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightprune.prune

PACKAGE = Path(lightprune.prune.__file__).resolve().parents[1]
ENGINE = PACKAGE / "prune"
SUBMODULES = {path.stem for path in ENGINE.glob("*.py") if path.stem != "__init__"}


def listed() -> set[str]:
    """The submodules the engine's docstring names as its internal API (its ``* ``name``: ...`` lines)."""
    return set(re.findall(r"^\* ``(\w+)``: ", lightprune.prune.__doc__ or "", flags=re.MULTILINE))


def package_of(path: Path) -> str:
    """The dotted package a source file under ``src/lightprune`` belongs to."""
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])


def imports(source: str, package: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every import in ``source`` (``name`` ``""`` for ``import module``), made absolute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found += [(module, alias.name) for alias in node.names]
    return found


def engine_uses(source: str, package: str) -> set[tuple[str, str]]:
    """``(submodule, name)`` for every engine submodule ``source`` imports (``name`` ``""``: the module itself)."""
    uses = set()
    for module, name in imports(source, package):
        if module.startswith("lightprune.prune."):
            uses.add((module.split(".")[2], name))
        elif module == "lightprune.prune" and name in SUBMODULES:
            uses.add((name, ""))
    return uses


def uses_outside_the_engine() -> list[tuple[str, str, str]]:
    """``(file, submodule, name)`` for every engine submodule imported by a file of lightprune outside ``prune/``."""
    return [
        (str(path.relative_to(PACKAGE)), submodule, name)
        for path in sorted(PACKAGE.rglob("*.py"))
        if ENGINE not in path.parents
        for submodule, name in engine_uses(path.read_text(), package_of(path))
    ]


def test_the_import_forms_in_use_are_all_seen() -> None:
    source = (
        "from lightprune.prune.masking import masked_\n"
        "from lightprune.prune import distributed, L1Unstructured\n"
        "import lightprune.prune.obs\n"
        "def f():\n"
        "    from ..prune.regrow import drop_and_grow\n"
    )
    assert engine_uses(source, "lightprune.callback") == {
        ("masking", "masked_"),
        ("distributed", ""),
        ("obs", ""),
        ("regrow", "drop_and_grow"),
    }


def test_the_listed_submodules_exist() -> None:
    assert listed(), "the engine's docstring lists no internal API"
    assert listed() <= SUBMODULES, listed() - SUBMODULES


def test_the_rest_of_lightprune_imports_only_the_listed_submodules() -> None:
    used: dict[str, set[str]] = {}
    for path, submodule, _ in uses_outside_the_engine():
        used.setdefault(submodule, set()).add(path)
    unlisted = {module: sorted(paths) for module, paths in used.items() if module not in listed()}
    assert unlisted == {}, "list them in lightprune/prune/__init__.py's docstring, or import public names"
    assert listed() - set(used) == set(), "listed in the docstring but imported by nothing outside the engine"


def test_no_private_name_of_a_submodule_is_imported_from_outside() -> None:
    """Underscore names stay inside the engine, except torch's helpers that ``lightprune.prune`` re-exports."""
    private = [use for use in uses_outside_the_engine() if use[2].startswith("_")]
    assert [use for use in private if use[2] not in lightprune.prune.__all__] == []


def test_the_engine_imports_no_lightning_hydra_or_torchmetrics() -> None:
    banned = {"lightning", "pytorch_lightning", "hydra", "omegaconf", "torchmetrics"}
    found = [
        (path.name, module)
        for path in sorted(ENGINE.glob("*.py"))
        for module, _ in imports(path.read_text(), package_of(path))
        if module.split(".")[0] in banned
    ]
    assert found == []

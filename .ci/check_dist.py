"""Check what the built sdist and wheel hold: what users install must not depend on the checkout.

Usage: ``python .ci/check_dist.py dist`` (the folder ``python -m build`` wrote). Exits non-zero naming every file
that is missing: the license text, the ``py.typed`` marker, every preset of ``conf/`` and Hydra's search-path plugin
in the wheel; the license text in the sdist.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wheel_problems(wheel: Path) -> list[str]:
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = next(name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info"))
    required = [f"{dist_info}/licenses/LICENSE", "lightprune/py.typed", "hydra_plugins/lightprune_searchpath.py"]
    presets = sorted((ROOT / "conf").rglob("*.yaml"))
    required += [f"lightprune/conf/{path.relative_to(ROOT / 'conf').as_posix()}" for path in presets]
    return [f"{wheel.name}: no {name}" for name in required if name not in names]


def sdist_problems(sdist: Path) -> list[str]:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[-1] for name in archive.getnames()}
    return [f"{sdist.name}: no {name}" for name in ("LICENSE", "src/lightprune/py.typed") if name not in names]


def main(dist: Path) -> int:
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {[p.name for p in wheels + sdists]}")
        return 1
    problems = wheel_problems(wheels[0]) + sdist_problems(sdists[0])
    print("\n".join(problems) or f"{wheels[0].name} and {sdists[0].name} hold what users need")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

"""pyproject.toml lists its packages explicitly ([tool.setuptools] packages): a package missing from the
list is left out of a built wheel, while the editable install (which maps the whole folder) still finds
it, so nothing else would notice. ``flywheel.serve`` was missing for a whole wave."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def packages_on_disk() -> set[str]:
    """Every package of the installed layout: folders with an ``__init__.py`` under each mapped folder."""
    found: set[str] = set()
    for package, folder in _setuptools()["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join((package, *rel.parts)) if rel.parts else package)
    return found


def test_every_package_on_disk_is_listed_for_the_wheel():
    listed = set(_setuptools()["packages"])
    missing = sorted(packages_on_disk() - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: a wheel would leave them out"


def test_every_listed_package_exists():
    listed = set(_setuptools()["packages"])
    assert not sorted(listed - packages_on_disk())

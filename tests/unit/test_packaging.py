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


def _package_dir(package: str) -> Path:
    """The folder a package is installed from (the longest ``package-dir`` prefix)."""
    mapping = _setuptools()["package-dir"]
    root = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
    rest = package[len(root):].lstrip(".")
    return ROOT / mapping[root] / Path(*rest.split(".")) if rest else ROOT / mapping[root]


def unshipped_data_files() -> list[str]:
    """Files a package holds that are neither Python nor matched by its ``package-data`` patterns: a wheel
    would leave them out. Folders without an ``__init__.py`` belong to the package above them."""
    data = _setuptools().get("package-data", {})
    listed = set(_setuptools()["packages"])
    missing = []
    for package in sorted(listed):
        base = _package_dir(package)
        shipped = {f for pattern in data.get(package, []) for f in base.glob(pattern)}  # setuptools globs
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(base)
            if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".py", ".pyc"):
                continue
            # a file inside a subpackage is that subpackage's
            if any((base / Path(*rel.parts[:i]) / "__init__.py").exists() for i in range(1, len(rel.parts))):
                continue
            if path not in shipped:
                missing.append(f"{package}: {rel.as_posix()}")
    return missing


def test_every_data_file_of_a_package_ships_in_the_wheel():
    """The PostgreSQL lineage queries (warehouse/postgres/queries/*.sql) were left out of package-data:
    an installed wheel's team-mode lineage would have raised FileNotFoundError."""
    missing = unshipped_data_files()
    assert not missing, f"pyproject.toml [tool.setuptools.package-data] does not ship: {missing}"

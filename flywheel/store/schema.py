"""The warehouse's SQL files (the package ``flywheel.warehouse``): each backend's migrations, and the
named queries (lineage walks) both backends read."""

from __future__ import annotations

from importlib import resources


def read_sql(name: str) -> str:
    """The text of ``flywheel/warehouse/<name>``."""
    return resources.files("flywheel.warehouse").joinpath(name).read_text()


def migrations(folder: str = "migrations") -> list[tuple[int, str, str]]:
    """(version, file name, script) of each migration in ``flywheel/warehouse/<folder>``, oldest first
    (``migrations`` for DuckDB, ``postgres`` for PostgreSQL)."""
    root = resources.files("flywheel.warehouse").joinpath(folder)
    out = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".sql"):
            out.append((int(entry.name.split("_", 1)[0]), entry.name, entry.read_text()))
    return out


def split_sql(script: str) -> list[str]:
    """The statements of a script, its ``--`` comment lines left out."""
    body = "\n".join(line for line in script.splitlines() if not line.strip().startswith("--"))
    return [s.strip() for s in body.split(";") if s.strip()]

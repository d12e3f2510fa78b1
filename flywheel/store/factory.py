"""Opening a store: which backend a location means (``EventStore(location)`` asks :func:`backend_for`),
and :func:`open_store`, which opens the configured one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flywheel.store.contract import EventStore, choose_backend_with, is_postgres_url
from flywheel.store.local import DuckDBEventStore

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig


def backend_for(location: object) -> type[EventStore]:
    """The backend class of a location: PostgreSQL for a ``postgresql://`` URL, else the DuckDB file."""
    if is_postgres_url(location):
        # only in team mode: psycopg is imported when a URL is opened
        from flywheel.store.postgres import PostgresEventStore

        return PostgresEventStore
    return DuckDBEventStore


choose_backend_with(backend_for)


def open_store(cfg: FlywheelConfig, **kw: Any) -> EventStore:
    """Open the configured event store: the PostgreSQL database of ``store.url`` when set, else the
    embedded ``warehouse`` file (creating the home directory, 0700)."""
    cfg.ensure_home()
    url = cfg.store.url
    if url:
        kw.pop("recover_wal", None)
        return EventStore(url, read_only=kw.pop("read_only", False))
    kw.setdefault("open_timeout_s", cfg.store.open_timeout_s)
    return EventStore(cfg.warehouse, **kw)

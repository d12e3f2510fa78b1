"""The append-only event store: one DuckDB file on one machine, or a PostgreSQL server for a team.

``EventStore(location)`` opens a DuckDB file (a path) or a PostgreSQL database (a ``postgresql://``
URL; :mod:`flywheel.store.postgres`). :func:`open_store` picks from the configuration (``store.url``,
else the ``warehouse`` file). Both backends keep the same contract, and the store tests run on both.

Guarantees (both backends)
- ``event_id`` is deterministic: a hash of type, stream and the canonical JSON payload. Appending an
  event that is already recorded is a no-op reported as ``already_recorded``; re-running a stage
  appends nothing new. ``correlation_id`` is *not* part of the hash.
- Per stream, versions are 1, 2, 3, ... without gaps; ``expected_version`` gives optimistic
  concurrency: a stale expected version raises :class:`ConcurrencyError` and appends nothing.
- ``seq`` is 1..n without gaps, and a reader that has seen ``seq`` n has seen every event before it
  (appends commit in seq order).
- Every append is one transaction, events and projections together; a payload that is not JSON
  raises :class:`InvalidEventError` with nothing appended. Batches go in through Arrow.
- Projections (``entity_names``; ``entity_index``, read through the view ``entities``;
  ``lineage_links``, read through the view ``lineage_edges``; ``streams`` is a view over events), keyed
  by 64-bit node ids (:func:`~flywheel.store.ids.node_id`, migration 003), are maintained on append and can be rebuilt
  from the events alone (:meth:`EventStore.rebuild_projections`); a test asserts rebuilt == incremental.

Crash safety (what survives a SIGKILL of a writer)
- Committed transactions survive; an append that was in flight is absent as a whole. DuckDB replays
  its write-ahead log on the next open (the WAL is checkpointed into the file every
  :data:`CHECKPOINT_THRESHOLD` and on close); PostgreSQL rolls back the killed client's transaction.
- If DuckDB refuses to replay the WAL, ``EventStore(path, recover_wal=True)`` (CLI:
  ``flywheel warehouse recover``) moves the WAL aside as ``<file>.wal.unreplayed-<time>``, opens the
  database, and warns loudly that the transactions in that file are lost from the store (the file is
  kept for forensics).

Concurrency, embedded (DuckDB lets one process open a file for writing)
- The first flywheel process to open the file owns it and serves every other flywheel process on the
  same machine over a private Unix socket (:mod:`flywheel.store.share`): reads run beside the owner's
  appends (DuckDB's MVCC), and appends from other processes (an ingest while a cycle runs) are
  serialised with the owner's own under one lock. When the owner closes, one of the others takes the
  file over and serves the rest; a request that was in flight is retried, which is safe because
  appends are idempotent (the retried append reports its events as ``already_recorded``).
- A process that holds the file without serving it (another DuckDB program, or a ``read_only`` open)
  is waited for up to ``open_timeout_s``; then :class:`StoreLockedError` names its PID.

Concurrency, PostgreSQL
- Any number of writer processes on any number of machines: appends take a transaction-scoped
  advisory lock for the part that numbers events (work that does not depend on the numbering, such as
  hashing and copying the batch in, happens before it), so seq and versions stay gap-free.

Modules, each importing only those below it (the "store-layers" contract of pyproject.toml)
- :mod:`~flywheel.store.factory`: which backend a location means; :func:`open_store`.
- :mod:`~flywheel.store.postgres`: the PostgreSQL backend, its appends (and :func:`~flywheel.store.postgres.migrate_events`).
- :mod:`~flywheel.store.local`: the DuckDB backend, its appends.
- :mod:`~flywheel.store.postgres_reads`, :mod:`~flywheel.store.local_reads`: their queries.
- :mod:`~flywheel.store.postgres_connection`, :mod:`~flywheel.store.local_connection`: their connections
  (the DuckDB file opened, or reached through its owner); :mod:`~flywheel.store.postgres_copy`: a batch in
  COPY's text form; :mod:`~flywheel.store.local_projections`: the DuckDB backend's projections.
- :mod:`~flywheel.store.share`: one DuckDB file served by its owning process to the others.
- :mod:`~flywheel.store.index`: the DuckDB backend's in-memory head index.
- :mod:`~flywheel.store.batch`: an append batch normalised, checked and planned (both backends).
- :mod:`~flywheel.store.contract`: the :class:`EventStore` base class, its records and errors.
- :mod:`~flywheel.store.schema`: the warehouse's SQL files (migrations, named queries).
- :mod:`~flywheel.store.ids`: event ids and entity node ids, in Python and in SQL.

Import the public API from here (``from flywheel.store import EventStore, NewEvent, open_store``).
"""

from __future__ import annotations

from flywheel.store.batch import (
    AppendPlan,
    expected_of,
    normalise_batch,
    plan_append,
    plan_small,
    small_rows_of,
)
from flywheel.store.contract import (
    ANY,
    BATCH_SCHEMA,
    EXPORT_TABLES,
    NO_STREAM,
    SMALL_APPEND,
    AppendResult,
    ConcurrencyError,
    EntityIdCollisionError,
    Event,
    EventStore,
    InvalidEventError,
    NewEvent,
    StoreError,
    StoreLockedError,
    StoreUnavailableError,
    events_table,
    is_postgres_url,
    redact_url,
    write_parquet_private,
)
from flywheel.store.factory import open_store
from flywheel.store.ids import compute_event_id, event_id_sql, node_id, signed_node_id
from flywheel.store.local import CHECKPOINT_THRESHOLD, DEFAULT_OPEN_TIMEOUT_S, DuckDBEventStore

# canonical_json is flywheel.vocab.ids's (event ids hash it); importable from here for the callers
# that build batches (BATCH_SCHEMA's payload column is canonical JSON).
from flywheel.vocab.ids import canonical_json

__all__ = [
    "ANY", "BATCH_SCHEMA", "CHECKPOINT_THRESHOLD", "DEFAULT_OPEN_TIMEOUT_S", "EXPORT_TABLES", "NO_STREAM",
    "SMALL_APPEND", "AppendPlan", "AppendResult", "ConcurrencyError", "DuckDBEventStore", "EntityIdCollisionError",
    "Event", "EventStore", "InvalidEventError", "NewEvent", "StoreError", "StoreLockedError", "StoreUnavailableError",
    "canonical_json", "compute_event_id", "event_id_sql", "events_table", "expected_of", "is_postgres_url", "node_id",
    "normalise_batch", "open_store", "plan_append", "plan_small", "redact_url", "signed_node_id", "small_rows_of",
    "write_parquet_private",
]

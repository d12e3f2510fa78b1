"""The append-only event store: one DuckDB file on one machine, or a PostgreSQL server for a team.

``EventStore(location)`` opens a DuckDB file (a path) or a PostgreSQL database (a ``postgresql://``
URL; :mod:`flywheel.store_postgres`). :func:`open_store` picks from the configuration (``store.url``,
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
  by 64-bit node ids (:func:`node_id`, migration 003), are maintained on append and can be rebuilt
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
  same machine over a private Unix socket (:mod:`flywheel.store_share`): reads run beside the owner's
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
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import CATALOG, check_event
from flywheel.store.index import HeadIndex

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig

ANY = None  # expected_version: no check
CHECKPOINT_THRESHOLD = "256MiB"
NO_STREAM = 0  # expected_version: the stream must not exist yet
# How long opening an embedded store waits for a file held by a process that does not serve it (or
# an owner still starting up) before StoreLockedError. Opening, migrations and a clean close of a
# 1M-event warehouse take ~1 s here; a read-only reader holds it for well under that.
DEFAULT_OPEN_TIMEOUT_S = 60.0


class StoreError(RuntimeError):
    pass


class StoreUnavailableError(StoreError):
    """The store cannot be reached now (file held elsewhere, server down); retrying later may work."""


class ConcurrencyError(StoreError):
    """The stream's current version is not the one the caller expected."""

    def __init__(self, stream: str, expected: int, actual: int):
        super().__init__(f"stream {stream!r} is at version {actual}, expected {expected}")
        self.stream, self.expected, self.actual = stream, expected, actual


class StoreLockedError(StoreUnavailableError):
    """Another process holds the warehouse file and does not serve it."""


class InvalidEventError(StoreError, ValueError):
    """An event that cannot be recorded (its payload is not valid JSON); nothing was appended."""


class EntityIdCollisionError(StoreError):
    """An append to one stream (:meth:`EventStore.append`) mentions an entity id whose 64-bit node id
    another name holds (:func:`node_id`); nothing was appended. ``name`` is the refused name,
    ``other`` the one that holds its node id."""

    def __init__(self, message: str, name: str, other: str):
        super().__init__(message)
        self.name, self.other = name, other


@dataclass(frozen=True)
class NewEvent:
    """An event to append. ``causation`` lists the entity ids it was caused by."""

    type: str
    payload: dict[str, Any]
    causation: Sequence[str] = ()


@dataclass(frozen=True)
class Event:
    seq: int
    event_id: str
    stream: str
    stream_version: int
    type: str
    payload: dict[str, Any]
    causation: list[str]
    correlation_id: str | None
    recorded_at: Any
    schema_version: int

    @property
    def entity_id(self) -> str:
        """The entity this event is about: its payload's ``entity_id`` when present (even empty, as the
        store's projections read it), else its stream."""
        entity = self.payload.get("entity_id")
        return self.stream if entity is None else entity


@dataclass
class AppendResult:
    appended: int = 0
    already_recorded: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    event_ids: list[str] = field(default_factory=list)
    # Rows of the batch that were not appended because an entity id they mention collides with another
    # name's node id (see EventStore.append_batch); each a dict: row (position in the batch), stream,
    # type, event_id, entity (the refused name), collides_with, node, reason.
    rejected: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_noop(self) -> bool:
        return self.appended == 0

    def to_dict(self) -> dict[str, Any]:
        return {"appended": self.appended, "already_recorded": self.already_recorded, "first_seq": self.first_seq,
                "last_seq": self.last_seq, "event_ids": list(self.event_ids),
                "rejected": [dict(r) for r in self.rejected]}


def canonical_json(payload: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 kept. Raises TypeError on non-JSON values."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def event_id_sql(type_col: str = "type", stream_col: str = "stream", payload_col: str = "payload") -> str:
    # 128 bits of sha256 over type, stream and canonical payload, separated by a unit separator.
    return f"'ev_' || left(sha256({type_col} || chr(31) || {stream_col} || chr(31) || {payload_col}), 32)"


def node_id(name: str) -> int:
    """An entity's node id: 64 bits of the name's MD5, as DuckDB's ``(md5_number(name) >> 64)::UBIGINT``.

    (``md5_number`` reads the digest as a little-endian 128-bit integer, so these are its last 8 bytes.
    ``md5_number_lower`` gives the same value at ~4x the cost: 60 ms vs 16 ms per 100k names.)
    PostgreSQL stores the same 64 bits as a signed BIGINT (:func:`signed_node_id`).
    """
    import hashlib

    return int.from_bytes(hashlib.md5(name.encode()).digest()[8:], "little")


def signed_node_id(name: str) -> int:
    """:func:`node_id` read as a signed 64-bit integer (PostgreSQL has no unsigned BIGINT)."""
    n = node_id(name)
    return n - (1 << 64) if n >= 1 << 63 else n


def compute_event_id(type_: str, stream: str, payload: dict[str, Any] | str) -> str:
    import hashlib

    body = payload if isinstance(payload, str) else canonical_json(payload)
    return "ev_" + hashlib.sha256(f"{type_}\x1f{stream}\x1f{body}".encode()).hexdigest()[:32]


def is_postgres_url(location: Any) -> bool:
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


_SECRET_PARAM_RE = re.compile(r"(?i)^(?:ssl)?password$")


def redact_url(url: str) -> str:
    """A store location safe to print: every password of a ``postgresql://`` URL masked.

    Masked from the URL's parts, not by one pattern over the text: the user info's password up to the
    *last* ``@`` before the host (a password with a raw ``@``, ``/`` or ``?`` in it, which libpq
    itself would misread, is masked whole), and the value of every ``password`` / ``sslpassword``
    query parameter (any case, percent-encoded or not). Anything that is not a ``postgresql://`` URL
    (a warehouse path) is returned as it is. Not guaranteed: a password written into some other
    parameter (``options=...``) is not recognised.
    """
    if not is_postgres_url(url):
        return url
    from urllib.parse import unquote

    scheme, rest = url.split("://", 1)
    q = rest.find("?")
    at = rest.rfind("@")
    if 0 <= q < at and "=" not in rest[q:at]:
        q = rest.find("?", at)  # that "?" was inside the password: the query starts after the host
    head, query = (rest, "") if q < 0 else (rest[:q], rest[q + 1:])
    if "@" in head:
        userinfo, host = head.rsplit("@", 1)
        user, has_pw, _ = userinfo.partition(":")
        head = f"{user}:***@{host}" if has_pw else f"{user}@{host}"
    if query:
        parts = []
        for item in query.split("&"):
            key, eq, _value = item.partition("=")
            parts.append(f"{key}=***" if eq and _SECRET_PARAM_RE.match(unquote(key).strip()) else item)
        query = "&".join(parts)
    return f"{scheme}://{head}" + (f"?{query}" if q >= 0 else "")


BATCH_SCHEMA = pa.schema(
    [
        ("stream", pa.string()),
        ("type", pa.string()),
        ("payload", pa.string()),  # canonical JSON text
        ("causation", pa.list_(pa.string())),
    ]
)

EXPORT_TABLES = ("events", "streams", "entities", "lineage_edges")

# One lock per warehouse file, shared by every EventStore of this process on that file. DuckDB's file
# lock keeps other processes out (they append through the owner, flywheel.store_share); this lock
# serialises appends of several connections inside one process, which is what lets the append
# transaction (not an index) keep seq, event_id and (stream, stream_version) unique.
_PATH_LOCKS: dict[str, threading.RLock] = {}
_PATH_LOCKS_GUARD = threading.Lock()


_PATH_INDEXES: dict[str, HeadIndex] = {}


def _path_lock(path: Path) -> threading.RLock:
    key = os.path.realpath(path)
    with _PATH_LOCKS_GUARD:
        return _PATH_LOCKS.setdefault(key, threading.RLock())


def _path_index(path: Path) -> HeadIndex:
    """The in-memory head index of this warehouse file in this process (flywheel.store_index), used
    under the file's lock."""
    key = os.path.realpath(path)
    with _PATH_LOCKS_GUARD:
        return _PATH_INDEXES.setdefault(key, HeadIndex())


# DuckDB's lock conflict: 'Could not set lock on file "...": Conflicting lock is held in <program>
# (PID <n>)...', with the program left out when it cannot be read (another PID namespace), and nothing
# after the colon when the holder let go between DuckDB's two fcntl calls (it reads PID 0): exactly
# what a takeover from an exiting owner meets. Not a conflict: an fcntl failure ("No locks available").
_LOCK_RE = re.compile(r'Conflicting lock is held|Could not set lock on file "[^"]*":\s*(?:\.|$)')
_HOLDER_RE = re.compile(r"Conflicting lock is held in (?:(?P<exe>.*?) )?\(?PID (?P<pid>\d+)\)?")


def _lock_holder(message: str) -> tuple[str, str] | None:
    """(pid, program) of the process DuckDB says holds the file's lock, or None when ``message`` is not
    a lock conflict; ('?', '') where DuckDB does not name the holder, ('<pid>', '') without its program."""
    if not _LOCK_RE.search(message):
        return None
    m = _HOLDER_RE.search(message)
    if m is None:
        return "?", ""
    return m["pid"], (m["exe"] or "").strip()


_ENTITY_SQL = "coalesce(json_extract_string(payload, '$.entity_id'), stream)"
_NODE_SQL = "(md5_number({}) >> 64)::UBIGINT"  # node_id() in SQL; .format(column)
# The catalog's schema version of b.type, without a join (a join would not keep the batch's row order).
_NON_DEFAULT_VERSIONS = " ".join(
    f"WHEN '{t}' THEN {spec.schema_version}" for t, spec in CATALOG.items() if spec.schema_version != 1
)
_SCHEMA_VERSION_SQL = f"CASE b.type {_NON_DEFAULT_VERSIONS} ELSE 1 END" if _NON_DEFAULT_VERSIONS else "1"


def _sql(name: str) -> str:
    return resources.files("flywheel.warehouse").joinpath(name).read_text()


def _migrations(folder: str = "migrations") -> list[tuple[int, str, str]]:
    root = resources.files("flywheel.warehouse").joinpath(folder)
    out = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".sql"):
            out.append((int(entry.name.split("_", 1)[0]), entry.name, entry.read_text()))
    return out


def _split_sql(script: str) -> list[str]:
    body = "\n".join(line for line in script.splitlines() if not line.strip().startswith("--"))
    return [s.strip() for s in body.split(";") if s.strip()]


def _checked_events(stream: str, events: Sequence[NewEvent]) -> list[tuple[str, str, list[str]]]:
    """(type, canonical JSON payload, causation) of each event, checked against the catalog."""
    out = []
    for i, ev in enumerate(events):
        check_event(ev.type, stream)
        try:
            body = canonical_json(ev.payload)
        except (TypeError, ValueError) as e:
            raise TypeError(f"event {i} ({ev.type} on {stream}): payload is not JSON-serialisable: {e}") from None
        out.append((ev.type, body, [str(c) for c in ev.causation]))
    return out


def events_table(stream: str, events: Sequence[NewEvent]) -> pa.Table:
    """The Arrow batch (:data:`BATCH_SCHEMA`) of events for one stream, checked against the catalog."""
    rows = _checked_events(stream, events)
    return pa.table({"stream": [stream] * len(rows), "type": [r[0] for r in rows], "payload": [r[1] for r in rows],
                     "causation": [r[2] for r in rows]}, schema=BATCH_SCHEMA)


def normalise_batch(table: pa.Table, validated: bool) -> pa.Table:
    """The batch with exactly the :data:`BATCH_SCHEMA` columns and a row index ``_i``; refuses nulls
    and (unless ``validated``) event types outside the catalog or on the wrong stream."""
    table = table.select(BATCH_SCHEMA.names).cast(BATCH_SCHEMA)
    for col in ("stream", "type", "payload"):
        if table.column(col).null_count:
            raise ValueError(f"append_batch: column {col!r} has {table.column(col).null_count} null value(s)")
    if not validated:
        prefixes = pc.utf8_slice_codeunits(table.column("stream"), 0, 64)
        pairs = pa.table({"t": table.column("type"), "p": prefixes}).group_by(["t", "p"]).aggregate([])
        for type_, stream in zip(pairs.column("t").to_pylist(), pairs.column("p").to_pylist(), strict=True):
            check_event(type_, stream.split(":", 1)[0] + ":")
    return table.append_column("_i", pa.array(np.arange(table.num_rows, dtype=np.int64)))


@dataclass
class AppendPlan:
    """Which rows of a batch are new and the stream version each gets (shared by both backends)."""

    fresh: np.ndarray  # bool per batch row
    versions: np.ndarray  # int64 per fresh row

    @property
    def n_new(self) -> int:
        return int(self.fresh.sum())


def plan_append(
    streams: pa.ChunkedArray | pa.Array,
    event_ids: pa.ChunkedArray | pa.Array,
    known_streams: pa.Array | pa.ChunkedArray,
    known_versions: pa.Array | pa.ChunkedArray,
    held: pa.Array | pa.ChunkedArray | None,
    expected_versions: dict[str, int | None] | None,
) -> AppendPlan:
    """Plan an append in Arrow/numpy: a row is fresh unless its event_id appeared earlier in the batch
    or is ``held`` (already recorded); each fresh row's version is its stream's prior version plus its
    rank among the stream's fresh rows. Raises :class:`ConcurrencyError` on a stale expected version
    (only when something would be appended)."""
    n_rows = len(event_ids)
    fresh = np.ones(n_rows, dtype=bool)
    if pc.count_distinct(event_ids).as_py() != n_rows:  # a repeat inside the batch: keep the first
        first = pc.index_in(event_ids, value_set=event_ids).to_numpy(zero_copy_only=False)
        fresh &= first == np.arange(n_rows)
    if held is not None and len(held):
        fresh &= ~pc.is_in(event_ids, value_set=held).to_numpy(zero_copy_only=False)
    n_new = int(fresh.sum())
    if n_new == 0:
        return AppendPlan(fresh, np.zeros(0, dtype=np.int64))
    if expected_versions:
        prior = dict(zip(pa.chunked_array([known_streams]).to_pylist() if not isinstance(known_streams, pa.ChunkedArray)
                         else known_streams.to_pylist(),
                         pa.chunked_array([known_versions]).to_pylist() if not isinstance(known_versions, pa.ChunkedArray)
                         else known_versions.to_pylist(), strict=True))
        for stream, expected in expected_versions.items():
            if expected is not None and (prior.get(stream) or 0) != expected:
                raise ConcurrencyError(stream, expected, prior.get(stream) or 0)
    fresh_streams = pc.filter(streams, pa.array(fresh)) if n_new < n_rows else streams
    if pc.count_distinct(fresh_streams).as_py() == n_new:
        rank = np.ones(n_new, dtype=np.int64)
    else:
        codes = pc.dictionary_encode(fresh_streams)
        codes = (codes.combine_chunks() if isinstance(codes, pa.ChunkedArray) else codes).indices.to_numpy()
        order = np.argsort(codes, kind="stable")
        sorted_codes = codes[order]
        starts = np.r_[0, np.flatnonzero(np.diff(sorted_codes)) + 1]
        pos = np.arange(n_new) - np.repeat(starts, np.diff(np.r_[starts, n_new]))
        rank = np.empty(n_new, dtype=np.int64)
        rank[order] = pos + 1
    versions = rank
    if len(known_streams):
        before = pc.index_in(fresh_streams, value_set=known_streams)
        prior_v = pc.take(known_versions, before)
        versions = versions + pc.fill_null(prior_v, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return AppendPlan(fresh, versions)


def expected_of(expected_versions: dict[str, int] | None, streams: set[str]) -> dict[str, int] | None:
    """The expected versions of these streams only: what is left to check once an append refused the
    other streams' rows (a refused stream's expectation is moot: nothing is appended to it)."""
    if expected_versions is None:
        return None
    return {k: v for k, v in expected_versions.items() if k in streams}


# Batches up to this many rows take the one-statement path of DuckDBEventStore._append_small.
SMALL_APPEND = 64


@dataclass(frozen=True)
class _SmallRow:
    stream: str
    type: str
    payload: str
    causation: list[str | None]
    event_id: str
    entity: str
    node: int
    parents: list[int]


def _lit(v: str | None) -> str:
    """A SQL string literal (standard strings: only the quote is special), or NULL."""
    return "NULL" if v is None else "'" + v.replace("'", "''") + "'"


def _small_row(stream: str, type_: str, payload: str, doc: Any, causation: list[str | None]) -> _SmallRow | None:
    entity = doc.get("entity_id") if isinstance(doc, dict) else None
    if entity is not None and not isinstance(entity, str):
        return None
    entity = stream if entity is None else entity  # as SQL's coalesce: an empty entity_id is one
    return _SmallRow(stream, type_, payload, causation, compute_event_id(type_, stream, payload), entity,
                     node_id(entity), [node_id(c) if c is not None else 0 for c in causation])


def _small_rows(batch: pa.Table) -> list[_SmallRow] | None:
    """The rows of a small batch with their ids computed in Python; None when a row needs DuckDB's own
    reading (an ``entity_id`` that is not a string, or a payload that is not JSON: the Arrow path
    reports it)."""
    out = []
    for stream, type_, payload, causation in zip(*(batch.column(c).to_pylist() for c in BATCH_SCHEMA.names), strict=True):
        try:
            doc = json.loads(payload)
        except ValueError:
            return None
        row = _small_row(stream, type_, payload, doc, list(causation or []))
        if row is None:
            return None
        out.append(row)
    return out


def small_rows_of(stream: str, events: Sequence[NewEvent]) -> list[_SmallRow] | None:
    """:func:`_small_rows` of ``events_table(stream, events)`` without going through Arrow (the same
    checks and errors); None when a row needs the Arrow path."""
    out = []
    for (type_, body, causation), ev in zip(_checked_events(stream, events), events, strict=True):
        row = _small_row(stream, type_, body, ev.payload, causation)
        if row is None:
            return None
        out.append(row)
    return out


def plan_small(rows: Sequence[_SmallRow], known: dict[str, tuple[int, set[str]]],
               expected_versions: dict[str, int | None] | None) -> tuple[list[bool], list[int]]:
    """:func:`plan_append` for a few rows, in plain Python: ``known`` maps each existing stream of the
    batch to (its version, the batch's event ids it holds). Returns (fresh per row, version per fresh row)."""
    seen: set[str] = set()
    fresh = []
    for r in rows:
        held = known.get(r.stream)
        keep = r.event_id not in seen and not (held is not None and r.event_id in held[1])
        seen.add(r.event_id)
        fresh.append(keep)
    if not any(fresh):
        return fresh, []
    for stream, expected in (expected_versions or {}).items():
        actual = known[stream][0] if stream in known else 0
        if expected is not None and actual != expected:
            raise ConcurrencyError(stream, expected, actual)
    next_version = {st: v for st, (v, _) in known.items()}
    versions = []
    for r, keep in zip(rows, fresh, strict=True):
        if keep:
            next_version[r.stream] = next_version.get(r.stream, 0) + 1
            versions.append(next_version[r.stream])
    return fresh, versions


def _unregister(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Unregister an Arrow view; in an aborted transaction DuckDB refuses until the rollback, after
    which the append unregisters again."""
    try:
        con.unregister(name)
    except duckdb.Error:
        pass


def _private_dir(directory: Path) -> None:
    """Create ``directory`` (and parents) as 0700; a directory this call created is made 0700 whatever
    the umask (an existing one keeps its mode: it is the caller's)."""
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700)
        os.chmod(directory, 0o700)


def write_parquet_private(final: Path, batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> None:
    """Write record batches as one zstd Parquet file, created 0600 under a temporary name and renamed
    into place (no half-written file under the final name, no window where it is readable by others)."""
    import pyarrow.parquet as pq

    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh, pq.ParquetWriter(fh, schema, compression="zstd") as writer:
            for b in batches:
                if b.num_rows:
                    writer.write_batch(b)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class EventStore:
    """The event store. ``EventStore(path)`` opens the embedded DuckDB file; ``EventStore(url)`` with a
    ``postgresql://`` URL opens the PostgreSQL backend. Use as a context manager.

    Public API (both backends): :meth:`append`, :meth:`append_batch`, :meth:`read`,
    :meth:`read_arrow`, :meth:`stream_version`, :meth:`last_seq`, :meth:`entity`, :meth:`entities`,
    :meth:`counts_by_kind`, :meth:`lineage`, :meth:`lineage_edges`, :meth:`rebuild_projections`,
    :meth:`check_integrity`, :meth:`projection_counts`, :meth:`export`, and the query helpers the
    stages use (:meth:`latest_entity_id`, :meth:`event_stats`, :meth:`existing_streams`,
    :meth:`entity_states`, :meth:`trace_states`, :meth:`failure_kinds_by_day`).
    """

    backend = "abstract"

    def __new__(cls, location: Any = None, *args: Any, **kw: Any) -> EventStore:
        if cls is EventStore:
            if is_postgres_url(location):
                # only in team mode (psycopg); store_postgres imports store
                from flywheel.store.postgres import PostgresEventStore

                cls = PostgresEventStore
            else:
                cls = DuckDBEventStore
        return super().__new__(cls)

    # -- common ------------------------------------------------------------------------------
    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - every backend overrides
        raise NotImplementedError

    @property
    def location(self) -> str:
        """Where the store lives, safe to print (a URL's password is masked)."""
        raise NotImplementedError

    def append(
        self,
        stream: str,
        events: NewEvent | Iterable[NewEvent],
        *,
        expected_version: int | None = ANY,
        correlation_id: str | None = None,
    ) -> AppendResult:
        """Append events to one stream in one transaction.

        ``expected_version``: ``None`` appends at the end; an int (``NO_STREAM`` = 0 for a new stream)
        must equal the stream's current version, else :class:`ConcurrencyError`. Events already recorded
        (same event_id) are skipped and counted as ``already_recorded``; a fully recorded append is a
        no-op that never raises on version.
        """
        if isinstance(events, NewEvent):
            events = [events]
        events = list(events)
        if not events:
            return AppendResult()
        expected = {stream: expected_version} if expected_version is not None else None
        res = None
        if len(events) <= SMALL_APPEND:
            res = self._append_small_events(stream, events, correlation_id, expected)
        if res is None:
            res = self.append_batch(events_table(stream, events), correlation_id=correlation_id,
                                    expected_versions=expected, validated=True)
        if res.rejected:
            # One stream: its events build on one another, so a refused event refuses all of them
            # (the append refuses a stream's later events with it, and appends nothing then).
            first = res.rejected[0]
            raise EntityIdCollisionError(
                f"append to {stream!r}: {first['reason']} (nothing was appended)", first["entity"], first["collides_with"])
        return res

    def _append_small_events(self, stream: str, events: list[NewEvent], correlation_id: str | None,
                             expected_versions: dict[str, int] | None) -> AppendResult | None:
        """A backend's direct path for a few events of one stream (no Arrow); None: use append_batch."""
        return None

    def append_batch(
        self,
        table: pa.Table,
        *,
        correlation_id: str | None = None,
        expected_versions: dict[str, int] | None = None,
        validated: bool = False,
    ) -> AppendResult:  # pragma: no cover - every backend overrides
        raise NotImplementedError

    @staticmethod
    def _check_node_ids(names: pa.Table, known: list[tuple[int, str]]) -> dict[str, tuple[str, int]]:
        """The names of an append that would share a node id with another name (a 64-bit MD5 prefix
        collision), each mapped to (the name that keeps the node id, the node id); empty when none.

        ``names``: the append's distinct names (columns ``name``, ``node`` as UBIGINT, and optionally
        ``row``, the first row of the batch that mentions the name); ``known``: (node, name) of the
        store's names with those node ids. A name the store holds keeps its node id; of new names that
        share one, the one mentioned first in the batch keeps it (without ``row``: the first in
        ``names``)."""
        ids = names.column("node")
        out: dict[str, tuple[str, int]] = {}
        if known:
            kt = pa.table({"node": pa.array([int(n) for n, _ in known], pa.uint64()),
                           "old": pa.array([x for _, x in known], pa.string())})
            j = names.select(["name", "node"]).join(kt, "node")
            j = j.filter(pc.not_equal(j.column("name"), j.column("old")))
            for name, node, old in zip(*(j.column(c).to_pylist() for c in ("name", "node", "old")), strict=True):
                out[name] = (old, node)
        if pc.count_distinct(ids).as_py() != names.num_rows:
            counts = pc.value_counts(ids)
            dups = set(pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1)).to_pylist())
            order = names.column("row").to_pylist() if "row" in names.column_names else range(names.num_rows)
            first: dict[int, tuple[Any, str]] = {}
            for name, node, at in zip(names.column("name").to_pylist(), ids.to_pylist(), order, strict=True):
                if node in dups and name not in out and (node not in first or at < first[node][0]):
                    first[node] = (at, name)
            for name, node in zip(names.column("name").to_pylist(), ids.to_pylist(), strict=True):
                if node in first and name != first[node][1] and name not in out:
                    out[name] = (first[node][1], node)
        return out

    def colliding_names(self, names: Sequence[str] | pa.Array | pa.ChunkedArray) -> dict[str, str]:
        """Of these entity ids, those an append would refuse because another name holds their 64-bit
        node id (:func:`node_id`; the store's name, or an earlier one of ``names``), each mapped to
        that other name. What a stage asks before it builds events on the names (ingest quarantines
        such a trace instead of sending it)."""
        values = names.to_pylist() if isinstance(names, pa.Array | pa.ChunkedArray) else list(names)
        values = list(dict.fromkeys(values))
        if not values:
            return {}
        nodes = [node_id(n) for n in values]
        held = [(int(n) % (1 << 64), x) for n, x in self._names_holding(nodes)]
        table = pa.table({"name": pa.array(values, pa.string()), "node": pa.array(nodes, pa.uint64())})
        return {k: v[0] for k, v in EventStore._check_node_ids(table, held).items()}

    def _names_holding(self, nodes: list[int]) -> list[tuple[int, str]]:  # pragma: no cover - every backend overrides
        """(node, name) of the store's names that hold any of these node ids."""
        raise NotImplementedError

    @staticmethod
    def _collision_message(name: str, other: str, node: int) -> str:
        return (f"entity ids collide: {name!r} and {other!r} share the node id {node} (64 bits of MD5); "
                f"{other!r} keeps it, so events that mention {name!r} are refused: rename one of these entities")

    @staticmethod
    def _rejected_rows(streams: Sequence[str], types: Sequence[str], event_ids: Sequence[str],
                       entities: Sequence[str], causations: Sequence[Sequence[str | None] | None],
                       clashes: dict[str, tuple[str, int]], rows: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        """The rows of a batch that an append refuses over ``clashes`` (:meth:`_check_node_ids`): every
        row that mentions a refused name (as its entity or in its causation), and every other row of
        the same stream in the batch (a stream's events build on one another, so a stream goes in
        whole or not at all). Keyed by position in these lists; ``rows`` gives each position's row
        number in the caller's batch."""
        out: dict[int, dict[str, Any]] = {}
        stopped: dict[str, dict[str, Any]] = {}
        for k, ent in enumerate(entities):
            hit = ent if ent in clashes else next((c for c in causations[k] or () if c in clashes), None)
            if hit is not None:
                other, node = clashes[hit]
                out[k] = {"row": int(rows[k]) if rows is not None else k, "stream": streams[k], "type": types[k],
                          "event_id": event_ids[k], "entity": hit, "collides_with": other, "node": int(node),
                          "reason": EventStore._collision_message(hit, other, int(node))}
                stopped.setdefault(streams[k], out[k])
        if stopped:
            for k, stream in enumerate(streams):
                if k not in out and stream in stopped:
                    first = stopped[stream]
                    out[k] = {"row": int(rows[k]) if rows is not None else k, "stream": stream, "type": types[k],
                              "event_id": event_ids[k], "entity": first["entity"],
                              "collides_with": first["collides_with"], "node": first["node"],
                              "reason": f"another event of stream {stream!r} in this batch was refused: {first['reason']}"}
        return dict(sorted(out.items()))

    @staticmethod
    def _event_from_row(r: Sequence[Any]) -> Event:
        payload = r[5] if isinstance(r[5], dict) else json.loads(r[5])
        return Event(r[0], r[1], r[2], r[3], r[4], payload, list(r[6]), r[7], r[8], r[9])

    def export(self, directory: str | os.PathLike[str]) -> dict[str, str]:
        """Write events and projections as zstd Parquet for readers elsewhere. The directory is created
        0700 when it does not exist; each file is written 0600 under a temporary name and renamed into
        place (atomic per file). The path never enters SQL."""
        out = Path(directory)
        _private_dir(out)
        written = {}
        for t in EXPORT_TABLES:
            final = out / f"{t}.parquet"
            reader = self._table_batches(t)
            write_parquet_private(final, reader, reader.schema)
            written[t] = str(final)
        return written

    def _table_batches(self, table: str) -> pa.RecordBatchReader:  # pragma: no cover - every backend overrides
        raise NotImplementedError

    def entity_states(self, entity_ids: Sequence[str]) -> dict[str, str]:
        """The current state (latest payload, JSON text) of each of these entities that exists."""
        return {k: v for k, (v, _) in self.entity_heads(entity_ids).items()}

    @contextmanager
    def memory_limit(self, mb: int) -> Iterator[None]:
        """Cap the store's buffer memory in this process while the block runs (embedded owner only;
        elsewhere a no-op)."""
        yield


class DuckDBEventStore(EventStore):
    """The embedded backend: one DuckDB file, shared between the processes of one machine by its owner
    (see the module docstring). ``con`` is the DuckDB connection in the owning process, or a read-only
    stand-in (``execute``/``sql`` of SELECT statements) that forwards to the owner in the others."""

    backend = "duckdb"

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False, recover_wal: bool = False,
                 open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S, serve: bool = True):
        self.path = Path(path)
        self.read_only = read_only
        self.recovered_wal: Path | None = None
        self.open_timeout_s = open_timeout_s
        self._serve = serve and not read_only
        self._recover_wal = recover_wal
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = _path_lock(self.path)
        self._index = _path_index(self.path)
        self._tls = threading.local()
        self._cursor_guard = threading.Lock()
        self._cursors: list[Any] = []
        self._remote: Any = None  # flywheel.store_share.Client when another process owns the file
        self._share: Any = None  # flywheel.store_share.Owner registration when this one serves it
        self.con: Any = None
        self._wcon: duckdb.DuckDBPyConnection | None = None
        self._closed = False
        self._attach(time.monotonic() + open_timeout_s)

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def is_owner(self) -> bool:
        """True when this process holds the DuckDB file (else it talks to the process that does)."""
        return self._remote is None and self.con is not None

    # -- opening -----------------------------------------------------------------------------
    def _attach(self, deadline: float) -> None:
        """Open the file, or connect to the flywheel process that holds it; wait (bounded) for a holder
        that serves nobody or for an owner that is still starting."""
        # store_share imports store: at module level this would be a cycle
        from flywheel.store.share import Client, socket_path

        sock = socket_path(self.path)
        delay = 0.02
        while True:
            holder = self._open_local()
            if holder is None:
                return
            client = Client.connect(sock)
            if client is not None:
                self._remote = client
                self.con = client.connection(read_only=self.read_only)
                return
            if time.monotonic() >= deadline:
                pid, exe = holder
                who = f"process {pid}" + (f" ({exe})" if exe else "") if pid != "?" else "another process"
                stop = f"stop it (kill {pid})" if pid != "?" else "stop it (`fuser` names it)"
                raise StoreLockedError(
                    f"warehouse {self.path} is held by {who}, which does not share it (not a "
                    f"flywheel store, or one opened read-only); waited {self.open_timeout_s:.0f} s. Wait for "
                    f"that process to finish or {stop}; flywheel processes share the file "
                    f"between them, and `flywheel warehouse export DIR` works from any of them."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _open_local(self) -> tuple[str, str] | None:
        """Open the DuckDB file in this process; on a lock held elsewhere return (pid, exe) of the holder."""
        try:
            con = self._connect(self._recover_wal)
        except duckdb.IOException as e:
            holder = _lock_holder(str(e))
            if holder is not None:
                return holder
            raise
        self.con = con
        self._wcon = None if self.read_only else con.cursor()
        if not self.read_only:
            for p in (self.path, Path(str(self.path) + ".wal")):
                if p.exists():
                    os.chmod(p, 0o600)
            # DuckDB checkpoints (rewrites the WAL into the file) once the WAL passes the threshold,
            # 16 MiB by default: that is every bulk append of 100k events, and checkpointing each one
            # cost ~0.4 s per 1M events. With 256 MiB the WAL replays in about a second after a crash.
            self.con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_THRESHOLD}'")
            self._migrate()
            with self._lock:  # another process may have appended while this one did not hold the file
                self._index.reset()
            if self._serve:
                # store_share imports store: at module level this would be a cycle
                from flywheel.store.share import Owner

                self._share = Owner.register(self.path)
        return None

    def _connect(self, recover_wal: bool) -> duckdb.DuckDBPyConnection:
        try:
            return duckdb.connect(str(self.path), read_only=self.read_only)
        except duckdb.IOException as e:
            if _LOCK_RE.search(str(e)):
                raise
            return self._connect_failed(e, recover_wal)
        except duckdb.Error as e:
            return self._connect_failed(e, recover_wal)

    def _connect_failed(self, e: Exception, recover_wal: bool) -> duckdb.DuckDBPyConnection:
        wal = Path(str(self.path) + ".wal")
        if not (recover_wal and wal.exists()):
            if wal.exists():
                raise StoreError(
                    f"DuckDB could not open {self.path} ({e}). If it failed while replaying its write-ahead "
                    f"log, run `flywheel warehouse recover` to set {wal.name} aside and open without it."
                ) from None
            raise e
        aside = wal.with_name(f"{wal.name}.unreplayed-{time.strftime('%Y%m%dT%H%M%S')}")
        wal.rename(aside)
        self.recovered_wal = aside
        import warnings

        warnings.warn(
            f"WAL of {self.path} could not be replayed ({e}); moved to {aside}. Transactions committed "
            f"after the last checkpoint are NOT in the store; re-run the stages that produced them.",
            stacklevel=4,
        )
        return duckdb.connect(str(self.path), read_only=self.read_only)

    def _migrate(self) -> None:
        con = self._wcon
        assert con is not None
        with self._lock:
            con.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMPTZ DEFAULT now())"
            )
            done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
            for version, name, script in _migrations():
                if version in done:
                    continue
                with self.transaction():
                    for stmt in _split_sql(script):
                        con.execute(stmt)
                    con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [version, name])

    def _reattach(self) -> None:
        """The owner this process talked to went away: take the file over or find the new owner."""
        if self._remote is not None:
            self._remote.close()
        self._remote = None
        self.con = None
        self._attach(time.monotonic() + self.open_timeout_s)

    def _call_remote(self, fn: Any) -> Any:
        """Run ``fn(client)`` against the owner; on a lost owner, re-attach and retry (bounded)."""
        # store_share imports store: at module level this would be a cycle
        from flywheel.store.share import OwnerGone

        deadline = None  # counted from when the owner is first found gone, not from the request's start
        while True:
            if self._remote is None:
                return None  # this process owns the file now: the caller runs locally
            try:
                return fn(self._remote)
            except OwnerGone:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.open_timeout_s
                elif now >= deadline:
                    raise StoreUnavailableError(f"the process serving {self.path} went away and none took over") from None
                self._reattach()

    def _writable(self) -> duckdb.DuckDBPyConnection:
        if self._closed or (self.con is None and self._remote is None):
            raise StoreError(f"event store {self.path} is closed")
        if self.read_only:
            raise StoreError(f"event store {self.path} is open read-only; appends need a writable store")
        assert self._wcon is not None
        return self._wcon

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"event store {self.path} is closed")

    def _rcon(self) -> Any:
        """The connection for reads in the calling thread: through the owner in a client process; in the
        owning process, a cursor per thread (a DuckDB connection must not be used by two threads at once,
        and the owner's socket threads read beside the stages' threads)."""
        self._check_open()
        if self._remote is not None:
            return self.con
        cur = getattr(self._tls, "cur", None)
        if cur is None:
            with self._cursor_guard:
                cur = self.con.cursor()
                self._cursors.append(cur)
            self._tls.cur = cur
        return cur

    def _drop_thread_cursor(self) -> None:
        """Close the calling thread's read cursor (threads that end: the owner's socket threads)."""
        cur = getattr(self._tls, "cur", None)
        if cur is not None:
            del self._tls.cur
            with self._cursor_guard:
                if cur in self._cursors:
                    self._cursors.remove(cur)
            cur.close()

    def _q(self, sql: str, params: Any = None) -> list[tuple]:
        """Rows of a read query, in this process or through the owner (retried if the owner changes)."""
        while True:
            con = self._rcon()
            if self._remote is None:
                return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()
            rows = self._call_remote(lambda c: c.query(sql, params).rows())
            if rows is not None:
                return rows

    def _qa(self, sql: str, params: Any = None) -> pa.Table:
        while True:
            con = self._rcon()
            if self._remote is None:
                return con.sql(sql, params=params).to_arrow_table() if params is not None else con.sql(sql).to_arrow_table()
            t = self._call_remote(lambda c: c.query(sql, params).table)
            if t is not None:
                return t

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        if self._share is not None:
            self._share.release()
            self._share = None
        for cur in self._cursors:
            try:
                cur.close()
            except duckdb.Error:
                pass
        if self._wcon is not None:
            self._wcon.close()
            self._wcon = None
        if self.con is not None:
            self.con.close()
        self.con = None

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A write transaction on this process's write connection, under the per-file lock (appends of
        other threads and of the processes this one serves wait for it)."""
        with self._lock:
            con = self._writable()
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            else:
                con.execute("COMMIT")

    @contextmanager
    def memory_limit(self, mb: int) -> Iterator[None]:
        """Cap DuckDB's buffer pool while the block runs (owner only). DuckDB defaults to 80% of RAM and
        never gives pages back on its own: measured here, an ingest's peak RSS grew from 1.2 GB (10^5
        traces) to 2.0 GB (10^6) without a cap. The previous limit is restored afterwards."""
        if self._remote is not None or self.con is None:
            yield
            return
        con = self.con
        before = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        con.execute(f"SET memory_limit = '{int(mb)}MB'")
        try:
            yield
        finally:
            if self.con is not None:
                self.con.execute(f"SET memory_limit = '{before}'")

    # -- appending ---------------------------------------------------------------------------
    def append_batch(
        self,
        table: pa.Table,
        *,
        correlation_id: str | None = None,
        expected_versions: dict[str, int] | None = None,
        validated: bool = False,
    ) -> AppendResult:
        """Append many events (any streams) in one transaction, through Arrow.

        ``table`` has the columns of :data:`BATCH_SCHEMA`; ``payload`` must already be canonical JSON
        (:func:`canonical_json`, or polars' ``struct.json_encode`` over sorted keys) and is validated as
        JSON by DuckDB. Order within a stream follows row order; a row whose event_id appears earlier in
        the batch or is already recorded is skipped (counted in ``already_recorded``).

        ``expected_versions`` maps streams to the version the caller expects them to be at; it is
        checked only when something new would be appended (a fully recorded batch is a no-op), and a
        mismatch raises :class:`ConcurrencyError` with nothing appended.

        How the constraints hold without indexes (migration 002 explains why there are none): the
        whole append runs under the store's per-file lock in one transaction (appends of other
        processes arrive through the owner and take the same lock), so ``seq`` continues from
        ``max(seq)``, each stream continues from its current version, and an event is recognised as
        recorded by its id among the events of the batch's *existing* streams only (an event_id hashes
        its stream, so an event on a new stream cannot be recorded). :meth:`_append_locked` plans
        this in Arrow.
        """
        self._check_open()
        if table.num_rows == 0:
            return AppendResult()
        if self.read_only:
            raise StoreError(f"event store {self.path} is open read-only; appends need a writable store")
        batch = normalise_batch(table, validated)
        if self._remote is not None:
            res = self._call_remote(lambda c: c.append_batch(batch.drop_columns(["_i"]), correlation_id=correlation_id,
                                                               expected_versions=expected_versions))
            if res is not None:
                return res
        return self._append_local(batch, correlation_id, expected_versions)

    def _append_small_events(self, stream: str, events: list[NewEvent], correlation_id: str | None,
                             expected_versions: dict[str, int] | None) -> AppendResult | None:
        self._check_open()
        if self.read_only or self._remote is not None:
            return None  # the refusal, or the owner, is append_batch's
        rows = small_rows_of(stream, events)
        if rows is None:
            return None
        with self._lock:
            return self._append_small(self._writable(), rows, correlation_id, expected_versions)

    def _append_local(self, batch: pa.Table, correlation_id: str | None,
                      expected_versions: dict[str, int] | None) -> AppendResult:
        if batch.num_rows <= SMALL_APPEND:
            rows = _small_rows(batch)
            if rows is not None:
                with self._lock:
                    return self._append_small(self._writable(), rows, correlation_id, expected_versions)
        with self._lock:
            con = self._writable()
            con.register("_batch_in", batch)
            try:
                with self.transaction():
                    res = self._append_locked(con, batch, correlation_id, expected_versions)
                if res.last_seq is not None:
                    self._index.head = res.last_seq  # the index catches up from the events when next used
                return res
            except (duckdb.ConversionException, duckdb.InvalidInputException) as e:
                if "JSON" in str(e):  # the entity ids are read before the insert: as InvalidInput there
                    raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None
                raise
            finally:
                for name in ("_batch_in", "_batch_ids", "_batch_plan"):
                    _unregister(con, name)

    def _append_small(self, con: duckdb.DuckDBPyConnection, rows: list[_SmallRow], correlation_id: str | None,
                      expected_versions: dict[str, int] | None) -> AppendResult:
        """The append of a few events (what stages do between batches): planned from the in-memory
        head index (:mod:`flywheel.store_index`: no scans), then one ``BEGIN; ...; COMMIT`` of the
        inserts as literals. Same plan and projections as :meth:`_append_locked` (Arrow path), which
        costs ~10 queries whatever the batch size."""
        idx = self._index
        base = idx.sync(con)
        # Names first, in the order the batch mentions them: a name whose node id another name holds
        # (a 64-bit collision) refuses the rows that mention it, before anything is planned.
        names: dict[str, int] = {}
        for r in rows:
            names.setdefault(r.entity, r.node)
            for c, p in zip(r.causation, r.parents, strict=True):
                if c is not None:
                    names.setdefault(c, p)
        add: dict[str, int] = {}
        held: list[tuple[int, str]] = []
        for name, node in names.items():
            state = idx.name_state(name, node)
            if state == "new":
                add[name] = node
            elif state == "clash":
                held += con.execute("SELECT node, name FROM entity_names WHERE node = ?", [node]).fetchall()
        rejected: dict[int, dict[str, Any]] = {}
        if held or len(set(names.values())) != len(names):
            clashes = EventStore._check_node_ids(
                pa.table({"name": list(names), "node": pa.array(list(names.values()), pa.uint64())}), held)
            if clashes:
                rejected = EventStore._rejected_rows([r.stream for r in rows], [r.type for r in rows],
                                                     [r.event_id for r in rows], [r.entity for r in rows],
                                                     [r.causation for r in rows], clashes)
                rows = [r for k, r in enumerate(rows) if k not in rejected]
                mentioned = {n for r in rows for n in (r.entity, *r.causation)}
                add = {n: v for n, v in add.items() if n in mentioned}
                expected_versions = expected_of(expected_versions, {r.stream for r in rows})
        known = {}
        for st in {r.stream for r in rows}:
            v = idx.stream_version(st)
            if v:
                known[st] = (v, set(idx.recorded([r.event_id for r in rows if r.stream == st])))
        keep, versions = plan_small(rows, known, expected_versions)
        n_new = len(versions)
        result = AppendResult(appended=n_new, already_recorded=len(rows) - n_new, rejected=list(rejected.values()))
        if n_new == 0:
            return result
        fresh = [r for r, k in zip(rows, keep, strict=True) if k]
        stmts = ["BEGIN TRANSACTION"]
        corr = _lit(correlation_id)
        values = []
        entities: dict[int, list[int]] = {}
        links: dict[tuple[int, int], int] = {}
        heads: dict[str, int] = {}
        parents_of: dict[int, set[int]] = {}
        for k, (r, version) in enumerate(zip(fresh, versions, strict=True)):
            seq = base + 1 + k
            heads[r.stream] = version
            cause = "[" + ", ".join(_lit(c) for c in r.causation) + "]::VARCHAR[]"
            sv = CATALOG[r.type].schema_version if r.type in CATALOG else 1
            values.append(f"({seq}, '{r.event_id}', {_lit(r.stream)}, {version}, {_lit(r.type)}, {_lit(r.payload)}::JSON, "
                          f"{cause}, {corr}, now(), {sv})")
            e = entities.setdefault(r.node, [seq, seq, 0])
            e[1], e[2] = seq, e[2] + 1
            for name, parent in zip(r.causation, r.parents, strict=True):
                if name is not None and name != r.entity:
                    if r.node not in parents_of:
                        parents_of[r.node] = idx.parents(r.node) if idx.entity_exists(r.node) else set()
                    if parent not in parents_of[r.node]:
                        links.setdefault((r.node, parent), seq)
        old_entities = {n for n in entities if idx.entity_exists(n)}
        stmts.append("INSERT INTO events VALUES " + ", ".join(values))
        if add:
            stmts.append("INSERT INTO entity_names VALUES " + ", ".join(f"({n}, {_lit(x)})" for x, n in sorted(add.items(), key=lambda i: i[1])))
        ins = [f"({n}, {a}, {b}, {c})" for n, (a, b, c) in entities.items() if n not in old_entities]
        if ins:
            stmts.append("INSERT INTO entity_index VALUES " + ", ".join(ins))
        for n, (_a, b, c) in entities.items():
            if n in old_entities:
                stmts.append(f"UPDATE entity_index SET last_seq = {b}, n_events = n_events + {c} WHERE node = {n}")
        if links:
            stmts.append("INSERT INTO lineage_links VALUES " + ", ".join(f"({c}, {p}, {q})" for (c, p), q in links.items()))
        stmts.append("COMMIT")
        try:
            con.execute(";\n".join(stmts))
        except duckdb.Error as e:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            if isinstance(e, duckdb.ConversionException) and "JSON" in str(e):
                raise InvalidEventError(f"append_batch: a payload is not valid JSON ({e}); nothing was appended") from None
            raise
        result.first_seq, result.last_seq = base + 1, base + n_new
        result.event_ids = [r.event_id for r in fresh]
        idx.record(base + n_new, heads, result.event_ids, add, [n for n in entities if n not in old_entities], links)
        return result

    def _append_locked(
        self,
        con: duckdb.DuckDBPyConnection,
        batch: pa.Table,
        correlation_id: str | None,
        expected_versions: dict[str, int] | None,
    ) -> AppendResult:
        """Plan the append in Arrow (which rows are fresh, their seq and stream versions), then insert.

        Five queries whatever the batch: the event ids, entity ids and node ids (sha256 and md5 in
        DuckDB), the batch's names with the store's names that hold their node ids, the batch's
        streams that exist already with their versions and the batch's events they hold, and the
        INSERT. The rest is vectorised Arrow/numpy (:func:`plan_append`); the SQL windows and
        anti-joins this replaces cost ~0.2 s per 50k.

        A name whose node id another name holds (a 64-bit MD5 prefix collision; the store's name, or
        the batch's first, keeps it) refuses every row that mentions it, and the other rows of those
        rows' streams, before anything is planned: they are reported in ``AppendResult.rejected``
        and the rest of the batch is appended (:meth:`EventStore._rejected_rows`).
        """
        base = con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchall()[0][0]
        # No ORDER BY (a sort of the batch): DuckDB keeps the scan's order (preserve_insertion_order),
        # and the check below sorts only if it ever did not. The entity and node ids are computed here,
        # once: the collision check needs them before the insert, and the projections reuse them.
        ids = con.sql(
            f"SELECT event_id, _i, entity, {_NODE_SQL.format('entity')} AS node FROM "
            f"(SELECT {event_id_sql()} AS event_id, _i, {_ENTITY_SQL} AS entity FROM _batch_in)").to_arrow_table()
        if pc.any(pc.not_equal(ids.column("_i"), batch.column("_i"))).as_py():
            ids = ids.sort_by("_i")
        con.register("_batch_ids", ids)
        try:
            # Every name of the batch (entities and causation) with its node id and first row, and the
            # store's names that hold those node ids (for the collision check, and so that only new
            # names are recorded).
            names = con.sql(
                f"""
                WITH c AS (SELECT name, min(i) AS row FROM (SELECT unnest(causation) AS name, _i AS i FROM _batch_in)
                           WHERE name IS NOT NULL GROUP BY name)
                SELECT name, any_value(node) AS node, min(row) AS row FROM (
                    SELECT entity AS name, node, _i AS row FROM _batch_ids
                    UNION ALL SELECT name, {_NODE_SQL.format("name")}, row FROM c)
                GROUP BY name
                """
            ).to_arrow_table()
            con.register("_names", names)
            try:
                held = con.execute("SELECT n.node, n.name FROM entity_names n SEMI JOIN _names b ON n.node = b.node").fetchall()
            finally:
                _unregister(con, "_names")
            # A stored name that is not among the batch's names holds one of their node ids: a collision.
            held_names = pa.array([x for _, x in held], pa.string())
            clashes = EventStore._check_node_ids(names, held) if (
                held and not pc.all(pc.is_in(held_names, value_set=names.column("name"))).as_py()
            ) or pc.count_distinct(names.column("node")).as_py() != names.num_rows else {}
            rejected: dict[int, dict[str, Any]] = {}
            if clashes:
                rejected = EventStore._rejected_rows(
                    *(batch.column(c).to_pylist() for c in ("stream", "type")), ids.column("event_id").to_pylist(),
                    ids.column("entity").to_pylist(), batch.column("causation").to_pylist(), clashes)
                keep = np.ones(batch.num_rows, dtype=bool)
                keep[list(rejected)] = False
                batch, ids = batch.filter(pa.array(keep)), ids.filter(pa.array(keep))
                for name, t in (("_batch_in", batch), ("_batch_ids", ids)):
                    _unregister(con, name)
                    con.register(name, t)
                names = names.filter(pc.invert(pc.is_in(names.column("name"), value_set=pa.array(list(clashes), pa.string()))))
                if batch.num_rows:  # only the names the rows that remain mention
                    mentioned = pa.concat_arrays([ids.column("entity").combine_chunks(),
                                                  pc.list_flatten(batch.column("causation").combine_chunks())])
                    names = names.filter(pc.is_in(names.column("name"), value_set=mentioned))
                expected_versions = expected_of(expected_versions, set(batch.column("stream").to_pylist()))
            # Streams of the batch that exist already: their versions, and which of the batch's event
            # ids they hold (an event_id hashes its stream, so only these streams can hold one). One
            # scan of events.stream; in the bulk case (new traces) it returns nothing.
            known = con.sql(
                """
                SELECT e.stream, max(e.stream_version) AS version,
                       list(e.event_id) FILTER (WHERE e.event_id IN (SELECT event_id FROM _batch_ids)) AS held
                FROM events e SEMI JOIN _batch_in b ON e.stream = b.stream
                GROUP BY e.stream
                """
            ).to_arrow_table() if batch.num_rows else None
        finally:
            _unregister(con, "_batch_ids")
        n_rows = batch.num_rows
        result = AppendResult(already_recorded=0, rejected=list(rejected.values()))
        if n_rows == 0:
            return result
        event_ids = ids.column("event_id")
        held_ids = pc.list_flatten(known.column("held")) if known.num_rows else None
        plan = plan_append(batch.column("stream"), event_ids, known.column("stream"), known.column("version"), held_ids,
                           expected_versions)
        n_new = plan.n_new
        result.appended, result.already_recorded = n_new, n_rows - n_new
        if n_new == 0:
            return result
        mask = pa.array(plan.fresh)
        rows = batch.filter(mask) if n_new < n_rows else batch
        fresh_ids = ids.filter(mask) if n_new < n_rows else ids
        new_ids = fresh_ids.column("event_id")
        seq = pa.array(np.arange(base + 1, base + 1 + n_new, dtype=np.int64))
        planned = rows.append_column("seq", seq)
        planned = planned.append_column("event_id", new_ids).append_column("stream_version", pa.array(plan.versions))
        con.register("_batch_plan", planned)
        try:
            con.execute(
                f"""
                INSERT INTO events
                SELECT b.seq, b.event_id, b.stream, b.stream_version, b.type, b.payload::JSON,
                       coalesce(b.causation, []::VARCHAR[]), $corr::VARCHAR, now(), {_SCHEMA_VERSION_SQL}
                FROM _batch_plan b
                """,
                {"corr": correlation_id},
            ).fetchall()
        finally:
            _unregister(con, "_batch_plan")
        held_nodes = pa.array([n for n, _ in held], pa.uint64())
        new_names = names.filter(pc.invert(pc.is_in(names.column("node"), value_set=held_nodes))) if held else names
        new = pa.table({"seq": seq, "entity_id": fresh_ids.column("entity"), "node": fresh_ids.column("node"),
                        "causation": pc.fill_null(rows.column("causation"), pa.scalar([], pa.list_(pa.string())))})
        self._project(con, base, new, new_names.select(["node", "name"]))
        result.first_seq, result.last_seq = base + 1, base + n_new
        if n_new <= 10_000:
            result.event_ids = new_ids.to_pylist()
        return result

    # Projections: one code path used both incrementally (over the events after ``after_seq``) and on
    # rebuild (``after_seq=0`` over emptied tables), so the two cannot drift apart. Everything is keyed
    # by node id (:func:`node_id`, migration 003).
    @staticmethod
    def _project(con: duckdb.DuckDBPyConnection, after_seq: int, new: pa.Table | None = None,
                 new_names: pa.Table | None = None) -> None:
        """Project the events after ``after_seq``. An append passes what it computed already: ``new``
        (seq, entity_id, node, causation of its events) and ``new_names`` (node, name: its names the
        store did not hold, checked for collisions); a rebuild reads the events."""
        after = int(after_seq)
        if new is None:
            # The new events' entity ids and node ids, computed once for all projections.
            new = con.sql(
                f"""
                SELECT seq, entity_id, {_NODE_SQL.format("entity_id")} AS node, causation
                FROM (SELECT seq, {_ENTITY_SQL} AS entity_id, causation FROM events WHERE seq > {after})
                """
            ).to_arrow_table()
        if new.num_rows == 0:
            return
        con.register("_new_events", new)
        try:
            if new_names is None:
                DuckDBEventStore._project_names(con)
            elif new_names.num_rows:
                con.register("_names", new_names)
                try:
                    con.execute("INSERT INTO entity_names SELECT node, name FROM _names")
                finally:
                    con.unregister("_names")
            updated = DuckDBEventStore._project_entities(con, new)
            DuckDBEventStore._project_lineage(con, updated)
        finally:
            con.unregister("_new_events")

    @staticmethod
    def _project_names(con: duckdb.DuckDBPyConnection) -> None:
        """entity_names: every entity id and every name in a causation, once (an anti-join on ids)."""
        names = con.sql(
            f"""
            SELECT entity_id AS name, node FROM _new_events
            UNION
            SELECT name, {_NODE_SQL.format("name")}
            FROM (SELECT DISTINCT unnest(causation) AS name FROM _new_events) WHERE name IS NOT NULL
            """
        ).to_arrow_table()
        con.register("_names", names)
        try:
            known = con.execute(
                "SELECT n.node, n.name FROM entity_names n SEMI JOIN _names b ON n.node = b.node"
            ).fetchall()
            clashes = EventStore._check_node_ids(names, known)
            if clashes:  # the events were recorded: a rebuild cannot refuse some of them
                name, (other, node) = next(iter(clashes.items()))
                raise StoreError(EventStore._collision_message(name, other, node) + " (the projections were not rebuilt)")
            con.execute(
                "INSERT INTO entity_names SELECT b.node, b.name FROM _names b ANTI JOIN entity_names n ON n.node = b.node"
            )
        finally:
            con.unregister("_names")

    @staticmethod
    def _project_entities(con: duckdb.DuckDBPyConnection, new: pa.Table) -> bool:
        """entity_index; returns whether an entity of the batch existed before it."""
        # The entities of the batch that exist already are looked up first (a semi-join on 64-bit ids);
        # when there are none (the bulk case: new traces) the new rows are inserted as they are, else
        # one MERGE updates and inserts (a MERGE costs ~3x the INSERT per 100k rows). When every entity
        # has one event in the batch, its row needs no aggregation.
        one_each = pc.count_distinct(new.column("node")).as_py() == new.num_rows
        rows = (
            "SELECT node, seq AS first_seq, seq AS last_seq, 1::BIGINT AS n_events FROM _new_events"
            if one_each
            else "SELECT node, min(seq) AS first_seq, max(seq) AS last_seq, count(*) AS n_events "
            "FROM _new_events GROUP BY node"
        )
        n_old = con.execute(
            "SELECT count(*) FROM entity_index i SEMI JOIN _new_events n ON i.node = n.node"
        ).fetchall()[0][0]
        if n_old == 0:
            con.execute(f"INSERT INTO entity_index {rows}")
            return False
        con.execute(
            f"""
            MERGE INTO entity_index USING ({rows}) n ON entity_index.node = n.node
            WHEN MATCHED THEN UPDATE SET last_seq = n.last_seq, n_events = entity_index.n_events + n.n_events
            WHEN NOT MATCHED THEN INSERT VALUES (n.node, n.first_seq, n.last_seq, n.n_events)
            """
        )
        return True

    @staticmethod
    def _project_lineage(con: duckdb.DuckDBPyConnection, any_old_entity: bool) -> None:
        """lineage_links: one row per (child, parent) node pair, from each event's causation."""
        edges = f"""
            SELECT child, {_NODE_SQL.format("parent")} AS parent, seq FROM (
                SELECT child, parent, min(seq) AS seq FROM (
                    SELECT node AS child, entity_id, unnest(causation) AS parent, seq FROM _new_events
                ) WHERE parent IS NOT NULL AND parent <> entity_id
                GROUP BY child, parent
            )
        """
        if not any_old_entity:
            # An edge can already exist only if its child entity existed before this batch.
            con.execute(f"INSERT INTO lineage_links {edges}")
            return
        con.execute(
            f"""
            INSERT INTO lineage_links
            WITH n AS ({edges}),
            old AS (SELECT l.child, l.parent FROM lineage_links l SEMI JOIN _new_events e ON l.child = e.node)
            SELECT n.* FROM n ANTI JOIN old ON old.child = n.child AND old.parent = n.parent
            """
        )

    def rebuild_projections(self) -> dict[str, int]:
        """Drop and recompute every projection from the events alone."""
        self._check_open()
        if self._remote is not None:
            res = self._call_remote(lambda c: c.call("rebuild"))
            if res is not None:
                return res
        with self._lock:
            self._index.reset()  # it mirrors the projections, which are about to be replaced
            with self.transaction() as con:
                for t in ("entity_index", "lineage_links", "entity_names"):
                    con.execute(f"DELETE FROM {t}")
                self._project(con, 0)
        return self.projection_counts()

    def check_integrity(self) -> list[str]:
        """The invariants the append transaction keeps without indexes; returns violations (empty = ok).

        seq is 1..n without gaps or repeats; event_id is unique; every
        stream's versions are 1..k; ``entity_index`` agrees with the events; no projection row is
        duplicated; node ids are their names' and unique; every entity and edge has a name.
        """
        checks = {
            "seq is not 1..n": "SELECT count(*) <> count(DISTINCT seq) OR coalesce(max(seq), 0) <> count(*) FROM events",
            "duplicate event_id": "SELECT count(*) <> count(DISTINCT event_id) FROM events",
            "stream versions not contiguous from 1": """
                SELECT count(*) > 0 FROM (SELECT stream, count(*) n, count(DISTINCT stream_version) d,
                       min(stream_version) lo, max(stream_version) hi FROM events GROUP BY stream)
                WHERE n <> d OR lo <> 1 OR hi <> n""",
            "entity_index disagrees with events": f"""
                SELECT count(*) > 0 FROM (
                    SELECT {_NODE_SQL.format(_ENTITY_SQL)} AS node,
                           min(seq) AS first_seq, max(seq) AS last_seq, count(*) AS n_events
                    FROM events GROUP BY 1) e
                FULL JOIN entity_index i USING (node)
                WHERE (e.first_seq, e.last_seq, e.n_events) IS DISTINCT FROM (i.first_seq, i.last_seq, i.n_events)""",
            "duplicate entity rows": "SELECT count(*) <> count(DISTINCT node) FROM entity_index",
            "duplicate lineage edges": "SELECT count(*) <> count(DISTINCT (child, parent)) FROM lineage_links",
            "entity names or node ids not unique, or a node id not its name's": f"""
                SELECT count(*) <> count(DISTINCT node) OR count(*) <> count(DISTINCT name)
                       OR bool_or(node <> {_NODE_SQL.format("name")}) FROM entity_names""",
            "an entity or lineage edge without a name": """
                SELECT count(*) > 0 FROM (
                    SELECT node FROM entity_index UNION ALL SELECT child FROM lineage_links
                    UNION ALL SELECT parent FROM lineage_links
                ) x ANTI JOIN entity_names n ON n.node = x.node""",
        }
        return [name for name, sql in checks.items() if self._q(sql)[0][0]]

    def projection_counts(self) -> dict[str, int]:
        tables = {"events": "events", "streams": "streams", "entities": "entity_index", "lineage_edges": "lineage_links"}
        return {name: self._q(f"SELECT count(*) FROM {t}")[0][0] for name, t in tables.items()}

    def projection_rows(self) -> dict[str, list[tuple]]:
        """Every row of the projections as people read them (``streams``, ``entities``,
        ``lineage_edges``), sorted, with JSON as text: what rebuilt == incremental compares."""
        return {
            "streams": [tuple(r) for r in self._q("SELECT stream, version FROM streams ORDER BY ALL")],
            "entities": [tuple(r) for r in self._q(
                "SELECT entity_id, kind, stream, last_type, first_seq, last_seq, n_events, state::VARCHAR "
                "FROM entities ORDER BY ALL")],
            "lineage_edges": [tuple(r) for r in self._q("SELECT child, parent, seq FROM lineage_edges ORDER BY ALL")],
        }

    # -- reading -----------------------------------------------------------------------------
    def stream_version(self, stream: str) -> int:
        return self._q("SELECT coalesce(max(stream_version), 0) FROM events WHERE stream = ?", [stream])[0][0]

    def read(
        self,
        stream: str | None = None,
        types: Sequence[str] | str | None = None,
        after_seq: int | None = None,
        limit: int | None = None,
        correlation_id: str | None = None,
        newest_first: bool = False,
    ) -> list[Event]:
        where, params = self._where(stream, types, after_seq, correlation_id)
        sql = (
            "SELECT seq, event_id, stream, stream_version, type, payload, causation, correlation_id, "
            f"recorded_at, schema_version FROM events {where} ORDER BY seq {'DESC' if newest_first else ''}"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return [self._event_from_row(r) for r in self._q(sql, params)]

    def read_arrow(self, stream=None, types=None, after_seq=None, correlation_id=None, limit: int | None = None) -> pa.Table:
        where, params = self._where(stream, types, after_seq, correlation_id)
        sql = f"SELECT * FROM events {where} ORDER BY seq"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self._qa(sql, params)

    @staticmethod
    def _where(stream, types, after_seq, correlation_id) -> tuple[str, list[Any]]:
        clauses, params = [], []
        if stream is not None:
            if stream.endswith("*"):
                clauses.append("starts_with(stream, ?)")
                params.append(stream[:-1])
            else:
                clauses.append("stream = ?")
                params.append(stream)
        if types:
            types = [types] if isinstance(types, str) else list(types)
            clauses.append(f"type IN ({', '.join('?' for _ in types)})")
            params.extend(types)
        if after_seq is not None:
            clauses.append("seq > ?")
            params.append(after_seq)
        if correlation_id is not None:
            clauses.append("correlation_id = ?")
            params.append(correlation_id)
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", params

    def entity(self, entity_id: str) -> dict[str, Any] | None:
        row = self._q(
            f"""
            SELECT ?::VARCHAR, split_part(?::VARCHAR, ':', 1), e.stream, e.type, i.first_seq, i.last_seq,
                   i.n_events, e.payload
            FROM entity_index i JOIN events e ON e.seq = i.last_seq
            JOIN entity_names n ON n.node = i.node AND n.name = ?::VARCHAR
            WHERE i.node = {_NODE_SQL.format("?::VARCHAR")}
            """,
            [entity_id, entity_id, entity_id, entity_id],
        )  # the name too: another name may hold this node id (a collision the append refused)
        if not row:
            return None
        keys = ["entity_id", "kind", "stream", "last_type", "first_seq", "last_seq", "n_events", "state"]
        out = dict(zip(keys, row[0], strict=True))
        out["state"] = json.loads(out["state"])
        return out

    def entities(self, kind: str, *, last_type: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT entity_id, last_type, state, first_seq, last_seq FROM entities WHERE kind = ?"
        params: list[Any] = [kind]
        if last_type:
            sql += " AND last_type = ?"
            params.append(last_type)
        sql += " ORDER BY first_seq"
        return [
            {"entity_id": r[0], "last_type": r[1], "state": json.loads(r[2]), "first_seq": r[3], "last_seq": r[4]}
            for r in self._q(sql, params)
        ]

    def counts_by_kind(self) -> dict[str, int]:
        return dict(
            self._q(
                "SELECT split_part(n.name, ':', 1) AS kind, count(*) FROM entity_index i "
                "JOIN entity_names n ON n.node = i.node GROUP BY kind ORDER BY kind"
            )
        )

    def last_seq(self) -> int:
        return self._q("SELECT coalesce(max(seq), 0) FROM events")[0][0]

    # -- queries the stages need (one per question, so both backends can answer it) -----------------
    def latest_entity_id(self, prefix: str) -> str | None:
        """The entity id starting with ``prefix`` (e.g. ``suite:heldout@``) whose latest event is newest."""
        kind = prefix.split(":", 1)[0]
        rows = self._q(
            "SELECT entity_id FROM entities WHERE kind = ? AND starts_with(entity_id, ?) ORDER BY last_seq DESC LIMIT 1",
            [kind, prefix],
        )
        return rows[0][0] if rows else None

    def event_stats(self, types: Sequence[str], after_seq: int = 0) -> tuple[int, int]:
        """(number of events of these types after ``after_seq``, their largest seq or 0)."""
        types = list(types)
        rows = self._q(
            f"SELECT count(*), coalesce(max(seq), 0) FROM events WHERE type IN ({', '.join('?' for _ in types)}) "
            "AND seq > ?",
            [*types, int(after_seq)],
        )
        return int(rows[0][0]), int(rows[0][1])

    def existing_streams(self, streams: Sequence[str] | pa.Array | pa.ChunkedArray) -> list[str]:
        """Which of ``streams`` hold at least one event."""
        values = streams if isinstance(streams, pa.Array | pa.ChunkedArray) else pa.array(list(streams), pa.string())
        if not len(values):
            return []
        return self._with_keys(values, "SELECT DISTINCT stream FROM events WHERE stream IN (SELECT k FROM _fw_keys)")

    def entity_heads(self, entity_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
        """For each of these entities that exists: its state (JSON text) and the version its latest
        event has in that event's stream (what an append that builds on the state expects)."""
        if not entity_ids:
            return {}
        rows = self._with_keys(pa.array(list(entity_ids), pa.string()),
                               "SELECT n.name, e.payload::VARCHAR, e.stream_version FROM entity_index i "
                               "JOIN entity_names n ON n.node = i.node JOIN events e ON e.seq = i.last_seq "
                               f"WHERE i.node IN (SELECT {_NODE_SQL.format('k')} FROM _fw_keys)", one=False)
        wanted = set(entity_ids)
        return {name: (state, int(v)) for name, state, v in rows if name in wanted}

    def _names_holding(self, nodes: list[int]) -> list[tuple[int, str]]:
        return [tuple(r) for r in self._q(
            "SELECT node, name FROM entity_names WHERE node IN (SELECT unnest(?::UBIGINT[]))", [nodes])]

    def _with_keys(self, keys: pa.Array | pa.ChunkedArray, sql: str, *, one: bool = True) -> list[Any]:
        if self._remote is not None:
            # No Arrow registration through the owner: the keys travel as a list literal parameter.
            inline = sql.replace("FROM _fw_keys)", "FROM (SELECT unnest(?::VARCHAR[]) AS k))")
            rows = self._q(inline, [keys.to_pylist()])
        else:
            con = self._rcon()
            con.register("_fw_keys", pa.table({"k": keys}))
            try:
                rows = con.execute(sql).fetchall()
            finally:
                con.unregister("_fw_keys")
        return [r[0] for r in rows] if one else [tuple(r) for r in rows]

    def trace_states(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        """``trace:`` entities whose latest event is ``trace.ingested`` with this outcome status, oldest
        first, with their states (filtered in SQL so the others' payloads are never parsed)."""
        rows = self._q(
            """
            SELECT entity_id, state::VARCHAR FROM entities
            WHERE kind = 'trace' AND last_type = 'trace.ingested' AND coalesce(
                json_extract_string(state, '$.status'),
                json_extract_string(state, '$.outcome.status'),
                json_extract_string(state, '$.trace.outcome.status')) = ?
            ORDER BY first_seq
            """,
            [status],
        )
        return [(r[0], json.loads(r[1])) for r in rows]

    def failure_kinds_by_day(self) -> list[tuple[str, str, int]]:
        """(day, failure kind, count) over ``trace.ingested`` failures, by the trace's own timestamp."""
        rows = self._q(
            """
            SELECT substr(json_extract_string(payload, '$.timestamp'), 1, 10) AS day, kind, count(*) AS n
            FROM (
                SELECT payload, unnest(CAST(json_extract(payload, '$.kinds') AS VARCHAR[])) AS kind
                FROM events WHERE type = 'trace.ingested' AND json_extract_string(payload, '$.status') = 'failure'
            ) GROUP BY ALL ORDER BY day, kind
            """
        )
        return [(r[0], r[1], int(r[2])) for r in rows]

    # -- lineage -----------------------------------------------------------------------------
    def lineage(self, entity_id: str, direction: str = "down", max_depth: int = 64) -> list[tuple[str, int]]:
        """Ancestors (``down``: what it was made from) or descendants (``up``: what it made)."""
        if direction not in ("down", "up"):
            raise ValueError("direction must be 'down' or 'up'")
        return [tuple(r) for r in self._q(_sql(f"queries/lineage_{direction}.sql"), [entity_id, max_depth])]

    def lineage_edges(self, entity_id: str, max_depth: int = 64) -> list[tuple[str, str]]:
        return [tuple(r) for r in self._q(_sql("queries/lineage_edges_down.sql"), [entity_id, max_depth])]

    # -- export ------------------------------------------------------------------------------
    def _table_batches(self, table: str) -> pa.RecordBatchReader:
        if table not in EXPORT_TABLES:
            raise ValueError(f"not an exported table: {table!r}")
        if self._remote is not None:
            return self._qa(f"SELECT * FROM {table}").to_reader()
        return self._rcon().sql(f"SELECT * FROM {table}").to_arrow_reader()


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

"""What every event store is: the :class:`EventStore` base class both backends implement, the records
it takes and gives (:class:`NewEvent`, :class:`Event`, :class:`AppendResult`, the Arrow
:data:`BATCH_SCHEMA`), its errors, and the helpers that do not depend on a backend.

``EventStore(location)`` opens the backend :mod:`flywheel.store.factory` picks for the location
(:func:`choose_backend_with`); the guarantees both backends keep are in :mod:`flywheel.store`.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import check_event
from flywheel.store import ids as store_ids
from flywheel.vocab.ids import canonical_json

ANY = None  # expected_version: no check
NO_STREAM = 0  # expected_version: the stream must not exist yet


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
    another name holds (:func:`~flywheel.store.ids.node_id`); nothing was appended. ``name`` is the refused name,
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



#: Query parameters handed to DuckDB or psycopg as they are: positional, or named for psycopg.
SqlParams = Sequence[object] | Mapping[str, object] | None


def is_postgres_url(location: object) -> bool:
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

# Batches up to this many rows take a backend's one-statement path (DuckDBEventStore._append_small).
SMALL_APPEND = 64


def checked_events(stream: str, events: Sequence[NewEvent]) -> list[tuple[str, str, list[str]]]:
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
    rows = checked_events(stream, events)
    return pa.table({"stream": [stream] * len(rows), "type": [r[0] for r in rows], "payload": [r[1] for r in rows],
                     "causation": [r[2] for r in rows]}, schema=BATCH_SCHEMA)



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


# What EventStore(location) opens: set by flywheel.store.factory when the package is imported (the
# backends import this module, so it cannot import them).
_backend_for: Callable[[Any], type[EventStore]] | None = None


def choose_backend_with(backend_for: Callable[[Any], type[EventStore]]) -> None:
    """Make ``EventStore(location)`` open ``backend_for(location)``, a backend class."""
    global _backend_for
    _backend_for = backend_for


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

    def __new__(cls, location: object = None, *args: Any, **kw: Any) -> EventStore:
        if cls is EventStore:
            if _backend_for is None:  # pragma: no cover - importing flywheel.store sets it
                raise StoreError("no event store backend is set: import flywheel.store")
            cls = _backend_for(location)
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
        node id (:func:`~flywheel.store.ids.node_id`; the store's name, or an earlier one of ``names``), each mapped to
        that other name. What a stage asks before it builds events on the names (ingest quarantines
        such a trace instead of sending it)."""
        values = names.to_pylist() if isinstance(names, pa.Array | pa.ChunkedArray) else list(names)
        values = list(dict.fromkeys(values))
        if not values:
            return {}
        nodes = [store_ids.node_id(n) for n in values]
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

    def lineage(self, entity_id: str, direction: str = "down", max_depth: int = 64) -> list[tuple[str, int]]:
        """Ancestors (``down``: what it was made from) or descendants (``up``: what it made), each with
        its shortest depth."""
        raise NotImplementedError  # pragma: no cover - every backend overrides

    def lineage_edges(self, entity_id: str, max_depth: int = 64) -> list[tuple[str, str]]:
        """The (child, parent) causation edges below ``entity_id``."""
        raise NotImplementedError  # pragma: no cover - every backend overrides

    def entity_states(self, entity_ids: Sequence[str]) -> dict[str, str]:
        """The current state (latest payload, JSON text) of each of these entities that exists."""
        return {k: v for k, (v, _) in self.entity_heads(entity_ids).items()}

    @contextmanager
    def memory_limit(self, mb: int) -> Iterator[None]:
        """Cap the store's buffer memory in this process while the block runs (embedded owner only;
        elsewhere a no-op)."""
        yield

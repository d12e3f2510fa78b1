"""An append batch before it is written, the same for both backends: normalised to
:data:`~flywheel.store.contract.BATCH_SCHEMA` and checked against the catalog, and planned (which rows
are new, which stream version each gets) in Arrow/numpy (:func:`plan_append`) or, for a few rows, in
plain Python (:class:`SmallRow`, :func:`plan_small`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import check_event
from flywheel.store import ids as store_ids
from flywheel.store.contract import BATCH_SCHEMA, ConcurrencyError, NewEvent, checked_events
from flywheel.store.ids import compute_event_id


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



@dataclass(frozen=True)
class SmallRow:
    """One event of a small append with its ids computed in Python (:func:`small_rows`)."""

    stream: str
    type: str
    payload: str
    causation: list[str | None]
    event_id: str
    entity: str
    node: int
    parents: list[int]



def _small_row(stream: str, type_: str, payload: str, doc: Any, causation: list[str | None]) -> SmallRow | None:
    entity = doc.get("entity_id") if isinstance(doc, dict) else None
    if entity is not None and not isinstance(entity, str):
        return None
    entity = stream if entity is None else entity  # as SQL's coalesce: an empty entity_id is one
    return SmallRow(stream, type_, payload, causation, compute_event_id(type_, stream, payload), entity,
                     store_ids.node_id(entity), [store_ids.node_id(c) if c is not None else 0 for c in causation])


def small_rows(batch: pa.Table) -> list[SmallRow] | None:
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


def small_rows_of(stream: str, events: Sequence[NewEvent]) -> list[SmallRow] | None:
    """:func:`small_rows` of ``events_table(stream, events)`` without going through Arrow (the same
    checks and errors); None when a row needs the Arrow path."""
    out = []
    for (type_, body, causation), ev in zip(checked_events(stream, events), events, strict=True):
        row = _small_row(stream, type_, body, ev.payload, causation)
        if row is None:
            return None
        out.append(row)
    return out


def plan_small(rows: Sequence[SmallRow], known: dict[str, tuple[int, set[str]]],
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

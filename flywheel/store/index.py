"""The embedded store's in-memory head index: what an append of a few events looks up, without scans.

An append of one event (what stages do between batches) must know the last ``seq``, its stream's
version and whether its event id is recorded, which of its names and entities exist, and which
lineage edges its entity has. The warehouse has no indexes (migration 002: an ART index on a random
64-bit key costs ~3 s per million appended rows here), so each of these was a scan: on a 1M-event
warehouse ~2 ms for a 64-bit column and ~35 ms for ``events.stream`` (measured, 2 cores, load ~6),
so one event cost 50 ms there. The process that owns the file is its only writer (DuckDB's file lock;
other processes append through it, :mod:`flywheel.store.share`), so it can keep these answers in
memory: :class:`HeadIndex`, one per warehouse file and process, looked up in microseconds.

Guarantees
- The index holds what the events and projections hold, read under the append lock: built on the
  first small append of the process (~1 s per million events here), then kept current by both append
  paths (a small append records what it wrote; after a bulk append the index reads the events it has
  not seen, and their projection rows, on its next use). Nothing of it is persisted: every open of the
  file by this process, and every rebuild of the projections, starts it afresh. Every write of the
  warehouse goes through these append paths (DuckDB's file lock keeps other processes out; they
  append through the owner).
- It answers exactly, never "probably": names, streams and event ids are keyed by 128 bits of their
  SHA-256 (event ids are 128 bits of SHA-256 already), so two of them can only be confused by a
  SHA-256 collision; entity ids are keyed by their node ids, which the append keeps unique per name.

Costs: ~90 bytes per event (1M events: ~90 MB), held only by a process that appended a small batch.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

import duckdb
import numpy as np

from flywheel.store import ids as store_ids

# Recent rows live in a dict; past this many keys they are frozen into a sorted run. Past this many
# runs, the runs are merged into one (an argsort of everything: ~60 ms per million keys here).
_RECENT_MAX = 4096
_MAX_RUNS = 8
_EVENT_ID_RE = re.compile(r"ev_[0-9a-f]{32}")


def digest128(text: str) -> tuple[int, int]:
    """128 bits of SHA-256 of the text (UTF-8) as two unsigned 64-bit integers (big-endian hex halves)."""
    h = hashlib.sha256(text.encode()).hexdigest()
    return int(h[:16], 16), int(h[16:32], 16)


def event_key(event_id: str) -> tuple[int, int]:
    """An event id as 128 bits: the id's own hex for ``ev_`` + 32 hex digits (what the store writes),
    else 128 bits of its SHA-256."""
    if _EVENT_ID_RE.fullmatch(event_id):
        return int(event_id[3:19], 16), int(event_id[19:35], 16)
    return digest128(event_id)


def _u64_halves_sql(hex_expr: str) -> str:
    return f"('0x' || substr({hex_expr}, 1, 16))::UBIGINT, ('0x' || substr({hex_expr}, 17, 16))::UBIGINT"


# The same keys in DuckDB SQL (event_key, digest128).
_EVENT_HEX_SQL = "CASE WHEN regexp_full_match(event_id, 'ev_[0-9a-f]{32}') THEN substr(event_id, 4, 32) ELSE sha256(event_id) END"


class KeyRuns:
    """A multimap from unsigned 64-bit keys to rows of ``width`` unsigned 64-bit values: sorted numpy
    runs plus a dict of recent rows. ``get`` returns every row ever added under the key."""

    def __init__(self, width: int, *, latest: bool = False):
        self.width = width
        # On merge, rows are deduplicated: identical rows once, or with ``latest`` one row per key and
        # leading columns, the one with the largest last column (stream heads keep their newest version).
        self.latest = latest
        self.keys: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.recent: dict[int, list[tuple[int, ...]]] = {}
        self.n_recent = 0

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys) + self.n_recent

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.vals, strict=True)) + 64 * self.n_recent

    def add(self, key: int, row: tuple[int, ...] = ()) -> None:
        self.recent.setdefault(key, []).append(row)
        self.n_recent += 1
        if self.n_recent > _RECENT_MAX:
            self._freeze()

    def add_many(self, keys: np.ndarray, rows: np.ndarray | None = None) -> None:
        if not len(keys):
            return
        keys = np.asarray(keys, dtype=np.uint64)
        rows = np.zeros((len(keys), 0), dtype=np.uint64) if rows is None else np.asarray(rows, dtype=np.uint64)
        if len(keys) > 1 and not bool(np.all(keys[1:] >= keys[:-1])):  # sorted already: no copy
            order = np.argsort(keys)
            keys, rows = keys[order], rows[order]
        self.keys.append(keys)
        self.vals.append(rows.reshape(len(keys), self.width))
        if len(self.keys) > _MAX_RUNS:
            self._merge()

    def get(self, key: int) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        k = np.uint64(key)
        for keys, vals in zip(self.keys, self.vals, strict=True):
            lo = int(np.searchsorted(keys, k, side="left"))
            if lo < len(keys) and keys[lo] == k:
                hi = int(np.searchsorted(keys, k, side="right"))
                out.extend(tuple(int(x) for x in r) for r in vals[lo:hi])
        out.extend(self.recent.get(key, ()))
        return out

    def _freeze(self) -> None:
        keys = np.fromiter((k for k, rows in self.recent.items() for _ in rows), dtype=np.uint64, count=self.n_recent)
        rows = np.array([r for rs in self.recent.values() for r in rs], dtype=np.uint64).reshape(self.n_recent, self.width)
        self.recent, self.n_recent = {}, 0
        self.add_many(keys, rows)

    def _merge(self) -> None:
        keys, vals = np.concatenate(self.keys), np.concatenate(self.vals)
        if len(keys):
            # lexsort: the last array given is the primary key.
            order = np.lexsort((*(vals[:, j] for j in reversed(range(self.width))), keys))
            keys, vals = keys[order], vals[order]
            same_next = keys[1:] == keys[:-1]
            for j in range(self.width - 1 if self.latest else self.width):
                same_next &= vals[1:, j] == vals[:-1, j]
            keep = np.r_[~same_next, True]
            keys, vals = keys[keep], vals[keep]
        self.keys, self.vals = [keys], [vals]


class HeadIndex:
    """What the small append looks up, for one warehouse file in one process (see the module docstring).

    ``synced``: the events 1..synced are in the index. ``head``: the store's last seq as this process
    last knew it (None: not known; read it). Callers hold the file's append lock.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.built = False
        self.synced = 0
        self.head: int | None = None
        self.streams = KeyRuns(2, latest=True)  # stream d1 -> (d2, version)
        self.events = KeyRuns(1)  # event key k1 -> (k2,)
        self.names = KeyRuns(2)  # node -> (d1, d2) of the name
        self.entities = KeyRuns(0)  # node of a recorded entity
        self.links = KeyRuns(1)  # child node -> (parent node,)

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in (self.streams, self.events, self.names, self.entities, self.links))

    # -- reading the store ------------------------------------------------------------------------
    def sync(self, con: duckdb.DuckDBPyConnection) -> int:
        """Bring the index up to the store's last seq (reading only the events it has not seen);
        returns that seq."""
        if self.head is None:
            self.head = con.execute("SELECT coalesce(max(seq), 0) FROM events").fetchall()[0][0]
        if self.synced < self.head or not self.built:
            self._catch_up(con, self.synced)
        return self.head

    def _catch_up(self, con: duckdb.DuckDBPyConnection, after: int) -> None:
        where = f"WHERE seq > {int(after)}"
        top = con.execute(f"SELECT coalesce(max(seq), {int(after)}) FROM events {where}").fetchall()[0][0]
        ev = con.execute(f"SELECT {_u64_halves_sql('h')} FROM (SELECT {_EVENT_HEX_SQL} AS h FROM events {where})").fetchnumpy()
        keys = list(ev.values())
        self.events.add_many(keys[0], np.column_stack([keys[1]]))
        st = con.execute(
            f"SELECT {_u64_halves_sql('h')}, v FROM (SELECT sha256(stream) AS h, max(stream_version)::UBIGINT AS v "
            f"FROM events {where} GROUP BY stream)"
        ).fetchnumpy()
        cols = list(st.values())
        self.streams.add_many(cols[0], np.column_stack([cols[1], cols[2]]))
        # Entities, edges and names as the projections hold them (so the small append writes exactly
        # what the Arrow path would): entity_index and lineage_links by seq; entity_names has no seq,
        # so after a first full read the names come from the new events (the names they record).
        en = con.execute(f"SELECT node FROM entity_index WHERE first_seq > {int(after)}").fetchnumpy()
        self.entities.add_many(en["node"])
        ln = con.execute(f"SELECT child, parent FROM lineage_links WHERE seq > {int(after)}").fetchnumpy()
        self.links.add_many(ln["child"], np.column_stack([ln["parent"]]))
        if after == 0:
            nm = con.execute(f"SELECT node, {_u64_halves_sql('h')} FROM (SELECT node, sha256(name) AS h FROM entity_names)").fetchnumpy()
        else:
            nm = con.execute(
                f"""
                WITH e AS (SELECT {store_ids.ENTITY_SQL} AS entity, causation FROM events {where})
                SELECT node, {_u64_halves_sql('h')} FROM (
                    SELECT {store_ids.NODE_SQL.format('name')} AS node, sha256(name) AS h FROM (
                        SELECT entity AS name FROM e UNION SELECT unnest(causation) FROM e) WHERE name IS NOT NULL)
                """
            ).fetchnumpy()
        cols = list(nm.values())
        self.names.add_many(cols[0], np.column_stack([cols[1], cols[2]]))
        self.synced = self.head = top
        self.built = True

    # -- answers ----------------------------------------------------------------------------------
    def stream_version(self, stream: str) -> int:
        d1, d2 = digest128(stream)
        return max((v for s2, v in self.streams.get(d1) if s2 == d2), default=0)

    def recorded(self, event_ids: Iterable[str]) -> list[str]:
        out = []
        for eid in event_ids:
            k1, k2 = event_key(eid)
            if any(r[0] == k2 for r in self.events.get(k1)):
                out.append(eid)
        return out

    def name_state(self, name: str, node: int) -> str:
        """``known`` (this name is recorded), ``new``, or ``clash`` (another name has this node id)."""
        rows = self.names.get(node)
        if not rows:
            return "new"
        return "known" if digest128(name) in rows else "clash"

    def entity_exists(self, node: int) -> bool:
        return bool(self.entities.get(node))

    def parents(self, child: int) -> set[int]:
        return {r[0] for r in self.links.get(child)}

    # -- after a committed small append ----------------------------------------------------------
    def record(self, last_seq: int, streams: dict[str, int], event_ids: Sequence[str], names: dict[str, int],
               entities: Iterable[int], links: Iterable[tuple[int, int]]) -> None:
        """Add what a committed append wrote (its streams' new versions, event ids, new names, new
        entities, new edges); the index is then synced up to ``last_seq``."""
        for stream, version in streams.items():
            d1, d2 = digest128(stream)
            self.streams.add(d1, (d2, version))
        for eid in event_ids:
            k1, k2 = event_key(eid)
            self.events.add(k1, (k2,))
        for name, node in names.items():
            self.names.add(node, digest128(name))
        for node in entities:
            self.entities.add(node)
        for child, parent in links:
            self.links.add(child, (parent,))
        self.synced = self.head = last_seq

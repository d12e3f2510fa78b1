"""Hypothesis stateful test: the event store against an in-memory model.

Rules append (single events and Arrow batches, with right, wrong and no expected versions, fresh and
duplicate payloads), read and rebuild. Invariants after every step: versions contiguous per stream,
no duplicate event_id, every acknowledged append readable exactly as acknowledged, and projections
equal to what a rebuild from events produces. The machine runs on both backends: the embedded DuckDB
file and a PostgreSQL database (a fresh one per example, on the session's server).
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flywheel.store import (
    BATCH_SCHEMA,
    ConcurrencyError,
    EventStore,
    NewEvent,
    canonical_json,
    compute_event_id,
)

STREAMS = ["trace:a", "trace:b", "trace:c"]
payloads = st.fixed_dictionaries({"v": st.integers(0, 5)})  # small space -> many duplicates
causations = st.lists(st.sampled_from(["ingest:x", "ingest:y", "trace:a"]), max_size=2)


class StoreMachine(RuleBasedStateMachine):
    pg_server = None  # set for the PostgreSQL run

    def __init__(self):
        super().__init__()
        self.model: dict[str, list[tuple[str, dict]]] = {s: [] for s in STREAMS}  # stream -> [(event_id, payload)]
        self.acked: dict[str, tuple[str, int]] = {}  # event_id -> (stream, version)

    @initialize()
    def open_store(self):
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.db = None
        if self.pg_server is not None:
            import uuid

            self.db = f"h_{uuid.uuid4().hex[:16]}"
            self.store = EventStore(self.pg_server.create_database(self.db))
        else:
            self.store = EventStore(f"{self.dir.name}/w.duckdb")

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
            self.dir.cleanup()
            if self.db:
                import psycopg

                with psycopg.connect(self.pg_server.url_for("postgres"), autocommit=True) as con:
                    con.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')

    def _model_append(self, stream: str, payloads_: list[dict]) -> tuple[int, int]:
        recorded = {eid for eid, _ in self.model[stream]}
        new = 0
        for p in payloads_:
            eid = compute_event_id("trace.ingested", stream, p)
            if eid in recorded:
                continue
            recorded.add(eid)
            self.model[stream].append((eid, p))
            self.acked[eid] = (stream, len(self.model[stream]))
            new += 1
        return new, len(payloads_) - new

    @rule(stream=st.sampled_from(STREAMS), ps=st.lists(payloads, min_size=1, max_size=3), causation=causations,
          mode=st.sampled_from(["right", "wrong", "none"]))
    def append(self, stream, ps, causation, mode):
        current = len(self.model[stream])
        expected = {"right": current, "wrong": current + 1, "none": None}[mode]
        recorded = {eid for eid, _ in self.model[stream]}
        would_append = any(compute_event_id("trace.ingested", stream, p) not in recorded for p in ps)
        events = [NewEvent("trace.ingested", p, causation) for p in ps]
        if mode == "wrong" and would_append:
            with pytest.raises(ConcurrencyError) as e:
                self.store.append(stream, events, expected_version=expected)
            assert e.value.actual == current
            return
        r = self.store.append(stream, events, expected_version=expected)
        new, dup = self._model_append(stream, ps)
        assert (r.appended, r.already_recorded) == (new, dup)
        for eid in r.event_ids:
            assert eid in self.acked

    @rule(rows=st.lists(st.tuples(st.sampled_from(STREAMS), payloads), min_size=1, max_size=6))
    def append_batch(self, rows):
        t = pa.table({"stream": [s for s, _ in rows], "type": ["trace.ingested"] * len(rows),
                      "payload": [canonical_json(p) for _, p in rows], "causation": [["ingest:x"]] * len(rows)},
                     schema=BATCH_SCHEMA)
        r = self.store.append_batch(t)
        new = sum(self._model_append(s, [p])[0] for s, p in rows)
        assert (r.appended, r.already_recorded) == (new, len(rows) - new)

    @rule(stream=st.sampled_from(STREAMS))
    def read_stream(self, stream):
        got = [(e.event_id, e.payload, e.stream_version) for e in self.store.read(stream)]
        assert got == [(eid, p, i + 1) for i, (eid, p) in enumerate(self.model[stream])]

    @precondition(lambda self: sum(map(len, self.model.values())) > 0)
    @rule()
    def rebuild(self):
        before = self.store.projection_rows()
        self.store.rebuild_projections()
        assert self.store.projection_rows() == before

    @invariant()
    def store_matches_model(self):
        if not hasattr(self, "store"):
            return
        assert self.store.check_integrity() == []
        events = self.store.read()
        ids = [e.event_id for e in events]
        assert len(ids) == len(set(ids)), "duplicate event_id"
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        by_stream: dict[str, list[int]] = {}
        for e in events:
            by_stream.setdefault(e.stream, []).append(e.stream_version)
            assert self.acked[e.event_id] == (e.stream, e.stream_version)
        for s, versions in by_stream.items():
            assert versions == list(range(1, len(versions) + 1)), f"{s} versions not contiguous"
            assert self.store.stream_version(s) == len(versions)
        assert set(ids) == set(self.acked), "an acknowledged append is not readable"


_SETTINGS = settings(
    max_examples=20, stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
StoreMachine.TestCase.settings = _SETTINGS
TestStoreStateful = pytest.mark.slow(StoreMachine.TestCase)


class PostgresStoreMachine(StoreMachine):
    pass


PostgresStoreMachine.TestCase.settings = _SETTINGS


@pytest.fixture
def _postgres_machine(pg_server):
    PostgresStoreMachine.pg_server = pg_server
    yield
    PostgresStoreMachine.pg_server = None


TestStoreStatefulPostgres = pytest.mark.usefixtures("_postgres_machine")(
    pytest.mark.slow(PostgresStoreMachine.TestCase))

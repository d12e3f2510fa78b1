"""SIGKILL mid-append: every acknowledged batch survives exactly once, no batch is half-applied.

A child process appends 20-event batches in a loop and prints ``ack <n>`` only after the commit
returned; the parent kills it with SIGKILL at a random moment (0.2-1.0 s after it is ready), reopens
the warehouse (DuckDB replays its WAL) and checks, 20 times over the same file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flywheel.store import EventStore

BATCH = 20
TRIALS = 20

# Only flywheel.store is imported (duckdb + pyarrow, ~0.5 s): the CLI or torch would dominate the test.
CHILD = textwrap.dedent(
    f"""
    import sys
    import pyarrow as pa
    from flywheel.store import EventStore, BATCH_SCHEMA
    store = EventStore(sys.argv[1])
    first = int(sys.argv[2])
    print("ready", flush=True)
    n = first
    while True:
        t = pa.table({{
            "stream": [f"trace:b{{n}}-{{i}}" for i in range({BATCH})],
            "type": ["trace.ingested"] * {BATCH},
            "payload": ['{{"b":%d,"i":%d,"pad":"%s"}}' % (n, i, "x" * 200) for i in range({BATCH})],
            "causation": [[f"ingest:b{{n}}"]] * {BATCH},
        }}, schema=BATCH_SCHEMA)
        store.append_batch(t, validated=True)
        print(f"ack {{n}}", flush=True)
        n += 1
    """
)


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_no_acknowledged_batch(tmp_path):
    rng = random.Random(1234)
    path = tmp_path / "w.duckdb"
    acked_all: set[int] = set()
    kills_mid_run = 0
    for trial in range(TRIALS):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(trial * 100_000)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.0))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        acked = {int(line.split()[1]) for line in out.splitlines() if line.startswith("ack ")}
        kills_mid_run += bool(acked)
        acked_all |= acked

        with EventStore(path) as store:
            rows = store.con.execute(
                "SELECT json_extract(payload, '$.b')::BIGINT AS b, count(*), count(DISTINCT stream) "
                "FROM events GROUP BY b"
            ).fetchall()
            present = {b: (n, d) for b, n, d in rows}
            # every acknowledged batch is there exactly once
            missing = acked_all - set(present)
            assert not missing, f"trial {trial}: acknowledged batches lost: {sorted(missing)[:5]}"
            # no partial (or doubled) batch, acknowledged or not
            bad = {b: v for b, v in present.items() if v != (BATCH, BATCH)}
            assert not bad, f"trial {trial}: partial batches {bad}"
            # at most the one in-flight batch may have committed without its ack being printed
            assert len(set(present) - acked_all) <= trial + 1
            assert store.check_integrity() == []
    assert kills_mid_run >= TRIALS // 2, "the child rarely got to append before being killed"


# The same on PostgreSQL: the child is a client of the server, so a SIGKILL leaves its open transaction
# for the server to roll back. Kills are tied to the child's progress (after its first acknowledged
# batch, a random short moment into a later one), not to wall-clock time.
PG_CHILD = textwrap.dedent(
    f"""
    import sys
    import pyarrow as pa
    from flywheel.store import EventStore, BATCH_SCHEMA
    store = EventStore(sys.argv[1])
    n = int(sys.argv[2])
    print("ready", flush=True)
    while True:
        t = pa.table({{
            "stream": [f"trace:b{{n}}-{{i}}" for i in range({BATCH})],
            "type": ["trace.ingested"] * {BATCH},
            "payload": ['{{"b":%d,"i":%d,"pad":"%s"}}' % (n, i, "x" * 200) for i in range({BATCH})],
            "causation": [[f"ingest:b{{n}}"]] * {BATCH},
        }}, schema=BATCH_SCHEMA)
        store.append_batch(t, validated=True)
        print(f"ack {{n}}", flush=True)
        n += 1
    """
)


@pytest.mark.slow
def test_sigkill_during_postgres_appends_loses_no_acknowledged_batch(pg_url):
    rng = random.Random(4321)
    acked_all: set[int] = set()
    for trial in range(10):
        proc = subprocess.Popen([sys.executable, "-c", PG_CHILD, pg_url, str(trial * 100_000)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [proc.stdout.readline()]
        for _ in range(1 + rng.randrange(3)):  # after 1-3 acknowledged batches ...
            lines.append(proc.stdout.readline())
        time.sleep(rng.uniform(0, 0.05))  # ... somewhere into the next one
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert lines[0].strip() == "ready", f"trial {trial}: the child failed to start: {err[-2000:]}"
        acked = {int(line.split()[1]) for line in lines + out.splitlines() if line.startswith("ack ")}
        assert acked, f"trial {trial}: the child died before its first acknowledged batch: {err[-2000:]}"
        acked_all |= acked
        with EventStore(pg_url) as store:
            events = store.read_arrow(stream="trace:*")
            present: dict[int, list[str]] = {}
            for stream, payload in zip(events.column("stream").to_pylist(), events.column("payload").to_pylist(),
                                       strict=True):
                present.setdefault(json.loads(payload)["b"], []).append(stream)
            missing = acked_all - set(present)
            assert not missing, f"trial {trial}: acknowledged batches lost: {sorted(missing)[:5]}"
            bad = {b: len(v) for b, v in present.items() if len(v) != BATCH or len(set(v)) != BATCH}
            assert not bad, f"trial {trial}: partial or doubled batches {bad}"
            assert len(set(present) - acked_all) <= trial + 1
            assert store.check_integrity() == []

"""SIGKILL mid-append: every acknowledged batch survives exactly once, no batch is half-applied.

A child process appends 20-event batches in a loop, printing ``begin <n>`` before each append and
``ack <n> <seconds>`` only after the commit returned. The parent kills it with SIGKILL relative to
the child's own progress, not to a clock: after a random number (1-3) of acknowledged batches, at a
random point of the next append (a random fraction of the child's own last append time after its
``begin``). So every trial kills a child that has acknowledged at least one batch and is inside an
append, on a fast or a slow machine alike. The parent then reopens the warehouse (DuckDB replays
its WAL) and checks, 20 times over the same file.
"""

from __future__ import annotations

import json
import os
import random
import select
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
    import time
    import pyarrow as pa
    from flywheel.store import EventStore, BATCH_SCHEMA
    store = EventStore(sys.argv[1])
    first = int(sys.argv[2])
    slow = float(sys.argv[3])  # extra seconds per append: a slow machine, simulated
    print("ready", flush=True)
    n = first
    while True:
        print(f"begin {{n}}", flush=True)
        t0 = time.perf_counter()
        time.sleep(slow)
        t = pa.table({{
            "stream": [f"trace:b{{n}}-{{i}}" for i in range({BATCH})],
            "type": ["trace.ingested"] * {BATCH},
            "payload": ['{{"b":%d,"i":%d,"pad":"%s"}}' % (n, i, "x" * 200) for i in range({BATCH})],
            "causation": [[f"ingest:b{{n}}"]] * {BATCH},
        }}, schema=BATCH_SCHEMA)
        store.append_batch(t, validated=True)
        print(f"ack {{n}} {{time.perf_counter() - t0:.6f}}", flush=True)
        n += 1
    """
)


def _kill_inside_an_append(proc: subprocess.Popen, rng: random.Random) -> tuple[list[str], bytes]:
    """Read the child's progress; after 1-3 acks, SIGKILL it at a random point of the next append.
    Returns the lines read and any partial line. Reads the pipe unbuffered, so a ``begin`` is acted
    on as it arrives."""
    target = rng.randint(1, 3)
    acks, last, seen, pending = 0, 0.0, [], b""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + 300  # generous: only a hung child gets near it
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 1.0)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"the child exited ({proc.wait()}) before it was killed")
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode()
            seen.append(line)
            if line.startswith("ack "):
                acks += 1
                last = float(line.split()[2])
        if acks >= target and lines and lines[-1].startswith(b"begin "):
            # A random point of this append, in the child's own time: its last append took ``last`` s.
            time.sleep(rng.uniform(0.0, 1.0) * last)
            proc.send_signal(signal.SIGKILL)
            return seen, pending
    raise AssertionError("the child made no progress for 300 s")


@pytest.mark.slow
@pytest.mark.parametrize("slow", [0.0, 1.5], ids=["as-is", "child-1.5s-slower-per-append"])
def test_sigkill_at_random_moments_loses_no_acknowledged_batch(tmp_path, slow):
    """The second case simulates a machine on which one append takes longer than the old fixed
    0.2-1.0 s kill delay: killing by the clock then never hit a child that had acknowledged a batch."""
    rng = random.Random(1234)
    path = tmp_path / "w.duckdb"
    acked_all: set[int] = set()
    for trial in range(TRIALS if not slow else 3):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(trial * 100_000), str(slow)],
                                stdout=subprocess.PIPE, bufsize=0, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            before, partial = _kill_inside_an_append(proc, rng)
            out = (partial + proc.communicate(timeout=60)[0]).decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert before[0] == "ready"
        acked = {int(line.split()[1]) for line in [*before, *out.splitlines()] if line.startswith("ack ")}
        assert acked, "killed before the child acknowledged a batch"  # cannot happen by construction
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
            # at most the one in-flight batch per trial may have committed without its ack being printed
            assert len(set(present) - acked_all) <= trial + 1
            assert store.check_integrity() == []


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

"""Reads while writers run, on one machine with the embedded store (and many writers on PostgreSQL).

Embedded: a writer process (a cycle's role) owns the warehouse and appends continuously; a second
writer (an ingest's role) starts while it runs; real read commands (`flywheel status`, `events`,
`trace`) run meanwhile. Before the shared store each read, and the second writer, failed with
"warehouse ... is in use by process N". Then the first writer stops while the second goes on (the
second takes the file over) and a read still answers. Finally: every acknowledged append is there
exactly once, and the stream both writers appended to has versions 1..n.

PostgreSQL: N writer processes (4 ingest-like bulk writers and 1 cycle-like writer using expected
versions) append at once; nothing is lost or duplicated and every stream's versions are gap-free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from flywheel.store import EventStore

FLYWHEEL = Path(sys.executable).with_name("flywheel")

WRITER = textwrap.dedent(
    """
    import sys, threading
    from flywheel.store import EventStore, NewEvent
    path, name, chain = sys.argv[1], sys.argv[2], sys.argv[3] == "chain"
    s = EventStore(path)
    if chain:  # a small lineage for `flywheel trace` to walk
        s.append("trace:t1", NewEvent("trace.ingested", {"i": 1, "status": "failure"}, ["ingest:b"]))
        s.append("failure:f1", NewEvent("failure.classified", {"kinds": ["tool_call"]}, ["trace:t1"]))
        s.append("eval:e1", NewEvent("eval.created", {"split": "train"}, ["failure:f1"]))
        s.append("run:1", NewEvent("training.completed", {"steps": 1}, ["eval:e1"]))
        s.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/2"}, ["run:1"]))
    print("ready", "owner" if s.is_owner else "client", flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    i = 0
    while not stop.is_set():
        s.append(f"trace:{name}-{i}", NewEvent("trace.ingested", {"w": name, "i": i}, [f"ingest:{name}"]))
        s.append("failure:shared", NewEvent("failure.classified", {"w": name, "i": i}, [f"trace:{name}-{i}"]))
        print(f"ack {i}", flush=True)
        i += 1
    print("owner" if s.is_owner else "client", flush=True)
    s.close()
    print("closed", flush=True)
    """
)


class Writer:
    """A writer process whose output lines are collected by a thread (waits tie to its own acks)."""

    def __init__(self, path: Path, name: str, chain: bool):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, "chain" if chain else "-"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    def acks(self) -> int:
        return sum(1 for x in self.lines if x.startswith("ack "))

    def wait_for(self, pred, what: str, timeout: float = 300) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: pred(self) or "<eof>" in self.lines, timeout=timeout)
        assert ok and pred(self), f"writer {self.name}: {what} never happened; output {self.lines[-5:]}, " \
                                  f"stderr {self.proc.stderr.read() if self.proc.poll() is not None else ''}"

    def stop(self) -> list[str]:
        self.proc.stdin.close()
        self.proc.wait(timeout=300)
        self.reader.join(timeout=30)
        assert self.proc.returncode == 0, self.proc.stderr.read()
        return self.lines


def flywheel(home: Path, *args: str) -> dict | list:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLYWHEEL_", "MLFLOW_"))}
    env.update(FLYWHEEL_HOME=str(home), COLUMNS="200")
    r = subprocess.run([str(FLYWHEEL), *args, "--json"], env=env, cwd=home.parent, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"flywheel {' '.join(args)} failed while a writer ran:\n{r.stderr[-2000:]}"
    return json.loads(r.stdout)


@pytest.mark.slow
def test_read_commands_answer_and_two_writers_serialise_while_a_writer_holds_the_warehouse(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    path = home / "warehouse.duckdb"
    a = Writer(path, "a", chain=True)
    a.wait_for(lambda w: w.acks() >= 3, "first appends")
    assert "ready owner" in a.lines
    b = Writer(path, "b", chain=False)  # the second writer: used to fail with the lock error
    b.wait_for(lambda w: w.acks() >= 3, "second writer's appends")
    assert "ready client" in b.lines

    status = flywheel(home, "status")
    assert status["events"] >= 5 + 2 * 3 and status["entities"]["model"] == 1
    events = flywheel(home, "events", "--limit", "5")
    assert len(events) == 5 and events[-1]["seq"] >= events[0]["seq"]
    trace = flywheel(home, "trace", "model:policy/2")
    assert trace["root"] == "model:policy/2" and [t["trace"] for t in trace["traces"]] == ["trace:t1"]

    # The owner stops while the other writer goes on: the second takes the file over.
    n_b = b.acks()
    out_a = a.stop()
    assert "closed" in out_a
    b.wait_for(lambda w: w.acks() >= n_b + 3, "appends after the owner left")
    after = flywheel(home, "events", "--stream", "failure:shared", "--limit", "1")
    assert after and after[0]["stream_version"] >= 2 * 3
    out_b = b.stop()
    assert "owner" in out_b  # it owned the file by the end

    acked = {"a": a.acks(), "b": b.acks()}
    with EventStore(path) as s:
        assert s.check_integrity() == []
        shared = s.read(stream="failure:shared")
        assert [e.stream_version for e in shared] == list(range(1, len(shared) + 1))
        for name, n in acked.items():
            mine = [e.payload["i"] for e in shared if e.payload["w"] == name]
            # every acknowledged append once; at most the one in flight at stop beyond that
            assert sorted(mine)[:n] == list(range(n)) and len(mine) in (n, n + 1), (name, n, len(mine))
            traces = s.read(stream=f"trace:{name}-*")
            assert len({e.stream for e in traces}) == len(traces) >= n


POSTGRES_WRITER = textwrap.dedent(
    """
    import sys, pyarrow as pa
    from flywheel.store import EventStore, NewEvent, ConcurrencyError, BATCH_SCHEMA
    url, role, w, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    s = EventStore(url)
    print("ready", flush=True)
    for r in range(rounds):
        if role == "ingest":
            n = 200
            t = pa.table({
                "stream": [f"trace:w{w}-r{r}-{i}" for i in range(n)] + [f"failure:k{r % 3}"],
                "type": ["trace.ingested"] * n + ["failure.classified"],
                "payload": ['{"w":%d,"r":%d,"i":%d}' % (w, r, i) for i in range(n)] + ['{"w":%d,"r":%d}' % (w, r)],
                "causation": [[f"ingest:w{w}"]] * n + [[f"trace:w{w}-r{r}-0"]],
            }, schema=BATCH_SCHEMA)
            res = s.append_batch(t, validated=True)
            assert res.appended == n + 1, res
        else:  # a cycle: read the version, append on it, retry on a concurrent append
            while True:
                v = s.stream_version("cycle:c")
                try:
                    s.append("cycle:c", NewEvent("cycle.started", {"w": w, "r": r}), expected_version=v)
                    break
                except ConcurrencyError:
                    print("retry", flush=True)
        print(f"ack {r}", flush=True)
    s.close()
    """
)


@pytest.mark.slow
def test_postgres_n_writer_processes_lose_nothing_and_keep_versions_gap_free(pg_url):
    ingests, rounds = 4, 15
    procs = [subprocess.Popen([sys.executable, "-c", POSTGRES_WRITER, pg_url, "ingest", str(w), str(rounds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(ingests)]
    procs += [subprocess.Popen([sys.executable, "-c", POSTGRES_WRITER, pg_url, "cycle", str(w), str(rounds)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in (100, 101)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert out.count("ack ") == rounds
    with EventStore(pg_url) as s:
        assert s.check_integrity() == []
        assert s.last_seq() == ingests * rounds * 201 + 2 * rounds
        traces = s.read(stream="trace:*")
        assert len(traces) == len({e.event_id for e in traces}) == ingests * rounds * 200
        for k in range(3):
            versions = [e.stream_version for e in s.read(stream=f"failure:k{k}")]
            assert versions == list(range(1, len(versions) + 1))
        assert sum(len(s.read(stream=f"failure:k{k}")) for k in range(3)) == ingests * rounds
        cycles = s.read(stream="cycle:c")
        assert [e.stream_version for e in cycles] == list(range(1, 2 * rounds + 1))
        assert sorted((e.payload["w"], e.payload["r"]) for e in cycles) == sorted(
            (w, r) for w in (100, 101) for r in range(rounds))
        seqs = [e.seq for e in s.read()]
        assert seqs == list(range(1, len(seqs) + 1))

"""Event store benchmark: batched appends vs one INSERT per event, and the lineage query.

    .venv/bin/python benchmarks/bench_event_store.py            # 1,000,000 events
    .venv/bin/python benchmarks/bench_event_store.py --quick    # 100,000 events

What it measures (each phase in a fresh warehouse under a temporary directory):

1. **Batched append**: ``EventStore.append_batch`` of N small ``trace.ingested`` events (one new
   stream each, causation = their ingest batch) in batches of ``--batch`` rows; the clock covers every
   append and the final close (DuckDB's checkpoint), not the generation of the Arrow batches. Runs in
   a child process so that its peak RSS is its own.
   Peer, same run: **naive** one transaction with one ``INSERT`` per event (event id hashed in
   Python, the same ``events`` table, no projections), on ``--naive`` events. Also reported:
   ``EventStore.append`` of one event per call (the API stages use for small appends).
2. **Lineage**: a warehouse of N trace events with a realistic fan-in (3% of traces fail, 3 traces
   per distinct failure, one eval per failure, train/held-out suites, environment versions, a synth
   batch, rollouts, a training run, a model version). Median latency of ``store.lineage(model,
   "down")`` (model -> every trace it learned from). Peer, same run: the same recursive walk over
   ``events.causation`` directly (no ``lineage_edges`` projection).

Targets (issue 2): >= 200,000 events/s batched; lineage median <= 100 ms on 1M events.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa


def _trace_batch(start: int, n: int, ingest: str) -> pa.Table:
    return pa.table(
        {
            "stream": [f"trace:{i:012x}" for i in range(start, start + n)],
            "type": ["trace.ingested"] * n,
            "payload": [
                f'{{"model":"policy","n_messages":{3 + i % 7},"status":"{"failure" if i % 33 == 0 else "success"}"}}'
                for i in range(start, start + n)
            ],
            "causation": [[ingest]] * n,
        }
    )


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_append(n: int, batch: int, out: Path) -> None:
    from flywheel.store import EventStore

    path = Path(tempfile.mkdtemp(prefix="bench-append-")) / "w.duckdb"
    store = EventStore(path)
    elapsed = 0.0
    for start in range(0, n, batch):
        table = _trace_batch(start, min(batch, n - start), f"ingest:b{start // batch}")
        t0 = time.perf_counter()
        store.append_batch(table, validated=True)
        elapsed += time.perf_counter() - t0
    t0 = time.perf_counter()
    store.close()  # includes DuckDB's checkpoint of everything appended
    close_s = time.perf_counter() - t0
    store = EventStore(path, read_only=True)
    counts = store.projection_counts()
    store.close()
    out.write_text(json.dumps({"append_s": elapsed, "close_s": close_s, "peak_rss_mib": _peak_rss_mib(),
                               "counts": counts, "db_mib": path.stat().st_size / 2**20}))


def naive(n: int) -> float:
    """One transaction and one INSERT per event into the same events table (no projections)."""
    import duckdb

    from flywheel.store import EventStore, compute_event_id

    path = Path(tempfile.mkdtemp(prefix="bench-naive-")) / "w.duckdb"
    EventStore(path).close()  # same schema, migrations applied
    con = duckdb.connect(str(path))
    t0 = time.perf_counter()
    for i in range(n):
        stream, payload = f"trace:{i:012x}", f'{{"model":"policy","n":{i}}}'
        con.execute("BEGIN TRANSACTION")
        con.execute(
            "INSERT INTO events VALUES (?, ?, ?, 1, 'trace.ingested', ?, ['ingest:b0'], NULL, now(), 1)",
            [i + 1, compute_event_id("trace.ingested", stream, payload), stream, payload],
        )
        con.execute("COMMIT")
    con.close()
    return time.perf_counter() - t0


def single_appends(n: int) -> float:
    from flywheel.store import EventStore, NewEvent

    path = Path(tempfile.mkdtemp(prefix="bench-single-")) / "w.duckdb"
    with EventStore(path) as store:
        t0 = time.perf_counter()
        for i in range(n):
            store.append(f"failure:{i:08x}", NewEvent("failure.classified", {"kind": "tool_call", "i": i},
                                                      [f"trace:{i:012x}"]))
        return time.perf_counter() - t0


def build_lineage_warehouse(n_traces: int, batch: int) -> tuple[Path, str, str, dict[str, int]]:
    from flywheel.store import EventStore, NewEvent

    path = Path(tempfile.mkdtemp(prefix="bench-lineage-")) / "w.duckdb"
    store = EventStore(path)
    n_batches = 0
    for start in range(0, n_traces, batch):
        ingest = f"ingest:b{n_batches}"
        store.append(ingest, NewEvent("ingest.completed", {"batch": n_batches}, ["file:traces.jsonl"]))
        store.append_batch(_trace_batch(start, min(batch, n_traces - start), ingest), validated=True)
        n_batches += 1
    failing = [f"trace:{i:012x}" for i in range(0, n_traces, 33)]  # 3% of traces fail
    n_fail = len(failing) // 3
    failures = [f"failure:{k:08x}" for k in range(n_fail)]
    rows = {"stream": [], "type": [], "payload": [], "causation": []}

    def add(stream: str, type_: str, payload: dict, causation: list[str]) -> None:
        rows["stream"].append(stream)
        rows["type"].append(type_)
        rows["payload"].append(json.dumps(payload, sort_keys=True, separators=(",", ":")))
        rows["causation"].append(causation)

    for k, f in enumerate(failures):
        add(f, "failure.classified", {"kind": "tool_call"}, failing[3 * k : 3 * k + 3])
    evals = [f"eval:{k:08x}" for k in range(n_fail)]
    for e, f in zip(evals, failures, strict=True):
        add(e, "eval.created", {"split": "train" if hash(e) % 10 < 7 else "heldout"}, [f])
    store.append_batch(pa.table(rows), validated=True)
    train = [e for i, e in enumerate(evals) if i % 10 < 7]
    heldout = [e for i, e in enumerate(evals) if i % 10 >= 7]
    store.append("suite:train", NewEvent("suite.versioned", {"entity_id": "suite:train@1"}, train))
    store.append("suite:heldout", NewEvent("suite.versioned", {"entity_id": "suite:heldout@1"}, heldout))
    store.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@1"}, ["suite:train@1"]))
    store.append("synth:s1", NewEvent("synth.batch_accepted", {"accepted": 800}, ["env:train@1"]))
    store.append("env:train", NewEvent("env.versioned", {"entity_id": "env:train@2"}, ["suite:train@1", "synth:s1"]))
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/1"}, []))
    store.append("rollouts:r1", NewEvent("rollouts.published", {"rows": 4096}, ["env:train@2", "model:policy/1"]))
    store.append("run:1", NewEvent("training.completed", {"steps": 8}, ["rollouts:r1", "model:policy/1"]))
    store.append("model:policy", NewEvent("model.registered", {"entity_id": "model:policy/2"}, ["run:1"]))
    counts = store.projection_counts()
    store.close()
    return path, "model:policy/2", failing[0], counts


_PEER_SQL = """
WITH RECURSIVE edges AS (
    SELECT coalesce(json_extract_string(payload, '$.entity_id'), stream) AS child, unnest(causation) AS parent
    FROM events
), walk(entity_id, depth) AS (
    SELECT $1::VARCHAR, 0
    UNION
    SELECT e.parent, w.depth + 1 FROM walk w JOIN edges e ON e.child = w.entity_id WHERE w.depth < 64
)
SELECT entity_id, min(depth) FROM walk WHERE entity_id <> $1 GROUP BY entity_id ORDER BY 2, 1
"""


def _median_ms(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100,000 events instead of 1,000,000")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--batch", type=int, default=100_000, help="rows per append_batch call")
    ap.add_argument("--naive", type=int, default=None, help="events in the naive baseline (default 20,000; quick 1,000)")
    ap.add_argument("--reps", type=int, default=None, help="lineage query repetitions")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.events or (100_000 if args.quick else 1_000_000)
    if args.child:
        child_append(n, args.batch, Path(args.child))
        return
    n_naive = args.naive or (1_000 if args.quick else 20_000)
    reps = args.reps or (10 if args.quick else 21)
    print(f"event store benchmark: {n:,} events, batches of {args.batch:,}, naive peer on {n_naive:,} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "append.json"
        subprocess.run([sys.executable, __file__, "--child", str(out), "--events", str(n), "--batch", str(args.batch)],
                       check=True)
        res = json.loads(out.read_text())
    total = res["append_s"] + res["close_s"]
    batched_rate = n / total
    print(f"  batched append_batch : {batched_rate:>10,.0f} events/s  ({res['append_s']:.2f} s appends + "
          f"{res['close_s']:.2f} s close/checkpoint; peak RSS {res['peak_rss_mib']:.0f} MiB; "
          f"warehouse {res['db_mib']:.0f} MiB; rows {res['counts']})")
    naive_s = naive(n_naive)
    naive_rate = n_naive / naive_s
    print(f"  naive 1 INSERT/event : {naive_rate:>10,.0f} events/s  ({n_naive:,} events in {naive_s:.2f} s)")
    n_single = 500 if args.quick else 2000
    single_s = single_appends(n_single)
    print(f"  store.append x1      : {n_single / single_s:>10,.0f} events/s  ({single_s / n_single * 1000:.2f} ms per "
          f"call incl. projections, {n_single:,} calls)")
    print(f"  ratio batched / naive: {batched_rate / naive_rate:.1f}x   (target >= 200,000 events/s: "
          f"{'met' if batched_rate >= 200_000 else 'NOT met'})")

    from flywheel.store import EventStore

    t0 = time.perf_counter()
    path, model, trace, counts = build_lineage_warehouse(n, args.batch)
    build_s = time.perf_counter() - t0
    with EventStore(path, read_only=True) as store:
        nodes = store.lineage(model, "down")
        up = store.lineage(trace, "up")
        ms = _median_ms(lambda: store.lineage(model, "down"), reps)
        up_ms = _median_ms(lambda: store.lineage(trace, "up"), reps)
        peer_rows = store.con.execute(_PEER_SQL, [model]).fetchall()
        peer_ms = _median_ms(lambda: store.con.execute(_PEER_SQL, [model]).fetchall(), max(3, reps // 4))
    assert sorted(map(tuple, peer_rows)) == sorted(nodes), "peer and projection disagree"
    kinds = {}
    for e, _ in nodes:
        kinds[e.split(":", 1)[0]] = kinds.get(e.split(":", 1)[0], 0) + 1
    print(f"  lineage warehouse    : {counts['events']:,} events, {counts['lineage_edges']:,} edges (built in {build_s:.1f} s)")
    print(f"  lineage down (model) : median {ms:7.1f} ms  -> {len(nodes):,} ancestors {kinds}  "
          f"(target <= 100 ms: {'met' if ms <= 100 else 'NOT met'})")
    print(f"  lineage up (trace)   : median {up_ms:7.1f} ms  -> {len(up)} descendants")
    print(f"  peer: walk over events.causation: median {peer_ms:.1f} ms; ratio peer / projection: {peer_ms / ms:.1f}x")


if __name__ == "__main__":
    main()

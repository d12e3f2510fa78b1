"""Event store benchmark, both backends in the same run: batched appends (1 and 4 writers), one event
appended alone, lineage, and (embedded) reads while a writer appends.

    .venv/bin/python benchmarks/bench_event_store.py            # 1,000,000 events
    .venv/bin/python benchmarks/bench_event_store.py --quick    # 100,000 events
    .venv/bin/python benchmarks/bench_event_store.py --backends duckdb

PostgreSQL runs on a private server this script starts from the local binaries (flywheel/pglocal.py;
fsync and synchronous_commit on, max_wal_size 8 GB, shared_buffers 512 MB). Each phase uses a fresh
store (a DuckDB file in a temporary directory, or a new database).

What it measures, per backend:

1. **Batched append**: ``append_batch`` of N small ``trace.ingested`` events (one new stream each,
   causation = their ingest batch) in batches of ``--batch`` rows, by 1 writer process and by 4 at
   once (N/4 each; on DuckDB the first owns the file and the others append through it). Every writer
   opens the store and generates its batches first; the clock runs from their common start to the
   last writer's close (DuckDB's checkpoint included).
2. **One event appended alone** (``store.append``, what stages do between batches): per-call latency
   on a fresh store and on the N-event lineage store.
3. **Lineage**: a store of N trace events with a realistic fan-in (3% of traces fail, 3 traces per
   distinct failure, one eval per failure, train/held-out suites, environment versions, a synth batch,
   rollouts, a training run, a model version). Median and p99 of ``store.lineage(model, "down")``
   (model -> every trace it learned from). Peer on DuckDB: the same recursive walk over
   ``events.causation`` directly (no projection). Both backends must return the same ancestors.
   PostgreSQL is timed straight after the load and again after ``VACUUM (ANALYZE)``, the state
   autovacuum leaves a table in within a minute or two of a bulk load (visibility map set, so the
   walk's probes are index-only; statistics); both are printed, the target is judged on the second.
4. **Reads while writing** (embedded): a writer process owns the warehouse and appends; this process
   opens the store and runs what ``flywheel status`` reads, again and again: latency median/p99, and
   the writer's rate against the same writer alone (peer).
Also, same run: a naive DuckDB peer (one transaction, one INSERT per event), and PostgreSQL / DuckDB
ratios.

Targets: DuckDB >= 200,000 events/s batched and lineage median <= 100 ms on 1M events; PostgreSQL
one writer >= 50,000 events/s, 4 writers >= 1.5x one, lineage median <= 150 ms; one event appended
alone <= 5 ms on both; embedded reads p99 < 2 s while a writer runs, the writer within 10% of alone.
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


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine since boot (Linux /proc/stat; None elsewhere): what every
    process used, the writers and a local server alike. Idle and I/O wait count as not busy."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _cores_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Average number of this machine's cores busy between two _cpu_ticks() readings."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fresh_location(backend: str, tag: str) -> str:
    """A fresh store: a DuckDB file in a temporary directory, or a new database on the benchmark's server."""
    if backend == "duckdb":
        return str(Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=_TMP)) / "w.duckdb")
    return _PG.create_database(f"bench_{tag}_{os.getpid()}_{time.monotonic_ns() % 10**9}")


def child_append(location: str, n: int, batch: int, first: int, out: Path) -> None:
    """One writer of :func:`batched`: open the store, generate its batches, say ready, wait for the
    common start, append, close; report its clock."""
    from flywheel.store import EventStore

    store = EventStore(location)
    tables = [_trace_batch(start, min(batch, first + n - start), f"ingest:b{start // batch}")
              for start in range(first, first + n, batch)]
    out.with_suffix(".ready").touch()
    go = out.parent / "go"
    while not go.exists():
        time.sleep(0.002)
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
    for table in tables:
        store.append_batch(table, validated=True)
    appended = time.monotonic()
    store.close()  # includes DuckDB's checkpoint of everything appended
    end = time.monotonic()
    out.write_text(json.dumps({"start": start, "end": end, "append_s": appended - start, "close_s": end - appended,
                               "peak_rss_mib": _peak_rss_mib()}))


def batched(location: str, n: int, batch: int, writers: int) -> dict:
    """``writers`` processes append n/writers events each, all at once. Each one first opens the store
    and generates its batches; the clock runs from the common start (a file every writer waits for)
    to the last writer's close, so neither interpreter start-up nor the generation of the batches
    competes with the appends being timed. ``cores_busy``: how many of the machine's cores were busy,
    on average, over the same span (writers and a local server together): with one writer the client
    and the server mostly take turns, and with four the machine's cores, not the store, can be the
    bound."""
    from flywheel.store import EventStore

    EventStore(location).close()  # schema in place before the clock starts
    per = n // writers
    with tempfile.TemporaryDirectory() as d:
        outs = [Path(d) / f"w{i}.json" for i in range(writers)]
        procs = [subprocess.Popen([sys.executable, __file__, "--child", str(o), "--location", location,
                                   "--events", str(per), "--batch", str(batch), "--first", str(i * per)])
                 for i, o in enumerate(outs)]
        while not all(o.with_suffix(".ready").exists() for o in outs):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("a writer failed before the start")
            time.sleep(0.01)
        ticks = _cpu_ticks()
        (Path(d) / "go").touch()
        for p in procs:
            assert p.wait() == 0
        cores = _cores_busy(ticks, _cpu_ticks())
        res = [json.loads(o.read_text()) for o in outs]
    wall = max(r["end"] for r in res) - min(r["start"] for r in res)
    with EventStore(location) as store:
        counts = store.projection_counts()
        assert counts["events"] == per * writers and store.check_integrity() == [], (counts, store.check_integrity())
    return {"rate": per * writers / wall, "wall_s": wall, "busy_s": max(r["append_s"] + r["close_s"] for r in res),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in res), "counts": counts, "cores_busy": cores}


def naive(n: int) -> float:
    """One transaction and one INSERT per event into the same events table (no projections)."""
    import duckdb

    from flywheel.store import EventStore, compute_event_id

    with tempfile.TemporaryDirectory(prefix="bench-naive-") as d:
        path = Path(d) / "w.duckdb"
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


def single_appends(location: str, n: int) -> list[float]:
    """Milliseconds per ``store.append`` of one event (with projections), n calls."""
    from flywheel.store import EventStore, NewEvent

    times = []
    with EventStore(location) as store:
        base = store.last_seq()
        for i in range(n):
            t0 = time.perf_counter()
            store.append(f"failure:{base:x}-{i:08x}", NewEvent("failure.classified", {"kind": "tool_call", "i": i},
                                                               [f"trace:{i:012x}"]))
            times.append((time.perf_counter() - t0) * 1000)
    return times


READER_WRITER = """
import sys, time, json
sys.path.insert(0, %r)
from bench_event_store import _trace_batch
from flywheel.store import EventStore
store = EventStore(sys.argv[1])
print("ready", flush=True)
batch, n, t = int(sys.argv[2]), int(sys.argv[3]), 0.0
for start in range(0, n, batch):
    t0 = time.perf_counter()
    store.append_batch(_trace_batch(10**9 + start, batch, "ingest:w"), validated=True)
    t += time.perf_counter() - t0
print(json.dumps({"rate": n / t}), flush=True)
store.close()
"""


def status_read_ms(EventStore, location: str) -> float:  # noqa: N803 (the class under test)
    """One `flywheel status`-like read: open, counts by kind, the newest events, close (milliseconds)."""
    t0 = time.perf_counter()
    with EventStore(location) as s:
        s.counts_by_kind()
        s.read(limit=10, newest_first=True)
        s.last_seq()
    return (time.perf_counter() - t0) * 1000


def reads_while_writing(location: str, batch: int, n: int, reads: int) -> dict:
    """Embedded: a writer process owns the warehouse and appends n events; meanwhile this process runs
    what `flywheel status` reads (counts by kind, the last events, the last seq) ``reads`` times, each
    time opening the store as a new process would. Returns read latencies and the writer's rate, and
    the same writer's rate alone (the peer)."""
    from flywheel.store import EventStore

    def writer() -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", READER_WRITER % str(Path(__file__).parent), location, str(batch),
                              str(n)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        return p

    alone = writer()
    rate_alone = json.loads(alone.stdout.readline())["rate"]
    alone.wait()
    w = writer()
    lat = []
    while len(lat) < reads:
        lat.append(status_read_ms(EventStore, location))
        if w.poll() is not None:
            break
    rate_busy = json.loads(w.stdout.readline())["rate"]
    w.wait()
    quiet = []  # peer: the same reads on the same store with no writer (their own cost)
    for _ in range(len(lat)):
        quiet.append(status_read_ms(EventStore, location))
    return {"latencies_ms": lat, "quiet_ms": quiet, "rate_alone": rate_alone, "rate_with_reads": rate_busy}


def build_lineage_warehouse(path: str, n_traces: int, batch: int) -> tuple[str, str, str, dict[str, int]]:
    from flywheel.store import EventStore, NewEvent

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

# Peer on PostgreSQL: the walk before migration 002, which found the ancestors' node ids and then looked
# each name up in entity_names (one more index probe per ancestor) and sorted every row on the server.
_PG_PEER_SQL = """
WITH RECURSIVE walk(frontier, seen, depth) AS (
    SELECT ARRAY[%(node)s::BIGINT], ARRAY[%(node)s::BIGINT], 0
    UNION ALL
    SELECT x.nxt, w.seen || x.nxt, w.depth + 1
    FROM walk w CROSS JOIN LATERAL (
        SELECT coalesce(array_agg(p), '{}') AS nxt FROM (
            SELECT l.parent AS p FROM lineage_links l WHERE l.child = ANY(w.frontier)
            EXCEPT SELECT unnest(w.seen)
        ) q
    ) x
    WHERE w.depth < %(depth)s AND cardinality(w.frontier) > 0
), found AS MATERIALIZED (
    SELECT unnest(frontier) AS node, depth FROM walk WHERE depth > 0
), named AS (
    SELECT n.node, n.name FROM entity_names n WHERE n.node = ANY(ARRAY(SELECT node FROM found))
)
SELECT named.name AS entity_id, found.depth
FROM found JOIN named USING (node)
ORDER BY found.depth, named.name COLLATE "C"
"""



def _times_ms(fn, reps: int) -> list[float]:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return times


def _cores_text(res: dict) -> str:
    busy = res.get("cores_busy")
    return "" if busy is None else f"; cores busy {busy:.2f} of {os.cpu_count()}"


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


_PG = None  # flywheel.pglocal.LocalPostgres of this run
_TMP = None  # this run's directory of DuckDB files (removed at the end)


def run_backend(backend: str, args: argparse.Namespace, n: int, reps: int) -> dict:
    from flywheel.store import EventStore

    r: dict = {}
    r["single_writer"] = batched(_fresh_location(backend, "w1"), n, args.batch, 1)
    print(f"  [{backend}] batched, 1 writer : {r['single_writer']['rate']:>10,.0f} events/s  "
          f"({r['single_writer']['wall_s']:.2f} s incl. close; peak RSS {r['single_writer']['peak_rss_mib']:.0f} MiB"
          f"{_cores_text(r['single_writer'])})")
    r["four_writers"] = batched(_fresh_location(backend, "w4"), n, args.batch, 4)
    print(f"  [{backend}] batched, 4 writers: {r['four_writers']['rate']:>10,.0f} events/s  "
          f"(x{r['four_writers']['rate'] / r['single_writer']['rate']:.2f} one writer; {r['four_writers']['wall_s']:.2f} s "
          f"from the common start to the last close{_cores_text(r['four_writers'])})")
    single = single_appends(_fresh_location(backend, "single"), args.single)
    r["single_append_ms"] = single
    print(f"  [{backend}] store.append x1   : median {statistics.median(single):6.2f} ms, p99 {_p(single, .99):6.2f} ms "
          f"({args.single} calls on a fresh store)")
    t0 = time.perf_counter()
    path, model, trace, counts = build_lineage_warehouse(_fresh_location(backend, "lineage"), n, args.batch)
    build_s = time.perf_counter() - t0
    big = single_appends(path, max(20, args.single // 10))
    r["single_append_big_ms"] = big
    print(f"  [{backend}] store.append x1   : median {statistics.median(big):6.2f} ms, p99 {_p(big, .99):6.2f} ms "
          f"(on the {counts['events']:,}-event lineage store)")
    with EventStore(path) as store:
        nodes = store.lineage(model, "down")
        up = store.lineage(trace, "up")
        down_ms = _times_ms(lambda: store.lineage(model, "down"), reps)
        up_ms = _times_ms(lambda: store.lineage(trace, "up"), reps)
        peer = None
        if backend == "postgresql":
            # What autovacuum does to a table within a minute or two of a bulk load (naptime 60 s): set
            # the visibility map (the walk's probes become index-only) and the planner's statistics.
            # The times above are of the store straight after the load; both are reported.
            fresh_down_ms, fresh_up_ms = down_ms, up_ms
            store.con.execute("VACUUM (ANALYZE)")
            down_ms = _times_ms(lambda: store.lineage(model, "down"), reps)
            up_ms = _times_ms(lambda: store.lineage(trace, "up"), reps)
            r.update(lineage_down_fresh_ms=fresh_down_ms, lineage_up_fresh_ms=fresh_up_ms)
            from flywheel.store import signed_node_id

            params = {"node": signed_node_id(model), "depth": 64}
            assert sorted(map(tuple, store.con.execute(_PG_PEER_SQL, params).fetchall())) == sorted(nodes)
            # round-robin with the walk itself, so that both see the same machine
            ours, theirs = [], []
            for _ in range(reps):
                ours += _times_ms(lambda: store.lineage(model, "down"), 1)
                theirs += _times_ms(lambda: store.con.execute(_PG_PEER_SQL, params).fetchall(), 1)
            peer = statistics.median(theirs)
            peer_ours = statistics.median(ours)
        if backend == "duckdb":
            con = store.con
            peer_rows = con.execute(_PEER_SQL, [model]).fetchall()
            assert sorted(map(tuple, peer_rows)) == sorted(nodes), "peer and projection disagree"
            peer = statistics.median(_times_ms(lambda: con.execute(_PEER_SQL, [model]).fetchall(), max(3, reps // 4)))
    kinds: dict[str, int] = {}
    for e, _ in nodes:
        kinds[e.split(":", 1)[0]] = kinds.get(e.split(":", 1)[0], 0) + 1
    r.update(lineage_nodes=sorted(nodes), lineage_down_ms=down_ms, lineage_up_ms=up_ms)
    print(f"  [{backend}] lineage store     : {counts['events']:,} events, {counts['lineage_edges']:,} edges (built in {build_s:.1f} s)")
    print(f"  [{backend}] lineage down      : median {statistics.median(down_ms):7.1f} ms, p99 {_p(down_ms, .99):7.1f} ms "
          f"-> {len(nodes):,} ancestors {kinds}")
    print(f"  [{backend}] lineage up        : median {statistics.median(up_ms):7.1f} ms, p99 {_p(up_ms, .99):7.1f} ms "
          f"-> {len(up)} descendants")
    if "lineage_down_fresh_ms" in r:
        fd, fu = r["lineage_down_fresh_ms"], r["lineage_up_fresh_ms"]
        print(f"  [{backend}]   (the two above after VACUUM ANALYZE, as autovacuum leaves the store; straight after "
              f"the bulk load: down median {statistics.median(fd):.1f} ms, p99 {_p(fd, .99):.1f} ms; "
              f"up median {statistics.median(fu):.1f} ms, p99 {_p(fu, .99):.1f} ms)")
    if peer is not None and backend == "duckdb":
        print(f"  [{backend}] peer: walk over events.causation: median {peer:.1f} ms; ratio peer / projection "
              f"{peer / statistics.median(down_ms):.1f}x")
    elif peer is not None:
        print(f"  [{backend}] peer: the walk before migration 002 (names looked up at the end): median {peer:.1f} ms "
              f"vs {peer_ours:.1f} ms, round-robin; ratio peer / walk {peer / peer_ours:.2f}x")
    if backend == "duckdb":
        rw = reads_while_writing(_fresh_location(backend, "rw"), args.batch // 10, n // 2, args.reads)
        lat = rw["latencies_ms"]
        r["reads_while_writing"] = rw
        quiet = rw["quiet_ms"]
        print(f"  [{backend}] reads while a writer appends ({len(lat)} opens + status reads from another process): "
              f"median {statistics.median(lat):.0f} ms, p99 {_p(lat, .99):.0f} ms, max {max(lat):.0f} ms "
              f"(target p99 < 2000 ms); peer, the same reads with no writer: median {statistics.median(quiet):.0f} ms, "
              f"p99 {_p(quiet, .99):.0f} ms")
        print(f"  [{backend}] the writer meanwhile: {rw['rate_with_reads']:,.0f} events/s vs {rw['rate_alone']:,.0f} alone "
              f"(x{rw['rate_with_reads'] / rw['rate_alone']:.2f}; target >= 0.90)")
    return r


def main() -> None:
    global _PG, _TMP
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100,000 events instead of 1,000,000")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--batch", type=int, default=100_000, help="rows per append_batch call")
    ap.add_argument("--naive", type=int, default=None, help="events in the naive baseline (default 20,000; quick 1,000)")
    ap.add_argument("--reps", type=int, default=None, help="lineage query repetitions")
    ap.add_argument("--single", type=int, default=None, help="single-event appends (default 2,000; quick 300)")
    ap.add_argument("--reads", type=int, default=None, help="reads while writing (default 200; quick 50)")
    ap.add_argument("--backends", default="duckdb,postgresql")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--location", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.events or (100_000 if args.quick else 1_000_000)
    if args.child:
        child_append(args.location, n, args.batch, args.first, Path(args.child))
        return
    n_naive = args.naive or (1_000 if args.quick else 20_000)
    reps = args.reps or (10 if args.quick else 21)
    args.single = args.single or (300 if args.quick else 2000)
    args.reads = args.reads or (50 if args.quick else 200)
    backends = args.backends.split(",")
    print(f"event store benchmark: {n:,} events, batches of {args.batch:,}, backends {backends} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    results = {}
    _TMP = tempfile.mkdtemp(prefix="bench-event-store-")
    if "postgresql" in backends:
        from flywheel.pglocal import LocalPostgres

        # A bulk load writes GBs of WAL: with the default max_wal_size (1 GB) the server checkpoints
        # every few batches. fsync and synchronous_commit stay on (durable commits).
        _PG = LocalPostgres.start(settings={"max_wal_size": "'8GB'", "shared_buffers": "'512MB'"})
    try:
        for b in backends:
            results[b] = run_backend(b, args, n, reps)
    finally:
        if _PG is not None:
            _PG.stop()
        import shutil

        shutil.rmtree(_TMP, ignore_errors=True)
    if "duckdb" in results:
        naive_s = naive(n_naive)
        naive_rate = n_naive / naive_s
        d = results["duckdb"]
        print(f"  peer: naive 1 INSERT/event (DuckDB): {naive_rate:,.0f} events/s ({n_naive:,} events); batched / naive "
              f"{d['single_writer']['rate'] / naive_rate:.1f}x")
    if len(results) == 2:
        d, p = results["duckdb"], results["postgresql"]
        assert d["lineage_nodes"] == p["lineage_nodes"], "the backends disagree on the lineage"
        print("  same run, PostgreSQL / DuckDB: "
              f"1 writer x{p['single_writer']['rate'] / d['single_writer']['rate']:.2f}, "
              f"4 writers x{p['four_writers']['rate'] / d['four_writers']['rate']:.2f}, "
              f"append x1 x{statistics.median(p['single_append_ms']) / statistics.median(d['single_append_ms']):.2f}, "
              f"lineage down x{statistics.median(p['lineage_down_ms']) / statistics.median(d['lineage_down_ms']):.2f}")
        print("  targets: PostgreSQL 1 writer >= 50,000/s: "
              f"{'met' if p['single_writer']['rate'] >= 50_000 else 'NOT met'}; 4 writers >= 1.5x one: "
              f"{'met' if p['four_writers']['rate'] >= 1.5 * p['single_writer']['rate'] else 'NOT met'}; "
              f"lineage median <= 150 ms: {'met' if statistics.median(p['lineage_down_ms']) <= 150 else 'NOT met'}; "
              f"append x1 <= 5 ms: DuckDB {'met' if statistics.median(d['single_append_ms']) <= 5 else 'NOT met'}, "
              f"PostgreSQL {'met' if statistics.median(p['single_append_ms']) <= 5 else 'NOT met'}; "
              f"DuckDB 1 writer >= 200,000/s: {'met' if d['single_writer']['rate'] >= 200_000 else 'NOT met'}, "
              f"lineage <= 100 ms: {'met' if statistics.median(d['lineage_down_ms']) <= 100 else 'NOT met'}")
    print(f"  (load average at the end {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

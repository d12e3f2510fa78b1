"""Ingest throughput and peak memory: flywheel.ingest vs a naive baseline, measured in the same run.

    .venv/bin/python benchmarks/bench_ingest.py            # 1,000,000 traces
    .venv/bin/python benchmarks/bench_ingest.py --quick    # 100,000 traces
    .venv/bin/python benchmarks/bench_ingest.py --otlp     # OTLP/JSON spans + logs vs OpenAI JSONL, 100,000 each

Workload: synthetic OpenAI-format traces, mixed: ~55% successes, the rest failures of several kinds
(invalid JSON arguments, unknown tool, missing/wrong-typed arguments, no call against a correction,
thumbs-down), drawn from a pool of requests so failures repeat and deduplicate; ~1% carry an e-mail
or phone number to redact; 2% of lines are malformed (truncated JSON, wrong types, bad timestamps).

Flywheel: ``ingest_paths`` end to end (parse, validation, redaction, classification, GX suite per
batch, Parquet artifacts, events), in a child process so its peak RSS is measured alone.
Peer ("naive"): ``json.loads`` + one ``EventStore.append`` per trace with the whole trace as payload,
on 2,000 traces (it is too slow for more), also in a child process.

``--otlp``: the same traces as an OpenTelemetry Collector's file exporter writes what
opentelemetry-instrumentation-openai-v2 <= 2.3 emits (content in log records joined to their spans by
trace and span id): per trace an ``invoke_agent`` root span and a ``chat`` span (model, usage, response
id, finish reasons, error status), and ``gen_ai.system.message``, ``gen_ai.user.message`` and
``gen_ai.choice`` log records; export requests of 100 traces, the logs line before the spans line
every other batch. Peer: ``ingest_paths`` on the OpenAI-JSONL file of the same traces, in the same run.
Target: OTLP within 2x of the OpenAI path. Measured on this shared 2-core machine (load average 7.5-9.5,
other sessions running), 100,000 traces, 296 MB of OTLP/JSON vs 99 MB of JSONL, four runs: OTLP
1,356-1,596 traces/s vs OpenAI 2,676-3,101 (ratio 0.51x, 0.51x, 0.53x; one run 0.39x when the load rose
to 11.7 during the OTLP half); per CPU-second over all processes 2,937-3,582 vs 5,611-6,700 (0.48x-0.55x).
Peak RSS main ~640 MB + worker ~805 MB (OpenAI: ~700 + 599). Where the OTLP time goes (per trace, one
process, GC tuned as in the worker): JSON parse ~15 µs (3x the bytes), reading export requests into
traces ~40 µs (mostly turning log-record bodies into values), mapping to the trace record ~60 µs, then
the same validation/redaction/classification as OpenAI traces ~45 µs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CITIES = [f"City{i}" for i in range(400)]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a table.",
            "parameters": {
                "type": "object",
                "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}},
                "required": ["restaurant", "people"],
            },
        },
    },
]


def _trace(i: int, rng: random.Random) -> dict:
    city = rng.choice(CITIES)
    r = rng.random()
    user = f"Weather in {city} please"
    if rng.random() < 0.01:
        user += rng.choice([" and mail me at jane.doe@example.com", " call me on +44 20 7946 0958"])
    outcome = {"status": "success"}
    correction = None
    if r < 0.55:
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
            }
        ]
        content = None
    elif r < 0.65:
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "' + city},
            }
        ]
        content, outcome = None, {"status": "failure", "error": "bad json"}
    elif r < 0.72:
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "weather_now", "arguments": json.dumps({"city": city})},
            }
        ]
        content, outcome = None, {"status": "failure"}
    elif r < 0.80:
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'},
            }
        ]
        content, outcome = None, {"status": "failure"}
    elif r < 0.87:
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "book_table", "arguments": '{"restaurant": "X", "people": "two"}'},
            }
        ]
        content, outcome = None, {"status": "failure"}
    elif r < 0.94:
        calls, content = None, f"It is sunny in {city}."
        outcome = {"status": "failure"}
        correction = {"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]}
    else:
        calls, content = None, f"I cannot check {city}."
        outcome = {"status": "failure", "feedback": {"score": -1, "comment": "useless"}}
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    t = {
        "trace_id": f"bench-{i:08d}",
        "timestamp": f"2026-10-{1 + i % 28:02d}T{i % 24:02d}:00:00Z",
        "model": "agent-v3",
        "messages": [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": user},
            msg,
        ],
        "tools": TOOLS,
        "outcome": outcome,
        "metadata": {"tenant": "acme", "session": f"s-{i % 997}"},
    }
    if correction:
        t["correction"] = correction
    return t


def generate(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    bad = [
        b'{"trace_id": "broken", "timestamp": "2026-10-01T00:00:00Z", "messa',
        b'{"trace_id": 7, "timestamp": "2026-10-01T00:00:00Z", "model": "m", "messages": [], "outcome": {}}',
        b'{"trace_id": "ts", "timestamp": "not a time", "model": "m", "messages": [{"role": "user", "content": "x"}], "outcome": {"status": "success"}}',
    ]
    with open(path, "wb", buffering=1 << 22) as f:
        for i in range(n):
            if rng.random() < 0.02:
                f.write(rng.choice(bad) + b"\n")
            else:
                f.write(json.dumps(_trace(i, rng)).encode() + b"\n")


def _kv(key: str, v) -> dict:
    if isinstance(v, bool):
        val = {"boolValue": v}
    elif isinstance(v, int):
        val = {"intValue": str(v)}
    elif isinstance(v, float):
        val = {"doubleValue": v}
    elif isinstance(v, list):
        val = {"arrayValue": {"values": [_kv("", x)["value"] for x in v]}}
    elif isinstance(v, dict):
        val = {"kvlistValue": {"values": [_kv(k, x) for k, x in v.items()]}}
    else:
        val = {"stringValue": str(v)}
    return {"key": key, "value": val}


def _otlp_trace(i: int, t: dict) -> tuple[list[dict], list[dict]]:
    """(spans, log records) of one trace, as openai-v2 2.3 writes them."""
    # random-looking ids, as the SDK draws them (sequential ones are mostly zeros: digit runs that
    # the redaction prefilter would flag in every trace)
    h = hashlib.sha256(str(i).encode()).hexdigest()
    tid, root, chat = h[:32], h[32:48], h[48:64]
    t0 = 1_793_610_000_000_000_000 + i * 1_000_000_000
    sys_msg, user, answer = t["messages"]
    fail = t["outcome"]["status"] == "failure" and "error" in t["outcome"]
    attrs = [_kv("gen_ai.operation.name", "chat"), _kv("gen_ai.system", "openai"), _kv("gen_ai.request.model", t["model"]),
             _kv("gen_ai.request.temperature", 0.2), _kv("gen_ai.response.id", f"chatcmpl-{i:x}"),
             _kv("gen_ai.response.model", t["model"]), _kv("gen_ai.usage.input_tokens", 40 + i % 7),
             _kv("gen_ai.usage.output_tokens", 12 + i % 5),
             _kv("gen_ai.response.finish_reasons", ["tool_calls" if answer.get("tool_calls") else "stop"])]
    chat_span = {"traceId": tid, "spanId": chat, "parentSpanId": root, "name": f"chat {t['model']}", "kind": 3,
                 "startTimeUnixNano": str(t0 + 1000), "endTimeUnixNano": str(t0 + 900_000_000),
                 "attributes": attrs + ([_kv("error.type", "BadRequestError")] if fail else []),
                 "status": {"code": 2, "message": t["outcome"]["error"]} if fail else {}}
    fb = t["outcome"].get("feedback")
    root_span = {"traceId": tid, "spanId": root, "name": "invoke_agent weather", "kind": 1,
                 "startTimeUnixNano": str(t0), "endTimeUnixNano": str(t0 + 950_000_000),
                 "attributes": [_kv("gen_ai.operation.name", "invoke_agent")], "status": {},
                 "events": [{"name": "gen_ai.evaluation.result", "timeUnixNano": str(t0 + 940_000_000), "attributes": [
                     _kv("gen_ai.evaluation.score.value", float(fb["score"])),
                     _kv("gen_ai.evaluation.explanation", fb["comment"])]}] if fb else []}
    choice = {"role": "assistant"}
    if answer.get("content") is not None:
        choice["content"] = answer["content"]
    if answer.get("tool_calls"):
        choice["tool_calls"] = answer["tool_calls"]
    logs = []
    for k, (name, body) in enumerate([("gen_ai.system.message", {"content": sys_msg["content"]}),
                                      ("gen_ai.user.message", {"content": user["content"]}),
                                      ("gen_ai.choice", {"index": 0, "finish_reason": "stop", "message": choice})]):
        logs.append({"timeUnixNano": str(t0 + 2000 + k), "observedTimeUnixNano": str(t0 + 2000 + k),
                     "eventName": name, "body": _kv("", body)["value"], "attributes": [_kv("gen_ai.system", "openai")],
                     "traceId": tid, "spanId": chat})
    return [root_span, chat_span], logs


def generate_otlp(path: Path, n: int, seed: int = 0, per_request: int = 100) -> None:
    """The traces of :func:`generate` (no malformed lines) as Collector file-exporter lines."""
    rng = random.Random(seed)
    res = {"attributes": [_kv("service.name", "weather-agent")]}
    scope = {"name": "opentelemetry.instrumentation.openai_v2"}
    with open(path, "wb", buffering=1 << 22) as f:
        for start in range(0, n, per_request):
            spans, logs = [], []
            for i in range(start, min(n, start + per_request)):
                sp, lg = _otlp_trace(i, _trace(i, rng))
                spans += sp
                logs += lg
            sl = json.dumps({"resourceSpans": [{"resource": res, "scopeSpans": [{"scope": scope, "spans": spans}]}]})
            ll = json.dumps({"resourceLogs": [{"resource": res, "scopeLogs": [{"scope": scope, "logRecords": logs}]}]})
            f.write(((ll + "\n" + sl) if (start // per_request) % 2 else (sl + "\n" + ll)).encode() + b"\n")


def generate_openai(path: Path, n: int, seed: int = 0) -> None:
    """The same traces as :func:`generate_otlp`, as OpenAI-format JSONL (no malformed lines)."""
    rng = random.Random(seed)
    with open(path, "wb", buffering=1 << 22) as f:
        for i in range(n):
            f.write(json.dumps(_trace(i, rng)).encode() + b"\n")


def child_flywheel(path: str, home: str) -> None:
    from flywheel.artifacts import ArtifactStore
    from flywheel.config import load_config
    from flywheel.ingest import ingest_paths
    from flywheel.store import EventStore

    cfg = load_config(overrides={"home": home})
    cfg.ensure_home()
    with EventStore(cfg.warehouse) as store:
        t0 = time.perf_counter()
        s = ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [Path(path)])
        dt = time.perf_counter() - t0
    # Preparation runs in worker processes (flywheel.ingest.worker) that live alongside this one:
    # their peak (the largest of them, from ru_maxrss) counts towards the memory target too.
    main_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    worker_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"seconds": dt, "summary": s.to_dict() | {"files": None}, "main_mb": main_mb,
                      "worker_mb": worker_mb, "workers": cfg.ingest.workers}))


def child_naive(path: str, home: str, n: int) -> None:
    from flywheel.store import EventStore, NewEvent

    with EventStore(Path(home) / "naive.duckdb") as store:
        t0 = time.perf_counter()
        done = 0
        with open(path, "rb") as f:
            for line in f:
                if done >= n:
                    break
                try:
                    rec = json.loads(line)
                    store.append(f"trace:{rec['trace_id']}", NewEvent("trace.ingested", rec))
                except Exception:  # noqa: BLE001 - the naive peer just skips bad lines
                    pass
                done += 1
        dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "records": done}))


def _run_child(args: list[str]) -> tuple[dict, float, float]:
    """(result, peak RSS MB, CPU seconds). ru_maxrss of children is the max over all children so
    far: the big run goes first. CPU seconds (user + system) are reported because this machine is
    shared: wall-clock rates fall with the load average, CPU-time rates much less."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"child {args[1]} failed")
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return json.loads(out.stdout.strip().splitlines()[-1]), r1.ru_maxrss / 1024, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100,000 traces instead of 1,000,000")
    ap.add_argument("-n", type=int, default=None)
    # One append per trace runs at ~50-100 traces/s here: 2,000 measure its steady rate in under a minute.
    ap.add_argument("--naive-n", type=int, default=2_000)
    ap.add_argument("--otlp", action="store_true", help="OTLP/JSON spans + logs vs OpenAI JSONL (100,000 traces)")
    ap.add_argument("--child", choices=["flywheel", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--home", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "flywheel":
        return child_flywheel(a.path, a.home)
    if a.child == "naive":
        return child_naive(a.path, a.home, a.naive_n)
    if a.otlp:
        return main_otlp(a.n or 100_000)
    n = a.n or (100_000 if a.quick else 1_000_000)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        path = Path(tmp) / "traces.jsonl"
        t0 = time.perf_counter()
        generate(path, n)
        print(
            f"generated {n:,} traces ({path.stat().st_size / 1e6:,.0f} MB) in {time.perf_counter() - t0:.1f} s"
        )
        # Flush the generator's ~1 GB of dirty pages first: left to the kernel's writeback they compete
        # with the ingest's own commits (DuckDB fsyncs its WAL), which measured 17.5k traces/s instead
        # of 21.7k on the same machine minutes apart.
        t0 = time.perf_counter()
        os.sync()
        print(f"flushed the generated file to disk in {time.perf_counter() - t0:.1f} s")
        print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        fw, fw_rss, fw_cpu = _run_child(["--child", "flywheel", "--path", str(path), "--home", str(Path(tmp) / "fw")])
        s = fw["summary"]
        fw_rate = n / fw["seconds"]
        peak = fw["main_mb"] + fw["workers"] * fw["worker_mb"]
        print(
            f"flywheel.ingest: {n:,} lines in {fw['seconds']:.1f} s = {fw_rate:,.0f} traces/s wall, "
            f"{n / fw_cpu:,.0f} traces per CPU-second (all processes), peak RSS {peak:,.0f} MB "
            f"(main {fw['main_mb']:,.0f} + {fw['workers']} workers x {fw['worker_mb']:,.0f}, an upper bound)"
        )
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        print(
            f"  ingested {s['ingested']:,}, quarantined {s['quarantined']:,} {s['quarantined_by_reason']}, "
            f"failures {sum(s['failures_by_kind'].values()):,} in {s['new_failures']:,} distinct "
            f"(+{s['updated_failures']:,} updates), redactions {s['redactions_by_rule']}, events {s['events_appended']:,}"
        )
        nv, _, nv_cpu = _run_child(
            ["--child", "naive", "--path", str(path), "--home", tmp, "--naive-n", str(a.naive_n)]
        )
        nv_rate = nv["records"] / nv["seconds"]
        print(
            f"naive (json.loads + one append per trace): {nv['records']:,} traces in {nv['seconds']:.1f} s = {nv_rate:,.0f} traces/s"
        )
        print(
            f"ratio flywheel/naive: {fw_rate / nv_rate:.1f}x  (targets: >= 20,000 traces/s, peak RSS < 2,048 MB)"
        )
        du = sum(f.stat().st_size for f in (Path(tmp) / "fw").rglob("*") if f.is_file())
        print(f"home size after ingest: {du / 1e6:,.0f} MB")


def main_otlp(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-ingest-otlp-") as tmp:
        oa, ot = Path(tmp) / "openai.jsonl", Path(tmp) / "otlp.jsonl"
        t0 = time.perf_counter()
        generate_openai(oa, n)
        generate_otlp(ot, n)
        os.sync()
        print(f"generated {n:,} traces twice: OpenAI JSONL {oa.stat().st_size / 1e6:,.0f} MB, OTLP/JSON spans + logs "
              f"{ot.stat().st_size / 1e6:,.0f} MB, in {time.perf_counter() - t0:.1f} s")
        rates = {}
        for name, path in (("openai", oa), ("otlp", ot)):
            print(f"load average before {name}: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            r, rss, cpu = _run_child(["--child", "flywheel", "--path", str(path), "--home", str(Path(tmp) / name)])
            s = r["summary"]
            rates[name] = n / r["seconds"]
            print(f"{name:>6}: {n:,} traces in {r['seconds']:.1f} s = {rates[name]:,.0f} traces/s wall, "
                  f"{n / cpu:,.0f} per CPU-second; ingested {s['ingested']:,}, quarantined {s['quarantined']:,} "
                  f"{s['quarantined_by_reason']}, failures {sum(s['failures_by_kind'].values()):,}, "
                  f"peak RSS main {r['main_mb']:,.0f} MB + worker {r['worker_mb']:,.0f} MB")
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        print(f"ratio OTLP/JSON (spans + logs joined) / OpenAI JSONL: {rates['otlp'] / rates['openai']:.2f}x "
              "(target: >= 0.5x)")


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    main()

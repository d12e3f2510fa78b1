"""Real telemetry in, the expected traces out: an ``openai`` client instrumented by the real packages.

Each set-up runs ``tests/integration/otel_agent.py`` in a subprocess (instrumentation patches the
``openai`` module globally and reads its settings from the environment at start): a tool loop under
an agent span, a lone chat call and a failing call, against this project's ``flywheel serve`` (in
this process, on a free loopback port) whose policy is the tiny model, with scripted answers for
the tool-calling turns (a random tiny model never writes a parseable call). Spans and log records are
encoded by the real OTLP protobuf encoder, converted to OTLP/JSON here as a Collector's file exporter
writes it (lowercase hex ids), and ingested with ``--format auto``.

Set-ups (the findings, one per row of the report that started this):

- openai-v2 2.3 (``.venv-otel23``: it cannot share an environment with 2.4), content ``true``:
  content lives in log records -> :func:`test_openai_v2_23_log_events_are_joined_to_their_spans`
- openai-v2 2.4, ``true`` (the value documented for 2.3, refused by 2.4): no content at all ->
  :func:`test_content_capture_off_is_named_with_the_setting_to_change`
- openai-v2 2.4, ``span_only`` / ``span_and_event`` / ``event_only``: no ``gen_ai.tool.definitions``
  -> :func:`test_openai_v2_24_content_modes_ingest_every_trace` (tools undeclared, nothing quarantined)
- OpenInference, default and with ``OPENINFERENCE_ENABLE_GENAI_SEMCONV=true`` ->
  :func:`test_openinference_spans_are_read`
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flywheel.artifacts import ArtifactStore, load_traces
from flywheel.ingest import ingest_paths
from flywheel.policy.base import Sample, SamplingParams
from flywheel.policy.testing import session_tiny_home, tiny_policy
from flywheel.serve import ServeLimits, create_app, run_in_thread, static_provider

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).with_name("otel_agent.py")
REQS_23 = Path(__file__).with_name("requirements-otel23.txt")
WEATHER_CALL = "[get_weather(city='Paris')]"
WEATHER_ANSWER = "It is 21 degrees and sunny in Paris."
WEATHER_SPEC = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ScriptedTiny:
    """The tiny model, except for the weather agent's two turns: a call, then the answer after the
    tool result. Token ids and usage are the tiny model's tokenizer's, so usage is real."""

    def __init__(self, inner: Any):
        self.inner, self.name, self.version = inner, "tiny", "tiny"
        self.tokenizer = inner.tokenizer

    def generate(self, prompts, params=None, *, tools=None):
        p = params if isinstance(params, SamplingParams) else SamplingParams(n=params or 1)
        out = []
        for i, msgs in enumerate(prompts):
            t = [tools[i]] if tools and isinstance(tools[0], list) else tools
            last = msgs[-1]
            script = None
            if last.get("role") == "tool":
                script = WEATHER_ANSWER
            elif last.get("role") == "user" and "weather" in str(last.get("content")):
                script = WEATHER_CALL
            if script is None:
                out += self.inner.generate([msgs], p, tools=t)
                continue
            (probe,) = self.inner.generate([msgs], replace(p, n=1, max_new_tokens=1), tools=t)
            ids = self.tokenizer(script, add_special_tokens=False)["input_ids"]
            out.append([Sample(script, probe[0].prompt_token_ids, ids, [0.0] * len(ids), "stop", False, 1.0)
                        for _ in range(p.n)])
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model on a busy 2-core machine (see tests/unit/test_policy.py)
    policy = ScriptedTiny(tiny_policy(session_tiny_home(tmp_path_factory), name="tiny"))
    app = create_app(static_provider("tiny", policy), limits=ServeLimits(max_tokens=64, max_n=2))
    try:
        with run_in_thread(app) as url:
            yield url
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def otel23_python() -> str:
    """The interpreter of ``.venv-otel23`` (built by ``make setup``; built here when missing)."""
    venv = ROOT / ".venv-otel23"
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not (stamp.exists() and stamp.stat().st_mtime >= REQS_23.stat().st_mtime and py.exists()):
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(REQS_23)], check=True,
                           capture_output=True, timeout=900)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            tail = (getattr(e, "stderr", b"") or b"")[-1500:].decode(errors="replace")
            pytest.skip(f"cannot build {venv} (needs the package index once; `make setup` does it): {tail}")
        stamp.touch()
    return str(py)


# -- OTLP protobuf -> OTLP/JSON, as the Collector's file exporter writes it (written here, independently
# of flywheel's own converter, so the reader is tested against the format, not against itself) ---------
_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str) else _hex_ids(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(x) for x in node]
    return node


def otlp_json(out: Path) -> tuple[dict, dict | None]:
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = MessageToDict(ExportTraceServiceRequest.FromString((out / "traces.pb").read_bytes()),
                          use_integers_for_enums=True)
    raw_logs = (out / "logs.pb").read_bytes()
    logs = MessageToDict(ExportLogsServiceRequest.FromString(raw_logs), use_integers_for_enums=True) if raw_logs else None
    return _hex_ids(spans), _hex_ids(logs) if logs else None


def run_agent(server: str, tmp: Path, instrumentation: str, content: str | None, *, python: str | None = None,
              env: dict[str, str] | None = None) -> tuple[dict, dict, dict | None]:
    args = {"base_url": server + "/v1", "model": "tiny", "instrumentation": instrumentation, "content": content,
            "env": env or {}, "out": str(tmp)}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENINFERENCE_"))}
    r = subprocess.run([python or sys.executable, str(AGENT), json.dumps(args)], capture_output=True, text=True,
                       timeout=300, env=clean, cwd=tmp.parent)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    spans, logs = otlp_json(tmp)
    return report, spans, logs


def collector_file(path: Path, spans: dict, logs: dict | None) -> Path:
    """One export request per line (logs first: the order in a Collector's file is not guaranteed)."""
    lines = ([json.dumps(logs)] if logs else []) + [json.dumps(spans)]
    path.write_text("\n".join(lines) + "\n")
    return path


def ingest(cfg, store, paths: list[Path]):
    arts = ArtifactStore(cfg.artifacts_dir)
    s = ingest_paths(cfg, store, arts, paths)
    traces = {}
    for e in store.entities("trace"):
        full = load_traces(arts, [e["state"]])[0]
        traces[full["trace_id"]] = full
    return s, traces


def _by_first_user(traces: dict) -> dict[str, dict]:
    out = {}
    for t in traces.values():
        user = next(m["content"] for m in t["messages"] if m["role"] == "user")
        out[user] = t
    return out


def check_weather_agent(t: dict, report: dict, *, tools_emitted: bool) -> None:
    rep = report["weather"]
    assert t["trace_id"] == rep["trace_id"] and t["source"] == "otel"
    assert [m["role"] for m in t["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert t["messages"][0]["content"] == "You answer weather questions."
    call = t["messages"][2]["tool_calls"][0]
    (want,) = rep["tool_calls"]
    assert call["id"] == want["id"] and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert t["messages"][3] == {"role": "tool", "tool_call_id": want["id"], "content": '{"temperature_c": 21}'}
    assert t["messages"][4]["content"] == WEATHER_ANSWER == rep["answer"]
    assert t["outcome"] == {"status": "success"} and t["model"] == "tiny"
    meta = t["metadata"]
    if tools_emitted:
        assert t["tools"] == [WEATHER_SPEC] and "tool_schema_sources" not in meta
    else:
        assert t["tools"] == [] and meta["tool_schema_sources"] == {"get_weather": "none"}
    usage = rep["usage"]
    assert meta["usage"] == {"input_tokens": sum(u["prompt_tokens"] for u in usage),
                             "output_tokens": sum(u["completion_tokens"] for u in usage), "calls": 2}
    assert meta["response_id"] == rep["response_ids"][1] and meta["finish_reasons"] == ["stop"]
    assert [c["response_id"] for c in meta["calls"]] == rep["response_ids"]
    # as recorded: OpenAI's "tool_calls", or the GenAI convention's "tool_call" (OpenInference's GenAI mode)
    assert [c["finish_reasons"] for c in meta["calls"]] in ([["tool_calls"], ["stop"]], [["tool_call"], ["stop"]])
    assert meta["calls"][0]["request"]["temperature"] == 0.5 and meta["calls"][0]["request"]["max_tokens"] == 32
    assert meta["request"]["max_tokens"] == 32
    assert meta["otel"]["service"] == "weather-agent" and meta["otel"]["spans"] == 3


def check_plain_and_error(traces: dict, report: dict) -> None:
    by_user = _by_first_user(traces)
    plain = by_user["Say hello."]
    assert [m["role"] for m in plain["messages"]] == ["user", "assistant"]
    assert plain["messages"][1]["content"] == report["plain"]["answer"]
    assert plain["metadata"]["usage"]["output_tokens"] == report["plain"]["usage"][0]["completion_tokens"]
    assert plain["metadata"]["response_id"] == report["plain"]["response_ids"][0]
    assert plain["metadata"]["request"]["temperature"] == 0.0
    err = by_user["Hi?"]
    assert err["outcome"]["status"] == "failure" and err["model"] == "no-such-model"
    assert err["outcome"]["error"].startswith("NotFoundError: ") and "404" in err["outcome"]["error"]
    assert report["error"] == {"raised": "NotFoundError", "status": 404}


# -- the set-ups ----------------------------------------------------------------------------------------
def test_openai_v2_23_log_events_are_joined_to_their_spans(server, otel23_python, tmp_path, cfg, store):
    report, spans, logs = run_agent(server, tmp_path / "run", "openai-v2", "true", python=otel23_python)
    assert logs is not None and report["counts"]["logs"] >= 8  # the content is in log records
    assert "gen_ai.input.messages" not in json.dumps(spans) and "What's the weather" not in json.dumps(spans)
    s, traces = ingest(cfg, store, [collector_file(tmp_path / "otel.jsonl", spans, logs)])
    assert s.quarantined_by_reason == {} and s.ingested == 3
    check_weather_agent(traces[report["weather"]["trace_id"]], report, tools_emitted=False)
    check_plain_and_error(traces, report)
    assert traces[report["weather"]["trace_id"]]["metadata"]["otel"]["convention"] == "genai-events"


def test_openai_v2_23_paired_files_and_a_lone_log_file(server, otel23_python, tmp_path, cfg, store):
    """A Collector with one file exporter per signal writes spans and logs to two files: given together
    they join; the log file alone is refused with a message saying where the spans are."""
    from flywheel.ingest import IngestError

    report, spans, logs = run_agent(server, tmp_path / "run", "openai-v2", "true", python=otel23_python)
    tr, lg = tmp_path / "traces.jsonl", tmp_path / "logs.jsonl"
    tr.write_text(json.dumps(spans) + "\n")
    lg.write_text(json.dumps(logs) + "\n")
    arts = ArtifactStore(cfg.artifacts_dir)
    with pytest.raises(IngestError, match="only OTLP log records.*give the spans file in the same command"):
        ingest_paths(cfg, store, arts, [lg])
    assert store.last_seq() == 0  # refused before anything was read
    s, traces = ingest(cfg, store, [lg, tr])
    assert s.quarantined_by_reason == {} and s.ingested == 3
    check_weather_agent(traces[report["weather"]["trace_id"]], report, tools_emitted=False)
    check_plain_and_error(traces, report)


def test_content_capture_off_is_named_with_the_setting_to_change(server, otel23_python, tmp_path, cfg, store):
    """openai-v2 2.4 refuses the documented ``true`` (it wants span_only/...) and records no content;
    2.3 with capture off writes log records without content. Both say which setting to change."""
    r24, s24, l24 = run_agent(server, tmp_path / "r24", "openai-v2", "true")
    r23, s23, l23 = run_agent(server, tmp_path / "r23", "openai-v2", "false", python=otel23_python)
    s, traces = ingest(cfg, store, [collector_file(tmp_path / "a.jsonl", s24, l24),
                                    collector_file(tmp_path / "b.jsonl", s23, l23)])
    assert s.ingested == 0 and s.quarantined_by_reason == {"otel_content_not_captured": 6}
    from flywheel.ingest import list_quarantine, show_quarantine

    details = [r["detail"] for b in list_quarantine(store)
               for r in show_quarantine(store, ArtifactStore(cfg.artifacts_dir), b["stream"])]
    assert len(details) == 6
    for d in details:
        assert "content capture is off" in d
        assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=span_only" in d
        assert "OPENINFERENCE_HIDE_INPUTS" in d


@pytest.mark.parametrize("mode", ["span_only", "span_and_event", "event_only"])
def test_openai_v2_24_content_modes_ingest_every_trace(server, tmp_path, cfg, store, mode):
    report, spans, logs = run_agent(server, tmp_path / "run", "openai-v2", mode)
    if mode == "event_only":
        assert "gen_ai.input.messages" not in json.dumps(spans) and logs is not None
    s, traces = ingest(cfg, store, [collector_file(tmp_path / "otel.jsonl", spans, logs)])
    assert s.quarantined_by_reason == {} and s.ingested == 3
    t = traces[report["weather"]["trace_id"]]
    check_weather_agent(t, report, tools_emitted=False)  # 2.4 writes no gen_ai.tool.definitions
    check_plain_and_error(traces, report)
    assert t["metadata"]["otel"]["convention"] == ("genai-details" if mode == "event_only" else "genai-span")


@pytest.mark.parametrize("genai_semconv", [False, True])
def test_openinference_spans_are_read(server, tmp_path, cfg, store, genai_semconv):
    env = {"OPENINFERENCE_ENABLE_GENAI_SEMCONV": "true"} if genai_semconv else {}
    report, spans, logs = run_agent(server, tmp_path / "run", "openinference", None, env=env)
    assert "llm.input_messages.0.message.role" in json.dumps(spans)
    s, traces = ingest(cfg, store, [collector_file(tmp_path / "otel.jsonl", spans, logs)])
    assert s.quarantined_by_reason == {} and s.ingested == 3
    t = traces[report["weather"]["trace_id"]]
    check_weather_agent(t, report, tools_emitted=True)
    check_plain_and_error(traces, report)


def test_tool_registry_supplies_the_schemas_the_telemetry_lacks(server, tmp_path, cfg, store):
    from flywheel.config import load_config

    report, spans, logs = run_agent(server, tmp_path / "run", "openai-v2", "span_only")
    reg = tmp_path / "tools"
    reg.mkdir()
    (reg / "weather.json").write_text(json.dumps([WEATHER_SPEC]))
    cfg2 = load_config(overrides={"home": str(cfg.home), "ingest": {"tool_registry": str(reg)}})
    s, traces = ingest(cfg2, store, [collector_file(tmp_path / "otel.jsonl", spans, logs)])
    assert s.quarantined_by_reason == {} and s.ingested == 3
    t = traces[report["weather"]["trace_id"]]
    assert t["tools"] == [WEATHER_SPEC] and t["metadata"]["tool_schema_sources"] == {"get_weather": "registry"}


def test_collector_json_lines_and_a_single_document_give_the_same_events(server, tmp_path, cfg, store):
    """One export request per line (two lines here, spans and logs) vs the same requests merged into
    one pretty-printed JSON document: the same trace.ingested events."""
    report, spans, logs = run_agent(server, tmp_path / "run", "openai-v2", "span_and_event")
    assert logs is not None
    lines = collector_file(tmp_path / "lines.jsonl", spans, logs)
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps({**spans, **logs}, indent=2))
    arts = ArtifactStore(cfg.artifacts_dir)
    a = ingest_paths(cfg, store, arts, [lines])
    first = {e.stream: e.payload for e in store.read(types=["trace.ingested"])}
    b = ingest_paths(cfg, store, arts, [doc])
    assert a.ingested == 3 and a.quarantined == 0
    assert b.ingested == 0 and b.duplicates == 3 and b.quarantined == 0  # the same traces, nothing new
    from flywheel.config import load_config
    from flywheel.store import open_store

    cfg2 = load_config(overrides={"home": str(tmp_path / "other-home")})
    cfg2.ensure_home()
    with open_store(cfg2) as store2:
        ingest_paths(cfg2, store2, ArtifactStore(cfg2.artifacts_dir), [doc])
        second = {e.stream: e.payload for e in store2.read(types=["trace.ingested"])}
        full2 = {e["entity_id"]: load_traces(ArtifactStore(cfg2.artifacts_dir), [e["state"]])[0]
                 for e in store2.entities("trace")}
    full1 = {e["entity_id"]: load_traces(arts, [e["state"]])[0] for e in store.entities("trace")}
    strip = lambda p: {k: v for k, v in p.items() if k != "trace"}  # noqa: E731 - artifact ids differ per file
    assert {k: strip(v) for k, v in first.items()} == {k: strip(v) for k, v in second.items()}
    assert full1 == full2


def test_dry_run_reports_what_would_be_captured_per_trace(server, tmp_path, cfg, monkeypatch):
    """``flywheel ingest --dry-run --json`` on real 2.4 spans: per trace its messages, tools (and where
    their schemas come from), tool calls and errors; a no-content file says what to switch on."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    report, spans, logs = run_agent(server, tmp_path / "run", "openai-v2", "span_only")
    path = collector_file(tmp_path / "otel.jsonl", spans, logs)
    r = CliRunner().invoke(app, ["ingest", "--dry-run", "--json", str(path), "--home", str(cfg.home)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    by_id = {t["trace_id"]: t for t in out["traces"]}
    w = by_id[report["weather"]["trace_id"]]
    assert w["roles"] == {"assistant": 2, "system": 1, "tool": 1, "user": 1} and w["tool_calls"] == ["get_weather"]
    assert w["tools"] == [] and w["tool_schema_sources"] == {"get_weather": "none"} and w["status"] == "success"
    assert w["convention"] == "genai-span" and w["usage"]["calls"] == 2
    assert sorted(t["status"] for t in out["traces"]) == ["failure", "success", "success"]
    assert out["summary"] == {"traces": 3, "quarantined": 0, "quarantined_by_reason": {}, "with_tool_calls": 1,
                              "with_tools_without_schema": 1, "failures": 1}
    assert not (cfg.home / "warehouse.duckdb").exists()  # nothing stored
    # the human-readable form names the trace, the calls and the error
    from flywheel.cli import common

    monkeypatch.setattr(common.out, "width", 250)  # rich wraps table cells at the default 80 columns
    r = CliRunner().invoke(app, ["ingest", "--dry-run", str(path), "--home", str(cfg.home)])
    assert r.exit_code == 0 and "get_weather" in r.output and "NotFoundError" in r.output and "nothing stored" in r.output
    # content capture off: the reason names the setting
    _, s_off, l_off = run_agent(server, tmp_path / "off", "openai-v2", "true")
    off = collector_file(tmp_path / "off.jsonl", s_off, l_off)
    r = CliRunner().invoke(app, ["ingest", "--dry-run", "--json", str(off), "--home", str(cfg.home)])
    out = json.loads(r.stdout)
    assert out["summary"]["quarantined_by_reason"] == {"otel_content_not_captured": 3}
    assert "span_only" in out["quarantined"][0]["detail"]


def test_collect_receives_otlp_http_and_writes_what_ingest_reads(server, tmp_path, cfg, store, it):
    """``flywheel collect`` as its own process: the real OTLP/HTTP protobuf exporter (gzip) sends the
    spans, OTLP/JSON log records are POSTed as JSON; SIGTERM writes what it holds, atomically, to the
    inbox; ingesting the inbox gives the same traces as the Collector-style file of the same data."""
    import signal

    import httpx

    port = it.free_port()
    inbox = tmp_path / "inbox"
    log = tmp_path / "collect.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([str(it.VENV_BIN / "flywheel"), "collect", "--port", str(port), "--inbox", str(inbox),
                                 "--home", str(tmp_path / "collect-home"), "--settle-s", "600", "--max-age-s", "3600", "--json"],
                                stdout=subprocess.PIPE, stderr=fh, env=it.clean_env(), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        import time

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the port answers (or the process died)
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        args = {"base_url": server + "/v1", "model": "tiny", "instrumentation": "openai-v2",
                "content": "span_and_event", "out": str(tmp_path / "run"), "otlp_endpoint": url, "export_logs": False}
        r = subprocess.run([sys.executable, str(AGENT), json.dumps(args)], capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
        assert r.returncode == 0, r.stderr[-3000:]
        report = json.loads(r.stdout.strip().splitlines()[-1])
        assert report["exported"] == {"spans": "SUCCESS"}
        spans, logs = otlp_json(tmp_path / "run")
        resp = httpx.post(url + "/v1/logs", content=json.dumps(logs), headers={"Content-Type": "application/json"})
        assert resp.status_code == 200 and resp.json() == {}
        bad = httpx.post(url + "/v1/traces", content=b"\x00garbage", headers={"Content-Type": "application/x-protobuf"})
        assert bad.status_code == 400
        assert list(inbox.glob("*.jsonl")) == []  # held until the trace settles or the receiver stops
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        it.kill_group(proc)
    assert proc.returncode == 0, log.read_text()
    summary = json.loads(out)
    assert summary["requests"] == 2 and summary["rejected"] == 1 and summary["traces_written"] == 3
    files = sorted(inbox.iterdir())
    assert [f.suffix for f in files] == [".jsonl"] and not [f for f in files if f.name.startswith(".")]
    s, traces = ingest(cfg, store, [inbox])
    assert s.quarantined_by_reason == {} and s.ingested == 3
    check_weather_agent(traces[report["weather"]["trace_id"]], report, tools_emitted=False)
    check_plain_and_error(traces, report)

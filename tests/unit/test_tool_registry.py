"""Tool calls whose tools the trace does not declare: ingested as undeclared, filled from the
``[ingest] tool_registry``, and compiled into evals that say where each schema came from."""

from __future__ import annotations

import json

import pytest

from flywheel.artifacts import ArtifactStore
from flywheel.config import load_config
from flywheel.envs.harness import verify_task
from flywheel.evals import build_evals
from flywheel.ingest import IngestError, ingest_paths
from flywheel.tool_registry import ToolRegistry, ToolRegistryError, resolve_undeclared

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _call(name: str, args: dict, cid: str = "call_1") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def _trace(tid: str, user: str, answer: dict, *, status: str = "success", error: str | None = None, tools=None) -> dict:
    t = {"trace_id": tid, "timestamp": "2026-11-02T09:00:00Z", "model": "agent",
         "messages": [{"role": "user", "content": user}, answer],
         "outcome": {"status": status, **({"error": error} if error else {})}}
    if tools is not None:
        t["tools"] = tools
    return t


def _ingest(cfg, store, tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [p])


def _evals_by_origin(store):
    out = {}
    for e in store.entities("eval"):
        st = e["state"]
        out[st["metadata"]["origin_trace"]] = st
    return out


def test_a_successful_call_of_an_undeclared_tool_is_ingested_not_quarantined(cfg, store, tmp_path):
    """On main this trace was quarantined ``tool_not_declared``: telemetry that records the call but not
    the definition (openai-v2 2.4) lost every tool-calling trace."""
    s = _ingest(cfg, store, tmp_path, [_trace("u-ok", "Weather in Oslo?", _call("get_weather", {"city": "Oslo"}))])
    assert s.quarantined_by_reason == {} and s.ingested == 1
    # a record that declares tools and calls another one still contradicts itself
    bad = _trace("u-bad", "Weather in Oslo?", _call("weather_now", {"city": "Oslo"}), tools=[WEATHER])
    assert _ingest(cfg, store, tmp_path, [bad], "b.jsonl").quarantined_by_reason == {"tool_not_declared": 1}


def test_a_failure_calling_an_undeclared_tool_is_not_an_unknown_tool(cfg, store, tmp_path):
    row = _trace("u-fail", "Find flights to Rome", _call("search_flights", {"to": "Rome"}), status="failure",
                 error="TimeoutError: flight search backend timed out")
    _ingest(cfg, store, tmp_path, [row])
    (f,) = [e["state"] for e in store.entities("failure")]
    assert f["kinds"] == ["runtime_exception"] and f["tool_schema_sources"] == {"search_flights": "none"}
    assert any("no schema was recorded" in d for d in f["details"])


def test_evals_say_where_each_schema_came_from(cfg, store, tmp_path):
    reg = tmp_path / "registry.json"
    reg.write_text(json.dumps({"tools": [WEATHER]}))
    cfg = load_config(overrides={"home": str(cfg.home), "ingest": {"tool_registry": str(reg)}})
    rows = [
        _trace("s-trace", "Weather in Lima?", _call("get_weather", {"city": "Lima"}), tools=[WEATHER]),
        _trace("s-registry", "Weather in Oslo?", _call("get_weather", {"city": "Oslo"})),
        _trace("s-none", "Find flights to Rome", _call("search_flights", {"to": "Rome"})),
        _trace("f-none", "Find flights to Paris", _call("search_flights", {"to": "Paris"}), status="failure",
               error="TimeoutError: flight search backend timed out"),
    ]
    assert _ingest(cfg, store, tmp_path, rows).ingested == 4
    summary = build_evals(cfg, store, ArtifactStore(cfg.artifacts_dir))
    assert not [s for s in summary.skipped if "f-none" in s["origin"]]
    ev = _evals_by_origin(store)
    trace_src, reg_src = ev["trace:s-trace"]["metadata"], ev["trace:s-registry"]["metadata"]
    none_src, fail = ev["trace:s-none"]["metadata"], ev["trace:f-none"]
    assert trace_src["tool_schema_sources"] == {"get_weather": "trace"} and trace_src["weak"] is False
    assert reg_src["tool_schema_sources"] == {"get_weather": "registry"} and reg_src["weak"] is False
    assert none_src["tool_schema_sources"] == {"search_flights": "none"} and none_src["weak"] is True
    assert fail["metadata"]["tool_schema_sources"] == {"search_flights": "none"} and fail["metadata"]["weak"] is True
    assert fail["verifier"]["kind"] == "tool_call" and summary.to_dict()["evals_with_tools_without_schema"] == 2

    def grade(state, answer):
        task = {k: state[k] for k in ("task_id", "prompt", "verifier", "harness", "tool_env", "reference", "metadata")}
        return verify_task(task, [*task["prompt"]["messages"], answer])

    # with a schema the types are checked; without one only what can be: the name, an object of arguments
    assert grade(ev["trace:s-registry"], _call("get_weather", {"city": "Oslo"})).passed
    assert not grade(ev["trace:s-registry"], _call("get_weather", {"city": 7})).passed
    assert grade(ev["trace:s-none"], _call("search_flights", {"to": "Rome"})).passed  # the recorded answer
    assert not grade(ev["trace:s-none"], _call("book_hotel", {"to": "Rome"})).passed
    assert grade(fail, _call("search_flights", {"to": "Paris", "anything": 1})).passed  # weak: validity only
    assert not grade(fail, {"role": "assistant", "content": "I cannot search flights."}).passed


def test_registry_files_and_their_errors(tmp_path):
    d = tmp_path / "reg"
    (d / "sub").mkdir(parents=True)
    (d / "a.json").write_text(json.dumps(WEATHER))
    flat = {"type": "function", "name": "search", "parameters": {"type": "object"}}
    (d / "sub" / "b.json").write_text(json.dumps([flat]))
    reg = ToolRegistry.load(d)
    assert sorted(reg.specs) == ["get_weather", "search"] and reg.get("search")["function"]["name"] == "search"
    (d / "c.json").write_text(json.dumps(WEATHER))
    with pytest.raises(ToolRegistryError, match="'get_weather' is defined twice"):
        ToolRegistry.load(d)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"description": "no name"}]')
    with pytest.raises(ToolRegistryError, match="entry 0 is not an OpenAI function spec"):
        ToolRegistry.load(bad)
    rec = {"messages": [{"role": "user", "content": "x"}]}
    assert resolve_undeclared(rec, reg) is rec  # nothing called: untouched


def test_a_bad_registry_is_refused_before_anything_is_read(cfg, store, tmp_path):
    cfg = load_config(overrides={"home": str(cfg.home), "ingest": {"tool_registry": str(tmp_path / "missing.json")}})
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(_trace("x", "hi", {"role": "assistant", "content": "hello"})) + "\n")
    with pytest.raises(IngestError, match="tool_registry .*missing.json: no such file"):
        ingest_paths(cfg, store, ArtifactStore(cfg.artifacts_dir), [p])
    assert store.last_seq() == 0

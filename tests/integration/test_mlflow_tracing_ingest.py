"""MLflow Tracing as a trace source, end to end with real parts only: a real ``mlflow server``, a real
``flywheel serve`` process (tiny model), an agent written against the real ``openai`` client with
MLflow's own OpenAI autologging (``mlflow.openai.autolog()``), then ``flywheel ingest --from mlflow``.

The agent runs in its own process: autologging patches the ``openai`` package and MLflow's fluent
tracing keeps global state, neither of which may leak into other tests. It records three traces:
a plain question (then a human thumbs-down on it), an agent turn that calls a tool and answers from
its result (a TOOL span between two chat calls; the second call carries the tool call and the tool
result in its history), and the same agent whose tool raises.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXPERIMENT = "support-agent"

AGENT = r"""
import json, sys
import mlflow, openai
from mlflow.entities import AssessmentSource, AssessmentSourceType

base_url, experiment = sys.argv[1], sys.argv[2]
mlflow.set_experiment(experiment)
mlflow.openai.autolog()
client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused-on-loopback", max_retries=0, timeout=120)
model = client.models.list().data[0].id
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a weather assistant. Call get_weather when asked about weather."}
ids = {}

client.chat.completions.create(model=model, messages=[SYSTEM, {"role": "user", "content": "Is it raining in Oslo?"}],
                               tools=TOOLS, max_tokens=8, temperature=0)
ids["plain"] = mlflow.get_last_active_trace_id()


@mlflow.trace(span_type="AGENT")
def agent(question, fail):
    history = [SYSTEM, {"role": "user", "content": question}]
    client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    call = {"id": "call_weather_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    with mlflow.start_span("get_weather", span_type="TOOL") as span:
        span.set_inputs({"city": "Paris"})
        if fail:
            raise TimeoutError("weather service timed out after 5 s")
        span.set_outputs({"forecast": "sunny, 21 C"})
    history += [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_weather_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    return r.choices[0].message.content


agent("What is the weather in Paris?", False)
ids["agent"] = mlflow.get_last_active_trace_id()
try:
    agent("And in Paris tomorrow?", True)
except TimeoutError:
    pass
ids["agent_tool_error"] = mlflow.get_last_active_trace_id()
mlflow.flush_trace_async_logging()
mlflow.log_feedback(trace_id=ids["plain"], name="user_thumbs", value=False, rationale="did not answer",
                    source=AssessmentSource(source_type=AssessmentSourceType.HUMAN, source_id="user-42"))
print(json.dumps(ids))
"""


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    from flywheel.policy.testing import session_tiny_home

    return session_tiny_home(tmp_path_factory)


@pytest.fixture(scope="module")
def traced(mlflow_server, tiny_home, tmp_path_factory, it):
    """The agent's traces on the MLflow server: ``(ids, serve url)``."""
    root = tmp_path_factory.mktemp("mlflow-tracing")
    port = it.free_port()
    serve = it.ServerProcess(
        "flywheel serve", [str(it.VENV_BIN / "flywheel"), "serve", "--model", "tiny", "--home", str(tiny_home),
                           "--port", str(port)],
        port=port, health_path="/health", env=it.clean_env(), log=root / "serve.log", cwd=root)
    try:
        serve.wait_healthy(300)
        agent = subprocess.run([sys.executable, "-c", AGENT, serve.url, EXPERIMENT], capture_output=True, text=True,
                               timeout=600, cwd=root, env=it.clean_env(MLFLOW_TRACKING_URI=mlflow_server.url))
    finally:
        serve.stop()
    assert agent.returncode == 0, agent.stderr[-4000:]
    ids = json.loads(agent.stdout.strip().splitlines()[-1])
    return ids, root


def _ingest(it, home: Path, mlflow_url: str, *extra: str) -> dict:
    p = subprocess.run([str(it.VENV_BIN / "flywheel"), "ingest", "--from", "mlflow", "--experiment", EXPERIMENT,
                        "--home", str(home), "--json", *extra], capture_output=True, text=True, timeout=600,
                       env=it.clean_env(MLFLOW_TRACKING_URI=mlflow_url))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_autologged_openai_traces_come_in_with_messages_and_tool_calls(traced, mlflow_server, it):
    from flywheel.artifacts import load_traces, open_artifacts
    from flywheel.config import load_config
    from flywheel.store import open_store

    ids, root = traced
    home = root / "home"
    first = _ingest(it, home, mlflow_server.url)
    assert (first["read"], first["ingested"], first["quarantined"], first["duplicates"]) == (3, 3, 0, 0), first
    assert first["failures_by_kind"].get("negative_feedback") == 1
    assert first["files"][0]["tracking_uri"] == mlflow_server.url

    cfg = load_config(overrides={"home": str(home)}, environ={})
    with open_store(cfg, read_only=True) as store:
        events = {e.stream.split(":", 1)[1]: e.payload for e in store.read(types=["trace.ingested"])}
        n_events = len(store.read())
        traces = {p["trace_id"]: t for p, t in zip(events.values(), load_traces(open_artifacts(cfg), list(events.values())),
                                                    strict=True)}
    assert set(traces) == set(ids.values())

    plain = traces[ids["plain"]]
    assert plain["source"] == "mlflow" and plain["source_id"] == ids["plain"]
    assert [m["role"] for m in plain["messages"]] == ["system", "user", "assistant"]
    assert plain["messages"][1]["content"] == "Is it raining in Oslo?"
    assert [t["function"]["name"] for t in plain["tools"]] == ["get_weather"]
    assert plain["outcome"]["feedback"] == {"score": -1, "comment": "user_thumbs: did not answer"}
    assert events[ids["plain"]]["status"] == "failure" and events[ids["plain"]]["kinds"] == ["negative_feedback"]

    agent = traces[ids["agent"]]
    # The last chat call of the agent holds the whole history: the tool call and its result.
    assert [m["role"] for m in agent["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    call = agent["messages"][2]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert agent["messages"][3] == {"role": "tool", "tool_call_id": "call_weather_1", "content": "sunny, 21 C"}
    assert agent["outcome"]["status"] == "success" and agent["model"] == "tiny"
    assert agent["metadata"]["mlflow"]["spans"] == {"AGENT": 1, "CHAT_MODEL": 2, "TOOL": 1}

    failed = traces[ids["agent_tool_error"]]
    assert failed["outcome"]["status"] == "failure"
    assert failed["outcome"]["error"] == "TOOL get_weather: TimeoutError: weather service timed out after 5 s"
    assert "runtime_exception" in events[ids["agent_tool_error"]]["kinds"]

    # A second run appends nothing: every MLflow trace id is already recorded.
    second = _ingest(it, home, mlflow_server.url)
    assert (second["read"], second["ingested"], second["duplicates"], second["events_appended"]) == (3, 0, 3, 0)
    with open_store(cfg, read_only=True) as store:
        assert len(store.read()) == n_events

    # --since after the traces: nothing to read.
    later = _ingest(it, root / "home-since", mlflow_server.url, "--since", "2999-01-01T00:00:00Z")
    assert later["read"] == 0 and later["events_appended"] == 0


def test_unknown_experiment_is_a_clear_cli_error(mlflow_server, tmp_path, it):
    p = subprocess.run([str(it.VENV_BIN / "flywheel"), "ingest", "--from", "mlflow", "--experiment", "no-such-agent",
                        "--home", str(tmp_path / "h"), "--json"], capture_output=True, text=True, timeout=300,
                       env=it.clean_env(MLFLOW_TRACKING_URI=mlflow_server.url))
    assert p.returncode == 1 and "has no experiment named 'no-such-agent'" in (p.stderr + p.stdout)


def test_where_to_look_screenshots_of_the_agent_trace(traced, mlflow_server, tmp_path, it):
    """The agent's trace in the MLflow UI (the docs' image): its TOOL span and tool call are shown."""
    import httpx

    ids, _ = traced
    exp = httpx.get(f"{mlflow_server.url}/api/2.0/mlflow/experiments/get-by-name",
                    params={"experiment_name": EXPERIMENT}, timeout=30).json()["experiment"]["experiment_id"]
    url = f"{mlflow_server.url}/#/experiments/{exp}/traces?selectedEvaluationId={ids['agent']}"
    png = it.screenshot(tmp_path, "mlflow-traces", url, "get_weather", width=1600, budget_ms=30_000)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the page (with the tool span) was rendered to an image

"""Team mode across machines (issue 34): every "machine" is a process with its own empty home, and none can
see another's.

Servers, each a real process on 127.0.0.1 started here: PostgreSQL (the event store), ``mlflow server``
with proxied artifacts (runs, the model registry, and the artifact store through ``artifacts.url =
mlflow-artifacts:/...``), ``prefect server start`` with two process work pools, ``cpu`` and ``gpu``.

"Machines": a gateway (runs the cycle flow), a cpu-pool worker, a gpu-pool worker, and a serving host. Each is
started inside its own mount namespace (``unshare --mount``) in which every other machine's home and the
servers' data directories are covered by an empty tmpfs: a process that tried to read another's disk would
find nothing there, so a green run proves that stages meet only through the servers.

The cycle maps ingest, evals and envs to the cpu pool and rollouts, training and the gate to the gpu pool
(``cycle.pools``); the tiny model. Checked: each stage ran on its pool's worker (``stage.completed`` names the
worker's home by a path-free id), Prefect shows them as sub-runs of the cycle, the trained adapter is served
by registry reference in the fourth empty home, and a second run of the cycle resumes: no stage runs twice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

POOLS = {"ingest": "cpu", "evals": "cpu", "envs": "cpu", "rollouts": "gpu", "train-sft": "gpu",
         "train-grpo": "gpu", "learn": "gpu", "gate": "gpu"}
MACHINES = ("gateway", "cpu-worker", "gpu-worker", "serving")
MODEL = f"team{os.getpid()}"

# Covers each directory given after the script with an empty tmpfs, then runs the command after "--".
_HIDE = r'''
while [ "$1" != "--" ]; do mount -t tmpfs -o size=1m,mode=0700 flywheel-hidden "$1" || exit 97; shift; done
shift
exec "$@"
'''


def namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    argv = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    try:
        return subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def isolated(argv: list[str], hide: list[Path]) -> list[str]:
    """``argv`` in a private mount namespace where every path of ``hide`` is an empty directory."""
    ns = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    return [*ns, "sh", "-c", _HIDE, "hide", *[str(h) for h in hide], "--", *argv]


@contextmanager
def team_cluster(root: Path, pg_server, mlflow_server, it) -> Iterator[dict]:
    """The servers' side of team mode and two workers (pools ``cpu`` and ``gpu``), each machine with its own
    home under ``root`` and a private mount namespace hiding the others. Yields what a caller needs to run a
    cycle from the gateway (``run_cycle(overrides, log)``) and to start more machines."""
    from flywheel.flows.pools import home_id

    homes = {m: root / m for m in MACHINES}
    for h in homes.values():
        h.mkdir(mode=0o700)
    prefect = it.start_prefect_server(root / "prefect-server")
    store_url = pg_server.create_database(f"team_{os.getpid()}_{time.time_ns() % 10**9}")
    servers_data = [root / "prefect-server", Path(mlflow_server.log).parent, pg_server.data_dir]
    common = dict(PREFECT_API_URL=prefect.api_url, PREFECT_WORKER_QUERY_SECONDS="1",
                  PREFECT_WORKER_PREFETCH_SECONDS="5", PREFECT_API_REQUEST_TIMEOUT="120",
                  MLFLOW_TRACKING_URI=mlflow_server.url, FLYWHEEL_STORE__URL=store_url,
                  # Its own registered model: the session's MLflow server also holds other tests' `policy`.
                  FLYWHEEL_CYCLE__MODEL_NAME=MODEL,
                  FLYWHEEL_ARTIFACTS__URL=f"mlflow-artifacts:/flywheel-team-{root.name}")

    def env_for(machine: str) -> dict[str, str]:
        prefect_home = homes[machine] / "prefect"
        prefect_home.mkdir(exist_ok=True)
        return it.clean_env(**common, FLYWHEEL_HOME=str(homes[machine]), PREFECT_HOME=str(prefect_home))

    def hidden_from(machine: str) -> list[Path]:
        return [h for m, h in homes.items() if m != machine] + servers_data

    def run_cycle(overrides: dict, log: Path) -> dict:
        return _run_gateway_cycle(homes["gateway"], [str(traffic)], env_for("gateway"), overrides,
                                  hidden_from("gateway"), log)

    workers = []
    try:
        for pool in ("cpu", "gpu"):
            subprocess.run([str(it.VENV_BIN / "prefect"), "work-pool", "create", pool, "--type", "process"],
                           env=env_for("gateway"), check=True, capture_output=True, timeout=120)
        for pool in ("cpu", "gpu"):
            machine = f"{pool}-worker"
            log = open(root / f"{machine}.log", "wb")  # noqa: SIM115 - closed below
            proc = subprocess.Popen(
                isolated([str(it.VENV_BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process",
                          "--name", machine], hidden_from(machine)),
                env=env_for(machine), cwd=homes[machine], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
            workers.append((proc, log))
        # The base model registered as the first champion, from the gateway: its files go to the registry.
        init = subprocess.run(isolated([str(it.VENV_BIN / "flywheel"), "init", "--home", str(homes["gateway"]),
                                        "--json"], hidden_from("gateway")),
                              env={**env_for("gateway"), "FLYWHEEL_POLICY__BASE_MODEL": "tiny"},
                              capture_output=True, text=True, timeout=600, cwd=homes["gateway"])
        assert init.returncode == 0, init.stderr[-4000:]
        traffic = it.bfcl_traffic(homes["gateway"] / "traffic.jsonl")
        yield {"homes": homes, "home_ids": {m: home_id(h) for m, h in homes.items()}, "store_url": store_url,
               "prefect": prefect, "env_for": env_for, "hidden_from": hidden_from, "root": root,
               "run_cycle": run_cycle}
    finally:
        for proc, log in workers:
            it.kill_group(proc, grace_s=5)
            log.close()
        prefect.stop()


@pytest.fixture(scope="module")
def team(tmp_path_factory, pg_server, mlflow_server, it):
    if not namespaces_work():
        pytest.skip("unshare --mount is not permitted here: the test cannot hide one machine's disk from another")
    root = tmp_path_factory.mktemp("team")
    with team_cluster(root, pg_server, mlflow_server, it) as t:
        overrides = {**it.TINY, "cycle": {"pools": POOLS}}
        t["result"] = t["run_cycle"](overrides, root / "gateway-cycle.log")
        t["again"] = t["run_cycle"]({**overrides, "force": True}, root / "gateway-cycle-again.log")
        yield t


_GATEWAY = r"""
import json, os, sys
args = json.loads(sys.argv[1])
from flywheel.config import load_config
from flywheel.flows.cycle import run_cycle
force = args["overrides"].pop("force", False)
cfg = load_config(overrides={"home": args["home"], **args["overrides"]})
result = run_cycle(cfg, traces=args["traces"], overrides=args["overrides"], force=force)
print(json.dumps({"kind": "result", "result": result}, default=str), flush=True)
"""


def _run_gateway_cycle(home: Path, traces: list[str], env: dict[str, str], overrides: dict, hide: list[Path],
                       log: Path) -> dict:
    argv = isolated([sys.executable, "-c", _GATEWAY, json.dumps({"home": str(home), "traces": traces,
                                                                  "overrides": overrides})], hide)
    with open(log, "wb") as err:
        p = subprocess.run(argv, env=env, cwd=home, stdout=subprocess.PIPE, stderr=err, timeout=1500, text=True)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert p.returncode == 0 and lines, f"gateway cycle exited {p.returncode}:\n{log.read_text(errors='replace')[-6000:]}"
    return lines[-1]["result"]


def _stage_events(store_url: str) -> list[dict]:
    from flywheel.config import load_config
    from flywheel.store import open_store

    cfg = load_config(overrides={"store": {"url": store_url}, "home": "/nonexistent-team-reader"})
    with open_store(cfg) as store:
        return [e.payload for e in store.read(types=["stage.completed"])]


def test_each_stage_ran_on_its_pools_worker(team):
    result = team["result"]
    assert result["outcome"] in ("promoted", "refused", "insufficient_evidence"), result
    ran = {ev["stage"]: ev for ev in _stage_events(team["store_url"])}
    ids = team["home_ids"]
    # auto mode on the tiny model: rollouts -> SFT (zero-variance groups) -> rollouts of the SFT model -> ...
    for stage in ("ingest", "evals", "envs"):
        assert ran[stage]["pool"] == "cpu" and ran[stage]["worker_home"] == ids["cpu-worker"], ran[stage]
    for stage in ("rollouts", "gate") + tuple(s for s in ("train-sft", "train-grpo") if s in ran):
        assert ran[stage]["pool"] == "gpu" and ran[stage]["worker_home"] == ids["gpu-worker"], ran[stage]
    assert "train-sft" in ran or "train-grpo" in ran
    # What the cycle reports is what the workers recorded.
    assert result["stages"]["gate"] == ran["gate"]["result"]
    assert result["stages"]["ingest"]["ingested"] == ran["ingest"]["result"]["ingested"] > 0


def test_no_machine_wrote_what_another_machine_does(team):
    """Training happened on the gpu worker only: no adapter ever reached the gateway's or the cpu worker's
    disk; the trace file reached the cpu worker's ingest as an artifact, never by its path."""
    homes = team["homes"]
    for machine in ("gateway", "cpu-worker"):
        assert not list(homes[machine].rglob("adapter_config.json")), machine
    assert list((homes["gpu-worker"] / "models").rglob("adapter_config.json"))
    assert not list(homes["cpu-worker"].rglob("traffic.jsonl"))
    assert not list(homes["gpu-worker"].rglob("traffic.jsonl"))


def test_prefect_shows_the_stages_as_sub_runs_of_the_cycle(team):
    run_id = team["result"]["cycle"].split(":", 1)[1]
    api = team["prefect"].api_url
    r = httpx.post(f"{api}/flow_runs/filter", json={"limit": 200}, timeout=60)
    r.raise_for_status()
    stage_runs = [fr for fr in r.json() if "flywheel" in fr.get("tags", []) and
                  any(t.startswith("stage:") for t in fr.get("tags", []))]
    assert stage_runs, "no flywheel-stage flow runs on the server"
    assert all(fr["state_type"] == "COMPLETED" for fr in stage_runs)
    # Sub-runs: each stage flow run's parent task run belongs to the cycle's flow run.
    parents = set()
    for fr in stage_runs:
        assert fr["parent_task_run_id"], fr
        tr = httpx.get(f"{api}/task_runs/{fr['parent_task_run_id']}", timeout=60).json()
        parents.add(tr["flow_run_id"])
    assert parents == {run_id}


def test_a_second_run_resumes_without_running_a_stage_twice(team):
    """The forced second cycle finds every stage of the same inputs completed: no new stage runs."""
    events = _stage_events(team["store_url"])
    keys = [ev["key"] for ev in events]
    assert len(keys) == len(set(keys))
    first, again = team["result"], team["again"]
    for stage in ("evals", "envs", "gate"):
        assert again["stages"][stage] == first["stages"][stage]


def _serve(it, team, *model_args: str) -> dict:
    """Start ``flywheel serve`` on the serving machine, check one chat completion, return /health."""
    home = team["homes"]["serving"]
    port = it.free_port()
    argv = isolated([str(it.VENV_BIN / "flywheel"), "serve", *model_args, "--port", str(port), "--home", str(home)],
                    team["hidden_from"]("serving"))
    srv = it.ServerProcess("flywheel serve", argv, port=port, health_path="/health",
                           env={**team["env_for"]("serving"), "FLYWHEEL_POLICY__BASE_MODEL": "tiny"},
                           log=team["root"] / f"serve-{port}.log", cwd=home)
    try:
        srv.wait_healthy(300)
        health = httpx.get(srv.url + "/health", timeout=30).json()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": health["model"], "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        return health
    finally:
        srv.stop()


def test_models_are_served_by_registry_reference_from_an_empty_home(team, it):
    """On a fourth machine whose home starts empty: ``flywheel serve --champion`` serves the champion the
    gate left (the base registered from the gateway, or the promoted challenger), and ``--model
    model:<name>/<N>`` the adapter the gpu worker trained; both come from the MLflow registry, their files
    through its artifact proxy, never from a path on another machine."""
    result = team["result"]
    home = team["homes"]["serving"]
    assert not [p for p in home.iterdir() if p.name != "prefect"]
    champion = _serve(it, team, "--champion")
    expected = result["stages"]["gate"]["challenger_version"] if result["outcome"] == "promoted" else 1
    assert str(champion["version"]) == str(expected), (champion, result["outcome"])
    challenger = result["stages"]["gate"]["challenger_version"]
    assert challenger and challenger > 1
    served = _serve(it, team, "--model", f"model:{MODEL}/{challenger}")
    assert str(served["version"]) == str(challenger), served
    assert (home / "models").is_dir()

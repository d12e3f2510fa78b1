"""``flywheel schedule`` against a real local Prefect server (``prefect server start`` on a free
loopback port): the deployment exists with the cron and timezone given, re-applying updates it in
place, ``--list``/``--pause``/``--resume`` work, and without ``PREFECT_API_URL`` the command fails
with one clear line. Every check of the server's state goes through Prefect's client, not the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FLYWHEEL = str(Path(sys.executable).parent / "flywheel")


def _cli(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([FLYWHEEL, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def env(prefect_server, tmp_path_factory, it):
    tmp = tmp_path_factory.mktemp("schedule")
    (tmp / "client-prefect-home").mkdir()
    return it.clean_env(PREFECT_API_URL=prefect_server.api_url, PREFECT_HOME=str(tmp / "client-prefect-home"),
                     FLYWHEEL_HOME=str(tmp / "home"))


def _deployments(api_url: str) -> list:
    """The server's deployments of flow ``flywheel-cycle``, read with Prefect's own client."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api_url) as client:
        flows = client.read_flows()
        ids = [f.id for f in flows if f.name == "flywheel-cycle"]
        return [d for d in client.read_deployments() if d.flow_id in ids]


def _json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def test_schedule_creates_updates_lists_pauses_and_resumes(prefect_server, env):
    api = prefect_server.api_url

    # 1. create
    created = _json(_cli(["schedule", "--cron", "0 2 * * *", "--timezone", "Europe/Lisbon", "--json"], env))
    assert created["deployment"] == "flywheel-cycle/nightly"
    deps = _deployments(api)
    assert len(deps) == 1, [d.name for d in deps]
    dep = deps[0]
    assert dep.name == "nightly" and str(dep.id) == created["id"]
    assert [(s.schedule.cron, s.schedule.timezone) for s in dep.schedules] == [("0 2 * * *", "Europe/Lisbon")]
    assert all(s.active for s in dep.schedules)
    # The scheduled runs use this home (a worker or served runner elsewhere would otherwise use its own).
    assert dep.parameters["overrides"]["home"] == env["FLYWHEEL_HOME"]
    assert dep.entrypoint and dep.entrypoint.endswith("flywheel_cycle")

    # 2. re-apply with another cron: the same deployment, updated in place
    updated = _json(_cli(["schedule", "--cron", "30 3 * * 1-5", "--timezone", "UTC", "--json"], env))
    assert updated["id"] == created["id"]
    deps = _deployments(api)
    assert len(deps) == 1
    assert [(s.schedule.cron, s.schedule.timezone) for s in deps[0].schedules] == [("30 3 * * 1-5", "UTC")]

    # 3. --list shows it, as the server has it
    listed = _json(_cli(["schedule", "--list", "--json"], env))
    assert [(d["name"], d["id"], d["paused"]) for d in listed] == [("nightly", created["id"], False)]
    assert listed[0]["schedules"] == ["30 3 * * 1-5 UTC"]

    # 4. --pause / --resume flip the server's state
    paused = _json(_cli(["schedule", "--pause", "--json"], env))
    assert paused["paused"] is True
    assert _deployments(api)[0].paused is True
    resumed = _json(_cli(["schedule", "--resume", "--json"], env))
    assert resumed["paused"] is False
    assert _deployments(api)[0].paused is False


def test_schedule_refuses_bad_input_with_one_line(env):
    bad_cron = _cli(["schedule", "--cron", "61 2 * * *", "--json"], env)
    assert bad_cron.returncode != 0 and "Traceback" not in bad_cron.stderr
    assert "cron" in bad_cron.stderr.lower()
    unknown = _cli(["schedule", "--pause", "--name", "no-such-deployment"], env)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr
    assert "no-such-deployment" in unknown.stderr


def test_schedule_without_a_server_fails_clearly(tmp_path, it):
    # COLUMNS: rich wraps stderr at 80 columns when it is not a terminal; the message is one line.
    env = it.clean_env(PREFECT_HOME=str(tmp_path / "ph"), FLYWHEEL_HOME=str(tmp_path / "home"), COLUMNS="400")
    proc = _cli(["schedule", "--cron", "0 2 * * *"], env, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "PREFECT_API_URL" in lines[0] and "prefect server start" in lines[0]


def test_schedule_to_a_work_pool(prefect_server, env):
    """``--work-pool``: the same entrypoint deployed for a ``prefect worker`` to run (infra/README.md)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate

    with SyncPrefectClient(prefect_server.api_url) as client:
        client.create_work_pool(WorkPoolCreate(name="flywheel-cpu", type="process"), overwrite=True)
    made = _json(_cli(["schedule", "--cron", "0 2 * * *", "--work-pool", "flywheel-cpu", "--name", "pool-nightly",
                       "--json"], env))
    assert made["work_pool"] == "flywheel-cpu"
    dep = next(d for d in _deployments(prefect_server.api_url) if d.name == "pool-nightly")
    assert dep.work_pool_name == "flywheel-cpu"
    assert dep.entrypoint == "flows/cycle.py:flywheel_cycle"
    assert [s.schedule.cron for s in dep.schedules] == ["0 2 * * *"]

"""Fixtures of the integration tests that run real servers and whole cycles.

- :class:`ServerProcess`: a server started as a plain process on a free loopback port, in its own
  process group (so its workers die with it), waited for with a bounded health poll, and always
  stopped (SIGTERM to the group, then SIGKILL) by the fixture's teardown.
- ``prefect_server`` / ``mlflow_server``: one real ``prefect server start`` and one real
  ``mlflow server`` per test session (starting them costs ~10-30 s each on 2 busy cores).
- :func:`run_cycle_subprocess`: one tiny-model cycle in a fresh Python process, so Prefect reads its
  settings (``PREFECT_API_URL``, ``PREFECT_HOME``) fresh and the process can be SIGKILLed; progress
  arrives as JSON lines on stdout.
- ``tiny_cycle``: one in-process tiny-model cycle per test session, read by tests/integration/test_cycle.py
  and tests/integration/test_report.py (two equal cycles cost ~50-100 s on 2 busy cores). Everything
  that writes to its home happens inside the fixture, in a fixed order, before any test reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

#: A tiny-model cycle (the same sizes as tests/integration/test_cycle.py).
TINY: dict[str, Any] = {
    "policy": {"base_model": "tiny", "device": "cpu", "dtype": "float32"},
    "rollout": {"group_size": 2, "max_new_tokens": 12, "max_tasks": 6},
    "train": {"steps": 1, "sft_steps": 2, "batch_size": 4, "lora_r": 4, "micro_batch_tokens": 2048},
    "synth": {"per_seed": 0},
    "gate": {"bootstrap_samples": 200, "max_new_tokens": 12, "require_decontaminated": False},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without flywheel/Prefect/MLflow settings that would leak in."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLYWHEEL_", "PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def kill_group(proc: subprocess.Popen, *, grace_s: float = 10.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it spawned."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    # Children that outlived the leader (same group) must not outlive the test.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ServerProcess:
    """A server process on 127.0.0.1:<port>, healthy when ``health_url`` answers 200."""

    def __init__(self, name: str, argv: list[str], *, port: int, health_path: str, env: dict[str, str],
                 log: Path, cwd: Path):
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.health_url = self.url + health_path
        self.log = log
        self._log_fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was healthy:\n{self.tail()}")
            try:
                r = httpx.get(self.health_url, timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy at {self.health_url} after {timeout_s:.0f} s ({last}):\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._log_fh.flush()
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        try:
            kill_group(self.proc)
        finally:
            self._log_fh.close()


def start_prefect_server(tmp: Path, *, timeout_s: float = 120.0, ui: bool = False) -> ServerProcess:
    """``prefect server start`` (no telemetry; the web UI only with ``ui``) with its own PREFECT_HOME under tmp."""
    port = free_port()
    home = tmp / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    # The web UI asks the API at PREFECT_UI_API_URL, which defaults to port 4200, not the one bound here.
    env = clean_env(PREFECT_HOME=str(home), PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api")
    srv = ServerProcess("prefect server", [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                          "--port", str(port), *(() if ui else ("--no-ui",)), "--analytics-off"],
                        port=port, health_path="/api/health", env=env, log=tmp / "prefect-server.log", cwd=tmp)
    try:
        srv.wait_healthy(timeout_s)
    except BaseException:
        srv.stop()
        raise
    srv.api_url = srv.url + "/api"  # type: ignore[attr-defined]
    return srv


def start_mlflow_server(tmp: Path, *, timeout_s: float = 120.0) -> ServerProcess:
    """``mlflow server`` on SQLite with proxied artifacts under tmp (one worker: 2 shared cores)."""
    port = free_port()
    data = tmp / "mlflow-server"
    data.mkdir(parents=True, exist_ok=True)
    argv = [str(VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{data / 'mlflow.db'}",
            "--artifacts-destination", str(data / "mlartifacts")]
    # Host-header protection (MLflow 3) allows localhost and 127.0.0.1 on any port by default: the
    # test reaches the server as 127.0.0.1:<port>, so no --allowed-hosts is needed here.
    srv = ServerProcess("mlflow server", argv, port=port, health_path="/health", env=clean_env(),
                        log=tmp / "mlflow-server.log", cwd=data)
    try:
        srv.wait_healthy(timeout_s)
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[ServerProcess]:
    # With its web UI: tests/integration/test_real_servers.py screenshots the flow run's artifacts.
    srv = start_prefect_server(tmp_path_factory.mktemp("prefect-server"), ui=True)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[ServerProcess]:
    srv = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield srv
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------ traffic + cycles


def bfcl_traffic(path: Path, n_simple: int = 16, n_multiple: int = 6) -> Path:
    """Production traffic as the demo gateway logs it: BFCL questions answered in prose (failures)."""
    from flywheel.verifiers.bfcl import load_bfcl

    rows = []
    for cat, n in (("simple_python", n_simple), ("multiple", n_multiple)):
        for i, item in enumerate(load_bfcl(cat, limit=n)):
            rows.append({"bfcl_id": item.id, "category": cat, "answer": "I am not sure how to help with that.",
                         "model": "policy/base", "timestamp": f"2026-11-2{i % 9}T10:{i:02d}:00Z"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tiny_cycle(tmp_path_factory) -> dict[str, Any]:
    """One tiny-model cycle (settings ``TINY``, traffic :func:`bfcl_traffic`) in one home, shared
    read-only by the modules that only read what it left (test_cycle.py, test_report.py).

    Nothing in the home may be copied to give a test a private one (``mlflow.db`` and the warehouse
    hold absolute paths into it), so what writes to it runs here, before any test sees it, in this
    order: the cycle; ``flywheel report`` for the last completed cycle (the one just run), as
    test_report.py reads it; then a second cycle on the same traffic (test_cycle.py checks that it
    ends early and records only its own two events). No test writes to this home."""
    from flywheel.flows.cycle import run_cycle
    from typer.testing import CliRunner

    from flywheel.cli import app
    from flywheel.config import load_config
    from flywheel.store import open_store

    root = tmp_path_factory.mktemp("tiny-cycle")
    home = root / "home"
    traffic = bfcl_traffic(root / "traffic.jsonl")
    cfg = load_config(overrides={"home": str(home), **TINY}, environ={})
    stages: list[str] = []
    result = run_cycle(cfg, traces=[str(traffic)], overrides={**TINY}, on_progress=lambda s, i: stages.append(s))

    r = CliRunner().invoke(app, ["report", "--home", str(home), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report_info = json.loads(r.stdout)

    with open_store(cfg) as store:
        before = store.last_seq()
    again = run_cycle(cfg, traces=[str(traffic)], overrides={**TINY})
    with open_store(cfg) as store:
        new = store.read(after_seq=before)
    return {"root": root, "cfg": cfg, "result": result, "traffic": traffic, "stages": stages,
            "report": report_info, "again": again, "events_after_first": new}


# Runs in the child: applies the embedded Prefect environment before Prefect is imported (what
# `flywheel cycle` does), runs one cycle, and reports progress and the result as JSON lines.
_DRIVER = r"""
import json, os, sys
args = json.loads(sys.argv[1])
from flywheel.flows.cycle_env import prefect_environment
for k, v in prefect_environment(args["home"]).items():
    os.environ.setdefault(k, v)
from flywheel.config import load_config
from flywheel.flows.cycle import run_cycle

def emit(kind, **kw):
    sys.stdout.write(json.dumps({"kind": kind, **kw}, default=str) + "\n")
    sys.stdout.flush()

cfg = load_config(overrides={"home": args["home"], **args["overrides"]})
emit("started", pid=os.getpid())
result = run_cycle(cfg, traces=args["traces"], overrides=args["overrides"], force=args.get("force", False),
                   on_progress=lambda stage, info: emit("progress", stage=stage, info=info))
emit("result", result=result)
"""


class CycleProcess:
    """A cycle running in a child process (own process group); ``events`` are its JSON lines."""

    def __init__(self, home: Path, traces: list[str], *, env: dict[str, str], overrides: dict[str, Any] | None = None,
                 log: Path):
        args = {"home": str(home), "traces": traces, "overrides": overrides if overrides is not None else TINY}
        self.stderr_path = log
        self._err = open(log, "wb")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(args)], env=env, cwd=home.parent,
                                     stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL,
                                     start_new_session=True, text=True)
        self.events: list[dict[str, Any]] = []

    def lines(self, deadline: float) -> Iterator[dict[str, Any]]:
        """Yield the child's JSON lines as they come, until it exits or ``deadline`` (monotonic)."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if not sel.select(timeout=min(1.0, max(deadline - time.monotonic(), 0.01))):
                    if self.proc.poll() is not None:
                        return
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    return
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue  # a stray print from a library
                self.events.append(ev)
                yield ev
        finally:
            sel.unregister(self.proc.stdout)

    def wait_until(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any] | None:
        for ev in self.lines(time.monotonic() + timeout_s):
            if pred(ev):
                return ev
        return None

    def result(self, timeout_s: float) -> dict[str, Any]:
        ev = self.wait_until(lambda e: e.get("kind") == "result", timeout_s)
        if ev is None:
            self.kill()
            raise AssertionError(f"the cycle process gave no result in {timeout_s:.0f} s "
                                 f"(exit {self.proc.returncode}):\n{self.stderr_tail()}")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        self.finish()
        return ev["result"]

    def kill(self) -> None:
        """SIGKILL the whole group (the cycle and, in the embedded default, its temporary Prefect server)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.finish()

    def finish(self) -> None:
        kill_group(self.proc, grace_s=5)
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()
        self._err.close()

    def stderr_tail(self, n: int = 6000) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")[-n:]


def run_cycle_subprocess(home: Path, traces: list[str], *, env: dict[str, str], timeout_s: float = 600,
                         overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], CycleProcess]:
    cp = CycleProcess(home, traces, env=env, overrides=overrides, log=home.parent / f"cycle-{time.time_ns()}.stderr")
    try:
        return cp.result(timeout_s), cp
    except BaseException:
        cp.finish()
        raise


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def screenshot(tmp: Path, name: str, url: str, expected: str, *, width: int = 1400, height: int = 1000,
               budget_ms: int = 20_000) -> Path:
    """Render ``url`` in headless Chromium: its DOM after the page's scripts ran (``budget_ms`` of
    virtual time; network waits do not consume it) must contain ``expected``; then a PNG
    ``<tmp>/<name>.png``, copied to ``$FLYWHEEL_SCREENSHOTS`` when that is set (the docs' images).
    Skips the test where Chromium is not installed."""
    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (Debian package `chromium`; .ci/run installs it)")
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
            f"--window-size={width},{height}", f"--virtual-time-budget={budget_ms}",
            f"--user-data-dir={tmp / 'chromium-profile'}"]
    dom = subprocess.run([*argv, "--dump-dom", url], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert expected in dom.stdout, (f"{name}: {expected!r} is not on the rendered page {url} "
                                    f"(exit {dom.returncode}):\n{dom.stdout[-2000:]}\n{dom.stderr[-2000:]}")
    png = tmp / f"{name}.png"
    shot = subprocess.run([*argv, f"--screenshot={png}", url], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert png.is_file() and png.stat().st_size > 10_000, f"{name}: no screenshot of {url}: {shot.stderr[-2000:]}"
    out = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, Path(out) / png.name)
    return png


@pytest.fixture(scope="session")
def it():
    """The helpers of this file for test modules (conftest modules are not importable by name)."""
    import types

    return types.SimpleNamespace(
        TINY=TINY, ROOT=ROOT, VENV_BIN=VENV_BIN, free_port=free_port, clean_env=clean_env, kill_group=kill_group,
        bfcl_traffic=bfcl_traffic, CycleProcess=CycleProcess, run_cycle_subprocess=run_cycle_subprocess,
        start_prefect_server=start_prefect_server, start_mlflow_server=start_mlflow_server, ServerProcess=ServerProcess,
        screenshot=screenshot,
    )

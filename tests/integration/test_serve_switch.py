"""``flywheel serve --champion``: the server follows the champion alias without a restart and never
drops a request that is in flight during a switch.

Models are scripted policies (the real ``Policy`` interface, see test_gate_e2e.py for why) that
take 0.4 s per request, so requests are demonstrably in flight while the alias moves. The alias is
the real MLflow registry alias, moved by :func:`flywheel.deploy.promote` / :func:`rollback`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from flywheel.deploy import ChampionWatcher, DeployError, promote, rollback
from flywheel.policy.base import Sample, SamplingParams
from flywheel.serve import ServeLimits, create_app, run_in_thread
from flywheel.tracking import Tracker

pytestmark = pytest.mark.slow


class SlowPolicy:
    def __init__(self, version: int, delay: float = 0.4):
        self.name, self.version, self.delay = "policy", str(version), delay
        self.active = 0

    def generate(self, prompts, params=None, *, tools=None):
        params = params if isinstance(params, SamplingParams) else SamplingParams()
        self.active += 1
        time.sleep(self.delay)
        self.active -= 1
        return [[Sample(f"answer from v{self.version}", [1], [2], [-0.5], "stop", False, self.delay * 1000)
                 for _ in range(params.n)] for _ in prompts]


@pytest.fixture
def registry(cfg, tmp_path):
    tracker = Tracker(cfg)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    for _ in range(3):
        with tracker.run("train") as run:
            tracker.register_model("policy", d, run_id=run.run_id, tags={"adapter": "false"})
    tracker.set_alias("policy", "champion", 1)
    return tracker


def _chat(url: str, results: list, i: int) -> None:
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 8})
        results.append((i, r.status_code, r.json()))
    except Exception as e:  # recorded, then asserted: a dropped request must fail the test
        results.append((i, None, repr(e)))


def test_serve_switches_champion_without_dropping_in_flight_requests(cfg, store, registry):
    tracker = registry
    loaded: list[int] = []

    def loader(v: int):
        loaded.append(v)
        return SlowPolicy(v)

    cfg.serve.max_concurrency = 16
    watcher = ChampionWatcher(cfg, tracker=tracker, loader=loader, poll_s=0.1).start(install_sighup=False)
    try:
        app = create_app(watcher, limits=ServeLimits.from_config(cfg.serve))
        with run_in_thread(app) as url:
            assert httpx.get(f"{url}/health").json()["version"] == "1"
            results: list = []
            before = [threading.Thread(target=_chat, args=(url, results, i)) for i in range(4)]
            for t in before:
                t.start()
            # wait until the four requests are inside generate() on v1, then move the alias
            old = watcher()[1]
            deadline = time.monotonic() + 10
            while old.active < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            promote(cfg, store, tracker, 2, force=True, reason="serve switch test")
            deadline = time.monotonic() + 10
            while watcher.version != 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert watcher.version == 2
            after = [threading.Thread(target=_chat, args=(url, results, 10 + i)) for i in range(3)]
            for t in after:
                t.start()
            for t in before + after:
                t.join(timeout=30)
            assert len(results) == 7
            assert all(code == 200 for _, code, _ in results), results
            by = {i: body for i, _, body in results}
            # requests that started on v1 finished on v1 (not dropped, not re-routed)
            assert {by[i]["system_fingerprint"] for i in range(4)} == {"flywheel-1"}
            assert {by[i]["choices"][0]["message"]["content"] for i in range(4)} == {"answer from v1"}
            assert {by[10 + i]["system_fingerprint"] for i in range(3)} == {"flywheel-2"}
            assert all(body["model"] == "policy" for body in by.values())  # stable served name
            # rollback is picked up the same way
            rollback(cfg, store, tracker)
            deadline = time.monotonic() + 10
            while watcher.version != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert httpx.get(f"{url}/health").json()["version"] == "1"
    finally:
        watcher.stop()
    assert loaded == [1, 2, 1] and watcher.swaps == 3


def test_sighup_triggers_reload_and_bad_version_keeps_old_model(cfg, registry):
    tracker = registry

    def loader(v: int):
        if v == 3:
            raise OSError("weights missing")
        return SlowPolicy(v, delay=0.0)

    watcher = ChampionWatcher(cfg, tracker=tracker, loader=loader, poll_s=3600).start(install_sighup=True)
    try:
        assert watcher.version == 1
        tracker.set_alias("policy", "champion", 2)
        os.kill(os.getpid(), signal.SIGHUP)  # the poll interval is an hour: only the signal can explain a swap
        deadline = time.monotonic() + 10
        while watcher.version != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.version == 2 and watcher()[1].version == "2"
        tracker.set_alias("policy", "champion", 3)
        assert watcher.check_now() is False  # loading v3 fails: keep serving v2, report why
        assert watcher.version == 2 and "weights missing" in watcher.last_error
    finally:
        watcher.stop()


def test_watcher_refuses_to_start_without_a_champion(cfg, registry):
    registry.delete_alias("policy", "champion")
    with pytest.raises(DeployError, match="no champion alias"):
        ChampionWatcher(cfg, tracker=registry, loader=lambda v: SlowPolicy(v), poll_s=1).start(install_sighup=False)

"""``flywheel serve --champion``: the server follows the champion alias without a restart and never
drops a request that is in flight during a switch.

Models are scripted policies (the real ``Policy`` interface, see test_gate_e2e.py for why). In the
switch test, version 1's ``generate`` holds until the test has seen the server swap to version 2,
so its requests are demonstrably in flight while the alias moves; every wait is on the server's own
progress (requests that took a policy, a generate in progress, the watcher's version), with
generous deadlines, never on a fixed delay. The alias is the real MLflow registry alias, moved by
:func:`flywheel.deploy.promote` / :func:`rollback`.
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
    """Answers once ``release`` is set (set from the start unless ``hold``)."""

    def __init__(self, version: int, hold: bool = False):
        self.name, self.version = "policy", str(version)
        self.active = 0
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def generate(self, prompts, params=None, *, tools=None):
        params = params if isinstance(params, SamplingParams) else SamplingParams()
        self.active += 1
        assert self.release.wait(timeout=120), "the test never released this policy"
        self.active -= 1
        return [[Sample(f"answer from v{self.version}", [1], [2], [-0.5], "stop", False, 1.0)
                 for _ in range(params.n)] for _ in prompts]


def _wait_for(condition, what: str, timeout_s: float = 120) -> None:
    """Poll ``condition`` (the server's progress) until true; fail after a generous deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def registry(cfg, tmp_path):
    from flywheel.store import open_store

    tracker = Tracker(cfg)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    for _ in range(3):
        with tracker.run("train") as run:
            tracker.register_model("policy", d, run_id=run.run_id, tags={"adapter": "false"})
    with open_store(cfg) as store:  # a recorded champion: the watcher serves only recorded moves
        promote(cfg, store, tracker, 1, force=True, reason="test fixture")
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
        return SlowPolicy(v, hold=len(loaded) == 1)  # the first v1 holds its requests until released

    taken: list[str] = []  # the version each request took from the provider, when it started

    def provider():
        name, policy = watcher()
        taken.append(policy.version)
        return name, policy

    cfg.serve.max_concurrency = 16
    watcher = ChampionWatcher(cfg, tracker=tracker, loader=loader, poll_s=0.1).start(install_sighup=False)
    try:
        app = create_app(provider, limits=ServeLimits.from_config(cfg.serve))
        with run_in_thread(app) as url:
            old = watcher()[1]
            assert httpx.get(f"{url}/health").json()["version"] == "1"
            results: list = []
            started = len(taken)
            before = [threading.Thread(target=_chat, args=(url, results, i)) for i in range(4)]
            for t in before:
                t.start()
            # All four requests have taken v1 and one generate on it is in progress (held): only
            # then move the alias, so they are in flight across the switch on any machine.
            _wait_for(lambda: taken[started:].count("1") == 4 and old.active >= 1, "four requests on v1")
            promote(cfg, store, tracker, 2, force=True, reason="serve switch test")
            _wait_for(lambda: watcher.version == 2, "the watcher to serve v2")
            assert len(results) == 0  # nothing on v1 has finished: they were in flight during the swap
            old.release.set()
            after = [threading.Thread(target=_chat, args=(url, results, 10 + i)) for i in range(3)]
            for t in after:
                t.start()
            for t in before + after:
                t.join(timeout=120)
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
            _wait_for(lambda: watcher.version == 1, "the watcher to serve v1 again")
            assert httpx.get(f"{url}/health").json()["version"] == "1"
    finally:
        watcher.stop()
    assert loaded == [1, 2, 1] and watcher.swaps == 3


def test_sighup_triggers_reload_and_bad_version_keeps_old_model(cfg, registry):
    tracker = registry

    def loader(v: int):
        if v == 3:
            raise OSError("weights missing")
        return SlowPolicy(v)

    from flywheel.store import open_store

    watcher = ChampionWatcher(cfg, tracker=tracker, loader=loader, poll_s=3600).start(install_sighup=True)
    try:
        assert watcher.version == 1
        with open_store(cfg) as store:
            promote(cfg, store, tracker, 2, force=True, reason="sighup test")
        os.kill(os.getpid(), signal.SIGHUP)  # the poll interval is an hour: only the signal can explain a swap
        _wait_for(lambda: watcher.version == 2, "the SIGHUP reload")
        assert watcher.version == 2 and watcher()[1].version == "2"
        with open_store(cfg) as store:
            promote(cfg, store, tracker, 3, force=True, reason="sighup test")
        assert watcher.check_now() is False  # loading v3 fails: keep serving v2, report why
        assert watcher.version == 2 and "weights missing" in watcher.last_error
    finally:
        watcher.stop()


def test_watcher_refuses_an_alias_moved_without_a_deployment_event(cfg, registry, caplog):
    """Issue 31, finding 3: whoever reached MLflow could move `champion` and `serve --champion` served
    it. An alias moved by hand (no model.promoted / model.rolled_back) is refused: the server keeps
    serving the recorded champion, logs why and reports it (``last_error``, ``refused``). At start, a
    hand-moved alias serves the recorded champion."""
    tracker = registry
    watcher = ChampionWatcher(cfg, tracker=tracker, loader=SlowPolicy, poll_s=3600).start(install_sighup=False)
    try:
        assert watcher.version == 1
        tracker.set_alias("policy", "champion", 3)  # by hand: no event
        with caplog.at_level("ERROR", logger="flywheel.deploy"):
            assert watcher.check_now() is False
        assert watcher.version == 1 and watcher()[1].version == "1" and watcher.refused == 3
        assert "without a model.promoted or model.rolled_back event" in watcher.last_error
        assert any("refused" in r.getMessage() for r in caplog.records)
    finally:
        watcher.stop()
    fresh = ChampionWatcher(cfg, tracker=tracker, loader=SlowPolicy, poll_s=3600).start(install_sighup=False)
    try:
        assert fresh.version == 1 and fresh.refused == 3  # the recorded champion, not the alias
    finally:
        fresh.stop()


def test_watcher_refuses_to_start_without_a_champion(cfg, registry):
    registry.delete_alias("policy", "champion")
    with pytest.raises(DeployError, match="no champion alias"):
        ChampionWatcher(cfg, tracker=registry, loader=lambda v: SlowPolicy(v), poll_s=1).start(install_sighup=False)

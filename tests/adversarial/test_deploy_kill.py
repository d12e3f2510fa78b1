"""Promotion survives a SIGKILL between its two steps (the deployment event, the MLflow alias move).

A child process promotes version 2 over version 1 with both steps wrapped: when the first of the two
has happened it prints ``between`` and waits; the parent kills it with SIGKILL on that line (tied to
the child's progress, not to a clock). Afterwards the deployment history and the alias must be
reconcilable and ``rollback`` must work. With the alias moved first (the old order) the kill left an
unrecorded champion that ``rollback`` could not resolve.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from flywheel.champion import CHAMPION, deployments, reconcile_champion
from flywheel.config import load_config
from flywheel.deploy import DeployError, promote, rollback
from flywheel.store import ConcurrencyError, open_store
from flywheel.tracking import Tracker

pytestmark = pytest.mark.slow  # MLflow's first use (imports + SQLite migrations) takes ~5 s

CHILD = textwrap.dedent(
    """
    import signal, sys
    from flywheel.config import load_config
    from flywheel.deploy import promote
    from flywheel.store import open_store
    from flywheel.tracking import Tracker

    cfg = load_config()
    store, tracker = open_store(cfg), Tracker(cfg)
    done = []

    def step(kind, fn):
        def wrapped(*a, **kw):
            if (kind == "append" and not str(a[0]).startswith("deploy:")) or (kind == "alias" and a[1] != "champion"):
                return fn(*a, **kw)
            if done:  # the first step happened: stop here, as a kill would
                print("between", done[0], flush=True)
                signal.pause()
            done.append(kind)
            return fn(*a, **kw)
        return wrapped

    tracker.set_alias = step("alias", tracker.set_alias)
    store.append = step("append", store.append)
    promote(cfg, store, tracker, 2, force=True, reason="kill test")
    print("finished", flush=True)
    """
)


@pytest.fixture
def world(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    cfg = load_config()
    cfg.ensure_home()
    tracker = Tracker(cfg)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with tracker.run("train") as run:
        pass
    for _ in range(2):
        tracker.register_model(cfg.cycle.model_name, model, run_id=run.run_id)
    with open_store(cfg) as store:
        promote(cfg, store, tracker, 1, force=True, reason="bootstrap")
    return cfg, tracker


def _readline(proc: subprocess.Popen, deadline: float) -> str:
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            return proc.stdout.readline().strip()
        if proc.poll() is not None:
            return proc.stdout.readline().strip()
    raise AssertionError("the child never reached the point between the two steps")


def _kill_between(cfg) -> str:
    """Run the promoting child and SIGKILL it between the two steps; returns which step it had done."""
    err = tempfile.TemporaryFile()  # not a pipe: a chatty child must never block on a full one
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=err,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = _readline(proc, time.monotonic() + 300)  # generous: MLflow + DuckDB start-up on a busy machine
        if not line.startswith("between"):
            err.seek(0)
            raise AssertionError(f"child: {line!r}\n{err.read().decode(errors='replace')[-3000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
    return line


def test_rollback_resolves_a_promotion_killed_between_the_event_and_the_alias_move(world):
    """Review finding 10."""
    cfg, tracker = world
    name = cfg.cycle.model_name
    line = _kill_between(cfg)
    with open_store(cfg) as store:
        # Whatever was left, rollback resolves it (with the alias moved first, the old order, it
        # raised "has no previous champion in the deployment history").
        dep = rollback(cfg, store, tracker, reason="after the kill")
        assert (dep.from_version, dep.to_version) == (2, 1)
        assert tracker.get_alias_version(name, CHAMPION) == 1
        assert [(d.action, d.from_version, d.to_version) for d in deployments(store, name)] == \
               [("promote", None, 1), ("promote", 1, 2), ("rollback", 2, 1)]
        assert store.check_integrity() == []
    assert line == "between append"  # the history is written first, the alias moved second


def test_a_killed_promotion_is_recorded_and_completed_at_start_up(world):
    """Review finding 10."""
    cfg, tracker = world
    name = cfg.cycle.model_name
    _kill_between(cfg)
    with open_store(cfg) as store:
        history = deployments(store, name)
        # Recorded, not yet applied: the alias still names the previous champion, the move's "from".
        assert [d.to_version for d in history] == [1, 2]
        assert tracker.get_alias_version(name, CHAMPION) == 1 == history[-1].from_version
        r = reconcile_champion(store, tracker, name)
        assert (r.action, r.champion) == ("completed", 2) and tracker.get_alias_version(name, CHAMPION) == 2
        assert reconcile_champion(store, tracker, name).action == "in_sync"


def test_serve_completes_the_interrupted_move_at_start_up(world):
    """Review finding 10."""
    from flywheel.deploy import champion_provider

    cfg, tracker = world
    _kill_between(cfg)
    assert tracker.get_alias_version(cfg.cycle.model_name, CHAMPION) == 1
    watcher = champion_provider(cfg, tracker=tracker, loader=lambda v: f"policy v{v}", poll_s=3600)
    try:
        assert watcher.version == 2 and watcher()[1] == "policy v2"
    finally:
        watcher.stop()


def test_reconcile_completes_only_a_recorded_move(world):
    """Review finding 10."""
    cfg, tracker = world
    name = cfg.cycle.model_name
    with open_store(cfg) as store:
        assert reconcile_champion(store, tracker, name).action == "in_sync"
        tracker.set_alias(name, CHAMPION, 2)  # moved outside flywheel: reported, left alone
        r = reconcile_champion(store, tracker, name)
        assert (r.action, r.champion) == ("diverged", 2) and tracker.get_alias_version(name, CHAMPION) == 2
        # No alias where the history says "None -> 1": the first promotion, recorded, not applied.
        tracker.delete_alias(name, CHAMPION)
        r = reconcile_champion(store, tracker, name)
        assert (r.action, r.champion) == ("completed", 1) and tracker.get_alias_version(name, CHAMPION) == 1


def test_a_refused_append_leaves_the_alias_where_it_was(world, monkeypatch):
    """Review finding 10."""
    cfg, tracker = world
    name = cfg.cycle.model_name
    with open_store(cfg) as store:
        real = store.append

        def racing(stream, *a, **kw):  # another promoter recorded a move since we read the version
            if stream.startswith("deploy:"):
                raise ConcurrencyError(stream, 1, 2)
            return real(stream, *a, **kw)

        monkeypatch.setattr(store, "append", racing)
        with pytest.raises(ConcurrencyError):
            promote(cfg, store, tracker, 2, force=True, reason="race")
        assert tracker.get_alias_version(name, CHAMPION) == 1
        monkeypatch.setattr(store, "append", real)
        assert [d.to_version for d in deployments(store, name)] == [1]


def test_an_alias_move_that_fails_is_completed_later(world, monkeypatch):
    """Review finding 10."""
    cfg, tracker = world
    name = cfg.cycle.model_name
    with open_store(cfg) as store:
        real = tracker.set_alias

        def down(*a, **kw):
            raise ConnectionError("MLflow is down")

        monkeypatch.setattr(tracker, "set_alias", down)
        with pytest.raises(DeployError, match="is recorded"):
            promote(cfg, store, tracker, 2, force=True, reason="mlflow down")
        assert tracker.get_alias_version(name, CHAMPION) == 1
        monkeypatch.setattr(tracker, "set_alias", real)
        r = reconcile_champion(store, tracker, name)
        assert (r.action, r.champion) == ("completed", 2) and tracker.get_alias_version(name, CHAMPION) == 2
        with pytest.raises(DeployError, match="already the champion"):
            promote(cfg, store, tracker, 2, force=True, reason="again")


def test_a_rollback_between_a_promotions_event_and_its_alias_move_is_not_overwritten(world, monkeypatch):
    """Issue 31, finding 11: promote recorded 1 -> 2; before it moved the alias, a rollback completed
    that move and rolled back to 1 (event and alias); then promote set the alias to 2 unconditionally,
    so the champion was 2 while the history's last word was "back to 1". With compare-and-set the
    promotion sees it was superseded, leaves the alias to the rollback and says so."""
    from flywheel.deploy import DeploySuperseded

    cfg, tracker = world
    name = cfg.cycle.model_name
    with open_store(cfg) as store:
        real = store.append
        raced = []

        def then_a_rollback(stream, *a, **kw):
            res = real(stream, *a, **kw)
            if stream.startswith("deploy:") and not raced:
                raced.append(True)
                rollback(cfg, store, tracker, reason="interleaved")  # runs to its end before promote goes on
            return res

        monkeypatch.setattr(store, "append", then_a_rollback)
        with pytest.raises(DeploySuperseded, match="later rollback to version 1"):
            promote(cfg, store, tracker, 2, force=True, reason="race")
        assert raced
        history = deployments(store, name)
        assert [(d.action, d.from_version, d.to_version) for d in history] == [
            ("promote", None, 1), ("promote", 1, 2), ("rollback", 2, 1)]
        assert tracker.get_alias_version(name, CHAMPION) == 1  # the rollback's, not overwritten
        assert reconcile_champion(store, tracker, name).action == "in_sync"


def test_an_alias_moved_by_hand_after_the_event_is_not_overwritten(world, monkeypatch):
    """Compare-and-set on the alias too: moved outside flywheel after the event, it is left alone.

    Issue 31, finding 11."""
    cfg, tracker = world
    name = cfg.cycle.model_name
    with open_store(cfg) as store:
        real = store.append

        def then_by_hand(stream, *a, **kw):
            res = real(stream, *a, **kw)
            if stream.startswith("deploy:"):
                tracker.delete_alias(name, CHAMPION)  # someone in the MLflow UI
            return res

        monkeypatch.setattr(store, "append", then_by_hand)
        with pytest.raises(DeployError, match="outside flywheel"):
            promote(cfg, store, tracker, 2, force=True, reason="race")
        assert tracker.get_alias_version(name, CHAMPION) is None  # left as the person left it

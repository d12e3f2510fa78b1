"""Deployment: the MLflow alias ``champion`` is the deployed model; promotion and rollback move it.

Guarantees
- :func:`promote` moves ``champion`` only with a *passing* ``gate.decided`` for exactly this model
  version, this held-out suite version (the latest one, unless given) and this champion (a decision
  taken against an older champion does not count: the new challenger has not been compared with
  the model it would replace). Otherwise it raises :class:`PromotionRefused`, unless
  ``force=True`` with a non-empty ``reason``; a forced promotion is recorded as such (who, why,
  and which gate decision, if any, it overrode).
- Every move appends one event on ``deploy:<model name>``: ``model.promoted`` (causation: the gate
  decision and the model version) or ``model.rolled_back`` (causation: the model version). Payloads
  record who (``getpass.getuser()``), when, from -> to.
- The history is written first and the alias moved second. The append uses ``expected_version`` on
  the deploy stream, so two concurrent promoters cannot both record a move from the same champion,
  and a refused or failed append leaves the alias untouched. A process killed between the two steps
  (or an MLflow error in the second) leaves a move that is recorded but not applied: the alias still
  names the previous champion, which is the recorded move's ``from``.
  :func:`flywheel.champion.reconcile_champion` completes such a move, and it runs at start-up of everything that acts on the champion:
  :func:`promote`, :func:`rollback`, the gate (:func:`flywheel.gate.run_gate`), rollouts from the
  champion, the cycle flow, the demo's bootstrap and ``flywheel serve --champion``. (The reverse order, used before, could leave an
  unrecorded champion that ``rollback`` could not resolve.)
- The alias is moved by compare-and-set (:func:`_record_then_move`): only while the move's event is
  the last of the deploy stream and the alias still names its ``from``; a move superseded by a later
  one (a rollback finishing in between) raises :class:`DeploySuperseded` and leaves the alias to the
  later move, never overwriting it.
- :func:`rollback` without ``to`` returns to the champion that preceded the current one's latest
  promotion; ``to`` must be a version that was promoted before (rolling back to a never-gated
  version would bypass the gate: promote it instead).
- :class:`ChampionWatcher` (``flywheel serve --champion``) serves whatever ``champion`` points to:
  it polls the alias every ``[serve] poll_alias_s`` seconds (and at once on SIGHUP), loads a new
  version in a background thread and swaps one reference; a request that already took the old
  policy finishes on it. A version that fails to load is logged and the old one keeps serving.

An alias moved outside flywheel (MLflow UI, anyone who reached the tracking server) is *not served*
(issue 31, finding 3): the watcher serves an alias version only if it is the last recorded move's
target (or its ``from``, a move recorded and not yet applied); otherwise it keeps serving what it
serves (at start: the recorded champion), logs the refusal and reports it (``last_error``,
``refused``). Not guaranteed: such a change is not recorded in the deployment history; :func:`flywheel.champion.reconcile_champion` reports them as
``diverged`` and leaves them alone. ``flywheel serve --champion`` reconciles once at start-up, when
the event store is free; a move interrupted while it runs is served once the next command that acts
on the champion completes it (the watcher then swaps within ``poll_alias_s``).
"""

from __future__ import annotations

import datetime as _dt
import getpass
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.champion import CHAMPION, Deployment, deploy_stream, deployments, reconcile_champion
from flywheel.config import FlywheelConfig
from flywheel.policy.models import ensure_base_model
from flywheel.policy.registry import load_policy_for_version
from flywheel.store import EventStore, NewEvent, StoreLockedError, open_store
from flywheel.tracking import Tracker

log = logging.getLogger(__name__)

class DeployError(RuntimeError):
    """A deployment action could not be carried out (unknown version, nothing to roll back to)."""


class PromotionRefused(DeployError):
    """Promotion refused by policy (no passing gate decision); ``--force --reason`` overrides."""


def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no USER/LOGNAME and no passwd entry (some containers)
        return "unknown"


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


def latest_suite_id(store: EventStore, suite_name: str) -> str | None:
    """``suite:<name>@N`` of the latest version of a suite, from its ``suite.versioned`` events."""
    events = store.read(stream=f"suite:{suite_name}", types="suite.versioned")
    return str(events[-1].payload["entity_id"]) if events else None


def _check_version(tracker: Tracker, name: str, version: int) -> None:
    try:
        tracker.model_version(name, version)
    except Exception as e:  # MLflow raises its own exception types
        raise DeployError(f"model:{name}/{version} is not a registered model version ({e})") from None


def find_gate_decision(
    store: EventStore, name: str, version: int, *, suite_id: str | None, champion: str | None
) -> dict[str, Any] | None:
    """The latest ``gate.decided`` payload for this model version on ``suite_id`` against
    ``champion`` (``model:<name>/<v>``, or ``None`` meaning "no champion": a base-model decision).
    Passing decisions are preferred over later refusals only if no later one exists."""
    matches = []
    for ev in store.read(stream="gate:*", types="gate.decided"):
        p = ev.payload
        if p.get("model") != name or p.get("challenger_version") != version:
            continue
        if suite_id is not None and p.get("suite") != suite_id:
            continue
        champ = p.get("champion") or ""
        if champion is None and not champ.startswith("base:"):
            continue
        if champion is not None and champ != champion:
            continue
        matches.append(p)
    return matches[-1] if matches else None


class DeploySuperseded(DeployError):
    """A move was recorded, but another one was recorded after it before its alias moved: the alias
    follows the later move (the history's last word), not this one."""


def _record_then_move(store: EventStore, tracker: Tracker, name: str, event: NewEvent, expected: int, target: int,
                      correlation_id: str | None) -> int | None:
    """Append the deployment event (expected version), then move the alias by compare-and-set: only
    while this event is still the last of the deploy stream and the alias still names the event's
    ``from_version``. Otherwise a later move (a rollback that finished in between) would be overwritten
    by this older one (issue 31, finding 11): the later mover completed this move first (it reconciles
    before acting) and then moved the alias itself. MLflow has no conditional alias update, so a move
    recorded in the instant between the check and ``set_alias`` is caught by a second look at the
    stream afterwards, and the alias is then brought to the history's last move."""
    stream = deploy_stream(name)
    res = store.append(stream, event, expected_version=expected, correlation_id=correlation_id)
    mine = expected + 1  # this event's version on the stream
    expected_alias = event.payload.get("from_version")

    def superseded(now: int) -> DeploySuperseded:
        last = deployments(store, name)[-1]
        return DeploySuperseded(
            f"the {event.type} of model:{name}/{target} is recorded (seq {res.last_seq}), but a later "
            f"{last.action} to version {last.to_version} (seq {last.seq}, by {last.user}) was recorded before "
            f"the alias moved; the champion alias follows that one (deploy stream at version {now})")

    now = store.stream_version(stream)
    if now != mine:
        raise superseded(now)
    try:
        alias = tracker.get_alias_version(name, CHAMPION)
        if alias != expected_alias:
            raise DeployError(
                f"the {event.type} of model:{name}/{target} is recorded (seq {res.last_seq}), but the champion "
                f"alias moved from {expected_alias} to {alias} outside flywheel meanwhile; left as it is "
                f"(`flywheel status` reports it as diverged)")
        tracker.set_alias(name, CHAMPION, target)
    except DeployError:
        raise
    except Exception as e:
        raise DeployError(
            f"the {event.type} of model:{name}/{target} is recorded (seq {res.last_seq}) but moving the "
            f"MLflow alias failed ({e}); the next promote, rollback, gate, rollout or cycle completes it"
        ) from e
    now = store.stream_version(stream)
    if now != mine:  # recorded while the alias moved: the history's last move wins
        reconcile_champion(store, tracker, name)
        raise superseded(now)
    return res.last_seq


def promote(
    cfg: FlywheelConfig,
    store: EventStore,
    tracker: Tracker,
    model_version: int,
    *,
    decision: Any = None,
    force: bool = False,
    reason: str | None = None,
    correlation_id: str | None = None,
    suite: str | None = None,
    user: str | None = None,
) -> Deployment:
    """Move ``champion`` to ``model_version`` (see module doc for when it is refused).

    ``decision``: a :class:`flywheel.gate.GateDecision` (or its payload) to use instead of looking
    one up; it must still be for this version, suite version and current champion.
    """
    name = cfg.cycle.model_name
    version = int(model_version)
    _check_version(tracker, name, version)
    if force and not (reason and reason.strip()):
        raise DeployError("--force needs --reason: a forced promotion must say why (it is recorded)")
    reconcile_champion(store, tracker, name)
    stream_version = store.stream_version(deploy_stream(name))
    current = tracker.get_alias_version(name, CHAMPION)
    if current == version:
        raise DeployError(f"model:{name}/{version} is already the champion")
    suite_id = suite if suite and suite.startswith("suite:") else (
        latest_suite_id(store, suite or cfg.cycle.heldout_suite)
    )
    champion_entity = f"model:{name}/{current}" if current is not None else None

    if decision is not None:
        d = decision.to_json() if hasattr(decision, "to_json") else dict(decision)
        d.setdefault("model", name)
        gate_id = d.get("gate_id") or d.get("entity_id")
        problems = []
        if d.get("challenger_version") != version:
            problems.append(f"it is for version {d.get('challenger_version')}")
        if suite_id is not None and d.get("suite") != suite_id:
            problems.append(f"it was taken on {d.get('suite')}, the held-out suite is now {suite_id}")
        champ = d.get("champion") or ""
        if (champion_entity is None and not champ.startswith("base:")) or (
            champion_entity is not None and champ != champion_entity
        ):
            problems.append(f"it compared against {champ or 'nothing'}, the champion is now {champion_entity or 'none'}")
        if problems:
            found = None
            why = f"gate decision {gate_id} does not apply: " + "; ".join(problems)
        else:
            found = d
            why = ""
    else:
        found = find_gate_decision(store, name, version, suite_id=suite_id, champion=champion_entity)
        why = "" if found else (
            f"no gate decision for model:{name}/{version} on {suite_id or 'any suite'} against "
            f"{champion_entity or 'the base model'}; run `flywheel gate {version}` first"
        )
    gate_id = (found or {}).get("gate_id") or (found or {}).get("entity_id")
    if found is not None and not found.get("passed"):
        reasons = "; ".join(found.get("reasons", [])[:3])
        why = f"gate decision {gate_id} refused model:{name}/{version}: {reasons}"
    gate_ok = found is not None and bool(found.get("passed"))
    if not gate_ok and not force:
        raise PromotionRefused(why + " (or override with --force --reason '...')")

    dep = Deployment(
        action="promote", model=name, from_version=current, to_version=version, gate=gate_id,
        forced=bool(force and not gate_ok), reason=reason if (force or reason) else None,
        user=user or current_user(), at=_now(),
    )
    payload = {
        **dep.to_json(),
        "suite": suite_id,
        "gate_passed": gate_ok,
        "refusal_overridden": (why or None) if dep.forced else None,
    }
    payload.pop("seq")
    causation = [c for c in (gate_id, f"model:{name}/{version}") if c]
    seq = _record_then_move(store, tracker, name, NewEvent("model.promoted", payload, causation), stream_version,
                            version, correlation_id)
    log.info("promoted model:%s/%s (was %s) gate=%s forced=%s", name, version, current, gate_id, dep.forced)
    return Deployment(**{**dep.to_json(), "seq": seq})


def rollback(
    cfg: FlywheelConfig,
    store: EventStore,
    tracker: Tracker,
    to: int | None = None,
    *,
    reason: str | None = None,
    user: str | None = None,
    correlation_id: str | None = None,
) -> Deployment:
    """Move ``champion`` back (to the previous champion, or to ``to``); appends ``model.rolled_back``."""
    name = cfg.cycle.model_name
    reconcile_champion(store, tracker, name)
    stream_version = store.stream_version(deploy_stream(name))
    current = tracker.get_alias_version(name, CHAMPION)
    if current is None:
        raise DeployError(f"{name} has no champion: nothing to roll back")
    history = deployments(store, name)
    promoted = [d for d in history if d.action == "promote"]
    if to is None:
        last = next((d for d in reversed(promoted) if d.to_version == current), None)
        if last is None or last.from_version is None:
            raise DeployError(
                f"model:{name}/{current} has no previous champion in the deployment history; "
                f"pass --to VERSION"
            )
        target = int(last.from_version)
    else:
        target = int(to)
        _check_version(tracker, name, target)
        if not any(d.to_version == target for d in promoted):
            raise DeployError(
                f"model:{name}/{target} was never promoted; rolling back to it would bypass the gate "
                f"(use `flywheel gate {target}` and `flywheel promote {target}`)"
            )
    if target == current:
        raise DeployError(f"model:{name}/{target} is already the champion")
    via = next((d.gate for d in reversed(promoted) if d.to_version == target), None)
    dep = Deployment(
        action="rollback", model=name, from_version=current, to_version=target, gate=via, forced=False,
        reason=reason, user=user or current_user(), at=_now(),
    )
    payload = dep.to_json()
    payload.pop("seq")
    seq = _record_then_move(store, tracker, name, NewEvent("model.rolled_back", payload, [f"model:{name}/{target}"]),
                            stream_version, target, correlation_id)
    log.info("rolled back %s: %s -> %s", name, current, target)
    return Deployment(**{**dep.to_json(), "seq": seq})


def bootstrap_champion(cfg: FlywheelConfig, store: EventStore, tracker: Tracker) -> tuple[int, bool]:
    """Register the base model (``[policy] base_model``) as the first version of ``[cycle]
    model_name`` and make it ``champion`` (forced: there is nothing to gate it against); returns
    ``(champion version, created)``. What ``flywheel init`` and the demo do, so ``champion`` names a
    registered version (``trace champion``, ``serve --champion``) before the first promotion.

    Idempotent: an existing champion is kept (an interrupted bootstrap or promotion is completed
    first). Raises :class:`flywheel.policy.models.ModelLoadError` when the base model cannot be
    materialised locally (a hub name, a missing directory): nothing is registered then."""
    name = cfg.cycle.model_name
    current = reconcile_champion(store, tracker, name).champion  # a bootstrap killed half-way is completed
    if current is not None:
        return current, False
    spec = cfg.policy.base_model
    directory = ensure_base_model(spec, cfg.home)
    model_ent_base = f"model:base/{Path(spec).name or spec}"
    with tracker.run("bootstrap-champion", consumes=[model_ent_base], tags={"base_model": spec}) as run:
        version = tracker.register_model(name, directory, run_id=run.run_id,
                                         tags={"base_model": spec, "adapter": "false", "mode": "base"})
    store.append(f"model:{name}", NewEvent("model.registered", {
        "entity_id": f"model:{name}/{version}", "name": name, "version": version, "adapter": "full",
        "base_model": spec, "mlflow_run_id": run.run_id, "aliases": ["champion"],
    }, [model_ent_base]))
    promote(cfg, store, tracker, version, force=True,
            reason="bootstrap: the base model is the first champion (nothing to gate it against)")
    return version, True


# --------------------------------------------------------------------------------------------
# serving the champion


class ChampionWatcher:
    """A ``policy_provider`` for :func:`flywheel.serve.create_app` that follows the ``champion`` alias.

    ``watcher()`` returns ``(model name, policy)`` of the current champion: one attribute read, so a
    request that took a policy keeps it while a swap happens. :meth:`start` loads the current
    champion synchronously (serving needs a model) and starts the polling thread; :meth:`check_now`
    does one poll-and-maybe-load in the calling thread (tests, SIGHUP).

    ``loader(version) -> policy`` defaults to :func:`flywheel.policy.registry.load_policy_for_version`;
    ``alias_version() -> int | None`` defaults to reading the alias through the tracker.
    """

    def __init__(
        self,
        cfg: FlywheelConfig,
        name: str | None = None,
        *,
        tracker: Tracker | None = None,
        loader: Callable[[int], Any] | None = None,
        alias_version: Callable[[], int | None] | None = None,
        poll_s: float | None = None,
        history: Callable[[], list[Deployment]] | None = None,
    ) -> None:
        self.name = name or cfg.cycle.model_name
        # The deployment history the alias must agree with (issue 31, finding 3): by default read from
        # the event store, opened for the read and closed again (only when the alias moved). A caller
        # that injects its own alias source without a history is trusted (tests of the swap itself).
        if history is None and alias_version is None:
            def history() -> list[Deployment]:
                with open_store(cfg) as store:
                    return deployments(store, self.name)
        self._history = history
        self.refused: int | None = None  # the alias version last refused (not served), if any
        if tracker is None and (loader is None or alias_version is None):
            tracker = Tracker(cfg)
        if loader is None:
            def loader(v: int) -> Any:
                return load_policy_for_version(cfg, tracker, self.name, v)

        self._loader = loader
        self._alias = alias_version or (lambda: tracker.get_alias_version(self.name, CHAMPION))
        self.poll_s = float(poll_s if poll_s is not None else cfg.serve.poll_alias_s)
        self._current: tuple[str, Any] | None = None
        self.version: int | None = None
        self.swaps = 0
        self.last_error: str | None = None
        self._load_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_sighup: Any = None

    def __call__(self) -> tuple[str, Any]:
        cur = self._current
        if cur is None:
            raise DeployError(f"{self.name}: no champion loaded yet")
        return cur

    def check_now(self) -> bool:
        """Poll the alias once; load and swap if it moved. Returns True when a swap happened."""
        with self._load_lock:
            v = self._alias()
            if v is None:
                if self._current is None:
                    raise DeployError(f"{self.name} has no champion alias; promote a model first")
                return False  # alias deleted: keep serving what we have rather than nothing
            if v == self.version:
                return False
            why = self._unrecorded(int(v))
            if why is not None:
                self.last_error, self.refused = why, int(v)
                log.error("%s; still serving version %s", why, self.version)
                if self._current is not None:
                    return False
                recorded = self._recorded_champion()
                if recorded is None or recorded == v:
                    raise DeployError(why)
                v = recorded  # at start: serve the recorded champion, not the alias
            try:
                policy = self._loader(int(v))
            except Exception as e:
                self.last_error = f"loading model:{self.name}/{v} failed: {e}"
                if self._current is None:
                    raise DeployError(self.last_error) from e
                log.error("%s; still serving version %s", self.last_error, self.version)
                return False
            self._current = (self.name, policy)  # the swap: one reference assignment
            old, self.version = self.version, int(v)
            self.swaps += 1
            self.last_error = None
            log.info("serving model:%s/%s (was %s)", self.name, v, old)
            return True

    def _unrecorded(self, v: int) -> str | None:
        """Why alias version ``v`` must not be served, or None: it must be the target of the last
        recorded ``model.promoted``/``model.rolled_back`` (or its ``from``: recorded, the alias not yet
        moved). An alias moved by hand, or by anyone who reached MLflow, is refused and logged; the
        server keeps serving what it serves."""
        if self._history is None:
            return None
        history = self._history()
        if not history:
            return (f"the champion alias of {self.name} names version {v}, but the deployment history is empty: "
                    "refused (promote through flywheel)")
        last = history[-1]
        if v in (last.to_version, last.from_version):
            return None
        return (f"the champion alias of {self.name} moved to version {v} without a model.promoted or "
                f"model.rolled_back event (the last recorded move is {last.action} {last.from_version} -> "
                f"{last.to_version}, seq {last.seq}): refused")

    def _recorded_champion(self) -> int | None:
        history = self._history() if self._history is not None else []
        return history[-1].to_version if history else None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.check_now()
            except Exception as e:  # a broken tracking store must not kill the server
                self.last_error = str(e)
                log.error("champion poll failed: %s", e)

    def reload(self) -> None:
        """Ask the polling thread to check the alias now (what SIGHUP does)."""
        self._wake.set()

    def start(self, *, install_sighup: bool = True) -> ChampionWatcher:
        self.check_now()
        self._thread = threading.Thread(target=self._run, name=f"champion-watcher-{self.name}", daemon=True)
        self._thread.start()
        if install_sighup and threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
            self._old_sighup = signal.signal(signal.SIGHUP, lambda *_: self.reload())
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._old_sighup is not None:
            signal.signal(signal.SIGHUP, self._old_sighup)
            self._old_sighup = None


def champion_provider(cfg: FlywheelConfig, name: str | None = None, **kw: Any) -> ChampionWatcher:
    """A started :class:`ChampionWatcher`: pass it as ``policy_provider`` to ``create_app``. At start
    it opens the event store briefly to complete an interrupted promotion first (when another
    process holds the store, it serves the alias as it is: that process reconciles when it acts on
    the champion, and the watcher follows)."""
    watcher = ChampionWatcher(cfg, name, **kw)
    tracker = kw.get("tracker")
    try:
        with open_store(cfg) as store:
            if tracker is None:
                tracker = Tracker(cfg)
            reconcile_champion(store, tracker, watcher.name)
    except StoreLockedError as e:
        log.info("not reconciling the champion at start-up (%s); serving the alias as it is", e)
    return watcher.start()

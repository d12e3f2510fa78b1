"""The champion: the MLflow alias ``champion`` of ``[cycle] model_name`` and the deployment history
that moves it (``model.promoted`` / ``model.rolled_back`` events on ``deploy:<model name>``).

Everything that acts on the champion (promotion and rollback in :mod:`flywheel.deploy`, the gate,
rollouts from the champion, the cycle flow, the demo's bootstrap, ``flywheel serve --champion``)
first calls :func:`reconcile_champion`: a move is recorded before the alias is moved, so a process
killed between the two leaves the alias on the recorded move's ``from``, and reconciling completes
that move.

Not guaranteed: alias changes made outside flywheel (MLflow UI) are reported as ``diverged`` and
left alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flywheel.store import EventStore

if TYPE_CHECKING:  # annotation only: flywheel.tracking is the one module that imports mlflow
    from flywheel.tracking import Tracker

__all__ = ["CHAMPION", "Deployment", "Reconciliation", "deploy_stream", "deployments", "reconcile_champion"]

log = logging.getLogger(__name__)

CHAMPION = "champion"


@dataclass(frozen=True)
class Deployment:
    """One recorded move of the champion (``model.promoted`` or ``model.rolled_back``)."""

    action: str  # "promote" | "rollback"
    model: str
    from_version: int | None
    to_version: int
    gate: str | None
    forced: bool
    reason: str | None
    user: str
    at: str
    seq: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def deploy_stream(name: str) -> str:
    """The stream holding the deployment history of model ``name``."""
    return f"deploy:{name}"


@dataclass(frozen=True)
class Reconciliation:
    """What :func:`reconcile_champion` found and did. ``action``: ``in_sync`` (the alias is the last
    recorded move's target, or there is no history and no alias), ``completed`` (a recorded move the
    alias had not followed was applied), ``diverged`` (the alias was set outside flywheel: left
    alone), ``unrecorded`` (an alias and no deployment history)."""

    model: str
    action: str
    alias_before: int | None
    recorded: int | None

    @property
    def champion(self) -> int | None:
        return self.recorded if self.action == "completed" else self.alias_before


def reconcile_champion(store: EventStore, tracker: Tracker, name: str) -> Reconciliation:
    """Bring the ``champion`` alias in line with the deployment history (see the module docstring)."""
    history = deployments(store, name)
    alias = tracker.get_alias_version(name, CHAMPION)
    if not history:
        return Reconciliation(name, "unrecorded" if alias is not None else "in_sync", alias, None)
    last = history[-1]
    if alias == last.to_version:
        return Reconciliation(name, "in_sync", alias, last.to_version)
    if alias == last.from_version:
        # Recorded, never applied: the process stopped between the append and the alias move.
        tracker.set_alias(name, CHAMPION, last.to_version)
        log.warning("completed the interrupted %s of %s: champion %s -> %s (recorded at seq %s)",
                    last.action, name, alias, last.to_version, last.seq)
        return Reconciliation(name, "completed", alias, last.to_version)
    log.warning("the champion alias of %s (version %s) is not the last recorded deployment (version %s): it "
                "was moved outside flywheel; left as it is", name, alias, last.to_version)
    return Reconciliation(name, "diverged", alias, last.to_version)


def deployments(store: EventStore, name: str) -> list[Deployment]:
    """The deployment history of ``name``, oldest first."""
    out = []
    for ev in store.read(stream=deploy_stream(name), types=["model.promoted", "model.rolled_back"]):
        p = ev.payload
        out.append(Deployment(
            action=p.get("action", "promote" if ev.type == "model.promoted" else "rollback"),
            model=p.get("model", name), from_version=p.get("from_version"), to_version=int(p["to_version"]),
            gate=p.get("gate"), forced=bool(p.get("forced")), reason=p.get("reason"),
            user=p.get("user", "unknown"), at=p.get("at") or str(ev.recorded_at), seq=ev.seq,
        ))
    return out

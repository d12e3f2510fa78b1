"""The gate stage: :func:`run_gate`, a list of the steps of :mod:`flywheel.gate.evidence` and
:mod:`flywheel.gate.recording`."""

from __future__ import annotations

from pathlib import Path

from flywheel.artifacts import ArtifactStore
from flywheel.config import FlywheelConfig
from flywheel.evaluate import PolicyLoader
from flywheel.gate.decision import GateDecision, render_markdown
from flywheel.gate.evidence import _assess, _contestants, _evaluate, _gate_suites
from flywheel.gate.recording import (
    _consumes,
    _decided_payload,
    _gate_id,
    _log_run,
    _numbers,
    _reasons,
    _write_report,
)
from flywheel.store import EventStore, NewEvent
from flywheel.tracking import Tracker
from flywheel.versioning import Suite


def run_gate(
    cfg: FlywheelConfig,
    store: EventStore,
    artifacts: ArtifactStore,
    tracker: Tracker,
    model_version: int,
    *,
    suite: Suite | str | None = None,
    correlation_id: str | None = None,
    policy_loader: PolicyLoader | None = None,
) -> GateDecision:
    """Gate ``model:<[cycle] model_name>/<model_version>`` against the champion on ``suite``.

    ``suite``: a suite object or spec (default: the latest version of ``[cycle] heldout_suite``).
    The regression suite (``[cycle] regression_suite``, latest version) is used when one exists.
    Appends one ``gate.decided`` event (``gate:<hash of the inputs>``, causation: challenger,
    champion, suite versions, evaluations), writes ``<home>/reports/gate/<id>.md`` and logs it to an
    MLflow run named ``gate``. Re-running with the same inputs returns the recorded decision
    (``cached=True``) without evaluating or logging again.

    Raises :class:`GateError` (or :class:`flywheel.evaluate.EvaluationError`) when the gate cannot be
    evaluated; a refusal is a normal return with ``passed=False``.
    """
    models = _contestants(cfg, store, tracker, model_version)
    suites = _gate_suites(cfg, store, artifacts, suite)
    evals = _evaluate(cfg, store, artifacts, tracker, models, suites, policy_loader, correlation_id)
    a = _assess(cfg, store, models, suites, evals)

    gate_id = _gate_id(cfg.gate, evals, a)
    report_path = Path(cfg.home) / "reports" / "gate" / f"{gate_id.split(':', 1)[1]}.md"
    prior = store.read(stream=gate_id, types="gate.decided")
    if prior:
        return GateDecision.from_payload(prior[-1].payload, report_path if report_path.exists() else None)

    decision = GateDecision(
        gate_id=gate_id, outcome=a.outcome, reasons=_reasons(a), rules=list(a.rules),
        numbers=_numbers(cfg.gate, models, suites, evals, a), report_path=report_path, model=models.name,
        challenger_version=models.version, champion=str(models.champion), suite=suites.heldout_id,
    )
    md = render_markdown(decision)
    md_ref = _write_report(report_path, md, artifacts)
    consumes = _consumes(models, suites, evals)
    run_id = _log_run(tracker, cfg.gate, decision, md, a, suites, evals, consumes, models.version, correlation_id)
    store.append(gate_id, NewEvent("gate.decided", _decided_payload(decision, md_ref, run_id), consumes),
                 correlation_id=correlation_id)
    return decision

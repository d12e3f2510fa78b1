"""Gate and deployment commands: gate, promote, rollback, deployments.

Exit codes (for CI systems): ``flywheel gate`` exits 0 when the gate passes, 3 on a clean refusal,
4 when the evidence is insufficient (too few paired held-out items to decide), 1 (or another
non-zero code) on errors. ``flywheel promote`` exits 3 when promotion is refused for
want of a passing gate decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from flywheel.cli.common import (
    CliError,
    ConfigOpt,
    HomeOpt,
    JsonOpt,
    console,
    emit_json,
    handle_errors,
    load,
    out,
    print_table,
)
from flywheel.config import FlywheelConfig

if TYPE_CHECKING:  # duckdb and pyarrow load when a command opens the store, not when the CLI starts
    from flywheel.artifacts import ArtifactStore
    from flywheel.store import EventStore
    from flywheel.tracking import Tracker

REFUSED = 3
INSUFFICIENT_EVIDENCE = 4
EXIT_CODES = {"passed": 0, "refused": REFUSED, "insufficient_evidence": INSUFFICIENT_EVIDENCE}
VERDICTS = {"passed": "[bold green]PASSED[/]", "refused": "[bold red]REFUSED[/]",
            "insufficient_evidence": "[bold yellow]INSUFFICIENT EVIDENCE[/]"}


def register(app: typer.Typer) -> None:
    app.command("gate")(gate)
    app.command("promote")(promote)
    app.command("rollback")(rollback)
    app.command("deployments")(deployments)


def _open(home: str | None, config: str | None, overrides: dict[str, Any] | None = None,
          ) -> tuple[FlywheelConfig, EventStore, ArtifactStore, Tracker]:
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start

    cfg = load(home, config, overrides)
    return cfg, open_store(cfg), open_artifacts(cfg), Tracker(cfg)


def registered_version(cfg: FlywheelConfig, tracker: Tracker, ref: str) -> int:
    """The version of ``[cycle] model_name`` that ``ref`` names: the references of ``rollout --policy``
    that name a registered version (``challenger``, ``champion``, ``model:<name>/<N>``,
    ``<name>/<N>``) or a bare version number. A version of another registered model is refused: the
    gate and the champion alias belong to ``[cycle] model_name``."""
    from flywheel.policy.registry import ModelRefError, resolve_model  # ~0.2 s: off the CLI's start

    try:
        m = resolve_model(cfg, tracker, ref, bare_version=True, registered_only=True)
    except ModelRefError as e:
        raise CliError(str(e)) from None
    if m.name != cfg.cycle.model_name:
        raise CliError(f"{m.ref} is not a version of [cycle] model_name {cfg.cycle.model_name!r}: the gate "
                       "compares versions of that model with its champion")
    return int(m.version)  # type: ignore[arg-type]


def _gate_errors() -> tuple[type[BaseException], ...]:
    from flywheel.deploy import DeployError  # duckdb, ~0.6 s: off the CLI's start
    from flywheel.evaluate import EvaluationError  # duckdb, ~0.6 s: off the CLI's start
    from flywheel.gate import GateError  # scipy+duckdb, ~2.5 s: off the CLI's start

    return (GateError, EvaluationError, DeployError)


def render_decision(decision: Any) -> None:
    from rich.table import Table

    n = decision.numbers
    verdict = VERDICTS[decision.outcome]
    out.print(f"gate {decision.gate_id}: {verdict}  {n.get('challenger')} vs {n.get('champion')} on {decision.suite}")
    if n.get("paired_items"):
        out.print(f"{n['paired_items']} paired items: champion {n['champion_pass_rate']:.1%}, challenger "
                  f"{n['challenger_pass_rate']:.1%}; {n['wins']} wins / {n['losses']} losses, exact sign test "
                  f"p = {n['p_value']:.4g}; one-sided {n['confidence']:.0%} lower bound {n['lower_bound']:+.1%}")
    t = Table(title="rules", title_justify="left", header_style="bold")
    for c in ("rule", "result", "value", "threshold", "reason"):
        t.add_column(c, overflow="fold")
    for r in decision.rules:
        val = f"{r.value:.3f}" if isinstance(r.value, float) else ("" if r.value is None else str(r.value))
        t.add_row(r.rule, "[green]pass[/]" if r.passed else "[red]FAIL[/]", val, str(r.threshold), r.reason)
    out.print(t)
    rows = [
        (s["name"], s["n"], f"{s['champion_rate']:.3f}", f"{s['challenger_rate']:.3f}", f"{s['delta']:+.3f}", s["wins"], s["losses"])
        for s in n.get("slices", [])
    ]
    if rows:
        print_table("slices", ["slice", "n", "champion", "challenger", "delta", "wins", "losses"], rows)
    if decision.report_path:
        console.print(f"report: {decision.report_path}")


@handle_errors
def gate(
    model: str = typer.Argument(
        "challenger", help="challenger | champion | model:<name>/<N> | <name>/<N> | a version number N of "
        "[cycle] model_name (default: challenger)."),
    suite: str = typer.Option(None, "--suite", help="Held-out suite (name or name@version); default the latest [cycle] heldout_suite."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Evaluate MODEL (a registered version, default the challenger) against the champion and decide.
    Exit 0 pass, 3 refused, 4 insufficient evidence, 1 error."""
    from flywheel.gate import run_gate  # scipy+duckdb, ~2.5 s: off the CLI's start

    cfg, store, artifacts, tracker = _open(home, config)
    model_version = registered_version(cfg, tracker, model)
    try:
        with store:
            decision = run_gate(cfg, store, artifacts, tracker, model_version, suite=suite)
    except _gate_errors() as e:
        raise CliError(str(e)) from None
    if as_json:
        emit_json(decision.to_json())
    else:
        render_decision(decision)
    if decision.outcome != "passed":
        raise typer.Exit(EXIT_CODES[decision.outcome])


@handle_errors
def promote(
    model: str = typer.Argument(..., help="Registered version to make champion: challenger | model:<name>/<N> | "
                                "<name>/<N> | a version number N of [cycle] model_name."),
    force: bool = typer.Option(False, "--force", help="Promote without a passing gate decision (needs --reason)."),
    reason: str = typer.Option(None, "--reason", help="Why (required with --force; recorded in the event)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Move the champion alias to MODEL; refused (exit 3) without a passing gate decision."""
    from flywheel.deploy import PromotionRefused  # duckdb, ~0.6 s: off the CLI's start
    from flywheel.deploy import promote as do_promote  # duckdb, ~0.6 s: off the CLI's start

    cfg, store, _artifacts, tracker = _open(home, config)
    model_version = registered_version(cfg, tracker, model)
    try:
        with store:
            dep = do_promote(cfg, store, tracker, model_version, force=force, reason=reason)
    except PromotionRefused as e:
        raise CliError(f"promotion refused: {e}", code=REFUSED) from None
    except _gate_errors() as e:
        raise CliError(str(e)) from None
    if as_json:
        emit_json(dep.to_json())
    else:
        forced = " [bold yellow](forced)[/]" if dep.forced else ""
        out.print(f"champion: model:{dep.model}/{dep.from_version} -> model:{dep.model}/{dep.to_version}{forced} (gate {dep.gate})")


@handle_errors
def rollback(
    to: int = typer.Option(None, "--to", help="Version to roll back to (default: the previous champion)."),
    reason: str = typer.Option(None, "--reason", help="Why (recorded)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Move the champion alias back to the previous champion (or --to VERSION)."""
    from flywheel.deploy import rollback as do_rollback  # duckdb, ~0.6 s: off the CLI's start

    cfg, store, _artifacts, tracker = _open(home, config)
    try:
        with store:
            dep = do_rollback(cfg, store, tracker, to, reason=reason)
    except _gate_errors() as e:
        raise CliError(str(e)) from None
    if as_json:
        emit_json(dep.to_json())
    else:
        out.print(f"champion: model:{dep.model}/{dep.from_version} -> model:{dep.model}/{dep.to_version} (rollback)")


@handle_errors
def deployments(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """The deployment history: who, when, which gate, from -> to."""
    from flywheel.champion import deployments as history  # duckdb, ~0.4 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as store:
        rows = history(store, cfg.cycle.model_name)
    if as_json:
        emit_json([d.to_json() for d in rows])
        return
    print_table(
        f"deployments of {cfg.cycle.model_name}",
        ["when", "who", "action", "from", "to", "gate", "forced", "reason"],
        [(d.at, d.user, d.action, d.from_version, d.to_version, d.gate, "yes" if d.forced else "", d.reason) for d in rows],
    )

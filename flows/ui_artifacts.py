"""What a cycle shows in the Prefect UI: artifacts on the flow run and on each stage's task run.

- Each stage task returns its summary through :func:`publish_stage`, which attaches a small markdown
  artifact (the stage's counts and its scalar fields) to the task run, so the task's page says what
  it did, not only that it completed.
- At the end, :func:`publish_cycle` attaches two artifacts to the flow run, under keys that are
  stable per deployment (:func:`artifact_keys`: ``flywheel-<deployment>-cycle-summary`` and
  ``flywheel-<deployment>-cycle-stages``; runs outside a deployment use ``adhoc``), so Prefect's
  Artifacts page shows their history night after night:

  - a markdown summary: outcome and reason, the gate decision with its p-value, the held-out pass
    rates (fix rate on production failures, keep rate on production successes), the champion after
    the cycle, and links to the HTML report (written here, ``<home>/reports/<run id>.html``) and to
    the challenger's MLflow model version;
  - a table: one row per stage in the order they ran, with its wall seconds and counts.

Publishing is observation, not a result: a failure to publish (Prefect API unreachable) is logged as
a warning and never fails a stage or the cycle; a report that cannot be built is named in the
summary instead of linked. The rendering functions are pure, so they are tested without Prefect.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flywheel.cycle import CycleResources
from flywheel.report import build_report

# ``timings`` keys (stage task names) -> ``stages`` keys of the cycle result
_STAGE_KEYS = {"train-sft": "sft", "train-grpo": "grpo", "rollouts-after-sft": "rollouts_after_sft"}
_MAX_FIELDS = 24  # rows of a stage's markdown: enough for every summary field we print, short on screen


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:48].strip("-") or "x"


def artifact_keys(deployment: str | None) -> dict[str, str]:
    """Prefect artifact keys (lowercase letters, digits, dashes) of a cycle run under ``deployment``."""
    prefix = f"flywheel-{_slug(deployment) if deployment else 'adhoc'}"
    return {"summary": f"{prefix}-cycle-summary", "stages": f"{prefix}-cycle-stages"}


def _num(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x + 0.0 if isinstance(x, float) else x, fmt)  # + 0.0: -0.0 prints as 0


def stage_counts(stage: str, s: Mapping[str, Any] | Any) -> str:
    """One line of counts for a stage summary (the table's ``counts`` column). A summary of a shape
    this does not know (a stage changed its fields) falls back to its numeric fields."""
    if not isinstance(s, Mapping):
        return str(s)
    try:
        return _known_counts(stage, s)
    except (TypeError, ValueError, AttributeError, KeyError):
        return _scalars(s)


def _scalars(s: Mapping[str, Any]) -> str:
    return ", ".join([f"{k} {v}" for k, v in s.items() if isinstance(v, int | float) and not isinstance(v, bool)][:8])


def _known_counts(stage: str, s: Mapping[str, Any]) -> str:
    if isinstance(s.get("skipped"), str):  # a stage that did not run says why (evals/envs list skipped items)
        return f"skipped: {s['skipped']}"
    key = _STAGE_KEYS.get(stage, stage)
    if key == "ingest":
        return (f"{s.get('read')} read, {s.get('ingested')} ingested, {s.get('quarantined')} quarantined, "
                f"{s.get('new_failures')} new failures")
    if key == "evals":
        splits = s.get("splits") or {}
        return ", ".join(f"{k} {v}" for k, v in sorted(splits.items())) or f"{len(s.get('suites') or [])} suites"
    if key == "envs":
        envs = [f"{e.get('env')} ({e.get('tasks')} tasks)" if isinstance(e, Mapping) else str(e) for e in s.get("envs") or []]
        return ", ".join(envs) or "no environment"
    if key in ("rollouts", "rollouts_after_sft"):
        st = s.get("stats") or {}
        return (f"{s.get('policy')}: {s.get('samples')} samples of {s.get('tasks')} tasks, pass@1 "
                f"{_num(st.get('pass_at_1'), '.2f')}, pass@K {_num(st.get('pass_at_k'), '.2f')}, zero-variance "
                f"groups {_num(st.get('zero_variance_share'), '.0%')}" + ("" if s.get("published", True) else " (not published)"))
    if key in ("sft", "grpo"):
        m = s.get("metrics") or {}
        return f"{s.get('model_entity')}: {s.get('steps')} steps, loss {_num(m.get('loss'), '.4f')}"
    if key == "gate":
        n = s.get("numbers") or {}
        return (f"{s.get('outcome')}: p = {_num(s.get('p_value'), '.4g')}, {n.get('wins')} wins / {n.get('losses')} "
                f"losses on {n.get('paired_items')} paired items")
    if key == "deploy":
        return ", ".join(f"{k} {v}" for k, v in s.items() if isinstance(v, str | int) and not isinstance(v, bool))[:300]
    return _scalars(s)


def stage_markdown(stage: str, summary: Mapping[str, Any] | Any) -> str:
    """The markdown a stage's task run shows: its counts line and its scalar fields."""
    lines = [f"### {stage}", "", stage_counts(stage, summary), ""]
    if isinstance(summary, Mapping):
        rows = []
        for k, v in summary.items():
            if isinstance(v, Mapping):
                v = ", ".join(f"{kk}={vv}" for kk, vv in v.items() if not isinstance(vv, Mapping | list))
            elif isinstance(v, list):
                v = f"{len(v)} items" if v and isinstance(v[0], Mapping | list) else ", ".join(map(str, v))
            text = str(v).replace("|", "/").replace("\n", " ")
            rows.append(f"| {k} | {text[:200]} |")
        if rows:
            lines += ["| field | value |", "|---|---|", *rows[:_MAX_FIELDS]]
    return "\n".join(lines) + "\n"


def stage_rows(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per stage, in the order the stages ran: ``stage``, ``seconds``, ``counts``."""
    stages = result.get("stages") or {}
    rows = []
    for stage, secs in (result.get("timings") or {}).items():
        rows.append({"stage": stage, "seconds": secs, "counts": stage_counts(stage, stages.get(_STAGE_KEYS.get(stage, stage)))})
    return rows


def cycle_markdown(result: Mapping[str, Any], *, champion: str | None, report: str | None, report_error: str | None,
                   model_link: str | None) -> str:
    """The cycle's summary artifact (see the module docstring)."""
    stages = result.get("stages") or {}
    gate = stages.get("gate") or {}
    n = gate.get("numbers") or {}
    lines = [f"# flywheel cycle: {result.get('outcome')}", "", str(result.get("reason") or ""), "",
             "| | |", "|---|---|", f"| cycle | `{result.get('cycle')}` |", f"| wall time | {result.get('wall_s')} s |"]
    if gate:
        lines += [
            f"| gate decision | **{gate.get('outcome')}** |",
            f"| evidence | exact sign test p = {_num(gate.get('p_value'), '.4g')}: {n.get('wins')} wins / "
            f"{n.get('losses')} losses on {n.get('paired_items')} paired held-out items |",
            f"| held-out pass rate | champion {_num(n.get('champion_pass_rate'), '.1%')}, challenger "
            f"{_num(n.get('challenger_pass_rate'), '.1%')} |",
        ]
        for key, label in (("failure", "fix rate (held-out production failures)"),
                           ("success", "keep rate (held-out production successes)")):
            o = (n.get("by_origin") or {}).get(key)
            if o:
                lines.append(f"| {label} | champion {_num(o.get('champion_rate'), '.1%')}, challenger "
                             f"{_num(o.get('challenger_rate'), '.1%')} ({o.get('n')} items) |")
        lines.append(f"| challenger | `{gate.get('model')}/{gate.get('challenger_version')}` against "
                     f"`{gate.get('champion')}` on `{gate.get('suite')}` |")
    lines.append(f"| champion after the cycle | `{champion or 'none'}`"
                 + (" (new)" if result.get("outcome") == "promoted" else "") + " |")
    if report:
        lines.append(f"| HTML report | [{Path(report).name}]({Path(report).absolute().as_uri()}) |")
    elif report_error:
        lines.append(f"| HTML report | not written: {report_error.replace('|', '/')} |")
    if model_link:
        shown = f"[{model_link}]({model_link})" if model_link.startswith(("http://", "https://")) else f"`{model_link}`"
        lines.append(f"| MLflow model version | {shown} |")
    if gate.get("rules"):
        lines += ["", "## Gate rules", "", "| rule | result | value | threshold |", "|---|---|---|---|"]
        for r in gate["rules"]:
            val = _num(r.get("value"), ".4g") if isinstance(r.get("value"), float) else r.get("value")
            lines.append(f"| {r.get('rule')} | {'pass' if r.get('passed') else 'FAIL'} | {val} | {r.get('threshold')} |")
    if gate.get("reasons"):
        lines += ["", "## Why", ""] + [f"- {x}" for x in gate["reasons"]]
    return "\n".join(lines) + "\n"


def _warn(what: str, e: BaseException) -> None:
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning("flywheel: %s not published: %s: %s", what, type(e).__name__, e)
    except Exception:  # noqa: BLE001 - outside a run context there is no run logger
        import logging

        logging.getLogger("flywheel.flows").warning("%s not published: %s: %s", what, type(e).__name__, e)


def publish_stage(stage: str, summary: Any) -> Any:
    """Attach ``summary``'s markdown to the running task; returns ``summary`` (a task returns this)."""
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(stage_markdown(stage, summary), description=f"flywheel {stage} stage result")
    except Exception as e:  # noqa: BLE001 - see the module docstring
        _warn(f"the {stage} stage artifact", e)
    return summary


def _deployment_name() -> str | None:
    try:
        from prefect.runtime import deployment

        return deployment.name
    except Exception:  # noqa: BLE001 - not in a deployment run
        return None


def publish_cycle(res: CycleResources, result: dict[str, Any]) -> dict[str, Any]:
    """Write the HTML report and attach the cycle's summary and stage table to the flow run.

    Returns ``{"summary": key, "stages": key, "report": path or None}`` (what was published)."""

    cfg, tracker = res.cfg, res.tracker
    keys = artifact_keys(_deployment_name())
    report = report_error = None
    try:
        report = build_report(cfg, res.store, tracker, cycle=result["cycle"])["path"]
    except Exception as e:  # noqa: BLE001 - the report is a view of the recorded cycle
        report_error = f"{type(e).__name__}: {e}"
    name = cfg.cycle.model_name
    gate = (result.get("stages") or {}).get("gate") or {}
    champion = model_link = None
    try:
        v = tracker.get_alias_version(name, "champion")
        champion = f"model:{name}/{v}" if v is not None else None
        if gate.get("challenger_version") is not None:
            model_link = tracker.model_version_link(name, int(gate["challenger_version"]))
    except Exception as e:  # noqa: BLE001 - an unreachable registry leaves the summary without the link
        report_error = report_error or f"MLflow registry: {type(e).__name__}: {e}"
    published: dict[str, Any] = {"report": report}
    try:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        create_markdown_artifact(cycle_markdown(result, champion=champion, report=report, report_error=report_error,
                                                model_link=model_link),
                                 key=keys["summary"], description=f"flywheel cycle {result.get('outcome')}")
        published["summary"] = keys["summary"]
        create_table_artifact(stage_rows(result), key=keys["stages"], description="flywheel cycle: per-stage counts and times")
        published["stages"] = keys["stages"]
    except Exception as e:  # noqa: BLE001 - see the module docstring
        _warn("the cycle artifacts", e)
    return published

"""``flywheel ingest`` and ``flywheel quarantine list|show``."""

from __future__ import annotations

from pathlib import Path

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
    print_table,
    progress,
)

quarantine_app = typer.Typer(help="Inspect records that failed ingest validation.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest)
    app.add_typer(quarantine_app, name="quarantine")


def _summary_tables(d: dict) -> None:
    print_table(
        "ingest summary",
        ["read", "ingested", "duplicates", "quarantined", "successes", "new failures", "updated failures", "events",
         "seconds"],
        [(d["read"], d["ingested"], d["duplicates"], d["quarantined"], d["successes"], d["new_failures"],
          d["updated_failures"], d["events_appended"], d["elapsed_s"])],
    )
    if d["quarantined_by_reason"]:
        print_table("quarantined by reason", ["reason", "records"], sorted(d["quarantined_by_reason"].items()))
    if d["failures_by_kind"]:
        print_table("failures by kind", ["kind", "traces"],
                    sorted(d["failures_by_kind"].items(), key=lambda kv: -kv[1]))
    if d["redactions_by_rule"]:
        print_table("redactions by rule", ["rule", "matches"], sorted(d["redactions_by_rule"].items()))


@handle_errors
def ingest(
    paths: list[Path] = typer.Argument(None, help="Trace files (.jsonl, .jsonl.gz, OTLP JSON) or directories."),
    fmt: str = typer.Option("auto", "--format", help="auto | openai | otel | bfcl."),
    replay_quarantine: bool = typer.Option(False, "--replay-quarantine",
                                           help="Retry every unresolved quarantined record (after a fix)."),
    batch_size: int = typer.Option(None, "--batch-size", help="Records per batch (ingest.batch_size)."),
    source: str = typer.Option(None, "--from", help="Read traces from a service instead of files: 'mlflow' "
                               "(MLflow Tracing on the configured tracking server, mlflow_tracking_uri)."),
    experiment: str = typer.Option(None, "--experiment", help="With --from mlflow: the MLflow experiment name."),
    since: str = typer.Option(None, "--since", help="With --from mlflow: only traces started at or after this "
                              "time (ISO 8601, e.g. 2026-11-30T00:00:00Z, or epoch milliseconds)."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Ingest production traces: validate, quarantine, deduplicate, redact, classify failures.

    Exit code 0 when records were only quarantined; 1 when a path is unusable; 2 when a batch fails
    the expectation suite (nothing of that batch is committed).
    """
    import time
    import uuid

    from flywheel.artifacts import open_artifacts
    from flywheel.ingest import IngestError, IngestRefused, ingest_paths
    from flywheel.ingest import replay_quarantine as replay
    from flywheel.store import open_store

    if source is not None:
        if source != "mlflow":
            raise CliError(f"--from must be 'mlflow' (got {source!r})")
        if paths or replay_quarantine:
            raise CliError("--from mlflow reads traces from MLflow: give no PATH and no --replay-quarantine with it")
        if not experiment:
            raise CliError("--from mlflow needs --experiment NAME")
    elif experiment or since:
        raise CliError("--experiment and --since go with --from mlflow")
    if not paths and not replay_quarantine and source is None:
        raise CliError("give at least one PATH, --from mlflow, or --replay-quarantine")
    if fmt not in ("auto", "openai", "otel", "bfcl"):
        raise CliError(f"--format must be auto, openai, otel or bfcl (got {fmt!r})")
    cfg = load(home, config, {"ingest": {"batch_size": batch_size}} if batch_size else None)
    correlation_id = f"ingest-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    artifacts = open_artifacts(cfg)
    with open_store(cfg) as store, progress(enabled=not as_json) as bar:
        task = bar.add_task("ingest", total=None, rate="")
        t0 = time.perf_counter()
        state = {"base": 0, "file": None}

        def report(p: dict) -> None:
            if p["file"] != state["file"]:
                state["file"] = p["file"]
            rate = p["records"] / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, description=Path(p["file"]).name[:40], completed=p["bytes_done"] or p["records"],
                       total=p["bytes_total"] or None, rate=f"{p['records']:,} records, {rate:,.0f} rec/s")

        try:
            if source == "mlflow":
                from flywheel.ingest.mlflow_source import ingest_mlflow
                from flywheel.tracking import Tracker

                summary = ingest_mlflow(cfg, store, artifacts, Tracker(cfg), experiment, since=since,
                                        correlation_id=correlation_id, progress=report)
            elif replay_quarantine:
                summary = replay(cfg, store, artifacts, correlation_id=correlation_id, progress=report)
                if paths:
                    more = ingest_paths(cfg, store, artifacts, list(paths), fmt=fmt, correlation_id=correlation_id,
                                        progress=report)
                    for k in ("read", "ingested", "duplicates", "new_failures", "updated_failures",
                              "events_appended", "successes"):
                        setattr(summary, k, getattr(summary, k) + getattr(more, k))
                    for k in ("quarantined_by_reason", "failures_by_kind", "redactions_by_rule"):
                        acc = getattr(summary, k)
                        for kk, v in getattr(more, k).items():
                            acc[kk] = acc.get(kk, 0) + v
                    summary.files += more.files
                    summary.elapsed_s = round(summary.elapsed_s + more.elapsed_s, 3)
            else:
                summary = ingest_paths(cfg, store, artifacts, list(paths), fmt=fmt, correlation_id=correlation_id,
                                       progress=report)
        except IngestError as e:
            raise CliError(str(e)) from None
        except IngestRefused as e:
            if as_json:
                emit_json({"error": str(e), "report": e.report})
            raise CliError(str(e), code=2) from None
    d = summary.to_dict()
    d["correlation_id"] = correlation_id
    if as_json:
        emit_json(d)
        return
    _summary_tables(d)
    if d["quarantined"]:
        console.print(f"{d['quarantined']} record(s) quarantined: `flywheel quarantine list` to inspect them.")


@quarantine_app.command("list")
@handle_errors
def quarantine_list(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Quarantine batches with their counts by reason and how many records remain unresolved."""
    from flywheel.ingest import list_quarantine
    from flywheel.store import open_store

    cfg = load(home, config)
    with open_store(cfg) as store:
        rows = list_quarantine(store)
    if as_json:
        emit_json(rows)
        return
    print_table(f"{len(rows)} quarantine batch(es)", ["stream", "file", "records", "remaining", "by reason"],
                [(r["stream"], r["file"], r["records"], r["remaining"],
                  ", ".join(f"{k}={v}" for k, v in (r["by_reason"] or {}).items())) for r in rows])


@quarantine_app.command("show")
@handle_errors
def quarantine_show(
    stream: str = typer.Argument(..., help="A quarantine stream (quarantine:<id>) or a unique prefix of its id."),
    limit: int = typer.Option(50, "--limit", help="At most this many records."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """The quarantined records of one batch: file, line, reason, detail and the redacted raw text."""
    from flywheel.artifacts import open_artifacts
    from flywheel.ingest import show_quarantine
    from flywheel.store import open_store

    cfg = load(home, config)
    with open_store(cfg) as store:
        try:
            rows = show_quarantine(store, open_artifacts(cfg), stream, limit=limit)
        except KeyError as e:
            raise CliError(str(e.args[0])) from None
    if as_json:
        emit_json(rows)
        return
    print_table(f"{len(rows)} record(s) in {stream}", ["file", "line", "reason", "detail", "raw", "resolved"],
                [(r["file"], r["line"], r["reason"], r["detail"][:120], r["raw"][:200], r["resolved"]) for r in rows])

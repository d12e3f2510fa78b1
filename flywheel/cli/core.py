"""Foundation commands: init, status, events, warehouse, lineage."""

from __future__ import annotations

import json
from pathlib import Path
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
    progress,
)
from flywheel.config import FlywheelConfig, reference_markdown

if TYPE_CHECKING:  # the store (duckdb) loads when a command opens it, not when the CLI starts
    from flywheel.store import EventStore


def _sandbox_rows(report: dict) -> list[tuple[str, str]]:
    return [("sandbox isolation", f"{report['mode']}: {report['namespaces']}"),
            ("sandbox uid", str(report["uid"])),
            ("sandbox cgroup", str(report["cgroup"])),
            ("sandboxed verdicts", str(report["verdicts"]))]


def _warn_sandbox(report: dict) -> None:
    if report.get("warning"):
        console.print(f"[bold red]WARNING (sandbox):[/] {report['warning']}")


warehouse_app = typer.Typer(
    help="The event store (embedded DuckDB file or PostgreSQL): rebuild projections, export Parquet, recover, "
    "migrate to a server.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("init")(init)
    app.command("status")(status)
    app.command("events")(events)
    app.add_typer(warehouse_app, name="warehouse")
    app.command("lineage")(lineage)
    app.command("config")(config_cmd)


@handle_errors
def init(
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
    champion: bool = typer.Option(
        True, "--champion/--no-champion", help="Register [policy] base_model as the first version of [cycle] "
        "model_name with the alias champion (kept when one exists), so `champion` names a registered version "
        "before the first promotion."),
) -> None:
    """Create the home directory, the warehouse (migrations applied) and the artifact store, register
    the base model as champion, and say which sandbox isolation python_tests/shell verifiers get on
    this machine. Idempotent."""
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.sandbox import isolation_report  # ~0.15 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    champ: dict[str, Any] | None = None
    with open_store(cfg) as s:
        if champion:
            champ = _bootstrap_champion(cfg, s)
        counts = s.projection_counts()
        where = s.location
    arts = open_artifacts(cfg)
    arts.objects.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = {
        "home": str(cfg.home),
        "warehouse": where,
        "artifacts": str(cfg.artifacts_dir),
        "mlflow_tracking_uri": cfg.mlflow_tracking_uri,
        "events": counts["events"],
    }
    sandbox = isolation_report(cfg.sandbox)
    if as_json:
        emit_json({**info, "champion": champ, "sandbox": sandbox})
    else:
        rows = [(k, v) for k, v in info.items()]
        if champ is not None:
            rows.append(("champion", champ["model"] + (" (registered now)" if champ["created"] else "")
                         if champ["model"] else f"none: {champ['reason']}"))
        print_table("flywheel initialised", ["what", "where"], rows + _sandbox_rows(sandbox))
        _warn_sandbox(sandbox)
        if champ is not None and not champ["model"]:
            console.print(f"[yellow]no champion registered[/]: {champ['reason']}")


def _bootstrap_champion(cfg: FlywheelConfig, store: EventStore) -> dict[str, Any]:
    """``flywheel.deploy.bootstrap_champion``; a base model that cannot be materialised here (a hub
    name, a missing directory) or a served one (``policy.backend = "openai"``) is reported, not fatal:
    ``champion`` then means the base model until the first promotion."""
    from flywheel.deploy import bootstrap_champion  # duckdb, ~0.6 s: off the CLI's start
    from flywheel.policy.models import ModelLoadError  # ~30 ms: off the CLI's start
    from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start

    name = cfg.cycle.model_name
    if cfg.policy.backend == "openai":
        return {"model": None, "created": False,
                "reason": "policy.backend is 'openai': the champion is the served model until the first promotion"}
    try:
        version, created = bootstrap_champion(cfg, store, Tracker(cfg))
    except ModelLoadError as e:
        return {"model": None, "created": False, "reason": str(e)}
    return {"model": f"model:{name}/{version}", "created": created, "reason": None}


def _artifact_store(cfg) -> dict:
    """What ``ArtifactStore.describe()`` says (nothing is reached: remotes open on first use); a URL the
    backend cannot take is shown with its error rather than failing the whole status."""
    from flywheel.artifact_backends import redact_url
    from flywheel.artifacts import ArtifactError, open_artifacts

    try:
        arts = open_artifacts(cfg)
    except ArtifactError as e:
        url = cfg.artifacts.url
        return {"kind": url.split(":", 1)[0], "url": redact_url(url), "local": str(cfg.artifacts_dir),
                "local_role": "cache", "error": str(e)}
    try:
        return arts.describe()
    finally:
        arts.close()


def _artifact_store_line(d: dict) -> str:
    if d["url"] is None:
        return "local (this home only: the embedded default)"
    line = f"{d['kind']} {d['url']}" + (f" at {d['server']}" if d.get("server") else "") + " (artifacts: its cache)"
    return line + (f"; error: {d['error']}" if d.get("error") else "")


@handle_errors
def status(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
           last: int = typer.Option(10, help="How many recent events to show.")) -> None:
    """Counts per entity type, the last events, where everything lives, and the sandbox isolation."""
    from flywheel.sandbox import isolation_report  # ~0.15 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    artifact_store = _artifact_store(cfg)
    with open_store(cfg) as s:
        counts = s.counts_by_kind()
        recent = s.read(limit=last, newest_first=True)
        n_events = s.last_seq()
        where = s.location
    data = {
        "home": str(cfg.home),
        "warehouse": where,
        "artifacts": str(cfg.artifacts_dir),
        "artifact_store": artifact_store,
        "mlflow_tracking_uri": cfg.mlflow_tracking_uri,
        "events": n_events,
        "entities": counts,
        "recent_events": [
            {"seq": e.seq, "type": e.type, "stream": e.stream, "recorded_at": str(e.recorded_at)} for e in recent
        ],
        "sandbox": isolation_report(cfg.sandbox),
    }
    if as_json:
        emit_json(data)
        return
    rows = [(k, data[k]) for k in ("home", "warehouse", "artifacts", "mlflow_tracking_uri")]
    rows.insert(3, ("artifact store", _artifact_store_line(artifact_store)))
    print_table("paths", ["what", "where"], rows)
    print_table(f"entities ({n_events} events)", ["kind", "count"], sorted(counts.items()))
    print_table("recent events", ["seq", "type", "stream", "recorded at"],
                [(e["seq"], e["type"], e["stream"], e["recorded_at"][:19]) for e in data["recent_events"]])
    print_table("sandbox", ["what", "value"], _sandbox_rows(data["sandbox"]))
    _warn_sandbox(data["sandbox"])


@handle_errors
def events(
    type_: list[str] = typer.Option(None, "--type", help="Only these event types (repeatable)."),
    stream: str = typer.Option(None, "--stream", help="Only this stream; a trailing * matches a prefix."),
    after: int = typer.Option(None, "--after", help="Only events with seq greater than this."),
    limit: int = typer.Option(50, "--limit", help="At most this many events (newest last)."),
    correlation: str = typer.Option(None, "--correlation", help="Only events of this run (correlation id)."),
    home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
) -> None:
    """List events from the append-only store."""
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        evs = s.read(stream=stream, types=type_ or None, after_seq=after, correlation_id=correlation,
                     limit=limit, newest_first=True)
    evs.reverse()
    if as_json:
        emit_json([
            {"seq": e.seq, "event_id": e.event_id, "stream": e.stream, "stream_version": e.stream_version,
             "type": e.type, "payload": e.payload, "causation": e.causation, "correlation_id": e.correlation_id,
             "recorded_at": str(e.recorded_at), "schema_version": e.schema_version}
            for e in evs
        ])
        return
    print_table(f"{len(evs)} events", ["seq", "type", "stream", "v", "causation", "payload"],
                [(e.seq, e.type, e.stream, e.stream_version, ", ".join(e.causation[:3]) + (" …" if len(e.causation) > 3 else ""),
                  json.dumps(e.payload)[:80]) for e in evs])


@warehouse_app.command("rebuild")
@handle_errors
def warehouse_rebuild(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Drop every projection and rebuild it from the events alone."""
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        counts = s.rebuild_projections()
    if as_json:
        emit_json({"rebuilt": counts})
    else:
        print_table("projections rebuilt from events", ["table", "rows"], sorted(counts.items()))


@warehouse_app.command("export")
@handle_errors
def warehouse_export(directory: Path = typer.Argument(..., help="Directory for the Parquet files."),
                     home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Export events and projections as Parquet, for readers in other processes."""
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    with open_store(cfg) as s:
        written = s.export(directory)
    if as_json:
        emit_json({"exported": written})
    else:
        print_table(f"exported to {directory}", ["table", "file"], sorted(written.items()))


@warehouse_app.command("recover")
@handle_errors
def warehouse_recover(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Open a warehouse whose write-ahead log DuckDB refuses to replay: the WAL is set aside, loudly."""
    from flywheel.store import EventStore  # duckdb, ~0.5 s: off the CLI's start

    cfg = load(home, config)
    if cfg.store.url:
        raise CliError("`warehouse recover` is for the embedded DuckDB file; store.url points at PostgreSQL, "
                       "which recovers by itself")
    cfg.ensure_home()
    with EventStore(cfg.warehouse, recover_wal=True) as s:
        aside = s.recovered_wal
        n = s.last_seq()
    data = {"warehouse": str(cfg.warehouse), "wal_set_aside": str(aside) if aside else None, "events": n}
    if as_json:
        emit_json(data)
    elif aside:
        console.print(f"[bold yellow]WAL set aside as {aside}[/]: transactions after the last checkpoint are lost; "
                      f"{n} events remain. Re-run the stages whose events are missing.")
    else:
        out.print(f"warehouse opened cleanly ({n} events); nothing to recover")


@warehouse_app.command("migrate")
@handle_errors
def warehouse_migrate(
    to: str = typer.Option(..., "--to", help="postgresql:// URL of the target database (password: PGPASSWORD or ~/.pgpass)."),
    chunk: int = typer.Option(100_000, min=1, help="Events per copy and per verification step."),
    home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
) -> None:
    """Copy the embedded warehouse to a PostgreSQL server, verified event by event (resumable)."""
    from flywheel.store import EventStore, is_postgres_url, redact_url  # duckdb, ~0.5 s: off the CLI's start
    from flywheel.store.postgres import migrate_events  # duckdb+psycopg, ~0.7 s: off the CLI's start

    if not is_postgres_url(to):
        raise CliError(f"--to must be a postgresql:// URL, got {redact_url(to)!r}")
    cfg = load(home, config)
    if not cfg.warehouse.exists():
        raise CliError(f"no embedded warehouse at {cfg.warehouse} to migrate")
    with EventStore(cfg.warehouse, open_timeout_s=cfg.store.open_timeout_s) as src, EventStore(to) as dst, \
            progress(enabled=not as_json) as bar:
        task = bar.add_task("migrate", total=None, rate="")

        def step(done: int, total: int, phase: str) -> None:
            bar.update(task, description=phase, completed=done, total=total)

        summary = migrate_events(src, dst, chunk=chunk, progress=step)
    data = {"source": str(cfg.warehouse), "target": redact_url(to), **summary,
            "next": f"set store.url (or FLYWHEEL_STORE__URL) to {redact_url(to)} to use it"}
    if as_json:
        emit_json(data)
        return
    print_table("warehouse migrated", ["what", "value"],
                [("source", data["source"]), ("target", data["target"]), ("events", summary["events"]),
                 ("copied now", summary["copied"]), ("already there", summary["already_there"]),
                 ("verified event by event", summary["verified"]),
                 *[(f"projection {k}", v) for k, v in summary["projections"].items()]])
    out.print(data["next"])


@handle_errors
def lineage(
    entity: str = typer.Argument(..., help="Entity id, e.g. model:policy/3 or trace:abc."),
    up: bool = typer.Option(False, "--up", help="What descends from the entity (its impact)."),
    down: bool = typer.Option(False, "--down", help="What the entity was made from (default)."),
    depth: int = typer.Option(64, help="Maximum depth."),
    home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
) -> None:
    """Walk the lineage graph from an entity (recursive query in warehouse/queries)."""
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

    if up and down:
        raise typer.BadParameter("choose one of --up / --down")
    direction = "up" if up else "down"
    cfg = load(home, config)
    with open_store(cfg) as s:
        if s.entity(entity) is None:
            raise CliError(f"unknown entity {entity!r} (see `flywheel status` for what exists)")
        rows = s.lineage(entity, direction, depth)
    if as_json:
        emit_json({"entity": entity, "direction": direction,
                   "nodes": [{"entity_id": e, "depth": d} for e, d in rows]})
    else:
        print_table(f"lineage of {entity} ({direction})", ["depth", "entity"], [(d, e) for e, d in rows])


@handle_errors
def config_cmd(
    reference: bool = typer.Option(False, "--reference", help="Print the Markdown reference of every field."),
    home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt,
) -> None:
    """Show the effective configuration (defaults < flywheel.toml < environment < flags)."""
    if reference:
        import sys

        sys.stdout.write(reference_markdown() + "\n")
        return
    cfg = load(home, config)
    data = json.loads(cfg.model_dump_json())
    if (data.get("store") or {}).get("url"):
        # store.url may carry a password (in the user info or ?password=): never printed
        from flywheel.store import redact_url  # duckdb, ~0.5 s: only when there is a URL to mask

        data["store"]["url"] = redact_url(data["store"]["url"])
    if as_json:
        emit_json(data)
        return
    rows = []
    for k, v in data.items():
        if isinstance(v, dict):
            rows += [(f"{k}.{kk}", json.dumps(vv)) for kk, vv in v.items()]
        else:
            rows.append((k, json.dumps(v)))
    print_table("effective configuration", ["key", "value"], rows)

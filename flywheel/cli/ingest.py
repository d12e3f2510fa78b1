"""``flywheel ingest`` and ``flywheel quarantine list|show``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
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
from flywheel.config import FlywheelConfig
from flywheel.net import is_loopback

quarantine_app = typer.Typer(help="Inspect records that failed ingest validation.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest)
    app.command("collect")(collect)
    app.add_typer(quarantine_app, name="quarantine")


class _TerminalLine(logging.Handler):
    """A log record as one line on the terminal: its message, never its traceback (that is in the log file)."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(logging.WARNING)
        self.log_path = log_path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage().splitlines()[0][:300]
            more = f" (traceback in {self.log_path})" if record.exc_info else ""
            console.print(f"{record.levelname.lower()}: {msg}{more}", markup=False, highlight=False)
        except Exception:  # noqa: BLE001 - logging must never stop an ingest
            self.handleError(record)


@contextmanager
def ingest_logging(log_path: Path) -> Iterator[None]:
    """While ingesting, ``flywheel.ingest``'s log goes whole (tracebacks included) to ``log_path``
    (``<home>/logs/ingest.log``) and as one line per warning to the terminal. Python's default (the
    last-resort handler) printed a traceback per record on the terminal. Only real internal errors
    log a traceback; bad input is a quarantine reason (``invalid_unicode``, ``too_deep``, ...)."""
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lg = logging.getLogger("flywheel.ingest")
    to_file = logging.FileHandler(log_path, encoding="utf-8", delay=True)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_term = _TerminalLine(log_path)
    saved = lg.level, lg.propagate
    lg.addHandler(to_file)
    lg.addHandler(to_term)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    try:
        yield
    finally:
        lg.removeHandler(to_file)
        lg.removeHandler(to_term)
        to_file.close()
        lg.setLevel(saved[0])
        lg.propagate = saved[1]


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
    dry_run: bool = typer.Option(False, "--dry-run", help="Report what would be captured per trace (messages, "
                                 "tools, tool calls, errors) and what would be quarantined; store nothing."),
    limit: int = typer.Option(50, "--limit", help="With --dry-run: rows shown per table (--json lists all)."),
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

    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start

    # duckdb, ~1.5 s: off the CLI's start
    from flywheel.ingest import IngestError, IngestRefused, ingest_paths
    from flywheel.ingest import replay_quarantine as replay  # duckdb, ~1.5 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

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
    if dry_run:
        if replay_quarantine:
            raise CliError("--dry-run reads files; it cannot be combined with --replay-quarantine")
        return _dry_run(cfg, list(paths), fmt, as_json, limit)
    correlation_id = f"ingest-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    artifacts = open_artifacts(cfg)
    with ingest_logging(Path(cfg.home) / "logs" / "ingest.log"), open_store(cfg) as store, \
            progress(enabled=not as_json) as bar:
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
                from flywheel.ingest.mlflow_source import ingest_mlflow  # duckdb, ~1.5 s: off the CLI's start
                from flywheel.tracking import Tracker  # ~20 ms: off the CLI's start

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


def _dry_run(cfg: FlywheelConfig, paths: list[Path], fmt: str, as_json: bool, limit: int) -> None:
    from flywheel.ingest import IngestError  # duckdb, ~1.5 s: off the CLI's start
    from flywheel.ingest.dryrun import dry_run  # duckdb, ~0.7 s: off the CLI's start

    try:
        report = dry_run(cfg, paths, fmt=fmt)
    except IngestError as e:
        raise CliError(str(e)) from None
    if as_json:
        emit_json(report)
        return
    rows = []
    for t in report["traces"][:limit]:
        no_schema = [n for n, src in t["tool_schema_sources"].items() if src != "trace"]
        tools = ", ".join(t["tools"]) + (f" (+{', '.join(no_schema)}: " + "/".join(
            sorted({t["tool_schema_sources"][n] for n in no_schema})) + ")" if no_schema else "")
        rows.append((t["trace_id"][:32], f"{t['file']}:{t['line']}", t["convention"] or t["source"],
                     " ".join(f"{k}:{v}" for k, v in t["roles"].items()), tools or "-",
                     ", ".join(t["tool_calls"]) or "-", t["status"] + (f" {','.join(t['kinds'])}" if t["kinds"] else ""),
                     (t["error"] or "")[:80]))
    print_table(f"would ingest {len(report['traces'])} trace(s)" + (f" (first {limit})" if len(report["traces"]) > limit else ""),
                ["trace", "from", "convention", "messages", "tools (schema)", "tool calls", "outcome", "error"], rows)
    if report["quarantined"]:
        print_table(f"would quarantine {len(report['quarantined'])} record(s)", ["file", "line", "reason", "detail"],
                    [(q["file"], q["line"], q["reason"], q["detail"][:300]) for q in report["quarantined"][:limit]])
    s = report["summary"]
    print_table("dry run (nothing stored)", ["traces", "with tool calls", "tools without schema", "failures",
                                             "quarantined"],
                [(s["traces"], s["with_tool_calls"], s["with_tools_without_schema"], s["failures"], s["quarantined"])])


@handle_errors
def collect(
    port: int = typer.Option(4318, "--port", help="Listen port (4318 is OTLP/HTTP's usual one; 0 = any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address; anything but loopback requires an API key."),
    inbox: Path = typer.Option(None, "--inbox", help="Where batch files are written (default <home>/inbox)."),
    settle_s: float = typer.Option(10.0, "--settle-s", help="A trace is written once nothing of it arrived for this "
                                   "long (exporters batch spans and logs separately, up to 5 s each by default)."),
    max_pending: int = typer.Option(10_000, "--max-pending", help="Traces held in memory at most (oldest written first)."),
    max_body_mb: int = typer.Option(16, "--max-body-mb", help="Largest request body accepted (after gzip), in MiB."),
    max_trace_mb: int = typer.Option(32, "--max-trace-mb", help="Records held for one trace, in MiB; past it a "
                                     "request gets 429 and the trace is written at once."),
    max_held_mb: int = typer.Option(512, "--max-held-mb", help="Records held in memory in all, in MiB; past it "
                                    "requests get 503 while the oldest traces are written."),
    max_age_s: float = typer.Option(120.0, "--max-age-s", help="A trace is written this long after its first record, "
                                    "however busy it still is."),
    allowed_host: list[str] = typer.Option(None, "--allowed-host", help="A Host header name to answer besides the "
                                           "bound address (repeatable; '*' = any). Others get 400 (DNS rebinding)."),
    header_timeout_s: float = typer.Option(10.0, "--header-timeout-s", help="A connection that sends no complete "
                                           "request head within this is closed."),
    body_timeout_s: float = typer.Option(30.0, "--body-timeout-s", help="A body not received within this gets 408."),
    max_connections: int = typer.Option(64, "--max-connections", help="Open connections plus running requests; "
                                        "past it 503."),
    api_key_env: str = typer.Option("FLYWHEEL_COLLECT_API_KEY", "--api-key-env",
                                    help="Env var holding the API key (requests then need 'Authorization: Bearer <key>')."),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Receive OTLP/HTTP (JSON or protobuf, /v1/traces and /v1/logs) and write batches to the inbox.

    Point an agent's exporter here (OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318) or a Collector's
    otlphttp exporter; then `flywheel ingest <home>/inbox`. Runs until SIGINT/SIGTERM, then writes every
    trace it still holds. Each batch file is written atomically (temp file + rename).
    """
    import os

    from flywheel.ingest.collect import CollectLimits, run  # duckdb, ~0.8 s: off the CLI's start
    from flywheel.net import allowed_hosts_for
    from flywheel.redact import Redactor

    if settle_s <= 0 or max_pending < 1 or max_body_mb < 1:
        raise CliError("--settle-s must be > 0, --max-pending and --max-body-mb >= 1")
    try:
        limits = CollectLimits(max_trace_bytes=max_trace_mb << 20, max_held_bytes=max_held_mb << 20,
                               max_age_s=max_age_s, header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                               max_connections=max_connections)
    except (ValueError, TypeError) as e:
        raise CliError(f"collect bounds: {e}") from None
    cfg = load(home, config)
    cfg.ensure_home()
    key = os.environ.get(api_key_env) or None
    if key is None and not is_loopback(host):
        raise CliError(f"binding to {host} requires an API key: set {api_key_env} (or bind to 127.0.0.1)", code=2)
    target = Path(inbox) if inbox else cfg.home / "inbox"

    def listening(url: str) -> None:
        console.print(f"flywheel collect listening on {url} (POST /v1/traces, /v1/logs); batches go to {target}")

    def wrote(path: Path, n: int) -> None:
        console.print(f"wrote {path.name}: {n} trace(s)")

    try:
        # Redacted at the receiver with ingest's rules: nothing reaches the inbox in clear.
        stats = run(target, host=host, port=port, settle_s=settle_s, max_pending=max_pending, api_key=key,
                    max_body_bytes=max_body_mb << 20, on_listen=listening, on_write=wrote, limits=limits,
                    allowed_hosts=allowed_hosts_for(host, allowed_host or ()), redactor=Redactor.from_config(cfg.ingest))
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    d = {"inbox": str(target), "requests": stats.requests, "rejected": stats.rejected, "overloaded": stats.overloaded,
         "spans": stats.spans, "log_records": stats.log_records, "traces_written": stats.traces_written,
         "write_errors": stats.write_errors, "files": stats.files}
    if as_json:
        emit_json(d)
        return
    print_table("collect summary", ["requests", "rejected", "spans", "log records", "traces written", "files"],
                [(d["requests"], d["rejected"], d["spans"], d["log_records"], d["traces_written"], len(d["files"]))])
    console.print(f"ingest them with: flywheel ingest {target}")


@quarantine_app.command("list")
@handle_errors
def quarantine_list(home: str = HomeOpt, config: str = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Quarantine batches with their counts by reason and how many records remain unresolved."""
    from flywheel.ingest import list_quarantine  # duckdb, ~1.5 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

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
    from flywheel.artifacts import open_artifacts  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.ingest import show_quarantine  # duckdb, ~1.5 s: off the CLI's start
    from flywheel.store import open_store  # duckdb, ~0.5 s: off the CLI's start

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

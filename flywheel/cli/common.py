"""Shared CLI plumbing: configuration from flags, ``--json`` output, tables, clean errors.

Every command takes ``--json``; with it the command prints exactly one JSON document on stdout and
nothing else (progress goes to stderr). Known errors become one red line and a non-zero exit code,
never a stack trace.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from flywheel.config import ConfigError, FlywheelConfig, load_config
from flywheel.lineage import LineageError

console = Console(stderr=True, soft_wrap=True)
out = Console()

JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout (for scripts).")
HomeOpt = typer.Option(None, "--home", help="Flywheel home directory (default $FLYWHEEL_HOME or ./.flywheel).")
ConfigOpt = typer.Option(None, "--config", help="Path of flywheel.toml (default ./flywheel.toml).")


class CliError(Exception):
    """A user-facing error: printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def load(home: str | None = None, config: str | None = None,
         overrides: dict[str, Any] | None = None) -> FlywheelConfig:
    os.umask(0o077)  # everything under the home directory is private: traces are user data
    ov = dict(overrides or {})
    if home:
        ov["home"] = home
    return load_config(config, overrides=ov)


def _known_errors() -> tuple[type[BaseException], ...]:
    from flywheel.artifacts import ArtifactError  # pyarrow, ~0.4 s: off the CLI's start
    from flywheel.store import StoreError  # duckdb, ~0.5 s: off the CLI's start

    return (CliError, ConfigError, StoreError, ArtifactError, LineageError, FileNotFoundError, PermissionError)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn known errors into one clean line and an exit code (no stack trace)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except _known_errors() as e:
            code = getattr(e, "code", 1) if isinstance(e, CliError) else 1
            msg = str(e).replace("[", r"\[")
            console.print(f"[bold red]error:[/] {msg}")
            raise typer.Exit(code) from None

    return wrapper


_json_out: Any = None


def reserve_stdout_for_json() -> None:
    """Under ``--json``, stdout carries exactly one JSON document: libraries that print to stdout
    (DeepSpeed's logger, tqdm bars, warnings) are sent to stderr at the file-descriptor level, and
    :func:`emit_json` writes to the original stdout."""
    global _json_out
    if _json_out is not None:
        return
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    _json_out = os.fdopen(fd, "w")


@contextmanager
def third_party_output_to(log_path: os.PathLike[str] | str) -> Iterator[None]:
    """Send everything others write to file descriptors 1 and 2 (library INFO logs, warnings,
    conversion progress bars, DeepSpeed's banner, child processes) to ``log_path``, while flywheel's
    own consoles (:data:`console`, :data:`out`; :func:`emit_json` under ``--json``) keep the terminal.

    At the descriptor level, so C extensions and child processes are covered too; restored on exit.
    """
    from pathlib import Path

    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    term_out = os.fdopen(os.dup(saved_out), "w", buffering=1)
    term_err = os.fdopen(os.dup(saved_err), "w", buffering=1)
    old_files = console._file, out._file
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    console.file, out.file = term_err, term_out
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        console._file, out._file = old_files
        term_out.close()
        term_err.close()


def emit_json(data: Any) -> None:
    stream = _json_out or sys.stdout
    stream.write(json.dumps(data, indent=2, default=str, sort_keys=False) + "\n")
    stream.flush()


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    return t


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    out.print(table(title, columns, rows))


@contextmanager
def progress(enabled: bool = True) -> Iterator[Any]:
    """A rich progress display on stderr (disabled under --json or when not a terminal and quiet)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    p = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    with p:
        yield p

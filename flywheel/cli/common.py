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


def _fit_widths(naturals: list[int], words: list[int], available: int) -> list[int] | None:
    """Column widths that fit ``available`` cells, or None when the natural widths already fit.

    Each column gets at least its longest word (so a model ref, path or number is never split; only a
    word longer than the whole table can take is folded), short columns keep their natural width, and
    the space left is shared evenly by the long ones (wrapped at spaces only where needed).
    """
    if sum(naturals) <= available:
        return None
    mins = [min(w, n) for w, n in zip(words, naturals, strict=True)]
    while sum(mins) > available:  # words wider than the table: fold the widest
        i = mins.index(max(mins))
        mins[i] -= 1
    # water-filling: the largest level L with sum(max(min, min(natural, L))) <= available
    lo, hi = 0, max(naturals)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(max(m, min(n, mid)) for m, n in zip(mins, naturals, strict=True)) <= available:
            lo = mid
        else:
            hi = mid - 1
    widths = [max(m, min(n, lo)) for m, n in zip(mins, naturals, strict=True)]
    spare = available - sum(widths)
    for i in sorted(range(len(widths)), key=lambda j: -naturals[j]):  # leftover cells to the widest
        if spare <= 0:
            break
        add = min(spare, naturals[i] - widths[i])
        widths[i] += add
        spare -= add
    return widths


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table that fits the terminal (80 columns when output is not a terminal): columns are
    never narrower than their longest word, so identifiers are wrapped whole, not split mid-word, and a
    one-row summary too wide for that is printed as one ``what | value`` line per column."""
    from rich.cells import cell_len

    t = table(title, columns, rows)
    def lines(cells: list[Any]) -> list[str]:
        return [ln for x in cells for ln in out.render_str("" if x is None else str(x)).plain.splitlines()]

    naturals, words = [], []
    for i, c in enumerate(columns):
        head, body = lines([c]) or [""], lines([r[i] for r in rows if i < len(r)])
        # a header wraps at its spaces: the cells' width decides, the header's longest word the minimum
        naturals.append(max(cell_len(ln) for ln in (body or head)))
        words.append(max([cell_len(w) for ln in head + body for w in ln.split()] or [0]))
        naturals[-1] = max(naturals[-1], words[-1])
    # the default box: one border per column and one more, 1 cell of padding on each side of a cell
    available = out.width - 3 * len(columns) - 1
    fits = sum(max(cell_len(ln) for ln in lines([c]) + lines([r[i] for r in rows if i < len(r)]) or [""])
               for i, c in enumerate(columns)) <= available
    if not fits and len(rows) == 1 and sum(words) > available:
        # a one-row summary whose headers alone cannot fit side by side: one line per column instead
        print_table(title, ["what", "value"], list(zip(columns, rows[0], strict=False)))
        return
    widths = None if fits else _fit_widths(naturals, words, available)
    if widths is not None:
        for col, w in zip(t.columns, widths, strict=True):
            col.width = max(w, 1)
    out.print(t)


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

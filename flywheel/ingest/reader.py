"""Streaming line reader: bounded memory, gzip by magic bytes, over-long lines skipped, cut files reported.

:func:`iter_lines` yields :class:`Line` items, never more than ``max_line_bytes`` (+1) bytes of one
line in memory: a longer line is consumed in 1 MiB chunks and yielded as ``oversize`` with its first
:data:`KEEP_PREFIX` bytes (for the quarantine). A gzip stream that ends before its end-of-stream
marker, or fails its CRC, ends the iteration with one ``error`` item naming the line where it broke;
every complete line before it has been yielded.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GZIP_MAGIC = b"\x1f\x8b"
KEEP_PREFIX = 64 * 1024
_BUF = 1 << 20


@dataclass(slots=True)
class Line:
    lineno: int
    data: bytes
    oversize: int = 0  # total length when the line was longer than max_line_bytes
    error: str | None = None  # set on the final item when the file was cut short or corrupt


def open_source(path: Path) -> tuple[BinaryIO, BinaryIO]:
    """``(decompressed stream, underlying file)``: gzip is detected by its magic bytes, not the suffix.
    The underlying file's ``tell()`` is the progress through the bytes on disk. Close both."""
    raw = open(path, "rb", buffering=_BUF)  # noqa: SIM115 - returned to the caller
    if raw.peek(2)[:2] == GZIP_MAGIC:
        # GzipFile itself, not a BufferedReader around it: a large buffered read that reaches a cut
        # end raises EOFError and would drop every complete line decoded in that read.
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw  # type: ignore[return-value]
    return raw, raw


def position(raw: BinaryIO, size: int) -> Callable[[], int]:
    """Bytes of the underlying file read so far (for progress), capped at ``size``; 0 once closed."""

    def pos() -> int:
        try:
            return min(size, raw.tell())
        except (OSError, ValueError):
            return 0

    return pos


def open_binary(path: Path) -> BinaryIO:
    """The file's decompressed bytes (closing it closes the file)."""
    stream, raw = open_source(path)
    if stream is not raw:
        stream.myfileobj = raw  # type: ignore[attr-defined]  # GzipFile closes myfileobj on close
    return stream


def iter_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[Line]:
    lineno = 0
    readline = stream.readline
    limit = max_line_bytes + 1
    while True:
        try:
            data = readline(limit)
        except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
            yield Line(lineno + 1, b"", error=f"compressed stream ended or broke after line {lineno}: {e}")
            return
        if not data:
            return
        lineno += 1
        if len(data) == limit and not data.endswith(b"\n"):
            prefix, total = data[:KEEP_PREFIX], len(data)
            try:
                while True:
                    chunk = readline(_BUF)
                    total += len(chunk)
                    if not chunk or chunk.endswith(b"\n"):
                        break
            except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
                yield Line(lineno, prefix, oversize=total)
                yield Line(lineno + 1, b"", error=f"compressed stream ended or broke in line {lineno}: {e}")
                return
            yield Line(lineno, prefix, oversize=total)
            continue
        yield Line(lineno, data)

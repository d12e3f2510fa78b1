"""Content ids: canonical JSON, SHA-256 digests and their truncations, named by width.

Every deterministic id in the project is ``<prefix>:<the first n hex digits of a SHA-256>`` of some
serialisation of its inputs. The serialisation and the width of each recorded id are frozen (they are
in users' event stores); they are named here so a reader sees which is which:

=====================  =====  ===================================================================
id                     width  hashed text
=====================  =====  ===================================================================
``ev_`` (event)        32     ``type \\x1f stream \\x1f canonical payload`` (``flywheel.store``)
``failure:``           16     ``\\x1e``-joined normalised parts (``flywheel.classify``)
``eval:`` ``rollouts:``
``synth:`` and more    16     the origin id, or :func:`canonical_json` of the inputs
``gate:``              20     ``json.dumps(inputs, sort_keys, (",", ":"), default=str)``
cache keys             24     :func:`canonical_json` of the stage inputs (``flywheel.cycle``)
``evaluation:`` suffix 8      ``json.dumps(decoding, sort_keys=True)`` (default separators)
=====================  =====  ===================================================================
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

__all__ = [
    "EVENT_ID_HEX",
    "ENTITY_HEX",
    "GATE_HEX",
    "CACHE_KEY_HEX",
    "SHORT_HEX",
    "canonical_json",
    "digest",
    "short_id",
    "json_id",
    "content_id",
    "sha256_file",
]

EVENT_ID_HEX = 32
ENTITY_HEX = 16
GATE_HEX = 20
CACHE_KEY_HEX = 24
SHORT_HEX = 8

_CHUNK = 1 << 20  # 1 MiB reads: the hash, not the syscalls, bounds the rate from there on


def canonical_json(payload: Any, *, allow_nan: bool = False) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 kept. Raises TypeError on non-JSON values and
    ValueError on NaN or infinities (the event store's payload format); ``allow_nan=True`` writes them
    as ``NaN``/``Infinity`` instead (Python's JSON extension, for text that is hashed or matched but is
    not an event payload: recorded tool calls, JSON artifacts)."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)


def digest(data: str | bytes) -> str:
    """SHA-256 of ``data`` (a string is UTF-8 encoded), as 64 hex digits."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def short_id(data: str | bytes, n: int = ENTITY_HEX) -> str:
    """The first ``n`` hex digits of :func:`digest`."""
    return digest(data)[:n]


def json_id(obj: Any, n: int = ENTITY_HEX) -> str:
    """``short_id(canonical_json(obj), n)``: the hash of a JSON value, independent of key order."""
    return short_id(canonical_json(obj), n)


def content_id(prefix: str, obj: Any, n: int = ENTITY_HEX) -> str:
    """``<prefix>:<json_id(obj, n)>``."""
    return f"{prefix}:{json_id(obj, n)}"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB chunks), as 64 hex digits."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()

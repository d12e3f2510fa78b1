"""OTLP/JSON decoding: export requests into spans and log records, ``AnyValue`` attributes into Python values.

:func:`iter_spans` / :func:`iter_logs` walk an export request (``resourceSpans`` / ``resourceLogs``);
:func:`attrs` / :func:`any_value` flatten attributes; :func:`norm_id` reads hex or base64 ids;
:func:`compact_log` keeps what the mapping reads of a GenAI log record (:class:`LogRec`). A value no
mapping can read raises :class:`BadValue`. The format is described in :mod:`flywheel.ingest.otlp`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

Problem = tuple[str, str]

GENAI_EVENTS = frozenset({
    "gen_ai.system.message", "gen_ai.user.message", "gen_ai.assistant.message", "gen_ai.tool.message",
    "gen_ai.choice", "gen_ai.client.inference.operation.details",
})


# -- OTLP/JSON values ------------------------------------------------------------------------------
class BadValue(ValueError):
    """An OTLP value no mapping can read (a kvlist entry whose key is not a string): the record that
    holds it is quarantined as ``otel_bad_value`` with this message, the rest of the file goes on."""


def _kv_key(e: dict[str, Any]) -> str:
    k = e.get("key")
    if type(k) is not str:
        raise BadValue(f"a kvlistValue entry's key is not a string ({type(k).__name__} {str(k)[:40]})")
    return k


def any_value(v: Any) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value (int64 strings as ints, kvlists as dicts).
    Raises :class:`BadValue` for a kvlist entry whose key is not a string (a dict key must be one)."""
    if type(v) is not dict or len(v) != 1:
        return _any_value_slow(v)
    ((k, x),) = v.items()  # one key: the common shape, read without a lookup per candidate key
    if k == "stringValue":
        return x
    if k == "kvlistValue" and type(x) is dict:
        try:
            out = {e["key"]: any_value(e["value"]) for e in _values(x)}
        except (KeyError, TypeError):
            return _any_value_slow(v)
        if all(type(kk) is str for kk in out):
            return out
        return _any_value_slow(v)
    if k == "arrayValue" and type(x) is dict:
        return [any_value(e) for e in _values(x)]
    return _any_value_slow(v)


def _values(container: dict[str, Any]) -> list[Any] | tuple[()]:
    """The ``values`` list of a kvlist or array value; anything else there (``true``, an object) is no values."""
    vs = container.get("values")
    return vs if type(vs) is list else ()


def _any_value_slow(v: Any) -> Any:
    if type(v) is not dict:
        return v
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        try:
            return int(v["intValue"])  # OTLP/JSON encodes int64 as a string
        except (TypeError, ValueError):
            return v["intValue"]
    if "doubleValue" in v:
        return v["doubleValue"]
    if "boolValue" in v:
        return v["boolValue"]
    kv = v.get("kvlistValue")
    if kv is not None:
        return {_kv_key(x): any_value(x.get("value")) for x in _values(kv) if type(x) is dict} \
            if type(kv) is dict else {}
    arr = v.get("arrayValue")
    if arr is not None:
        return [any_value(x) for x in _values(arr)] if type(arr) is dict else []
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def attrs(items: Any) -> dict[str, Any]:
    if type(items) is not list:
        return {}
    try:  # well-formed attributes: {key, value} objects with a string key
        out = {a["key"]: any_value(a["value"]) for a in items}
        if all(type(k) is str for k in out):
            return out
    except (KeyError, TypeError):
        pass
    out = {}
    for a in items:
        if type(a) is dict:
            k = a.get("key")
            if type(k) is str:
                out[k] = any_value(a.get("value"))
    return out


def norm_id(v: Any) -> str:
    """A trace/span id as lowercase hex: hex is kept, base64 (protobuf's JSON mapping) is converted."""
    if type(v) is not str or not v:
        return ""
    if len(v) in (16, 32):  # hex (base64 of 8 or 16 bytes is 12 or 24 characters long)
        return v.lower()
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return v
    return raw.hex() if len(raw) in (8, 16) else v


def _nanos(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _json_attr(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return orjson.loads(v)
        except orjson.JSONDecodeError:
            return None
    return v


# -- iterating export requests --------------------------------------------------------------------
def _obj(v: Any) -> dict[str, Any]:
    return v if type(v) is dict else {}


def _seq(v: Any) -> list[Any]:
    return v if type(v) is list else []


def iter_spans(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], str]]:
    """(trace id, span, resource attributes, scope name) for every span of an export request."""
    for rs in _seq(obj.get("resourceSpans")):
        if not isinstance(rs, dict):
            continue
        res = attrs(_obj(rs.get("resource")).get("attributes"))
        for ss in _seq(rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans")):
            if not isinstance(ss, dict):
                continue
            scope = str(_obj(ss.get("scope") or ss.get("instrumentationLibrary")).get("name") or "")
            for sp in _seq(ss.get("spans")):
                if isinstance(sp, dict):
                    tid = norm_id(sp.get("traceId"))
                    if tid:
                        yield tid, sp, res, scope


def iter_logs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(trace id or "", log record, scope name) for every log record of an export request."""
    for rl in _seq(obj.get("resourceLogs")):
        if not isinstance(rl, dict):
            continue
        for sl in _seq(rl.get("scopeLogs")):
            if not isinstance(sl, dict):
                continue
            scope = str(_obj(sl.get("scope")).get("name") or "")
            for lr in _seq(sl.get("logRecords")):
                if isinstance(lr, dict):
                    yield norm_id(lr.get("traceId")), lr, scope


def event_name(lr: dict[str, Any], a: dict[str, Any] | None = None) -> str:
    name = lr.get("eventName")
    if isinstance(name, str) and name:
        return name
    if a is None:
        for kv in _seq(lr.get("attributes")):
            if isinstance(kv, dict) and kv.get("key") == "event.name":
                return str(any_value(kv.get("value")) or "")
        return ""
    return str(a.get("event.name") or "")


@dataclass(slots=True)
class LogRec:
    """A GenAI log record, reduced to what the mapping reads."""

    span_id: str
    name: str
    time: int
    attrs: dict[str, Any]
    body: Any


def compact_log(lr: dict[str, Any]) -> LogRec | None:
    """A GenAI log record as a :class:`LogRec` (None for any other record)."""
    name = event_name(lr)
    if name not in GENAI_EVENTS:
        return None
    return LogRec(norm_id(lr.get("spanId")), name, _nanos(lr.get("timeUnixNano") or lr.get("observedTimeUnixNano")),
                  attrs(lr.get("attributes")), any_value(lr.get("body")))

"""The kinds that read the answer without running it: ``tool_call``, ``json_schema``, ``exact``, ``numeric``,
``regex`` (parameters and rules: :mod:`flywheel.verifiers.registry`; tool-call matching:
:mod:`flywheel.verifiers.matching`). Deterministic, no I/O."""

from __future__ import annotations

import math
import re
from typing import Any

import jsonschema

from flywheel.verifiers.matching import match_tool_calls, normalize_expected, tool_index
from flywheel.verifiers.registry import (
    _FENCE,
    SpecError,
    Verdict,
    VerifyContext,
    _done,
    _fail,
    register_verifier,
)
from flywheel.vocab.messages import answer_message, message_text
from flywheel.vocab.text import answer_text
from flywheel.vocab.toolcalls import ToolCall, loads_strict, parse_tool_calls


def _check_tool_call(spec: dict) -> None:
    try:
        tool_index(spec["tools"])
        if spec.get("expected") is not None:
            normalize_expected(spec["expected"])
    except ValueError as e:
        raise SpecError(f"tool_call: {e}") from None


@register_verifier("tool_call", required=("tools",), check=_check_tool_call)
def _tool_call(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    scope = spec.get("scope", "last")
    if scope == "all":
        msgs = [m for m in trajectory if isinstance(m, dict) and m.get("role") == "assistant"]
    elif scope == "last":
        last = answer_message(trajectory)
        msgs = [last] if last else []
    else:
        raise SpecError(f"tool_call: scope must be 'last' or 'all', got {scope!r}")
    calls: list[ToolCall] = []
    formats, errors = [], []
    for m in msgs:
        pr = parse_tool_calls(m)
        calls += pr.calls
        formats.append(pr.format)
        if pr.error:
            errors.append(pr.error)
    expected = spec.get("expected")
    try:
        rep = match_tool_calls(
            calls,
            spec["tools"],
            expected,
            order_sensitive=bool(spec.get("order_sensitive", False)),
            allow_extra_calls=bool(spec.get("allow_extra_calls", False)),
            normalize_strings=bool(spec.get("normalize_strings", True)),
        )
    except ValueError as e:
        raise SpecError(f"tool_call: {e}") from None
    parseable = 1.0 if (calls and not errors) or (expected == [] and not errors) else 0.0
    comps = {"parseable": parseable, **rep.components}
    details = {**rep.details, "formats": formats, "parse_errors": errors, "calls": [c.canonical() for c in calls]}
    passed = rep.passed and not errors
    return _done(passed, comps, **details)


def _json_validator(schema: Any) -> Any:
    if not isinstance(schema, dict | bool):
        raise SpecError("json_schema: 'schema' must be a JSON Schema object")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise SpecError(f"json_schema: invalid schema: {e.message}") from None
    return cls(schema)


def _check_json_schema(spec: dict) -> None:
    _json_validator(spec["schema"])


@register_verifier("json_schema", required=("schema",), check=_check_json_schema)
def _json_schema(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    validator = _json_validator(spec["schema"])
    msg = answer_message(trajectory)
    source = spec.get("source", "auto")
    if source not in ("auto", "content", "tool_arguments"):
        raise SpecError(f"json_schema: source must be auto|content|tool_arguments, got {source!r}")
    value: Any = None
    where = "text"
    if msg is not None and source in ("auto", "tool_arguments") and msg.get("tool_calls"):
        pr = parse_tool_calls(msg)
        if pr.error or len(pr.calls) != 1:
            return _fail({"parseable": 0.0, "valid": 0.0}, error=pr.error or f"{len(pr.calls)} tool calls, expected 1")
        value, where = pr.calls[0].arguments, "tool_arguments"
    elif source == "tool_arguments":
        return _fail({"parseable": 0.0, "valid": 0.0}, error="no tool call in the answer")
    else:
        text = message_text(msg).strip()
        if len(text) > 1_000_000:
            return _fail({"parseable": 0.0, "valid": 0.0}, error="answer too large")
        tried = [text] + [b for lang, b in _FENCE.findall(text) if lang.lower() in ("json", "")]
        err = "empty answer"
        for t in tried:
            try:
                value = loads_strict(t.strip())
                break
            except ValueError as e:
                err = str(e)
        else:
            return _fail({"parseable": 0.0, "valid": 0.0}, error=f"not valid JSON: {err}"[:300])
    try:
        errors = [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message[:200]}" for e in validator.iter_errors(value)]
    except RecursionError:
        errors = ["value nested too deeply"]
    return _done(not errors, {"parseable": 1.0, "valid": 0.0 if errors else 1.0}, source=where, errors=errors[:10])


@register_verifier("exact", required=("expected",))
def _exact(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    exp = spec["expected"]
    options = exp if isinstance(exp, list) else [exp]
    if not options or not all(isinstance(o, str) for o in options):
        raise SpecError("exact: 'expected' must be a string or a non-empty list of strings")
    got = message_text(answer_message(trajectory))
    if spec.get("normalize", True):
        ok = answer_text(got) in {answer_text(o) for o in options}
    else:
        ok = got.strip() in {o.strip() for o in options}
    return _done(ok, {"match": float(ok)})


_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUM_RE = re.compile(rf"(?<![\w.]){_NUM}(?:\s*/\s*{_NUM})?")


def _to_number(s: str) -> float | None:
    s = s.strip().rstrip(".").replace(",", "").replace("$", "").strip()
    if not s:
        return None
    try:
        if "/" in s:
            a, b = s.split("/", 1)
            v = float(a) / float(b)
        else:
            v = float(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def _float_param(spec: dict, key: str) -> float:
    v = spec[key]
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise SpecError(f"{spec['kind']}: {key!r} must be a number")
    f = _to_number(str(v)) if isinstance(v, str) else float(v)
    if f is None:
        raise SpecError(f"{spec['kind']}: {key!r} is not a finite number: {v!r}")
    return f


def _check_numeric(spec: dict) -> None:
    _float_param(spec, "expected")


@register_verifier("numeric", required=("expected",), check=_check_numeric)
def _numeric(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    expected = _float_param(spec, "expected")
    rel, abs_ = float(spec.get("rel_tol", 1e-6)), float(spec.get("abs_tol", 1e-9))
    text = message_text(answer_message(trajectory)).strip()
    got = _to_number(text)
    source = "whole answer"
    if got is None and not spec.get("strict", False) and len(text) <= 100_000:
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        marked = re.findall(r"(?im)^\s*(?:final\s+)?answer\s*[:=]\s*(.+)$", text)
        for src, cands in (("boxed", boxed), ("answer line", marked)):
            if cands:
                got, source = _to_number(cands[-1]), src
                if got is None:
                    m = _NUM_RE.findall(cands[-1])
                    got = _to_number(m[-1]) if m else None
                break
        else:
            nums = [n for n in _NUM_RE.findall(text) if n.strip() and _to_number(n) is not None]
            if nums:
                got, source = _to_number(nums[-1]), "last number"
    if got is None:
        return _fail({"parseable": 0.0, "close": 0.0}, error="no number in the answer")
    ok = math.isclose(got, expected, rel_tol=rel, abs_tol=abs_)
    return _done(ok, {"parseable": 1.0, "close": float(ok)}, got=got, source=source)


def _compile_regex(spec: dict) -> re.Pattern:
    flags = 0
    for name in spec.get("flags", []) or []:
        f = getattr(re, str(name).upper(), None)
        if not isinstance(f, re.RegexFlag):
            raise SpecError(f"regex: unknown flag {name!r}")
        flags |= f
    try:
        return re.compile(spec["pattern"], flags)
    except re.error as e:
        raise SpecError(f"regex: invalid pattern: {e}") from None


def _check_regex(spec: dict) -> None:
    _compile_regex(spec)


@register_verifier("regex", required=("pattern",), check=_check_regex)
def _regex(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    rx = _compile_regex(spec)
    text = message_text(answer_message(trajectory))
    if len(text) > 100_000:
        return _fail({"match": 0.0}, error="answer longer than 100000 characters")
    m = rx.fullmatch(text.strip()) if spec.get("fullmatch", False) else rx.search(text)
    return _done(m is not None, {"match": float(m is not None)})

"""Tool calls: one value type, a tolerant parser for what models really emit, one canonical renderer.

Accepted input formats (:func:`parse_tool_calls`), tried in this order:

1. ``"openai"``: an assistant message dict with ``tool_calls`` (``function.arguments`` as a JSON
   *string*, as OpenAI sends it; a dict is tolerated).
2. ``"json"``: JSON in the text, fenced (```json ... ```) or bare, possibly inside ``<tool_call>``
   tags: ``{"name": .., "arguments": ..}``, ``{"name": .., "parameters": ..}``,
   ``{"function": {"name": .., "arguments": ..}}``, ``{"tool_calls": [...]}`` or an array of these.
3. ``"pythonic"``: BFCL's prompting format ``[fn(a=1, b="x"), mod.fn2(x=[1, 2])]`` (brackets optional,
   dotted names allowed, one call per line also accepted), parsed with :mod:`ast`; argument values must
   be literals (``ast.literal_eval`` on each node: strings, numbers, booleans, None, lists, tuples,
   dicts). Nothing is ever evaluated; positional arguments, names, calls and expressions are rejected.

Values are normalised to JSON types: tuples become lists; sets, bytes, complex numbers, non-finite
floats and non-string dict keys are rejected. Texts larger than :data:`MAX_TEXT_CHARS` are rejected
before parsing (a bound on parser time and memory, not on legitimate calls).

``ParseResult.format == "none"`` means no call was found: ``error`` is None for plain prose and names
the problem when something call-shaped failed to parse (a malformed call is a different failure kind
from no call at all).

The arguments of an OpenAI ``tool_calls`` entry follow one rule everywhere (classification, eval
compilation, rewards): :func:`decode_arguments`. Empty or whitespace-only text, ``null`` and a missing
``arguments`` key are the empty object ``{}`` (a function without parameters); JSON that is not an
object, invalid JSON and non-finite numbers (``NaN``, ``Infinity``, ``1e999``) are errors. Duplicate
keys keep the last value (as ``json.loads`` does and as OpenAI's own parser does).
:func:`decode_tool_calls` applies it call by call, so one malformed call does not hide the others.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from flywheel.vocab.messages import text_of
from flywheel.vocab.tools import call_function

__all__ = [
    "ToolCall",
    "ParseResult",
    "parse_tool_calls",
    "format_tool_calls",
    "MAX_TEXT_CHARS",
    "ArgumentsError",
    "DecodedCall",
    "decode_arguments",
    "decode_tool_calls",
    "loads_strict",
]

MAX_TEXT_CHARS = 200_000
Format = Literal["openai", "json", "pythonic", "none"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_TAGS = re.compile(r"<(tool_call|toolcall|TOOLCALL|function_call|tool_calls)>(.*?)</\1>", re.DOTALL)
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True, eq=False)
class ToolCall:
    """One function call. Equality and hash go through :meth:`canonical` (sorted-key JSON), so
    ``1`` and ``True`` and ``1.0`` are different values, and key order does not matter."""

    name: str
    arguments: dict[str, Any]

    def canonical(self) -> str:
        return json.dumps(
            {"name": self.name, "arguments": self.arguments}, sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolCall) and self.canonical() == other.canonical()

    def __hash__(self) -> int:
        return hash(self.canonical())

    def to_openai(self, call_id: str) -> dict:
        """As an OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass(frozen=True)
class ParseResult:
    calls: list[ToolCall]
    format: Format
    error: str | None = None


class _Reject(ValueError):
    pass


def _jsonify(v: Any, where: str) -> Any:
    """Normalise a parsed value to JSON types or raise _Reject naming the offending path."""
    if v is None or isinstance(v, bool | str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Reject(f"{where}: non-finite number {v!r}")
        return v
    if isinstance(v, list | tuple):
        return [_jsonify(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Reject(f"{where}: dict key {k!r} is not a string")
            out[k] = _jsonify(x, f"{where}.{k}")
        return out
    raise _Reject(f"{where}: {type(v).__name__} is not a JSON value")


class ArgumentsError(ValueError):
    """A tool call's arguments break the rule of :func:`decode_arguments`; the message says why."""


def _non_standard(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _json_error(raw: str, e: BaseException) -> str:
    # orjson's wording ("unexpected end of data: line 1 column 16 (char 15)"), which classification
    # details recorded before this rule was shared; json's when orjson accepts the text.
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as oe:
        return str(oe)
    return str(e)


def decode_arguments(raw: Any) -> dict[str, Any]:
    """The arguments of a tool call as an object (the one rule, see the module docstring).

    ``raw`` is the ``arguments`` value of a call: a JSON string (as OpenAI sends it), an object
    (tolerated), or None (missing). Raises :class:`ArgumentsError`.
    """
    value = raw
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            # json, not orjson, for the value: orjson reads integers beyond 64 bits as floats.
            value = json.loads(raw, parse_constant=_non_standard)
        except (ValueError, RecursionError) as e:
            raise ArgumentsError(f"arguments are not valid JSON ({_json_error(raw, e)})") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArgumentsError(f"arguments are a JSON {type(value).__name__}, not an object")
    try:
        return _jsonify(value, "arguments")
    except _Reject as e:
        raise ArgumentsError(str(e)) from None


@dataclass(frozen=True)
class DecodedCall:
    """One ``tool_calls`` entry: ``arguments`` is None exactly when ``error`` says why they broke
    the rule; ``raw`` is the arguments string as sent (None when it was not a string)."""

    name: str
    arguments: dict[str, Any] | None
    raw: str | None
    error: str | None = None


def decode_tool_calls(tool_calls: Any) -> list[DecodedCall]:
    """Every entry of a message's ``tool_calls``, decoded one by one (nested or flat entries)."""
    out: list[DecodedCall] = []
    for tc in tool_calls if isinstance(tool_calls, list) else ():
        fn = call_function(tc)
        name = fn.get("name")
        raw = fn.get("arguments", fn.get("parameters"))
        try:
            args, err = decode_arguments(raw), None
        except ArgumentsError as e:
            args, err = None, str(e)
        out.append(DecodedCall("" if name is None else str(name), args, raw if isinstance(raw, str) else None, err))
    return out


def _call(name: Any, args: Any, where: str) -> ToolCall:
    if not isinstance(name, str) or not name.strip():
        raise _Reject(f"{where}: missing function name")
    try:
        return ToolCall(name.strip(), decode_arguments(args))
    except ArgumentsError as e:
        raise _Reject(f"{where}: {e}") from None


def _from_json_obj(obj: Any, where: str = "call") -> list[ToolCall]:
    if isinstance(obj, list):
        out: list[ToolCall] = []
        for i, item in enumerate(obj):
            out.extend(_from_json_obj(item, f"{where}[{i}]"))
        return out
    if not isinstance(obj, dict):
        raise _Reject(f"{where}: expected an object with a function name")
    if "tool_calls" in obj and isinstance(obj["tool_calls"], list):
        return _from_json_obj(obj["tool_calls"], where)
    if isinstance(obj.get("function"), dict):
        fn = call_function(obj)
        return [_call(fn.get("name"), fn.get("arguments", fn.get("parameters")), where)]
    if "name" in obj:
        args = obj.get("arguments", obj.get("parameters", obj.get("args")))
        return [_call(obj.get("name"), args, where)]
    # BFCL's own decoded form: {"fn_name": {"arg": value}}
    if len(obj) == 1:
        (name, args), = obj.items()
        if isinstance(args, dict) and _DOTTED.match(name):
            return [_call(name, args, where)]
    raise _Reject(f"{where}: object has no 'name' field")


def _literal(node: ast.AST, where: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise _Reject(f"{where}: not a literal value ({type(e).__name__})") from None
    return _jsonify(value, where)


def _dotted_name(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _from_ast_call(node: ast.AST, where: str) -> ToolCall:
    if not isinstance(node, ast.Call):
        raise _Reject(f"{where}: expected a function call, got {type(node).__name__}")
    name = _dotted_name(node.func)
    if name is None:
        raise _Reject(f"{where}: function name must be a (dotted) identifier")
    if node.args:
        raise _Reject(f"{where}: positional arguments are not allowed in {name}(...); use name=value")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise _Reject(f"{where}: **kwargs is not allowed in {name}(...)")
        if kw.arg in args:
            raise _Reject(f"{where}: argument {kw.arg!r} given twice in {name}(...)")
        args[kw.arg] = _literal(kw.value, f"{name}.{kw.arg}")
    return ToolCall(name, args)


def _parse_pythonic(text: str) -> list[ToolCall]:
    src = text.strip()
    if src.startswith("'") and src.endswith("'"):  # BFCL strips wrapping quotes models sometimes add
        src = src[1:-1].strip()
    try:
        tree = ast.parse(src, mode="exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise _Reject(f"not valid Python call syntax ({type(e).__name__}: {getattr(e, 'msg', e)})") from None
    calls: list[ToolCall] = []
    if not tree.body:
        raise _Reject("empty")
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            raise _Reject(f"expected call expressions, got a {type(stmt).__name__} statement")
        value = stmt.value
        if isinstance(value, ast.List | ast.Tuple):
            calls.extend(_from_ast_call(e, f"call[{len(calls) + i}]") for i, e in enumerate(value.elts))
        else:
            calls.append(_from_ast_call(value, f"call[{len(calls)}]"))
    return calls


def _no_dupe_keys(pairs: list[tuple[str, Any]]) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise _Reject(f"duplicate JSON key {k!r}")
        d[k] = v
    return d


def _reject_constant(name: str) -> Any:
    raise _Reject(f"non-standard JSON constant {name}")


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects NaN/Infinity and duplicate keys (both let a candidate smuggle
    values past a validator that sees only one of the duplicates). Raises ValueError."""
    try:
        return json.loads(text, object_pairs_hook=_no_dupe_keys, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _parse_json(text: str) -> list[ToolCall]:
    try:
        obj = loads_strict(text.strip())
    except _Reject:
        raise
    except ValueError as e:
        raise _Reject(f"not valid JSON ({e})") from None
    return _from_json_obj(obj)


def _looks_like_json(text: str) -> bool:
    s = text.lstrip()
    return s.startswith("{") or (s.startswith("[") and s[1:].lstrip()[:1] in ("{", "]", ""))


def _parse_segment(text: str) -> tuple[list[ToolCall], Format]:
    if _looks_like_json(text):
        return _parse_json(text), "json"
    return _parse_pythonic(text), "pythonic"


def _candidates(text: str) -> list[str]:
    """Segments worth trying, most specific first: tagged, fenced, the whole text, then the outermost
    bracketed or braced span (prose around the call)."""
    segs = [m.group(2).strip() for m in _TAGS.finditer(text)]
    if segs:
        # Hermes/Qwen style emits one <tool_call>{json}</tool_call> per call: join them into one array.
        if all(_looks_like_json(s) for s in segs):
            return ["[" + ",".join(segs) + "]"]
        return ["\n".join(segs)]
    out = [m.group(2) for m in _FENCE.finditer(text)]
    out.append(text)
    for open_, close in (("[", "]"), ("{", "}")):
        i, j = text.find(open_), text.rfind(close)
        if 0 <= i < j:
            out.append(text[i : j + 1])
    return out


_CALLISH = re.compile(r"[A-Za-z_][\w.]*\s*\(|\"name\"\s*:|\{\s*\"")


def parse_tool_calls(message_or_text: dict | str | None) -> ParseResult:
    """Extract tool calls from an assistant message (dict) or its text. Never raises on bad input."""
    if isinstance(message_or_text, dict):
        tcs = message_or_text.get("tool_calls")
        if tcs:
            try:
                if not isinstance(tcs, list):
                    raise _Reject("tool_calls is not a list")
                return ParseResult(_from_json_obj(tcs, "tool_calls"), "openai")
            except _Reject as e:
                return ParseResult([], "none", f"malformed tool_calls: {e}")
        text = text_of(message_or_text.get("content"))
    else:
        text = text_of(message_or_text)
    if not text.strip():
        return ParseResult([], "none", None)
    if len(text) > MAX_TEXT_CHARS:
        return ParseResult([], "none", f"text of {len(text)} chars exceeds the {MAX_TEXT_CHARS} limit")
    first_error: str | None = None
    for seg in _candidates(text):
        if not seg.strip():
            continue
        try:
            calls, fmt = _parse_segment(seg)
        except _Reject as e:
            first_error = first_error or str(e)
            continue
        if calls:
            return ParseResult(calls, fmt)
    # Prose that never tried to call anything is "no call"; something call-shaped is "malformed".
    if first_error and _CALLISH.search(text):
        return ParseResult([], "none", first_error)
    return ParseResult([], "none", None)


def _render(v: Any) -> str:
    # repr of JSON types is a Python literal that ast.literal_eval reads back exactly (floats repr
    # round-trip since Python 3.1); dicts/lists are rendered by hand so nested order stays as given.
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_render(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_render(x) for x in v) + "]"
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"cannot render non-finite float {v!r}")
    if v is None or isinstance(v, bool | int | float | str):
        return repr(v)
    raise ValueError(f"cannot render {type(v).__name__} as a literal")


def format_tool_calls(calls: list[ToolCall]) -> str:
    """The canonical pythonic form ``[fn(a=1, b='x'), m.g(y=[1, 2])]``: what the policy is trained to
    emit. Deterministic: arguments in the order given. ``parse_tool_calls(format_tool_calls(c)).calls
    == c`` for every list of calls with JSON-typed arguments and identifier names."""
    return tool_call_decisions(calls)[0]


#: What each span of :func:`tool_call_decisions` decides.
DECISION_KINDS = ("function", "argument", "arguments_end", "calls_end")


def tool_call_decisions(calls: list[ToolCall]) -> tuple[str, list[tuple[int, int, str]]]:
    """:func:`format_tool_calls`' text and the character spans ``(start, end, kind)`` where the answer's
    structure is decided, as opposed to copied or punctuated:

    - ``function``: each function name (which function to call);
    - ``argument``: each argument name (which argument to pass next);
    - ``arguments_end``: the character after each argument value, or after ``(`` of a call without
      arguments -- ``,`` (another argument) or ``)`` (no more);
    - ``calls_end``: the character after each call -- ``,`` (another call) or ``]`` (no more).

    The extra calls, extra or missing arguments and wrong functions that dominate a small model's errors
    are decided at these characters (:mod:`flywheel.synth.probe` counts them); the learning stage can weight
    their tokens (``train.decision_weight``)."""
    text, spans = "[", []
    for i, c in enumerate(calls):
        if not _DOTTED.match(c.name):
            raise ValueError(f"function name {c.name!r} is not a (dotted) Python identifier")
        if i:
            text += ", "
        spans.append((len(text), len(text) + len(c.name), "function"))
        text += f"{c.name}("
        if not c.arguments:
            spans.append((len(text), len(text) + 1, "arguments_end"))
        for j, (k, v) in enumerate(c.arguments.items()):
            if not k.isidentifier() or keyword.iskeyword(k):
                raise ValueError(f"argument name {k!r} of {c.name} is not a Python identifier")
            if j:
                text += ", "
            spans.append((len(text), len(text) + len(k), "argument"))
            text += f"{k}={_render(v)}"
            spans.append((len(text), len(text) + 1, "arguments_end"))
        text += ")"
        spans.append((len(text), len(text) + 1, "calls_end"))
    return text + "]", spans

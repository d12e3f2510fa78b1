"""Redaction of secrets and PII in traces, before anything is stored.

Every match of a rule is replaced by ``[REDACTED:<rule>]``; counts per rule are kept on the
:class:`Redactor` so the ingest summary can report them.

Built-in rules (``IngestConfig.redaction_builtin`` selects which; applied in this order so that a
bearer token is not half-eaten by the api_key rule and a card number is not taken for a phone):

- ``bearer``: ``Bearer <token>`` (HTTP Authorization values).
- ``api_key``: well-known key shapes: OpenAI/Anthropic/Stripe-style ``sk-…``/``pk-…``/``rk-…``,
  AWS access key ids ``AKIA…``, GitHub tokens ``ghp_…``/``gho_…``/…, Slack ``xox?-…``, Google
  ``AIza…``, and ``key=value`` assignments whose key says api_key/secret/token/password.
- ``card``: 13–19 digit card numbers (spaces or dashes allowed) that pass the Luhn check; digit runs
  that fail Luhn are left alone (order ids, timestamps), and so are digit runs glued to letters or
  ``_`` (hex identifiers such as OTLP trace ids or ``chatcmpl-…`` response ids).
- ``email``: ``local@domain.tld``.
- ``phone``: international (``+<cc> …``) or grouped national numbers with at least 9 digits.
- user rules (``IngestConfig.redaction_rules``), applied last, in configuration order.

Guarantees
- Structure is never changed: only JSON *string values* are rewritten. Dict keys are structure and
  are kept, except in the free-form ``metadata`` object, whose keys are redacted too. A tool call's
  ``function.arguments`` (a JSON string, as OpenAI sends it) is parsed, its string values redacted,
  and re-serialised, so argument names, nesting and value types are unchanged; arguments that are not
  valid JSON are redacted as plain text (they are already broken; the failure kind is kept).
- Deterministic: the same input gives the same output, so equal strings stay equal after redaction
  (deduplication and failure hashing work on redacted data).
- Raw text (quarantined lines) goes through the same rules as text.

Not guaranteed
- PII inside JSON *numbers* (e.g. ``{"phone": 5551234567}``) is not redacted: changing a number into
  a string would change the argument's type, which this module promises never to do. Configure the
  producer to send such fields as strings, or drop them upstream.
- Regular expressions have false negatives (unusual formats, names, addresses) and false positives
  (a 10-digit order number may look like a phone). Names and postal addresses are not detected.
- In quarantined raw text, PII hidden behind JSON ``\\uXXXX`` escapes is not decoded first.

Speed: most production lines carry no secret. :meth:`Redactor.line_needs_redaction` runs one
combined regex over a JSON-unescaped view of the raw line (C speed, ~1-2 µs per KB); only lines it
flags are walked string by string in Python. The view decodes every JSON escape except ``\\uXXXX``
(lines containing ``\\u`` are always walked), so a match inside any decoded string is also a match in
the view; user rules with anchors (``^ $ \\A \\Z``) cannot be checked that way and turn the walk on
for every line.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

REPLACEMENT = "[REDACTED:{name}]"


def _luhn_ok(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if alt:
            d *= 2
            if d > 9:
                d -= 9
        total += d
        alt = not alt
    return total % 10 == 0


# Each pattern avoids JSON-escape characters (quote, backslash, control chars) so the raw-line
# prefilter sees exactly what the per-string pass sees (see the module docstring).
BUILTIN_PATTERNS: dict[str, str] = {
    "bearer": r"\b(?i:bearer)[ \t]+[A-Za-z0-9._~+/\-]{8,}=*",
    "api_key": (
        r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)?[A-Za-z0-9_\-]{16,}"
        r"|\bA(?:KIA|SIA)[0-9A-Z]{16}\b"
        r"|\bgh[pousr]_[A-Za-z0-9]{30,}"
        r"|\bxox[abprs]-[A-Za-z0-9\-]{10,}"
        r"|\bAIza[0-9A-Za-z_\-]{35}"
        r"|(?i:\b(?:api[_-]?key|secret|access[_-]?token|password|passwd)\b[ \t]*[:=][ \t]*)[^\s'\",;]{6,}"
    ),
    # Not glued to letters: digit runs inside hex identifiers (OTLP trace/span ids, "chatcmpl-<hex>"
    # response ids) pass the Luhn check one time in ten and are not card numbers.
    "card": r"(?<![\w-])\d(?:[ -]?\d){12,18}(?![\w-])",
    "email": r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b",
    "phone": (
        r"(?<![\w+])(?:\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{2,4}(?:[ .\-]?\d{2,4}){1,3}"
        r"|\(\d{2,4}\)[ .\-]?\d{3,4}[ .\-]?\d{3,4}"
        r"|\d{3}[ .\-]\d{3}[ .\-]\d{4})(?![\w])"
    ),
}
BUILTIN_ORDER = ["bearer", "api_key", "card", "email", "phone"]

# Conservative triggers on *raw JSON text*, in Rust regex syntax (run by polars over a whole batch of
# lines: ~7 µs per 1 KB line here, against ~600 µs for the full Python patterns). Each is a superset
# of its rule's matches: the characters a full match needs appear unescaped in the JSON text, except
# through \uXXXX escapes (a separate trigger) and a tab written as \t (allowed explicitly).
BUILTIN_TRIGGERS: dict[str, str] = {
    "bearer": r"(?i:bearer)",
    "api_key": r"sk-|pk-|rk-|AKIA|ASIA|gh[pousr]_|xox[abprs]-|AIza"
    r"|(?i:api[_-]?key|secret|access[_-]?token|password|passwd)(?:[ \t]|\\t)*[:=]",
    "card": r"\d(?:[ -]?\d){12}",
    "email": r"@",
    "phone": r"\+\d|\(\d|\d{3}[ .\-]\d{3}[ .\-]\d{4}",
}
_UNICODE_ESCAPE = r"\\u"
_ANCHORS = re.compile(r"(?<!\\)[\^$]|\\[AZ]")


@dataclass(frozen=True)
class Rule:
    name: str
    regex: re.Pattern[str]
    replace: Callable[[re.Match[str]], str] | str


def _card_replacer(name: str) -> Callable[[re.Match[str]], str]:
    token = REPLACEMENT.format(name=name)

    def repl(m: re.Match[str]) -> str:
        digits = re.sub(r"[ -]", "", m.group(0))
        return token if 13 <= len(digits) <= 19 and _luhn_ok(digits) else m.group(0)

    return repl


def _phone_ok(m: re.Match[str]) -> bool:
    return sum(c.isdigit() for c in m.group(0)) >= 9


_GLOBAL_FLAGS = re.compile(r"^\(\?([aiLmsux]+)\)")


def _scoped(pattern: str) -> str:
    """``(?i)abc`` -> ``(?i:abc)``: global flags are only legal at the start of the combined regex."""
    m = _GLOBAL_FLAGS.match(pattern)
    return f"(?{m.group(1)}:{pattern[m.end():]})" if m else pattern


class Redactor:
    """Applies the configured rules; ``counts`` accumulates matches per rule (since creation)."""

    def __init__(
        self,
        builtin: Iterable[str] = BUILTIN_ORDER,
        rules: Iterable[tuple[str, str]] = (),
        *,
        enabled: bool = True,
    ):
        builtin = list(builtin)
        unknown = [b for b in builtin if b not in BUILTIN_PATTERNS]
        if unknown:
            raise ValueError(f"unknown built-in redaction rule(s) {unknown}; known: {BUILTIN_ORDER}")
        self.enabled = enabled
        self.counts: Counter[str] = Counter()
        self.rules: list[Rule] = []
        for name in BUILTIN_ORDER:
            if name in builtin:
                rx = re.compile(BUILTIN_PATTERNS[name])
                token = REPLACEMENT.format(name=name)
                if name == "card":
                    repl: Callable[[re.Match[str]], str] | str = _card_replacer(name)
                elif name == "phone":
                    repl = (lambda t: lambda m: t if _phone_ok(m) else m.group(0))(token)
                else:
                    repl = token
                self.rules.append(Rule(name, rx, repl))
        self._always_walk = False
        triggers = [BUILTIN_TRIGGERS[n] for n in BUILTIN_ORDER if n in builtin]
        for name, pattern in rules:
            self.rules.append(Rule(name, re.compile(pattern), REPLACEMENT.format(name=name)))
            if _ANCHORS.search(pattern):
                self._always_walk = True
            triggers.append(_scoped(pattern))
        self._trigger = "|".join(f"(?:{t})" for t in [_UNICODE_ESCAPE, *triggers]) if self.rules else None
        self._any = (
            re.compile("|".join(f"(?:{_scoped(r.regex.pattern)})" for r in self.rules)) if self.rules else None
        )

    @classmethod
    def from_config(cls, ingest_cfg: Any) -> Redactor:
        return cls(
            ingest_cfg.redaction_builtin,
            [(r.name, r.pattern) for r in ingest_cfg.redaction_rules],
            enabled=ingest_cfg.redact,
        )

    # -- text ----------------------------------------------------------------------------------
    def text(self, s: str) -> str:
        """Redact one string (counting matches per rule)."""
        if not self.enabled or self._any is None or not self._any.search(s):
            return s
        for rule in self.rules:
            if isinstance(rule.replace, str):
                s, n = rule.regex.subn(rule.replace, s)
            else:
                n = 0

                def counting(m: re.Match[str], _f=rule.replace) -> str:
                    nonlocal n
                    r = _f(m)
                    if r != m.group(0):
                        n += 1
                    return r

                s = rule.regex.sub(counting, s)
            if n:
                self.counts[rule.name] += n
        return s

    def lines_need_redaction(self, lines: list[bytes]) -> list[bool]:
        """Vectorised conservative check over raw JSON lines (see :data:`BUILTIN_TRIGGERS`): False
        means no string in that line can match a rule. Lines that are not UTF-8 are True."""
        if not self.enabled or self._trigger is None:
            return [False] * len(lines)
        if self._always_walk:
            return [True] * len(lines)
        import polars as pl

        # Invalid UTF-8 is replaced (U+FFFD): such lines are quarantined, and quarantined text is
        # redacted by the full rules anyway.
        text = pl.Series([x.decode("utf-8", "replace") for x in lines], dtype=pl.Utf8)
        try:
            hit = text.str.contains(self._trigger)
        except Exception:  # noqa: BLE001 - a user pattern Rust's regex engine cannot compile
            return [self.line_needs_redaction(x.decode("utf-8", "replace")) for x in lines]
        return hit.fill_null(True).to_list()

    def line_needs_redaction(self, raw: str) -> bool:
        """Conservative check on a raw JSON line: False means no string in it can match a rule."""
        if not self.enabled or self._any is None:
            return False
        if self._always_walk:
            return True
        if "\\" in raw:
            if "\\u" in raw:
                return True
            # Decode JSON escapes (all but \\u, handled above). NUL cannot occur unescaped in valid
            # JSON, so it is a safe placeholder for an escaped backslash.
            raw = (
                raw.replace("\\\\", "\x00").replace('\\"', '"').replace("\\/", "/").replace("\\n", "\n")
                .replace("\\t", "\t").replace("\\r", "\r").replace("\\b", "\b").replace("\\f", "\f")
                .replace("\x00", "\\")
            )
        return self._any.search(raw) is not None

    # -- JSON values -----------------------------------------------------------------------------
    def value(self, v: Any, *, keys: bool = False) -> Any:
        """Redact every string in a JSON value; dict keys only when ``keys``. Types are kept."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.value(x, keys=keys) for x in v]
        if isinstance(v, dict):
            return {(self.text(k) if keys else k): self.value(x, keys=keys) for k, x in v.items()}
        return v

    def arguments(self, args: Any) -> Any:
        """Redact a tool call's ``arguments``: a JSON string is parsed, redacted and re-serialised."""
        if not isinstance(args, str):
            return self.value(args)
        if self._any is None or not self._any.search(args) and "\\u" not in args:
            return args
        try:
            parsed = orjson.loads(args)
        except orjson.JSONDecodeError:
            return self.text(args)
        red = self.value(parsed)
        if red == parsed:
            return args
        import json

        # json.dumps' default separators match what OpenAI sends (", " and ": ").
        return json.dumps(red, ensure_ascii=False)

    def trace(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Redact a trace record (the DESIGN.md trace input shape) without changing its structure."""
        if not self.enabled or self._any is None:
            return rec
        out: dict[str, Any] = {}
        for k, v in rec.items():
            if k == "messages" and isinstance(v, list):
                out[k] = [self._message(m) for m in v]
            elif k == "metadata":
                out[k] = self.value(v, keys=True)
            elif k == "correction" and isinstance(v, dict):
                out[k] = self._correction(v)
            else:
                out[k] = self.value(v)
        return out

    def _message(self, m: Any) -> Any:
        if not isinstance(m, dict):
            return self.value(m)
        out = {}
        for k, v in m.items():
            if k == "tool_calls" and isinstance(v, list):
                out[k] = [self._tool_call(tc) for tc in v]
            else:
                out[k] = self.value(v)
        return out

    def _tool_call(self, tc: Any) -> Any:
        if not isinstance(tc, dict):
            return self.value(tc)
        out = {}
        for k, v in tc.items():
            if k == "function" and isinstance(v, dict):
                out[k] = {fk: (self.arguments(fv) if fk == "arguments" else self.value(fv)) for fk, fv in v.items()}
            else:
                out[k] = self.value(v)
        return out

    def _correction(self, c: dict[str, Any]) -> dict[str, Any]:
        return self.value(c)

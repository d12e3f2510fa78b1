"""Redaction of secrets and PII in traces, before anything is stored.

Every match of a rule is replaced by ``[REDACTED:<rule>]``; counts per rule are kept on the
:class:`Redactor` so the ingest summary can report them.

Built-in rules (``IngestConfig.redaction_builtin`` selects which), applied in this order, so that a
private key is removed whole before its base64 lines meet other rules, URL credentials before the
e-mail rule reads ``pass@host`` as an address, and a vendor key before the key-name rule:

- ``private_key``: PEM/OpenSSH/PGP private key blocks (``-----BEGIN … PRIVATE KEY-----`` to its END
  line, or to the end of the string when the END line is missing), with real or ``\n``-escaped
  line breaks.
- ``basic_auth``: credentials in a URL (``scheme://user:password@host``), ``Basic <base64>``
  values that decode to ``user:password``, and the password of ``curl -u user:password`` /
  ``--user=user:password``.
- ``bearer``: ``Bearer <token>`` (HTTP Authorization values).
- ``jwt``: JSON Web Tokens (``eyJ…`` header, payload, optional signature).
- ``api_key``: well-known key shapes: OpenAI/Anthropic ``sk-…``, Stripe ``sk_live_…``/``rk_…``, AWS
  key ids (``AKIA…``, ``ASIA…``), GitHub (``ghp_…``, ``github_pat_…``), GitLab ``glpat-…``, Slack
  tokens and webhooks, Google ``AIza…``/``GOCSPX-…``/``ya29.…``, SendGrid, Twilio, Mailchimp, npm,
  PyPI, Hugging Face, Discord, Telegram, Square, Artifactory, DigitalOcean, Shopify, Databricks,
  Azure SAS signatures.
- ``secret``: values by the *name* they are given. In text: ``<key> = <value>``, ``<key>: <value>``,
  ``<key> := <value>``, ``<key> => <value>``, the value bare or quoted (``"…"``, ``'…'``, backticks,
  or ``\"…\"`` quotes of JSON inside a JSON string), where the key's last word is a secret word
  (:data:`SECRET_KEY_PATTERN`: ``password``, ``secret``, ``token``, ``api_key``, ``private_key``,
  ``client_secret``, ``Authorization``, …). Words are split at ``_``, ``-``, ``.``, spaces and
  camelCase steps, so ``AWS_SECRET_ACCESS_KEY=…``, ``DB_PASSWORD=…``, ``clientSecret: "…"`` and
  ``token=…`` match while ``max_tokens=256`` and ``password_reset_url=…`` do not (``\b`` could not
  do this: ``_`` is a word character). Also ``cookie``, ``session``, ``passcode``, ``otp``, ``pin``,
  ``privateKeyPem``; a Cookie/Set-Cookie header line whole; an HTTP auth scheme before the value
  (``Authorization: Token …``); SQL's ``PASSWORD '…'`` / ``IDENTIFIED BY '…'``; whitespace, line breaks
  included, between a key and its separator (``"password"\n: "…"``). In dicts (the trace at every
  level: its top-level fields, messages, tool calls beside ``arguments``, arguments, metadata, tool
  results parsed from JSON): every string under a key that is a secret name is replaced whole, whatever
  it looks like and however deep (``{"password": "x y z"}``, ``{"password": [...]}``,
  ``{"credentials": {"pass": …}}``), and so is every string in the ``value`` of a
  ``{"key"|"name": <secret name>, "value": …}`` pair (OTLP attributes and kvlists, header lists). A
  JSON Schema's ``properties`` map names parameters, not data: only string values are replaced there,
  so a tool spec's ``{"password": {"type": "string"}}`` stays a schema.
- ``card``: 13–19 digit card numbers (spaces or dashes allowed) that pass the Luhn check; digit runs
  that fail Luhn are left alone (order ids, timestamps), and so are digit runs glued to letters or
  ``_`` (hex identifiers such as OTLP trace ids or ``chatcmpl-…`` response ids).
- ``email``: ``local@domain.tld``.
- ``phone``: international (``+<cc> …``) or grouped national numbers with at least 9 digits.
- user rules (``IngestConfig.redaction_rules``), applied last, in configuration order.

A value is left alone when it is a placeholder, not a secret: empty, ``None``/``null``/``true``,
``***``, ``<your password>``, ``${VAR}``/``$VAR``, ``{{ var }}``, ``os.environ[…]``, an earlier
``[REDACTED:…]`` (so redaction is idempotent: a replayed quarantine line is not counted twice).
After ``key:`` a bare value that is all letters and shorter than 16 characters is read as prose
(``Password: required for sign-in``) unless it ends its line (``password: letmein`` in a config
file).

Guarantees
- Types are never changed: only JSON *string values* are rewritten, into strings. Dict keys are
  structure and are kept, except in the free-form ``metadata`` object, whose keys are redacted too
  (two keys that redact alike are kept apart with a ``#2`` suffix, so no entry is lost). A tool call's
  ``function.arguments`` (a JSON string, as OpenAI sends it) is parsed, redacted by key and by value,
  and re-serialised, so argument names, nesting and value types are unchanged; arguments that are not
  valid JSON are redacted as plain text (they are already broken; the failure kind is kept).
- Deterministic: the same input gives the same output, so equal strings stay equal after redaction
  (deduplication and failure hashing work on redacted data).
- Raw text (quarantined lines) goes through the same rules as text.
- Measured against Yelp's detect-secrets as an oracle (``tests/unit/test_redact_secrets.py``): every
  secret its pattern plugins find in a 69-sample corpus (code, JSON, env files, URLs, prose) is
  removed; none of ~1,000 ordinary strings (BFCL questions, near misses) changes.

Not guaranteed
- Secrets inside JSON *numbers* (``{"pin": 123456}``, ``{"phone": 5551234567}``) are not redacted:
  changing a number into a string would change the argument's type, which this module promises never
  to do. Configure the producer to send such fields as strings, or drop them upstream.
- Secrets named in prose without a key (``my password is hunter2``), or with a key outside the list,
  and high-entropy strings with no known shape are not detected: the rules are shapes and names, not
  entropy (an entropy rule would redact the ids and hashes that traces are full of).
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

import base64
import binascii
import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the redactor itself needs nothing from the config module
    from flywheel.config import IngestConfig

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


# Edges that treat "_" as a separator. ``\b`` does not (``_`` is a word character): ``\bsecret``
# never matched inside ``CLIENT_SECRET``, nor ``\bsk-`` after ``key_``.
_L = r"(?<![A-Za-z0-9])"
_R = r"(?![A-Za-z0-9])"

# The last word of a key that names a secret. Words that are secrets whatever precedes them
# (``dbpassword``, ``PGPASSWORD``) ...
_ANY_PREFIX_WORDS = r"password|passwd|passphrase|secret|credentials?|contrase(?:n|ñ)a"
# ... and words that need a word edge before them (``token`` but not ``tokenizer``'s prefix; compounds
# of ``key``/``pass`` only with a secret-ish first part: ``api_key``, ``db_pass``; not ``primary_key``).
_EDGE_WORDS = (
    r"pwd|token|auth|authorization|apikey|cookies?|session|passcode|otp|pin|private[_\-. ]?key[_\-. ]?pem|"
    r"(?:api|access|auth|client|private|secret|signing|encryption|master|account|service|storage|app|consumer|"
    r"subscription|license|licence|db|database)[_\- ]?key|"
    r"(?:db|database|key|smtp|mysql|pg|redis|admin|root|user|mail)[_\- ]?pass"
)
# A key name whose last word is a secret word. Word edges: start, any of ``_ - . space``, or a
# camelCase step (lower/digit then upper, checked case-sensitively: ``dbPassword``, ``apiKey``).
SECRET_KEY_PATTERN = (
    rf"(?:(?i:{_ANY_PREFIX_WORDS})|(?:(?<![A-Za-z0-9])|(?<=[a-z0-9])(?=[A-Z]))(?i:{_EDGE_WORDS}))"
)
_SECRET_KEY = re.compile(rf"[A-Za-z0-9_.\- ]*?{SECRET_KEY_PATTERN}")

# ``<key><closing quote?> <sep> <value>`` in text, where the key ends in a secret word. The match
# starts at that word: what precedes it in the key is kept either way, and a leading ``[\w.-]*?``
# made the search quadratic in the length of every string (8.7 vs 2.7 µs a string, measured). The
# value is quoted (JSON escapes honoured inside "..." and '...'; ``\"...\"`` for JSON inside a JSON
# string) or bare up to whitespace, a quote, ``,`` ``;``, a backslash (an escape in raw JSON) or
# ``&name=`` (the next query parameter); a bare value never starts with ``<``, ``{`` or ``[``.
_SECRET_TEXT = (
    # A Cookie / Set-Cookie header line: every cookie in it, up to the end of the line or a quote.
    r"(?<![A-Za-z0-9])(?i:(?:set-)?cookie)(?:\\*[\"'`])?[ \t]*:[ \t]*(?P<v6>(?![\"'\\\s])[^\r\n\"'\\]+)"
    # SQL: ``PASSWORD 'x'``, ``IDENTIFIED BY 'x'`` (CREATE/ALTER USER/ROLE), no separator.
    r"|(?<![A-Za-z0-9])(?i:password|identified[ \t]+by)[ \t]+'(?P<v7>(?:''|[^'\r\n\\])+)'"
    rf"|{SECRET_KEY_PATTERN}(?![A-Za-z0-9_])"
    # whitespace before the separator may be a line break, real or JSON-escaped (``"password"\n:``)
    r"(?:\\*[\"'`])?(?:\s|\\[nrt])*(?P<sep>:=|=>|==|=|:)[ \t]*"
    # an HTTP auth scheme before the value (``Authorization: Token abc``; Bearer/Basic have their rules)
    r"(?:(?i:token|digest|apikey|api-key|key|sso-key)[ \t]+(?=[^\s<]))?"
    r"(?:\"(?P<v1>(?:\\.|[^\"\\\n])+)\"|'(?P<v2>(?:\\.|[^'\\\n])+)'|`(?P<v3>[^`\n]+)`"
    r"|(?P<q4>\\+[\"'])(?P<v4>.+?)(?P=q4)"
    r"|(?P<v5>(?![<{\[])(?:(?!&[A-Za-z0-9_.\-]+=)[^\s'\"`,;\\])+))"
)
# A secret-named key in text that is JSON, whatever its value (an object or list under it is walked by
# key; the text rule only reads scalar values): the key's closing quote, then ``:`` or, for a
# ``{"key"|"name": <secret name>, "value": ...}`` pair, the end of the string.
_KEY_HINT = re.compile(rf"{SECRET_KEY_PATTERN}(?![A-Za-z0-9_])(?:\\*[\"'`](?:\s|\\[nrt])*[:=]|\\*[\"'])")

BUILTIN_PATTERNS: dict[str, str] = {
    "private_key": (
        r"-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"(?:-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----|\Z)"
    ),
    "basic_auth": (
        r"(?<=://)(?P<url>[^\s/?#@'\"\\<>:]*:[^\s/?#'\"\\<>]+)@(?=[A-Za-z0-9\[])"
        rf"|{_L}(?i:basic)[ \t]+(?P<b64>[A-Za-z0-9+/]{{6,}}={{0,2}})(?![A-Za-z0-9+/=])"
        # curl/wget ``-u user:password`` / ``--user=user:password`` (quoted or bare): the password part
        r"|(?<![\w-])(?:-u|--user|--proxy-user)(?:[ \t]+|=)(?P<cq>\\?[\"']?)[^\s:'\"\\]*:(?P<cpw>[^\s'\"\\]+)(?P=cq)"
    ),
    "bearer": rf"{_L}(?i:bearer)[ \t]+[A-Za-z0-9._~+/\-]{{8,}}=*",
    "jwt": rf"{_L}eyJ[A-Za-z0-9_\-]{{10,}}={{0,2}}\.[A-Za-z0-9_\-]{{10,}}={{0,2}}(?:\.[A-Za-z0-9_\-+/=]*)?",
    "api_key": _L + "(?:" + "|".join([
        r"(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)?[A-Za-z0-9_\-]{16,}",  # OpenAI, Anthropic (sk-ant-...)
        r"(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}",  # Stripe
        r"(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA|A3T[A-Z0-9])[A-Z0-9]{16}" + _R,  # AWS key ids
        r"gh[pousr]_[A-Za-z0-9]{30,}", r"github_pat_[A-Za-z0-9_]{22,}",  # GitHub
        r"glpat-[A-Za-z0-9_\-]{20,}",  # GitLab
        r"xox[abposre]-[A-Za-z0-9\-]{10,}", r"hooks\.slack\.com/services/[A-Za-z0-9_/]{20,}",  # Slack
        r"AIza[0-9A-Za-z_\-]{35}", r"GOCSPX-[A-Za-z0-9_\-]{20,}", r"ya29\.[0-9A-Za-z_\-]{20,}",  # Google
        r"SG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}",  # SendGrid
        r"SK[0-9a-fA-F]{32}" + _R,  # Twilio API key
        r"[0-9a-f]{32}-us[0-9]{1,2}" + _R,  # Mailchimp
        r"npm_[A-Za-z0-9]{36}", r"pypi-AgEIcHlwaS5vcmc[A-Za-z0-9_\-]{50,}",  # npm, PyPI
        r"hf_[A-Za-z0-9]{30,}",  # Hugging Face
        r"[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27,}",  # Discord bot
        r"[0-9]{8,10}:[A-Za-z0-9_\-]{35}" + _R,  # Telegram bot
        r"sq0(?:atp|csp)-[0-9A-Za-z_\-]{22,}",  # Square
        r"AKC[a-zA-Z0-9]{10,}",  # Artifactory
        r"dop_v1_[a-f0-9]{64}", r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}", r"dapi[a-f0-9]{32}",
        r"(?<=[?&])sig=[A-Za-z0-9%+/]{16,}={0,2}",  # Azure SAS signature
    ]) + ")",
    "secret": _SECRET_TEXT,
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
BUILTIN_ORDER = ["private_key", "basic_auth", "bearer", "jwt", "api_key", "secret", "card", "email", "phone"]

# Conservative triggers on *raw JSON text*, in Rust regex syntax (run by polars over a whole batch of
# lines: ~7 µs per 1 KB line here, against ~600 µs for the full Python patterns). Each is a superset
# of its rule's matches: the characters a full match needs appear unescaped in the JSON text, except
# through \uXXXX escapes (a separate trigger) and a tab written as \t (allowed explicitly). The
# ``secret`` trigger also covers the key-aware walk of objects: a secret-named key appears in the raw
# line as the secret word, its closing quote (escaped inside a JSON string) and a colon.
BUILTIN_TRIGGERS: dict[str, str] = {
    "private_key": r"PRIVATE KEY",
    "basic_auth": r"@|(?i:basic)(?:[ \t]|\\t)|-u(?:[ \t=]|\\t)|--user|--proxy-user",
    "bearer": r"(?i:bearer)",
    "jwt": r"eyJ",
    "api_key": r"sk-|pk-|rk-|sk_|pk_|rk_|AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA|A3T"
    r"|gh[pousr]_|github_pat_|glpat-|xox[abposre]-|hooks\.slack\.com|AIza|GOCSPX-|ya29\.|SG\.|SK[0-9a-fA-F]{32}"
    r"|-us[0-9]|npm_|pypi-|hf_|[MNO][A-Za-z0-9_\-]{23,25}\.|[0-9]{8}:|sq0|AKC|dop_v1_|shp(?:at|ca|pa|ss)_|dapi"
    r"|sig=",
    # every last word a secret key can end with (compounds end in ``key`` or ``pass``), whole
    # (whitespace before the separator includes line breaks, real or escaped; a key that ends a string
    # is a key/value pair's name; SQL ``PASSWORD '...'`` and Cookie headers have no ``=``)
    "secret": r"(?i:password|passwd|passphrase|secret|credentials?|contrase(?:n|ñ)a|pwd|token|auth|authorization"
    r"|key|pass|cookies?|session|passcode|otp|pin|pem)(?:(?:\\*[\"'`])?(?:\s|\\[tnr])*[:=]|\\*[\"'])"
    r"|(?i:password|identified[ \t]+by)(?:[ \t]|\\t)+'",
    "card": r"\d(?:[ -]?\d){12}",
    "email": r"@",
    "phone": r"\+\d|\(\d|\d{3}[ .\-]\d{3}[ .\-]\d{4}",
}
_UNICODE_ESCAPE = r"\\u"
_ANCHORS = re.compile(r"(?<!\\)[\^$]|\\[AZ]")

# Values that stand for a secret without being one (see the module docstring).
_PLACEHOLDER = re.compile(
    r"\s*|\[REDACTED:[^\]]*\]|\*+|[xX]{3,}|\.\.\.|…|<[^<>]*>|\$\{[^}]*\}|\$[A-Z_][A-Z0-9_]*|\{\{.*\}\}|%\(\w+\)s|%s"
    r"|(?i:null|none|nil|undefined|true|false)"
    r"|(?:os\.environ|os\.getenv|getenv|process\.env|env|ENV|settings|config)[.\[(].*"  # code references
    r"|[A-Za-z_][\w.]*[(\[]"  # code: a call or subscript whose argument the bare-value match cut off
)
# After ``key:``, a bare all-letter value this short is prose ("Password: required for sign-in")
# unless it ends its line.
_PROSE_WORD = re.compile(r"[A-Za-z]{1,15}")
_LINE_END = re.compile(r"[ \t]*(?:$|\r|\n|\\n|\\r)")


_NOT_JSON = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads_exact(text: str) -> Any:
    """``json.loads`` (integers of any size stay integers: orjson reads those beyond 64 bits as
    floats, and redaction must not change a type); ``_NOT_JSON`` when it is not strict JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _dumps(obj: Any) -> str:
    """JSON text; a lone surrogate the parser accepted is written back as its ``\\udXXX`` escape
    (Arrow and DuckDB refuse it as a character)."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, ensure_ascii=True)
    return text


@functools.lru_cache(maxsize=4096)  # traces repeat a few hundred keys
def is_secret_key(key: str) -> bool:
    """Whether an object key names a secret (its last word is a secret word; see the module doc)."""
    return _SECRET_KEY.fullmatch(key) is not None


def is_placeholder(value: str) -> bool:
    return _PLACEHOLDER.fullmatch(value) is not None


@dataclass(frozen=True)
class Rule:
    name: str
    regex: re.Pattern[str]
    replace: Callable[[re.Match[str]], str] | str
    # Characters of which a match contains at least one, checked with ``in`` before the regex runs:
    # the ``secret`` rule needs ":" or "=", which most strings lack, and its case-insensitive word
    # list is the slowest pattern here (~3 µs a string alone, more than all the others together).
    needs: str = ""

    def may_match(self, s: str) -> bool:
        return not self.needs or any(c in s for c in self.needs)


def _card_replacer(name: str) -> Callable[[re.Match[str]], str]:
    token = REPLACEMENT.format(name=name)

    def repl(m: re.Match[str]) -> str:
        digits = re.sub(r"[ -]", "", m.group(0))
        return token if 13 <= len(digits) <= 19 and _luhn_ok(digits) else m.group(0)

    return repl


def _phone_ok(m: re.Match[str]) -> bool:
    return sum(c.isdigit() for c in m.group(0)) >= 9


def _secret_replacer(name: str) -> Callable[[re.Match[str]], str]:
    """Replace the value of a ``key = value`` match, keeping the key, separator and quotes."""
    token = REPLACEMENT.format(name=name)

    def repl(m: re.Match[str]) -> str:
        for g in ("v1", "v2", "v3", "v4", "v5", "v6", "v7"):
            if m.group(g) is not None:
                break
        value = m.group(g)
        if is_placeholder(value):
            return m.group(0)
        if g == "v5" and m.group("sep") == ":" and _PROSE_WORD.fullmatch(value) \
                and not _LINE_END.match(m.string, m.end()):
            return m.group(0)
        start, end = m.start(g) - m.start(), m.end(g) - m.start()
        whole = m.group(0)
        return whole[:start] + token + whole[end:]

    return repl


def _basic_auth_replacer(name: str) -> Callable[[re.Match[str]], str]:
    """URL credentials always; ``Basic <x>`` only when ``x`` decodes to ``user:password`` (``basic``
    is an English word: "Basic understanding" must stay)."""
    token = REPLACEMENT.format(name=name)

    def repl(m: re.Match[str]) -> str:
        if m.group("url") is not None:
            return token + m.group(0)[len(m.group("url")):]
        if m.group("cpw") is not None:
            if is_placeholder(m.group("cpw")):
                return m.group(0)
            start, end = m.start("cpw") - m.start(), m.end("cpw") - m.start()
            return m.group(0)[:start] + token + m.group(0)[end:]
        b64 = m.group("b64")
        try:
            raw = base64.b64decode(b64 + "=" * (-len(b64) % 4), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return m.group(0)
        user, sep, pw = raw.partition(":")
        return token if sep and pw and raw.isprintable() else m.group(0)

    return repl


_REPLACERS: dict[str, Callable[[str], Callable[[re.Match[str]], str]]] = {
    "card": _card_replacer, "secret": _secret_replacer, "basic_auth": _basic_auth_replacer,
}


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
                if name in _REPLACERS:
                    repl: Callable[[re.Match[str]], str] | str = _REPLACERS[name](name)
                elif name == "phone":
                    repl = (lambda t: lambda m: t if _phone_ok(m) else m.group(0))(token)
                else:
                    repl = token
                # the secret rule needs a separator, or the quote of SQL's ``PASSWORD 'x'``
                self.rules.append(Rule(name, rx, repl, needs=":='" if name == "secret" else ""))
        self._always_walk = False
        triggers = [BUILTIN_TRIGGERS[n] for n in BUILTIN_ORDER if n in builtin]
        for name, pattern in rules:
            self.rules.append(Rule(name, re.compile(pattern), REPLACEMENT.format(name=name)))
            if _ANCHORS.search(pattern):
                self._always_walk = True
            triggers.append(_scoped(pattern))
        self._keys = "secret" in builtin  # redact object values by their key names
        self._secret_token = REPLACEMENT.format(name="secret")
        self._trigger = "|".join(f"(?:{t})" for t in [_UNICODE_ESCAPE, *triggers]) if self.rules else None
        plain = [r for r in self.rules if not r.needs]
        self._any = re.compile("|".join(f"(?:{_scoped(r.regex.pattern)})" for r in plain)) if plain else None
        self._gated = [r for r in self.rules if r.needs]

    @classmethod
    def from_config(cls, ingest_cfg: IngestConfig) -> Redactor:
        return cls(
            ingest_cfg.redaction_builtin,
            [(r.name, r.pattern) for r in ingest_cfg.redaction_rules],
            enabled=ingest_cfg.redact,
        )

    # -- text ----------------------------------------------------------------------------------
    def _matches(self, s: str) -> bool:
        """Whether any rule matches somewhere in ``s``."""
        if self._any is not None and self._any.search(s):
            return True
        return any(r.may_match(s) and r.regex.search(s) for r in self._gated)

    def text(self, s: str) -> str:
        """Redact one string (counting matches per rule)."""
        if not self.enabled or not self.rules or not self._matches(s):
            return s
        for rule in self.rules:
            if not rule.may_match(s):
                continue
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
        if not self.enabled or not self.rules:
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
        return self._matches(raw) or (self._keys and _KEY_HINT.search(raw) is not None)

    # -- JSON values -----------------------------------------------------------------------------
    def _by_key(self, k: Any, x: Any) -> bool:
        """Whether ``x`` is a non-placeholder string under a secret-named key (replaced whole)."""
        return (self._keys and type(x) is str and type(k) is str and is_secret_key(k)
                and not is_placeholder(x))

    def _secret(self) -> str:
        self.counts["secret"] += 1
        return self._secret_token

    def _secret_name(self, k: Any) -> bool:
        return self._keys and type(k) is str and is_secret_key(k)

    def _pair_value_is_secret(self, d: dict[Any, Any]) -> bool:
        """``{"key"|"name": <a secret name>, "value": ...}``: an OTLP attribute (``{"key":
        "db.password", "value": {"stringValue": ...}}``, kvlist entries) or a header list entry
        (``{"name": "Authorization", "value": ...}``). Key-based redaction never saw these: the
        secret's name is a value, not a key."""
        if not self._keys or "value" not in d:
            return False
        name = d.get("key", d.get("name"))
        return type(name) is str and is_secret_key(name)

    def _keyed(self, k: Any, x: Any, *, keys: bool = False, schema: bool = False,
               keep: frozenset[str] = frozenset()) -> Any:
        """``x`` redacted as the value of key ``k``: under a secret name every string in it goes,
        whatever its type (a list, an object, an OTLP ``AnyValue``); types are kept. ``schema``: ``k``
        names a parameter in a JSON Schema ``properties`` map, whose values are schemas, not data
        (``{"password": {"type": "string"}}``): only a string there is replaced."""
        if self._secret_name(k) and (type(x) is str or not schema):
            return self._all_strings(x)
        return self.value(x, keys=keys, keep=keep, _parent=k)

    def value(self, v: Any, *, keys: bool = False, keep: frozenset[str] = frozenset(), _parent: Any = None) -> Any:
        """Redact every string in a JSON value; dict keys only when ``keys``. Types are kept; every
        string under a secret-named key (at any depth, in lists and objects under it too) and in the
        ``value`` of a ``{"key"|"name": <secret name>, "value": ...}`` pair is replaced whole (see the
        module docstring). ``keep``: keys whose values are structure, not content, left as they are at
        any depth (OTLP's ids and nanosecond timestamps: a 19-digit timestamp passes the Luhn check one
        time in ten and would otherwise go as a card number)."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.value(x, keys=keys, keep=keep) for x in v]
        if isinstance(v, dict):
            pair = self._pair_value_is_secret(v)
            schema = _parent == "properties"
            out: dict[Any, Any] = {}
            for k, x in v.items():
                if k in keep:
                    out[k] = x
                    continue
                nx = (self._all_strings(x) if pair and k == "value"
                      else self._keyed(k, x, keys=keys, schema=schema, keep=keep))
                if keys and isinstance(k, str):
                    nk = self.text(k)
                    if nk != k and (nk in out or nk in v):
                        # Two keys that redact alike stay two entries.
                        i = 2
                        while f"{nk}#{i}" in out or f"{nk}#{i}" in v:
                            i += 1
                        nk = f"{nk}#{i}"
                    out[nk] = nx
                else:
                    out[k] = nx
            return out
        return v

    def _all_strings(self, v: Any) -> Any:
        """Every string in ``v`` replaced (types kept): the value of a secret-named argument of a
        correction, which may be ``{"one_of": [...]}`` rather than a string."""
        if isinstance(v, str):
            return v if is_placeholder(v) else self._secret()
        if isinstance(v, list):
            return [self._all_strings(x) for x in v]
        if isinstance(v, dict):
            return {k: self._all_strings(x) for k, x in v.items()}
        return v

    def arguments(self, args: Any) -> Any:
        """Redact a tool call's ``arguments``: a JSON string is parsed, redacted and re-serialised."""
        if not isinstance(args, str):
            return self.value(args)
        if not self.rules or not self._matches(args) and "\\u" not in args \
                and not (self._keys and _KEY_HINT.search(args)):
            return args
        parsed = _loads_exact(args)
        if parsed is _NOT_JSON:
            return self.text(args)
        red = self.value(parsed)
        if red == parsed:
            return args
        # json.dumps' default separators match what OpenAI sends (", " and ": ").
        return _dumps(red)

    def raw(self, line: str) -> str:
        """Redact the raw text of a record (a quarantined line). A line that is JSON is redacted as a
        value, by key and by value as a trace is (so ``"password": {"one_of": [...]}`` in a
        correction goes too), and written back as JSON; otherwise it is redacted as text."""
        if not self.enabled or not self.rules:
            return line
        if line.lstrip()[:1] in ("{", "["):
            obj = _loads_exact(line)
            if obj is not _NOT_JSON:
                try:
                    red = self.trace(obj) if isinstance(obj, dict) else self.value(obj)
                    return line if red == obj else _dumps(red)
                except Exception:  # noqa: BLE001 - e.g. nested beyond Python's limit: the text rules still apply
                    pass
        return self.text(line)

    def trace(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Redact a trace record (the shape of ``schemas/trace.schema.json``) without changing its structure."""
        if not self.enabled or not self.rules:
            return rec
        out: dict[str, Any] = {}
        for k, v in rec.items():
            if self._secret_name(k):  # a secret-named field at the top level
                out[k] = self._all_strings(v)
            elif k == "messages" and isinstance(v, list):
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
                out[k] = self._keyed(k, v)
        return out

    def _tool_call(self, tc: Any) -> Any:
        if not isinstance(tc, dict):
            return self.value(tc)
        out = {}
        for k, v in tc.items():
            if k == "function" and isinstance(v, dict):
                # beside ``arguments``, a secret-named field of the function object is checked too
                out[k] = {fk: (self.arguments(fv) if fk == "arguments" else self._keyed(fk, fv)) for fk, fv in v.items()}
            else:
                out[k] = self._keyed(k, v)
        return out

    def _correction(self, c: dict[str, Any]) -> dict[str, Any]:
        # A secret-named argument's value may be ``{"one_of": [...]}``: value() replaces every string
        # under a secret name, whatever its type.
        return self.value(c)

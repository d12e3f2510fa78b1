"""Secrets in the shapes the redactor did not walk (issue 31, finding 5).

Key-based redaction looked only at a string directly under a secret-named key inside a message's
content, arguments or metadata. It missed: OTLP attributes and header lists, where the secret's name
is a *value* (``{"key": "db.password", "value": {...}}``, ``{"name": "Authorization", "value": ...}``);
secret-named keys at a trace's top level, on a message, beside ``function.arguments``; lists and
objects under a secret key; and a quarantined OTLP line was stored whole once per trace in it. The
text forms and key names of (c) and (d) are in the oracle corpus (``test_redact_secrets.py``).

Guarantee checked: every planted secret is gone from the redacted value and from everything ingest
stores, and what detect-secrets (the oracle) reads in the stored text is only redaction markers.
Not guaranteed: numbers under a secret key (``{"pin": 1234}``) are kept, as the module documents.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.redact import Redactor

_rng = random.Random(31)


def _secret() -> str:
    return "".join(_rng.choice(string.ascii_letters + string.digits) for _ in range(14)) + "!9"


P = {k: _secret() for k in ("db", "cookie", "token", "sql", "top", "msg", "fn", "list", "cred", "hdr", "kv", "arg")}


def _oracle_left(tmp_path: Path, text: str) -> list[str]:
    """What detect-secrets still finds in ``text`` (as a JSON file) that is not a redaction marker."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
    from detect_secrets.core.scan import scan_file
    from detect_secrets.settings import transient_settings

    skipped = {"Base64HighEntropyString", "HexHighEntropyString", "IPPublicDetector"}
    plugins = [{"name": c.__name__} for c in get_mapping_from_secret_type_to_class().values()
               if c.__name__ not in skipped]
    f = tmp_path / "stored.json"
    f.write_text(text)
    with transient_settings({"plugins_used": plugins}):
        return [s.secret_value for s in scan_file(str(f)) if s.secret_value and "[REDACTED:" not in s.secret_value]


def _kv(k: str, v: object) -> dict:
    if isinstance(v, str):
        return {"key": k, "value": {"stringValue": v}}
    return {"key": k, "value": {"arrayValue": {"values": [{"stringValue": x} for x in v]}}}  # type: ignore[union-attr]


def _span(tid: str, attrs: list[dict]) -> dict:
    return {"traceId": tid, "spanId": tid[:16], "name": "db query", "startTimeUnixNano": "1793610000000000000",
            "endTimeUnixNano": "1793610001000000000", "attributes": attrs}


THREE_SPANS = {"resourceSpans": [{"resource": {"attributes": [_kv("service.name", "shop")]}, "scopeSpans": [{
    "scope": {"name": "db"}, "spans": [
        _span("1" * 32, [_kv("db.system", "postgresql"), _kv("db.password", P["db"]),
                         _kv("db.statement", f"ALTER USER app WITH PASSWORD '{P['sql']}'")]),
        _span("2" * 32, [_kv("http.request.header.cookie", [f"session={P['cookie']}"])]),
        _span("3" * 32, [_kv("http.request.header.authorization", [f"Token {P['token']}"]),
                         _kv("note", f"Authorization: Token {P['token']}")]),
    ]}]}]}


def test_otlp_kv_attribute_secret_is_redacted(tmp_path):
    """Finding 5 (a): OTLP attributes are key/value pairs; a secret name in ``key`` redacts its
    ``value`` whatever its type (string, array); SQL ``PASSWORD '...'`` and ``Token`` text forms too."""
    red = Redactor().value(THREE_SPANS)
    text = json.dumps(red)
    for k in ("db", "sql", "cookie", "token"):
        assert P[k] not in text, (k, text)
    spans = red["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert spans[0]["attributes"][1] == {"key": "db.password", "value": {"stringValue": "[REDACTED:secret]"}}
    assert spans[0]["attributes"][0]["value"]["stringValue"] == "postgresql"  # other attributes kept
    assert not _oracle_left(tmp_path, text)


def test_header_list_and_values_under_a_secret_key_are_redacted_whole():
    """Finding 5 (b): name/value header lists; a list or an object under a secret-named key
    (``{"password": [...]}``, ``{"credentials": {"pass": ...}}``): every string in it goes, types kept."""
    r = Redactor()
    v = {"headers": [{"name": "Authorization", "value": f"Token {P['hdr']}"}, {"name": "Accept", "value": "json"}],
         "password": [P["list"], "x2"], "credentials": {"user": "bob", "pass": P["cred"], "n": 3}}
    out = r.value(v)
    assert P["hdr"] not in json.dumps(out) and out["headers"][1]["value"] == "json"
    assert out["password"] == ["[REDACTED:secret]", "[REDACTED:secret]"]
    assert out["credentials"] == {"user": "[REDACTED:secret]", "pass": "[REDACTED:secret]", "n": 3}
    # a JSON Schema's properties name parameters, they hold no data: a tool spec is kept as it is
    spec = {"type": "object", "properties": {"password": {"type": "string", "minLength": 8}}, "required": ["password"]}
    assert r.value({"parameters": spec}) == {"parameters": spec}


def test_secret_keys_at_top_level_on_a_message_and_beside_arguments_are_redacted():
    """Finding 5 (b): a secret-named field at a trace's top level, on a message, on a tool call's
    function object (beside ``arguments``) and inside arguments under a list is redacted."""
    tr = {"trace_id": "t1", "password": P["top"],
          "messages": [{"role": "user", "content": "hi", "api_key": P["msg"]},
                       {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
                           "name": "login", "token": P["fn"],
                           "arguments": json.dumps({"user": "bob", "credentials": {"pass": P["arg"]}})}}]}]}
    out = Redactor().trace(tr)
    text = json.dumps(out)
    for k in ("top", "msg", "fn", "arg"):
        assert P[k] not in text, (k, text)
    assert out["trace_id"] == "t1" and out["messages"][1]["tool_calls"][0]["function"]["name"] == "login"


def test_whitespace_before_the_colon_does_not_skip_the_prefilter():
    """Finding 5 (d): ``"password"\\n:`` inside an arguments string: the raw-line prefilter fires and
    the secret goes."""
    r = Redactor()
    args = '{"user": "bob", "password"\n: "' + P["arg"] + '"}'
    line = json.dumps({"trace_id": "t", "messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": args}}]}]})
    assert r.lines_need_redaction([line.encode()]) == [True]
    assert r.line_needs_redaction(line)
    assert P["arg"] not in r.arguments(args)


KEYS = st.sampled_from(["password", "db.password", "cookie", "session", "credentials", "pin", "otp", "passcode",
                        "privateKeyPem", "Authorization", "name", "x"])
VALUES = st.recursive(st.text(max_size=8) | st.sampled_from([P["kv"], "Token " + P["kv"]]),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(KEYS, c, max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(KEYS, VALUES), max_size=3), st.sampled_from(["pair", "name", "key", "args"]))
def test_prefilter_fires_for_every_shape_the_walk_redacts(pairs, shape):
    """Finding 5: the vectorised raw-line check stays a superset of the walk for the new shapes
    (key/value pairs, header lists, objects and lists under a secret key, arguments strings)."""
    r = Redactor()
    if shape == "pair":
        obj = {"attributes": [{"key": k, "value": {"stringValue": json.dumps(v)}} for k, v in pairs]}
    elif shape == "name":
        obj = {"headers": [{"name": k, "value": v} for k, v in pairs]}
    elif shape == "key":
        obj = {"meta": dict(pairs)}
    else:
        obj = {"args": json.dumps(dict(pairs), indent=1)}
    would = r.value(obj) != obj or (shape == "args" and r.arguments(obj["args"]) != obj["args"])
    if would:
        for ascii_only in (False, True):
            line = json.dumps(obj, ensure_ascii=ascii_only)
            assert r.lines_need_redaction([line.encode()]) == [True], line
            assert r.line_needs_redaction(line), line


@pytest.mark.slow
def test_quarantined_otlp_line_is_stored_once_and_redacted(cfg, store, tmp_path):
    """Finding 5 (a): one OTLP line with three spans (three traces, none a GenAI call, so all three are
    quarantined) carrying ``db.password``, a cookie header, ``Authorization: Token ...`` and SQL
    ``PASSWORD '...'``: three quarantine rows, the raw line in one of them, no secret in any file of
    the home, and the oracle finds nothing in the stored rows."""
    from flywheel.artifacts import ArtifactStore
    from flywheel.ingest import ingest_paths, list_quarantine, show_quarantine

    arts = ArtifactStore(cfg.artifacts_dir)
    f = tmp_path / "spans.jsonl"
    f.write_text(json.dumps(THREE_SPANS) + "\n")
    s = ingest_paths(cfg, store, arts, [f])
    rows = [r for q in list_quarantine(store) for r in show_quarantine(store, arts, q["stream"])]
    assert s.quarantined == 3 and len(rows) == 3, rows
    with_raw = [r for r in rows if r["raw"].startswith("{")]
    assert len(with_raw) == 1 and with_raw[0]["replayable"], rows
    text = json.dumps(rows)
    for k in ("db", "sql", "cookie", "token"):
        assert P[k] not in text, k
    assert not _oracle_left(tmp_path, text)
    store.close()
    for p in Path(cfg.home).rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            for k in ("db", "sql", "cookie", "token"):
                assert P[k].encode() not in data, (p, k)

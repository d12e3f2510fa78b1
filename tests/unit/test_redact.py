"""Redaction: rules, structure preservation, the conservative prefilter, and planted secrets never
stored in clear (warehouse, artifacts, quarantine)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.artifacts import ArtifactStore
from flywheel.config import IngestConfig
from flywheel.redact import Redactor

SECRETS = {
    "api_key": "sk-proj-Abcdefghijklmnop1234567890",
    "bearer": "Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig",
    "email": "jane.doe+x@example.co.uk",
    "phone": "+44 20 7946 0958",
    "card": "4111 1111 1111 1111",
}


def test_each_builtin_rule():
    r = Redactor()
    for name, secret in SECRETS.items():
        out = r.text(f"prefix {secret} suffix")
        assert secret not in out and f"[REDACTED:{name}]" in out, (name, out)
    assert r.text("order 4111 1111 1111 1112 and 2026-11-02T09:00:00Z at 20:30") == \
        "order 4111 1111 1111 1112 and 2026-11-02T09:00:00Z at 20:30"  # Luhn fails; timestamps kept
    assert r.text("AKIAABCDEFGHIJKLMNOP ghp_" + "a" * 36).count("[REDACTED:api_key]") == 2
    assert r.text("call 555-123-4567") == "call [REDACTED:phone]"
    assert r.counts["email"] == 1 and r.counts["card"] == 1


def test_user_rules_and_disabled():
    r = Redactor(rules=[("ticket", r"(?i)TICKET-\d+")])
    assert r.text("see ticket-123") == "see [REDACTED:ticket]"
    assert Redactor(enabled=False).text(SECRETS["email"]) == SECRETS["email"]


def test_structure_and_types_are_kept():
    r = Redactor()
    args = json.dumps({"to": "jane@example.com", "n": 5, "flag": True, "nested": {"cc": ["bob@example.com", 3.5]}})
    tr = {"trace_id": "t", "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "send_mail", "arguments": args}}]}],
          "metadata": {"jane@example.com": "x"}}
    out = r.trace(tr)
    a = json.loads(out["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert a == {"to": "[REDACTED:email]", "n": 5, "flag": True, "nested": {"cc": ["[REDACTED:email]", 3.5]}}
    assert out["messages"][0]["tool_calls"][0]["function"]["name"] == "send_mail"
    assert list(out["metadata"]) == ["[REDACTED:email]"]
    broken = r.arguments('{"to": "jane@example.com"')  # invalid JSON stays a string, redacted as text
    assert broken == '{"to": "[REDACTED:email]"'


TEXT = st.text(alphabet=st.sampled_from(list("ab@.-+ ()0123456789\t\"\\/xyz_ekAIKSsp:=")), max_size=60)


@settings(max_examples=400, deadline=None)
@given(st.lists(TEXT, min_size=1, max_size=4))
def test_prefilter_is_conservative(strings):
    """If any decoded string would be redacted, the vectorised raw-line trigger fires."""
    r = Redactor()
    line = json.dumps({"s": strings}, ensure_ascii=bool(len(strings) % 2)).encode()
    would = any(Redactor().text(s) != s for s in strings)
    if would:
        assert r.lines_need_redaction([line]) == [True]
        assert r.line_needs_redaction(line.decode())


def test_planted_secrets_never_stored_in_clear(cfg, store, tmp_path):
    from flywheel.ingest import ingest_paths

    arts = ArtifactStore(cfg.artifacts_dir)
    s = " ".join(SECRETS.values())
    good = {"trace_id": "p-1", "timestamp": "2026-11-02T09:00:00Z", "model": "m",
            "messages": [{"role": "user", "content": f"my details: {s}"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                          "function": {"name": "send", "arguments": json.dumps({"to": SECRETS["email"]})}}]}],
            "tools": [{"type": "function", "function": {"name": "mail", "parameters": {"type": "object"}}}],
            "outcome": {"status": "failure", "error": f"auth {SECRETS['bearer']} rejected"},
            "metadata": {"phone": SECRETS["phone"]}}
    ok = {**good, "trace_id": "p-2", "outcome": {"status": "success"},
          "messages": [{"role": "user", "content": f"card {SECRETS['card']}"}, {"role": "assistant", "content": "ok"}]}
    bad = ('{"trace_id": "p-3", "broken": "' + s + '"').encode()
    escaped = json.dumps({**ok, "trace_id": "p-4", "messages": [{"role": "user", "content": SECRETS["email"]},
                                                                 {"role": "assistant", "content": "k"}]},
                         ensure_ascii=True).replace("@", "\\u0040").encode()
    f = tmp_path / "pii.jsonl"
    f.write_bytes(b"\n".join([json.dumps(good).encode(), json.dumps(ok).encode(), bad, escaped]) + b"\n")
    summary = ingest_paths(cfg, store, arts, [f])
    assert summary.ingested == 3 and summary.quarantined == 1
    assert set(summary.redactions_by_rule) == set(SECRETS)
    store.close()
    blobs = [cfg.warehouse.read_bytes()] + [p.read_bytes() for p in Path(cfg.home).rglob("*") if p.is_file()]
    import pyarrow.parquet as pq

    texts = [str(pq.read_table(p).to_pylist()) for p in Path(cfg.artifacts_dir).rglob("*.parquet")]
    from flywheel.store import EventStore

    with EventStore(cfg.warehouse) as s2:
        texts.append(str(s2.con.execute("SELECT list(payload::VARCHAR) FROM events").fetchall()))
        texts.append(str(s2.con.execute("SELECT list(state::VARCHAR) FROM entities").fetchall()))
    for secret in SECRETS.values():
        for t in texts:
            assert secret not in t
        for blob in blobs:
            assert secret.encode() not in blob
    assert any("[REDACTED:email]" in t for t in texts)


def test_hex_identifiers_are_not_card_numbers():
    """A 32-hex-digit OTLP trace id or a ``chatcmpl-<hex>`` response id can hold a Luhn-valid run of
    13+ digits (this one was redacted before, and a trace id so redacted was replaced by a pseudonym)."""
    r = Redactor.from_config(IngestConfig())
    rid = "chatcmpl-7006a2870c6e4945958026843e7d031f"
    assert r.text(rid) == rid and r.text("trace 4945958026843e7d031f7006a2870c6e") == "trace 4945958026843e7d031f7006a2870c6e"
    assert r.text("card: 4111 1111 1111 1111.") == "card: [REDACTED:card]."

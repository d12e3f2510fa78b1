"""OTLP/JSON spans and log records -> trace records: OpenTelemetry GenAI (both generations) and OpenInference.

Input: OTLP/JSON export requests, one per line, as an OpenTelemetry Collector's file exporter writes
them (``{"resourceSpans": [...]}`` and/or ``{"resourceLogs": [...]}``; one file may mix both), or one
JSON document. Ids are lowercase hex as OTLP/JSON specifies; base64 ids (protobuf's generic JSON
mapping) are accepted too. Attributes are ``{key, value: {stringValue | intValue | doubleValue |
boolValue | arrayValue | kvlistValue | bytesValue}}``.

What is read (tested against spans and logs produced by the real packages: see
``tests/integration/test_otel_instrumentations.py``)
-----------------------------------------------------------------------------------------------
Conventions, per inference span (the conversation is taken from the *last* inference span that
carries content: each call records the full history it sent):

``genai-span`` (``opentelemetry-instrumentation-openai-v2`` >= 2.4 with ``span_only`` /
``span_and_event``; other GenAI instrumentations)
    span attributes ``gen_ai.input.messages``, ``gen_ai.output.messages``,
    ``gen_ai.system_instructions``, ``gen_ai.tool.definitions`` (JSON strings or structured values;
    parts ``text``, ``tool_call`` {id, name, arguments}, ``tool_call_response`` {id, response}).
``genai-details`` (openai-v2 >= 2.4 with ``event_only``)
    the same attributes on a ``gen_ai.client.inference.operation.details`` log record correlated to
    the span by trace and span id.
``genai-events`` (openai-v2 <= 2.3, content as log records)
    ``gen_ai.system.message``, ``gen_ai.user.message``, ``gen_ai.assistant.message``,
    ``gen_ai.tool.message`` (the input, in record order) and ``gen_ai.choice`` (the output; choice
    ``index`` 0 when ``n`` > 1) log records correlated by trace and span id; the event name is the
    record's ``eventName`` or its ``event.name`` attribute (older SDKs).
``openinference`` (``openinference-instrumentation-openai``, Arize Phoenix)
    ``llm.input_messages.N.message.{role, content, contents.M.message_content.text, name,
    tool_call_id, tool_calls.K.tool_call.{id, function.name, function.arguments}}``,
    ``llm.output_messages.*`` alike, ``llm.tools.N.tool.json_schema``, ``llm.invocation_parameters``,
    ``llm.token_count.{prompt, completion}``, ``llm.model_name``; errors from the span status and its
    ``exception`` event.
``genai-flattened`` (older instrumentations)
    ``gen_ai.prompt.N.*``, ``gen_ai.completion.N.*`` (+ ``tool_calls.M.*``),
    ``llm.request.functions.N.*``.

Kept as trace metadata (``metadata``): ``usage`` (input/output tokens summed over the trace's
inference calls), ``finish_reasons``, ``response_id``, ``request`` (temperature, max_tokens, top_p,
seed, ... of the last call), ``calls`` (per inference call: span, response id, model, finish reasons,
tokens) and ``otel`` (spans, service, provider, convention, instrumentation scope). Outcome: failure
when a span has status ERROR or ``error.type``; ``error`` = ``<type>: <message>`` from
``error.type`` / the ``exception`` event / the status message. Feedback from a
``gen_ai.evaluation.result`` span event.

When is a trace complete
------------------------
A file is scanned once before it is read (:func:`scan`, a regex over the raw bytes: ~1 GB/s) for
the last line that mentions each trace id; a trace is assembled right after that line, so spans and
log records of one trace may come in any order and on any lines of the file. Without a scan (a
single JSON document) every trace is assembled at the end.

Paired files: a file holding only log records (``resourceLogs``) is joined to the span-bearing OTLP
files given in the same ingest (a Collector with one file exporter per signal writes such pairs):
its GenAI records are held in memory (:class:`LogIndex`) while those files are read. Alone, it is
refused up front with a message that says where the spans are (:func:`plan_files`). Its own records
are then counted as joined, or quarantined ``otel_log_without_span`` when no span of their trace was
found.

Quarantine reasons
------------------
``otel_no_genai`` (no span is a GenAI inference call), ``otel_content_not_captured`` (GenAI spans
without any message content: the instrumentation's content capture is off; the detail names the
setting for each instrumentation), ``otel_log_without_span`` (GenAI log records whose spans are in
none of the files read), ``otel_nothing_to_read`` (an export request with neither spans nor log
records carrying a trace id), ``otel_late_span`` (a trace id met again after its trace was assembled:
only possible when the scan could not run), ``otel_unreadable`` (a span or record of an unexpected
shape, e.g. a ``status`` that is not an object; the detail names the error), ``otel_bad_value`` (a
value no mapping can read, e.g. a kvlist entry whose key is not a string: the line or trace holding it
is quarantined, also when it sits in a logs companion file; the other records go on).

Not supported: a trace's spans split across two span-bearing files (the first part is read, the
later one is a duplicate id); content uploaded elsewhere by reference (``gen_ai.input.messages.ref``);
several independent conversations in one trace (the last inference call's conversation is kept, the
other calls appear only in ``metadata.calls``); ``n`` > 1 choices beyond the first.
Memory: the scan keeps one small entry per trace id of the file; open traces are held until their
last line.

Where it lives: this module reads files (the scan, the pairing of span and log files, the
:class:`Assembler` that groups a file's records by trace and joins log-only companions);
:mod:`flywheel.ingest.otlp_decode` decodes OTLP/JSON, :mod:`flywheel.ingest.otlp_messages` maps each
convention's content to chat messages and :mod:`flywheel.ingest.otlp_trace` maps one trace's spans
and records to a trace record.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.ingest.formats import parse_json
from flywheel.ingest.otlp_decode import BadValue, LogRec, Problem, compact_log, iter_logs, iter_spans, norm_id
from flywheel.ingest.otlp_trace import to_trace
from flywheel.ingest.reader import iter_lines, open_binary

_TRACE_ID = re.compile(rb'"traceId"\s*:\s*"([^"]+)"')


@dataclass
class Scan:
    """What :func:`scan` learnt about a file without parsing it."""

    last_line: dict[str, int] = field(default_factory=dict)  # trace id -> last line mentioning it
    has_spans: bool = False
    has_logs: bool = False


def scan(path: Path, max_line_bytes: int) -> Scan:
    """One pass over the raw lines: the last line of every trace id, and which signals the file holds."""
    out = Scan()
    last = out.last_line
    with open_binary(path) as stream:
        try:
            for line in iter_lines(stream, max_line_bytes):
                if line.error or line.oversize:
                    continue
                data = line.data
                if not out.has_spans and b'"resourceSpans"' in data:
                    out.has_spans = True
                if not out.has_logs and b'"resourceLogs"' in data:
                    out.has_logs = True
                n = line.lineno
                for m in _TRACE_ID.findall(data):
                    tid = m.decode("ascii", "replace")
                    last[tid if len(tid) == 32 else norm_id(tid)] = n
        except (EOFError, OSError):  # a cut file: the line reader reports it when the file is read
            pass
    last.pop("", None)
    return out


def looks_like_otlp(path: Path) -> bool:
    """The first 64 KiB mention ``resourceSpans`` or ``resourceLogs`` (an OTLP/JSON file)."""
    try:
        with open_binary(path) as f:
            head = f.read(64 * 1024)
    except (EOFError, OSError):
        return False
    return b'"resourceSpans"' in head or b'"resourceLogs"' in head


class PairingError(ValueError):
    """A file of log records was given without any file holding their spans."""


def plan_files(paths: Sequence[Path], max_line_bytes: int) -> dict[Path, list[Path]]:
    """Companions of each OTLP file in one ingest: a span-bearing file gets the log-only files (to join
    their records), a log-only file gets the span-bearing files (to know which of its records were
    joined). Raises :class:`PairingError` when there are log-only files but no span-bearing one."""
    spans, logs_only = [], []
    for p in paths:
        s = scan_signals(p)
        if s == "logs":
            logs_only.append(p)
        elif s == "spans":
            spans.append(p)
    if logs_only and not spans:
        names = ", ".join(p.name for p in logs_only[:3]) + (" ..." if len(logs_only) > 3 else "")
        raise PairingError(
            f"{names}: only OTLP log records (resourceLogs), no spans. GenAI log records are joined to their "
            "spans by trace and span id, and the spans are exported separately (the tracer provider's exporter; "
            "a Collector's traces pipeline writes them to its own file): give the spans file in the same "
            "command, e.g. `flywheel ingest traces.jsonl logs.jsonl`, or a directory holding both")
    plan: dict[Path, list[Path]] = {}
    for p in spans:
        plan[p] = list(logs_only)
    for p in logs_only:
        plan[p] = list(spans)
    return plan


def scan_signals(path: Path) -> str:
    """``"spans"`` (the file holds spans, maybe logs too), ``"logs"`` (log records only) or ``""``."""
    has_spans = has_logs = False
    tail = b""
    try:
        with open_binary(path) as f:
            while chunk := f.read(1 << 22):
                buf = tail + chunk  # a key split across two reads is still found
                has_logs = has_logs or b'"resourceLogs"' in buf
                if b'"resourceSpans"' in buf:
                    has_spans = True
                    break
                tail = chunk[-32:]
    except (EOFError, OSError):
        pass
    return "spans" if has_spans else ("logs" if has_logs else "")


class LogIndex:
    """GenAI log records of log-only companion files, by trace id (held in memory while the span
    files are read; a trace's records are handed over once and forgotten)."""

    def __init__(self) -> None:
        self.by_trace: dict[str, list[LogRec]] = {}

    @classmethod
    def load(cls, paths: Sequence[Path], max_line_bytes: int) -> LogIndex:
        idx = cls()
        for p in paths:
            with open_binary(p) as stream:
                try:
                    for line in iter_lines(stream, max_line_bytes):
                        if line.error or line.oversize or not line.data.strip():
                            continue
                        obj, prob = parse_json(line.data)
                        if prob or not isinstance(obj, dict):
                            continue  # reported when the log file itself is read
                        for tid, lr, _ in iter_logs(obj):
                            try:
                                rec = compact_log(lr) if tid else None
                            except BadValue:
                                continue  # quarantined with its reason when the log file itself is read
                            if rec is not None:
                                idx.by_trace.setdefault(tid, []).append(rec)
                except (EOFError, OSError):
                    pass
        return idx

    def take(self, tid: str) -> list[LogRec]:
        return self.by_trace.pop(tid, [])


class Assembler:
    """Per-file state of the OTLP reader: spans and GenAI log records grouped by trace, handed out
    when a trace is complete (see the module docstring).

    ``path``: the file, scanned on first use for the last line of each trace (None: every trace is
    complete at the end). ``companions``: log-only files to join (for a span-bearing file), or the
    span-bearing files (for a log-only file).
    """

    def __init__(self, path: Path | None, companions: Sequence[Path], max_line_bytes: int) -> None:
        self.path = path
        self.companions = list(companions)
        self.max_line_bytes = max_line_bytes
        self._ready = False
        self._last: dict[str, int] = {}
        self._ends: dict[int, list[str]] = {}
        self._logs_only = False
        self._index: LogIndex | None = None
        self._span_tids: set[str] = set()
        self._open: dict[str, dict[str, Any]] = {}
        self._closed: set[str] = set()
        self.joined = 0  # log records of a log-only file whose spans are in a companion

    def _prepare(self) -> None:
        self._ready = True
        if self.path is not None:
            sc = scan(self.path, self.max_line_bytes)
            self._last = sc.last_line
            for tid, n in self._last.items():
                self._ends.setdefault(n, []).append(tid)
            self._logs_only = sc.has_logs and not sc.has_spans
        if self.companions:
            if self._logs_only:
                for p in self.companions:
                    self._span_tids.update(scan(p, self.max_line_bytes).last_line)
            else:
                self._index = LogIndex.load(self.companions, self.max_line_bytes)

    def line_weight(self, lineno: int) -> int:
        """How many traces end on line ``lineno`` (at least 1): batches are sized by traces, not lines
        (a Collector line holds hundreds)."""
        if not self._ready:
            self._prepare()
        return max(1, len(self._ends.get(lineno, ())))

    def _state(self, tid: str, line: Any) -> dict[str, Any]:
        st = self._open.get(tid)
        if st is None:
            st = self._open[tid] = {"spans": [], "logs": [], "line": line}
        return st

    def feed(self, obj: Any, line: Any) -> tuple[list[Problem], list[str]]:
        """Read one export request (the line ``line``). Returns (problems of the line, trace ids that
        are complete after it)."""
        if not self._ready:
            self._prepare()
        if not isinstance(obj, dict) or ("resourceSpans" not in obj and "resourceLogs" not in obj):
            return [("schema", "an OTLP line must be an export request with 'resourceSpans' or 'resourceLogs'")], \
                self._due(line.lineno)
        problems: list[Problem] = []
        n = 0
        try:
            for tid, sp, res, scope in iter_spans(obj):
                n += 1
                if tid in self._closed:
                    problems.append(("otel_late_span", f"span of trace {tid} after its trace was assembled"))
                    continue
                self._state(tid, line)["spans"].append((sp, res, scope))
        except BadValue as e:  # in a resource's attributes: the spans after it on this line are not read
            n += 1
            problems.append(("otel_bad_value", f"resource attributes: {e}"))
        for tid, lr, _ in iter_logs(obj):
            if not tid:
                continue
            n += 1
            try:
                rec = compact_log(lr)
            except BadValue as e:  # this record alone: the line is quarantined, its other records go on
                problems.append(("otel_bad_value", f"log record of trace {tid}: {e}"))
                continue
            if rec is None:
                continue
            if self._logs_only and tid in self._span_tids:
                self.joined += 1
                continue
            if tid in self._closed:
                problems.append(("otel_late_span", f"log record of trace {tid} after its trace was assembled"))
                continue
            self._state(tid, line)["logs"].append(rec)
        if n == 0:
            problems.append(("otel_nothing_to_read", "no span and no log record with a trace id in this export request"))
        return problems, self._due(line.lineno)

    def _due(self, lineno: int) -> list[str]:
        if not self._last:
            return []
        return [t for t in self._ends.pop(lineno, ()) if t in self._open]

    def line_of(self, tid: str) -> Any:
        """The line where the open trace ``tid`` started (where its problems are quarantined)."""
        return self._open[tid]["line"]

    def remaining(self) -> list[str]:
        """Trace ids still open (at the end of the file)."""
        return list(self._open)

    def take(self, tid: str) -> tuple[dict[str, Any] | None, Problem | None, Any]:
        """Assemble one trace: (record, problem, the line where it started)."""
        st = self._open.pop(tid)
        self._closed.add(tid)
        logs = st["logs"]
        if self._index is not None:
            logs = logs + self._index.take(tid)
        try:
            rec, prob = to_trace(tid, st["spans"], logs)
        except BadValue as e:
            rec, prob = None, ("otel_bad_value", f"trace {tid}: {e}"[:500])
        except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
            # A shape the mapping did not expect (a status that is not an object, ...): this trace is
            # quarantined with the reason, the rest of the file goes on.
            rec, prob = None, ("otel_unreadable", f"trace {tid}: {type(e).__name__}: {e}"[:500])
        if prob and prob[0] == "otel_log_without_span" and self._logs_only:
            where = ", ".join(p.name for p in self.companions[:3]) or "no span file"
            prob = (prob[0], prob[1].split(": spans and", 1)[0] + f": no span of this trace in the files given with "
                    f"it ({where}); spans and log records are exported separately (tracer and logger provider): "
                    "give the file with its spans in the same ingest")
        return rec, prob, st["line"]

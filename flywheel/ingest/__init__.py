"""Ingest of production traces: validate, quarantine, deduplicate, redact, classify failures.

Public API (the CLI and the Prefect flow call these):

- :func:`ingest_paths` ``(cfg, store, artifacts, paths, *, fmt="auto", correlation_id=None,
  progress=None) -> IngestSummary``
- :func:`replay_quarantine` ``(cfg, store, artifacts, *, correlation_id=None, progress=None) ->
  IngestSummary``: retry quarantined records after a fix.
- :func:`list_quarantine` / :func:`show_quarantine`: inspection.

See :mod:`flywheel.ingest.pipeline` for the guarantees, :mod:`flywheel.ingest.formats` for the input
formats, :mod:`flywheel.redact` and :mod:`flywheel.classify` for redaction and failure kinds. The
full redacted traces behind ``trace.ingested`` payloads are read back with
:func:`flywheel.artifacts.load_traces`.
"""

from flywheel.ingest.pipeline import (
    QUARANTINE_SCHEMA,
    TRACE_SCHEMA,
    IngestError,
    IngestRefused,
    IngestSummary,
    ingest_paths,
)
from flywheel.ingest.quarantine import list_quarantine, replay_quarantine, show_quarantine

__all__ = [
    "IngestError",
    "IngestRefused",
    "IngestSummary",
    "QUARANTINE_SCHEMA",
    "TRACE_SCHEMA",
    "ingest_paths",
    "list_quarantine",
    "replay_quarantine",
    "show_quarantine",
]

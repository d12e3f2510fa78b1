"""The event catalog: every event type the flywheel appends, in one place.

An event belongs to a *stream* (``trace:<id>``, ``suite:<name>``, ...). The *entity* an event is
about defaults to its stream; an event whose payload carries ``entity_id`` (for example
``model.registered`` on stream ``model:policy`` about ``model:policy/7``) names it explicitly.
The lineage graph has an edge from that entity to every entity id listed in the event's
``causation``.

Extend the catalog here; :func:`check_event` refuses types that are not listed so a typo cannot
create a stream nobody reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from flywheel.vocab.refs import ENTITY_KINDS, entity_kind

__all__ = ["CATALOG", "ENTITY_KINDS", "EventType", "UnknownEventType", "check_event", "entity_kind"]


@dataclass(frozen=True)
class EventType:
    name: str
    stream_prefix: str
    caused_by: str
    schema_version: int = 1


CATALOG: dict[str, EventType] = {
    e.name: e
    for e in [
        EventType("trace.ingested", "trace", "the ingest batch"),
        EventType("trace.quarantined", "quarantine", "the ingest batch"),
        EventType("ingest.completed", "ingest", "the input files (sha256)"),
        EventType("failure.classified", "failure", "traces"),
        EventType("eval.created", "eval", "failures (or a successful trace, for regression evals)"),
        EventType("suite.versioned", "suite", "evals"),
        EventType("env.versioned", "env", "suite versions, synth batches"),
        EventType("synth.batch_accepted", "synth", "env version, seed evals"),
        EventType("synth.batch_rechecked", "synth", "the held-out suite version it was checked against"),
        EventType("rollouts.published", "rollouts", "env versions, policy model"),
        EventType("preferences.published", "preferences", "the source evals (or synth batches) of its pairs"),
        EventType("training.completed", "run", "rollouts or demonstrations, base model"),
        EventType("model.registered", "model", "training run"),
        EventType("learning.decided", "learn", "the first-pass, arm and fold-in runs and models it compared"),
        EventType("eval.completed", "evaluation", "model version, suite version"),
        EventType("gate.decided", "gate", "model version, suite version, evaluations"),
        EventType("model.promoted", "deploy", "gate decision"),
        EventType("model.rolled_back", "deploy", "the user"),
        EventType("adapter.loaded", "serve", "an API call to a running server (adapter files by sha256)"),
        EventType("adapter.unloaded", "serve", "an API call, or the served base model changing"),
        EventType("cycle.started", "cycle", "schedule or user"),
        EventType("cycle.completed", "cycle", "the stage outputs"),
        EventType("stage.completed", "stage", "a cycle stage run on a work pool (cycle.pools): its summary, pool, worker"),
    ]
}


class UnknownEventType(ValueError):
    pass


def check_event(type_: str, stream: str) -> EventType:
    """Return the catalog entry for ``type_``; refuse unknown types and mismatched streams."""
    try:
        et = CATALOG[type_]
    except KeyError:
        raise UnknownEventType(f"event type {type_!r} is not in the catalog (flywheel/events.py)") from None
    if entity_kind(stream) != et.stream_prefix:
        raise UnknownEventType(
            f"event {type_!r} belongs on a '{et.stream_prefix}:' stream, not {stream!r}"
        )
    return et

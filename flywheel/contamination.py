"""Contamination: whether a task's request copies a protected request (the held-out suite and the
failures it came from, or the recorded synthetic tasks). Shared by the synth stage (a candidate must
not copy a held-out request) and the evals stage (a new held-out item must not be a copy of a
synthetic task some model was already trained on).

The checks, in order: the exact request (:func:`flywheel.dedup.exact_key`), a near duplicate (word
bigram Jaccard >= ``contamination_jaccard``, :class:`flywheel.dedup.NearDupIndex`), a shared long
n-gram (``contamination_ngram`` words, GPT-3's 13-gram check, :class:`flywheel.dedup.NgramOverlapIndex`),
and, when enabled, sentence-embedding similarity (:class:`flywheel.dedup.SemanticIndex`). Requests
are compared *regardless of tools and answers*: a held-out request with other values is still a
leak of the held-out template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from flywheel.artifacts import ArtifactStore
from flywheel.config import SynthConfig
from flywheel.dedup import NearDupIndex, NgramOverlapIndex, SemanticIndex, exact_key, normalize_text
from flywheel.store import Event, EventStore
from flywheel.versioning import Suite
from flywheel.vocab.messages import request_content_text

__all__ = ["Contamination", "contaminated_by_synthetic", "find_contamination", "protected_texts", "request_text",
           "synthetic_batches", "synthetic_tasks"]




def request_text(task: dict) -> str:
    """The user turns of the task's prompt, raw (normalise with :func:`flywheel.dedup.normalize_text`);
    the system turns when there is no user text. An agent's long system prompt is the same in every
    request: compared with it, every variant would look like a near-copy of every other (the same
    rule as the train/held-out split, :mod:`flywheel.split`)."""
    msgs = [m for m in (task.get("prompt") or {}).get("messages") or [] if isinstance(m, dict)]
    user = "\n".join(request_content_text(m.get("content")) for m in msgs if m.get("role") == "user")
    if user.strip():
        return user
    return "\n".join(request_content_text(m.get("content")) for m in msgs if m.get("role") == "system")


@dataclass(frozen=True)
class Contamination:
    """Why a task is contaminated: the protected id it copies, a reason naming the check, and the
    similarity where the check has one."""

    task_id: str
    matched: str
    reason: str
    similarity: float | None = None


def find_contamination(tasks: list[dict], protected: list[tuple[str, str]], *, jaccard_threshold: float,
                       ngram: int, semantic: SemanticIndex | None = None) -> dict[str, Contamination]:
    """``{task id: Contamination}`` for the tasks whose request is an exact or near duplicate of, shares
    a long n-gram with, or (optionally) is semantically close to a protected ``(id, request text)``."""
    if not protected or not tasks:
        return {}
    ids = [p[0] for p in protected]
    ptexts = [p[1] for p in protected]
    exact: dict[str, str] = {}
    for pid, text in protected:
        exact.setdefault(exact_key(text), pid)
    near = NearDupIndex(jaccard_threshold)
    near.add(ids, ptexts)
    grams = NgramOverlapIndex(ngram)
    grams.add(ids, ptexts)
    if semantic is not None:
        semantic.add(ids, ptexts)
    texts = [request_text(t) for t in tasks]
    near_hits = near.query(texts)
    gram_hits = grams.query(texts)
    sem_hits = semantic.query(texts) if semantic is not None else [[] for _ in tasks]
    out: dict[str, Contamination] = {}
    for i, t in enumerate(tasks):
        tid = t["task_id"]
        ek = exact_key(texts[i])
        if ek in exact:
            out[tid] = Contamination(tid, exact[ek], f"contaminates held-out {exact[ek]} (exact request)", 1.0)
        elif near_hits[i]:
            m = near_hits[i][0]
            out[tid] = Contamination(tid, str(m.key), f"contaminates held-out {m.key} (near-duplicate, jaccard "
                                     f"{m.jaccard:.2f})", m.jaccard)
        elif gram_hits[i] is not None:
            key, gram = gram_hits[i]
            out[tid] = Contamination(tid, str(key), f"contaminates held-out {key} (shares {len(gram.split())}-gram "
                                     f"'{gram[:80]}')")
        elif sem_hits[i]:
            m = sem_hits[i][0]
            out[tid] = Contamination(tid, str(m.key), f"contaminates held-out {m.key} (semantic, cosine "
                                     f"{m.jaccard:.3f})", m.jaccard)
    return out


def protected_texts(store: EventStore, suite: Suite) -> list[tuple[str, str]]:
    """(id, request text) of every held-out eval and of the failures they came from."""
    out: list[tuple[str, str]] = []
    for t in suite.tasks:
        out.append((t["task_id"], request_text(t)))
        fid = (t.get("metadata") or {}).get("origin_failure")
        if fid:
            ent = store.entity(fid)
            msgs = ((ent or {}).get("state") or {}).get("messages") or []
            text = request_text({"prompt": {"messages": msgs}})
            if text and normalize_text(text) != normalize_text(out[-1][1]):
                out.append((fid, text))
    return out


def synthetic_tasks(store: EventStore, artifacts: ArtifactStore, exclude_batch: str | None = None) -> list[dict]:
    return [t for _, tasks in synthetic_batches(store, artifacts, exclude_batch) for t in tasks]


def synthetic_batches(store: EventStore, artifacts: ArtifactStore, exclude_batch: str | None = None) -> list[tuple[Event, list[dict]]]:
    """(``synth.batch_accepted`` event, its accepted tasks) of every recorded batch."""
    out = []
    for ev in store.read(stream="synth:*", types="synth.batch_accepted"):
        if ev.payload.get("entity_id") == exclude_batch:
            continue
        ref = ev.payload.get("accepted_artifact") or {}
        tasks = []
        if ref.get("sha256") and ref.get("rows"):
            tbl = artifacts.read_table(ref["sha256"], columns=["task_json"])
            tasks = [json.loads(x) for x in tbl.column("task_json").to_pylist()]
        out.append((ev, tasks))
    return out


def contaminated_by_synthetic(store: EventStore, artifacts: ArtifactStore, items: list[dict], scfg: SynthConfig) -> dict[str, str]:
    """Which of ``items`` (eval tasks about to be held out) are exact, near or long-n-gram copies of a
    recorded synthetic task: ``{item task id: synthetic task id}``.

    The evals stage asks before a new item joins the held-out suite: a model already trained on a
    synthetic near-copy of it must not be gated on it (the same tests, the other way round, as
    :func:`flywheel.synth.decontaminate` applies to new candidates)."""
    if not items:
        return {}
    synthetic = synthetic_tasks(store, artifacts)
    if not synthetic:
        return {}
    protected = [(t["task_id"], request_text(t)) for t in synthetic]
    found = find_contamination(items, protected, jaccard_threshold=scfg.contamination_jaccard,
                               ngram=scfg.contamination_ngram)
    return {tid: c.matched for tid, c in found.items()}



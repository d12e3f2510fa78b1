"""The funnel's gates after generation: valid, solvable, unique, uncontaminated, and the optional
difficulty measurement. Each gate keeps what passes and returns a :class:`Rejection` (stage, kind,
reason, matched id) for the rest.

Validation (:func:`validate_candidates`)
----------------------------------------
- **valid**: the task-record contract (:func:`flywheel.tasks.validate_task`), the verifier spec
  (:func:`flywheel.verifiers.validate_spec`), a renderable reference, generator-reported problems,
  and the Great Expectations suite ``schemas/gx/synth_batch.json`` over the batch's feature rows
  (required fields, lengths in bounds, tools are valid JSON Schema, reference present); a row failing
  an expectation is rejected naming it.
- **solvable**: the reference answer, rendered exactly as the policy is trained to write it
  (:func:`flywheel.policy.format.render_answer`), must pass the task's own verifier.
- **difficulty** (optional, ``[synth] difficulty_samples = K > 0`` and a policy): the pass rate of
  K samples is recorded as ``metadata.difficulty = {pass_rate, k, policy, zero_advantage}`` (all
  pass or none pass: a GRPO group with zero advantage); ``difficulty_drop`` can drop such tasks.

Deduplication and decontamination (:mod:`flywheel.dedup` does the text work)
----------------------------------------------------------------------------
A task's **request** is its user turns (its system turns only when it has no user text: an agent's
system prompt is shared by all its requests), normalised (whitespace, case, punctuation, number
formatting). Against everything already in the training environment (seeds and every earlier
batch's accepted tasks) and the batch's own earlier accepted candidates:

- **exact duplicate**: same normalised request and same set of offered tools;
- **near duplicate**: word-bigram Jaccard >= ``near_dup_jaccard`` (MinHash LSH proposes, exact
  Jaccard confirms) *and* the same tools *and* the same expected answer (canonical calls). Why the
  answer: a mutation changes one value of a long request, leaving its Jaccard near 1, yet asks for
  a different call -- that is the point of the generator, not a duplicate;
- **semantic duplicate** (``semantic_dedup``): embedding cosine >= ``semantic_threshold``, same
  tools and answer.

Against the held-out suite (``suite:<cycle.heldout_suite>@latest``) and the failures those evals
came from, *regardless of tools and answers* (a held-out request with other values is still a
leak of the held-out template): exact request, near duplicate at ``contamination_jaccard``,
a shared long n-gram (``contamination_ngram`` words, GPT-3's 13-gram check), and the semantic check
when enabled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flywheel.contamination import find_contamination, request_text
from flywheel.dedup import NearDupIndex, SemanticIndex, exact_key
from flywheel.envs.harness import verify_task
from flywheel.policy.base import Policy, SamplingParams
from flywheel.policy.format import render_answer
from flywheel.schemas.gx_synth import candidate_features, tools_schema_valid, validate_synth_batch
from flywheel.synth.generators import Candidate
from flywheel.synth.keys import LIMITS, answer_key, synth_task_id, tool_key
from flywheel.tasks import TaskError, validate_task
from flywheel.verifiers import SpecError, VerifyContext, validate_spec
from flywheel.vocab import ToolCall

#: The gates in order; a batch records its count after each.
FUNNEL = ("generated", "valid", "solvable", "unique", "uncontaminated", "accepted")


@dataclass(frozen=True)
class Rejection:
    task_id: str
    seed_task: str
    generator: str
    stage: str  # the funnel stage it failed: valid | solvable | unique | uncontaminated | difficulty
    reason_kind: str  # invalid | unsolvable | duplicate | near_duplicate | semantic_duplicate | contaminated | too_easy | too_hard
    reason: str
    matched: str | None = None
    similarity: float | None = None



# ================================================================================ validation
def _reference_answer(task: dict) -> dict:
    ref = task["reference"]
    if isinstance(ref.get("tool_calls"), list):
        return {"role": "assistant", "content": render_answer([ToolCall(c["name"], c.get("arguments") or {})
                                                               for c in ref["tool_calls"]])}
    return {"role": "assistant", "content": render_answer(content=str(ref.get("content", "")))}


def _per_task_problems(c: Candidate) -> list[str]:
    problems = list(c.problems)
    t = c.task
    try:
        validate_task(t)
    except TaskError as e:
        problems.append(f"task record: {e}")
        return problems
    try:
        validate_spec(t["verifier"])
    except SpecError as e:
        problems.append(f"verifier spec: {e}")
    ok, why = tools_schema_valid(t["prompt"].get("tools") or [])
    if not ok:
        problems.append(why or "invalid tool schema")
    ref = t.get("reference")
    if not isinstance(ref, dict) or not (ref.get("tool_calls") or str(ref.get("content") or "").strip()):
        problems.append("no reference answer")
    else:
        try:
            _reference_answer(t)
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"reference cannot be rendered: {e}")
    if synth_task_id(t) != t["task_id"]:
        problems.append("task_id is not the content hash of the task")
    return problems


def validate_candidates(cands: list[Candidate], generator_names: Sequence[str]) -> tuple[list[Candidate], list[Rejection], dict]:
    """Per-task checks plus the GX suite over the batch. Returns (valid, rejections, GX summary)."""
    rows = [candidate_features(c.task) for c in cands]
    values = {"generators": sorted(set(generator_names)), **LIMITS}
    success, per_row, report = validate_synth_batch(rows, values)
    valid, rejected = [], []
    for i, c in enumerate(cands):
        problems = _per_task_problems(c)
        problems += [f"GX {x}" for x in per_row.get(i, [])]
        if problems:
            rejected.append(_reject(c, "valid", "invalid", "invalid: " + "; ".join(problems)))
        else:
            valid.append(c)
    return valid, rejected, {"success": success, "failed_expectations": report}


def _reject(c: Candidate, stage: str, kind: str, reason: str, matched: str | None = None,
            similarity: float | None = None) -> Rejection:
    return Rejection(c.task_id, c.seed_ids[0] if c.seed_ids else "", c.generator, stage, kind, reason, matched,
                     None if similarity is None else round(float(similarity), 4))


def check_solvable(task: dict, context: VerifyContext | None = None) -> tuple[bool, str]:
    """(passed, why): the reference, rendered as the policy writes answers, must pass the task's
    own verifier. An infrastructure error is not a pass."""
    answer = _reference_answer(task)
    v = verify_task(task, [*task["prompt"]["messages"], answer], context)
    if v.infra_error:
        return False, f"unverifiable: verifier infrastructure error ({v.infra_error})"
    if not v.passed:
        comps = ", ".join(f"{k}={x:.2f}" for k, x in sorted(v.components.items()))
        return False, f"reference fails its verifier ({comps})"
    return True, "ok"


# ================================================================================ dedup / decontamination
def dedup_candidates(cands: list[Candidate], reference_tasks: list[dict], *, threshold: float,
                     semantic: SemanticIndex | None = None) -> tuple[list[Candidate], list[Rejection]]:
    """Drop exact, near and (optionally) semantic duplicates of ``reference_tasks`` and of earlier
    candidates in the list (see the module docstring for the definitions). Order-preserving."""
    by_exact: dict[str, str] = {}
    info: dict[str, tuple[str, str | None]] = {}  # task id -> (tool key, answer key)
    near = NearDupIndex(threshold)
    ref_ids = [t["task_id"] for t in reference_tasks]
    ref_texts = [request_text(t) for t in reference_tasks]
    for t, text in zip(reference_tasks, ref_texts, strict=True):
        by_exact.setdefault(exact_key(text) + "|" + tool_key(t), t["task_id"])
        info[t["task_id"]] = (tool_key(t), answer_key(t))
    if ref_ids:
        near.add(ref_ids, ref_texts)
        if semantic is not None:
            semantic.add(ref_ids, ref_texts)
    kept, rejected = [], []
    texts = [request_text(c.task) for c in cands]
    # Near matches against the reference set in one vectorised query; matches against earlier
    # candidates of this batch come from a second index that grows as candidates are kept.
    ref_matches = near.query(texts) if ref_ids else [[] for _ in cands]
    batch_near = NearDupIndex(threshold)
    for i, c in enumerate(cands):
        t = c.task
        tk, ak = tool_key(t), answer_key(t)
        ek = exact_key(texts[i]) + "|" + tk
        if ek in by_exact:
            rejected.append(_reject(c, "unique", "duplicate", f"duplicate-of {by_exact[ek]}", by_exact[ek], 1.0))
            continue
        matches = list(ref_matches[i])
        if len(batch_near):
            matches += batch_near.query([texts[i]])[0]
        hit = next((m for m in sorted(matches, key=lambda m: -m.jaccard)
                    if info.get(str(m.key)) == (tk, ak)), None)
        if hit is not None:
            rejected.append(_reject(c, "unique", "near_duplicate",
                                    f"near-duplicate-of {hit.key} (jaccard {hit.jaccard:.2f})", str(hit.key), hit.jaccard))
            continue
        if semantic is not None and len(semantic.keys):
            sem = next((m for m in semantic.query([texts[i]])[0] if info.get(str(m.key)) == (tk, ak)), None)
            if sem is not None:
                rejected.append(_reject(c, "unique", "semantic_duplicate",
                                        f"semantic-duplicate-of {sem.key} (cosine {sem.jaccard:.3f})", str(sem.key),
                                        sem.jaccard))
                continue
        kept.append(c)
        by_exact[ek] = t["task_id"]
        info[t["task_id"]] = (tk, ak)
        batch_near.add([t["task_id"]], [texts[i]])
        if semantic is not None:
            semantic.add([t["task_id"]], [texts[i]])
    return kept, rejected


def decontaminate(cands: list[Candidate], protected: list[tuple[str, str]], *, jaccard_threshold: float,
                  ngram: int, semantic: SemanticIndex | None = None) -> tuple[list[Candidate], list[Rejection]]:
    """Drop candidates whose request is an exact or near duplicate of, shares a long n-gram with,
    or (optionally) is semantically close to any protected ``(id, request text)``
    (:func:`flywheel.contamination.find_contamination`)."""
    found = find_contamination([c.task for c in cands], protected, jaccard_threshold=jaccard_threshold,
                               ngram=ngram, semantic=semantic)
    kept, rejected = [], []
    for c in cands:
        hit = found.get(c.task_id)
        if hit is None:
            kept.append(c)
        else:
            rejected.append(_reject(c, "uncontaminated", "contaminated", hit.reason, hit.matched, hit.similarity))
    return kept, rejected


# ================================================================================ difficulty
def measure_difficulty(cands: list[Candidate], policy: Policy, k: int, *, max_new_tokens: int, temperature: float,
                       seed: int, context: VerifyContext | None = None) -> None:
    """Set ``metadata.difficulty`` on every candidate from ``k`` policy samples."""
    if not cands:
        return
    params = SamplingParams(n=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    samples = policy.generate([c.task["prompt"]["messages"] for c in cands], params,
                              tools=[c.task["prompt"].get("tools") or [] for c in cands])
    pol = f"{getattr(policy, 'name', '?')}@{getattr(policy, 'version', '?')}"
    for c, group in zip(cands, samples, strict=True):
        passed = 0
        scored = 0
        for s in group:
            v = verify_task(c.task, [*c.task["prompt"]["messages"], {"role": "assistant", "content": s.text}], context)
            if v.infra_error:
                continue
            scored += 1
            passed += int(v.passed)
        rate = passed / scored if scored else None
        c.task["metadata"]["difficulty"] = {
            "pass_rate": rate, "k": k, "scored": scored, "policy": pol,
            "zero_advantage": rate in (0.0, 1.0),
        }

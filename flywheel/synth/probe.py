"""The probe that aims the synthesis: decode a policy greedily on train-side tasks, let each task's
own verifier grade the answer, name what went wrong, and plan how many variants each generator gets.

Torch-free: the policy is reached through :class:`flywheel.policy.base.Policy` only.

Error kinds (:data:`ERROR_KINDS`; one *primary* kind per failed answer, the first of this order
that applies; every kind that applies is kept per task)
------------------------------------------------------------------------------------------------
``unparseable``
    the answer holds call-shaped text the verifier's parser cannot read (truncated, invalid
    Python/JSON): the verdict's ``parse_errors``. One exception: an answer whose only parse error is
    an argument given twice in one call (``f(city='Berlin', city='Moscow')``) lists several items in
    one call where one call per item was due: that is ``missing_call``, and what it needs to learn is
    the count (one call per item), not the syntax.
``unexpected_call``
    no call was due (``expected == []``: an irrelevance task) and the answer made one.
``wrong_function``
    a call names a function the expected answer does not call in its place: another offered tool
    (the wrong function among many) or one that is not offered at all.
``missing_call``
    fewer calls than expected (prose with no call at all included), every call made being right
    by name.
``extra_call``
    more calls than expected (when the verifier does not allow extra calls).
``missing_argument``
    a call of the right function omits an argument the expected call requires.
``extra_argument``
    a call of the right function passes an argument the expected call does not mention.
``wrong_value``
    a call of the right function passes a value the verifier does not accept: a wrong value, or
    the right one in the wrong format ("Tel Aviv" where the description asks "City, Country").
``other``
    the verdict failed for none of these reasons (a verifier kind other than ``tool_call``, calls
    in the wrong order under ``order_sensitive``).

A verdict with an infrastructure error is not a model failure: :func:`classify_answer` returns
:data:`UNSCORED` and the report counts it apart.

How the kinds are found: :func:`flywheel.envs.harness.verify_task` grades the answer (pass/fail,
parse errors, the parsed calls); the failing calls are then paired with the expected ones by
function name (the verifier's name resolution, ``a_b`` for ``a.b``) and each pair's arguments
compared with the verifier's own rules (:func:`flywheel.verifiers.matching.values_equal`,
``one_of``/``optional`` from :func:`~flywheel.verifiers.matching.normalize_expected`).

Planning (:func:`plan_generators`, mapping :data:`KIND_TO_GENERATORS`)
---------------------------------------------------------------------
========================  ==========================================================
error kind                generators (share of that kind's weight)
========================  ==========================================================
wrong_value               schema_values 0.75, mutate 0.25
missing_argument          schema_values 0.5, mutate 0.5
extra_argument            masked_names 0.5, mutate 0.5
wrong_function            distractor 0.5, masked_names 0.5
missing_call              parallel 1.0
extra_call                mutate 1.0 (requests answered with the calls they need and no more)
unexpected_call           irrelevance 1.0
unparseable, other        mutate 1.0 (more demonstrations of the call syntax)
========================  ==========================================================

``extra_call`` went to ``parallel`` at first: a model that makes more calls than were
due was given more requests answered with several calls. On seed 1 of
``benchmarks/bench_flywheel_vs_sft.py`` the probe counted 4 extra calls of 13 failures, and the shipped
model made 30 extra calls on the 234 unseen single-call questions (``simple_python``, ``multiple``)
against plain SFT's 23. ``mutate`` re-asks a request with other values and keeps its shape, so its
variants are answered with as many calls as their seeds.

Each generator's weight is the sum over kinds of (primary count x share); the budget is split in
proportion after a floor (``floor`` x budget, at least one variant when the budget allows) for
every planned generator, so a generator the probe does not ask for still gets a few variants (a
probe of a few dozen tasks misses rare kinds). With no failure at all the budget is split evenly.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flywheel.envs.harness import verify_task
from flywheel.policy.base import Policy, SamplingParams
from flywheel.verifiers import VerifyContext
from flywheel.verifiers.matching import _resolve_name, normalize_expected, tool_index, values_equal

__all__ = ["ERROR_KINDS", "KIND_TO_GENERATORS", "PLANNED_GENERATORS", "UNSCORED", "ProbeReport", "answer_kinds",
           "classify_answer", "largest_remainder", "plan_generators", "probe_counts", "run_probe"]

#: Error kinds in priority order (the module docstring defines each).
ERROR_KINDS = ("unparseable", "unexpected_call", "wrong_function", "missing_call", "extra_call",
               "missing_argument", "extra_argument", "wrong_value", "other")

#: What :func:`classify_answer` returns when the verifier could not judge (infrastructure error).
UNSCORED = "unscored"

#: Error kind -> {generator: share of that kind's weight}; see the module docstring.
KIND_TO_GENERATORS: dict[str, dict[str, float]] = {
    "wrong_value": {"schema_values": 0.75, "mutate": 0.25},
    "missing_argument": {"schema_values": 0.5, "mutate": 0.5},
    "extra_argument": {"masked_names": 0.5, "mutate": 0.5},
    "wrong_function": {"distractor": 0.5, "masked_names": 0.5},
    "missing_call": {"parallel": 1.0},
    "extra_call": {"mutate": 1.0},
    "unexpected_call": {"irrelevance": 1.0},
    "unparseable": {"mutate": 1.0},
    "other": {"mutate": 1.0},
}

#: The generators :func:`plan_generators` plans by default (every target of the mapping; not
#: ``paraphrase``, which needs a policy).
PLANNED_GENERATORS = ("schema_values", "masked_names", "distractor", "parallel", "irrelevance", "mutate")

_ORDER = {k: i for i, k in enumerate(ERROR_KINDS)}

#: A parse error that only says an argument was given twice in one call (Python's and the parser's words).
_REPEATED_ARG = re.compile(r"keyword argument repeated|argument '[^']*' given twice")


def _answer_message(answer_text: str) -> dict:
    return {"role": "assistant", "content": answer_text}


def _call_kinds(calls: list[dict], spec: dict) -> set[str]:
    """Kinds of a failed, parsed answer against a ``tool_call`` spec with expected calls."""
    index = tool_index(spec.get("tools") or [])
    expected = normalize_expected(spec["expected"])
    kinds: set[str] = set()
    got = [(_resolve_name(str(c.get("name", "")), index), c.get("arguments") or {}) for c in calls]
    unused = list(range(len(got)))
    unpaired_exp = 0
    for name, args in expected:
        props = (index.get(name) or {}).get("properties") or {}

        def agree(a: dict, args: dict = args, props: dict = props) -> int:
            return sum(1 for k, (allowed, _) in args.items()
                       if k in a and any(values_equal(a[k], x, props.get(k), bool(spec.get("normalize_strings", True)))
                                         for x in allowed))

        same = [i for i in unused if got[i][0] == name]
        if not same:
            unpaired_exp += 1
            continue
        i = max(same, key=lambda j: agree(got[j][1]))
        unused.remove(i)
        a = got[i][1]
        for k, (allowed, optional) in args.items():
            if k not in a:
                if not optional:
                    kinds.add("missing_argument")
            elif not any(values_equal(a[k], x, props.get(k), bool(spec.get("normalize_strings", True)))
                         for x in allowed):
                kinds.add("wrong_value")
        if any(k not in args for k in a):
            kinds.add("extra_argument")
    extra_calls = len(unused)
    if unpaired_exp and extra_calls:
        kinds.add("wrong_function")
        # Calls beyond the wrong ones still count as a shape error.
        if extra_calls > unpaired_exp and not spec.get("allow_extra_calls", False):
            kinds.add("extra_call")
        elif unpaired_exp > extra_calls:
            kinds.add("missing_call")
    elif unpaired_exp:
        kinds.add("missing_call")
    elif extra_calls and not spec.get("allow_extra_calls", False):
        kinds.add("extra_call")
    if any(index and n not in index for n, _ in got):
        kinds.add("wrong_function")
    return kinds


def answer_kinds(task: dict, answer_text: str, context: VerifyContext | None = None) -> list[str] | None:
    """Every error kind of ``answer_text`` for ``task`` in :data:`ERROR_KINDS` order; ``None`` when
    it passes, ``[UNSCORED]`` when the verifier could not judge."""
    v = verify_task(task, [*task["prompt"]["messages"], _answer_message(answer_text)], context)
    if v.infra_error:
        return [UNSCORED]
    if v.passed:
        return None
    spec = task["verifier"]
    if spec.get("kind") != "tool_call":
        return ["other"]
    errors = v.details.get("parse_errors") or []
    if errors:
        if spec.get("expected") and all(_REPEATED_ARG.search(str(e)) for e in errors):
            return ["missing_call"]  # several items squeezed into one call (module docstring)
        return ["unparseable"]
    calls = [json.loads(c) for c in v.details.get("calls") or []]
    expected = spec.get("expected")
    kinds: set[str] = set()
    if expected is None:  # a weak spec: only schema validity was checked
        index = tool_index(spec.get("tools") or [])
        if not calls:
            kinds.add("missing_call")
        for c in calls:
            name = _resolve_name(str(c.get("name", "")), index)
            if index and name not in index:
                kinds.add("wrong_function")
                continue
            schema = index.get(name) or {}
            args = c.get("arguments") or {}
            props = schema.get("properties") or {}
            if any(r not in args for r in schema.get("required") or []):
                kinds.add("missing_argument")
            if props and any(k not in props for k in args):
                kinds.add("extra_argument")
        if calls and not kinds:
            kinds.add("wrong_value")  # a type or enum violation
    elif not expected:
        kinds.add("unexpected_call")
    elif not calls:
        kinds.add("missing_call")
    else:
        kinds |= _call_kinds(calls, spec)
    return sorted(kinds or {"other"}, key=_ORDER.__getitem__)


def classify_answer(task: dict, answer_text: str, context: VerifyContext | None = None) -> str | None:
    """The primary error kind of ``answer_text`` as the answer to ``task`` (the first of
    :data:`ERROR_KINDS` that applies), ``None`` when the task's verifier passes it, and
    :data:`UNSCORED` when the verifier could not judge."""
    kinds = answer_kinds(task, answer_text, context)
    return None if kinds is None else kinds[0]


@dataclass
class ProbeReport:
    """What a probe found.

    ``counts``: primary kind -> failed answers (every kind of :data:`ERROR_KINDS`, zeros included);
    ``all_counts``: kind -> answers showing it at all (an answer can show several);
    ``per_task``: task id -> its kinds in priority order (``[]`` = passed; ``[UNSCORED]`` = not
    judged); ``total`` = answers probed, ``scored`` = judged, ``passed``, ``failed``;
    ``shares``: primary kind -> share of the failed answers.
    """

    total: int
    scored: int
    passed: int
    failed: int
    counts: dict[str, int]
    all_counts: dict[str, int]
    per_task: dict[str, list[str]] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)

    @property
    def pass_rate(self) -> float | None:
        return self.passed / self.scored if self.scored else None

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "scored": self.scored, "passed": self.passed, "failed": self.failed,
                "pass_rate": self.pass_rate, "counts": dict(self.counts), "all_counts": dict(self.all_counts),
                "shares": dict(self.shares), "per_task": {k: list(v) for k, v in self.per_task.items()}}


def probe_counts(tasks: Sequence[dict], answers: Sequence[str], context: VerifyContext | None = None) -> ProbeReport:
    """Classify ``answers[i]`` as the answer to ``tasks[i]`` and count the kinds."""
    if len(tasks) != len(answers):
        raise ValueError(f"{len(tasks)} tasks but {len(answers)} answers")
    counts: Counter[str] = Counter()
    all_counts: Counter[str] = Counter()
    per_task: dict[str, list[str]] = {}
    passed = unscored = 0
    for t, a in zip(tasks, answers, strict=True):
        kinds = answer_kinds(t, a, context)
        if kinds is None:
            passed += 1
            per_task[t["task_id"]] = []
        elif kinds == [UNSCORED]:
            unscored += 1
            per_task[t["task_id"]] = [UNSCORED]
        else:
            counts[kinds[0]] += 1
            all_counts.update(kinds)
            per_task[t["task_id"]] = kinds
    failed = sum(counts.values())
    return ProbeReport(
        total=len(tasks), scored=len(tasks) - unscored, passed=passed, failed=failed,
        counts={k: counts.get(k, 0) for k in ERROR_KINDS}, all_counts={k: all_counts.get(k, 0) for k in ERROR_KINDS},
        per_task=per_task, shares={k: (counts.get(k, 0) / failed if failed else 0.0) for k in ERROR_KINDS},
    )


def run_probe(policy: Policy, tasks: Sequence[dict], *, max_new_tokens: int, context: VerifyContext | None = None,
              batch_size: int = 16) -> ProbeReport:
    """Decode ``policy`` greedily (``n=1``, temperature 0) on every task's prompt with its tools,
    and :func:`probe_counts` the answers. ``batch_size`` prompts per ``generate`` call."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    answers: list[str] = []
    tasks = list(tasks)
    for i in range(0, len(tasks), max(1, batch_size)):
        chunk = tasks[i:i + max(1, batch_size)]
        out = policy.generate([t["prompt"]["messages"] for t in chunk], params,
                              tools=[t["prompt"].get("tools") or [] for t in chunk])
        answers += [group[0].text if group else "" for group in out]
    return probe_counts(tasks, answers, context)


def plan_generators(report: ProbeReport | dict[str, int], budget: int, *, floor: float = 0.05,
                    generators: Sequence[str] | None = None) -> dict[str, int]:
    """Variants per generator for a batch of ``budget`` variants, following the probe's primary
    counts through :data:`KIND_TO_GENERATORS` (``report`` may also be the counts themselves).

    Every generator of ``generators`` (default :data:`PLANNED_GENERATORS`) first gets
    ``max(1, floor(floor * budget))`` variants while the budget allows (in that order), the rest
    goes in proportion to the weights (largest remainder, ties in ``generators`` order). The values
    sum to ``budget``; a mapping target not in ``generators`` passes its weight to nobody (the
    others share the budget)."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    counts = report.counts if isinstance(report, ProbeReport) else dict(report)
    unknown = sorted(set(counts) - set(ERROR_KINDS))
    if unknown:
        raise ValueError(f"unknown error kind(s) {unknown}; known: {list(ERROR_KINDS)}")
    names = list(dict.fromkeys(generators if generators is not None else PLANNED_GENERATORS))
    if not names:
        raise ValueError("no generators to plan")
    plan = dict.fromkeys(names, 0)
    left = budget
    each = max(1, math.floor(floor * budget)) if floor > 0 else 0
    for n in names:
        give = min(each, left)
        plan[n] += give
        left -= give
    weight = dict.fromkeys(names, 0.0)
    for kind, c in counts.items():
        for g, share in KIND_TO_GENERATORS[kind].items():
            if g in weight:
                weight[g] += c * share
    total_w = sum(weight.values())
    if total_w <= 0:
        weight = dict.fromkeys(names, 1.0)
        total_w = float(len(names))
    if left > 0:
        split = largest_remainder(left, {n: weight[n] for n in names})
        for n in names:
            plan[n] += split[n]
    return plan


def largest_remainder(total: int, weights: dict[str, float]) -> dict[str, int]:
    """``total`` split in proportion to ``weights`` (positive sum): each key gets the floor of its exact share,
    and the units left go to the largest remainders, ties in ``weights``' order. The values sum to ``total``."""
    names = list(weights)
    whole = sum(weights.values())
    exact = {n: total * weights[n] / whole for n in names}
    out = {n: math.floor(x) for n, x in exact.items()}
    order = sorted(names, key=lambda n: (-(exact[n] - out[n]), names.index(n)))
    for n in order[: total - sum(out.values())]:
        out[n] += 1
    return out

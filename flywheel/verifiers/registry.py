"""Verifiers: ``verify(spec, trajectory) -> Verdict``, the reward of every eval, environment and rollout.

A task stores a JSON spec ``{"kind": <kind>, ...params}``; :func:`verify` grades the model's trajectory
(OpenAI chat messages it produced) against it. The graded answer is the **last assistant message**
unless a kind says otherwise.

Kinds and parameters (defaults in brackets)
-------------------------------------------
- ``tool_call``: ``tools`` (OpenAI tool specs), ``expected`` (list of ``{name, arguments: {param:
  literal | {"one_of": [...], "optional": bool}}}`` or None), ``order_sensitive`` [False],
  ``allow_extra_calls`` [False], ``normalize_strings`` [True], ``scope`` ["last" | "all": calls of
  every assistant message]. Components ``parseable``, ``valid_schema``, ``function_names``,
  ``required_args``, ``values`` (partial credit in [0, 1]); ``passed`` is the full match. With
  ``expected=None`` only schema validity is checked and ``details["weak"] = True``. Matching rules:
  :mod:`flywheel.verifiers.matching`; parsing: :mod:`flywheel.vocab.toolcalls`.
- ``json_schema``: ``schema``; ``source`` ["auto": the tool-call arguments when the message has exactly
  one call, else the text]. The text (or its fenced ```json block) must parse as strict JSON (no NaN, no
  duplicate keys) and validate. Components ``parseable``, ``valid``.
- ``exact``: ``expected`` (string or list of acceptable strings), ``normalize`` [True: Unicode NFKC,
  case-folded, whitespace collapsed]; without normalize only surrounding whitespace is stripped.
- ``numeric``: ``expected``, ``rel_tol`` [1e-6], ``abs_tol`` [1e-9], ``strict`` [False]. The number is
  the whole answer, else ``\\boxed{..}``, else an ``answer: X`` line, else the last number in the text
  (``strict`` accepts only the whole answer). Accepts ``1,234.5``, ``-3e-2``, ``3/4``.
- ``regex``: ``pattern``, ``fullmatch`` [False], ``flags`` [list of ``re`` flag names]. Patterns are
  trusted; candidates longer than 100k characters fail (a bound on backtracking time).
- ``python_tests``: ``tests`` (Python source importing ``solution``), ``site_packages`` [False],
  ``grading`` ["auto" | "io" | "proxy"; "in_process" is proxy's former name]. The candidate is the
  last fenced ```python block, else the last fenced block, else the whole text. Sandboxed
  (:mod:`flywheel.sandbox`): tests that are input -> expected-output checks (``assert f(1, 'a') ==
  [2]``, :mod:`flywheel.io_grading`) are judged outside the sandbox (``io``), any others run in a
  process of their own against a proxy of the candidate (``proxy``: never in the candidate's
  interpreter); "io" makes other tests a :class:`SpecError`. ``details["isolation"]["grading"]`` says which path graded it.
  Component ``tests`` = share passed.
- ``shell``: ``command`` (the trusted grading script; exit 0 = pass). The candidate script is the last
  fenced ```bash/```sh block, else the last fenced block, else the whole text. Sandboxed; the grader
  runs as another uid from an empty directory and finds the candidate's files, read-only, in ``$WORK``.
- ``llm_judge``: ``rubric``, ``reference`` [None], ``pass_threshold`` [0.5]. POSTs to
  ``{judge.base_url}/chat/completions`` (``/v1`` is appended when the URL lacks it); the judge answers
  with a score in [0, 1] (``SCORE: 0.8`` or JSON ``{"score": 0.8}``; 0-10 scales are divided by 10).
  ``deterministic=False``. HTTP 429, 5xx and connection errors are retried (4 times, jittered backoff,
  ``Retry-After`` honoured: :func:`flywheel.net.request_with_retries`, the policy client's policy)
  before they become infrastructure errors naming the URL and the last status. A reply without a
  parseable score (a judge talked out of scoring by the answer it grades) and a request the endpoint
  refuses for its content (HTTP 400, 413, 422; never retried) are *failures* (reward 0,
  ``details["judge_error"]``): the answer may have caused them, so they must cost the side that
  produced it rather than drop the item from a comparison.
- ``composite``: ``parts`` (``[{weight, spec}]``), ``pass_rule`` ["all" | "weighted"], ``threshold``
  [1.0 for weighted]. Reward = weighted mean of part rewards; components are prefixed ``<i>.<kind>.``.
- ``reward_mode`` ["binary" | "partial"] on any kind: the reward is ``float(passed)`` by default, or
  the kind's partial-credit score (mean of its components) with "partial". Binary is the default because
  partial credit is easier to game (a call with the right name and garbage arguments scores 0.4).

Infrastructure errors
---------------------
When the verifier could not judge (sandbox did not start or has no isolation on this machine, judge
endpoint unreachable, timed out, 5xx/429/401/403/404, or a reply that is not a chat completion), the
verdict has ``infra_error`` set, ``reward = 0.0`` and ``ok_for_training = False``. **Consumers must check ``ok_for_training`` (or ``infra_error``) and drop or
retry such samples; never read their reward as a candidate failure.** The reward stays a finite 0.0
(not NaN) so that arithmetic over a batch never poisons other rows by accident; the flag carries the
meaning. A malformed *spec* is a bug in the task, not in the candidate: :class:`SpecError` is raised
(use :func:`validate_spec` when a task is created).

Verdicts that must not become training data
-------------------------------------------
A sandboxed verdict from a weak sandbox (``sandbox.allow_weak`` on a machine without namespaces) is a
real verdict -- it counts in evaluation -- but the candidate could have forged it, so
``not_for_training`` says why and ``ok_for_training`` is False unless ``sandbox.train_on_weak``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flywheel.config import JudgeConfig, SandboxConfig
from flywheel.vocab.errors import InfraError

if TYPE_CHECKING:
    import httpx

# The package (flywheel.verifiers) re-exports these with the vocabulary names verifiers work with.
__all__ = ["KINDS", "SpecError", "Verdict", "VerifyContext", "register_verifier", "validate_spec", "verify"]


class SpecError(ValueError):
    """The task's verifier spec is malformed (names the kind and the field)."""


@dataclass(frozen=True)
class Verdict:
    """The result of grading one trajectory.

    ``reward`` in [0, 1]; ``passed`` is the binary full success; ``components`` are partial-credit
    scores in [0, 1] reported separately; ``infra_error`` set means the verifier could not judge
    (reward 0.0 and meaningless, see :attr:`ok_for_training`); ``deterministic`` False for judges;
    ``not_for_training`` set means the verdict is real but the candidate could have forged it (a weak
    sandbox), so it must not become a training signal.
    """

    reward: float
    passed: bool
    components: dict[str, float]
    infra_error: str | None = None
    deterministic: bool = True
    details: dict = field(default_factory=dict)
    not_for_training: str | None = None

    @property
    def ok_for_training(self) -> bool:
        """False when the verdict reflects an infrastructure failure, not the candidate, or when it
        came from a sandbox the candidate could have forged (see ``not_for_training``)."""
        return self.infra_error is None and self.not_for_training is None


@dataclass
class VerifyContext:
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    http_client: httpx.Client | None = None  # the judge's; a short-lived one is made per call when None


VerifierFn = Callable[[dict, list[dict], VerifyContext], Verdict]
SpecCheck = Callable[[dict], None]
_REGISTRY: dict[str, VerifierFn] = {}
KINDS = _REGISTRY
# kind -> (fields the spec must have, a check of the rest raising SpecError); filled by register_verifier
_SPEC_RULES: dict[str, tuple[tuple[str, ...], SpecCheck | None]] = {}


def register_verifier(
    kind: str, *, required: tuple[str, ...] = (), check: SpecCheck | None = None
) -> Callable[[VerifierFn], VerifierFn]:
    """Decorator adding a verifier kind: ``fn(spec, trajectory, context) -> Verdict``.

    ``required`` names the spec fields :func:`validate_spec` insists on; ``check(spec)`` validates the
    rest without grading anything (raises :class:`SpecError`)."""

    def deco(fn: VerifierFn) -> VerifierFn:
        if kind in _REGISTRY and _REGISTRY[kind] is not fn:
            raise ValueError(f"verifier kind {kind!r} is already registered")
        _REGISTRY[kind] = fn
        _SPEC_RULES[kind] = (tuple(required), check)
        return fn

    return deco


def verify(spec: dict, trajectory: list[dict], *, context: VerifyContext | None = None) -> Verdict:
    """Grade ``trajectory`` against ``spec``. Raises :class:`SpecError` for a malformed spec; every
    candidate-side problem (no answer, malformed output, crashes) is a failed verdict, and every
    infrastructure problem a verdict with ``infra_error``."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise SpecError(f"verifier spec must be an object with a 'kind', got {spec!r:.200}")
    kind = spec["kind"]
    fn = _REGISTRY.get(kind)
    if fn is None:
        raise SpecError(f"unknown verifier kind {kind!r}; known: {sorted(_REGISTRY)}")
    if not isinstance(trajectory, list):
        raise SpecError("trajectory must be a list of chat messages")
    ctx = context or VerifyContext()
    try:
        v = fn(spec, trajectory, ctx)
    except InfraError as e:
        return Verdict(0.0, False, {}, infra_error=f"{kind}: {e}", deterministic=kind != "llm_judge")
    except KeyError as e:
        raise SpecError(f"{kind} spec is missing field {e}") from None
    mode = spec.get("reward_mode", "binary")
    if mode not in ("binary", "partial"):
        raise SpecError(f"{kind}: reward_mode must be 'binary' or 'partial', got {mode!r}")
    if mode == "partial" and v.infra_error is None and kind != "composite":
        v = dataclasses.replace(v, reward=partial_credit(v))
    return v


def partial_credit(v: Verdict) -> float:
    """1.0 for a passed verdict, else the mean of its partial-credit components (0.0 without any)."""
    if v.passed:
        return 1.0
    comps = list(v.components.values())
    return sum(comps) / len(comps) if comps else 0.0


def validate_spec(spec: dict) -> None:
    """Check a spec without grading anything (raises :class:`SpecError`)."""
    if not isinstance(spec, dict) or spec.get("kind") not in _REGISTRY:
        raise SpecError(f"unknown or missing verifier kind in {spec!r:.200}")
    kind = spec["kind"]
    required, check = _SPEC_RULES.get(kind, ((), None))
    for k in required:
        if k not in spec:
            raise SpecError(f"{kind} spec is missing field {k!r}")
    if check is not None:
        check(spec)


# ------------------------------------------------------------- helpers of the kind modules (package-internal)


def _fail(components: dict[str, float], **details: Any) -> Verdict:
    return Verdict(0.0, False, components, details=details)


def _done(passed: bool, components: dict[str, float], **details: Any) -> Verdict:
    return Verdict(1.0 if passed else 0.0, passed, components, details=details)


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)


def _extract_code(text: str, langs: tuple[str, ...]) -> tuple[str, str]:
    """The last fenced block tagged with one of ``langs``, else the last fenced block, else the whole
    text; and which of the three it was."""
    blocks = _FENCE.findall(text)
    for lang, body in reversed(blocks):
        if lang.lower() in langs:
            return body, f"fenced {lang}"
    if blocks:
        return blocks[-1][1], "fenced"
    return text, "whole text"

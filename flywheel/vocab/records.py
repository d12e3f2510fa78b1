"""Typed records for what crosses a stage boundary, and the map of every such contract.

A leaf like the rest of :mod:`flywheel.vocab`: standard library and ``typing`` only. The records
here are :class:`~typing.TypedDict` s: at runtime they are the plain dicts (and Parquet rows) the
stages already exchange, so naming them changes no value, no event payload and no content id; they
let a reader and mypy see the shape. tests/unit/test_records.py keeps each one equal to its schema
(:data:`flywheel.tasks.TASK_KEYS`, the Arrow schemas) and checks real records against it.

The contract map (data flows one way; docs/architecture.md, "Layers")
---------------------------------------------------------------------
Per boundary: the record -- where it is defined -- its schema. Records marked *here* are in this
module; the others are dataclasses that stay in the module of the stage that owns them.

- **-> ingest**: a trace (OpenAI chat messages, tools, outcome, correction) -- plain JSON --
  ``schemas/trace.schema.json``; the batch's GX suite ``schemas/gx/traces_batch.json``.
- **ingest -> evals**: a failure, the ``failure.classified`` payload -- an event payload (dict) --
  the event catalog :mod:`flywheel.events`.
- **evals, synth -> envs, rollouts, train, gate**: :class:`EvalTask` (metadata :class:`TaskMetadata`)
  -- *here* (a dict at runtime) -- :data:`flywheel.tasks.TASK_KEYS` and
  :func:`flywheel.tasks.validate_task`; synth candidates also pass ``schemas/gx/synth_batch.json``.
- **suites and environments**: ``Suite``, ``Env`` (a version; ``tasks`` are :class:`EvalTask` s) --
  :mod:`flywheel.versioning` -- ``suite.versioned`` / ``env.versioned`` events and a JSON artifact
  of the tasks.
- **synth -> envs**: ``Candidate``, ``Rejection`` -- :mod:`flywheel.synth.generators`,
  :mod:`flywheel.synth.funnel` -- ``synth.batch_accepted`` and its accepted/rejected Parquet.
- **envs -> rollouts, gate, synth**: ``Episode`` -- :mod:`flywheel.envs.harness` (its ``context`` is
  ``HarnessContext`` there) -- the token contract in that module's docstring; ``Verdict``,
  ``VerifyContext`` -- :mod:`flywheel.verifiers.registry`; ``Policy``, ``SamplingParams``,
  ``Sample`` -- :mod:`flywheel.policy.base`.
- **rollouts -> train**: :class:`RolloutRow` (one sample; the ``K`` rows of a group share
  ``group_id``) -- *here*, written by :mod:`flywheel.rollouts` (``RolloutSummary``) --
  ``ROLLOUT_SCHEMA`` in ``schemas/rollouts.py``; GX ``schemas/gx/rollouts.json``. Read back as
  ``TrainSample`` / ``MicroBatch`` -- :mod:`flywheel.train.data`.
- **train inputs**: ``Demonstration`` (SFT, from a task's ``reference``) -- :mod:`flywheel.train.demos`;
  :class:`PreferenceRow` (*here*) / ``PreferencePair`` -- :mod:`flywheel.train.preference` --
  ``PREFERENCE_SCHEMA`` in ``schemas/preferences.py``; GX ``schemas/gx/preferences.json``;
  ``LossInputs`` -- :mod:`flywheel.train.losses`.
- **evaluate -> gate**: :class:`EvalItemRow` (one item; *here*), ``EvalResult``, ``ModelRef`` --
  :mod:`flywheel.evaluate` -- its ``ITEM_SCHEMA`` and the ``eval.completed`` event.
- **gate -> deploy**: ``GateEvidence``, ``GateDecision`` -- :mod:`flywheel.gate` -- the
  ``gate.decided`` event.

What the TypedDicts do not do: they check nothing at runtime (a malformed task is refused by
:func:`flywheel.tasks.validate_task`, a malformed row by its Arrow schema when it is written), and
a :class:`~typing.TypedDict` takes no keys beyond the declared ones under mypy, so a stage that adds
a metadata key must declare it in :class:`TaskMetadata` (the test fails until it does).

Why :data:`TaskRecord` exists: most holders of task records (``Suite.tasks``, ``Env.tasks``, the
synth candidates) still type them ``dict``, and mypy treats a ``dict[str, Any]`` as incompatible
with a :class:`~typing.TypedDict`. Functions that take a task accept :data:`TaskRecord` (an
:class:`EvalTask` or such a dict) until those holders say ``EvalTask`` too.
"""

# No ``from __future__ import annotations`` here: a TypedDict reads ``Required[...]`` from evaluated
# annotations, and under PEP 563 Python 3.11 leaves ``__required_keys__`` empty.
from typing import Any, Literal, Required, TypeAlias, TypedDict

__all__ = [
    "HARNESS_NAMES",
    "ChatMessage",
    "EvalItemRow",
    "EvalTask",
    "HarnessName",
    "PreferenceRow",
    "RecordedToolOutput",
    "ReferenceCall",
    "RolloutRow",
    "TaskPrompt",
    "TaskMetadata",
    "TaskRecord",
    "TaskReference",
    "ToolEnvSpec",
    "ToolSpec",
    "VerifierSpec",
]

#: An OpenAI chat message (``role``, ``content``, optional ``tool_calls`` / ``tool_call_id`` / ``name``).
ChatMessage: TypeAlias = dict[str, Any]
#: An OpenAI function spec (``{"type": "function", "function": {name, description, parameters}}``
#: or the flat ``{name, description, parameters}``; :mod:`flywheel.vocab.tools` reads both).
ToolSpec: TypeAlias = dict[str, Any]
#: A verifier spec: ``{"kind": <one of flywheel.verifiers.KINDS>, ...the kind's fields}``.
VerifierSpec: TypeAlias = dict[str, Any]

HarnessName: TypeAlias = Literal["single_turn", "tool_loop"]
#: The same names as :data:`flywheel.tasks.HARNESSES` (the test holds them equal).
HARNESS_NAMES: tuple[HarnessName, ...] = ("single_turn", "tool_loop")


# ------------------------------------------------------------------------------ the task record
class TaskPrompt(TypedDict, total=False):
    """What the model is shown: the conversation so far and the tools offered."""

    messages: Required[list[ChatMessage]]  # non-empty
    tools: list[ToolSpec]  # absent means none


class RecordedToolOutput(TypedDict):
    """One tool output recorded in the trace, answered again when a call matches it."""

    name: str
    arguments: dict[str, Any]
    content: str


class ToolEnvSpec(TypedDict, total=False):
    """The environment of a ``tool_loop`` task (:mod:`flywheel.envs.tools`): recorded outputs
    matched by tool name and arguments, or Python source defining one function per tool (run in
    the sandbox); ``replay``: the answer's calls are executed against ``python`` and the episode
    fails if one raises."""

    recorded: list[RecordedToolOutput]
    python: str | None
    replay: bool


class ReferenceCall(TypedDict):
    """One call of a reference answer: a concrete value per argument."""

    name: str
    arguments: dict[str, Any]


class _ReferenceCalls(TypedDict):
    tool_calls: list[ReferenceCall]


class _ReferenceContent(TypedDict):
    content: str


#: One concrete correct answer, when one is known: calls, or text.
TaskReference: TypeAlias = _ReferenceCalls | _ReferenceContent


class TaskMetadata(TypedDict, total=False):
    """What the stages record about a task. The eval compiler writes the first group, the evals stage
    the split, synthesis the second group (a synthetic task copies its seed's metadata first)."""

    # the eval compiler (flywheel.evals.compiler)
    failure_kinds: list[str]
    tools: list[str]  # names of the offered tools, sorted
    source: str | None
    origin_failure: str | None  # failure:<id>; None for a regression eval from a success
    origin_trace: str | None  # trace:<id>
    origin_outcome: Literal["failure", "success"]
    weak: bool  # the verifier checks validity only
    deterministic: bool  # False for llm_judge
    verifier_kind: str
    request_hash: str
    tool_schema_sources: dict[str, Literal["trace", "registry", "none"]]
    # the evals stage (flywheel.evals.stage, flywheel.split)
    split: Literal["train", "heldout", "excluded", "regression"]
    cluster: str
    # synthesis (flywheel.synth)
    seed_task: str
    seed_tasks: list[str]
    generator: str
    generator_params: dict[str, Any]
    synth_detail: dict[str, Any]
    synth_version: int
    synth_batch: str  # synth:<id>, set when the batch joins an environment
    difficulty: dict[str, Any]  # {pass_rate, k, policy, zero_advantage}


class EvalTask(TypedDict, total=False):
    """The task record (:mod:`flywheel.tasks` describes each field): what evals and synthesis make and
    environments, rollouts, SFT and the gate consume. The four required keys are the ones
    :func:`flywheel.tasks.validate_task` insists on; a validated record carries all seven."""

    task_id: Required[str]  # eval:<16 hex> | synth:<id>
    prompt: Required[TaskPrompt]
    verifier: Required[VerifierSpec]
    harness: Required[HarnessName]
    tool_env: ToolEnvSpec | None
    reference: TaskReference | None
    metadata: TaskMetadata


#: What a function that takes a task accepts (see the module docstring): the typed record, or the
#: bare dict most holders still declare.
TaskRecord: TypeAlias = EvalTask | dict[str, Any]


# ------------------------------------------------------------------------------ Parquet rows
class RolloutRow(TypedDict):
    """One row of the rollout Parquet (``ROLLOUT_SCHEMA`` in ``schemas/rollouts.py``; its comments
    say what each column holds), as :mod:`flywheel.rollouts` writes it. ``reward_components`` is a
    dict when written; pyarrow reads a map column back as a list of (key, value) pairs."""

    task_id: str
    env_id: str
    group_id: str
    sample_idx: int
    policy_version: str
    messages: str  # JSON
    completion: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    sampler_logprobs: list[float]
    loss_mask: list[int]
    truncated: bool
    reward: float
    reward_components: dict[str, float]
    passed: bool
    advantage: float
    finish_reason: str
    infra_error: str | None
    generation_ms: float
    verify_ms: float


class PreferenceRow(TypedDict):
    """One row of the preference-pair Parquet (``PREFERENCE_SCHEMA`` in ``schemas/preferences.py``)."""

    pair_id: str
    task_id: str
    messages: str  # JSON
    tools: str  # JSON
    chosen: str
    chosen_calls: str | None  # JSON
    chosen_content: str | None
    rejected: str
    chosen_reward: float
    rejected_reward: float
    source: str  # production | sampled
    source_entity_id: str
    split: str


class EvalItemRow(TypedDict):
    """One item of an evaluation (``ITEM_SCHEMA`` in :mod:`flywheel.evaluate`): one task's result
    for one model and decoding, what the gate pairs between champion and challenger. (The items of an
    evaluation recorded before item reuse existed lack ``task_hash``.)"""

    task_id: str
    passed: bool
    n_samples: int
    n_passed: int
    reward: float
    infra_error: str | None
    deterministic: bool
    failure_kinds: list[str]
    tools: list[str]
    source: str | None
    cluster: str | None
    origin_failure: str | None
    split: str | None
    completion: str | None
    task_hash: str
    n_truncated: int | None  # samples cut at max_new_tokens; None in evaluations recorded before it was counted

"""The typed records of flywheel.vocab.records stay equal to the schemas they name, and the records
the stages really produce conform to them.

- Each record against its schema: ``EvalTask``'s keys are :data:`flywheel.tasks.TASK_KEYS` and its
  required keys are exactly the ones :func:`flywheel.tasks.validate_task` refuses to miss; each
  Parquet row's keys, value types and nullability are its Arrow schema's. A field added to a schema
  and not to its record (or the reverse) fails here.
- Real records against the TypedDicts (keys declared, required keys present, every value of the
  declared type, nested records included): the tasks of the fixture traffic through the real
  ingest and evals stages (every eval, every suite version's tasks), synthetic tasks from the
  generators, :func:`validate_task`'s output, and the evaluation's item rows. A stage that starts
  writing a metadata key ``TaskMetadata`` lacks fails here too.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

import pyarrow as pa
import pytest
from fixtures.bfcl_seeds import bfcl_tasks
from flywheel.schemas.preferences import PREFERENCE_SCHEMA
from flywheel.schemas.rollouts import ROLLOUT_SCHEMA

from flywheel.artifacts import open_artifacts
from flywheel.envs.harness import Episode
from flywheel.evals import build_evals
from flywheel.evaluate import ITEM_SCHEMA, item_row
from flywheel.ingest import ingest_paths
from flywheel.synth import generate_candidates, make_generators, seed_tasks
from flywheel.tasks import HARNESSES, TASK_KEYS, TaskError, task_from_state, validate_task
from flywheel.verifiers import Verdict
from flywheel.versioning import latest_versions, load_suite
from flywheel.vocab.records import (
    HARNESS_NAMES,
    EvalItemRow,
    EvalTask,
    HarnessName,
    PreferenceRow,
    RolloutRow,
    TaskMetadata,
)

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
# Metadata keys that a later stage adds to a task already in an environment (not produced below):
# the synth stage's batch id and its optional difficulty measurement.
LATER_METADATA = {"synth_batch", "difficulty"}


# ------------------------------------------------------------------------------ a structural checker
def conform(value: Any, tp: Any, path: str = "$") -> list[str]:
    """Where ``value`` departs from the type ``tp`` (TypedDicts, unions, Literal, list, dict, scalars)."""
    if tp is Any or tp is object:
        return []
    if is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__}, not a dict ({tp.__name__})"]
        hints = get_type_hints(tp)
        out = [f"{path}: missing required key {k!r} ({tp.__name__})" for k in sorted(tp.__required_keys__ - set(value))]
        out += [f"{path}: key {k!r} not declared in {tp.__name__}" for k in sorted(set(value) - set(hints))]
        for k in sorted(set(value) & set(hints)):
            out += conform(value[k], hints[k], f"{path}.{k}")
        return out
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        arms = [conform(value, arm, path) for arm in get_args(tp)]
        return [] if any(not a for a in arms) else [f"{path}: {value!r:.80} matches no arm of {tp}"]
    if origin is Literal:
        return [] if value in get_args(tp) else [f"{path}: {value!r} not one of {get_args(tp)}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__}, not a list"]
        (item,) = get_args(tp)
        return [e for i, v in enumerate(value) for e in conform(v, item, f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__}, not a dict"]
        kt, vt = get_args(tp)
        return [e for k, v in value.items() for e in conform(k, kt, f"{path} key") + conform(v, vt, f"{path}[{k!r}]")]
    if tp is type(None):
        return [] if value is None else [f"{path}: {value!r:.80} is not None"]
    if tp is bool:
        return [] if isinstance(value, bool) else [f"{path}: {value!r:.80} is not a bool"]
    if tp is int:
        return [] if isinstance(value, int) and not isinstance(value, bool) else [f"{path}: {value!r:.80} is not an int"]
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r:.80} is not a float"]
    if tp is str:
        return [] if isinstance(value, str) else [f"{path}: {value!r:.80} is not a str"]
    raise AssertionError(f"conform() does not know {tp!r}")


def test_the_checker_catches_what_it_must():
    good = {"task_id": "eval:1", "prompt": {"messages": [{"role": "user", "content": "hi"}]},
            "verifier": {"kind": "exact", "expected": "x"}, "harness": "single_turn"}
    assert conform(good, EvalTask) == []
    assert conform({**good, "harness": "multi"}, EvalTask)  # not a HarnessName
    assert conform({k: v for k, v in good.items() if k != "prompt"}, EvalTask)  # a required key missing
    assert conform({**good, "extra": 1}, EvalTask)  # an undeclared key
    assert conform({**good, "metadata": {"weak": "yes"}}, EvalTask)  # a nested value of the wrong type
    assert conform({**good, "metadata": {"brand_new": 1}}, EvalTask)  # an undeclared metadata key
    assert conform({**good, "reference": {"content": 3}}, EvalTask)  # no arm of the reference union


# ------------------------------------------------------------------------------ records = schemas
def _valid_task() -> dict:
    return {"task_id": "eval:0123456789abcdef", "prompt": {"messages": [{"role": "user", "content": "hi"}]},
            "verifier": {"kind": "exact", "expected": "hello"}, "harness": "single_turn"}


def test_eval_task_has_the_task_contract_keys_and_requires_what_validate_task_requires():
    assert set(get_type_hints(EvalTask)) == set(TASK_KEYS)
    # Required = the keys whose absence validate_task refuses as missing (asked of the code, not copied).
    required = set()
    for key in TASK_KEYS:
        task = {**_valid_task(), "tool_env": None, "reference": None, "metadata": {}}
        del task[key]
        try:
            validate_task(task)
        except TaskError as e:
            assert "missing" in str(e) and key in str(e), e
            required.add(key)
    assert EvalTask.__required_keys__ == required == {"task_id", "prompt", "verifier", "harness"}
    assert set(HARNESS_NAMES) == set(get_args(HarnessName)) == set(HARNESSES)


def _py_type(t: pa.DataType) -> Any:
    """The Python type a value of Arrow type ``t`` is written as."""
    if pa.types.is_string(t):
        return str
    if pa.types.is_boolean(t):
        return bool
    if pa.types.is_integer(t):
        return int
    if pa.types.is_floating(t):
        return float
    if pa.types.is_map(t):
        return dict[_py_type(t.key_type), _py_type(t.item_type)]  # type: ignore[misc]
    if pa.types.is_list(t):
        return list[_py_type(t.value_type)]  # type: ignore[misc]
    raise AssertionError(f"no Python type for {t}")


def _optional_arm(tp: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` was allowed)."""
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        (rest,) = [a for a in get_args(tp) if a is not type(None)]  # the rows have no wider unions
        return rest, True
    return tp, False


@pytest.mark.parametrize(
    ("record", "schema", "nullability"),
    [
        (RolloutRow, ROLLOUT_SCHEMA, True),
        (PreferenceRow, PREFERENCE_SCHEMA, True),
        # ITEM_SCHEMA declares no nullability (every field is nullable by default): names and types only
        (EvalItemRow, ITEM_SCHEMA, False),
    ],
    ids=["rollouts", "preferences", "eval-items"],
)
def test_each_parquet_row_record_is_its_arrow_schema(record, schema, nullability):
    hints = get_type_hints(record)
    assert list(hints) == schema.names, "the record's fields, in the schema's column order"
    assert record.__required_keys__ == set(schema.names)  # a writer gives every column
    for f in schema:
        base, optional = _optional_arm(hints[f.name])
        assert base == _py_type(f.type), (f.name, base, f.type)
        if nullability:
            assert optional == f.nullable, (f.name, "nullable" if f.nullable else "not nullable")


# ------------------------------------------------------------------------------ real records conform
@pytest.fixture
def staged_tasks(cfg, store) -> list[dict]:
    """Every task record the ingest and evals stages make of the fixture traffic: each eval (as the
    suites read it from its event) and each suite version's tasks (as consumers load them)."""
    arts = open_artifacts(cfg)
    ingest_paths(cfg, store, arts, [TRACES / "examples.jsonl", TRACES / "kinds.jsonl"])
    build_evals(cfg, store, arts)
    tasks = [task_from_state(e["state"]) for e in store.entities("eval")]
    for v in latest_versions(store, "suite"):
        tasks += load_suite(store, arts, v["entity_id"]).tasks
    return tasks


def test_the_tasks_the_stages_make_conform_to_eval_task(staged_tasks):
    assert len(staged_tasks) >= 10
    assert {t["harness"] for t in staged_tasks} == {"single_turn", "tool_loop"}  # both harnesses covered
    assert {t["metadata"]["origin_outcome"] for t in staged_tasks} == {"failure", "success"}
    for t in staged_tasks:
        assert conform(t, EvalTask) == [], t["task_id"]
        assert conform(validate_task(t), EvalTask) == [], t["task_id"]


# Every generator that needs no policy (paraphrase asks one to rewrite the request).
GENERATORS = ("mutate", "distractor", "parallel", "schema_values", "masked_names", "irrelevance")


def test_synthetic_tasks_conform_and_every_metadata_key_is_produced(staged_tasks):
    out: list[dict] = []
    for cat, n in (("simple_python", 14), ("multiple", 8), ("parallel", 8), ("parallel_multiple", 6)):
        out += bfcl_tasks(cat, n)
    seeds = seed_tasks(out)
    synth = [c.task for g in GENERATORS for c in generate_candidates(seeds, make_generators([g]), 2, seed=0)[0]]
    assert {t["metadata"]["generator"] for t in synth} == set(GENERATORS)
    for t in synth:
        assert conform(t, EvalTask) == [], t["task_id"]
    # The reverse direction: no declared metadata key is stale (each is produced by some stage here,
    # but for the ones a later stage adds).
    produced = {k for t in [*staged_tasks, *synth] for k in t["metadata"]}
    assert set(get_type_hints(TaskMetadata)) - produced == LATER_METADATA


def test_item_rows_conform_to_eval_item_row(staged_tasks):
    def episode(task: dict, i: int, verdict: Verdict) -> Episode:
        return Episode(task_id=task["task_id"], sample_idx=i, messages=[], completion_text="[f(a=1)]",
                       prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1], loss_mask=[1],
                       finish_reason="stop", truncated=False, verdict=verdict, gen_ms=1.0, verify_ms=1.0, turns=1)

    ok = Verdict(reward=1.0, passed=True, components={})
    infra = Verdict(reward=0.0, passed=False, components={}, infra_error="sandbox did not start")
    rows = [item_row(t, [episode(t, 0, ok), episode(t, 1, infra if i % 2 else ok)])
            for i, t in enumerate(staged_tasks)]
    for r in rows:
        assert conform(r, EvalItemRow) == [], r["task_id"]
    assert pa.Table.from_pylist(rows, schema=ITEM_SCHEMA).num_rows == len(rows)

"""Entity ids and the references people type for them.

Entity ids are typed: ``<kind>:<id>`` (:data:`ENTITY_KINDS`). Versioned entities are
``suite:<name>@<N>`` / ``env:<name>@<N>`` (names never contain ``@``, versions start at 1) and
``model:<name>/<N>`` (the version is the part after the last ``/``).

A *model reference* is what a command accepts wherever it asks for a model
(``rollout --policy``, ``gate``, ``promote``, ``serve --model``); :func:`parse_model_ref` reads it:

============================  ==============================================================
reference                     meaning
============================  ==============================================================
``champion``, ``challenger``  the registry alias of the configured model
``model:<name>/<N>``          a registered version
``<model_name>/<N>``          a registered version of the configured model (short form)
``<N>``                       version N of the configured model, where ``bare_version`` is on
``http(s)://...``             an OpenAI-compatible server
anything else                 a base model spec (``tiny``, ``smollm2-135m``) or a local directory
============================  ==============================================================

Resolving a reference (an alias needs the registry) is :mod:`flywheel.policy.registry`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ENTITY_KINDS",
    "MODEL_ALIASES",
    "ModelRefSpec",
    "entity_kind",
    "with_prefix",
    "model_entity",
    "parse_model_entity",
    "parse_model_ref",
    "parse_versioned_ref",
    "versioned_entity",
]

#: Entity kinds (the prefix of an entity id) and what they name.
ENTITY_KINDS = {
    "trace": "a production trace",
    "quarantine": "an ingest batch's quarantined records",
    "ingest": "an ingest batch",
    "failure": "a distinct failure (deduplicated across traces)",
    "eval": "an eval case",
    "suite": "a versioned eval suite, suite:<name>@<version>",
    "env": "a versioned environment, env:<name>@<version>",
    "synth": "a synthetic task batch",
    "rollouts": "a rollout dataset",
    "preferences": "a preference-pair dataset (chosen vs rejected answers, for DPO/RPO)",
    "run": "a training run",
    "learn": "a learning stage's decision: its arms, their budgets and dev scores, the model it shipped",
    "model": "a model version, model:<name>/<version>",
    "evaluation": "an evaluation of a model version on a suite version",
    "gate": "a gate decision",
    "deploy": "a deployment history stream",
    "serve": "the runtime adapter history of a served model, serve:<model name>",
    "cycle": "one run of the flywheel cycle",
    "stage": "one cycle stage run on a work pool, stage:<stage>-<inputs hash> (cycle.pools)",
}

MODEL_ALIASES = ("champion", "challenger")


def entity_kind(entity_id: str) -> str:
    """``"model:policy/3"`` -> ``"model"``."""
    return entity_id.split(":", 1)[0]


def with_prefix(kind: str, ref: str) -> str:
    """``ref`` as an entity id of ``kind``: ``with_prefix("trace", "abc") == "trace:abc"``; an id that
    already carries the prefix is returned as it is."""
    ref = str(ref)
    return ref if ref.startswith(kind + ":") else f"{kind}:{ref}"


def model_entity(name: str, version: int) -> str:
    """``model:<name>/<version>``."""
    return f"model:{name}/{int(version)}"


def parse_model_entity(entity: str) -> tuple[str, int]:
    """``model:policy/3`` -> ``("policy", 3)``; a ``ValueError`` naming the expected form otherwise."""
    body = entity.removeprefix("model:")
    name, _, ver = body.rpartition("/")
    if not entity.startswith("model:") or not name or not ver.isdigit():
        raise ValueError(f"{entity!r} is not a model version id (expected model:<name>/<version>)")
    return name, int(ver)


@dataclass(frozen=True)
class ModelRefSpec:
    """A parsed model reference (see the module docstring). ``kind``: ``alias`` (``alias`` set),
    ``version`` (``name`` and ``version`` set), ``url`` or ``spec`` (``spec`` set). What it resolves to
    is :class:`flywheel.policy.registry.ResolvedModel`."""

    kind: Literal["alias", "version", "url", "spec"]
    name: str | None = None
    version: int | None = None
    alias: str | None = None
    spec: str | None = None

    @property
    def entity_id(self) -> str | None:
        return model_entity(self.name, self.version) if self.kind == "version" else None  # type: ignore[arg-type]


def parse_model_ref(ref: str, *, model_name: str, bare_version: bool = False) -> ModelRefSpec:
    """Read a model reference; ``model_name`` is the configured registered model (``[cycle]
    model_name``). Raises ``ValueError`` for a ``model:`` reference that is not ``model:<name>/<N>``."""
    ref = str(ref).strip()
    if ref in MODEL_ALIASES:
        return ModelRefSpec("alias", name=model_name, alias=ref)
    if ref.startswith(("http://", "https://")):
        return ModelRefSpec("url", spec=ref)
    if ref.startswith("model:"):
        name, version = parse_model_entity(ref)
        return ModelRefSpec("version", name=name, version=version)
    if bare_version and ref.isdigit():
        return ModelRefSpec("version", name=model_name, version=int(ref))
    head, _, tail = ref.rpartition("/")
    if head == model_name and tail.isdigit():
        return ModelRefSpec("version", name=model_name, version=int(tail))
    return ModelRefSpec("spec", spec=ref)


def parse_versioned_ref(ref: str, kind: str) -> tuple[str, int | None]:
    """``"train"`` / ``"train@3"`` / ``"suite:train@3"`` -> ``("train", 3 or None)``: the one reader of
    suite and env references (``flywheel.versioning``, ``flywheel.evaluate.parse_suite_spec``).

    A ``ValueError`` naming ``ref`` for an empty name, a name containing ``@`` (``"a@b@3"``), and a
    version that is not an integer >= 1 (``"train@0"``, ``"train@x"``, ``"train@"``): versions start at 1."""
    body = ref.removeprefix(kind + ":")
    name, sep, ver = body.partition("@")
    if not name:
        raise ValueError(f"{kind} reference {ref!r}: empty {kind} name")
    if "@" in ver:
        raise ValueError(f"{kind} reference {ref!r}: a {kind} name cannot contain '@' "
                         f"(expected <name> or <name>@<version>)")
    if not sep:
        return name, None
    try:
        v = int(ver)
    except ValueError:
        raise ValueError(f"{kind} reference {ref!r}: version {ver!r} is not an integer") from None
    if v < 1:
        raise ValueError(f"{kind} reference {ref!r}: version {v} is not >= 1 (versions start at 1)")
    return name, v


def versioned_entity(kind: str, name: str, version: int) -> str:
    """``suite:<name>@<version>`` / ``env:<name>@<version>``."""
    return f"{kind}:{name}@{int(version)}"

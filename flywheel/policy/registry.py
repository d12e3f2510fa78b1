"""Model references resolved against the MLflow registry, and the policies they load.

Every command that takes a model takes the same references (:func:`flywheel.vocab.refs.parse_model_ref`):
``champion`` / ``challenger`` (aliases of ``[cycle] model_name``), ``model:<name>/<N>``,
``<model_name>/<N>``, an ``http(s)://`` OpenAI-compatible server, or a base model spec / local
directory. :func:`resolve_model` turns one into a :class:`ResolvedModel` (which registered version, or
which spec); :func:`resolve_policy` also loads it as a :class:`~flywheel.policy.base.Policy`.

What a registered version holds (the one rule, for sampling and for training): a **LoRA adapter**
when its directory holds ``adapter_config.json`` (or its ``adapter`` tag says ``lora``), applied to its
base model: the ``base_model`` tag, else the adapter config's ``base_model_name_or_path``, else
``[policy] base_model``; otherwise a **full** Hugging Face model directory.

Resolution rules: ``champion`` with no version holding the alias is the base model (the implicit
champion before the first promotion); ``challenger`` with none is an error; a version that is not
registered is an error naming it. Heavy backends (torch, transformers) load only when a policy is
loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.config import FlywheelConfig
from flywheel.policy.base import Policy
from flywheel.policy.hf import HFPolicy
from flywheel.policy.openai_http import OpenAIPolicy
from flywheel.tracking import Tracker
from flywheel.vocab.refs import model_entity, parse_model_entity, parse_model_ref

__all__ = [
    "ModelRefError",
    "ResolvedModel",
    "ResolvedPolicy",
    "VersionFiles",
    "load_policy_for_version",
    "resolve_model",
    "resolve_policy",
    "version_files",
]

ADAPTER_MARKER = "adapter_config.json"


class ModelRefError(LookupError):
    """A model reference that names nothing usable; the message says which and why."""


@dataclass(frozen=True)
class ResolvedModel:
    """What a reference names: a registered ``version`` of ``name``, a base ``spec`` (or directory), or
    a server ``url``. ``ref`` is how records name it (``model:<name>/<N>``, ``base:<spec>`` or the URL).

    The reference as parsed is :class:`flywheel.vocab.refs.ModelRefSpec` (an alias not yet looked up,
    a URL in ``spec``); what an evaluation records is :class:`flywheel.evaluate.ModelRef` (no URL, a
    base model named ``"base"``)."""

    ref: str
    name: str | None = None
    version: int | None = None
    spec: str | None = None
    url: str | None = None

    @property
    def entity_id(self) -> str | None:
        return model_entity(self.name, self.version) if self.version is not None and self.name else None


def resolve_model(cfg: FlywheelConfig, tracker: Tracker, ref: str | None, *, bare_version: bool = False,
                  registered_only: bool = False) -> ResolvedModel:
    """Resolve ``ref`` (default ``champion``); see the module docstring. ``bare_version``: a plain
    integer is a version of ``[cycle] model_name`` (``flywheel gate 3``). ``registered_only``: refuse
    what is not a registered version (a base spec, a URL, ``champion`` before the first promotion)."""
    ref = ref or "champion"
    name = cfg.cycle.model_name
    try:
        spec = parse_model_ref(ref, model_name=name, bare_version=bare_version)
    except ValueError as e:
        raise ModelRefError(str(e)) from None
    if spec.kind == "alias":
        version = tracker.get_alias_version(name, spec.alias)
        if version is None:
            if spec.alias == "challenger" or registered_only:
                raise ModelRefError(f"no model version of {name!r} has the alias {spec.alias!r}")
            return ResolvedModel(f"base:{cfg.policy.base_model}", spec=cfg.policy.base_model)
        return ResolvedModel(model_entity(name, version), name=name, version=int(version))
    if spec.kind == "version":
        try:
            tracker.model_version(spec.name, spec.version)
        except Exception as e:  # MLflow raises its own exception types for a missing version
            raise ModelRefError(f"{spec.entity_id} is not a registered version: {e}") from None
        return ResolvedModel(spec.entity_id, name=spec.name, version=spec.version)  # type: ignore[arg-type]
    if registered_only:
        raise ModelRefError(f"{ref!r} is not a registered model version (expected champion, challenger, "
                            f"model:<name>/<N>, {name}/<N> or a version number)")
    if spec.kind == "url":
        return ResolvedModel(ref, url=ref)
    return ResolvedModel(f"base:{ref}", spec=ref)


@dataclass(frozen=True)
class VersionFiles:
    """Where a registered version's files are and how to load them (see the module docstring)."""

    directory: Path
    adapter: bool
    base_model: str | None  # what an adapter applies to; None for a full model


def version_files(cfg: FlywheelConfig, tracker: Tracker, name: str, version: int) -> VersionFiles:
    """The files of ``model:<name>/<version>``; :class:`ModelRefError` when it is not registered."""
    try:
        mv = tracker.model_version(name, version)
    except Exception as e:  # MLflow raises its own exception types for a missing version
        raise ModelRefError(f"model:{name}/{version} is not a registered version: {e}") from None
    tags = dict(getattr(mv, "tags", {}) or {})
    d = Path(tracker.model_dir(name, version))
    adapter_cfg = d / ADAPTER_MARKER
    if not (adapter_cfg.exists() or str(tags.get("adapter", "")).lower() in ("lora", "true")):
        return VersionFiles(d, False, None)
    base = tags.get("base_model")
    if base and os.path.isabs(base) and not os.path.exists(base) and str(tags.get("base", "")).startswith("model:"):
        # Recorded by an older trainer as a directory on the machine that trained it: the base's registry
        # reference (the `base` tag) is what every machine can resolve.
        base = tags["base"]
    if not base and adapter_cfg.exists():
        base = json.loads(adapter_cfg.read_text()).get("base_model_name_or_path")
    return VersionFiles(d, True, local_base(cfg, tracker, base or cfg.policy.base_model, of=f"model:{name}/{version}"))


def local_base(cfg: FlywheelConfig, tracker: Tracker, spec: str, *, of: str) -> str:
    """An adapter's base as this machine loads it: a base spec or directory as it is; a registry reference
    (``model:<name>/<N>``, how a base that is itself a registered full model is recorded, so that another
    machine can find it) as the directory of that version's files here (downloaded into this home when
    the registry is a server)."""
    if not spec.startswith("model:"):
        return spec
    try:
        files = version_files(cfg, tracker, *parse_model_entity(spec))
    except ValueError as e:
        raise ModelRefError(f"{of}: its base {spec!r} is not a model reference: {e}") from None
    if files.adapter:
        raise ModelRefError(f"{of}: its base {spec} is itself an adapter; an adapter applies to a full model")
    return str(files.directory)


def load_policy_for_version(cfg: FlywheelConfig, tracker: Tracker, name: str, version: int) -> Any:
    """An :class:`~flywheel.policy.hf.HFPolicy` for a registered version, full model or LoRA adapter."""
    files = version_files(cfg, tracker, name, version)
    if files.adapter:
        # The gate and `flywheel serve` both load here, so the gate judges the weights that are served.
        return HFPolicy.from_config(cfg.policy, files.base_model, cfg.home, adapter=files.directory, name=name,
                                    version=str(version))
    return HFPolicy.from_config(cfg.policy, str(files.directory), cfg.home, name=name, version=str(version))


def _openai(cfg: FlywheelConfig, url: str | list[str], model: str) -> Any:
    return OpenAIPolicy(url, model=model, api_key=os.environ.get(cfg.policy.api_key_env),
                        max_concurrency=cfg.policy.max_concurrency, timeout_s=cfg.policy.request_timeout_s)


def _base_policy(cfg: FlywheelConfig, spec: str) -> Any:
    return HFPolicy.from_config(cfg.policy, spec, cfg.home)


@dataclass
class ResolvedPolicy:
    """A loaded policy and how records name it: ``ref`` (``model:<name>/<N>``, ``base:<spec>``, the
    URL) and ``entity_id`` (the registered version, for causation; None otherwise)."""

    policy: Policy
    ref: str
    entity_id: str | None


def _served(cfg: FlywheelConfig, tracker: Tracker, m: ResolvedModel) -> ResolvedPolicy:
    """``policy.backend = "openai"``: sample from the OpenAI-compatible server(s) at ``policy.base_url``
    (vLLM in the team deployment; several endpoints share the work, :mod:`flywheel.policy.endpoints`).
    The champion is the served model ``<name>``; any other version must be a LoRA adapter, hot-loaded
    as ``<name>-<version>`` through the runtime adapter endpoint of every server."""
    if not cfg.policy.endpoints:
        raise ModelRefError("policy.backend is 'openai' but policy.base_url is not set")
    pol = _openai(cfg, cfg.policy.endpoints, m.name)  # type: ignore[arg-type]
    if tracker.get_alias_version(m.name, "champion") == m.version:
        return ResolvedPolicy(pol, m.ref, m.ref)
    files = version_files(cfg, tracker, m.name, m.version)  # type: ignore[arg-type]
    if not files.adapter:
        raise ModelRefError(f"{m.ref} is a full model: serve it with the OpenAI-compatible server first "
                            f"(infra/vllm/README.md), or use policy.backend = 'hf'")
    adapter = f"{m.name}-{m.version}"
    pol.load_lora_adapter(adapter, str(files.directory))
    return ResolvedPolicy(pol.for_model(adapter), m.ref, m.ref)


def resolve_policy(cfg: FlywheelConfig, tracker: Tracker, ref: str | None = None) -> ResolvedPolicy:
    """Resolve ``ref`` (:func:`resolve_model`) and load it: a registered version with the HF backend
    (or through the server with ``policy.backend = "openai"``), a base spec with the HF backend, a URL
    through the OpenAI-compatible client."""
    m = resolve_model(cfg, tracker, ref)
    if m.url is not None:
        return ResolvedPolicy(_openai(cfg, m.url, cfg.cycle.model_name), m.ref, None)
    if m.version is not None:
        if cfg.policy.backend == "openai":
            return _served(cfg, tracker, m)
        return ResolvedPolicy(load_policy_for_version(cfg, tracker, m.name, m.version), m.ref, m.ref)  # type: ignore[arg-type]
    return ResolvedPolicy(_base_policy(cfg, m.spec), m.ref, None)  # type: ignore[arg-type]

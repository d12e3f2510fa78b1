"""Loading: :func:`load_config` layers defaults < ``flywheel.toml`` < environment < CLI flags
(pydantic-settings' TOML and environment sources) and turns a validation error into a
:class:`~flywheel.config.base.ConfigError` that names the key and the reason."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource, TomlConfigSettingsSource

from flywheel.config.base import ConfigError
from flywheel.config.root import FlywheelConfig


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _drop_none(over: dict[str, Any]) -> dict[str, Any]:
    # A CLI flag that was not given arrives as None, at any depth ({"gate": {"min_pass_rate": None}}):
    # it must not override the lower layers.
    out = {}
    for k, v in over.items():
        if isinstance(v, dict):
            v = _drop_none(v)
            if v:
                out[k] = v
        elif v is not None:
            out[k] = v
    return out


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over an explicit mapping (tests, and ``load_config``'s
    ``environ``) instead of ``os.environ``."""

    def __init__(self, environ: dict[str, str]):
        self._environ = environ
        super().__init__(FlywheelConfig, case_sensitive=False, env_prefix="FLYWHEEL_", env_nested_delimiter="__",
                         env_ignore_empty=True)  # type: ignore[arg-type]

    def _load_env_vars(self) -> dict[str, str | None]:
        return {k.lower(): v for k, v in self._environ.items()}


def _nulls(layer: dict[str, Any]) -> dict[str, Any]:
    # pydantic-settings parses "null" only at the top level; a nested FLYWHEEL_ROLLOUT__MAX_TASKS=null
    # arrives as the string "null", which means None here as it does in JSON.
    return {k: _nulls(v) if isinstance(v, dict) else (None if v == "null" else v) for k, v in layer.items()}


def _env_layer(environ: dict[str, str]) -> dict[str, Any]:
    """``FLYWHEEL_*`` variables as a nested dict (and ``MLFLOW_TRACKING_URI``, MLflow's own variable).
    A ``FLYWHEEL_<X>__...`` variable whose first part is not a section is refused: pydantic-settings
    would drop it silently, and a mistyped section must not look applied."""
    for key in environ:
        if key.upper().startswith("FLYWHEEL_") and "__" in key:
            section = key[len("FLYWHEEL_"):].split("__", 1)[0].lower()
            if section not in FlywheelConfig.model_fields:
                raise ConfigError(f"invalid configuration (environment):\n  {section}: unknown key (from {key})")
    layer = _nulls(_EnvSource(environ)())
    if environ.get("MLFLOW_TRACKING_URI") and "mlflow_tracking_uri" not in layer:
        layer["mlflow_tracking_uri"] = environ["MLFLOW_TRACKING_URI"]
    return layer


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{key}: {reason} (got {e.get('input')!r})" if e["type"] != "extra_forbidden" else f"{key}: {reason}")
    return f"invalid configuration ({source}):\n  " + "\n  ".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> FlywheelConfig:
    """Build the configuration from defaults, ``flywheel.toml``, the environment and ``overrides``."""
    environ = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    sources = ["defaults"]
    toml_path = Path(path) if path else Path(environ.get("FLYWHEEL_CONFIG", "flywheel.toml"))
    if path and not toml_path.exists():
        raise ConfigError(f"config file {toml_path} does not exist")
    if toml_path.exists():
        try:
            data = TomlConfigSettingsSource(FlywheelConfig, toml_file=toml_path)()  # type: ignore[arg-type]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{toml_path}: not valid TOML: {e}") from e
        sources.append(str(toml_path))
    env = _env_layer(environ)
    if env:
        data = _deep_merge(data, env)
        sources.append("environment")
    if overrides:
        data = _deep_merge(data, _drop_none(overrides))
        sources.append("CLI flags")
    try:
        return FlywheelConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, " < ".join(sources))) from None

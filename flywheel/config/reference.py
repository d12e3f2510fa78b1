"""The configuration reference: every section and field, walked from :class:`FlywheelConfig`
(:func:`config_sections`) and written as ``docs/configuration.md`` (:func:`reference_markdown`)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel

from flywheel.config.root import FlywheelConfig


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """``(section model, is a list of them)`` of a field annotation; ``(None, False)`` for a leaf."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation)
    if getattr(annotation, "__origin__", None) is list and args and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel):
        return args[0], True
    return None, False


def _type_name(annotation: Any) -> str:
    if getattr(annotation, "__origin__", None) is Literal:
        return " \\| ".join(repr(a) for a in get_args(annotation))
    name = getattr(annotation, "__name__", None)
    if name and not get_args(annotation):
        return name
    return str(annotation).replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def config_sections() -> list[tuple[str, type[BaseModel], bool, str]]:
    """Every section of the configuration, depth first: ``(dotted path, model, is an array of
    tables, description)``; the top level is ``("", FlywheelConfig, False, ...)``."""
    out: list[tuple[str, type[BaseModel], bool, str]] = []

    def walk(path: str, model: type[BaseModel], many: bool, desc: str) -> None:
        out.append((path, model, many, desc))
        for name, f in model.model_fields.items():
            sub, sub_many = _model_of(f.annotation)
            if sub is not None:
                doc = (sub.__doc__ or "").strip().splitlines()[0] if sub.__doc__ else ""
                walk(f"{path}.{name}" if path else name, sub, sub_many, f.description or doc)

    walk("", FlywheelConfig, False, FlywheelConfig.__doc__ or "")
    return out


def reference_markdown() -> str:
    """``docs/configuration.md``: every section (nested ones too: ``[train.objective]``, arrays of tables
    ``[[ingest.redaction_rules]]``) and every field with its type, default and description."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the models in `flywheel/config/` by `flywheel config --reference` (a test keeps it in sync).",
        "Precedence: defaults < `flywheel.toml` < environment < CLI flags. Environment variables (read by",
        "pydantic-settings): `FLYWHEEL_<FIELD>` for top-level fields (`FLYWHEEL_HOME`, `FLYWHEEL_WAREHOUSE`),",
        "`FLYWHEEL_<SECTION>__<FIELD>` at any depth (`FLYWHEEL_TRAIN__OBJECTIVE__EPS_HIGH`), a whole section as",
        "JSON (`FLYWHEEL_GATE='{\"min_pass_rate\": 0.5}'`), `null` for None, and `MLFLOW_TRACKING_URI`.",
        "Unknown keys and bad values are rejected with the key and the reason.",
        "",
    ]
    for path, model, many, desc in config_sections():
        title = "top level" if not path else (f"[[{path}]]" if many else f"[{path}]")
        lines += [f"## {title}", ""]
        if desc and path:
            lines += [" ".join(desc.split()), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for name, f in model.model_fields.items():
            if _model_of(f.annotation)[0] is not None:
                continue  # its own section below
            default = "(required)" if f.is_required() else repr(f.get_default(call_default_factory=True))
            ann = _type_name(f.annotation)
            d = (f.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{name}` | `{ann}` | `{default}` | {d} |")
        lines.append("")
    return "\n".join(lines)

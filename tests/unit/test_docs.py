"""Documentation that is generated from code must match the code."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    from flywheel.config import reference_markdown

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc.strip() == reference_markdown().strip(), (
        "docs/configuration.md is stale: regenerate it with `flywheel config --reference > docs/configuration.md`"
    )


def _leaf_paths(model, prefix=""):
    """Every configurable leaf of the model tree, walked independently of the generator."""
    import typing

    from pydantic import BaseModel

    for name, f in model.model_fields.items():
        ann = f.annotation
        args = typing.get_args(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_paths(ann, f"{prefix}{name}.")
        elif typing.get_origin(ann) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            yield from _leaf_paths(args[0], f"{prefix}{name}[].")
        else:
            yield f"{prefix}{name}", f


def _doc_rows(doc: str) -> set[str]:
    """``section.field`` for every table row of docs/configuration.md (``[[x]]`` sections as ``x[]``)."""
    rows, section = set(), ""
    for line in doc.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            if title == "top level":
                section = ""
            elif title.startswith("[["):
                section = title[2:-2] + "[]"
            else:
                section = title[1:-1]
        elif line.startswith("| `"):
            name = line.split("`")[1]
            rows.add(f"{section}.{name}" if section else name)
    return rows


def test_every_configuration_field_is_documented_with_a_description():
    """Independent of the generator (a generator that skips a kind of field would skip it in the
    file it writes too): every leaf of the configuration tree, nested sections such as
    ``train.objective.eps_high`` included, has a row under its section, and a description."""
    from flywheel.config import FlywheelConfig

    documented = _doc_rows((ROOT / "docs" / "configuration.md").read_text())
    leaves = dict(_leaf_paths(FlywheelConfig))
    assert "train.objective.eps_high" in leaves and "ingest.redaction_rules[].pattern" in leaves
    missing = sorted(set(leaves) - documented)
    assert not missing, f"docs/configuration.md has no row for {missing}"
    undescribed = sorted(p for p, f in leaves.items() if not (f.description or "").strip())
    assert not undescribed, f"fields without a description: {undescribed}"
    sections = [n for n, f in FlywheelConfig.model_fields.items() if not (f.description or "").strip()]
    assert not sections, f"sections without a description: {sections}"


def test_the_documentation_check_catches_an_omitted_field(monkeypatch):
    """A field the generator leaves out (here: one nested field dropped from its output) is caught."""
    from flywheel.config import FlywheelConfig, reference_markdown

    doc = "\n".join(line for line in reference_markdown().splitlines() if not line.startswith("| `eps_high`"))
    missing = sorted(set(dict(_leaf_paths(FlywheelConfig))) - _doc_rows(doc))
    assert missing == ["train.objective.eps_high"]


def test_readme_quick_start_is_two_make_targets():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: setup" in makefile and "\ntest: setup" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci

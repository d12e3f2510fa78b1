"""Documentation that is generated from code must match the code."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    from flywheel.config import reference_markdown

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc.strip() == reference_markdown().strip(), (
        "docs/configuration.md is stale: regenerate it with `flywheel config --reference > docs/configuration.md`"
    )


def test_readme_quick_start_is_two_make_targets():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: setup" in makefile and "\ntest: setup" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci

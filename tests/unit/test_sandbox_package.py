"""``flywheel.sandbox.PYTHON`` is the knob a deployment sets to run the sandbox with another interpreter.
When the module became a package the name moved to ``flywheel.sandbox.supervisor``; setting it on the
package then silently changed nothing (found in review). The package forwards it."""

from __future__ import annotations

import sys

import flywheel.sandbox as sb
from flywheel.sandbox import supervisor


def test_setting_python_on_the_package_reaches_the_supervisor(monkeypatch):
    assert sb.PYTHON == supervisor.PYTHON == sys.executable
    monkeypatch.setattr(sb, "PYTHON", "/opt/sandbox-python/bin/python3")
    assert supervisor.PYTHON == "/opt/sandbox-python/bin/python3"
    assert sb.PYTHON == "/opt/sandbox-python/bin/python3"
    assert "PYTHON" not in vars(sb)  # no stale copy that a later read could return


def test_monkeypatch_undo_restores_the_supervisors_interpreter(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sb, "PYTHON", "/elsewhere/python")
    assert supervisor.PYTHON == sys.executable


def test_a_run_uses_the_interpreter_set_on_the_package(monkeypatch):
    monkeypatch.setattr(sb, "PYTHON", "/nonexistent/interpreter/python3")
    result = sb.run_shell("true", "true")
    assert not result.passed
    assert "/nonexistent/interpreter/python3" in (result.infra_error or "")


def test_other_names_still_behave_like_module_attributes():
    assert sb.run_shell is supervisor.run_shell
    try:
        sb.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("a missing name must raise AttributeError")

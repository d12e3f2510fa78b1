"""The kinds that run the answer in :mod:`flywheel.sandbox`: ``python_tests`` and ``shell`` (parameters:
:mod:`flywheel.verifiers.registry`). A sandbox that cannot start is an infrastructure error; a verdict
from a weak sandbox is real but carries ``not_for_training`` unless ``sandbox.train_on_weak``."""

from __future__ import annotations

import dataclasses

from flywheel.config import SandboxConfig
from flywheel.io_grading import NotIO, compile_io
from flywheel.sandbox import GRADINGS, SandboxResult, discover_tests, run_python_tests, run_shell
from flywheel.verifiers.registry import (
    SpecError,
    Verdict,
    VerifyContext,
    _done,
    _extract_code,
    _fail,
    register_verifier,
)
from flywheel.vocab.errors import InfraError
from flywheel.vocab.messages import answer_message, message_text


def _sandbox_verdict(res: SandboxResult, extraction: str, cfg: SandboxConfig) -> Verdict:
    if res.infra_error:
        raise InfraError(res.infra_error)
    share = res.tests_passed / res.tests_total if res.tests_total else 0.0
    v = _done(
        res.passed,
        {"tests": share},
        per_test=res.per_test,
        killed_reason=res.killed_reason,
        isolation={**res.report, "detail": res.isolation},
        extraction=extraction,
        duration_s=round(res.duration_s, 4),
        stderr=res.stderr[-2000:],
        sandbox=res.details,
    )
    if res.weak and not cfg.train_on_weak:
        v = dataclasses.replace(v, not_for_training=f"weak sandbox ({res.isolation}): the candidate could "
                                "have forged this verdict (sandbox.train_on_weak = false)")
    return v


def _check_python_tests(spec: dict) -> None:
    try:
        discover_tests(spec["tests"])
    except ValueError as e:
        raise SpecError(f"python_tests: {e}") from None
    grading = spec.get("grading", "auto")
    if grading not in GRADINGS:
        raise SpecError(f"python_tests: grading must be one of {GRADINGS}, got {grading!r}")
    if grading == "io":
        try:
            compile_io(spec["tests"])
        except NotIO as e:
            raise SpecError(f"python_tests: grading = io but the tests are not input -> expected-output "
                            f"checks: {e}") from None


@register_verifier("python_tests", required=("tests",), check=_check_python_tests)
def _python_tests(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    msg = answer_message(trajectory)
    if msg is None or not message_text(msg).strip():
        return _fail({"tests": 0.0}, error="no answer")
    code, how = _extract_code(message_text(msg), ("python", "py", "python3"))
    try:
        res = run_python_tests(code, spec["tests"], ctx.sandbox, site_packages=bool(spec.get("site_packages", False)),
                               grading=str(spec.get("grading", "auto")))
    except ValueError as e:
        raise SpecError(f"python_tests: {e}") from None
    return _sandbox_verdict(res, how, ctx.sandbox)


@register_verifier("shell", required=("command",))
def _shell(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    msg = answer_message(trajectory)
    if msg is None or not message_text(msg).strip():
        return _fail({"tests": 0.0}, error="no answer")
    script, how = _extract_code(message_text(msg), ("bash", "sh", "shell", "console"))
    try:
        res = run_shell(script, spec["command"], ctx.sandbox)
    except ValueError as e:
        raise SpecError(f"shell: {e}") from None
    return _sandbox_verdict(res, how, ctx.sandbox)

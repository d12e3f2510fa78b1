"""What a sandboxed verifier gets on this machine: :func:`isolation_report`, for ``flywheel init``,
``flywheel status`` and the cycle's warning.

The report comes from a real probe run (:func:`_probe_sandbox`), not only from whether ``unshare``
works: a checkout under /tmp once made every run fail to start on a machine with namespaces (issue 31,
finding 1).
"""

from __future__ import annotations

import functools
import os

from flywheel.config import SandboxConfig
from flywheel.sandbox import cgroups, isolation, supervisor


def isolation_report(cfg: SandboxConfig | None = None) -> dict[str, str | bool]:
    """What a sandboxed verifier gets on this machine, for ``flywheel init``/``status`` and the cycle.

    Keys: ``mode`` (``netns``/``weak``), ``namespaces``, ``uid``, ``cgroup``, ``verdicts`` (what
    becomes of ``python_tests``/``shell`` verdicts under ``cfg``), ``trusted`` (True when verdicts
    are graded in full isolation), ``warning`` (empty when nothing is wrong).
    """
    cfg = cfg or SandboxConfig()
    iso = isolation.isolation_mode()
    strong = iso == "netns"
    cg = cgroups.cgroup_support() if cfg.cgroup != "off" else "none: disabled (sandbox.cgroup = off)"
    cannot = _probe_sandbox(supervisor.PYTHON, cfg.model_dump_json()) if (strong or cfg.allow_weak) else None
    if cannot is not None:
        verdicts = "infrastructure errors: the sandbox cannot start on this machine"
        warning = f"python_tests/shell verdicts are infrastructure errors: the sandbox cannot start ({cannot})"
    elif strong:
        verdicts = "graded in namespaces; io-checkable python tests judged outside the sandbox"
        warning = ""
        if cg.startswith("none") and cfg.cgroup == "require":
            verdicts = "infrastructure errors: sandbox.cgroup = require and no cgroup is writable"
            warning = "python_tests/shell verdicts are infrastructure errors: " + cg
        elif cg.startswith("none"):
            warning = "no per-sandbox cgroup: memory is bounded per process only (" + cg[6:] + ")"
    elif not cfg.allow_weak:
        verdicts = "infrastructure errors (no isolation; sandbox.allow_weak = false)"
        warning = f"python_tests/shell verdicts are infrastructure errors on this machine ({iso})"
    else:
        verdicts = "WEAK: forgeable by the candidate; " + (
            "used as training data (sandbox.train_on_weak = true)" if cfg.train_on_weak else "never training data"
        )
        warning = f"python_tests/shell verdicts come from a weak sandbox and can be forged ({iso})"
    blocked = supervisor.interpreter_blocked(supervisor.PYTHON) if cannot is None else None
    if blocked is not None:  # python_tests runs fork the sandbox's interpreter; a shell's python execs it
        warning = "; ".join(filter(None, [warning, "shell verdicts are infrastructure errors: " + blocked]))
    return {
        "mode": "netns" if strong else "weak",
        "namespaces": "pid, mount, ipc, network (unshare)" if strong else iso,
        "uid": "throwaway uid per run (grader: a second one)" if os.geteuid() == 0 else "the verifier's own uid",
        "cgroup": cg,
        "verdicts": verdicts,
        "trusted": strong and cannot is None and not (cg.startswith("none") and cfg.cgroup == "require"),
        "warning": warning,
    }


@functools.lru_cache(maxsize=4)
def _probe_sandbox(python: str, cfg_json: str) -> str | None:
    """None when a real sandbox run of a two-line honest solution passes here (~0.1 s, once per
    process and configuration), else why not. ``isolation_mode()`` only proves that ``unshare``
    works; a checkout under /tmp once made every run fail to start after that (issue 31, finding 1),
    so ``flywheel init``/``status`` report what a run actually does."""
    cfg = SandboxConfig.model_validate_json(cfg_json)
    try:
        r = supervisor.run_python_tests("def f():\n    return 1\n",
                                        "from solution import f\n\ndef test_f():\n    assert f() == 1\n",
                                        cfg, python=python)
    except Exception as e:  # noqa: BLE001 - whatever broke, the report must say it instead of raising
        return f"{type(e).__name__}: {e}"[:300]
    if r.infra_error:
        return r.infra_error[:300]
    if not r.passed:
        return "an honest probe solution did not pass: " + "; ".join(r.per_test.values())[:300]
    return None

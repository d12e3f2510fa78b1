"""Whether this machine gives a sandbox run its namespaces: :func:`isolation_mode`.

``"netns"`` when this process is root and ``unshare`` works (pid, mount, ipc and network namespaces, a
throwaway uid per run), else ``"weak: <why>"``, and then a ``python_tests``/``shell`` verdict is an
infrastructure error unless ``sandbox.allow_weak`` (see :mod:`flywheel.sandbox`).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """``"netns"`` when pid/mount/network namespaces and a uid drop are available, else ``"weak: <why>"``.

    Probed once per process by running ``unshare`` on ``true``.
    """
    if os.name != "posix" or not hasattr(os, "fork"):
        return "weak: not a POSIX system"
    if os.geteuid() != 0:
        return "weak: not running as root (no namespaces, no uid drop)"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "weak: unshare(1) not found"
    try:
        r = subprocess.run(
            [unshare, "--pid", "--fork", "--mount-proc", "--ipc", "--net", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"weak: unshare probe failed ({e})"
    if r.returncode != 0:
        return f"weak: unshare refused ({r.stderr.decode(errors='replace').strip()[:200]})"
    return "netns"

"""Prefect environment of the embedded default. Imports nothing from Prefect: it must be applied
before Prefect is imported (Prefect reads its settings at import)."""

from __future__ import annotations

import os
from pathlib import Path


def prefect_environment(home: str | os.PathLike[str]) -> dict[str, str]:
    """Prefect's database and results under the flywheel home (nothing written elsewhere), no
    telemetry. A configured ``PREFECT_API_URL`` (a real server) keeps its own home."""
    env = {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOCAL_STORAGE_PATH": str(Path(home) / "prefect" / "storage"),
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING"),
        # The temporary server needs ~10-20 s on 2 busy cores; Prefect's default wait is 20 s.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    if not os.environ.get("PREFECT_API_URL"):
        env["PREFECT_HOME"] = str(Path(home) / "prefect")
    return env

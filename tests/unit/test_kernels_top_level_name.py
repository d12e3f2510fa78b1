"""The repository's ``kernels/`` folder must not take the top-level name ``kernels`` from Hugging Face's package.

transformers >= 5.25 depends on HF ``kernels`` and runs ``from kernels import CUDAProperties, ...`` when it sees
it installed. With the repository root on sys.path (``python -m pytest`` from the checkout, a Prefect worker
running a flow from the checkout), ``import kernels`` used to find this folder first, and every model load
failed with ``ImportError: cannot import name 'CUDAProperties' from 'kernels'``.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import kernels
from transformers.utils import import_utils
out = {"file": kernels.__file__, "available": import_utils.is_kernels_available()}
if out["available"]:
    from transformers.integrations import hub_kernels  # the import that failed
    out["hub_kernels"] = hub_kernels.__name__
import flywheel.kernels
out["ours"] = flywheel.kernels.__file__
print(json.dumps(out))
"""


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_repo_root_on_sys_path_does_not_shadow_hf_kernels():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["ours"]).resolve() == ROOT / "kernels" / "__init__.py"
    if _hf_kernels_installed():
        assert not Path(out["file"]).resolve().is_relative_to(ROOT / "kernels"), out
        assert out["hub_kernels"] == "transformers.integrations.hub_kernels"
    else:
        # Without HF's package the name stays ours, and transformers must not mistake it for theirs.
        assert Path(out["file"]).resolve() == ROOT / "kernels" / "__init__.py"
        assert out["available"] is False

"""LoRA adapters loaded at run time through vLLM's endpoints: the table tying them to the base policy they
were loaded onto, and the checks on the directory an adapter is loaded from (symlinks followed, safetensors
only, never a path outside ``serve.adapter_dirs``). See :mod:`flywheel.serve`, "Adapters".
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.serve.schema import ApiError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class Adapter:
    name: str  # the public lora_name
    internal: str  # the peft adapter name on the base model (never chosen by a client)
    view: Any
    load_id: str
    sha256: str


def weak_ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # not weak-referenceable: held until the provider returns another policy
        return lambda: obj


class AdapterTable:
    """LoRA adapters loaded through the API, tied to the base policy they were loaded onto."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards the table
        self.admin = threading.Lock()  # one load or unload at a time
        self._base: Callable[[], Any] | None = None
        self.table: dict[str, Adapter] = {}

    def current(self, base: Any) -> tuple[dict[str, Adapter], list[Adapter], Any]:
        """``(table, dropped, old base)``: a new base forgets every adapter of the old one."""
        with self.lock:
            if self._base is not None and self._base() is base:
                return dict(self.table), [], None
            dropped, old = list(self.table.values()), self._base() if self._base is not None else None
            self._base, self.table = weak_ref(base), {}
            return {}, dropped, old

    def publish(self, base: Any, entry: Adapter) -> bool:
        with self.lock:
            if self._base is None or self._base() is not base:
                return False
            self.table[entry.name] = entry
            return True

    def withdraw(self, base: Any, name: str) -> Adapter | None:
        with self.lock:
            if self._base is None or self._base() is not base:
                return None
            return self.table.pop(name, None)


def adapter_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for fname in ADAPTER_FILES:
        h.update(fname.encode() + b"\0")
        with open(directory / fname, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def allowed_adapter_dir(lora_path: str, dirs: Sequence[Path]) -> Path:
    """The real directory of ``lora_path``; 400/403 (never echoing a path) unless it is allowed."""
    if not Path(lora_path).is_absolute():
        raise ApiError(400, "'lora_path' must be an absolute path on the server", param="lora_path")

    def inside(p: Path) -> bool:
        return any(p == d or p.is_relative_to(d) for d in dirs)

    refused = ApiError(403, "'lora_path' is outside the directories this server loads adapters from "
                       "(serve.adapter_dirs)", type_="permission_error", param="lora_path",
                       code="adapter_path_not_allowed")
    real = Path(os.path.realpath(lora_path))
    if not inside(real):
        raise refused
    for fname in ADAPTER_FILES:
        f = Path(os.path.realpath(real / fname))
        if not inside(f):
            raise refused
        if not f.is_file():
            raise ApiError(400, "'lora_path' holds no LoRA adapter in safetensors form "
                           f"({' and '.join(ADAPTER_FILES)})", param="lora_path", code="adapter_not_found")
    return real

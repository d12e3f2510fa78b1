"""Running ``flywheel serve``: the API key's sources, the policy a model reference names, the event recorder,
uvicorn's config with the server's bounds, and the server itself (in the foreground or in a thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from flywheel.config import FlywheelConfig
from flywheel.net import (
    allowed_hosts_for,
    bind,
    head_timeout_protocol,
    is_loopback,
)
from flywheel.policy.hf import HFPolicy
from flywheel.policy.registry import ModelRefError, load_policy_for_version, resolve_model
from flywheel.serve.app import create_app
from flywheel.serve.schema import AdapterLoading, PolicyProvider, Recorder, ServeError, ServeLimits
from flywheel.store import NewEvent, StoreLockedError, open_store
from flywheel.tracking import Tracker

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("flywheel.serve")


def read_key_file(path: Path) -> str:
    """The first line of ``path``, stripped. A file other users can read is used, with a warning
    (container secrets are often mounted 0444)."""
    try:
        st = path.stat()
        with open(path, encoding="utf-8") as f:
            key = f.read(4096).splitlines()[0].strip() if st.st_size else ""
    except (OSError, UnicodeDecodeError, IndexError) as e:
        raise ServeError(f"cannot read the API key file {path}: {e}") from None
    if not key:
        raise ServeError(f"the API key file {path} is empty")
    if st.st_mode & 0o077:
        log.warning("API key file %s is readable by other users (mode %o); chmod 600 it", path, st.st_mode & 0o777)
    return key


def resolve_api_key(cfg: FlywheelConfig, api_key: str | None, host: str, *, key_file: Path | None = None) -> str | None:
    """The server's key, first found of: ``api_key`` (library callers), ``key_file`` (the CLI's
    ``--api-key-file``), the env var named by ``serve.api_key_env``, ``serve.api_key_file``
    (relative to home). Required off loopback."""
    key = api_key or None
    if key is None and key_file is not None:
        key = read_key_file(Path(key_file).expanduser())
    if key is None:
        key = os.environ.get(cfg.serve.api_key_env) or None
    if key is None and cfg.serve.api_key_file is not None:
        p = Path(cfg.serve.api_key_file).expanduser()
        key = read_key_file(p if p.is_absolute() else cfg.home / p)
    if not is_loopback(host) and not key:
        raise ServeError(
            f"binding to {host} (not loopback) requires an API key: set {cfg.serve.api_key_env}, pass "
            "--api-key-file, or set serve.api_key_file"
        )
    return key


def registry_names(cfg: FlywheelConfig) -> Callable[[], set[str]]:
    """``reserved()`` for :class:`AdapterLoading`: every registered model name and every alias of one in
    the MLflow registry (an adapter named like them would shadow them for a client)."""
    from flywheel.tracking import Tracker

    tracker = Tracker(cfg)

    def names() -> set[str]:
        out: set[str] = set()
        for rm in tracker.client.search_registered_models():
            out.add(rm.name)
            aliases = getattr(rm, "aliases", None) or {}
            out.update(aliases.keys() if isinstance(aliases, dict) else (getattr(a, "alias", a) for a in aliases))
        return out

    return names


def adapter_dirs(cfg: FlywheelConfig) -> tuple[Path, ...]:
    """``serve.adapter_dirs`` (relative entries under home), default ``<home>/models`` and the MLflow
    artifact root: where flywheel's own trained and registered adapters live."""
    dirs = [Path(d).expanduser() for d in cfg.serve.adapter_dirs] or [cfg.models_dir, Path(cfg.mlflow_artifact_root)]
    return tuple(d if d.is_absolute() else cfg.home / d for d in dirs)


def store_recorder(cfg: FlywheelConfig, *, wait_s: float = 30.0) -> Recorder:
    """A :data:`Recorder` that opens the event store for each append and closes it again (so a
    long-running server is not the embedded warehouse's owner for days; while a cycle owns it, the
    append goes through the cycle's process). A warehouse held by a process that does not share it is
    waited for ``wait_s``; then the error propagates (the server answers 503 and changes nothing)."""

    def record(type_: str, stream: str, payload: dict[str, Any]) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with open_store(cfg, open_timeout_s=wait_s) as store:
                    store.append(stream, NewEvent(type_, payload))
                return
            except StoreLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)

    return record


def static_provider(name: str, policy: Any) -> PolicyProvider:
    """A provider that always serves ``policy`` under ``name``."""
    return lambda: (name, policy)


def build_policy(cfg: FlywheelConfig, model: str | None = None, tracker: Tracker | None = None) -> tuple[str, Any]:
    """Load ``model`` (default ``cfg.policy.base_model``) with the HF backend, taking the references
    of ``flywheel rollout --policy`` (:func:`flywheel.policy.registry.resolve_model`): a registered
    version (``champion``, ``challenger``, ``model:<name>/<N>``, ``<name>/<N>``) is loaded as it is
    now (pinned: ``--champion`` follows the alias) and served as ``<name>-<N>``; a spec or directory
    is served under the spec or the directory's name. ``champion`` before the first promotion is
    the base model. A server URL is refused (:class:`ServeError`)."""
    try:
        m = resolve_model(cfg, tracker or Tracker(cfg), model or cfg.policy.base_model)
    except ModelRefError as e:
        raise ServeError(f"cannot serve {model!r}: {e}") from None
    if m.url is not None:
        raise ServeError(f"cannot serve {m.url}: it is a server already (serve a model spec, a directory "
                         "or a registered version)")
    if m.version is not None:
        return f"{m.name}-{m.version}", load_policy_for_version(cfg, tracker or Tracker(cfg), m.name, m.version)  # type: ignore[arg-type]
    spec = m.spec
    name = spec if spec in ("smollm2-135m", "tiny") else Path(spec).expanduser().resolve().name  # type: ignore[arg-type]
    policy = HFPolicy.from_config(cfg.policy, spec, cfg.home, name=name)
    return name, policy


def uvicorn_config(app: FastAPI, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the bounds of its :class:`ServeLimits` (``app.state.limits``)."""
    import uvicorn

    lim: ServeLimits = getattr(app.state, "limits", None) or ServeLimits()
    return uvicorn.Config(app, http=head_timeout_protocol(lim.header_timeout_s),
                          limit_concurrency=lim.limit_concurrency, **kwargs)


def serve(cfg: FlywheelConfig, model: str | None = None, host: str | None = None, port: int | None = None,
          *, api_key: str | None = None, provider: PolicyProvider | None = None,
          on_ready: Callable[[str, int], None] | None = None) -> None:
    """Load the policy and serve until interrupted. ``provider`` overrides ``model`` (hot swap).
    ``api_key`` (a library caller's) wins over the configured sources (:func:`resolve_api_key`)."""
    import uvicorn

    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    key = resolve_api_key(cfg, api_key, host)
    loading = None
    if cfg.serve.allow_adapter_loading:
        if not key:
            raise ServeError(f"serve.allow_adapter_loading needs an API key, on loopback too: set {cfg.serve.api_key_env}, "
                             "pass --api-key-file, or set serve.api_key_file")
        loading = AdapterLoading(adapter_dirs(cfg), store_recorder(cfg), api_key=key, reserved=registry_names(cfg))
    if provider is None:
        provider = static_provider(*build_policy(cfg, model))
    app = create_app(provider, api_key=key, limits=ServeLimits.from_config(cfg.serve),
                     allowed_hosts=allowed_hosts_for(host, cfg.serve.allowed_hosts), adapter_loading=loading)
    sock = bind(host, port)
    if on_ready is not None:
        on_ready(host, sock.getsockname()[1])
    server = uvicorn.Server(uvicorn_config(app, log_level="info", timeout_graceful_shutdown=30))
    server.run(sockets=[sock])


@contextmanager
def run_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a background thread (tests, embedding); yields the base URL.

    ``port=0`` picks a free port. The server is shut down and joined on exit.
    """
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="flywheel-serve")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServeError("server thread failed to start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

"""MLflow glue: the only module that talks to MLflow.

- Runs are opened with the configured tracking URI (default ``sqlite:///<home>/mlflow.db``, artifacts
  under ``<home>/mlartifacts``) through ``MlflowClient``; no global active-run state is used.
- Every run is tagged with the entity ids it consumes and produces (``flywheel.consumes`` /
  ``flywheel.produces``, comma-separated, plus one ``flywheel.input.<i>`` tag per input), so a run can
  be traced from the MLflow UI back into the event store.
- Models are registered versions; aliases ``challenger`` and ``champion`` mark the candidate and the
  deployed model.

MLflow is imported lazily (1.5 s cold) so that ``flywheel --help`` stays fast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

EXPERIMENT = "flywheel"
_TAG_MAX = 5000  # MLflow's tag value limit is 8000 characters; leave room for the key


class TrackingError(RuntimeError):
    pass


def _quiet_mlflow() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    import logging

    for name in ("mlflow", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


class RunHandle:
    """An open MLflow run. Obtained from :meth:`Tracker.run`."""

    def __init__(self, client: Any, run_id: str, artifact_uri: str):
        self._client = client
        self.run_id = run_id
        self.artifact_uri = artifact_uri

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [
            Metric(str(k), float(v), ts, int(step or 0))
            for k, v in metrics.items()
            if v is not None and v == v  # drop None and NaN
        ]
        for i in range(0, len(items), 500):
            self._client.log_batch(self.run_id, metrics=items[i : i + 500])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(str(k), str(v)[:_TAG_MAX]) for k, v in tags.items()])

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self._client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self._client.log_dict(self.run_id, obj, artifact_file)


class Tracker:
    """MLflow access for one configuration."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.tracking_uri: str = cfg.mlflow_tracking_uri
        self.artifact_root = Path(cfg.mlflow_artifact_root)
        self._client = None
        self._experiment_id: str | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            _quiet_mlflow()
            from mlflow.tracking import MlflowClient

            if self.tracking_uri.startswith("sqlite:"):
                self.cfg.ensure_home()
            self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        return self._client

    def experiment_id(self, name: str = EXPERIMENT) -> str:
        if self._experiment_id is None:
            exp = self.client.get_experiment_by_name(name)
            if exp is not None:
                self._experiment_id = exp.experiment_id
            else:
                location = None
                if not self.tracking_uri.startswith(("http://", "https://", "databricks")):
                    self.artifact_root.mkdir(parents=True, exist_ok=True, mode=0o700)
                    location = self.artifact_root.absolute().as_uri()
                try:
                    self._experiment_id = self.client.create_experiment(name, artifact_location=location)
                except Exception:  # created concurrently by another process
                    self._experiment_id = self.client.get_experiment_by_name(name).experiment_id
        return self._experiment_id

    @contextmanager
    def run(
        self,
        name: str,
        *,
        consumes: Sequence[str] = (),
        produces: Sequence[str] = (),
        tags: Mapping[str, Any] | None = None,
        correlation_id: str | None = None,
    ) -> Iterator[RunHandle]:
        """Open a run; it ends FINISHED on success and FAILED (re-raising) on error."""
        all_tags = {
            "flywheel.stage": name,
            "flywheel.consumes": ",".join(consumes)[:_TAG_MAX],
            "flywheel.produces": ",".join(produces)[:_TAG_MAX],
        }
        for i, c in enumerate(list(consumes)[:50]):
            all_tags[f"flywheel.input.{i}"] = c
        if correlation_id:
            all_tags["flywheel.correlation_id"] = correlation_id
        all_tags.update({k: str(v)[:_TAG_MAX] for k, v in (tags or {}).items()})
        run = self.client.create_run(self.experiment_id(), tags=all_tags, run_name=name)
        handle = RunHandle(self.client, run.info.run_id, run.info.artifact_uri)
        try:
            yield handle
        except BaseException:
            self.client.set_terminated(handle.run_id, "FAILED")
            raise
        else:
            self.client.set_terminated(handle.run_id, "FINISHED")

    def get_run(self, run_id: str) -> Any:
        return self.client.get_run(run_id)

    # -- model registry ------------------------------------------------------------------------
    def register_model(
        self,
        name: str,
        local_dir: str | os.PathLike[str],
        *,
        run_id: str,
        tags: Mapping[str, Any] | None = None,
        artifact_path: str = "model",
    ) -> int:
        """Copy ``local_dir`` into the run's artifacts and register it as a new version of ``name``."""
        from mlflow.exceptions import MlflowException

        self.client.log_artifacts(run_id, str(local_dir), artifact_path)
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri}/{artifact_path}"
        mv = self.client.create_model_version(
            name, source=source, run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()}
        )
        return int(mv.version)

    def set_alias(self, name: str, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(name, alias, str(version))

    def delete_alias(self, name: str, alias: str) -> None:
        self.client.delete_registered_model_alias(name, alias)

    def get_alias_version(self, name: str, alias: str) -> int | None:
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version_by_alias(name, alias)
        except MlflowException:
            return None
        return int(mv.version)

    def model_version(self, name: str, version: int) -> Any:
        return self.client.get_model_version(name, str(version))

    def model_versions(self, name: str) -> list[Any]:
        from mlflow.exceptions import MlflowException

        try:
            return sorted(self.client.search_model_versions(f"name='{name}'"), key=lambda mv: int(mv.version))
        except MlflowException:
            return []

    def model_dir(self, name: str, version: int) -> Path:
        """A local directory holding the files of a registered version (no copy for local stores)."""
        source = self.model_version(name, version).source
        if source.startswith("file://"):
            from urllib.parse import unquote, urlparse

            return Path(unquote(urlparse(source).path))
        if source.startswith("/"):
            return Path(source)
        import mlflow.artifacts

        dest = self.cfg.models_dir / "registry" / name / str(version)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            import shutil

            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            # download_artifacts puts the files under <dst>/<last path component> and returns that path.
            got = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=self.tracking_uri)
            os.replace(got, dest)
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

"""MLflow glue: the only module that talks to MLflow.

- Runs are opened with the configured tracking URI (default ``sqlite:///<home>/mlflow.db``, artifacts
  under ``<home>/mlartifacts``) through ``MlflowClient``; no global active-run state is used.
- Every run is tagged with the entity ids it consumes and produces (``flywheel.consumes`` /
  ``flywheel.produces``, comma-separated, plus one ``flywheel.input.<i>`` tag per input), so a run can
  be traced from the MLflow UI back into the event store.
- Models are registered versions; aliases ``challenger`` and ``champion`` mark the candidate and the
  deployed model.
- Datasets (:class:`DatasetSpec`, :meth:`RunHandle.log_datasets`): a run's inputs are MLflow dataset
  inputs (``mlflow.data``: name, digest, a ``flywheel`` source holding the event-store entity id,
  the Arrow schema as MLflow column specs, the row count as profile) with context ``training``,
  ``demonstrations`` or ``evaluation``, so MLflow's own view of a model version's run lists what it
  learned from, by the same ids ``flywheel trace`` walks.
- Gate evidence (:meth:`Tracker.log_gate_evidence`): the per-item table and the rule results as
  MLflow tables, the suites as ``evaluation`` inputs, and the decision as tags on the challenger's
  model version (``gate.outcome``, ``gate.p_value``, ``gate.id``).
- Traces (:meth:`Tracker.iter_traces`): MLflow Tracing traces of an experiment, oldest first, for
  ``flywheel ingest --from mlflow``.

MLflow is imported lazily (1.5 s cold) so that ``flywheel --help`` stays fast.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlparse, urlsplit, urlunsplit

if TYPE_CHECKING:
    import pyarrow as pa

    # annotation only: flywheel.config sits beside flywheel.tracking in the core layer (no imports between them)
    from flywheel.config import FlywheelConfig

EXPERIMENT = "flywheel"
_TAG_MAX = 5000  # MLflow's tag value limit is 8000 characters; leave room for the key


DATASET_CONTEXTS = ("training", "demonstrations", "evaluation")
_DIGEST_MAX = 36  # MLflow's datasets.digest column is VARCHAR(36)
_SOURCE_TYPE = "flywheel"


@dataclass(frozen=True)
class DatasetSpec:
    """One input of a run, as MLflow records it (a dataset input of the run).

    ``entity_id``: the event-store entity the data is (``rollouts:…``, ``suite:heldout@3``) or, for
    data assembled from many entities (SFT demonstrations), a name for the set; ``context``: one of
    :data:`DATASET_CONTEXTS`; ``digest``: a content hash (the artifact's sha256, the suite's version
    hash), cut to 36 characters; ``rows``: the row count (MLflow's profile); ``schema``: the Arrow
    schema, shown as MLflow column specs; ``source``: more fields of the source (artifact sha256,
    member entity ids). ``name`` defaults to ``entity_id``.
    """

    entity_id: str
    context: str
    digest: str
    rows: int
    schema: pa.Schema | None = None
    source: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None

    def __post_init__(self) -> None:
        if self.context not in DATASET_CONTEXTS:
            raise ValueError(f"dataset {self.entity_id}: context {self.context!r} is not one of {DATASET_CONTEXTS}")


def _mlflow_type(t: Any) -> Any:
    """An Arrow type as an MLflow schema type (``None`` when MLflow has no equivalent)."""
    import pyarrow as pa
    from mlflow.types.schema import Array, DataType, Map

    if pa.types.is_boolean(t):
        return DataType.boolean
    if pa.types.is_integer(t):
        return DataType.long if t.bit_width > 32 else DataType.integer
    if pa.types.is_float32(t) or pa.types.is_float16(t):
        return DataType.float
    if pa.types.is_floating(t):
        return DataType.double
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return DataType.string
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return DataType.binary
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return DataType.datetime
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _mlflow_type(t.value_type)
        return Array(inner) if inner is not None else None
    if pa.types.is_map(t) and pa.types.is_string(t.key_type):
        inner = _mlflow_type(t.item_type)
        return Map(inner) if inner is not None else None
    return None


def _mlflow_schema(schema: pa.Schema | None) -> Any:
    if schema is None:
        return None
    from mlflow.types.schema import ColSpec, Schema

    cols = []
    for f in schema:
        t = _mlflow_type(f.type)
        if t is not None:
            cols.append(ColSpec(t, f.name, required=not f.nullable))
    return Schema(cols) if cols else None


@functools.cache
def _dataset_classes() -> tuple[type, type]:
    """MLflow's dataset classes for flywheel data, built once on first use (MLflow is imported lazily)."""
    from mlflow.data.dataset_source import DatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    class FlywheelSource(DatasetSource):
        """Where a flywheel dataset lives: an entity of the event store (and its artifact)."""

        def __init__(self, fields: Mapping[str, Any]):
            self._fields = dict(fields)

        @staticmethod
        def _get_source_type() -> str:
            return _SOURCE_TYPE

        def load(self, **kwargs: Any) -> Any:
            raise NotImplementedError("read flywheel datasets with flywheel (the artifact store), not MLflow")

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any) -> Any:
            raise NotImplementedError

        def to_dict(self) -> dict[str, Any]:
            return dict(self._fields)

        @classmethod
        def from_dict(cls, source_dict: dict[str, Any]) -> Any:
            return cls(source_dict)

    class FlywheelDataset(MetaDataset):
        """Metadata only (the data stays in flywheel's artifact store), with the row count as profile."""

        def __init__(self, source: Any, name: str, digest: str, schema: Any, rows: int):
            self._rows = int(rows)
            super().__init__(source=source, name=name, digest=digest, schema=schema)

        @property
        def profile(self) -> dict[str, int]:
            return {"num_rows": self._rows}

        def to_dict(self) -> dict[str, str]:
            d = super().to_dict()
            d["profile"] = json.dumps(self.profile)
            return d

    return FlywheelSource, FlywheelDataset


def mlflow_dataset(spec: DatasetSpec) -> Any:
    """The ``mlflow.data`` dataset of ``spec`` (a metadata-only dataset with a ``flywheel`` source)."""
    source_cls, dataset_cls = _dataset_classes()
    source = source_cls({"entity_id": spec.entity_id, **spec.source})
    return dataset_cls(source, spec.name or spec.entity_id, spec.digest[:_DIGEST_MAX], _mlflow_schema(spec.schema),
                       spec.rows)


def public_uri(uri: str) -> str:
    """``uri`` without user/password (safe to print, tag or publish)."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host += f":{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return uri


def _quiet_mlflow() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
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

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str, *, columns: Sequence[str]) -> None:
        """A table artifact (``mlflow.log_table``: JSON the MLflow UI shows as a table), one row per
        mapping, in ``columns`` order (an empty table keeps its columns)."""
        self._client.log_table(self.run_id, {c: [r.get(c) for r in rows] for c in columns}, artifact_file)

    def log_datasets(self, datasets: Sequence[DatasetSpec]) -> None:
        """Record ``datasets`` as the run's dataset inputs, each with its context tag."""
        if not datasets:
            return
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        inputs = [DatasetInput(mlflow_dataset(d)._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, d.context)])
                  for d in datasets]
        self._client.log_inputs(self.run_id, datasets=inputs)


class Tracker:
    """MLflow access for one configuration."""

    def __init__(self, cfg: FlywheelConfig):
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

    def log_gate_evidence(
        self,
        run: RunHandle,
        *,
        model: str,
        version: int,
        items: Sequence[Mapping[str, Any]],
        rules: Sequence[Mapping[str, Any]],
        datasets: Sequence[DatasetSpec],
        version_tags: Mapping[str, Any],
    ) -> None:
        """What a reviewer needs beside the model, in MLflow: ``gate_items.json`` (one row per paired
        held-out item: ``item``, ``slice``, ``champion_pass``, ``challenger_pass``, ``change``),
        ``gate_rules.json`` (``rule``, ``passed``, ``value``, ``threshold``, ``reason``), the suites
        as ``evaluation`` inputs of ``run``, and ``version_tags`` on ``model``/``version``."""
        run.log_table(items, "gate_items.json", columns=("item", "slice", "champion_pass", "challenger_pass", "change"))
        run.log_table([{**r, "value": None if r.get("value") is None else str(r["value"]),
                        "threshold": None if r.get("threshold") is None else str(r["threshold"])} for r in rules],
                      "gate_rules.json", columns=("rule", "passed", "value", "threshold", "reason"))
        run.log_datasets(datasets)
        self.set_model_version_tags(model, version, version_tags)

    # -- traces (MLflow Tracing) ------------------------------------------------------------------
    def find_experiment(self, name: str) -> str | None:
        """The id of experiment ``name`` (never creates one)."""
        exp = self.client.get_experiment_by_name(name)
        return None if exp is None else str(exp.experiment_id)

    def iter_traces(self, experiment_id: str, *, since_ms: int | None = None, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every trace of the experiment (spans included) as ``Trace.to_dict()``, oldest first, from
        ``since_ms`` (epoch milliseconds, inclusive) on; one server request per ``page_size`` traces."""
        flt = f"attributes.timestamp_ms >= {int(since_ms)}" if since_ms is not None else None
        token = None
        while True:
            page = self.client.search_traces(locations=[experiment_id], filter_string=flt, max_results=page_size,
                                             order_by=["timestamp_ms ASC"], page_token=token)
            for trace in page:
                yield trace.to_dict()
            token = page.token
            if not token:
                return

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

    def set_model_version_tags(self, name: str, version: int, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(name, str(version), str(k), str(v)[:_TAG_MAX])

    def model_version_link(self, name: str, version: int) -> str:
        """Where a person opens the version: the MLflow UI page on a tracking server, else the
        ``models:/`` URI (a local store has no UI until ``mlflow ui`` is started on it)."""
        uri = public_uri(self.tracking_uri)
        if uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/models/{quote(name)}/versions/{int(version)}"
        return f"models:/{name}/{int(version)}"

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
            return Path(unquote(urlparse(source).path))
        if source.startswith("/"):
            return Path(source)
        import mlflow.artifacts

        dest = self.cfg.models_dir / "registry" / name / str(version)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            # download_artifacts puts the files under <dst>/<last path component> and returns that path.
            got = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=self.tracking_uri)
            os.replace(got, dest)
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

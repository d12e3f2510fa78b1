"""Content-addressed artifact store: ``<home>/artifacts/sha256/ab/abcd….<ext>``.

Guarantees
- Atomic: every artifact is written to a temporary name in the same directory, fsynced and renamed;
  a crash leaves at most a ``.tmp-*`` file (swept by :meth:`ArtifactStore.sweep_temp`), never a
  half-written artifact under its final name.
- Idempotent: the name is the SHA-256 of the bytes, so writing the same content twice yields the same
  reference and no second copy. Parquet is written deterministically (same table -> same bytes).
- Self-healing: writing content whose file already exists re-hashes that file first; a file that no
  longer hashes to its name (bit rot, truncation) is replaced atomically by the new copy, so
  re-running the stage that produced an artifact repairs it. The check costs one read of the
  existing file (a few ms per MB), paid only when the same content is written again.
- Verified: every read re-hashes the file; a mismatch raises :class:`ArtifactCorruptError` naming the
  file and both hashes. A corrupted artifact is never silently used.
- Private: files are 0600 and directories 0700 (traces are user data).

Remote (``artifacts.url``, a team's store; backends in :mod:`flywheel.artifact_backends`): the remote is
the source of truth and ``<home>/artifacts`` a hash-verified cache in front of it, so a worker with an
empty home reads everything another worker wrote.
- A put writes the local temp file as above, publishes it to the remote (atomically, per backend), and
  only then renames it into the cache: a failed publish leaves nothing under the final name anywhere.
- A put of content the remote already holds re-hashes the remote object first (stat, then one
  streaming download without touching disk: the cost of a download of the object, paid only when the
  same content is put again); a remote object whose size or hash is wrong is replaced.
- A read that misses the cache, or finds a corrupt cached copy, downloads to a temp file while hashing,
  and renames it into the cache only if it hashes to its name; otherwise it raises
  :class:`ArtifactCorruptError` naming the remote object and both hashes, and caches nothing.
- ``exists`` and ``find`` consult the remote after the cache; ``find``/``verify`` return cached paths.

Not guaranteed: garbage collection of artifacts no event references (they are kept), locally or remotely.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from flywheel.artifact_backends import ArtifactError, ArtifactRemoteError, RemoteBackend, backend_from_url
from flywheel.vocab.ids import canonical_json, sha256_file

if TYPE_CHECKING:  # annotations only: config and artifacts are independent core layers (pyproject)
    from flywheel.config import FlywheelConfig

_CHUNK = 1 << 20
log = logging.getLogger(__name__)


__all__ = ["ArtifactCorruptError", "ArtifactError", "ArtifactNotFound", "ArtifactRef", "ArtifactRemoteError",
           "ArtifactStore", "load_traces", "open_artifacts"]


class ArtifactCorruptError(ArtifactError):
    """The bytes on disk do not hash to the artifact's name."""


class ArtifactNotFound(ArtifactError):
    pass


@dataclass(frozen=True)
class ArtifactRef:
    sha256: str
    ext: str
    size: int
    rows: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArtifactRef:
        return cls(sha256=d["sha256"], ext=d.get("ext", "parquet"), size=d.get("size", 0), rows=d.get("rows"))


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename in it survives a crash (a no-op where it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArtifactStore:
    """The store under ``root``; with ``remote``, ``root`` is the cache of that remote (module docstring)."""

    def __init__(self, root: str | os.PathLike[str], remote: RemoteBackend | None = None):
        self.root = Path(root)
        self.objects = self.root / "sha256"
        self.remote = remote

    def describe(self) -> dict[str, Any]:
        """Where artifacts live, for ``flywheel status``: ``{"kind": "local" | "file" | "s3" | "gs" | "az" |
        "memory" | "mlflow-artifacts", "url": the remote URL without credentials (None when local),
        "local": this directory, "local_role": "store" | "cache"}`` (+ ``"server"`` for the MLflow proxy)."""
        if self.remote is None:
            return {"kind": "local", "url": None, "local": str(self.root), "local_role": "store"}
        return {**self.remote.describe(), "local": str(self.root), "local_role": "cache"}

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()

    # -- paths ---------------------------------------------------------------------------------
    def path(self, sha256: str, ext: str) -> Path:
        return self.objects / sha256[:2] / f"{sha256}.{ext}"

    @staticmethod
    def key(sha256: str, ext: str) -> str:
        """The object's key in a remote store (the local layout under ``root``)."""
        return f"sha256/{sha256[:2]}/{sha256}.{ext}"

    def _cached(self, sha256: str) -> Path | None:
        d = self.objects / sha256[:2]
        matches = sorted(d.glob(f"{sha256}.*")) if d.exists() else []
        matches = [m for m in matches if ".tmp-" not in m.name]
        return matches[0] if matches else None

    def find(self, sha256: str) -> Path:
        """The local file of the artifact (not re-hashed: :meth:`verify` does that), fetched into the
        cache from the remote when it is not here."""
        if (p := self._cached(sha256)) is not None:
            return p
        if self.remote is not None:
            return self._fetch(sha256)
        raise ArtifactNotFound(f"artifact {sha256} is not in {self.objects}")

    def exists(self, sha256: str) -> bool:
        if self._cached(sha256) is not None:
            return True
        return self.remote is not None and self.remote.find(f"sha256/{sha256[:2]}", sha256) is not None

    def _tmp(self) -> Path:
        self.objects.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.objects / f".tmp-{uuid.uuid4().hex}"

    def _intact(self, path: Path, sha256: str) -> bool:
        """Whether ``path`` exists and hashes to ``sha256`` (an unreadable file is not intact)."""
        try:
            return path.exists() and sha256_file(path) == sha256
        except OSError:
            return False

    # -- the remote ----------------------------------------------------------------------------
    def _fetch(self, sha256: str) -> Path:
        """Download the remote object into the cache, hashing as it streams; corrupt bytes are never cached."""
        assert self.remote is not None
        hit = self.remote.find(f"sha256/{sha256[:2]}", sha256)
        if hit is None:
            raise ArtifactNotFound(f"artifact {sha256} is neither in {self.objects} nor in the remote store "
                                   f"{self.remote.object_url(f'sha256/{sha256[:2]}/')}")
        key = hit[0]
        ext = key.rsplit("/", 1)[-1][len(sha256) + 1:]
        tmp = self._tmp()
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as f:
                for chunk in self.remote.chunks(key):
                    h.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if (actual := h.hexdigest()) != sha256:
                raise ArtifactCorruptError(
                    f"remote artifact {self.remote.object_url(key)} is corrupted: its content hashes to {actual}, "
                    f"not {sha256}. It was not cached; re-run the stage that produced it (putting the same content "
                    f"again replaces the remote object).")
            final = self.path(sha256, ext)
            final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(tmp, 0o600)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(final.parent)
        return final

    def _remote_intact(self, key: str, sha256: str) -> bool:
        assert self.remote is not None
        h = hashlib.sha256()
        for chunk in self.remote.chunks(key):
            h.update(chunk)
        return h.hexdigest() == sha256

    def _publish(self, src: Path, sha256: str, ext: str) -> None:
        """Make the remote hold ``src`` (complete, hashing to ``sha256``) under its key: nothing to do if
        it already holds an intact copy (stat + one streaming re-hash), else upload (replacing a corrupt one)."""
        assert self.remote is not None
        key = self.key(sha256, ext)
        size = self.remote.stat(key)
        if size is not None:
            if size == src.stat().st_size and self._remote_intact(key, sha256):
                return
            log.warning("remote artifact %s was corrupted (it no longer hashed to its name); replaced by the copy "
                        "just written", self.remote.object_url(key))
        self.remote.upload(src, key)

    def _commit(self, tmp: Path, sha256: str, ext: str) -> Path:
        final = self.path(sha256, ext)
        if self.remote is not None:
            try:  # published before it is visible here: a failed publish leaves no cached copy either
                self._publish(tmp, sha256, ext)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._intact(final, sha256):
            tmp.unlink()
        else:
            if final.exists():
                log.warning("artifact %s was corrupted (it no longer hashed to its name); replaced by the copy "
                            "just written", final)
            os.chmod(tmp, 0o600)
            os.replace(tmp, final)
            fsync_dir(final.parent)
        return final

    # -- writing -------------------------------------------------------------------------------
    def put_bytes(self, data: bytes, ext: str = "bin") -> ArtifactRef:
        sha = hashlib.sha256(data).hexdigest()
        if self._intact(cached := self.path(sha, ext), sha):
            if self.remote is not None:
                self._publish(cached, sha, ext)
            return ArtifactRef(sha, ext, len(data))
        tmp = self._tmp()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, sha, ext)
        return ArtifactRef(sha, ext, len(data))

    def put_json(self, obj: Any) -> ArtifactRef:
        data = canonical_json(obj, allow_nan=True).encode()  # NaN metrics stay storable, as they always were
        return self.put_bytes(data, "json")

    def put_file(self, src: str | os.PathLike[str], ext: str | None = None) -> ArtifactRef:
        """Copy a file in (streaming hash)."""
        src = Path(src)
        ext = ext or (src.suffix.lstrip(".") or "bin")
        tmp = self._tmp()
        h = hashlib.sha256()
        size = 0
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            while chunk := fi.read(_CHUNK):
                h.update(chunk)
                fo.write(chunk)
                size += len(chunk)
            fo.flush()
            os.fsync(fo.fileno())
        sha = h.hexdigest()
        self._commit(tmp, sha, ext)
        return ArtifactRef(sha, ext, size)

    def put_table(self, table: pa.Table, *, row_group_size: int | None = None) -> ArtifactRef:
        """Write an Arrow table as zstd Parquet."""
        with self.table_writer(table.schema) as w:
            w.write_table(table, row_group_size=row_group_size)
        return w.ref

    @contextmanager
    def table_writer(self, schema: pa.Schema, **kw: Any) -> Iterator[_TableWriter]:
        """Stream record batches into one Parquet artifact with bounded memory.

        The artifact exists under its final name only if the block exits without an exception.
        """
        tmp = self._tmp()
        writer = _TableWriter(tmp, schema, **kw)
        try:
            yield writer
            writer.close()
            sha = sha256_file(tmp)
            self._commit(tmp, sha, "parquet")
            writer.ref = ArtifactRef(sha, "parquet", self.path(sha, "parquet").stat().st_size, writer.rows)
        except BaseException:
            writer.close()
            tmp.unlink(missing_ok=True)
            raise

    def put_dir(self, src: str | os.PathLike[str]) -> ArtifactRef:
        """Archive a directory (e.g. a model) as an uncompressed, deterministic tar."""
        import tarfile

        src = Path(src)
        tmp = self._tmp()
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for p in sorted(src.rglob("*")):
                info = tar.gettarinfo(str(p), arcname=str(p.relative_to(src)))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if p.is_file():
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
        sha = sha256_file(tmp)
        self._commit(tmp, sha, "tar")
        return ArtifactRef(sha, "tar", self.path(sha, "tar").stat().st_size)

    # -- reading -------------------------------------------------------------------------------
    def _refetch(self, p: Path, actual: str) -> Path:
        assert self.remote is not None
        log.warning("cached artifact %s is corrupted (it hashes to %s); fetching it again from the remote store", p, actual)
        return self._fetch(p.name.split(".", 1)[0])

    def verify(self, sha256: str) -> Path:
        if self._cached(sha256) is None and self.remote is not None:
            return self._fetch(sha256)  # hashed while it downloads
        p = self.find(sha256)
        actual = sha256_file(p)
        if actual != sha256 and self.remote is not None:
            return self._refetch(p, actual)  # hashed while it downloads
        if actual != sha256:
            raise ArtifactCorruptError(
                f"artifact {p} is corrupted: its content hashes to {actual}, not {sha256}. "
                f"Do not use it; re-run the stage that produced it (the event that references it names the stage)."
            )
        return p

    def read_bytes(self, sha256: str) -> bytes:
        if self._cached(sha256) is None and self.remote is not None:
            return self._fetch(sha256).read_bytes()  # hashed while it downloaded
        p = self.find(sha256)
        data = p.read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256 and self.remote is not None:
            p = self._refetch(p, actual)
            data = p.read_bytes()
            actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise ArtifactCorruptError(
                f"artifact {p} is corrupted: its content hashes to {actual}, not {sha256}."
            )
        return data

    def read_json(self, sha256: str) -> Any:
        return json.loads(self.read_bytes(sha256))

    def read_table(self, sha256: str, columns: list[str] | None = None) -> pa.Table:
        p = self.verify(sha256)
        try:
            return pq.read_table(p, columns=columns)
        except Exception as e:  # pragma: no cover - only reachable with a hash collision
            raise ArtifactCorruptError(f"artifact {p} hashes correctly but is not readable Parquet: {e}") from e

    def extract_dir(self, sha256: str, dest: str | os.PathLike[str]) -> Path:
        import tarfile

        p = self.verify(sha256)
        dest = Path(dest)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex}")
        with tarfile.open(p) as tar:
            tar.extractall(tmp, filter="data")
        if dest.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, dest)
        return dest

    def sweep_temp(self) -> int:
        """Remove temporary files left by a crash. Returns how many were removed."""
        n = 0
        if self.objects.exists():
            for p in self.objects.glob(".tmp-*"):
                p.unlink(missing_ok=True)
                n += 1
        return n


class _TableWriter:
    def __init__(self, path: Path, schema: pa.Schema, compression: str = "zstd", row_group_size: int | None = None):
        self._w = pq.ParquetWriter(str(path), schema, compression=compression, write_statistics=True)
        self._row_group_size = row_group_size
        self.rows = 0
        self.ref: ArtifactRef | None = None
        self._closed = False

    def write_table(self, table: pa.Table, row_group_size: int | None = None) -> None:
        self._w.write_table(table, row_group_size=row_group_size or self._row_group_size)
        self.rows += table.num_rows

    def write_batch(self, batch: pa.RecordBatch) -> None:
        self._w.write_batch(batch)
        self.rows += batch.num_rows

    def close(self) -> None:
        if not self._closed:
            self._w.close()
            self._closed = True


def load_traces(artifacts: ArtifactStore, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Full redacted traces for ``trace.ingested`` payloads (or states), in the given order.

    Ingest keeps each redacted trace in a per-batch Parquet artifact and only a reference
    ``trace: {sha256, row}`` in the event. Reads each referenced artifact once (hash-verified),
    whatever the number of payloads."""
    by_sha: dict[str, list[int]] = {}
    for p in payloads:
        by_sha.setdefault(p["trace"]["sha256"], []).append(p["trace"]["row"])
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for sha, wanted in by_sha.items():
        col = artifacts.read_table(sha, columns=["trace"]).column("trace")
        for r in set(wanted):
            rows[(sha, r)] = orjson.loads(col[r].as_py())
    return [rows[(p["trace"]["sha256"], p["trace"]["row"])] for p in payloads]


def open_artifacts(cfg: FlywheelConfig) -> ArtifactStore:
    """The store of ``cfg``: ``<home>/artifacts`` alone, or the cache of ``artifacts.url`` (built lazily:
    nothing is reached until the first put or cache miss; the MLflow proxy is the server at
    ``mlflow_tracking_uri``)."""
    cfg.ensure_home()
    return ArtifactStore(cfg.artifacts_dir,
                         remote=backend_from_url(cfg.artifacts.url, tracking_uri=cfg.mlflow_tracking_uri))

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

Not guaranteed: garbage collection of artifacts no event references (they are kept).
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

from flywheel.vocab.ids import sha256_file

if TYPE_CHECKING:  # annotations only: config and artifacts are independent core layers (pyproject)
    from flywheel.config import FlywheelConfig

_CHUNK = 1 << 20
log = logging.getLogger(__name__)


class ArtifactError(RuntimeError):
    pass


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
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.objects = self.root / "sha256"

    # -- paths ---------------------------------------------------------------------------------
    def path(self, sha256: str, ext: str) -> Path:
        return self.objects / sha256[:2] / f"{sha256}.{ext}"

    def find(self, sha256: str) -> Path:
        d = self.objects / sha256[:2]
        matches = sorted(d.glob(f"{sha256}.*")) if d.exists() else []
        matches = [m for m in matches if ".tmp-" not in m.name]
        if not matches:
            raise ArtifactNotFound(f"artifact {sha256} is not in {self.objects}")
        return matches[0]

    def exists(self, sha256: str) -> bool:
        try:
            self.find(sha256)
            return True
        except ArtifactNotFound:
            return False

    def _tmp(self) -> Path:
        self.objects.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.objects / f".tmp-{uuid.uuid4().hex}"

    def _intact(self, path: Path, sha256: str) -> bool:
        """Whether ``path`` exists and hashes to ``sha256`` (an unreadable file is not intact)."""
        try:
            return path.exists() and sha256_file(path) == sha256
        except OSError:
            return False

    def _commit(self, tmp: Path, sha256: str, ext: str) -> Path:
        final = self.path(sha256, ext)
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
        if self._intact(self.path(sha, ext), sha):
            return ArtifactRef(sha, ext, len(data))
        tmp = self._tmp()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, sha, ext)
        return ArtifactRef(sha, ext, len(data))

    def put_json(self, obj: Any) -> ArtifactRef:
        data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
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
    def verify(self, sha256: str) -> Path:
        p = self.find(sha256)
        actual = sha256_file(p)
        if actual != sha256:
            raise ArtifactCorruptError(
                f"artifact {p} is corrupted: its content hashes to {actual}, not {sha256}. "
                f"Do not use it; re-run the stage that produced it (the event that references it names the stage)."
            )
        return p

    def read_bytes(self, sha256: str) -> bytes:
        p = self.find(sha256)
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
    cfg.ensure_home()
    return ArtifactStore(cfg.artifacts_dir)

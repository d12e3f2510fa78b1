"""A corrupted artifact is an error naming the file, never silently used."""

from __future__ import annotations

import pyarrow as pa
import pytest

from flywheel.artifacts import ArtifactCorruptError, ArtifactStore


def _flip(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.chmod(0o600)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["table", "json", "bytes", "dir"])
def test_flipped_byte_fails_reading_with_the_file_named(tmp_path, kind):
    arts = ArtifactStore(tmp_path / "artifacts")
    if kind == "table":
        ref = arts.put_table(pa.table({"a": list(range(100)), "b": ["x"] * 100}))
        read = lambda: arts.read_table(ref.sha256)  # noqa: E731
    elif kind == "json":
        ref = arts.put_json({"k": list(range(50))})
        read = lambda: arts.read_json(ref.sha256)  # noqa: E731
    elif kind == "bytes":
        ref = arts.put_bytes(b"\x00" * 1000, "bin")
        read = lambda: arts.read_bytes(ref.sha256)  # noqa: E731
    else:
        src = tmp_path / "model"
        src.mkdir()
        (src / "weights.bin").write_bytes(b"w" * 4096)
        ref = arts.put_dir(src)
        read = lambda: arts.extract_dir(ref.sha256, tmp_path / "out")  # noqa: E731
    path = arts.path(ref.sha256, ref.ext)
    _flip(path)
    with pytest.raises(ArtifactCorruptError) as e:
        read()
    assert str(path) in str(e.value) and ref.sha256 in str(e.value)
    assert not (tmp_path / "out").exists()


def test_truncated_artifact_is_corrupt(tmp_path):
    arts = ArtifactStore(tmp_path / "artifacts")
    ref = arts.put_table(pa.table({"a": list(range(1000))}))
    path = arts.path(ref.sha256, "parquet")
    path.chmod(0o600)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ArtifactCorruptError, match="corrupted"):
        arts.read_table(ref.sha256)

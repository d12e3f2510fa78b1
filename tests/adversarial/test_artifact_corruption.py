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


@pytest.mark.parametrize("kind", ["table", "json", "bytes", "file", "dir", "writer"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_putting_the_same_content_again_replaces_a_corrupt_file(tmp_path, kind, damage):
    """After bit rot, writing the same content again verifies the stored file and replaces it (it
    used to see the name, keep the corrupt file and return a reference to it).

    Review finding 8."""
    arts = ArtifactStore(tmp_path / "artifacts")
    table = pa.table({"a": list(range(100)), "b": ["x"] * 100})
    src = tmp_path / "model"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"w" * 4096)
    (tmp_path / "blob.bin").write_bytes(b"\x01" * 3000)

    def put():
        if kind == "table":
            return arts.put_table(table)
        if kind == "json":
            return arts.put_json({"k": list(range(50))})
        if kind == "bytes":
            return arts.put_bytes(b"\x00" * 1000, "bin")
        if kind == "file":
            return arts.put_file(tmp_path / "blob.bin")
        if kind == "dir":
            return arts.put_dir(src)
        with arts.table_writer(table.schema) as w:
            w.write_table(table)
        return w.ref

    ref = put()
    path = arts.path(ref.sha256, ref.ext)
    good = path.read_bytes()
    if damage == "flip":
        _flip(path)
    else:
        path.chmod(0o600)
        path.write_bytes(good[: len(good) // 2] if damage == "truncate" else b"")
    with pytest.raises(ArtifactCorruptError):
        arts.verify(ref.sha256)
    again = put()
    assert again.sha256 == ref.sha256
    assert path.read_bytes() == good and arts.verify(ref.sha256) == path
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert not list(arts.objects.glob(".tmp-*"))  # no temporary file left behind
    put()  # an intact file is kept as it is
    assert path.read_bytes() == good

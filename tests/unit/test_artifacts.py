"""Artifact store: content addressing, atomicity, idempotence, permissions."""

from __future__ import annotations

import os
import stat

import pyarrow as pa
import pytest

from flywheel.artifacts import ArtifactNotFound, ArtifactRef, ArtifactStore, sha256_file


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def arts(tmp_path):
    return ArtifactStore(tmp_path / "artifacts")


def test_table_round_trip_is_content_addressed(arts):
    t = pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"]})
    ref = arts.put_table(t)
    path = arts.path(ref.sha256, "parquet")
    assert path.parent.name == ref.sha256[:2] and path.parent.parent.name == "sha256"
    assert sha256_file(path) == ref.sha256 and ref.rows == 3 and ref.size == path.stat().st_size
    assert arts.read_table(ref.sha256).equals(t)
    assert arts.read_table(ref.sha256, columns=["b"]).column_names == ["b"]
    assert ArtifactRef.from_dict(ref.to_dict()) == ref


def test_same_table_twice_gives_same_sha_and_one_file(arts):
    t = pa.table({"a": list(range(1000))})
    r1, r2 = arts.put_table(t), arts.put_table(pa.table({"a": list(range(1000))}))
    assert r1 == r2
    files = [p for p in arts.objects.rglob("*") if p.is_file()]
    assert files == [arts.path(r1.sha256, "parquet")]
    assert arts.put_json({"b": 1, "a": 2}).sha256 == arts.put_json({"a": 2, "b": 1}).sha256


def test_failing_table_writer_leaves_no_artifact_and_no_temp_file(arts):
    schema = pa.schema([("a", pa.int64())])
    with pytest.raises(RuntimeError, match="boom"):
        with arts.table_writer(schema) as w:
            w.write_table(pa.table({"a": [1, 2]}, schema=schema))
            raise RuntimeError("boom")
    assert arts.sweep_temp() == 0
    assert [p for p in arts.objects.rglob("*") if p.is_file()] == []


def test_sweep_removes_crash_leftovers_and_find_ignores_them(arts):
    ref = arts.put_bytes(b"hello", "txt")
    leftover = arts.objects / ".tmp-deadbeef"
    leftover.write_bytes(b"half")
    assert arts.find(ref.sha256).name == f"{ref.sha256}.txt"
    assert arts.sweep_temp() == 1 and not leftover.exists()
    with pytest.raises(ArtifactNotFound):
        arts.read_bytes("0" * 64)


def test_streaming_writer_counts_rows(arts):
    schema = pa.schema([("a", pa.int64())])
    with arts.table_writer(schema) as w:
        for i in range(3):
            w.write_batch(pa.record_batch([pa.array([i] * 10)], schema=schema))
    assert w.ref.rows == 30 and arts.read_table(w.ref.sha256).num_rows == 30


def test_files_0600_and_directories_0700(arts, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc")
    refs = [arts.put_table(pa.table({"a": [1]})), arts.put_json([1]), arts.put_file(src), arts.put_bytes(b"z")]
    for ref in refs:
        p = arts.path(ref.sha256, ref.ext)
        assert mode(p) == 0o600, p
        assert mode(p.parent) == 0o700 and mode(arts.objects) == 0o700
    assert arts.read_bytes(refs[2].sha256) == b"abc"


def test_dir_round_trip(arts, tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"\x01" * 100)
    ref = arts.put_dir(src)
    os.utime(src / "config.json", (0, 12345))
    assert arts.put_dir(src) == ref  # deterministic tar: mtimes are not part of the content
    out = arts.extract_dir(ref.sha256, tmp_path / "out")
    assert (out / "sub" / "w.bin").read_bytes() == b"\x01" * 100

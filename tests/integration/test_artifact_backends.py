"""One contract for the artifact store, whatever ``artifacts.url`` names (flywheel/artifact_backends.py).

Every backend runs the same tests:
- ``local``: no url, ``<home>/artifacts`` alone (the embedded default);
- ``file``: ``file:///dir`` (a shared directory);
- ``s3``: ``s3://bucket/prefix`` against moto's S3 server (``moto.server.ThreadedMotoServer`` on
  127.0.0.1 — an S3 *emulator*, not AWS: it speaks the S3 REST API that pyarrow's S3 client uses);
- ``mlflow``: ``mlflow-artifacts:/prefix`` through a real ``mlflow server`` subprocess (SQLite backend
  store, ``--artifacts-destination`` under tmp; the session fixture of tests/integration/conftest.py).

The contract: round trips of bytes, JSON, a Parquet table and a directory tar; a second store with an
empty home reads what the first wrote (the cross-machine property); every read hashes (a corrupt remote
object raises ArtifactCorruptError naming it and both hashes, and never lands in the cache); the next put
of the same content replaces a corrupt remote object; a put that fails mid-way leaves nothing under the
final name, remote or local; puts are idempotent (same ref, one object). The remote is inspected and
corrupted with an independent client (the filesystem, boto3, plain HTTP), never through the backend.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

from flywheel import artifact_backends
from flywheel.artifact_backends import ArtifactRemoteError, MlflowProxyBackend, backend_from_url, redact_url
from flywheel.artifacts import ArtifactCorruptError, ArtifactNotFound, ArtifactStore, open_artifacts
from flywheel.config import load_config

KINDS = ["local", "file", pytest.param("s3", marks=pytest.mark.slow), pytest.param("mlflow", marks=pytest.mark.slow)]


class Remote:
    """A backend under test: how to open a store on it, and raw access that bypasses flywheel."""

    def __init__(self, kind: str, url: str | None, *, tracking_uri: str | None = None,
                 raw_get: Callable[[str], bytes] | None = None, raw_put: Callable[[str, bytes], None] | None = None,
                 raw_keys: Callable[[], list[str]] | None = None):
        self.kind, self.url, self.tracking_uri = kind, url, tracking_uri
        self.raw_get, self.raw_put, self.raw_keys = raw_get, raw_put, raw_keys

    def store(self, home: Path) -> ArtifactStore:
        overrides = {"home": str(home), "artifacts": {"url": self.url}}
        if self.tracking_uri:
            overrides["mlflow_tracking_uri"] = self.tracking_uri
        return open_artifacts(load_config(overrides=overrides, environ={}))


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[tuple[str, int]]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    try:
        yield srv.get_host_and_port()
    finally:
        srv.stop()


def _local_remote(tmp_path: Path) -> Remote:
    return Remote("local", None)


def _file_remote(tmp_path: Path) -> Remote:
    root = tmp_path / "shared"

    def keys() -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []

    return Remote("file", f"file://{root}", raw_get=lambda k: (root / k).read_bytes(),
                  raw_put=lambda k, b: (root / k).write_bytes(b), raw_keys=keys)


def _s3_remote(host: str, port: int) -> Remote:
    import boto3

    bucket, prefix = f"b{uuid.uuid4().hex[:12]}", "team/artifacts"
    s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=bucket)

    def keys() -> list[str]:
        out = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
        return sorted(o["Key"][len(prefix) + 1:] for o in out)

    # credentials in the URL (pyarrow's form): describe() must not show them
    url = f"s3://testing:testing@{bucket}/{prefix}?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    return Remote("s3", url,
                  raw_get=lambda k: s3.get_object(Bucket=bucket, Key=f"{prefix}/{k}")["Body"].read(),
                  raw_put=lambda k, b: s3.put_object(Bucket=bucket, Key=f"{prefix}/{k}", Body=b), raw_keys=keys)


def _mlflow_remote(server_url: str) -> Remote:
    prefix = f"flywheel-{uuid.uuid4().hex[:8]}"
    api = f"{server_url}/api/2.0/mlflow-artifacts/artifacts"

    def keys(path: str = prefix) -> list[str]:
        r = httpx.get(api, params={"path": path}, timeout=30)
        r.raise_for_status()
        out = []
        for f in r.json().get("files", []):
            sub = f"{path}/{f['path'].rsplit('/', 1)[-1]}"
            out += keys(sub) if f.get("is_dir") else [sub[len(prefix) + 1:]]
        return sorted(out)

    def put(k: str, b: bytes) -> None:
        httpx.put(f"{api}/{prefix}/{k}", content=b, timeout=30).raise_for_status()

    def get(k: str) -> bytes:
        r = httpx.get(f"{api}/{prefix}/{k}", timeout=30)
        r.raise_for_status()
        return r.content

    return Remote("mlflow", f"mlflow-artifacts:/{prefix}", tracking_uri=server_url,
                  raw_get=get, raw_put=put, raw_keys=keys)


@pytest.fixture(params=KINDS)
def remote(request, tmp_path) -> Remote:
    kind = request.param
    if kind == "local":
        return _local_remote(tmp_path)
    if kind == "file":
        return _file_remote(tmp_path)
    if kind == "s3":
        return _s3_remote(*request.getfixturevalue("moto_s3"))
    return _mlflow_remote(request.getfixturevalue("mlflow_server").url)


def _cached_files(store: ArtifactStore) -> list[str]:
    return sorted(p.name for p in store.objects.rglob("*") if p.is_file()) if store.objects.exists() else []


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


# ------------------------------------------------------------------------------------ the contract


def test_round_trip(remote: Remote, tmp_path):
    arts = remote.store(tmp_path / "home")
    b = arts.put_bytes(b"\x00\x01 payload" * 1000, "bin")
    j = arts.put_json({"b": [1, 2], "a": "é"})
    table = pa.table({"id": list(range(5000)), "text": [f"row {i}" for i in range(5000)]})
    t = arts.put_table(table)
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "weights.bin").write_bytes(b"w" * 70_000)
    (src / "sub" / "config.json").write_text('{"layers": 2}')
    d = arts.put_dir(src)
    assert arts.read_bytes(b.sha256) == b"\x00\x01 payload" * 1000
    assert arts.read_json(j.sha256) == {"b": [1, 2], "a": "é"}
    assert arts.read_table(t.sha256).equals(table) and t.rows == 5000
    out = arts.extract_dir(d.sha256, tmp_path / "out")
    assert (out / "weights.bin").read_bytes() == b"w" * 70_000
    assert (out / "sub" / "config.json").read_text() == '{"layers": 2}'
    if remote.raw_keys:  # published: the remote holds every object under the store's own key
        assert set(remote.raw_keys()) == {arts.key(r.sha256, r.ext) for r in (b, j, t, d)}
        assert remote.raw_get(arts.key(t.sha256, "parquet")) == arts.path(t.sha256, "parquet").read_bytes()


def test_an_empty_home_reads_what_another_wrote(remote: Remote, tmp_path):
    writer = remote.store(tmp_path / "machine-a")
    table = pa.table({"x": list(range(1000))})
    t, j = writer.put_table(table), writer.put_json({"k": 1})
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter.safetensors").write_bytes(b"a" * 10_000)
    d = writer.put_dir(src)
    reader = remote.store(tmp_path / "machine-b")  # another machine: nothing in its home
    assert _cached_files(reader) == []
    if remote.kind == "local":  # the embedded default has no remote: another home is another store
        assert not reader.exists(t.sha256)
        with pytest.raises(ArtifactNotFound):
            reader.read_table(t.sha256)
        return
    assert reader.exists(t.sha256) and reader.exists(j.sha256) and not reader.exists("0" * 64)
    assert reader.read_table(t.sha256).equals(table)
    assert reader.read_json(j.sha256) == {"k": 1}
    assert (reader.extract_dir(d.sha256, tmp_path / "x") / "adapter.safetensors").read_bytes() == b"a" * 10_000
    # now cached: find/verify hand out local paths that callers open directly
    assert reader.verify(t.sha256) == reader.path(t.sha256, "parquet")
    assert reader.find(d.sha256).read_bytes() == writer.find(d.sha256).read_bytes()
    with pytest.raises(ArtifactNotFound, match="0{64}"):
        reader.find("0" * 64)


def test_every_read_hashes_and_corrupt_bytes_are_never_cached(remote: Remote, tmp_path):
    writer = remote.store(tmp_path / "a")
    ref = writer.put_bytes(b"precious" * 4096, "bin")
    key = writer.key(ref.sha256, "bin")
    bad = _flip(b"precious" * 4096)
    bad_sha = hashlib.sha256(bad).hexdigest()
    if remote.kind == "local":
        writer.path(ref.sha256, "bin").write_bytes(bad)
        with pytest.raises(ArtifactCorruptError, match=bad_sha):
            writer.read_bytes(ref.sha256)
        return
    remote.raw_put(key, bad)  # bit rot on the remote, same size
    reader = remote.store(tmp_path / "b")
    for read in (reader.read_bytes, reader.verify, reader.find):
        with pytest.raises(ArtifactCorruptError) as e:
            read(ref.sha256)
        msg = str(e.value)
        assert ref.sha256 in msg and bad_sha in msg and key in msg, msg
        assert _cached_files(reader) == []  # neither under its name nor as a temp file
    # a corrupt *cached* copy is fetched again from an intact remote
    remote.raw_put(key, b"precious" * 4096)
    assert reader.read_bytes(ref.sha256) == b"precious" * 4096
    reader.path(ref.sha256, "bin").write_bytes(bad)
    assert reader.read_bytes(ref.sha256) == b"precious" * 4096
    reader.path(ref.sha256, "bin").write_bytes(bad)
    assert reader.verify(ref.sha256).read_bytes() == b"precious" * 4096


@pytest.mark.parametrize("damage", ["bitflip", "truncated"])
def test_a_corrupt_remote_object_is_replaced_by_the_next_put(remote: Remote, tmp_path, damage):
    data = b"rollouts" * 50_000
    arts = remote.store(tmp_path / "a")
    ref = arts.put_bytes(data, "bin")
    key = arts.key(ref.sha256, "bin")
    bad = _flip(data) if damage == "bitflip" else data[: len(data) // 2]
    if remote.kind == "local":
        arts.path(ref.sha256, "bin").write_bytes(bad)
        assert arts.put_bytes(data, "bin") == ref
        assert arts.read_bytes(ref.sha256) == data
        return
    remote.raw_put(key, bad)
    # the same home (its cached copy intact) and a fresh home both repair the remote
    for home in ("a", "c"):
        remote.raw_put(key, bad)
        assert remote.store(tmp_path / home).put_bytes(data, "bin") == ref
        assert remote.raw_get(key) == data
    assert remote.store(tmp_path / "d").read_bytes(ref.sha256) == data


def test_a_put_that_fails_midway_leaves_nothing_under_the_final_name(remote: Remote, tmp_path, monkeypatch):
    arts = remote.store(tmp_path / "a")
    schema = pa.schema([("x", pa.int64())])
    with pytest.raises(RuntimeError, match="stage crashed"), arts.table_writer(schema) as w:
        w.write_table(pa.table({"x": list(range(100))}, schema=schema))
        raise RuntimeError("stage crashed")
    assert _cached_files(arts) == []
    assert not remote.raw_keys or remote.raw_keys() == []
    if remote.kind == "local":
        return
    data = bytes(range(256)) * 16384  # 4 MiB: several chunks into the upload
    sha = hashlib.sha256(data).hexdigest()
    real = artifact_backends.read_chunks

    def dies_midway(path):
        it = real(path)
        yield next(it)
        raise OSError("disk read error in the middle of the upload")

    monkeypatch.setattr(artifact_backends, "read_chunks", dies_midway)
    with pytest.raises((OSError, ArtifactRemoteError)):
        arts.put_bytes(data, "bin")
    assert not any(sha in k for k in remote.raw_keys()), remote.raw_keys()
    assert _cached_files(arts) == []  # published first, cached after: nothing here either
    assert not arts.exists(sha) and not remote.store(tmp_path / "b").exists(sha)
    monkeypatch.setattr(artifact_backends, "read_chunks", real)
    assert arts.put_bytes(data, "bin").sha256 == sha  # and the retry publishes it whole
    assert remote.store(tmp_path / "b").read_bytes(sha) == data


def test_puts_are_idempotent(remote: Remote, tmp_path):
    a, b = remote.store(tmp_path / "a"), remote.store(tmp_path / "b")
    table = pa.table({"x": [1, 2, 3]})
    refs = {a.put_table(table), a.put_table(table), b.put_table(table)}
    assert len(refs) == 1
    (ref,) = refs
    assert _cached_files(a) == [f"{ref.sha256}.parquet"] == _cached_files(b)
    if remote.raw_keys:
        assert remote.raw_keys() == [a.key(ref.sha256, "parquet")]
    assert a.put_json({"k": 1}) == b.put_json({"k": 1})


def test_describe_names_the_backend_without_credentials(remote: Remote, tmp_path):
    d = remote.store(tmp_path / "home").describe()
    assert d["local"] == str(tmp_path / "home" / "artifacts")
    if remote.kind == "local":
        assert d == {"kind": "local", "url": None, "local": d["local"], "local_role": "store"}
        return
    assert d["local_role"] == "cache" and d["kind"] == {"mlflow": "mlflow-artifacts"}.get(remote.kind, remote.kind)
    assert "testing:testing" not in str(d) and "@" not in d["url"]
    if remote.kind == "mlflow":
        assert d["server"] == remote.tracking_uri and d["url"].startswith("mlflow-artifacts:/flywheel-")


# ------------------------------------------------------------------------- backend specifics, no servers


def test_memory_and_redaction(tmp_path):
    a = ArtifactStore(tmp_path / "a", backend_from_url("memory:"))  # as the config hands it over ("/" stripped)
    b = ArtifactStore(tmp_path / "b", backend_from_url("memory://"))
    ref = a.put_json({"in": "memory"})
    assert b.read_json(ref.sha256) == {"in": "memory"} and b.describe()["url"] == "memory://"
    assert redact_url("s3://AK:SK@bucket/p?secret_key=x&region=eu-west-1") == "s3://bucket/p?region=eu-west-1"
    assert redact_url("az://c@acct.dfs.core.windows.net/p?sas_token=s") == "az://acct.dfs.core.windows.net/p"


def test_mlflow_proxy_needs_an_http_tracking_server(tmp_path):
    with pytest.raises(ArtifactRemoteError, match="mlflow_tracking_uri.*sqlite"):
        MlflowProxyBackend("mlflow-artifacts:/team", "sqlite:///x/mlflow.db")


class _Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(500 if "boom" in self.path else 200)
        body = b'{"files": []}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_mlflow_proxy_auth_timeouts_and_errors(recorder, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ann")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    assert MlflowProxyBackend("mlflow-artifacts:/team", recorder).stat("sha256/ab/x.bin") is None
    assert _Recorder.seen[-1][1].startswith("Basic ")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok")
    MlflowProxyBackend("mlflow-artifacts:/team", recorder).stat("sha256/ab/x.bin")
    assert _Recorder.seen[-1] == ("/api/2.0/mlflow-artifacts/artifacts?path=team%2Fsha256%2Fab", "Bearer tok")
    # an error names the URL of the object and the HTTP status
    with pytest.raises(ArtifactRemoteError, match=r"listing of .*/api/2\.0/mlflow-artifacts/artifacts/boom/sha256/ab.*HTTP 500"):
        MlflowProxyBackend("mlflow-artifacts:/boom", recorder).stat("sha256/ab/x.bin")
    # a server that is not there: the error names the artifact's URL (and comes within the timeout)
    dead = MlflowProxyBackend("mlflow-artifacts:/team", "http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(ArtifactRemoteError, match=r"download of http://127\.0\.0\.1:9/.*/team/sha256/ab/x\.bin failed"):
        list(dead.chunks("sha256/ab/x.bin"))

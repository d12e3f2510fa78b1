"""Artifact store throughput per backend: flywheel's put/get of a ~100 MB Parquet file vs the same
library's plain copy of the same file, same servers, same run.

Backends (``artifacts.url``) and their named peers:
- ``local`` (no url): ``ArtifactStore.put_file`` (stream copy + SHA-256 + fsync + rename) and a
  verified read (``verify``: re-hash) vs ``shutil.copyfile`` and a plain read of the file;
- ``file://``: vs ``pyarrow.fs.copy_files`` local -> shared directory and back;
- ``s3://`` against moto's S3 server (an S3 emulator, in its own process on 127.0.0.1): vs
  ``pyarrow.fs.copy_files`` to and from the same bucket;
- ``mlflow-artifacts:`` through a real ``mlflow server --serve-artifacts`` (SQLite, one worker): vs a
  plain streaming ``httpx`` PUT and GET of the same file at the same endpoint.

Put = ``put_file`` from a fresh home into an empty remote prefix (local cache write, hash, stat,
upload, rename). Get = a read from a fresh, empty home (``verify``: find, download while hashing,
fsync, rename into the cache). The peers move the bytes once and check nothing. Reported: MB/s
(median of the repeats, flywheel and peer alternating), and the ratio flywheel/peer of the
throughputs (1.0 = as fast as the plain copy).

Run: ``.venv/bin/python benchmarks/bench_artifacts.py [--quick] [--json] [--mb 100] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flywheel.artifact_backends import backend_from_url
from flywheel.artifacts import ArtifactStore

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=5).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up after {timeout_s:.0f} s")


def make_parquet(path: Path, mb: int) -> Path:
    """A Parquet file of about ``mb`` MB that zstd cannot shrink much (random ints and bytes)."""
    rng = np.random.default_rng(0)
    rows = mb * 1024 * 1024 // 64
    table = pa.table({"id": np.arange(rows, dtype=np.int64),
                      "x": rng.standard_normal(rows),
                      "blob": pa.array([rng.bytes(48) for _ in range(rows)], pa.binary(48))})
    pq.write_table(table, path, compression="zstd")
    return path


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _one_repeat(name: str, url: str | None, src: Path, work: Path, i: int, tracking: str | None,
                peer_put: Callable[[Path, str], None], peer_get: Callable[[str, Path], None],
                t: dict[str, list[float]]) -> None:
    """One put and one get of each (flywheel and peer alternate who goes first)."""
    run = uuid.uuid4().hex[:8]
    # a fresh remote prefix per repeat: every put uploads, every get downloads
    u = None if url is None else url.replace("?", f"/{run}?", 1) if "?" in url else f"{url}/{run}"
    a = ArtifactStore(work / f"{name}-{run}-a", backend_from_url(u, tracking_uri=tracking))
    key, dst = f"peer-{run}/{src.name}", work / f"peer-get-{run}.parquet"
    refs = []
    pair = [("flywheel_put", lambda: refs.append(a.put_file(src))), ("peer_put", lambda: peer_put(src, key))]
    for k, fn in (pair if i % 2 == 0 else pair[::-1]):
        t[k].append(timed(fn))
    # local: the same home (a verified read); remote: an empty home (download while hashing)
    b = a if url is None else ArtifactStore(work / f"{name}-{run}-b", backend_from_url(u, tracking_uri=tracking))
    pair = [("flywheel_get", lambda: b.verify(refs[0].sha256)), ("peer_get", lambda: peer_get(key, dst))]
    for k, fn in (pair if i % 2 == 0 else pair[::-1]):
        t[k].append(timed(fn))
    assert dst.stat().st_size == src.stat().st_size == b.verify(refs[0].sha256).stat().st_size
    for p in (a.root, b.root):
        shutil.rmtree(p, ignore_errors=True)
    dst.unlink()
    a.close()
    b.close()


def run_backend(name: str, url: str | None, src: Path, work: Path, repeats: int, *, tracking: str | None,
                peer_put: Callable[[Path, str], None], peer_get: Callable[[str, Path], None]) -> dict:
    size_mb = src.stat().st_size / 1e6
    t = {"flywheel_put": [], "flywheel_get": [], "peer_put": [], "peer_get": []}
    for i in range(repeats):
        _one_repeat(name, url, src, work, i, tracking, peer_put, peer_get, t)
    med = {k: statistics.median(v) for k, v in t.items()}
    mbps = {k: round(size_mb / v, 1) for k, v in med.items()}
    return {"backend": name, "url": url, "mb": round(size_mb, 1), "seconds": {k: [round(x, 3) for x in v] for k, v in t.items()},
            "mb_s": mbps, "ratio_put": round(mbps["flywheel_put"] / mbps["peer_put"], 2),
            "ratio_get": round(mbps["flywheel_get"] / mbps["peer_get"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 MB, one repeat")
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="local,file,s3,mlflow")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeats = 20, 1
    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-artifacts-"))
    procs: list[subprocess.Popen] = []
    results = []
    try:
        src = make_parquet(work / "table.parquet", args.mb)
        local = pafs.LocalFileSystem()
        backends = args.backends.split(",")
        if "local" in backends:
            def copy_local(s: Path, key: str) -> None:
                (work / "peer-local" / key).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(s, work / "peer-local" / key)

            def plain_read(key: str, dst: Path) -> None:  # the peer of a verified read: read the bytes once
                with open(work / "peer-local" / key, "rb") as f:
                    while f.read(1 << 20):
                        pass
                os.link(work / "peer-local" / key, dst)  # (for the size check only; not timed work)

            results.append(run_backend("local", None, src, work, args.repeats, tracking=None,
                                       peer_put=copy_local, peer_get=plain_read))
        if "file" in backends:
            shared = work / "shared"
            shared.mkdir()
            results.append(run_backend(
                "file://", f"file://{shared}", src, work, args.repeats, tracking=None,
                peer_put=lambda s, k: (local.create_dir(str((shared / k).parent)),
                                       pafs.copy_files(str(s), str(shared / k), source_filesystem=local,
                                                       destination_filesystem=local)),
                peer_get=lambda k, d: pafs.copy_files(str(shared / k), str(d), source_filesystem=local,
                                                      destination_filesystem=local)))
        if "s3" in backends:
            port = free_port()
            procs.append(subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            wait_http(f"http://127.0.0.1:{port}/", procs[-1])
            os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
            s3 = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                                   allow_bucket_creation=True)
            s3.create_dir("bench")
            results.append(run_backend(
                "s3:// (moto)", f"s3://bench/artifacts?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1",
                src, work, args.repeats, tracking=None,
                peer_put=lambda s, k: pafs.copy_files(str(s), f"bench/peer/{k}", source_filesystem=local,
                                                      destination_filesystem=s3),
                peer_get=lambda k, d: pafs.copy_files(f"bench/peer/{k}", str(d), source_filesystem=s3,
                                                      destination_filesystem=local)))
        if "mlflow" in backends:
            port = free_port()
            data = work / "mlflow-server"
            data.mkdir()
            env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
            procs.append(subprocess.Popen(
                [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{data / 'mlflow.db'}", "--artifacts-destination",
                 str(data / "mlartifacts")], cwd=data, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
            server = f"http://127.0.0.1:{port}"
            wait_http(f"{server}/health", procs[-1])
            api = f"{server}/api/2.0/mlflow-artifacts/artifacts"
            client = httpx.Client(timeout=300)

            def http_put(s: Path, k: str) -> None:
                def body():
                    with open(s, "rb") as f:
                        while c := f.read(1 << 20):
                            yield c
                client.put(f"{api}/peer/{k}", content=body(),
                           headers={"Content-Length": str(s.stat().st_size)}).raise_for_status()

            def http_get(k: str, d: Path) -> None:
                with client.stream("GET", f"{api}/peer/{k}") as r, open(d, "wb") as f:
                    r.raise_for_status()
                    for c in r.iter_bytes(1 << 20):
                        f.write(c)

            results.append(run_backend("mlflow-artifacts:", "mlflow-artifacts:/bench", src, work, args.repeats,
                                       tracking=server, peer_put=http_put, peer_get=http_get))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15)
                p.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, 9)
        shutil.rmtree(work, ignore_errors=True)
    out = {"mb": args.mb, "repeats": args.repeats, "load_at_start": load0, "load_at_end": os.getloadavg(),
           "results": results}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"load average {load0} -> {out['load_at_end']}; {results[0]['mb'] if results else '?'} MB Parquet, "
          f"median of {args.repeats}")
    print("| backend | put MB/s flywheel | put MB/s peer | put ratio | get MB/s flywheel | get MB/s peer | get ratio | peer |")
    print("|---|---|---|---|---|---|---|---|")
    peers = {"local": "shutil.copyfile / plain read", "file://": "pyarrow.fs.copy_files",
             "s3:// (moto)": "pyarrow.fs.copy_files", "mlflow-artifacts:": "httpx PUT / GET"}
    for r in results:
        m = r["mb_s"]
        print(f"| {r['backend']} | {m['flywheel_put']} | {m['peer_put']} | x{r['ratio_put']} | {m['flywheel_get']} | "
              f"{m['peer_get']} | x{r['ratio_get']} | {peers[r['backend']]} |")


if __name__ == "__main__":
    main()

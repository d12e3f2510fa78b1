"""Remote backends of the artifact store (``artifacts.url``): the team's source of truth behind the
hash-verified local cache of :class:`flywheel.artifacts.ArtifactStore`.

A backend moves whole objects by key (``sha256/ab/abcd….parquet``, the local layout) and knows nothing
about hashes: the store hashes every byte it downloads or re-checks, so each backend only has to be
atomic on publish, and a broken one is caught on read. One small interface, :class:`RemoteBackend`:
``stat`` (size or None), ``find`` (the object whose name starts with a stem), ``upload`` (publish a
complete local file), ``chunks`` (stream an object), ``delete`` (tests and repairs).

- :class:`ArrowBackend`: ``pyarrow.fs`` for ``s3://`` (also any S3 API: ``?endpoint_override=host:port
  &scheme=http``, or ``AWS_ENDPOINT_URL``), ``gs://``, ``az://container/prefix`` (pyarrow's
  AzureFileSystem; account from ``AZURE_STORAGE_ACCOUNT_NAME``), ``file:///dir`` and ``memory://``
  (fsspec's in-process memory filesystem, for tests). Publish on ``file://``/``memory://``: write a
  ``.tmp-*`` name in the same directory, then rename. Publish on object stores: one upload stream to the
  final key, which the store makes visible only when the upload completes (S3 PutObject /
  CompleteMultipartUpload, GCS finalize, Azure block-list commit), so a process that dies mid-upload
  leaves nothing. pyarrow has no way to abort a stream: closing one after an error in this process
  completes it, so on an error the backend deletes the partial object at once; in that short window
  (or if the delete fails) a reader's hash check rejects it and the next put replaces it.
- :class:`MlflowProxyBackend`: the MLflow server's artifact proxy (``mlflow server --serve-artifacts``),
  over its REST API ``GET|PUT|DELETE {tracking}/api/2.0/mlflow-artifacts/artifacts/<path>`` and the
  listing ``GET {tracking}/api/2.0/mlflow-artifacts/artifacts?path=<dir>``. The API has no rename, so
  no upload-then-rename: one PUT streams to the final path. The server (mlflow>=3.17) buffers the body
  to a temporary file and publishes it only once complete (a local destination: temp file + os.replace;
  an object store: one upload of the complete file), so a client that fails mid-PUT leaves nothing;
  an older or different server that writes in place would expose a partial object, which the store's
  hash check on read rejects and the next put replaces.
"""

from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

_CHUNK = 1 << 20
#: Extensions tried (one stat each) before listing a shard directory to find an artifact by hash.
PROBE_EXTS = ("parquet", "json", "tar", "bin")
#: URL query parameters that carry secrets (never shown by :func:`redact_url`).
_SECRET_PARAMS = {"access_key", "secret_key", "session_token", "account_key", "sas_token", "client_secret",
                  "password", "token"}


class ArtifactError(RuntimeError):
    pass


class ArtifactRemoteError(ArtifactError):
    """The remote store could not be reached or refused a request (the message names the URL)."""


def redact_url(url: str) -> str:
    """``url`` without user, password and secret query parameters (what ``flywheel status`` shows)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k.lower() not in _SECRET_PARAMS], safe=":/")
    if not netloc and not parts.path and not query:
        return f"{parts.scheme}://"
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def read_chunks(path: Path) -> Iterator[bytes]:
    """The bytes of a local file in 1 MiB chunks (what every upload streams)."""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _pick(listing: dict[str, int], directory: str, stem: str) -> tuple[str, int] | None:
    names = sorted(n for n in listing if n.startswith(stem + ".") and ".tmp-" not in n)
    return (f"{directory}/{names[0]}", listing[names[0]]) if names else None


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


class RemoteBackend(ABC):
    """Whole objects by key (``sha256/ab/<sha>.<ext>``); no hashing here (the store does it)."""

    kind: str
    url: str  # as configured; shown through redact_url

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": redact_url(self.url)}

    @abstractmethod
    def object_url(self, key: str) -> str:
        """Where the object lives, for messages (no credentials)."""

    @abstractmethod
    def stat(self, key: str) -> int | None:
        """The object's size, or None when there is none."""

    @abstractmethod
    def list_dir(self, directory: str) -> dict[str, int]:
        """Object name -> size of the objects directly under ``directory`` (empty if none)."""

    def find(self, directory: str, stem: str) -> tuple[str, int] | None:
        """The key and size of an object ``<directory>/<stem>.<ext>`` (any ext), or None: one stat per
        common extension, then a listing of the directory."""
        for ext in PROBE_EXTS:
            key = f"{directory}/{stem}.{ext}"
            if (size := self.stat(key)) is not None:
                return key, size
        return _pick(self.list_dir(directory), directory, stem)

    @abstractmethod
    def upload(self, src: Path, key: str) -> None:
        """Publish the complete local file ``src`` under ``key``, atomically (see the module docstring)."""

    @abstractmethod
    def chunks(self, key: str) -> Iterator[bytes]:
        """Stream the object's bytes; raises ArtifactRemoteError if it cannot be read."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object (absent: no error)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


# ------------------------------------------------------------------------------------------ pyarrow.fs


def _arrow_filesystem(url: str) -> tuple[Any, str, bool]:
    """(pyarrow filesystem, base path, whether publish must go through a temp name + rename)."""
    import pyarrow.fs as pafs

    scheme = urlsplit(url).scheme
    if scheme == "file":
        return pafs.LocalFileSystem(), urlsplit(url).path, True
    if scheme == "memory":
        try:
            from fsspec.implementations.memory import MemoryFileSystem
        except ImportError as e:  # pragma: no cover - fsspec comes with huggingface_hub
            raise ArtifactRemoteError(f"artifacts.url {url} needs fsspec (pip install fsspec)") from e
        path = _join("/flywheel-artifacts", urlsplit(url).netloc, urlsplit(url).path)
        return pafs.PyFileSystem(pafs.FSSpecHandler(MemoryFileSystem())), "/" + path, True
    if scheme == "az":
        parts = urlsplit(url)
        if "@" in parts.netloc:  # az://container@account.dfs.core.windows.net/prefix: pyarrow's own abfs form
            fs, path = pafs.FileSystem.from_uri(urlunsplit(("abfs", *parts[1:])))
            return fs, path, False
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        if not account:
            raise ArtifactRemoteError(f"artifacts.url {redact_url(url)}: set AZURE_STORAGE_ACCOUNT_NAME (the storage "
                                      "account; AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, else Azure's "
                                      "default credential) or write az://container@account.dfs.core.windows.net/prefix")
        kw = {k: os.environ[e] for k, e in (("account_key", "AZURE_STORAGE_ACCOUNT_KEY"),
                                            ("sas_token", "AZURE_STORAGE_SAS_TOKEN")) if os.environ.get(e)}
        return pafs.AzureFileSystem(account, **kw), _join(parts.netloc, parts.path), False
    fs, path = pafs.FileSystem.from_uri(url)
    return fs, path, False


class ArrowBackend(RemoteBackend):
    """Any filesystem pyarrow reaches (see the module docstring for what each guarantees)."""

    def __init__(self, url: str, *, filesystem: Any = None, base: str | None = None, rename: bool | None = None):
        self.url = url
        self.kind = urlsplit(url).scheme
        self._fs, self._base, self._rename = filesystem, base, rename

    def _ready(self) -> tuple[Any, str]:
        # Built on first use: `flywheel status` describes the store without reaching it (an S3 URL
        # without a region resolves it over the network).
        if self._fs is None:
            try:
                self._fs, self._base, self._rename = _arrow_filesystem(self.url)
            except ArtifactRemoteError:
                raise
            except Exception as e:
                raise ArtifactRemoteError(f"cannot open artifact store {redact_url(self.url)}: {e}") from e
        return self._fs, self._base or ""

    def _path(self, key: str) -> str:
        fs, base = self._ready()
        return f"{base.rstrip('/')}/{key}" if base else key

    def object_url(self, key: str) -> str:
        return f"{redact_url(self.url).split('?')[0].rstrip('/')}/{key}"

    def _call(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise ArtifactRemoteError(f"{what} {self.object_url(key)} failed: {e}") from e

    def stat(self, key: str) -> int | None:
        import pyarrow.fs as pafs

        fs, _ = self._ready()
        info = self._call("stat of", key, lambda: fs.get_file_info(self._path(key)))
        return info.size if info.type == pafs.FileType.File else None

    def list_dir(self, directory: str) -> dict[str, int]:
        import pyarrow.fs as pafs

        fs, _ = self._ready()
        sel = pafs.FileSelector(self._path(directory), allow_not_found=True)
        infos = self._call("listing of", directory, lambda: fs.get_file_info(sel))
        return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}

    def find(self, directory: str, stem: str) -> tuple[str, int] | None:
        import pyarrow.fs as pafs

        fs, _ = self._ready()
        keys = [f"{directory}/{stem}.{ext}" for ext in PROBE_EXTS]
        infos = self._call("stat of", keys[0], lambda: fs.get_file_info([self._path(k) for k in keys]))
        for k, i in zip(keys, infos, strict=True):
            if i.type == pafs.FileType.File:
                return k, i.size
        return _pick(self.list_dir(directory), directory, stem)

    def upload(self, src: Path, key: str) -> None:
        fs, _ = self._ready()
        final = self._path(key)
        target = final
        if self._rename:
            parent = final.rsplit("/", 1)[0]
            self._call("creating the directory of", key, lambda: fs.create_dir(parent, recursive=True))
            target = f"{parent}/.tmp-{uuid.uuid4().hex}"
        out = self._call("upload of", key, lambda: fs.open_output_stream(target))
        try:
            for chunk in read_chunks(src):
                out.write(chunk)
            out.close()
        except BaseException as e:
            # pyarrow cannot abort a stream: closing it (here or in its destructor) completes the upload,
            # so remove what it published before anyone trusts it (readers re-hash it in any case).
            try:
                out.close()
            except Exception:  # noqa: BLE001,S110 - the stream is already broken; the delete below is what matters
                pass
            try:
                fs.delete_file(target)
            except Exception:  # noqa: BLE001,S110 - absent already, or unreachable: hash checks cover it
                pass
            if isinstance(e, OSError):
                raise ArtifactRemoteError(f"upload of {self.object_url(key)} failed: {e}") from e
            raise
        if self._rename:
            try:
                self._call("publishing (rename into place of)", key, lambda: fs.move(target, final))
            except BaseException:
                try:
                    fs.delete_file(target)
                except Exception:  # noqa: BLE001,S110
                    pass
                raise

    def chunks(self, key: str) -> Iterator[bytes]:
        fs, _ = self._ready()
        try:
            f = fs.open_input_stream(self._path(key))
        except FileNotFoundError as e:
            raise ArtifactRemoteError(f"artifact {self.object_url(key)} is not in the remote store") from e
        except OSError as e:
            raise ArtifactRemoteError(f"download of {self.object_url(key)} failed: {e}") from e
        with f:
            while True:
                try:
                    chunk = f.read(_CHUNK)
                except OSError as e:
                    raise ArtifactRemoteError(f"download of {self.object_url(key)} failed: {e}") from e
                if not chunk:
                    return
                yield chunk

    def delete(self, key: str) -> None:
        fs, _ = self._ready()
        try:
            fs.delete_file(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ArtifactRemoteError(f"delete of {self.object_url(key)} failed: {e}") from e


# ------------------------------------------------------------------------------------ MLflow's proxy

MLFLOW_ARTIFACTS_API = "/api/2.0/mlflow-artifacts/artifacts"


class MlflowProxyBackend(RemoteBackend):
    """``mlflow-artifacts:/prefix`` through the MLflow server at ``tracking_uri`` (see the module docstring).

    Auth as MLflow's own client: ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (basic) or
    ``MLFLOW_TRACKING_TOKEN`` (bearer); ``MLFLOW_TRACKING_INSECURE_TLS=true`` skips TLS verification;
    ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (seconds, default 120) bounds every request's connect and each read.
    """

    kind = "mlflow-artifacts"

    def __init__(self, url: str, tracking_uri: str | None, *, timeout_s: float | None = None):
        import httpx

        self.url = url
        parts = urlsplit(url)
        if parts.netloc:  # mlflow-artifacts://host:port/prefix names the server itself (MLflow's own form)
            server = f"http://{parts.netloc}"
        else:
            server = (tracking_uri or "").rstrip("/")
            if not server.startswith(("http://", "https://")):
                raise ArtifactRemoteError(
                    f"artifacts.url {url} is served by the MLflow server at mlflow_tracking_uri, which must be an "
                    f"http(s) URL of a server started with --serve-artifacts; it is {tracking_uri!r}")
        self.server = server
        self.prefix = parts.path.strip("/")
        self.endpoint = server + MLFLOW_ARTIFACTS_API
        if timeout_s is None:
            timeout_s = float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or 120)
        auth: Any = None
        headers = {}
        if os.environ.get("MLFLOW_TRACKING_TOKEN"):
            headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
        elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
            auth = httpx.BasicAuth(os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))
        verify = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() not in ("1", "true")
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), auth=auth, headers=headers, verify=verify,
                                    transport=httpx.HTTPTransport(retries=2, verify=verify))

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": redact_url(self.url), "server": redact_url(self.server)}

    def _key(self, key: str) -> str:
        return _join(self.prefix, key)

    def object_url(self, key: str) -> str:
        return f"{redact_url(self.endpoint)}/{quote(self._key(key))}"

    def _fail(self, what: str, key: str, e: Exception | None = None, response: Any = None) -> ArtifactRemoteError:
        if response is not None:
            try:
                body = response.text[:300]
            except Exception:  # noqa: BLE001 - a streamed body not read: no excerpt
                body = ""
            hint = " (is the server started with --serve-artifacts, and are MLFLOW_TRACKING_* credentials set?)" \
                if response.status_code in (401, 403, 503) else ""
            return ArtifactRemoteError(f"{what} {self.object_url(key)}: HTTP {response.status_code}{hint} {body}".rstrip())
        return ArtifactRemoteError(f"{what} {self.object_url(key)} failed: {type(e).__name__}: {e}")

    def list_dir(self, directory: str) -> dict[str, int]:
        import httpx

        try:
            r = self._client.get(self.endpoint, params={"path": self._key(directory)})
        except httpx.HTTPError as e:
            raise self._fail("listing of", directory, e) from e
        if r.status_code == 404:
            return {}
        if r.status_code != 200:
            raise self._fail("listing of", directory, response=r)
        return {f["path"].rsplit("/", 1)[-1]: int(f.get("file_size", 0))
                for f in r.json().get("files", []) if not f.get("is_dir")}

    def stat(self, key: str) -> int | None:
        directory, name = key.rsplit("/", 1)
        return self.list_dir(directory).get(name)

    def find(self, directory: str, stem: str) -> tuple[str, int] | None:
        return _pick(self.list_dir(directory), directory, stem)  # one request, whatever the extension

    def upload(self, src: Path, key: str) -> None:
        import httpx

        url = f"{self.endpoint}/{quote(self._key(key))}"
        try:
            r = self._client.put(url, content=read_chunks(src),
                                 headers={"Content-Length": str(src.stat().st_size),
                                          "Content-Type": "application/octet-stream"})
        except httpx.HTTPError as e:
            raise self._fail("upload of", key, e) from e
        if r.status_code != 200:
            raise self._fail("upload of", key, response=r)

    def chunks(self, key: str) -> Iterator[bytes]:
        import httpx

        url = f"{self.endpoint}/{quote(self._key(key))}"
        try:
            with self._client.stream("GET", url) as r:
                if r.status_code != 200:
                    r.read()
                    if r.status_code == 404:
                        raise ArtifactRemoteError(f"artifact {self.object_url(key)} is not in the remote store")
                    raise self._fail("download of", key, response=r)
                yield from r.iter_bytes(_CHUNK)
        except httpx.HTTPError as e:
            raise self._fail("download of", key, e) from e

    def delete(self, key: str) -> None:
        import httpx

        try:
            r = self._client.delete(f"{self.endpoint}/{quote(self._key(key))}")
        except httpx.HTTPError as e:
            raise self._fail("delete of", key, e) from e
        if r.status_code not in (200, 404):
            raise self._fail("delete of", key, response=r)

    def close(self) -> None:
        self._client.close()


def backend_from_url(url: str | None, *, tracking_uri: str | None = None) -> RemoteBackend | None:
    """The backend ``artifacts.url`` names (None: the embedded default, no remote)."""
    if not url:
        return None
    if url.startswith("mlflow-artifacts:"):
        return MlflowProxyBackend(url, tracking_uri)
    if url.startswith("memory:") and not url.startswith("memory://"):  # the config strips trailing slashes
        url = "memory://"
    return ArrowBackend(url)

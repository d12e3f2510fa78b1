"""The team compose file opens no control plane to the network (issue 31, finding 3).

No Docker engine runs here, so ``infra/compose.yaml`` is checked statically, and its one piece of
code, ``infra/with-secrets.sh`` (``NAME_FILE`` -> ``NAME``), is run. Guaranteed by these tests: no
port is published beyond loopback; no password, key or auth string is written in the file (they come
from secret files); vLLM requires an API key (its runtime LoRA endpoints live under ``/v1``, which the
key guards); MLflow runs its basic-auth app and Prefect its basic auth, and the workers hold the
matching credentials. Not checked here: that the images honour these settings at run time (that needs
Docker), and what a service exposes to the other containers of its own network.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "compose.yaml"
LOOPBACK = {"127.0.0.1", "::1", "[::1]", "localhost"}
# Variable names that hold a credential (their value must never be written in the file).
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|API_KEY|AUTH_STRING|TOKEN|PRIVATE_KEY)$")
WORKERS = ("prefect-worker", "prefect-worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _argv(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def _secret_of(compose: dict, service: str, path: str) -> str:
    """The secret that ``path`` (a ``*_FILE`` value) is, checked to be declared from a file and given
    to the service."""
    m = re.fullmatch(r"/run/secrets/([A-Za-z0-9_.-]+)", path)
    assert m, f"{service}: {path} is not a docker secret (/run/secrets/NAME)"
    name = m.group(1)
    declared = (compose.get("secrets") or {}).get(name)
    assert declared and "file" in declared, f"secret {name!r} is not declared with a file"
    given = [s if isinstance(s, str) else s.get("source") for s in compose["services"][service].get("secrets") or []]
    assert name in given, f"{service} reads {path} but is not given the secret {name!r}"
    return name


def test_compose_publishes_no_port_beyond_loopback(compose):
    """Finding 3: 5432, 5000, 4200, 8000 (and MinIO's 9000/9001) were published on every interface."""
    published = 0
    for name, svc in compose["services"].items():
        assert svc.get("network_mode") != "host", f"{name} shares the host's network: every port it opens is public"
        for p in svc.get("ports") or []:
            published += 1
            if isinstance(p, dict):
                host_ip = p.get("host_ip")
            else:
                spec = str(p).rsplit("/", 1)[0]
                m = re.fullmatch(r"(?:(\[[^\]]+\]|[^:]+):)?(?:([\d-]*):)?([\d-]+)", spec)
                assert m, f"{name}: cannot read the port {p!r}"
                host_ip = m.group(1) if m.group(2) is not None else None
            assert host_ip in LOOPBACK, f"{name} publishes {p!r} on every interface (bind it to 127.0.0.1)"
    assert published, "no published port at all: the file is not the one these tests were written for"


def _walk_strings(node, where: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk_strings(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk_strings(v, f"{where}[{i}]")
    elif node is not None:
        yield where, str(node)


def test_compose_holds_no_inline_password_key_or_auth_string(compose):
    """Finding 3: the Postgres password `flywheel` (in POSTGRES_PASSWORD, PGPASSWORD and two URLs), the
    MinIO secret and the S3 key were written in the file. Every credential now comes from a secret file
    (``NAME_FILE``, read by the image or by ``infra/with-secrets.sh``)."""
    for name, svc in compose["services"].items():
        for key, value in _env(svc).items():
            if SECRET_NAME.search(key):
                pytest.fail(f"{name}: {key} is written in the file ({value[:2]}...): use {key}_FILE and a secret")
            if key.endswith("_FILE") and SECRET_NAME.search(key[:-5]):
                _secret_of(compose, name, value)
    for where, text in _walk_strings(compose, "compose"):
        assert not re.search(r"://[^/\s:@]+:[^@\s/]+@", text), f"{where}: a URL with a password in it: {text[:80]}"
        assert not re.search(r"--(api-key|password)[ =](?!\$)", text), f"{where}: a credential on a command line"
        assert "flywheel-secret" not in text and "password1234" not in text, f"{where}: a known default credential"


def test_with_secrets_exports_each_file_variable_and_refuses_a_missing_file(tmp_path):
    script = ROOT / "infra" / "with-secrets.sh"
    (tmp_path / "k").write_text("s3cret-key\n")
    env = {"PATH": os.environ["PATH"], "VLLM_API_KEY_FILE": str(tmp_path / "k")}
    r = subprocess.run(["sh", str(script), "sh", "-c", 'printf %s "$VLLM_API_KEY"'], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == "s3cret-key", r  # trailing newline of the file dropped
    env["VLLM_API_KEY_FILE"] = str(tmp_path / "missing")
    r = subprocess.run(["sh", str(script), "true"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "VLLM_API_KEY_FILE" in r.stderr  # no silent start without the key


def _runs_with_secrets(svc: dict) -> bool:
    return any(a.endswith("with-secrets.sh") for a in _argv(svc.get("entrypoint")) + _argv(svc.get("command")))


def test_compose_vllm_requires_an_api_key_for_every_v1_call(compose):
    """Finding 3: vLLM served /v1 (runtime LoRA loading included) with no key."""
    vllm = compose["services"]["vllm"]
    env = _env(vllm)
    assert "VLLM_API_KEY_FILE" in env and _runs_with_secrets(vllm), "vLLM starts without VLLM_API_KEY"
    key = _secret_of(compose, "vllm", env["VLLM_API_KEY_FILE"])
    for w in WORKERS:  # the workers' policy client sends the same key (policy.api_key_env)
        wenv = _env(compose["services"][w])
        assert _secret_of(compose, w, wenv["FLYWHEEL_POLICY_API_KEY_FILE"]) == key
        assert _runs_with_secrets(compose["services"][w])


def test_compose_mlflow_and_prefect_require_authentication(compose):
    """Finding 3: anyone reaching MLflow could move the `champion` alias; anyone reaching Prefect could
    run flows. MLflow runs its basic-auth app (admin password from a secret, a config file naming the
    admin), Prefect its basic auth (PREFECT_SERVER_API_AUTH_STRING); the workers log in to both."""
    services = compose["services"]
    mlflow = services["mlflow"]
    argv = _argv(mlflow.get("command"))
    assert "--app-name" in argv and argv[argv.index("--app-name") + 1] == "basic-auth"
    env = _env(mlflow)
    assert _runs_with_secrets(mlflow)
    admin_pw = _secret_of(compose, "mlflow", env["MLFLOW_AUTH_ADMIN_PASSWORD_FILE"])
    _secret_of(compose, "mlflow", env["MLFLOW_FLASK_SERVER_SECRET_KEY_FILE"])
    ini_in_container = env["MLFLOW_AUTH_CONFIG_PATH"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in mlflow.get("volumes") or []}
    assert ini_in_container in mounts, "the auth config file is not mounted where MLFLOW_AUTH_CONFIG_PATH says"
    ini = configparser.ConfigParser()
    ini.read(COMPOSE.parent / mounts[ini_in_container])
    admin = ini["mlflow"]["admin_username"]
    assert "admin_password" not in ini["mlflow"], "the admin password belongs in a secret, not the config file"
    assert ini["mlflow"]["authorization_function"].endswith("authenticate_request_basic_auth")

    prefect = services["prefect-server"]
    penv = _env(prefect)
    assert _runs_with_secrets(prefect)
    auth = _secret_of(compose, "prefect-server", penv["PREFECT_SERVER_API_AUTH_STRING_FILE"])
    for w in WORKERS:
        wenv = _env(services[w])
        assert wenv["MLFLOW_TRACKING_USERNAME"] == admin
        assert _secret_of(compose, w, wenv["MLFLOW_TRACKING_PASSWORD_FILE"]) == admin_pw
        assert _secret_of(compose, w, wenv["PREFECT_API_AUTH_STRING_FILE"]) == auth

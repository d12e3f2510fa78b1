"""The team deployment files agree with the code: ``infra/compose.yaml`` (no Docker engine runs here,
so it is checked statically) and ``prefect.yaml``.

- every ``FLYWHEEL_<SECTION>__<FIELD>`` a container gets is a real field of the config, and the
  whole environment of each flywheel container loads through :func:`flywheel.config.load_config`;
- the URLs flywheel is given (``PREFECT_API_URL``, ``MLFLOW_TRACKING_URI``, the vLLM base URL) name a
  service of the file, on the port that service listens on, with the path its API lives under;
- MLflow 3's host-header check accepts the name the workers use for it;
- ``prefect.yaml`` validates with Prefect's own model, its entrypoints exist, its cron schedules parse,
  and its work pools are the ones the compose workers serve.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "compose.yaml"
PREFECT_YAML = ROOT / "prefect.yaml"
FLYWHEEL_SERVICES = ("prefect-worker", "prefect-worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def prefect_yaml() -> dict:
    return yaml.safe_load(PREFECT_YAML.read_text())


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the "KEY=value" list form
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _command(service: dict) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _published(service: dict) -> dict[int, int]:
    """container port -> host port of the service's ``ports``."""
    out = {}
    for p in service.get("ports") or []:
        parts = str(p).split(":")
        out[int(parts[-1])] = int(parts[-2]) if len(parts) > 1 else int(parts[-1])
    return out


def _listen_port(name: str, service: dict) -> int:
    """The port the service's process listens on, from its command (or the image's default)."""
    argv = _command(service)
    port = _flag(argv, "--port")
    if port is not None:
        return int(port)
    defaults = {"postgres": 5432, "minio": 9000}
    assert name in defaults, f"service {name}: no --port in its command and no known default"
    return defaults[name]


# ------------------------------------------------------------------------------------------ compose


def test_compose_parses_and_has_the_team_services(compose):
    services = compose["services"]
    for name in ("postgres", "minio", "prefect-server", "mlflow", "prefect-worker", "prefect-worker-gpu", "vllm"):
        assert name in services, f"infra/compose.yaml has no service {name!r}"
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, f"service {name} has neither image nor build"
        for dep in svc.get("depends_on") or []:
            assert dep in services, f"service {name} depends on unknown service {dep!r}"
        for vol in svc.get("volumes") or []:
            src = str(vol).split(":")[0]
            if not src.startswith((".", "/")):
                assert src in (compose.get("volumes") or {}), f"service {name}: named volume {src!r} is not declared"
            elif src.startswith("."):
                assert (COMPOSE.parent / src).exists(), f"service {name} mounts {src}, which does not exist"


def test_every_flywheel_variable_is_a_config_field(compose):
    from flywheel.config import FlywheelConfig, load_config

    services = compose["services"]
    seen = 0
    for name in FLYWHEEL_SERVICES:
        env = _env(services[name])
        for key in env:
            if not key.startswith("FLYWHEEL_") or "__" not in key:
                continue
            section, _, field = key[len("FLYWHEEL_"):].lower().partition("__")
            assert section in FlywheelConfig.model_fields, f"{name}: {key}: no config section {section!r}"
            cls = FlywheelConfig.model_fields[section].annotation
            assert field in cls.model_fields, f"{name}: {key}: section {section!r} has no field {field!r}"
            seen += 1
        # The container's whole environment loads (no ConfigError), and says what it means.
        cfg = load_config(environ=env)
        assert str(cfg.home) == env["FLYWHEEL_HOME"]
        assert cfg.mlflow_tracking_uri == env["MLFLOW_TRACKING_URI"]
        assert cfg.policy.base_url == env["FLYWHEEL_POLICY__BASE_URL"]
    assert seen >= 2 * len(FLYWHEEL_SERVICES)
    gpu = load_config(environ=_env(services["prefect-worker-gpu"]))
    assert gpu.policy.device == "cuda"


def _service_of(url: str, compose: dict) -> tuple[str, dict, int]:
    u = urlparse(url)
    assert u.scheme == "http" and u.hostname in compose["services"], f"{url} names no service of the compose file"
    return u.hostname, compose["services"][u.hostname], u.port


def test_urls_point_at_the_services_and_their_ports(compose):
    for name in FLYWHEEL_SERVICES:
        env = _env(compose["services"][name])
        # Prefect: the server's API lives under /api.
        svc_name, svc, port = _service_of(env["PREFECT_API_URL"], compose)
        assert svc_name == "prefect-server" and urlparse(env["PREFECT_API_URL"]).path == "/api"
        assert port == _listen_port(svc_name, svc)
        assert port in _published(svc), "the Prefect API port is not published (the CLI reaches it from the host)"
        # MLflow tracking server.
        svc_name, svc, port = _service_of(env["MLFLOW_TRACKING_URI"], compose)
        assert svc_name == "mlflow" and port == _listen_port(svc_name, svc) and port in _published(svc)
        # vLLM: OpenAI-compatible API under /v1.
        svc_name, svc, port = _service_of(env["FLYWHEEL_POLICY__BASE_URL"], compose)
        assert svc_name == "vllm" and urlparse(env["FLYWHEEL_POLICY__BASE_URL"]).path == "/v1"
        assert port == _listen_port(svc_name, svc) and port in _published(svc)
        assert env.get("PREFECT_SERVER_ANALYTICS_ENABLED") == "false"  # no internet from the workers
        # Both workers share the single-writer home volume mounted where FLYWHEEL_HOME points.
        mounts = {str(v).split(":")[1] for v in compose["services"][name].get("volumes") or []}
        assert env["FLYWHEEL_HOME"] in mounts, f"{name}: FLYWHEEL_HOME is not on a volume"


def test_servers_use_postgres_and_the_object_store(compose):
    services = compose["services"]
    # Prefect builds its database URL from these parts (the password from the same secret as Postgres').
    prefect = _env(services["prefect-server"])
    pg_env = _env(services["postgres"])
    assert prefect["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert prefect["PREFECT_SERVER_DATABASE_HOST"] == "postgres" and prefect["PREFECT_SERVER_DATABASE_PORT"] == "5432"
    assert prefect["PREFECT_SERVER_DATABASE_USER"] == pg_env["POSTGRES_USER"]
    assert prefect["PREFECT_SERVER_DATABASE_PASSWORD_FILE"] == pg_env["POSTGRES_PASSWORD_FILE"]
    assert prefect["PREFECT_SERVER_DATABASE_NAME"] == pg_env["POSTGRES_DB"]

    mlflow = services["mlflow"]
    argv = _command(mlflow)
    backend = urlparse(_flag(argv, "--backend-store-uri"))
    assert backend.hostname == "postgres" and backend.username == pg_env["POSTGRES_USER"] and backend.password is None
    assert _env(mlflow)["PGPASSWORD_FILE"] == pg_env["POSTGRES_PASSWORD_FILE"]  # libpq reads PGPASSWORD
    # MLflow's database is created by the init script next to the compose file.
    init = (COMPOSE.parent / "postgres-init.sql").read_text()
    assert re.search(rf"CREATE DATABASE {backend.path.lstrip('/')}\b", init)
    assert _flag(argv, "--artifacts-destination").startswith("s3://")
    endpoint = urlparse(_env(mlflow)["MLFLOW_S3_ENDPOINT_URL"])
    assert endpoint.hostname == "minio" and endpoint.port == _listen_port("minio", services["minio"])
    assert _env(mlflow)["AWS_ACCESS_KEY_ID"] == _env(services["minio"])["MINIO_ROOT_USER"]


def test_workers_share_the_event_store_on_the_compose_postgres(compose):
    """Team mode: every worker's store.url names the compose Postgres, a database its init script
    creates, the user it runs as, and no password (that travels as PGPASSWORD, read from the secret
    Postgres itself was given)."""
    from flywheel.config import load_config

    services = compose["services"]
    pg_env = _env(services["postgres"])
    init = (COMPOSE.parent / "postgres-init.sql").read_text()
    for name in FLYWHEEL_SERVICES:
        env = _env(services[name])
        url = load_config(environ=env).store.url
        u = urlparse(url)
        assert u.scheme == "postgresql" and u.hostname == "postgres" and u.port == _listen_port("postgres", services["postgres"])
        assert u.username == pg_env["POSTGRES_USER"] and u.password is None
        assert env["PGPASSWORD_FILE"] == pg_env["POSTGRES_PASSWORD_FILE"]
        assert re.search(rf"CREATE DATABASE {u.path.lstrip('/')}\b", init)
        deps = services[name]["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy"


def test_mlflow_accepts_the_host_name_workers_use(compose):
    """MLflow 3 rejects Host headers outside localhost/private IPs unless --allowed-hosts lists them;
    the workers send ``Host: mlflow:5000``."""
    from mlflow.server.security_utils import is_allowed_host_header

    argv = _command(compose["services"]["mlflow"])
    allowed = _flag(argv, "--allowed-hosts")
    assert allowed, "mlflow server without --allowed-hosts refuses requests addressed to `mlflow:5000`"
    hosts = [h.strip() for h in allowed.split(",")]
    tracking = urlparse(_env(compose["services"]["prefect-worker"])["MLFLOW_TRACKING_URI"])
    assert is_allowed_host_header(hosts, tracking.netloc)
    assert is_allowed_host_header(hosts, "localhost:5000")  # the published port, from the host
    assert not is_allowed_host_header(hosts, "evil.example:5000")


def test_workers_serve_the_pools_of_prefect_yaml(compose, prefect_yaml):
    pools = {d["work_pool"]["name"] for d in prefect_yaml["deployments"]}
    served = set()
    for name in FLYWHEEL_SERVICES:
        argv = _command(compose["services"][name])
        assert argv[:3] == ["prefect", "worker", "start"], f"{name} does not run a Prefect worker"
        served.add(_flag(argv, "--pool"))
        assert _flag(argv, "--type") == "process"
    assert pools == served, f"prefect.yaml targets {pools}, the compose workers serve {served}"


# ------------------------------------------------------------------------------------------ prefect.yaml


def test_prefect_yaml_validates_and_its_entrypoints_exist(prefect_yaml):
    from prefect.cli.deploy._models import PrefectYamlModel, RawScheduleConfig
    from prefect.schedules import Cron

    model = PrefectYamlModel.model_validate(prefect_yaml)
    assert {d.name for d in model.deployments} == {"nightly-cpu", "nightly-gpu"}
    for dep in model.deployments:
        path, _, func = dep.entrypoint.partition(":")
        file = ROOT / path
        assert file.is_file(), f"{dep.name}: entrypoint file {path} does not exist"
        assert re.search(rf"^def {func}\(", file.read_text(), re.M), f"{dep.name}: {path} defines no {func}()"
        assert dep.schedules, f"{dep.name} has no schedule"
        for s in dep.schedules:
            assert isinstance(s, RawScheduleConfig) and s.cron == "0 2 * * *"
            Cron(s.cron, timezone=s.timezone)  # raises on a bad cron or timezone
        assert dep.concurrency_limit is not None and dep.concurrency_limit.limit == 1
        assert dep.work_pool.name in ("flywheel-cpu", "flywheel-gpu")
        params = dep.parameters or {}
        assert set(params) <= {"traces", "config_path", "overrides", "force"}
        env = (dep.work_pool.job_variables or {}).get("env") or {}
        from flywheel.config import load_config

        load_config(environ={str(k): str(v) for k, v in env.items()})  # worker env is valid config
    # The GPU deployment's schedule starts inactive: only one cycle may write the event store.
    active = [d.name for d in model.deployments if any(s.active is not False for s in d.schedules)]
    assert active == ["nightly-cpu"]


def test_prefect_yaml_entrypoint_is_the_flow():
    """The entrypoint loads as the ``flywheel-cycle`` flow, as a worker would load it."""
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(str(ROOT / "flows" / "cycle.py") + ":flywheel_cycle")
    assert flow.name == "flywheel-cycle"
    assert {"traces", "config_path", "overrides", "force"} <= set(flow.parameters.properties)
    # The same module the library imports (flywheel.flows), so the CLI and workers run one flow.
    assert importlib.util.find_spec("flywheel.flows.cycle") is not None


def test_readme_links_the_recipes():
    readme = (ROOT / "infra" / "README.md").read_text()
    for link in ("vllm/README.md", "deepspeed/README.md", "compose.yaml", "../prefect.yaml"):
        assert f"]({link})" in readme, f"infra/README.md does not link {link}"
        assert (ROOT / "infra" / link).resolve().exists(), link

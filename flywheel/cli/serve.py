"""``flywheel serve``: the OpenAI-compatible server over the HF backend (see ``flywheel.serve``)."""

from __future__ import annotations

import typer

from flywheel.cli.common import CliError, ConfigOpt, HomeOpt, JsonOpt, console, emit_json, handle_errors, load


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@handle_errors
def serve(
    model: str = typer.Option(
        None, "--model", help="champion | challenger | model:<name>/<N> | <name>/<N> (a registered version, "
        "loaded as it is now; --champion follows the alias) | 'smollm2-135m' | 'tiny' | a local HF model directory "
        "(default: policy.base_model)."
    ),
    host: str = typer.Option(None, "--host", help="Bind address (default serve.host, 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="Port (default serve.port, 8000; 0 picks a free one)."),
    api_key_file: str = typer.Option(
        None, "--api-key-file", help="File whose first line is the API key clients must send as 'Authorization: "
        "Bearer KEY' (else $FLYWHEEL_API_KEY, else serve.api_key_file). Mandatory off loopback, advised on any "
        "shared machine. There is no option taking the key itself: `ps` shows arguments to every user.",
        show_default=False,
    ),
    champion: bool = typer.Option(
        False, "--champion", help="Serve the MLflow alias 'champion' of cycle.model_name and follow it: a "
        "promotion or rollback is picked up without a restart (polled every serve.poll_alias_s, or on SIGHUP).",
    ),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Serve a policy with an OpenAI-compatible API (/v1/chat/completions, /v1/models; the LoRA endpoints
    only with serve.allow_adapter_loading).

    Runs until interrupted. With --json, one JSON line with the base URL is printed once the socket is
    bound (scripts can wait for it); logs go to stderr.
    """
    from pathlib import Path

    from flywheel.policy.models import ModelLoadError  # ~30 ms: off the CLI's start
    from flywheel.serve import ServeError, resolve_api_key  # fastapi+duckdb, ~0.8 s: off the CLI's start
    from flywheel.serve import serve as run_server  # fastapi+duckdb, ~0.8 s: off the CLI's start

    cfg = load(home, config)
    try:
        key = resolve_api_key(cfg, None, host or cfg.serve.host,
                              key_file=Path(api_key_file).expanduser().absolute() if api_key_file else None)
    except ServeError as e:
        raise CliError(str(e), code=2) from None
    provider = None
    if champion:
        if model:
            raise CliError("--champion and --model are exclusive: --champion serves the registered champion")
        from flywheel.deploy import DeployError, champion_provider  # duckdb, ~0.6 s: off the CLI's start

        try:
            provider = champion_provider(cfg)
        except DeployError as e:
            raise CliError(str(e), code=2) from None
        model = f"model:{provider.name}/{provider.version} (champion, followed)"

    def ready(h: str, p: int) -> None:
        url = f"http://{h}:{p}"
        if as_json:
            emit_json({"url": url, "model": model or cfg.policy.base_model, "auth": key is not None})
        else:
            console.print(f"serving [bold]{model or cfg.policy.base_model}[/] at {url}/v1")

    try:
        run_server(cfg, model=None if provider else model, host=host, port=port, api_key=key, on_ready=ready,
                   provider=provider)
    except (ServeError, ModelLoadError) as e:
        raise CliError(str(e), code=2) from None
    except OSError as e:  # address in use, permission denied on a low port
        raise CliError(f"cannot bind {host or cfg.serve.host}:{port if port is not None else cfg.serve.port}: {e}",
                       code=2) from None
    finally:
        if provider is not None:
            provider.stop()

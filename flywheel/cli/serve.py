"""``flywheel serve``: the OpenAI-compatible server over the HF backend (see ``flywheel.serve``)."""

from __future__ import annotations

import os

import typer

from flywheel.cli.common import CliError, ConfigOpt, HomeOpt, JsonOpt, console, emit_json, handle_errors, load


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@handle_errors
def serve(
    model: str = typer.Option(
        None, "--model", help="'smollm2-135m', 'tiny' or a local HF model directory (default: policy.base_model)."
    ),
    host: str = typer.Option(None, "--host", help="Bind address (default serve.host, 127.0.0.1)."),
    port: int = typer.Option(None, "--port", help="Port (default serve.port, 8000; 0 picks a free one)."),
    api_key: str = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' (default: $FLYWHEEL_API_KEY). "
        "Mandatory when binding to anything but loopback.", show_default=False,
    ),
    champion: bool = typer.Option(
        False, "--champion", help="Serve the MLflow alias 'champion' of cycle.model_name and follow it: a "
        "promotion or rollback is picked up without a restart (polled every serve.poll_alias_s, or on SIGHUP).",
    ),
    home: str = HomeOpt,
    config: str = ConfigOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Serve a policy with an OpenAI-compatible API (/v1/chat/completions, /v1/models, LoRA endpoints).

    Runs until interrupted. With --json, one JSON line with the base URL is printed once the socket is
    bound (scripts can wait for it); logs go to stderr.
    """
    from flywheel.policy.models import ModelLoadError
    from flywheel.serve import ServeError
    from flywheel.serve import serve as run_server

    cfg = load(home, config)
    provider = None
    if champion:
        if model:
            raise CliError("--champion and --model are exclusive: --champion serves the registered champion")
        from flywheel.deploy import DeployError, champion_provider

        try:
            provider = champion_provider(cfg)
        except DeployError as e:
            raise CliError(str(e), code=2) from None
        model = f"model:{provider.name}/{provider.version} (champion, followed)"

    def ready(h: str, p: int) -> None:
        url = f"http://{h}:{p}"
        if as_json:
            emit_json({"url": url, "model": model or cfg.policy.base_model, "auth": bool(api_key or os.environ.get(cfg.serve.api_key_env))})
        else:
            console.print(f"serving [bold]{model or cfg.policy.base_model}[/] at {url}/v1")

    try:
        run_server(cfg, model=None if provider else model, host=host, port=port, api_key=api_key, on_ready=ready,
                   provider=provider)
    except (ServeError, ModelLoadError) as e:
        raise CliError(str(e), code=2) from None
    except OSError as e:  # address in use, permission denied on a low port
        raise CliError(f"cannot bind {host or cfg.serve.host}:{port if port is not None else cfg.serve.port}: {e}",
                       code=2) from None
    finally:
        if provider is not None:
            provider.stop()

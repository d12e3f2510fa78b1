"""Helpers for tests that need a real (tiny) policy: plain functions, no pytest dependency.

Typical use in a test module::

    @pytest.fixture(scope="session")
    def tiny_home(tmp_path_factory):
        return tiny_model_home(tmp_path_factory.mktemp("policy-home"))

The first call converts the SmolLM2 tokenizer from the GGUF (~5 s) and builds the tiny model
(<1 s); later calls with the same home reuse both from disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.policy.hf import HFPolicy
from flywheel.policy.models import TINY, ensure_base_model, load_model


def tiny_model_home(home: Path) -> Path:
    """Make sure ``<home>/models/base/tiny`` exists; returns ``home``."""
    ensure_base_model(TINY, Path(home))
    return Path(home)


def tiny_policy(home: Path, **kwargs: Any) -> Any:
    """An fp32 CPU :class:`~flywheel.policy.hf.HFPolicy` over the tiny model."""
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    return HFPolicy.from_spec(TINY, Path(tiny_model_home(home)), **kwargs)


def make_lora_adapter(home: Path, out_dir: Path, *, seed: int = 0, r: int = 4) -> Path:
    """Save a LoRA adapter for the tiny model with random (non-zero) A and B matrices, so that it
    visibly changes the model's outputs. Returns ``out_dir``."""
    import torch  # heavy: only when an adapter is made
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(TINY, home=Path(home), device="cpu", dtype="float32")
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, cfg)
        with torch.no_grad():  # scale up so greedy outputs of the tiny model surely change
            for n, p in peft_model.named_parameters():
                if "lora_" in n:
                    p.mul_(20.0)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


_SESSION_HOME: Path | None = None


def session_tiny_home(tmp_path_factory: Any) -> Path:
    """One tiny-model home per test process, shared by every test module that asks (pytest's
    ``tmp_path_factory`` is session-scoped), so the ~5 s tokenizer conversion runs once per run."""
    global _SESSION_HOME
    if _SESSION_HOME is None or not (_SESSION_HOME / "models" / "base" / TINY).exists():
        _SESSION_HOME = tiny_model_home(tmp_path_factory.mktemp("tiny-policy-home"))
    return _SESSION_HOME

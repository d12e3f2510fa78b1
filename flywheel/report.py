"""One self-contained HTML page per cycle: what came in, what was learned, what the gate decided.

Sections: the cycle summary; failure kinds over time (from the ingested traces); the training curves
(per-step metrics of the cycle's training runs, from MLflow); champion vs challenger pass rates with
95% Wilson intervals per slice (from the gate decision); the gate's rules; and the lineage graph of
the new model. Charts are inline SVG and the page loads nothing from the network (it must open on an
air-gapped machine), so it is one file you can attach to a ticket.
"""

from __future__ import annotations

import html
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from flywheel.artifacts import ArtifactStore, load_traces, open_artifacts
from flywheel.config import FlywheelConfig
from flywheel.cycle import sandbox_warning
from flywheel.lineage import traces_of
from flywheel.stats import wilson
from flywheel.store import EventStore
from flywheel.tracking import Tracker

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


class ReportError(LookupError):
    pass


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


# ------------------------------------------------------------------------------------------ charts


def svg_stacked_bars(categories: list[str], series: dict[str, list[float]], *, title: str, width: int = 760,
                     height: int = 260) -> str:
    pad_l, pad_b, pad_t = 48, 56, 24
    w, h = width - pad_l - 16, height - pad_b - pad_t
    totals = [sum(s[i] for s in series.values()) for i in range(len(categories))]
    top = max(totals or [1]) or 1
    bw = w / max(len(categories), 1)
    parts = [f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">']
    parts.append(f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#999"/>')
    for frac in (0.0, 0.5, 1.0):
        y = pad_t + h - frac * h
        parts.append(f'<text x="{pad_l - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{top * frac:g}</text>')
    for i, cat in enumerate(categories):
        y = pad_t + h
        for j, (name, vals) in enumerate(series.items()):
            v = vals[i]
            if v <= 0:
                continue
            bh = v / top * h
            y -= bh
            parts.append(f'<rect x="{pad_l + i * bw + 2:.1f}" y="{y:.1f}" width="{max(bw - 4, 1):.1f}" height="{bh:.1f}" '
                         f'fill="{PALETTE[j % len(PALETTE)]}"><title>{esc(cat)} {esc(name)}: {v:g}</title></rect>')
        parts.append(f'<text x="{pad_l + i * bw + bw / 2:.1f}" y="{pad_t + h + 14}" font-size="10" text-anchor="middle">'
                     f'{esc(cat[-5:])}</text>')
    lx = pad_l
    for j, name in enumerate(series):
        parts.append(f'<rect x="{lx}" y="{height - 18}" width="10" height="10" fill="{PALETTE[j % len(PALETTE)]}"/>'
                     f'<text x="{lx + 14}" y="{height - 9}" font-size="11">{esc(name)}</text>')
        lx += 16 + 7 * len(name) + 12
    parts.append("</svg>")
    return "".join(parts)


def svg_lines(series: dict[str, list[tuple[float, float]]], *, title: str, width: int = 760, height: int = 240) -> str:
    pad_l, pad_b, pad_t = 72, 40, 20
    w, h = width - pad_l - 16, height - pad_b - pad_t
    pts = [p for s in series.values() for p in s]
    if not pts:
        return '<p class="empty">no training metrics recorded</p>'
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    digits = 3
    while digits < 9 and f"{y0:.{digits}g}" == f"{y1:.{digits}g}":
        digits += 1
    parts = [f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#999"/>',
             f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}" stroke="#999"/>',
             f'<text x="{pad_l - 6}" y="{pad_t + 4}" font-size="10" text-anchor="end">{y1:.{digits}g}</text>',
             f'<text x="{pad_l - 6}" y="{pad_t + h}" font-size="10" text-anchor="end">{y0:.{digits}g}</text>',
             f'<text x="{pad_l + w}" y="{pad_t + h + 14}" font-size="10" text-anchor="end">step {x1:g}</text>']
    for j, (name, s) in enumerate(series.items()):
        col = PALETTE[j % len(PALETTE)]
        coords = " ".join(f"{pad_l + (x - x0) / (x1 - x0) * w:.1f},{pad_t + h - (y - y0) / (y1 - y0) * h:.1f}" for x, y in s)
        parts.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="{coords}"><title>{esc(name)}</title></polyline>')
        parts.append(f'<text x="{pad_l + 8 + j * 150}" y="{height - 8}" font-size="11" fill="{col}">{esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def svg_pass_rates(rows: list[dict[str, Any]], *, title: str, width: int = 760) -> str:
    """Grouped horizontal bars: champion and challenger pass rate per slice with Wilson intervals."""
    bar_h, gap, pad_l = 12, 10, 220
    height = 30 + len(rows) * (2 * bar_h + gap) + 20
    w = width - pad_l - 24
    parts = [f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        x = pad_l + frac * w
        parts.append(f'<line x1="{x:.1f}" y1="18" x2="{x:.1f}" y2="{height - 20}" stroke="#eee"/>'
                     f'<text x="{x:.1f}" y="12" font-size="10" text-anchor="middle">{frac:.0%}</text>')
    y = 24
    for r in rows:
        label = f'{r["slice"]} (n={r["n"]})'
        # ~6 px per character at 11 px: the label must fit left of the bars (pad_l - 8 px).
        room = (pad_l - 12) // 6
        short = label if len(label) <= room else "…" + label[-(room - 1):]
        parts.append(f'<text x="{pad_l - 8}" y="{y + bar_h + 4}" font-size="11" text-anchor="end">{esc(short)}'
                     f'<title>{esc(label)}</title></text>')
        for who in ("champion", "challenger"):
            k = r[f"{who}_passed"]
            rate = k / r["n"] if r["n"] else 0.0
            lo, hi = wilson(k, r["n"])
            col = "#bab0ac" if who == "champion" else "#4e79a7"
            parts.append(f'<rect x="{pad_l}" y="{y}" width="{rate * w:.1f}" height="{bar_h}" fill="{col}">'
                         f'<title>{who}: {rate:.1%} [{lo:.1%}, {hi:.1%}]</title></rect>')
            parts.append(f'<line x1="{pad_l + lo * w:.1f}" y1="{y + bar_h / 2}" x2="{pad_l + hi * w:.1f}" '
                         f'y2="{y + bar_h / 2}" stroke="#333" stroke-width="1.5"/>')
            y += bar_h
        y += gap
    parts.append(f'<rect x="{pad_l}" y="{height - 14}" width="10" height="10" fill="#bab0ac"/>'
                 f'<text x="{pad_l + 14}" y="{height - 5}" font-size="11">champion</text>'
                 f'<rect x="{pad_l + 100}" y="{height - 14}" width="10" height="10" fill="#4e79a7"/>'
                 f'<text x="{pad_l + 114}" y="{height - 5}" font-size="11">challenger (bars: 95% Wilson CI)</text>')
    parts.append("</svg>")
    return "".join(parts)


def svg_lineage(edges: list[tuple[str, str]], root: str, *, width: int = 1100, max_per_column: int = 12) -> str:
    """A layered drawing of the causal graph: one column per entity kind, from the model to traces."""
    order = ["model", "gate", "run", "rollouts", "env", "synth", "suite", "eval", "failure", "trace"]
    nodes = {root} | {c for c, _ in edges} | {p for _, p in edges}
    cols: dict[str, list[str]] = defaultdict(list)
    for n in sorted(nodes):
        cols[n.split(":", 1)[0]].append(n)
    kinds = [k for k in order if k in cols] + sorted(k for k in cols if k not in order)
    shown: dict[str, tuple[float, float]] = {}
    col_w = width / max(len(kinds), 1)
    rows = min(max((len(v) for v in cols.values()), default=1), max_per_column + 1)
    height = 60 + rows * 34
    parts = [f'<svg class="chart" id="lineage-svg" role="img" aria-label="lineage of {esc(root)}" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">']
    for i, k in enumerate(kinds):
        x = i * col_w + col_w / 2
        parts.append(f'<text x="{x:.1f}" y="16" font-size="12" font-weight="bold" text-anchor="middle">{esc(k)} ({len(cols[k])})</text>')
        for j, n in enumerate(cols[k][:max_per_column]):
            shown[n] = (x, 40 + j * 34)
        if len(cols[k]) > max_per_column:
            parts.append(f'<text x="{x:.1f}" y="{40 + max_per_column * 34 + 4}" font-size="10" text-anchor="middle">'
                         f'… {len(cols[k]) - max_per_column} more</text>')
    for c, p in edges:
        if c in shown and p in shown:
            (x1, y1), (x2, y2) = shown[c], shown[p]
            parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="#ccc"/>')
    for n, (x, y) in shown.items():
        label = n if len(n) <= 22 else n[:20] + "…"
        fill = "#fde9d9" if n == root else "#f4f6fa"
        parts.append(f'<g><rect x="{x - col_w / 2 + 4:.1f}" y="{y - 11:.1f}" width="{col_w - 8:.1f}" height="22" rx="4" '
                     f'fill="{fill}" stroke="#8a9bb5"/><text x="{x:.1f}" y="{y + 4:.1f}" font-size="10" '
                     f'text-anchor="middle">{esc(label)}</text><title>{esc(n)}</title></g>')
    parts.append("</svg>")
    return "".join(parts)


# ------------------------------------------------------------------------------------------ data


def _cycle_event(store: EventStore, cycle: str | None) -> tuple[str, dict[str, Any], Any]:
    if cycle:
        cid = cycle if cycle.startswith("cycle:") else f"cycle:{cycle}"
        evs = store.read(stream=cid, types=["cycle.completed"])
        if not evs:
            raise ReportError(f"no completed cycle {cid!r} (see `flywheel events --type cycle.completed`)")
        return cid, evs[-1].payload, evs[-1]
    evs = store.read(types=["cycle.completed"], limit=1, newest_first=True)
    if not evs:
        raise ReportError("no cycle has completed yet: run `flywheel cycle` first")
    return evs[0].stream, evs[0].payload, evs[0]


def failure_kinds_over_time(store: EventStore) -> tuple[list[str], dict[str, list[float]]]:
    rows = store.failure_kinds_by_day()
    days = sorted({r[0] for r in rows if r[0]})
    kinds = sorted({r[1] for r in rows})
    series = {k: [0.0] * len(days) for k in kinds}
    for day, kind, n in rows:
        if day in days:
            series[kind][days.index(day)] += n
    return days, series


def trace_facts(artifacts: ArtifactStore, store: EventStore, traces: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per trace entity: the facts its telemetry recorded (source, model, token usage, finish reasons,
    response id; see :mod:`flywheel.ingest.otlp`), read from the trace artifacts. A trace whose
    artifact cannot be read gets no facts (the report still renders)."""
    states = [(t["trace"], (store.entity(t["trace"]) or {}).get("state") or {}) for t in traces]
    states = [(e, st) for e, st in states if isinstance(st.get("trace"), dict)]
    try:
        full = load_traces(artifacts, [st for _, st in states])
    except Exception:  # noqa: BLE001 - a missing or corrupt artifact must not take the report down
        return {}
    out = {}
    for (e, _), tr in zip(states, full, strict=True):
        meta = tr.get("metadata") or {}
        usage = meta.get("usage") or {}
        out[e] = {
            "source": str((meta.get("otel") or {}).get("convention") or tr.get("source") or ""),
            "model": str(tr.get("model") or ""),
            "tokens": f"{usage.get('input_tokens')} in / {usage.get('output_tokens')} out" if usage else "",
            "finish": ", ".join(str(x) for x in meta.get("finish_reasons") or []),
            "response": str(meta.get("response_id") or ""),
        }
    return out


def training_curves(tracker: Tracker, runs: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        rid = r.get("mlflow_run_id")
        if not rid:
            continue
        for metric in ("loss", "reward_mean"):
            try:
                hist = tracker.client.get_metric_history(rid, metric)
            except Exception:  # noqa: BLE001 - a missing metric or run: that curve is simply absent
                continue
            if hist:
                out[f"{r.get('mode', 'train')} {metric}"] = [(float(m.step), float(m.value)) for m in sorted(hist, key=lambda m: m.step)]
    return out


def _folded(cont: dict[str, Any]) -> str:
    n = (cont.get("detail") or {}).get("dev_folded_in")
    return f", with the {n} dev corrections" if n else ""


def learning_table(learn: dict[str, Any]) -> str:
    """The learning stage's arms (``train.mode = arms``): budget, dev score, and which one shipped."""
    fp = learn.get("first_pass") or {}
    rows = [f'<tr><td>first pass</td><td>{esc(fp.get("steps"))}</td><td>{esc(fp.get("tokens"))}</td>'
            f'<td>{esc(fp.get("cpu_s"))}</td><td>--</td><td>{esc(fp.get("demonstrations"))} real corrections</td></tr>']
    for a in learn.get("arms") or []:
        dev = f'{a.get("dev_passed")}/{a.get("dev_items")}' if a.get("dev_passed") is not None else "--"
        if a.get("dev_passed") is not None and a.get("dev_credit") is not None:
            dev += f', credit {a["dev_credit"]:.3f}'
        if a.get("dev_loss") is not None:
            dev += f', loss {a["dev_loss"]:.4f}'
        mark = '<span class="pass">shipped</span>' if a.get("name") == learn.get("chosen") else esc(a.get("skipped") or "")
        rows.append(f'<tr><td>{esc(a.get("name"))}</td><td>{esc(a.get("steps"))}</td><td>{esc(a.get("tokens"))}</td>'
                    f'<td>{esc(a.get("cpu_s"))}</td><td>{esc(dev)}</td><td>{mark}</td></tr>')
    cont = learn.get("continuation") or {}
    if cont.get("steps"):
        rows.append(f'<tr><td>continuation ({esc(cont.get("arm"))})</td><td>{esc(cont.get("steps"))}</td>'
                    f'<td>{esc(cont.get("tokens"))}</td><td>{esc(cont.get("cpu_s"))}</td><td>--</td>'
                    f'<td>from its trial, resuming at step {esc(cont.get("start_step"))}{esc(_folded(cont))}</td></tr>')
    reg = learn.get("regression") or {}
    if reg.get("skipped"):
        rows.append(f'<tr><td>regression check</td><td>--</td><td>--</td><td>--</td><td>--</td>'
                    f'<td>not run: {esc(reg["skipped"])}</td></tr>')
    elif reg.get("items"):
        failed = ", ".join(reg.get("failed") or []) or "none"
        rows.append(f'<tr><td>regression check</td><td>--</td><td>--</td><td>{esc(reg.get("cpu_s"))}</td>'
                    f'<td>{esc(reg.get("passed"))}/{esc(reg.get("items"))}</td><td>trial model on the regression suite; '
                    f'failed: {esc(failed)} (each {esc(reg.get("copies"))} more times in the continuation)</td></tr>')
    bl = learn.get("blend") or {}
    if bl.get("model_entity"):
        rows.append(f'<tr><td>blend with the champion</td><td>0</td><td>--</td><td>{esc(bl.get("cpu_s"))}</td><td>--</td>'
                    f'<td>shipped: {esc(bl.get("champion"))} + {esc(bl.get("weight"))} x ({esc(bl.get("trained"))} - '
                    f'{esc(bl.get("champion"))}) = {esc(bl.get("model_entity"))}</td></tr>')
    elif bl.get("skipped"):
        rows.append(f'<tr><td>blend with the champion</td><td>--</td><td>--</td><td>--</td><td>--</td>'
                    f'<td>not run: {esc(bl["skipped"])}</td></tr>')
    return (f'<p>Learning stage: <b>{esc(learn.get("chosen"))}</b> shipped ({esc(learn.get("why"))}).</p>'
            '<table id="arms"><tr><th>phase / arm</th><th>steps</th><th>tokens</th><th>CPU-s</th><th>dev passed</th>'
            f'<th></th></tr>{"".join(rows)}</table>')


def slice_rows(numbers: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    n = numbers.get("paired_items") or 0
    if n:
        rows.append({"slice": "all held-out", "n": n,
                     "champion_passed": round((numbers.get("champion_pass_rate") or 0) * n),
                     "challenger_passed": round((numbers.get("challenger_pass_rate") or 0) * n)})
    for s in numbers.get("slices") or []:
        sn = s.get("n") or s.get("size") or 0
        if not sn:
            continue
        ch = s.get("challenger_passed")
        cp = s.get("champion_passed")
        if ch is None:
            ch = round((s.get("challenger_rate") or 0) * sn)
        if cp is None:
            cp = round((s.get("champion_rate") or 0) * sn)
        rows.append({"slice": s.get("name") or s.get("slice"), "n": sn, "champion_passed": cp, "challenger_passed": ch})
    # The overall row, then the largest slices: one-item slices say little and crowd the chart.
    head, rest = rows[:1], sorted(rows[1:], key=lambda r: (-r["n"], str(r["slice"])))
    return head + rest[:MAX_SLICES]


MAX_SLICES = 12


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1140px;color:#222}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f6fa}.pass{color:#1a7f37;font-weight:bold}.fail{color:#c62828;font-weight:bold}
.muted{color:#666}.chart{max-width:100%;height:auto}code{background:#f4f6fa;padding:1px 4px;border-radius:3px}
"""


def build_report(cfg: FlywheelConfig, store: EventStore, tracker: Tracker, *, cycle: str | None = None) -> dict[str, Any]:
    """Render the report of ``cycle`` (default: the last completed one). Returns path and key facts."""
    cid, payload, ev = _cycle_event(store, cycle)
    stages = payload.get("stages") or {}
    gate = stages.get("gate") or {}
    numbers = gate.get("numbers") or {}
    model = (stages.get("learn") or {}).get("model_entity")
    for key in ("grpo", "sft"):
        if model:
            break
        if isinstance(stages.get(key), dict) and stages[key].get("model_entity"):
            model = stages[key]["model_entity"]
            break
    runs = [stages[k] for k in ("sft", "grpo") if isinstance(stages.get(k), dict) and stages[k].get("mlflow_run_id")]
    learn = stages.get("learn") if isinstance(stages.get("learn"), dict) else None
    if learn:
        runs += [{**(learn.get("first_pass") or {}), "mode": "first pass"}]
        runs += [{**a, "mode": f"arm {a.get('name')}"} for a in learn.get("arms") or [] if a.get("mlflow_run_id")]
        if (learn.get("continuation") or {}).get("mlflow_run_id"):
            runs += [{**learn["continuation"], "mode": f"continuation {learn['continuation'].get('arm')}"}]

    days, kinds = failure_kinds_over_time(store)
    curves = training_curves(tracker, runs)
    srows = slice_rows(numbers)
    edges = store.lineage_edges(model) if model else []
    traces = traces_of(store, model) if model else []

    outcome = payload.get("outcome", "?")
    badge = {"promoted": "pass", "refused": "fail"}.get(outcome, "muted")
    summary_rows = [("outcome", f'<span class="{badge}">{esc(outcome)}</span>'), ("reason", esc(payload.get("reason"))),
                    ("new failures", esc(stages.get("new_failures"))), ("wall time", f"{esc(payload.get('wall_s'))} s"),
                    ("recorded at", esc(ev.recorded_at))]
    warning = sandbox_warning({"stages": stages})
    if warning:
        summary_rows.append(("warning", f'<span class="fail">{esc(warning)}</span>'))
    if "ingest" in stages:
        i = stages["ingest"]
        summary_rows.append(("ingest", esc(f"{i.get('read')} read, {i.get('ingested')} ingested, {i.get('quarantined')} quarantined")))
    for key in ("rollouts", "rollouts_after_sft"):
        if isinstance(stages.get(key), dict):
            s = stages[key].get("stats") or {}
            summary_rows.append((key, esc(f"{stages[key].get('policy')}: pass@1 {s.get('pass_at_1', 0):.2f}, pass@K "
                                          f"{s.get('pass_at_k', 0):.2f}, zero-variance groups {s.get('zero_variance_share', 0):.0%}")))
    if "train_mode" in stages:
        summary_rows.append(("training", esc(f"{stages['train_mode'].get('mode')}: {stages['train_mode'].get('why')}")))

    rules_html = "".join(
        f'<tr><td>{esc(r.get("rule"))}</td><td class="{"pass" if r.get("passed") else "fail"}">'
        f'{"pass" if r.get("passed") else "fail"}</td><td>{esc(_fmt(r.get("value")))}</td><td>{esc(_fmt(r.get("threshold")))}</td>'
        f'<td>{esc(r.get("reason") or "")}</td></tr>'
        for r in gate.get("rules") or [])
    ci = ""
    if numbers:
        conf = numbers.get("confidence") or 0.95
        p_value = numbers.get("p_value")
        lower = numbers.get("lower_bound")
        ci = (f'<p>Held-out pass rate: champion <b>{numbers.get("champion_pass_rate") or 0:.1%}</b>, challenger '
              f'<b>{numbers.get("challenger_pass_rate") or 0:.1%}</b> over {numbers.get("paired_items")} paired items '
              f'({numbers.get("wins")} wins, {numbers.get("losses")} losses); difference '
              f'{numbers.get("diff") or 0:+.1%}.</p>')
        if p_value is not None:
            ci += (f'<p>Decision: exact one-sided sign test p = <b>{p_value:.4g}</b>'
                   + (f'; one-sided {conf:.0%} lower bound (Newcombe) {lower:+.1%}' if lower is not None else "")
                   + f'. Effect size: {conf:.0%} paired-bootstrap CI [{numbers.get("ci_lo") or 0:+.1%}, '
                   f'{numbers.get("ci_hi") or 0:+.1%}].</p>')
        origin = numbers.get("by_origin") or {}
        parts = [f'{label} {o["challenger_rate"]:.1%} vs {o["champion_rate"]:.1%} ({o["n"]} items)'
                 for key, label in (("failure", "fix rate"), ("success", "keep rate")) if (o := origin.get(key))]
        if parts:
            ci += "<p>Challenger vs champion: " + esc("; ".join(parts)) + ".</p>"
    gate_outcome = (gate.get("outcome") or ("passed" if gate.get("passed") else "refused")) if gate else "not run"
    gate_class = {"passed": "pass", "refused": "fail"}.get(gate_outcome, "muted")
    facts = trace_facts(open_artifacts(cfg), store, traces[:40])
    trace_rows = "".join(
        f"<tr><td><code>{esc(t['trace'])}</code></td><td>{esc(t['timestamp'])}</td>"
        f"<td>{esc(', '.join(t['failure_kinds'] or []) or t['status'])}</td>"
        + "".join(f"<td>{esc(facts.get(t['trace'], {}).get(k, ''))}</td>"
                  for k in ("source", "model", "tokens", "finish", "response")) + "</tr>"
        for t in traces[:40])
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>flywheel cycle {esc(cid)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body data-cycle="{esc(cid)}">
<h1>flywheel cycle report</h1><p class="muted"><code>{esc(cid)}</code> · model <code>{esc(model or "none")}</code></p>
<section id="summary"><h2>Summary</h2><table>{"".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in summary_rows)}</table></section>
<section id="failure-kinds"><h2>Failure kinds over time</h2>{svg_stacked_bars(days, kinds, title="failure kinds per day") if days else '<p class="empty">no failures ingested</p>'}</section>
<section id="training"><h2>Training</h2>{learning_table(learn) if learn else ""}{svg_lines(curves, title="training curves")}</section>
<section id="pass-rates"><h2>Champion vs challenger (held-out)</h2>{ci}{svg_pass_rates(srows, title="pass rates per slice") if srows else '<p class="empty">no gate evaluation in this cycle</p>'}</section>
<section id="gate"><h2>Gate decision: <span class="{gate_class}">{esc(gate_outcome)}</span></h2>
<table><tr><th>rule</th><th>result</th><th>value</th><th>threshold</th><th>reason</th></tr>{rules_html}</table></section>
<section id="lineage"><h2>Lineage of {esc(model or "the new model")}</h2>{svg_lineage(edges, model) if model else '<p class="empty">no model was trained</p>'}
<table><tr><th>production trace</th><th>timestamp</th><th>failure kinds</th><th>source</th><th>model</th><th>tokens</th><th>finish</th><th>response id</th></tr>{trace_rows}</table>
<p class="muted">{len(traces)} production traces in total; <code>flywheel trace {esc(model or "")}</code> prints the whole tree.</p></section>
<script>document.body.dataset.ready = "1";</script>
</body></html>
"""
    out_dir = Path(cfg.home) / "reports"
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = out_dir / f"{cid.split(':', 1)[1]}.html"
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(page)
    os.replace(tmp, path)
    return {"cycle": cid, "path": str(path), "outcome": outcome, "model": model, "traces": len(traces),
            "slices": len(srows), "curves": sorted(curves)}

"""Lineage for people: the causal tree of a model down to production traces, and the impact of a trace.

The graph is the ``lineage_edges`` projection (child -> parent, from every event's causation); the
recursive walks are SQL in ``warehouse/queries``. This module resolves friendly references
(``champion``, ``model:policy/7``, ``policy/7``), labels every node with what a person wants to see
(timestamps and failure kinds for traces and failures, metrics for runs, decisions for gates) and
renders trees, JSON and Mermaid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: lineage stays importable without the store's DuckDB/pyarrow
    from flywheel.store import EventStore
    from flywheel.tracking import Tracker

KIND_ORDER = ["model", "gate", "run", "rollouts", "env", "synth", "suite", "eval", "failure", "trace"]


class LineageError(LookupError):
    pass


@dataclass
class Node:
    entity_id: str
    kind: str
    label: str
    facts: dict[str, Any] = field(default_factory=dict)
    children: list[Node] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"entity_id": self.entity_id, "kind": self.kind, "label": self.label, "facts": self.facts,
                "children": [c.to_dict() for c in self.children]}


def resolve_ref(store: EventStore, tracker: Tracker | None, ref: str, model_name: str = "policy") -> str:
    """``champion``/``challenger`` (MLflow aliases), ``policy/7``, ``model:policy/7``, or any entity id."""
    if ref in ("champion", "challenger"):
        if tracker is None:
            raise LineageError(f"{ref!r} needs the MLflow registry")
        v = tracker.get_alias_version(model_name, ref)
        if v is None:
            raise LineageError(f"no version of {model_name!r} has the alias {ref!r}")
        ref = f"model:{model_name}/{v}"
    elif ":" not in ref and "/" in ref:
        ref = f"model:{ref}"
    if store.entity(ref) is None:
        raise LineageError(f"unknown entity {ref!r} (see `flywheel status` for what exists)")
    return ref


def facts(entity: dict[str, Any] | None) -> dict[str, Any]:
    """The few facts worth printing for an entity, from its current state."""
    if entity is None:
        return {}
    st = entity.get("state") or {}
    kind = entity["kind"]
    pick: dict[str, Any] = {}
    if kind == "trace":
        pick = {"timestamp": st.get("timestamp"), "status": st.get("status"), "kinds": st.get("kinds") or st.get("failure_kinds"),
                "model": st.get("model")}
    elif kind == "failure":
        pick = {"kinds": st.get("kinds"), "occurrences": st.get("occurrences"), "first_seen": st.get("first_seen"),
                "last_seen": st.get("last_seen")}
    elif kind == "eval":
        pick = {"split": st.get("split"), "verifier": (st.get("verifier") or {}).get("kind") if isinstance(st.get("verifier"), dict) else st.get("verifier_kind")}
    elif kind in ("suite", "env"):
        pick = {"members": st.get("members") or st.get("tasks"), "version": st.get("version")}
    elif kind == "synth":
        pick = {"accepted": (st.get("counts") or {}).get("accepted"), "decontaminated_against": st.get("decontaminated_against")}
    elif kind == "rollouts":
        s = st.get("stats") or {}
        pick = {"policy": st.get("policy"), "samples": st.get("samples"), "pass_at_1": s.get("pass_at_1"),
                "zero_variance_share": s.get("zero_variance_share")}
    elif kind == "run":
        pick = {"mode": st.get("mode"), "steps": st.get("steps"), "loss": st.get("loss"), "mlflow_run_id": st.get("mlflow_run_id")}
    elif kind == "model":
        pick = {"adapter": st.get("adapter"), "base_model": st.get("base_model"), "run": st.get("run")}
    elif kind == "gate":
        pick = {"passed": st.get("passed"), "reasons": st.get("reasons")}
    return {k: v for k, v in pick.items() if v not in (None, [], {})}


def _label(eid: str, f: dict[str, Any]) -> str:
    bits = [f"{k}={v}" for k, v in f.items() if k in ("timestamp", "kinds", "split", "mode", "passed", "pass_at_1",
                                                       "occurrences", "members", "accepted", "policy")]
    return eid + (f"  ({', '.join(bits)})" if bits else "")


def tree(store: EventStore, root: str, *, max_depth: int = 64, max_children: int | None = None) -> Node:
    """The causal tree below ``root`` (each entity expanded once; later references are leaves)."""
    edges = store.lineage_edges(root, max_depth)
    parents: dict[str, list[str]] = {}
    for child, parent in edges:
        parents.setdefault(child, []).append(parent)
    seen: set[str] = set()

    def build(eid: str) -> Node:
        ent = store.entity(eid)
        f = facts(ent)
        node = Node(eid, eid.split(":", 1)[0], _label(eid, f), f)
        if eid in seen:
            return node
        seen.add(eid)
        kids = sorted(parents.get(eid, []), key=lambda e: (KIND_ORDER.index(e.split(":")[0]) if e.split(":")[0] in KIND_ORDER else 99, e))
        for p in kids[: max_children] if max_children else kids:
            node.children.append(build(p))
        if max_children and len(kids) > max_children:
            node.children.append(Node(f"… {len(kids) - max_children} more", "more", f"… {len(kids) - max_children} more"))
        return node

    return build(root)


def traces_of(store: EventStore, root: str) -> list[dict[str, Any]]:
    """Production traces a model (or any entity) descends from, with timestamps and failure kinds."""
    out = []
    failure_kinds: dict[str, list[str]] = {}
    nodes = [e for e, _ in store.lineage(root, "down")]
    for e in nodes:
        if e.startswith("failure:"):
            st = (store.entity(e) or {}).get("state") or {}
            for t in st.get("trace_ids") or []:
                failure_kinds.setdefault(t if t.startswith("trace:") else f"trace:{t}", []).extend(st.get("kinds") or [])
    for e in nodes:
        if e.startswith("trace:"):
            st = (store.entity(e) or {}).get("state") or {}
            out.append({"trace": e, "timestamp": st.get("timestamp"), "status": st.get("status"),
                        "failure_kinds": sorted(set(failure_kinds.get(e, []))) or None})
    return sorted(out, key=lambda r: (str(r["timestamp"]), r["trace"]))


def impact(store: EventStore, root: str) -> dict[str, list[str]]:
    """Everything that descends from ``root``, grouped by kind (evals, datasets, models, gates, ...)."""
    out: dict[str, list[str]] = {}
    for e, _ in store.lineage(root, "up"):
        out.setdefault(e.split(":", 1)[0], []).append(e)
    deploys = []
    models = set(out.get("model", []))
    if models:
        for ev in store.read(types=["model.promoted", "model.rolled_back"]):
            target = ev.payload.get("to") or ev.payload.get("model") or ev.payload.get("to_model")
            if target in models or any(c in models or c in out.get("gate", []) for c in ev.causation):
                deploys.append(f"{ev.stream}#{ev.stream_version} ({ev.type})")
    if deploys:
        out["deploy"] = deploys
    return out


def render_tree(node: Node) -> Any:
    from rich.text import Text
    from rich.tree import Tree

    def style(kind: str) -> str:
        return {"model": "bold magenta", "run": "cyan", "rollouts": "blue", "env": "green", "suite": "green",
                "synth": "yellow", "eval": "white", "failure": "red", "trace": "dim", "gate": "bold"}.get(kind, "")

    def text(n: Node) -> Any:
        # Labels hold entity ids and facts such as "kinds=['tool_call']": plain text, never markup.
        # Kinds without a colour (ingest batches, cycles) must not get an empty "[]...[/]" tag either.
        return Text(n.label, style=style(n.kind))

    def add(t: Any, n: Node) -> None:
        for c in n.children:
            add(t.add(text(c)), c)

    root = Tree(text(node))
    add(root, node)
    return root


def mermaid(store: EventStore, root: str, *, max_depth: int = 64) -> str:
    """A Mermaid ``graph TD`` of the causal subgraph (for docs and reports)."""
    edges = store.lineage_edges(root, max_depth)
    ids: dict[str, str] = {}

    def nid(e: str) -> str:
        if e not in ids:
            ids[e] = f"n{len(ids)}"
        return ids[e]

    lines = ["graph TD"]
    nid(root)
    for child, parent in edges:
        lines.append(f"  {nid(child)} --> {nid(parent)}")
    for e, i in ids.items():
        lines.insert(1, f'  {i}["{e}"]')
    return "\n".join(lines) + "\n"

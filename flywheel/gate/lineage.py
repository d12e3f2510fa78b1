"""Lineage-derived facts, pure functions of entity states (not the store): the failures the
challenger's training data descends from (:func:`training_signatures`), a held-out item's slice
labels (:func:`item_labels`), and whether that data was decontaminated against the held-out suite
(:func:`assess_decontamination`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flywheel.gate.rules import DecontaminationStatus


def _as_list(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [str(x) for x in v]


def entity_facts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Failure kinds, tool names, cluster, split and origin failure of a failure/eval entity state.

    Tolerant of where the producing stage put them (top level or under ``metadata``), because
    failure and eval payloads are owned by other stages; unknown -> empty.
    """
    md = state.get("metadata") if isinstance(state.get("metadata"), Mapping) else {}
    kinds = _as_list(state.get("failure_kinds") or md.get("failure_kinds") or state.get("kinds") or state.get("kind"))
    tools = _as_list(state.get("tools") if isinstance(state.get("tools"), list) and all(
        isinstance(t, str) for t in state.get("tools")) else md.get("tools"))
    return {
        "kinds": kinds,
        "tools": tools,
        "cluster": state.get("cluster") or md.get("cluster"),
        "split": state.get("split") or md.get("split"),
        "origin_failure": state.get("origin_failure") or md.get("origin_failure") or state.get("failure_id"),
    }


def training_signatures(lineage_states: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """From the challenger's lineage (entity id -> state), the failures its training data came from.

    Returns ``failures`` (failure entity ids), ``clusters``, and ``signatures``: the set of
    ``(failure_kind, tool)`` pairs (tool ``""`` when the failure names none) of those failures and of
    the eval cases built from them.
    """
    failures: set[str] = set()
    clusters: set[str] = set()
    sigs: set[tuple[str, str]] = set()
    for eid, state in lineage_states.items():
        kind = eid.split(":", 1)[0]
        if kind not in ("failure", "eval"):
            continue
        f = entity_facts(state or {})
        if kind == "failure":
            failures.add(eid)
        elif f["origin_failure"]:
            failures.add(str(f["origin_failure"]))
        if f["cluster"]:
            clusters.add(str(f["cluster"]))
        for k in f["kinds"]:
            for t in f["tools"] or [""]:
                sigs.add((k, t))
    return {"failures": failures, "clusters": clusters, "signatures": sigs}


def item_labels(metadata: Mapping[str, Any], training: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Slice labels of one held-out item.

    ``kind:<failure kind>``, ``tool:<tool name>``, ``source:<source>`` from the item's metadata, and
    ``originating_failures`` when the item belongs to the originating-failures slice:

    an item is in it when one of its (failure kind, tool) pairs equals a (failure kind, tool) pair of
    a failure the challenger's training data descends from (lineage: model -> run -> rollouts/synth ->
    env -> suite -> evals -> failures). The held-out split is by failure *cluster*, so the exact
    failures trained on are never in the held-out suite; this slice asks the next best question:
    are failures *of the same kind on the same tool* fixed on evals the model never saw? Items whose
    own cluster or origin failure appears in the training lineage would be contamination; they get
    the label ``contaminated`` (and fail :func:`assess_decontamination`).
    """
    md = metadata or {}
    kinds = _as_list(md.get("failure_kinds"))
    tools = _as_list(md.get("tools"))
    labels = [f"kind:{k}" for k in kinds] + [f"tool:{t}" for t in tools]
    if md.get("source"):
        labels.append(f"source:{md['source']}")
    origin = md.get("origin_outcome") or ("failure" if md.get("origin_failure") else None)
    if origin in ("failure", "success"):
        labels.append(f"origin:{origin}")
    if training:
        sigs = training.get("signatures", set())
        if any((k, t) in sigs for k in kinds for t in (tools or [""])):
            labels.append("originating_failures")
        if (md.get("cluster") and md["cluster"] in training.get("clusters", set())) or (
            md.get("origin_failure") and md["origin_failure"] in training.get("failures", set())
        ):
            labels.append("contaminated")
    return tuple(labels)


def assess_decontamination(
    lineage_states: Mapping[str, Mapping[str, Any]],
    suite_id: str,
    heldout_suite_name: str,
    contaminated_items: Sequence[str] = (),
) -> DecontaminationStatus:
    """Was the challenger's training data decontaminated against ``suite_id`` (``suite:heldout@N``)?

    The rule, from the challenger's lineage (every entity its training descends from):

    1. Not decontaminated if the lineage reaches any version of the held-out suite
       (``suite:<heldout>@*``) or any eval whose split is held-out, or if a held-out item of
       ``suite_id`` shares a failure cluster or origin failure with the lineage
       (``contaminated_items``).
    2. Every synthetic batch (``synth:*``) in the lineage must list exactly ``suite_id`` in its
       ``decontaminated_against`` payload field: decontamination against an older held-out version
       does not cover items added since.
    3. Data built only from train-split evals (no synthetic batch) is decontaminated by
       construction: the split is by failure cluster, so no held-out cluster is in the train split.
    4. No recorded training data at all (no eval, failure or synth in the lineage): unknown
       (``None``), which fails the rule when it is required; a gate cannot vouch for data it cannot see.
    """
    heldout_prefix = f"suite:{heldout_suite_name}@"
    touched = sorted(e for e in lineage_states if e.startswith(heldout_prefix))
    heldout_evals = sorted(
        e for e, s in lineage_states.items()
        if e.startswith("eval:") and str(entity_facts(s or {})["split"] or "").lower() in ("heldout", "held-out", "held_out")
    )
    synth = {e: s for e, s in lineage_states.items() if e.startswith("synth:")}
    evals = [e for e in lineage_states if e.startswith(("eval:", "failure:"))]
    details: dict[str, Any] = {
        "suite": suite_id, "synth_batches": len(synth), "evals_and_failures": len(evals),
    }
    if touched or heldout_evals or contaminated_items:
        details.update(heldout_suites=touched, heldout_evals=heldout_evals[:20], contaminated_items=list(contaminated_items)[:20])
        what = touched[:2] or heldout_evals[:2] or list(contaminated_items)[:2]
        return DecontaminationStatus(False, f"training lineage reaches held-out data ({', '.join(what)})", details)
    missing = sorted(e for e, s in synth.items() if suite_id not in _as_list((s or {}).get("decontaminated_against")))
    if missing:
        details["not_decontaminated"] = missing[:20]
        return DecontaminationStatus(
            False, f"{len(missing)} synthetic batch(es) not decontaminated against {suite_id} (e.g. {missing[0]})", details
        )
    if synth:
        return DecontaminationStatus(True, f"all {len(synth)} synthetic batch(es) decontaminated against {suite_id}", details)
    if evals:
        return DecontaminationStatus(True, f"trained only on train-split evals ({len(evals)} in lineage): clean by construction", details)
    return DecontaminationStatus(None, "no training data recorded in lineage: decontamination cannot be verified", details)



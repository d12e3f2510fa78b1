"""The ``composite`` kind: a weighted combination of other specs (parameters:
:mod:`flywheel.verifiers.registry`). One part that cannot be judged makes the whole an infrastructure
error; a part not fit for training makes the whole unfit."""

from __future__ import annotations

from flywheel.verifiers.registry import (
    SpecError,
    Verdict,
    VerifyContext,
    register_verifier,
    validate_spec,
    verify,
)


def _parts(spec: dict) -> list[dict]:
    parts = spec["parts"]
    if not isinstance(parts, list) or not parts:
        raise SpecError("composite: 'parts' must be a non-empty list")
    for i, p in enumerate(parts):
        if not isinstance(p, dict) or "spec" not in p:
            raise SpecError(f"composite: parts[{i}] needs a 'spec'")
        w = p.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, int | float) or w < 0:
            raise SpecError(f"composite: parts[{i}].weight must be a number >= 0")
    return parts


def _check_composite(spec: dict) -> None:
    for p in _parts(spec):
        validate_spec(p["spec"])


@register_verifier("composite", required=("parts",), check=_check_composite)
def _composite(spec: dict, trajectory: list[dict], ctx: VerifyContext) -> Verdict:
    parts = _parts(spec)
    rule = spec.get("pass_rule", "all")
    if rule not in ("all", "weighted"):
        raise SpecError(f"composite: pass_rule must be 'all' or 'weighted', got {rule!r}")
    total_w = sum(float(p.get("weight", 1.0)) for p in parts) or 1.0
    reward, comps, deterministic, all_pass, subs = 0.0, {}, True, True, []
    not_for_training: str | None = None
    for i, p in enumerate(parts):
        v = verify(p["spec"], trajectory, context=ctx)
        kind = p["spec"]["kind"]
        if v.infra_error:
            # One part could not be judged, so the whole cannot: never average an unknown in as 0.
            return Verdict(0.0, False, comps, infra_error=f"part {i} ({kind}): {v.infra_error}", deterministic=False)
        if v.not_for_training and not_for_training is None:
            not_for_training = f"part {i} ({kind}): {v.not_for_training}"
        w = float(p.get("weight", 1.0)) / total_w
        reward += w * v.reward
        all_pass &= v.passed
        deterministic &= v.deterministic
        comps[f"{i}.{kind}"] = v.reward
        comps.update({f"{i}.{kind}.{k}": x for k, x in v.components.items()})
        subs.append({"kind": kind, "passed": v.passed, "reward": v.reward})
    threshold = float(spec.get("threshold", 1.0))
    passed = all_pass if rule == "all" else reward >= threshold - 1e-12
    return Verdict(reward, passed, comps, deterministic=deterministic, details={"parts": subs},
                   not_for_training=not_for_training)

"""Errors that mean the same thing in every stage."""

from __future__ import annotations

__all__ = ["InfraError"]


class InfraError(RuntimeError):
    """The *infrastructure* failed, not the candidate or the data: a sandbox that did not start, a
    judge endpoint that is down. A verifier raising it gets a verdict with ``infra_error`` set (never
    reward 0); the cycle retries a stage that raised it (``flywheel.cycle.is_infra_error``)."""

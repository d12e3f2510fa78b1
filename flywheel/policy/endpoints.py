"""Several OpenAI-compatible endpoints (vLLM replicas) behind one policy: which one gets the next
piece of work, when a server counts as down, and how work moves off a failed one.

The rules (used by :class:`~flywheel.policy.openai_http.OpenAIPolicy` for single requests and for
whole groups, :meth:`~flywheel.policy.openai_http.OpenAIPolicy.spread`):

- **Choice** (:meth:`EndpointPool.acquire`): among the endpoints that are up, the one with the fewest
  pieces of work in flight; ties go round-robin (a rotating start index), so an idle fleet is used
  evenly. When every endpoint is down, the one whose cool-down ends first is tried anyway (a server
  that came back is found again without waiting).
- **Server failure** (:func:`is_server_failure`): no response at all (connection refused or reset,
  timeout, the server vanished mid-answer), HTTP 429 or HTTP 5xx. The server is marked down for
  ``cooldown_s`` and the work is tried on another endpoint. Anything else (a 4xx that says the request
  is bad, a malformed answer, a bug) is raised at once and never retried elsewhere: another replica
  would refuse it the same way.
- **Rounds** (:func:`run_on_endpoints`): one round tries each endpoint at most once. When all of them
  failed, the next round starts after the shared backoff (:func:`flywheel.net.backoff_delay`); after
  ``rounds`` rounds :class:`AllEndpointsFailedError` names every endpoint and its last error. Its
  ``status`` is the HTTP status they all shared, else ``None``: either way
  ``flywheel.cycle.is_infra_error`` classifies it as an infrastructure error (Prefect retries it).
- A success on an endpoint marks it up again.

Everything here is thread-safe (one lock per pool) and free of I/O, so the rules are unit-tested with a
fake clock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from flywheel.net import backoff_delay
from flywheel.policy.base import PolicyRequestError

__all__ = [
    "DEFAULT_COOLDOWN_S",
    "AllEndpointsFailedError",
    "EndpointPool",
    "is_server_failure",
    "run_on_endpoints",
]

T = TypeVar("T")

DEFAULT_COOLDOWN_S = 30.0


def is_server_failure(exc: BaseException) -> bool:
    """A failure of the *server* (worth trying another one): a :class:`PolicyRequestError` without a
    response (status None) or with HTTP 429 / 5xx. A 4xx about the request, a malformed response
    (status 200) and every other exception are not."""
    if not isinstance(exc, PolicyRequestError):
        return False
    s = exc.status
    return s is None or s == 429 or 500 <= s <= 599


class AllEndpointsFailedError(PolicyRequestError):
    """Every endpoint failed (server failures only) for one piece of work. ``errors`` maps each endpoint
    to its last error message; the message names them all."""

    def __init__(self, what: str, errors: dict[str, str], statuses: dict[str, int | None], rounds: int) -> None:
        shared = set(statuses.values())
        status = shared.pop() if len(shared) == 1 else None
        detail = "; ".join(f"{u}: {m}" for u, m in errors.items())
        super().__init__(f"every policy endpoint failed for {what} ({len(errors)} endpoints, {rounds} "
                         f"round{'s' if rounds != 1 else ''}): {detail}", status=status)
        self.errors = dict(errors)
        self.endpoints = list(errors)


class EndpointPool:
    """The endpoints of one policy, with their in-flight counts and cool-downs (see the module doc)."""

    def __init__(self, urls: Iterable[str], *, cooldown_s: float = DEFAULT_COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.urls = list(dict.fromkeys(urls))
        if not self.urls:
            raise ValueError("an endpoint pool needs at least one endpoint")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0 (got {cooldown_s})")
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._outstanding = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._next = 0  # round-robin start for ties
        self.answered: Counter[str] = Counter()  # pieces of work each endpoint completed
        self.failures: Counter[str] = Counter()  # server failures seen on each endpoint

    def is_up(self, url: str) -> bool:
        with self._lock:
            return self._down_until[url] <= self._clock()

    def outstanding(self, url: str) -> int:
        with self._lock:
            return self._outstanding[url]

    def acquire(self, exclude: Iterable[str] = ()) -> str | None:
        """The endpoint for the next piece of work (its in-flight count goes up by one), or None when
        every endpoint is in ``exclude``. Pair with :meth:`release`."""
        skip = set(exclude)
        with self._lock:
            now = self._clock()
            n = len(self.urls)
            order = [self.urls[(self._next + i) % n] for i in range(n)]
            candidates = [u for u in order if u not in skip]
            if not candidates:
                return None
            up = [u for u in candidates if self._down_until[u] <= now]
            if up:
                best = min(up, key=lambda u: self._outstanding[u])  # min keeps the first of equals
            else:
                best = min(candidates, key=lambda u: self._down_until[u])
            self._next = (self.urls.index(best) + 1) % n
            self._outstanding[best] += 1
            return best

    def release(self, url: str, *, ok: bool | None = None) -> None:
        """The piece of work on ``url`` ended: ``ok=True`` marks it up (and counts an answer),
        ``ok=False`` marks it down for the cool-down, ``None`` (a non-server error) changes nothing."""
        with self._lock:
            self._outstanding[url] -= 1
            if ok is True:
                self._down_until[url] = 0.0
                self.answered[url] += 1
            elif ok is False:
                self._down_until[url] = self._clock() + self.cooldown_s
                self.failures[url] += 1

    def mark_down(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = self._clock() + self.cooldown_s
            self.failures[url] += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per endpoint: up, in flight, answered, failures (for logs and tests)."""
        with self._lock:
            now = self._clock()
            return {u: {"up": self._down_until[u] <= now, "in_flight": self._outstanding[u],
                        "answered": self.answered[u], "failures": self.failures[u]} for u in self.urls}


def run_on_endpoints(
    pool: EndpointPool,
    fn: Callable[[str], T],
    *,
    what: str,
    rounds: int = 1,
    backoff_base_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[T, str]:
    """``fn(endpoint)`` on one endpoint at a time until it returns; ``(result, endpoint)``.

    A server failure (:func:`is_server_failure`) marks that endpoint down and moves on to one not yet
    tried this round; any other exception propagates at once. After ``rounds`` rounds in which every
    endpoint failed: :class:`AllEndpointsFailedError` (``what`` names the work in its message)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    errors: dict[str, str] = {}
    statuses: dict[str, int | None] = {}
    for r in range(rounds):
        tried: set[str] = set()
        while (url := pool.acquire(exclude=tried)) is not None:
            tried.add(url)
            try:
                result = fn(url)
            except BaseException as e:
                if isinstance(e, Exception) and is_server_failure(e):
                    pool.release(url, ok=False)
                    errors[url] = str(e)
                    statuses[url] = getattr(e, "status", None)
                    continue
                pool.release(url)
                raise
            pool.release(url, ok=True)
            return result, url
        if r < rounds - 1:
            sleep(backoff_delay(r, base_s=backoff_base_s))
    raise AllEndpointsFailedError(what, errors, statuses, rounds)

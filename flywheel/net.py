"""Network plumbing shared across layers: the servers' sockets (``flywheel serve``, ``flywheel collect``)
and the one retrying client of OpenAI-compatible endpoints (the policy's HTTP backend and the
``llm_judge`` verifier): :func:`request_with_retries`."""

from __future__ import annotations

import ipaddress
import json
import random
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = [
    "bind",
    "is_loopback",
    "LOOPBACK_HOSTS",
    "host_name",
    "allowed_hosts_for",
    "head_timeout_protocol",
    "CHAT_COMPLETIONS_PATH",
    "HTTPRequestError",
    "backoff_delay",
    "openai_base_url",
    "openai_error_message",
    "request_with_retries",
    "retryable_status",
]


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1): reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host has a colon; port 0 = a free one),
    inheritable so a server can be handed it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


# ------------------------------------------------------------------ servers: Host header, request heads
# The Host-header and request-head checks of every server flywheel runs (``flywheel serve``, and
# ``flywheel collect``, which must not depend on serve's imports).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(header: str | None) -> str | None:
    """The name in a ``Host`` header, lower-cased, without port or trailing dot; None if malformed.
    ``"[::1]:8000"`` -> ``"::1"``, ``"Localhost.:80"`` -> ``"localhost"``."""
    if not header:
        return None
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        rest = h[end + 1 :] if end > 0 else "?"
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return h[1:end]
    name, sep, port = h.rpartition(":")
    if sep:
        if not port.isdigit() or ":" in name:
            return None  # a bare IPv6 address must be bracketed in a Host header (RFC 7230 5.4)
        h = name
    return h.rstrip(".") or None


def allowed_hosts_for(host: str, extra: tuple[str, ...] | list[str] = ()) -> tuple[str, ...]:
    """The Host names a server bound to ``host`` answers: loopback names for a loopback bind, the
    address itself for a specific one, any (``"*"``) for a wildcard bind without ``extra`` (such a
    server always has an API key, which a rebinding page does not know); plus ``extra``."""
    more = tuple(h.strip().lower().rstrip(".") for h in extra if h.strip())
    if "*" in more:
        return ("*",)
    if is_loopback(host):
        return (*LOOPBACK_HOSTS, *more)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return (host.lower().rstrip("."), *more)
    if ip.is_unspecified:
        return (*LOOPBACK_HOSTS, *more) if more else ("*",)
    return (str(ip), *more)


def head_timeout_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol plus a deadline for each request head (as ``flywheel serve``'s).

    uvicorn arms its keep-alive timer only after a response and cancels it on any received byte, so
    a connection that never completes its head (slowloris) is never closed. Here a timer runs from
    the connection's start (and from each response) until h11 has parsed a complete head; when it
    fires first the connection is closed. The body needs its own deadline in the app.
    """
    import asyncio
    import logging

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    log = logging.getLogger(__name__)

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a complete head was parsed
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request head in %g s", header_timeout_s)
                self.transport.close()

    return HeadTimeoutH11Protocol


# ------------------------------------------------------------------ OpenAI-compatible HTTP clients

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
DEFAULT_MAX_RETRIES = 4
# Backoff before retry k (0-based): uniform(0, min(cap, base * 2^k)) -- "full jitter", so the retries of
# many clients hit by the same outage spread out instead of arriving together. Read at each request.
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0


class HTTPRequestError(Exception):
    """A request that failed for good: a status that is not retried (400, 401, 404, 413, ...) at once,
    or a retried one (429, 5xx) or a transport error once the attempts ran out.

    ``url`` is the URL requested, ``status`` the last HTTP status (None: no response, a transport
    error), ``body`` the last response's text, ``attempts`` how many requests were sent. The message
    names the method, the URL and the status (or the transport error), and ends in ``(gave up after N
    attempts)`` when retries ran out."""

    def __init__(self, message: str, *, url: str, status: int | None, body: str = "", attempts: int = 1) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body
        self.attempts = attempts


def openai_base_url(url: str) -> str:
    """The server root of an OpenAI-compatible endpoint given with or without ``/v1`` (and a trailing
    slash): ``http://h:8000/v1/`` -> ``http://h:8000``; append :data:`CHAT_COMPLETIONS_PATH` to it."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def retryable_status(status: int) -> bool:
    """429 (rate limited) and 5xx (overloaded, restarting, gateway errors): worth another try; every
    other 4xx is about the request itself, and retrying it only hides it."""
    return status == 429 or 500 <= status <= 599


def backoff_delay(attempt: int, retry_after: str | None = None, *, base_s: float | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter over ``base * 2^attempt`` capped
    at :data:`BACKOFF_CAP_S`; a numeric ``Retry-After`` raises it (up to the cap). An HTTP-date
    ``Retry-After`` is ignored."""
    base = BACKOFF_BASE_S if base_s is None else base_s
    delay = random.uniform(0, min(BACKOFF_CAP_S, base * (2**attempt)))
    if retry_after:
        try:
            delay = max(delay, min(BACKOFF_CAP_S, float(retry_after)))
        except ValueError:
            pass
    return delay


def openai_error_message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the first 500 characters of it."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:500]


def request_with_retries(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    backoff_base_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> httpx.Response:
    """Send one request to an OpenAI-compatible server, retrying what may pass on another try.

    Retried, up to ``max_retries`` times with :func:`backoff_delay` between tries (``Retry-After``
    honoured): HTTP 429, HTTP 5xx and transport errors (connection refused or reset, timeouts). Returns
    the first response with a status below 400. Raises :class:`HTTPRequestError` for any other status
    at once, and for the last failure once the attempts (``max_retries + 1``) ran out. ``url`` may be
    relative to the client's ``base_url``. Thread-safe as far as ``client`` is (an ``httpx.Client`` is).
    A request whose answer was lost after the server read it (a reset, a read timeout) is sent again:
    use it where a repeat is harmless (a chat completion only draws another sample).
    """
    import httpx  # ~100 ms at import; the servers that import this module for bind() never need it

    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0 (got {max_retries})")
    kwargs: dict[str, Any] = {"json": json_body, "headers": headers}
    if timeout is not None:
        kwargs["timeout"] = timeout
    last: HTTPRequestError | None = None
    for attempt in range(max_retries + 1):
        try:
            resp = client.request(method, url, **kwargs)
        except httpx.TransportError as e:
            where = _request_url(e, url)
            last = HTTPRequestError(f"{method} {where}: {type(e).__name__}: {e}", url=where, status=None,
                                    attempts=attempt + 1)
            retry_after = None
        else:
            if resp.status_code < 400:
                return resp
            where = str(resp.request.url)
            last = HTTPRequestError(
                f"{method} {where}: HTTP {resp.status_code}: {openai_error_message(resp.text)}",
                url=where, status=resp.status_code, body=resp.text, attempts=attempt + 1,
            )
            if not retryable_status(resp.status_code):
                raise last
            retry_after = resp.headers.get("retry-after")
        if attempt < max_retries:
            sleep(backoff_delay(attempt, retry_after, base_s=backoff_base_s))
    assert last is not None
    raise HTTPRequestError(f"{last} (gave up after {max_retries + 1} attempts)", url=last.url, status=last.status,
                           body=last.body, attempts=max_retries + 1)


def _request_url(exc: httpx.TransportError, fallback: str) -> str:
    try:
        return str(exc.request.url)
    except RuntimeError:  # raised by httpx when the error carries no request
        return fallback

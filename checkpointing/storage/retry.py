"""Bounded retries with exponential backoff and full jitter, for storage requests.

    policy = RetryPolicy(attempts=6, request_timeout_s=60)
    policy.call(lambda: fs.pipe_file(path, data), what=f"put {path}")
    await policy.acall(lambda: client.put_object(...), what=...)

Only transient errors are retried: timeouts, dropped connections, HTTP 5xx,
throttling. Everything else (missing bucket, access denied, bad request)
fails at once. Each attempt is bounded by ``request_timeout_s`` (async calls;
threads cannot be interrupted, so the bound there is the client's own socket
timeouts), and the whole call by ``deadline_s``. Built on tenacity.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import tenacity

from ..errors import StorageError

log = logging.getLogger("etrain")

_THROTTLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException",
    "TransientError", "503", "500",
}
_TRANSIENT_CLASS_NAMES = {
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "HTTPClientError", "IncompleteReadError", "ResponseStreamingError", "ClientPayloadError",
    "ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "FSTimeoutError",
}


class TransientStorageError(OSError):
    """A failure worth retrying (also what fault injection raises)."""


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (TransientStorageError, TimeoutError, asyncio.TimeoutError, socket.timeout, ConnectionError)):
        return True
    if type(exc).__name__ in _TRANSIENT_CLASS_NAMES:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        return code in _THROTTLE_CODES or status >= 500 or status == 429
    return False


def describe(exc: BaseException) -> str:
    """A short, credential-free description of a storage error."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        return f"{err.get('Code', type(exc).__name__)} (HTTP {status}): {err.get('Message', '')}".strip()
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        # DCP's CheckpointException: its text is a traceback per rank; name each rank's own error instead.
        return "; ".join(f"rank {rank}: {describe(pair[0]) if isinstance(pair, tuple) else pair}"
                         for rank, pair in sorted(failures.items()))[:600]
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    attempts: int = 6
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    request_timeout_s: float = 120.0
    deadline_s: float = 600.0

    def _tenacity(self, what: str, cls):
        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.debug("retrying %s after attempt %d: %s", what, state.attempt_number, describe(exc) if exc else "")

        return cls(
            stop=tenacity.stop_after_attempt(self.attempts) | tenacity.stop_after_delay(self.deadline_s),
            wait=tenacity.wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )

    def call(self, fn, *, what: str):
        """Run ``fn()`` with retries; a final failure becomes a StorageError naming ``what``."""
        try:
            return self._tenacity(what, tenacity.Retrying)(fn)
        except (StorageError, FileNotFoundError, FileExistsError):
            raise
        except Exception as e:
            raise StorageError(f"{what} failed: {describe(e)}") from e

    async def acall(self, make_coro, *, what: str):
        """Await ``make_coro()`` with retries, each attempt bounded by ``request_timeout_s``."""

        async def attempt():
            return await asyncio.wait_for(make_coro(), timeout=self.request_timeout_s)

        try:
            return await self._tenacity(what, tenacity.AsyncRetrying)(attempt)
        except (StorageError, FileNotFoundError, FileExistsError):
            raise
        except Exception as e:
            raise StorageError(f"{what} failed: {describe(e)}") from e

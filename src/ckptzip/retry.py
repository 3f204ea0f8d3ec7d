"""Retrying storage calls: transient faults are retried with backoff, permanent ones surface at once.

    policy = RetryPolicy()                                    # 6 tries, 0.1 s doubling to 5 s, 60 s budget
    data = call(policy, "reading", "s3://b/run/index.json", fs.cat_file, path)

Call order inside :func:`call`: run ``fn``; on an exception decide with :func:`transient`; a
transient one is retried after ``first_delay_s * 2**k`` (full jitter, capped at ``max_delay_s``)
while tries and the time budget last, then raised as :class:`StorageUnavailableError`; a permanent
one is raised at once, as :class:`StorageFullError` (ENOSPC, EDQUOT), :class:`StorageReadOnlyError`
(EROFS, EACCES, EPERM) or unchanged (not found, not a directory, ...).

Transient: timeouts, dropped or refused connections, HTTP 5xx and throttling (S3 ``SlowDown``,
429), and the errno values an object store client maps those to (EBUSY, EREMOTEIO, ...). A store's
own client may retry inside each of our tries (botocore and s3fs do); the budget here bounds the
whole call.

A retried write must be idempotent or checked: ``storage.Storage`` re-reads after an ambiguous
failure of a conditional write (a lost response to a write that landed) before calling it lost.
"""
from __future__ import annotations

import errno as _errno
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from .configcheck import Range, check_fields
from .errors import (CkptzipError, StorageFullError, StorageReadOnlyError, StorageUnavailableError,
                     WriteConflictError)

T = TypeVar("T")

_TRANSIENT_ERRNOS = {_errno.EAGAIN, _errno.EBUSY, _errno.ETIMEDOUT, _errno.ECONNRESET, _errno.ECONNABORTED,
                     _errno.ECONNREFUSED, _errno.EPIPE, _errno.ENETDOWN, _errno.ENETUNREACH, _errno.EHOSTUNREACH,
                     _errno.EINTR, getattr(_errno, "EREMOTEIO", 121)}
_FULL_ERRNOS = {_errno.ENOSPC, getattr(_errno, "EDQUOT", 122)}
_READ_ONLY_ERRNOS = {_errno.EROFS, _errno.EACCES, _errno.EPERM}
# exception classes of HTTP clients (botocore, aiohttp, urllib3, requests) that mean "the
# connection or the server failed this time", matched by name so that none has to be installed
_TRANSIENT_NAMES = {"HTTPClientError", "ConnectionError", "ClientConnectionError", "ClientPayloadError",
                    "ServerDisconnectedError", "ServerTimeoutError", "IncompleteRead", "ProtocolError",
                    "ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError", "ResponseParserError"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestTimeout",
                    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "OperationAborted"}
CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}


@dataclass(frozen=True)
class RetryPolicy:
    """How long a storage call keeps trying through transient faults (runtime, not in any file)."""

    attempts: int = 6            # tries per call, the first included
    first_delay_s: float = 0.1   # wait before the second try; doubles per try (full jitter)
    max_delay_s: float = 5.0     # cap on one wait
    budget_s: float = 60.0       # no new try starts this long after the first

    def __post_init__(self):
        seconds = Range(ge=0)
        check_fields(self, attempts=Range(ge=1), first_delay_s=seconds, max_delay_s=seconds, budget_s=seconds)

    def delay_s(self, k: int) -> float:
        """Wait before try ``k + 2`` (``k`` failures so far, from 0)."""
        return random.uniform(0, min(self.max_delay_s, self.first_delay_s * 2 ** k))


def service_error(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of an object store's error response behind ``exc``, if any."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and "Error" in resp:
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return resp["Error"].get("Code"), status
        e = e.__cause__ or e.__context__
    return None, None


def transient(exc: BaseException) -> bool:
    """Whether trying the same call again may succeed."""
    if isinstance(exc, CkptzipError | FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    code, status = service_error(exc)
    if code in CONFLICT_CODES:
        return False
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
        return True
    if isinstance(exc, TimeoutError | ConnectionError | InterruptedError):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__)


def typed(exc: BaseException, what: str, where: str) -> BaseException:
    """The error to raise for a permanent failure: ENOSPC and read-only get their typed errors."""
    if isinstance(exc, CkptzipError):
        return exc
    eno = getattr(exc, "errno", None)
    if eno in _FULL_ERRNOS:
        return StorageFullError(f"{where}: No space left on device while {what}; free space (or write the "
                                "chain elsewhere) and retry", errno=eno)
    if eno in _READ_ONLY_ERRNOS or (isinstance(exc, PermissionError) and eno is None):
        return StorageReadOnlyError(f"{where}: {what} is not permitted ({_reason(exc)}): the location is "
                                    "read-only or lacks permission; fix its permissions or mount, or use "
                                    "another location", errno=eno)
    return exc


def call(policy: RetryPolicy, what: str, where: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, retried through transient faults under ``policy``."""
    t0 = time.monotonic()
    for k in range(policy.attempts):
        try:
            return fn(*args, **kwargs)
        except WriteConflictError:
            raise
        except Exception as e:
            if not transient(e):
                err = typed(e, what, where)
                if err is e:
                    raise
                raise err from e
            spent = time.monotonic() - t0
            wait = policy.delay_s(k)
            if k + 1 >= policy.attempts or spent + wait > policy.budget_s:
                raise StorageUnavailableError(
                    f"{where}: {what} failed {k + 1} time{'s' if k else ''} over {spent:.1f} s ({_reason(e)}); the store is "
                    "unavailable or throttling: retry later, or allow more with RetryPolicy(attempts=, budget_s=)",
                    errno=getattr(e, "errno", None)) from e
            if wait:
                time.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


def _reason(exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or "no message"
    return f"{type(exc).__name__}: {msg[:200]}"


"""LayerCheck's default limits for the S3 client (``uri.py`` applies them to every ``s3://`` URI
that sets none), kept apart from pyarrow so that the run config can derive its own bounds from
them (``persistence.hung_write_s``) without importing it."""

from __future__ import annotations

#: Seconds to wait for a TCP connection.
CONNECT_TIMEOUT_S = 3.0
#: Seconds a request may make no progress.
REQUEST_TIMEOUT_S = 5.0
#: Attempts per request before a write fails.
RETRY_MAX_ATTEMPTS = 3


def worst_request_s(
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    attempts: int = RETRY_MAX_ATTEMPTS,
) -> float:
    """The longest one request may go unanswered before the client gives up on it and the write
    fails: every attempt connects at the last moment and then times out (backoff aside)."""
    return attempts * (connect_timeout_s + request_timeout_s)

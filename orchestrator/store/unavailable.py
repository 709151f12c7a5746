"""Telling a storage that did not answer, or refused this process, from an answer about a file.

A read that fails because the endpoint reset the connection, timed out, throttled or refused the
credentials says nothing about the file read: it is not missing, truncated or damaged. Readers
that conclude from a failed read (a commit record left out as torn, a version skipped as
corrupt) must not conclude from these, or a recovery during a network blip silently plans an
older composite. So :class:`StoreFS` raises :class:`StoreUnavailableError` (its subclass
:class:`StoreAccessError` for a refusal) for them, naming the store, and the readers let it pass.

Recognised by the error texts of pyarrow's object-store clients (``AWS Error <CODE> during …``,
``HTTP status …`` for a code the SDK does not name, gRPC-style status names for GCS); any other
``OSError`` (a local disk's, a missing file) stays what it was.
"""

from __future__ import annotations

import re

from layercheck.orchestrator.store.errors import StoreAccessError, StoreUnavailableError

#: The S3 client's codes (and GCS statuses, HTTP statuses) for credentials or permissions refused.
_REFUSED = re.compile(
    r"AWS Error (?:ACCESS_DENIED|SIGNATURE_DOES_NOT_MATCH|INVALID_ACCESS_KEY_ID|INVALID_SIGNATURE|"
    r"INVALID_CLIENT_TOKEN_ID|UNRECOGNIZED_CLIENT|MISSING_AUTHENTICATION_TOKEN|INCOMPLETE_SIGNATURE|"
    r"REQUEST_EXPIRED|REQUEST_TIME_TOO_SKEWED)\b|\(HTTP status 40[13]\)|ExpiredToken|InvalidToken|"
    r"\bPERMISSION_DENIED\b|\bUNAUTHENTICATED\b"
)
#: ... for no answer: the connection failed or was reset, a timeout, throttling, a server error.
_NO_ANSWER = re.compile(
    r"AWS Error (?:NETWORK_CONNECTION|REQUEST_TIMEOUT|SERVICE_UNAVAILABLE|THROTTLING|SLOW_DOWN|"
    r"INTERNAL_FAILURE)\b|\(HTTP status 5\d\d\)|\bUNAVAILABLE\b|\bDEADLINE_EXCEEDED\b"
)
#: ... for a refusal for the request rate (S3's ``503 SlowDown``; a HEAD's 503 has no body to say so).
_THROTTLED = re.compile(r"\bSLOW_DOWN\b|\bSlowDown\b|\bTHROTTLING\b|\(HTTP status (?:503|429)\)")


def is_throttled(error: BaseException) -> bool:
    """The storage turned the request down for the rate of requests (slow down), not for the request."""
    return bool(_THROTTLED.search(str(error)))


#: What to check when the storage refuses the credentials (said with every refusal).
ACCESS_HINT = (
    "check the credentials every LayerCheck process gets (for s3://: AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and what the bucket's policy allows them"
)


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` says the storage refused the credentials or permissions."""
    return bool(_REFUSED.search(str(error)))


def unavailable_error(location: str, error: OSError) -> StoreUnavailableError | None:
    """What to raise instead of ``error``, a failed read or listing of ``location``, when it says
    the storage refused this process or did not answer; ``None`` when it is about the file."""
    if isinstance(error, (FileNotFoundError, StoreUnavailableError)):
        return None
    if is_refusal(error):
        return StoreAccessError(f"storage refused access to {location}: {error}; {ACCESS_HINT}")
    if _NO_ANSWER.search(str(error)):
        return StoreUnavailableError(f"storage did not answer for {location}: {error}")
    return None

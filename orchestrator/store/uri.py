"""Storage URIs: opening one with LayerCheck's own client options, and showing one without its
secrets.

pyarrow reads the query of an object-store URI itself (``s3://bucket/run?endpoint_override=
127.0.0.1:9000&scheme=http`` for MinIO or moto; ``region=…``) but has no query option for the
S3 client's timeouts and retries, and rejects unknown ones. A run's storage URI is the one string
every process of a run opens (driver, writer actors, workers, ``export``), so LayerCheck reads
three options of its own from it and passes the rest to pyarrow:

* ``connect_timeout`` — seconds to wait for a TCP connection (default here: 3);
* ``request_timeout`` — seconds a request may make no progress (default here: 5);
* ``retry_max_attempts`` — attempts per request before a write fails (default here: 3).

The defaults apply to every ``s3://`` URI that does not set its own: with pyarrow's, one request
to an endpoint that accepts connections and never answers blocked for over a minute. An outage
now fails a write within about ``retry_max_attempts × (timeouts + backoff)``, which LayerCheck
counts as a write failure (see ``persistence.on_staleness_breach``) instead of a writer waiting
on a dead endpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote_plus, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from layercheck.orchestrator.store.s3_limits import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, RETRY_MAX_ATTEMPTS
from layercheck.policies.config_loader import ConfigError

#: LayerCheck's own query options of an ``s3://`` URI (see the module docstring).
S3_CLIENT_OPTIONS: frozenset[str] = frozenset({"connect_timeout", "request_timeout", "retry_max_attempts"})

#: Query keys whose values are never shown (a SAS signature, a token passed in a URI).
_SECRET_KEY = re.compile(r"key|secret|token|password|passwd|sig|credential", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class S3ClientOptions:
    """The S3 client's timeouts and retries; each is bounded by default (see the module docstring)."""

    connect_timeout: float = CONNECT_TIMEOUT_S
    request_timeout: float = REQUEST_TIMEOUT_S
    retry_max_attempts: int = RETRY_MAX_ATTEMPTS

    @classmethod
    def from_query(cls, values: dict[str, str], *, uri: str) -> S3ClientOptions:
        """The options a URI's query sets, the defaults for the rest."""

        def number(key: str, kind: type[float] | type[int], default: float) -> float:
            if key not in values:
                return default
            try:
                value = kind(values[key])
            except ValueError:
                value = 0
            if value <= 0:
                raise ConfigError(f"storage: {key}={values[key]!r} in {redact_uri(uri)} must be a positive number")
            return value

        defaults = cls()
        return cls(
            connect_timeout=number("connect_timeout", float, defaults.connect_timeout),
            request_timeout=number("request_timeout", float, defaults.request_timeout),
            retry_max_attempts=int(number("retry_max_attempts", int, defaults.retry_max_attempts)),
        )

    def apply(self, fs: pafs.FileSystem) -> pafs.FileSystem:
        """``fs`` (an ``S3FileSystem``) rebuilt with these options."""
        _, (kwargs,) = fs.__reduce__()  # the options pyarrow parsed from the URI, credentials included
        kwargs["connect_timeout"] = self.connect_timeout
        kwargs["request_timeout"] = self.request_timeout
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=self.retry_max_attempts)
        return pafs.S3FileSystem(**kwargs)


@dataclass(frozen=True, kw_only=True)
class OpenedURI:
    fs: pafs.FileSystem
    root: str
    """The path inside ``fs`` (bucket and prefix on an object store)."""
    query: str
    """The URI's query as given, secrets redacted: appended to locations in messages so that
    they name the endpoint too (``s3://b/run/x?endpoint_override=…``)."""


def open_uri(uri: str) -> OpenedURI:
    """``pafs.FileSystem.from_uri`` with LayerCheck's S3 client options taken out of the query."""
    parts = urlsplit(uri)
    if "://" not in uri or parts.scheme == "file":  # a path: '?' and '#' are characters of a name
        fs, root = pafs.FileSystem.from_uri(uri)
        return OpenedURI(fs=fs, root=root, query="")
    own = {key: value for key, value in parse_qsl(parts.query, keep_blank_values=True) if key in S3_CLIENT_OPTIONS}
    if own and parts.scheme != "s3":
        raise ConfigError(f"storage: {', '.join(sorted(own))} apply to s3:// storage only, not {redact_uri(uri)}")
    # the rest goes to pyarrow exactly as written (no re-encoding of its values)
    rest = "&".join(piece for piece in parts.query.split("&") if piece and _key(piece) not in S3_CLIENT_OPTIONS)
    try:
        fs, root = pafs.FileSystem.from_uri(urlunsplit(parts._replace(query=rest)))
    except pa.ArrowInvalid as error:  # an option pyarrow does not know, say `session_token`
        raise ConfigError(
            f"storage: {redact_uri(uri)}: {error} (pyarrow's own options for the query are listed at "
            "pyarrow.fs.S3FileSystem; LayerCheck adds "
            + ", ".join(sorted(S3_CLIENT_OPTIONS))
            + "; credentials come from the environment, e.g. AWS_SESSION_TOKEN)"
        ) from None
    if parts.scheme == "s3":
        fs = S3ClientOptions.from_query(own, uri=uri).apply(fs)
    return OpenedURI(fs=fs, root=root, query=_redact_query(parts.query))


def redact_uri(uri: str) -> str:
    """``uri`` fit for a message or a log: no ``user:password@``, secret query values as ``***``."""
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=netloc, query=_redact_query(parts.query)))


def _key(piece: str) -> str:
    return unquote_plus(piece.partition("=")[0])


def _redact_query(query: str) -> str:
    pieces = [piece for piece in query.split("&") if piece]
    return "&".join(f"{piece.partition('=')[0]}=***" if _SECRET_KEY.search(_key(piece)) else piece for piece in pieces)

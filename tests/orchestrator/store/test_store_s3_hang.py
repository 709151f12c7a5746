"""Storage that hangs is bounded: an ``s3://`` URI that sets no client options gets
LayerCheck's connect and request timeouts and retry count, so one request to an endpoint that
accepts connections and never answers costs seconds, not minutes (pyarrow's defaults blocked for
over a minute)."""

import socket
import threading
import time

import pytest

from layercheck.orchestrator.store.errors import StoreWriteError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.uri import S3ClientOptions, open_uri
from tests.support.s3_server import S3_ENV


@pytest.fixture
def black_hole():
    """A loopback port that accepts TCP connections and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for sock in held:
        sock.close()
    listener.close()


def test_an_s3_uri_without_options_gets_bounded_timeouts(monkeypatch):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    _, (options,) = open_uri("s3://bucket/run?endpoint_override=127.0.0.1:9&scheme=http").fs.__reduce__()
    defaults = S3ClientOptions()
    assert options["connect_timeout"] == defaults.connect_timeout
    assert options["request_timeout"] == defaults.request_timeout
    assert defaults.connect_timeout <= 10 and defaults.request_timeout <= 30 and defaults.retry_max_attempts <= 5


@pytest.mark.slow
def test_a_write_to_an_endpoint_that_never_answers_fails_within_the_request_timeout(monkeypatch, black_hole):
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    # one attempt with a 1 s request timeout (the defaults, 5 s, go the same way to pyarrow and are
    # checked above): what one hung request costs
    timeout = 1.0
    fs = StoreFS.open(
        f"s3://bucket/run?endpoint_override={black_hole}&scheme=http&retry_max_attempts=1&request_timeout={timeout}"
    )
    started = time.monotonic()
    with pytest.raises(StoreWriteError, match="cannot write s3://bucket/run/x"):
        fs.write_bytes("x", b"payload")
    elapsed = time.monotonic() - started
    # a write is a few requests (the directory marker, the upload, its completion), each bounded
    # by the request timeout: seconds, never pyarrow's minutes
    assert elapsed < 4 * timeout, elapsed


def test_an_option_pyarrow_does_not_know_is_one_clear_line_without_the_secret():
    from layercheck.policies.config_loader import ConfigError

    with pytest.raises(ConfigError) as error:
        open_uri("s3://bucket/run?session_token=SECRET&endpoint_override=127.0.0.1:1")
    message = str(error.value)
    assert message.startswith("storage: ") and "'session_token'" in message and "AWS_SESSION_TOKEN" in message
    assert "SECRET" not in message

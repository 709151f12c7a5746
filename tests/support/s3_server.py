"""A loopback S3-compatible server for the object-store tests: moto's server on 127.0.0.1
behind a TCP proxy that a test can cut (an outage: connections are reset, the stored objects
stay in moto's memory) and restore, or cut on and off (``flapping``), or hang (connections
accepted and never answered); and moto enforcing
credentials for a while (``iam_enforced``)."""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow.fs as pafs

#: Dummy credentials and region: moto accepts any, the AWS SDK needs some (and must not go
#: looking for a profile or the EC2 metadata service).
S3_ENV: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "lc-dummy-key-id",
    "AWS_SECRET_ACCESS_KEY": "lc-dummy-secret",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

#: LayerCheck's S3 client options (``orchestrator/store/uri.py``) for tests: an outage fails a
#: write within seconds instead of after the SDK's default retries.
FAST_FAIL: dict[str, str] = {"connect_timeout": "1", "request_timeout": "2", "retry_max_attempts": "2"}


class CuttableProxy:
    """Forwards TCP connections from ``127.0.0.1:port`` to ``target`` until :meth:`cut`; while
    cut, live connections are dropped and new ones reset at once (what a client sees when the
    server is down). While :meth:`hang` is on, nothing more is forwarded either way and new
    connections are accepted and never answered (a hung server or load balancer: only the
    client's timeouts end a request). :meth:`restore` forwards again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._hung = threading.Event()
        self._silent: list[socket.socket] = []  # accepted while hung, never answered
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="s3-proxy", daemon=True)
        self._thread.start()

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            live, self._live = list(self._live), set()
        for sock in live:
            _reset(sock)

    def hang(self) -> None:
        self._hung.set()

    def restore(self) -> None:
        self._cut.clear()
        self._hung.clear()
        with self._lock:
            silent, self._silent = self._silent, []
        for sock in silent:  # their clients reconnect
            _reset(sock)

    def close(self) -> None:
        self._closed.set()
        self.restore()
        self.cut()
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self._cut.is_set():
                _reset(client)
                continue
            if self._hung.is_set():
                with self._lock:
                    self._silent.append(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._live.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                if self._cut.is_set():
                    break
                if not self._hung.is_set():  # (hung: swallowed, the peer waits for an answer)
                    dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            with self._lock:
                self._live.discard(sock)
            _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset, not a clean FIN: the peer sees the connection fail."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


@dataclass(frozen=True, kw_only=True)
class LoopbackS3:
    """A bucket on the moto server, reached through ``proxy``."""

    proxy: CuttableProxy
    bucket: str

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.proxy.port}"

    def uri(self, prefix: str, *, credentials: str = "", **options: str) -> str:
        """``s3://[CREDENTIALS@]BUCKET/PREFIX?endpoint_override=…&scheme=http`` (plus ``options``)."""
        query = {"endpoint_override": self.endpoint, "scheme": "http", **options}
        at = f"{credentials}@" if credentials else ""
        return f"s3://{at}{self.bucket}/{prefix}?" + "&".join(f"{key}={value}" for key, value in query.items())

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", allow_bucket_creation=True)


def start_moto() -> tuple[object, tuple[str, int]]:
    """moto's threaded server on a free loopback port; returns (server, (host, port))."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server, server.get_host_and_port()


def new_bucket(target: tuple[str, int]) -> LoopbackS3:
    """A fresh bucket behind a new proxy (the caller closes the proxy). Needs :data:`S3_ENV` set."""
    proxy = CuttableProxy(target)
    s3 = LoopbackS3(proxy=proxy, bucket=f"lc-{secrets.token_hex(4)}")
    s3.filesystem().create_dir(s3.bucket)
    return s3


@contextmanager
def iam_enforced(target: tuple[str, int]) -> Iterator[dict[str, str]]:
    """moto checking every request's signature and IAM permissions, for the ``with`` block:
    yields the environment of a new IAM user allowed ``s3:*`` (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``). By moto's server-mode switch (``/moto-api/reset-auth``, its
    ``INITIAL_NO_AUTH_ACTION_COUNT``), restored after: the other tests' dummy keys work again."""
    import boto3

    endpoint = f"http://{target[0]}:{target[1]}"
    iam = boto3.client("iam", endpoint_url=endpoint, region_name=S3_ENV["AWS_REGION"])
    user = f"lc-{secrets.token_hex(4)}"
    iam.create_user(UserName=user)
    allow_s3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(allow_s3))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    previous = _reset_auth(endpoint, "0")
    try:
        yield {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    finally:
        _reset_auth(endpoint, previous)


def _reset_auth(endpoint: str, count: str) -> str:
    """Set moto's ``INITIAL_NO_AUTH_ACTION_COUNT`` (``"0"``: check every request); the previous value."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=count.encode(), headers={"Content-Type": "text/plain"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]


@contextmanager
def flapping(proxy: CuttableProxy, *, up_s: float, down_s: float) -> Iterator[list[int]]:
    """``proxy`` cut for ``down_s`` every ``up_s + down_s`` seconds (an endpoint failing on and
    off) for the ``with`` block; yields a list that counts the outages begun (one element per
    outage). Restored at the end."""
    outages: list[int] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(up_s):
            proxy.cut()
            outages.append(1)
            stop.wait(down_s)
            proxy.restore()

    thread = threading.Thread(target=run, name="s3-flapping", daemon=True)
    thread.start()
    try:
        yield outages
    finally:
        stop.set()
        thread.join(timeout=up_s + down_s + 5)
        proxy.restore()


#: What S3 answers a request over its rate (HTTP 503): the client backs off and retries.
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>lc-throttle</RequestId></Error>"
)


class RequestLimit:
    """A WSGI wrapper that lets at most ``per_second`` requests through in any one second and
    answers the rest ``503 SlowDown``, as S3 does past a prefix's request rate (``per_second``
    0: every request refused). Counts both."""

    def __init__(self, app: object, per_second: int) -> None:
        self.app = app
        self.per_second = per_second
        self.served = 0
        self.refused = 0
        self._recent: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, environ: dict, start_response):  # noqa: ANN204 - WSGI
        with self._lock:
            now = time.monotonic()
            self._recent = [t for t in self._recent if now - t < 1.0]
            over = len(self._recent) >= self.per_second
            if over:
                self.refused += 1
            else:
                self._recent.append(now)
                self.served += 1
        if not over:
            return self.app(environ, start_response)  # type: ignore[operator]
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # (the client sent it all)
        start_response("503 Slow Down", [("Content-Type", "application/xml"), ("Content-Length", str(len(SLOW_DOWN)))])
        return [SLOW_DOWN]


@contextmanager
def throttled_s3(per_second: int) -> Iterator[tuple[tuple[str, int], RequestLimit]]:
    """A second moto server on a free loopback port (the same buckets: moto's state is the
    process's) under :class:`RequestLimit`; yields its (host, port) and the limit."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    limit = RequestLimit(DomainDispatcherApplication(create_backend_app), per_second)
    server = make_server("127.0.0.1", 0, limit, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="s3-throttled", daemon=True)
    thread.start()
    try:
        yield (str(server.server_address[0]), int(server.server_address[1])), limit
    finally:
        server.shutdown()
        thread.join(timeout=5)

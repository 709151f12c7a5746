"""A loopback S3-compatible server for the object-store tests: moto's server on 127.0.0.1
behind a TCP proxy that a test can cut (an outage: connections are reset, the stored objects
stay in moto's memory) and restore."""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
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
    server is down). :meth:`restore` forwards again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._cut = threading.Event()
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

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
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

"""A real S3-compatible HTTP endpoint on 127.0.0.1 for tests (moto's server mode).

``S3Endpoint`` can be stopped (connections refused, open connections cut),
hung (connections accepted, never answered) and started again on the same
port. moto keeps its buckets in process-wide state, so the objects survive a
stop and a start, like a real server's disk.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from moto.server import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    ThreadedMotoServer,
    create_backend_app,
)
from werkzeug.serving import BaseWSGIServer, make_server

CREDENTIALS = {"key": "testing", "secret": "testing"}


class _TrackingHandler(MotoRequestHandler):
    """Remembers open connections so that a stop can cut keep-alive ones too."""

    def setup(self) -> None:
        super().setup()
        self.server.open_connections.add(self.connection)

    def finish(self) -> None:
        self.server.open_connections.discard(self.connection)
        super().finish()

    def log_request(self, *args: Any) -> None:
        pass  # keep test output quiet


class S3Endpoint(ThreadedMotoServer):
    def __init__(self, port: int = 0) -> None:
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self._sink: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def _server_entry(self) -> None:
        app = DomainDispatcherApplication(create_backend_app)
        server: BaseWSGIServer = make_server(self._ip_address, self._port, app, True,
                                             request_handler=_TrackingHandler)
        server.open_connections = set()
        self._port = server.server_address[1]  # a port of 0 becomes the real one
        # Ready once the loop runs: a shutdown() before that would be lost.
        server.service_actions = self._server_ready_event.set
        self._server = server
        server.serve_forever(poll_interval=0.05)  # closes the socket when it ends

    def start(self) -> None:
        """Serve (again, on the same port: moto keeps its objects in this process)."""
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        super().start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones."""
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        if self._server is None:
            return
        super().stop()
        for conn in list(self._server.open_connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server = None

    def hang(self) -> None:
        """Accept connections (the kernel queues them) but never answer them."""
        self.stop()
        sink = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sink.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sink.bind((self._ip_address, self._port))
        sink.listen(128)
        self._sink = sink

    def client(self) -> Any:
        """A boto3 client of this endpoint (no region in client_kwargs: see below)."""
        import boto3

        # us-east-1 is the one region where CreateBucket takes no LocationConstraint.
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["key"],
                            aws_secret_access_key=CREDENTIALS["secret"])

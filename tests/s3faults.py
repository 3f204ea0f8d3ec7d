"""A real S3 API that fails on request: moto's server behind a WSGI middleware counting requests.

Used by tests/test_storage_s3.py and bench/faults.py::

    server = FaultyS3Server().start()          # server.url: the endpoint for s3fs
    server.arm(at=3, kind="503")               # the 3rd request from now answers 503 SlowDown

Kinds: "503" (SlowDown, throttling), "500" (InternalError), "drop" (the connection is cut: for a
PUT after half its body was received, so the object never lands), "lost" (the request is served
and its effect stays, then the connection is cut before the answer: the client cannot tell).
``chain_options(server)`` turns off botocore's and s3fs's own retries, so ckptzip's retry layer is
the one that sees every fault.
"""
from __future__ import annotations

import logging
import socket
import threading

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

KINDS = ("503", "500", "drop", "lost")
_BODIES = {"503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
           "500": ("500 Internal Server Error", "InternalError", "We encountered an internal error.")}


class FaultMiddleware:
    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.requests: list[str] = []
        self.failed: list[str] = []
        self.at, self.kind, self.times, self.methods = None, None, 0, None

    def arm(self, at: int | None, kind: str | None = None, times: int = 1, methods: tuple[str, ...] | None = None):
        """Fail requests ``at`` .. ``at + times - 1`` from now (1-based; counting only ``methods``)."""
        with self.lock:
            self.requests.clear()
            self.failed.clear()
            self.at, self.kind, self.times, self.methods = at, kind, times, methods

    def clear(self) -> None:
        self.arm(None)

    def __call__(self, environ, start_response):
        what = f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')}"
        if self.methods is not None and environ["REQUEST_METHOD"] not in self.methods:
            return self.app(environ, start_response)
        with self.lock:
            self.requests.append(what)
            n = len(self.requests)
            kind = self.kind if self.at is not None and self.at <= n < self.at + self.times else None
            if kind:
                self.failed.append(what)
        if kind in _BODIES:
            status, code, msg = _BODIES[kind]
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
                    f"<RequestId>fault</RequestId></Error>").encode()
            start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if kind == "drop":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length:
                environ["wsgi.input"].read(length // 2)  # half an upload arrives, then the line dies
            _cut(environ)
        if kind == "lost":
            body = b"".join(self.app(environ, lambda *a, **k: None))  # served: its effect stays
            del body
            _cut(environ)
        return self.app(environ, start_response)


def _cut(environ):
    sock = environ["werkzeug.socket"]
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()
    raise ConnectionAbortedError("fault injected: connection cut")


class FaultyS3Server(ThreadedMotoServer):
    def __init__(self):
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.faults = FaultMiddleware(DomainDispatcherApplication(create_backend_app))

    def _server_entry(self) -> None:
        self._server = make_server(self._ip_address, self._port, self.faults, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    def start(self) -> "FaultyS3Server":
        for name in ("werkzeug", "moto"):  # a cut connection logs a traceback per request otherwise
            logging.getLogger(name).setLevel(logging.CRITICAL)
        super().start()
        host, port = self.get_host_and_port()
        self.url = f"http://{host}:{port}"
        return self

    def arm(self, at: int | None, kind: str | None = None, times: int = 1, methods: tuple[str, ...] | None = None):
        self.faults.arm(at, kind, times, methods)

    def clear(self) -> None:
        self.faults.clear()

    @property
    def failed(self) -> list[str]:
        return self.faults.failed

    @property
    def calls(self) -> list[str]:
        """The requests counted since the last arm (as FaultPlan.calls)."""
        return self.faults.requests


def chain_options(server: FaultyS3Server) -> dict:
    """storage_options for s3fs on ``server`` with the client's own retries off."""
    return {"client_kwargs": {"endpoint_url": server.url},
            "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 5, "read_timeout": 5}}

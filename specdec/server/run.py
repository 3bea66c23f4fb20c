"""Running the app under uvicorn: in the foreground (``specdec serve``) or in a background thread.

Uvicorn gets the app's ``ServerLimits``: keep-alive timeout, connection limit, and an HTTP protocol
with a deadline for each request's headers (uvicorn has none: a client that opens connections and
sends nothing, or sends its headers a byte at a time, would hold them open for good).
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specdec.host_memory import pin_mmap_threshold
from specdec.server.limits import ServerLimits


class _HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol (the C parser the server extra installs) with a deadline for each
    request's headers: ``header_timeout`` seconds from the connection's start or the request's first
    byte. Idle keep-alive connections are uvicorn's own timeout's business."""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    limits: ServerLimits = getattr(getattr(app.state, "server", None), "limits", None) or ServerLimits()
    protocol = type("HeaderDeadline", (_HeaderDeadline,), {"header_timeout": limits.header_timeout})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol,
                          timeout_keep_alive=limits.timeout_keep_alive, limit_concurrency=limits.limit_concurrency,
                          server_header=False)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    pin_mmap_threshold()  # this process is a server: give memory back after bursts (host_memory.py)
    uvicorn.Server(uvicorn_config(app, host, port, log_level)).run()


class ServerThread:
    """Uvicorn on ``host`` in a daemon thread; port 0 (the default) picks a free ephemeral port.

        with ServerThread(build_app(llm)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.config = uvicorn_config(app, host, port, log_level)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="specdec-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""The ASGI layer in front of the routes: who may call, and how much and how slowly they may send.

- ``Host`` must be an allowed name (by default, on a connection over loopback, only loopback
  names: a page that rebinds its DNS name to 127.0.0.1 sends its own name), and so must a
  browser's ``Origin``;
- a body longer than ``max_body_bytes`` is refused with 413: at once when ``Content-Length``
  says so, else as soon as the bytes read pass the limit;
- a body must arrive within ``body_timeout`` seconds of its headers, else 408.
The headers' own deadline lives in the HTTP protocol (run.py): the app sees a request only once
its headers are complete.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from urllib.parse import urlsplit

from specdec.server import protocol as P
from specdec.server.limits import ServerLimits


class Guard:
    def __init__(self, app, limits: ServerLimits, on_reject: Callable[[int], None] = lambda status: None):
        self.app, self.limits, self.on_reject = app, limits, on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        allowed = self.limits.hosts_for((scope.get("server") or ("", 0))[0])
        if allowed is not None:
            if _hostname(headers.get("host", "")) not in allowed:
                return await self._reply(send, 400, "the Host header names a host this server does not serve; "
                                                    "pass --allowed-hosts to serve it", "invalid_host")
            origin = headers.get("origin")  # browsers send it; "null" from sandboxed frames and files
            if origin is not None and (origin == "null" or _hostname(urlsplit(origin).netloc) not in allowed):
                return await self._reply(send, 403, "cross-origin requests are not allowed; pass --allowed-hosts "
                                                    "to allow this origin", "invalid_origin")
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._reply(send, 413, f"the request body is larger than {limit} bytes", "body_too_large")
        await self.app(scope, _BodyReader(receive, limit, self.limits.body_timeout), send)

    async def _reply(self, send, status: int, message: str, code: str) -> None:
        self.on_reject(status)
        body = json.dumps(P.error_body(message, code=code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _BodyReader:
    """``receive`` with a size limit and a deadline on the body; after the body it passes through
    (the routes wait on it for the client's disconnect)."""

    def __init__(self, receive, limit: int, timeout: float):
        self.receive, self.limit = receive, limit
        self.deadline = asyncio.get_running_loop().time() + timeout
        self.read = 0
        self.done = False

    async def __call__(self):
        if self.done:
            return await self.receive()
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self.receive(), max(remaining, 0.0))
        except TimeoutError:
            raise P.ApiError(408, "the request body did not arrive in time", code="request_timeout",
                             headers={"Connection": "close"}) from None
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.limit:
                raise P.ApiError(413, f"the request body is larger than {self.limit} bytes", code="body_too_large",
                                 headers={"Connection": "close"})
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        return message


def _hostname(netloc: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '[::1]'."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[: netloc.find("]") + 1]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc

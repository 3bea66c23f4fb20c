"""Running the app under uvicorn: in the foreground (``specdec serve``) or in a background thread."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from specdec.host_memory import pin_mmap_threshold


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    pin_mmap_threshold()  # this process is a server: give memory back after bursts (host_memory.py)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


class ServerThread:
    """Uvicorn on ``host`` in a daemon thread; port 0 (the default) picks a free ephemeral port.

        with ServerThread(build_app(llm)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
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

"""OpenAI-compatible server: ``build_app`` (FastAPI), ``ServerThread`` / ``serve`` (uvicorn).

Layout: ``protocol`` (wire format and errors), ``chat`` (messages to tokens), ``async_engine`` (the
engine thread and per-request queues), ``metrics`` (Prometheus), ``app`` (routes), ``run`` (uvicorn).
"""

from specdec.server.app import build_app
from specdec.server.run import ServerThread, serve

__all__ = ["ServerThread", "build_app", "serve"]

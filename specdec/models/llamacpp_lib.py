"""llama.cpp's shared library, through llama-cpp-python's low-level bindings: loaded and initialised
once, its log lines routed to Python's logging (shown when SPECDEC_LLAMA_LOG is set)."""

from __future__ import annotations

import importlib.util
import logging
import os

log = logging.getLogger(__name__)
_state: dict = {}  # "lib": the initialised module; "callback": the log callback C holds a pointer to


def available() -> bool:
    """Whether llama-cpp-python is installed (without loading the library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def load_library():
    """The ``llama_cpp`` module, its backend initialised; ValueError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("the llama.cpp backend needs llama-cpp-python: run `make install` (builds it for this CPU) "
                         "or `pip install llama-cpp-python gguf`; or pass backend='torch'") from None
    if "lib" not in _state:
        llama_cpp.llama_backend_init()
        _state["callback"] = llama_cpp.llama_log_callback(_log_from_llama)  # kept alive: C holds the pointer
        llama_cpp.llama_log_set(_state["callback"], None)
        _state["lib"] = llama_cpp
    return llama_cpp


def _log_from_llama(level: int, text: bytes, _user) -> None:
    if os.environ.get("SPECDEC_LLAMA_LOG"):  # llama.cpp's own log lines, on request only
        log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())

"""The server's bounds, in one validated dataclass, and the memory they are measured against.

Every resource a client can ask for is bounded: request body bytes, prompts per request, queued
requests (429 past it), sequences and prompt tokens per round, KV cache bytes (requests wait
until theirs fit), and the time a connection may take to send its headers and its body. The
scheduler enforces the round's bounds and the KV budget (scheduler.py, ``Scheduler.limit``).
Names follow vLLM's where it has the setting (``max_num_seqs``, ``max_num_batched_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import MAX_N, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass
class ServerLimits:
    """Bounds and timeouts of one server. ``None`` for ``kv_cache_memory`` means
    ``kv_cache_memory_fraction`` of the memory free once the models are loaded."""

    max_body_bytes: int = 4 * 2**20
    max_prompts_per_request: int = 64
    max_n: int = 16  # choices per prompt (each a sequence of its own in the batch and the KV budget)
    max_stop_strings: int = 16  # each is searched in a sequence's text after every round, on the engine thread
    max_stop_token_ids: int = 256
    max_queued_requests: int = 1024  # waiting for a batch slot or KV memory; 429 past it
    max_num_batched_tokens: int = 8192  # prompt tokens admitted into one round (one prompt always fits)
    kv_cache_memory: int | None = None  # bytes
    kv_cache_memory_fraction: float = 0.5
    timeout_keep_alive: float = 5.0  # idle keep-alive connections are closed after this (uvicorn's name)
    header_timeout: float = 10.0  # a connection must send a request's headers within this
    body_timeout: float = 30.0  # ... and its body within this once the headers are in
    limit_concurrency: int | None = 1024  # connections + tasks before uvicorn answers 503
    allowed_hosts: tuple[str, ...] | None = None  # besides loopback names; None: see hosts_for
    metrics_public: bool = False  # /metrics without the API key
    enable_docs: bool = False  # /docs, /redoc, /openapi.json
    engine_restarts: int = 5  # restarts of a dead engine process tried in a row before giving up (0: none)
    engine_restart_backoff: float = 0.5  # seconds before the first restart; doubles with each failure in a row
    # seconds an engine process may go without a pass of its loop while requests are in flight; past it the
    # process is taken as hung, killed and restarted like a dead one (vLLM: VLLM_ENGINE_ITERATION_TIMEOUT_S)
    engine_iteration_timeout: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompts_per_request", "max_queued_requests", "max_num_batched_tokens",
                     "max_n", "max_stop_strings", "max_stop_token_ids"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"{name} must be an integer >= 1, got {value!r}")
        for name, bound in (("max_n", MAX_N), ("max_stop_strings", MAX_STOP_STRINGS),
                            ("max_stop_token_ids", MAX_STOP_TOKEN_IDS)):
            _check(getattr(self, name) <= bound, f"{name} must be at most {bound} (SamplingParams' bound), "
                   f"got {getattr(self, name)}")
        _check(self.kv_cache_memory is None or (isinstance(self.kv_cache_memory, int) and self.kv_cache_memory > 0),
               f"kv_cache_memory must be a number of bytes > 0 or None, got {self.kv_cache_memory!r}")
        _check(isinstance(self.kv_cache_memory_fraction, (int, float)) and 0 < self.kv_cache_memory_fraction <= 1,
               f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and value > 0,
                   f"{name} must be a number of seconds > 0, got {value!r}")
        _check(isinstance(self.engine_restarts, int) and not isinstance(self.engine_restarts, bool)
               and self.engine_restarts >= 0, f"engine_restarts must be an integer >= 0, got {self.engine_restarts!r}")
        _check(isinstance(self.engine_restart_backoff, (int, float)) and self.engine_restart_backoff >= 0,
               f"engine_restart_backoff must be a number of seconds >= 0, got {self.engine_restart_backoff!r}")
        _check(isinstance(self.engine_iteration_timeout, (int, float)) and self.engine_iteration_timeout > 0,
               f"engine_iteration_timeout must be a number of seconds > 0, got {self.engine_iteration_timeout!r}")
        limit = self.limit_concurrency
        _check(limit is None or (isinstance(limit, int) and limit >= 1),
               f"limit_concurrency must be an integer >= 1 or None, got {limit!r}")
        if self.allowed_hosts is not None:
            self.allowed_hosts = tuple(h.lower() for h in self.allowed_hosts)

    def hosts_for(self, local_host: str) -> frozenset[str] | None:
        """The Host (and Origin) names to accept on a connection that came in at ``local_host``; None
        accepts any. A connection over loopback must name a loopback host (or an allowed one): a page
        that rebinds its DNS name to 127.0.0.1 sends its own name, so it cannot reach the server."""
        if self.allowed_hosts is not None:
            return frozenset(self.allowed_hosts) | frozenset(LOOPBACK_HOSTS)
        if local_host in LOOPBACK_HOSTS:
            return frozenset(LOOPBACK_HOSTS)
        return None


def available_memory(device: torch.device) -> int:
    """Bytes free now: the accelerator's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '1.5GB', '1000000' -> bytes (for --kv-cache-memory)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    _check(unit in units and value > 0, f"a memory size must look like 8GiB, 512MiB or 1000000 (bytes), got {text!r}")
    return int(value * units[unit])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


"""The engine loop in a process of its own, as vLLM V1 runs its EngineCore: the HTTP process parses,
tokenizes and streams; the engine process owns the model and runs the rounds.

Python runs one thread at a time per process (the GIL). With the engine loop in the HTTP process,
every request the HTTP side handles, a hostile client's flood of bad ones included, takes time from
the rounds of everyone else's; in its own process it cannot. The two talk over one pipe
(``multiprocessing.Pipe``, pickled tuples):

    HTTP -> engine   ("add", rid, prompts, arrival)              a request checked by ``Admission``
                     ("abort", rid), ("stop",)
    engine -> HTTP   ("ready", EngineInfo, KvBudget)              once, when the model is loaded, with a
                                                                   copy of the scheduler's budget for
                                                                   ``Admission``; or ("failed", message)
                     ("round", events, hooks, dequeued, Snapshot)  after each pass of the loop that did
                                                                   something: the requests' Events, the
                                                                   metrics hooks fired, requests that left
                                                                   the queue, what /metrics shows
                     ("stopped",)                                  the loop ended

In the engine process the loop is ``AsyncEngine`` itself; its request handles put their events in an
outbox sent once a pass. The process's main thread reads the pipe and compiles grammars (llguidance
releases the GIL while it compiles), so neither runs on the engine thread.

The HTTP side's supervisor thread reads the pipe and watches the process (its sentinel, so a death
is seen at once, killed or out of memory). When the engine dies, every request in flight fails with
503 (a stream gets an error event and ends), /health answers 503 while a new engine process loads,
and the server serves again once it is ready. Restarts back off exponentially
(``ServerLimits.engine_restart_backoff``, doubling) and are bounded: after
``ServerLimits.engine_restarts`` failures in a row (a launch that fails, or an engine that dies within
``STABLE_AFTER_S`` of loading) the server stops trying and /health stays 503. An engine that hangs
instead of dying (no pass of its loop for ``ServerLimits.engine_iteration_timeout`` seconds while requests
are in flight) is killed and handled the same way.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from dataclasses import fields
from multiprocessing.connection import wait
from typing import Any

from specdec.server.async_engine import (
    Admission, AsyncEngine, EngineInfo, Event, LoopHooks, Prompt, RequestError, RequestHandle, Snapshot)
from specdec.server.limits import ServerLimits

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading (or converting) a large model may take minutes
STABLE_AFTER_S = 60.0  # an engine that served this long before dying starts a fresh count of failures
BACKOFF_CAP_S = 30.0
POLL_S = 0.5  # how often a wait checks whether the server is stopping
# what a request in flight learns when its engine dies (the word "stopped" is what clients match on)
ENGINE_DIED = "the engine stopped unexpectedly while running this request and is restarting; retry the request"
ENGINE_GONE = "the engine stopped unexpectedly while running this request"


class EngineProcess(Admission):
    """The HTTP side of an engine process: the same surface as ``AsyncEngine`` (submit, abort, alive,
    snapshot, hooks) plus ``state`` ("serving", "restarting", "failed", "stopped") and ``restarts``.
    Constructing it starts the process and waits until the model is loaded; a model that cannot be
    loaded is a ValueError with the engine's message. The engine runs as many torch threads as this
    process has set (``specdec serve --threads``)."""

    def __init__(self, llm_kwargs: dict[str, Any], limits: ServerLimits | None = None, release_when_idle: bool = True):
        import torch

        limits = limits or ServerLimits()
        self.hooks = LoopHooks()
        self._args = (llm_kwargs, limits, release_when_idle, torch.get_num_threads())
        self._state_lock = threading.Lock()  # state, _proc/_conn and the handles change together
        self._stopping = threading.Event()
        self._proc = self._conn = None
        msg = self._launch()
        if msg[0] != "ready":
            _reap(self._proc, 10)
            raise ValueError(msg[1])
        self.info: EngineInfo = msg[1]
        super().__init__(msg[2], limits)
        self._snapshot = Snapshot(kv_budget_bytes=self.budget.budget)
        self._dead = Snapshot()  # counters of engine processes that died, added to the live one's
        self._handles: dict[int, list] = {}  # rid -> [handle, choices not finished]
        self._heard = time.monotonic()  # the engine's last message, or the first request after it went idle
        self._send_lock = threading.Lock()
        self.state = "serving"
        self.restarts = 0  # engine processes started again after one died
        self._failures = 0  # failures in a row (launches that failed, engines that died soon after loading)
        self._up_since = time.monotonic()
        self.error: BaseException | None = None
        # Started here, not in start(): `specdec serve` lowers the HTTP process's priority once this
        # returns, and on Linux a thread (and what it spawns: a restarted engine) keeps the priority of
        # the thread that created it.
        self._supervisor = threading.Thread(target=self._supervise, name="specdec-engine-pipe", daemon=True)
        self._supervisor.start()

    # -- asyncio side ---------------------------------------------------------------------------

    def start(self) -> None:
        """Nothing to do: the supervisor runs from construction on (see ``__init__``)."""

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._send(self._conn, ("stop",))
        _reap(self._proc, timeout)
        self._supervisor.join(timeout)
        proc = self._proc  # the one that got the stop, or one a restart started meanwhile
        if proc.is_alive():
            proc.kill()
            _reap(proc, timeout)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self.state == "serving"

    def submit(self, prompts: list[Prompt | tuple], arrival: float | None = None) -> RequestHandle:
        """Queue one request in the engine process; see ``Admission.check``. RuntimeError while no
        engine serves (restarting, failed, stopped)."""
        with self._state_lock:
            if self.state != "serving":
                raise RuntimeError(f"the engine is {self.state}")
            prompts = self.check(prompts)
            handle = RequestHandle(self, asyncio.get_running_loop(), sum(p.params.n for p in prompts))
            if not self._handles:  # an idle engine owes no message until now
                self._heard = time.monotonic()
            self._handles[handle.rid] = [handle, handle.num_choices]
            conn = self._conn
        # matchers stay here (they do not pickle): the engine process compiles the request's grammar again
        sent = [Prompt(p.token_ids, p.params) for p in prompts]
        if not self._send(conn, ("add", handle.rid, sent, arrival or time.perf_counter())):
            with self._state_lock:
                if self._handles.pop(handle.rid, None) is not None:  # else the supervisor failed it already
                    self._left_queue()
                    raise RuntimeError("the engine process is not running")
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.rid, None) is not None:
            self._send(self._conn, ("abort", handle.rid))

    def snapshot(self) -> Snapshot:
        """The live engine's snapshot, its counters added to those of engines that died."""
        return _added(self._dead, self._snapshot)

    def _send(self, conn, msg: tuple) -> bool:
        try:
            with self._send_lock:
                conn.send(msg)
            return True
        except (OSError, ValueError):  # the engine process is gone, or the pipe closed
            return False

    # -- the supervisor thread: read the pipe, watch the process, restart it ------------------------

    def _supervise(self) -> None:
        try:
            while True:
                self._read(self._conn, self._proc)
                if self._stopping.is_set() or not self._restart():
                    break
        except Exception:  # a bug here must not leave requests hanging
            log.exception("the engine supervisor failed")
            self.state = "failed"
        finally:
            with self._state_lock:
                if self.state != "failed":
                    self.state = "stopped"
                handles, self._handles = list(self._handles.values()), {}
            for handle, _ in handles:
                handle.post(Event(0, "", [], error=RequestError(503, "the engine stopped")))

    def _read(self, conn, proc) -> None:
        """Deliver the engine's messages until it stops or dies."""
        while True:
            ready = wait([conn, proc.sentinel], timeout=POLL_S)
            if not ready:
                self._kill_if_hung(proc)
                continue
            if conn not in ready and not conn.poll():  # dead, and nothing left in the pipe
                return
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            self._heard = time.monotonic()
            if msg[0] == "stopped":
                return
            _, events, hooks, dequeued, self._snapshot = msg
            for _ in range(dequeued):
                self._left_queue()
            for name, arg in hooks:
                self._hook(name, arg)
            for rid, ev in events:
                self._deliver(rid, ev)

    def _kill_if_hung(self, proc) -> None:
        """Kill an engine that has requests in flight but has not finished a pass of its loop for
        ``limits.engine_iteration_timeout`` seconds; the sentinel then wakes ``_read`` as for a death."""
        silent = time.monotonic() - self._heard
        if self._handles and silent > self.limits.engine_iteration_timeout and proc.is_alive():
            log.error("the engine process made no progress for %.0f s with %d requests in flight; killing it",
                      silent, len(self._handles))
            proc.kill()

    def _restart(self) -> bool:
        """After an engine died: fail its requests, then start engines until one loads (backing off) or
        the failures in a row pass ``limits.engine_restarts``. False when giving up (or stopping)."""
        old = self._proc
        _reap(old, 1.0)
        if old.is_alive():  # its loop ended ("stopped") but the process lingers
            old.kill()
            _reap(old, 5.0)
        if time.monotonic() - self._up_since >= STABLE_AFTER_S:
            self._failures = 0
        self._failures += 1
        limit = self.limits.engine_restarts
        again = self._failures <= limit
        with self._state_lock:
            self.state = "restarting" if again else "failed"
            handles, self._handles = list(self._handles.values()), {}
            with self._lock:  # Admission's count: what was queued there is failed now
                self._num_queued = 0
            self._dead = _added(self._dead, self._snapshot)
            self._snapshot = Snapshot(kv_budget_bytes=self.budget.budget)
        self._conn.close()
        log.error("the engine process died (%s) with %d requests in flight; failing them with 503", _exit(old),
                  len(handles))
        error = RequestError(503, ENGINE_DIED if again else ENGINE_GONE)
        for handle, _ in handles:
            handle.post(Event(0, "", [], error=error))
        while self._failures <= limit:
            delay = min(BACKOFF_CAP_S, self.limits.engine_restart_backoff * 2 ** (self._failures - 1))
            log.warning("restarting the engine process in %.1f s (attempt %d of at most %d in a row)", delay,
                        self._failures, limit)
            if self._stopping.wait(delay):
                return False
            began = time.monotonic()
            msg = self._launch()
            if self._stopping.is_set():
                self._proc.kill()
                return False
            if msg[0] == "ready":
                with self._state_lock:
                    self.budget = msg[2]
                    self._snapshot = Snapshot(kv_budget_bytes=self.budget.budget)
                    self.state, self._up_since = "serving", time.monotonic()
                    self.restarts += 1
                log.warning("the engine process restarted in %.1f s; serving again", time.monotonic() - began)
                return True
            log.error("the engine process could not be restarted: %s", msg[1])
            _reap(self._proc, 5.0)
            self._conn.close()
            self._failures += 1
        with self._state_lock:
            self.state = "failed"
        log.error("the engine process failed %d times in a row; not restarting it again (/health answers 503)",
                  self._failures)
        return False

    def _launch(self) -> tuple:
        """Start an engine process (it becomes ``_proc``/``_conn`` at once, so ``stop`` can end it) and
        wait for its first message: ("ready", ...) or ("failed", message)."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch or OpenMP state forked
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_main, name="specdec-engine", daemon=True, args=(child, *self._args))
        with self._state_lock:
            self._proc, self._conn = proc, conn
        try:
            proc.start()
        except OSError as e:  # no memory or no process slots left to start one
            log.error("the engine process could not be started: %s", e)
            return ("failed", "the engine process could not be started (see the log)")
        finally:
            child.close()
        died = ("failed", "the engine process exited while loading the model (see the log above)")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._stopping.is_set():
            ready = wait([conn, proc.sentinel], timeout=POLL_S)
            if conn in ready or (ready and conn.poll()):
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    return died
            if ready:
                return died
            if time.monotonic() > deadline:
                proc.kill()
                return ("failed", f"the engine process did not load the model within {START_TIMEOUT_S:.0f} s")
        return ("failed", "the server is stopping")

    def _deliver(self, rid: int, ev: Event) -> None:
        entry = self._handles.get(rid)
        if entry is None:  # aborted here meanwhile
            return
        handle = entry[0]
        if ev.finish_reason is not None:
            entry[1] -= 1
        if ev.error is not None or entry[1] == 0:
            self._handles.pop(rid, None)
        handle.post(ev)

    def _hook(self, name: str, arg: Any) -> None:
        try:
            getattr(self.hooks, name)(arg)
        except Exception:
            log.exception("a metrics hook failed")


_GAUGES = ("running", "waiting", "kv_budget_bytes", "kv_reserved_bytes")


def _added(dead: Snapshot, live: Snapshot) -> Snapshot:
    """``live`` with the counters of ``dead`` added: numbers, lists by position, dicts by key (the
    gauges are the live engine's)."""
    out = {}
    for f in fields(Snapshot):
        a, b = getattr(dead, f.name), getattr(live, f.name)
        if f.name in _GAUGES:
            out[f.name] = b
        elif isinstance(b, list):
            out[f.name] = [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))]
        elif isinstance(b, dict):
            out[f.name] = {key: a.get(key, 0) + b.get(key, 0) for key in sorted(set(a) | set(b))}
        else:
            out[f.name] = a + b
    return Snapshot(**out)


def _reap(proc, timeout: float) -> None:
    if proc.pid is not None:  # it was started
        proc.join(timeout)


def _exit(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "still running; killed"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"killed by {name}" + (": killed, or out of memory" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


# -- the engine process ---------------------------------------------------------------------------


class _RemoteHandle(RequestHandle):
    """A request in the engine process: its events go to the loop's outbox, sent once a pass."""

    def __init__(self, owner: _PipedEngine, rid: int, num_choices: int):
        super().__init__(owner, None, num_choices, rid)

    def post(self, ev: Event) -> None:  # engine thread, as for AsyncEngine's handles
        self.owner.outbox.append((self.rid, ev))


class _PipedEngine(AsyncEngine):
    """``AsyncEngine`` whose handles and hooks report over the pipe after each pass of the loop."""

    def __init__(self, engine, conn, limits: ServerLimits, release_when_idle: bool):
        super().__init__(engine, release_when_idle=release_when_idle, limits=limits)
        self.conn, self.send_lock = conn, threading.Lock()
        self.outbox: list[tuple[int, Event]] = []
        self.fired: list[tuple[str, Any]] = []
        self.dequeued = 0
        self.handles: dict[int, _RemoteHandle] = {}  # main thread only
        self._last: Snapshot | None = None
        self.hooks = LoopHooks(*(self._forward(name) for name in ("on_first_token", "on_finish", "on_error",
                                                                  "on_loop_error")))

    def _forward(self, name: str):
        def hook(arg):  # an exception does not pickle reliably: the metrics only count those
            self.fired.append((name, None if isinstance(arg, BaseException) else arg))
        return hook

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _iterate(self) -> bool:
        stop = super()._iterate()
        self.flush()
        return stop

    def _run(self) -> None:
        super()._run()
        self.flush()
        try:
            self.send(("stopped",))
        except OSError:
            pass

    def _left_queue(self) -> None:
        self.dequeued += 1  # the HTTP side's count of queued requests follows
        super()._left_queue()

    def flush(self) -> None:
        snapshot = self.snapshot()
        if not (self.outbox or self.fired or self.dequeued) and snapshot == self._last:
            return
        events, self.outbox = self.outbox, []
        fired, self.fired = self.fired, []
        dequeued, self.dequeued = self.dequeued, 0
        self._last = snapshot
        try:
            self.send(("round", events, fired, dequeued, snapshot))
        except OSError:  # the HTTP process is gone; the main thread sees it too and stops the loop
            pass

    def add(self, rid: int, prompts: list[Prompt], arrival: float) -> None:
        """A request from the HTTP side (main thread): its grammars compiled here, then into the queue."""
        try:
            prompts = [Prompt(p.token_ids, p.params, self._matchers(p)) for p in prompts]
        except ValueError as e:  # the HTTP side compiled it already; this is a last line of defence
            log.warning("a grammar the HTTP side compiled failed here: %s", e)
            error = Event(0, "", [], error=RequestError(400, "the grammar could not be compiled"))
            self.send(("round", [(rid, error)], [], 1, self.snapshot()))  # 1: it leaves the HTTP side's queue count
            return
        self._joined_queue()  # the HTTP side checked the queue's bound
        handle = self.handles[rid] = _RemoteHandle(self, rid, sum(p.params.n for p in prompts))
        self.enqueue(handle, prompts, arrival)

    def _matchers(self, p: Prompt) -> list | None:
        so = p.params.structured_outputs
        return None if so is None else self.engine.grammar_compiler.ready_matchers(so, p.params.n)

    def drop_done(self) -> None:
        """Forget the handles of requests that ended (finished, failed or aborted; main thread): each
        holds its sequences, tokens and logprobs."""
        for rid in [rid for rid, h in self.handles.items() if h.state == "done"]:
            del self.handles[rid]

    def abort_request(self, rid: int) -> None:
        handle = self.handles.pop(rid, None)
        if handle is not None:
            handle.abort()


def _engine_main(conn, llm_kwargs: dict[str, Any], limits: ServerLimits, release_when_idle: bool,
                 threads: int) -> None:
    """The engine process: load the model, say so, run the loop; its main thread reads the pipe."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s specdec-engine %(levelname)s %(name)s: %(message)s")
    try:
        import torch
        from tqdm import tqdm

        from specdec.llm import LLM

        # tqdm's default lock (loading bars) is a multiprocessing semaphore that is never released; the
        # resource tracker this process shares with the HTTP one would report it as leaked at exit
        tqdm.set_lock(threading.RLock())
        torch.set_num_threads(threads)
        llm = LLM(**llm_kwargs)
        loop = _PipedEngine(llm.engine, conn, limits, release_when_idle)
    except Exception as e:  # a bad path, a corrupt file: the HTTP process raises it as a ValueError
        if isinstance(e, ValueError):  # bad input (a head for another target, a missing file): its message says it
            log.error("the engine could not load the model: %s", e)
        else:
            log.exception("the engine could not load the model")
        conn.send(("failed", str(e) if isinstance(e, ValueError) else f"the model could not be loaded ({type(e).__name__})"))
        return
    conn.send(("ready", EngineInfo.of(llm), loop.budget))
    loop.start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the HTTP process went away
                break
            if msg[0] == "add":
                loop.add(*msg[1:])
            elif msg[0] == "abort":
                loop.abort_request(msg[1])
            elif msg[0] == "stop":
                break
            loop.drop_done()
    finally:
        loop.stop()

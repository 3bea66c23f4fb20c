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
releases the GIL while it compiles), so neither runs on the engine thread. If the engine process
dies, every request in flight fails with 503 and /health turns 503.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from typing import Any

from specdec.server.async_engine import (
    Admission, AsyncEngine, EngineInfo, Event, LoopHooks, Prompt, RequestError, RequestHandle, Snapshot)
from specdec.server.limits import ServerLimits

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading (or converting) a large model may take minutes


class EngineProcess(Admission):
    """The HTTP side of an engine process: the same surface as ``AsyncEngine`` (submit, abort, alive,
    snapshot, hooks). Constructing it starts the process and waits until the model is loaded; a model
    that cannot be loaded is a ValueError with the engine's message. The engine runs as many torch
    threads as this process has set (``specdec serve --threads``)."""

    def __init__(self, llm_kwargs: dict[str, Any], limits: ServerLimits | None = None, release_when_idle: bool = True):
        import torch

        limits = limits or ServerLimits()
        self.hooks = LoopHooks()
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch or OpenMP state forked
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, name="specdec-engine", daemon=True,
                                 args=(child, llm_kwargs, limits, release_when_idle, torch.get_num_threads()))
        self._proc.start()
        child.close()
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise ValueError(f"the engine process did not load the model within {START_TIMEOUT_S:.0f} s")
            msg = self._conn.recv()
        except (EOFError, OSError):
            msg = ("failed", "the engine process exited while loading the model (see the log above)")
        if msg[0] != "ready":
            self._proc.join(10)
            raise ValueError(msg[1])
        self.info: EngineInfo = msg[1]
        super().__init__(msg[2], limits)
        self._snapshot = Snapshot(kv_budget_bytes=self.budget.budget)
        self._handles: dict[int, list] = {}  # rid -> [handle, choices not finished]
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._running = True
        self.error: BaseException | None = None

    # -- asyncio side ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="specdec-engine-pipe", daemon=True)
            self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._running and self._proc.is_alive()

    def submit(self, prompts: list[Prompt | tuple], arrival: float | None = None) -> RequestHandle:
        """Queue one request in the engine process; see ``Admission.check``."""
        if not self.alive:
            raise RuntimeError("the engine process is not running")
        prompts = self.check(prompts)
        handle = RequestHandle(self, asyncio.get_running_loop(), sum(p.params.n for p in prompts))
        self._handles[handle.rid] = [handle, handle.num_choices]
        # matchers stay here (they do not pickle): the engine process compiles the request's grammar again
        sent = [Prompt(p.token_ids, p.params) for p in prompts]
        if not self._send(("add", handle.rid, sent, arrival or time.perf_counter())):
            self._handles.pop(handle.rid, None)
            self._left_queue()
            raise RuntimeError("the engine process is not running")
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.rid, None) is not None:
            self._send(("abort", handle.rid))

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def _send(self, msg: tuple) -> bool:
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):  # the engine process is gone, or the pipe closed
            return False

    # -- the thread reading the pipe ----------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "stopped":
                    break
                _, events, hooks, dequeued, self._snapshot = msg
                for _ in range(dequeued):
                    self._left_queue()
                for name, arg in hooks:
                    self._hook(name, arg)
                for rid, ev in events:
                    self._deliver(rid, ev)
        finally:
            self._running = False
            for handle, _ in list(self._handles.values()):
                handle._post(Event(0, "", [], error=RequestError(503, "the engine stopped")))
            self._handles.clear()

    def _deliver(self, rid: int, ev: Event) -> None:
        entry = self._handles.get(rid)
        if entry is None:  # aborted here meanwhile
            return
        handle = entry[0]
        if ev.finish_reason is not None:
            entry[1] -= 1
        if ev.error is not None or entry[1] == 0:
            self._handles.pop(rid, None)
        handle._post(ev)

    def _hook(self, name: str, arg: Any) -> None:
        try:
            getattr(self.hooks, name)(arg)
        except Exception:
            log.exception("a metrics hook failed")


# -- the engine process ---------------------------------------------------------------------------


class _RemoteHandle(RequestHandle):
    """A request in the engine process: its events go to the loop's outbox, sent once a pass."""

    def __init__(self, owner: _PipedEngine, rid: int, num_choices: int):
        super().__init__(owner, None, num_choices, rid)

    def _post(self, ev: Event) -> None:  # engine thread, as for AsyncEngine's handles
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
            # a finished request's handle is dropped when its last event has gone out
            for rid in [rid for rid, h in loop.handles.items() if h.state == "done"]:
                del loop.handles[rid]
    finally:
        loop.stop()

"""One engine loop for the server: a thread owns the ``Engine``; requests join between rounds.

The asyncio side never touches the engine, a ``Sequence`` or the tokenizer. It sends commands
(add, abort) through a thread-safe inbox. The engine thread, between two rounds:
  1. applies the commands: tokenizes and ``add_request``s new prompts, ``abort``s the sequences
     of requests whose client went away;
  2. runs one ``engine.step()`` over the batch (the engine admits waiting sequences up to
     ``max_num_seqs`` and retires finished and aborted ones);
  3. turns each sequence's new tokens into a text delta (``TextStreamer``) and posts it to the
     request's asyncio queue with ``loop.call_soon_threadsafe``.
When no sequence is left it releases the KV caches and blocks on the inbox.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.detokenizer import TextStreamer
from specdec.sequence import Sequence

log = logging.getLogger(__name__)

# Runs on the engine thread (it may use the tokenizer): returns the prompt's token ids and its params.
Job = Callable[[], tuple[list[int], SamplingParams]]


@dataclass
class Event:
    """What one round added to one choice of a request."""

    index: int  # choice index within the request
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: BaseException | None = None


class RequestHandle:
    """The asyncio side of one request: a queue of Events for its choices, and a way to abort them."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop, num_choices: int):
        self.owner, self.loop = owner, loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.num_choices = num_choices
        self.seqs: list[Sequence] = []  # set on the engine thread; read only there
        self.open = num_choices  # choices not finished yet (asyncio side)

    @property
    def finished(self) -> bool:
        return self.open == 0

    async def events(self) -> AsyncIterator[Event]:
        """Every event until all choices finished; an engine failure is raised here."""
        while self.open:
            ev = await self.queue.get()
            if ev.error is not None:
                self.open = 0
                raise ev.error
            if ev.finish_reason is not None:
                self.open -= 1
            yield ev

    def abort(self) -> None:
        """Drop the request's sequences (thread-safe); they leave the batch within one round."""
        if self.open:
            self.open = 0
            self.owner._inbox.put(("abort", self))

    def _post(self, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Track:
    """Engine-thread bookkeeping for one running sequence."""

    handle: RequestHandle
    index: int
    streamer: TextStreamer
    arrival: float  # perf_counter when the request arrived
    first_token: float | None = None


@dataclass
class LoopHooks:
    """Callbacks the engine thread fires (the Prometheus metrics hang on these)."""

    on_first_token: Callable[[float], None] = lambda ttft: None
    on_finish: Callable[[Sequence, float, float | None], None] = lambda seq, arrival, first: None
    on_error: Callable[[BaseException], None] = lambda e: None


class AsyncEngine:
    def __init__(self, engine: Engine, hooks: LoopHooks | None = None, release_when_idle: bool = True):
        self.engine = engine
        self.hooks = hooks or LoopHooks()
        self.release_when_idle = release_when_idle
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[int, _Track] = {}  # seq_id -> track (engine thread only)
        self._thread: threading.Thread | None = None
        self._busy = False
        self.error: BaseException | None = None  # set if the loop itself died

    # -- asyncio side ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, jobs: list[Job], arrival: float | None = None) -> RequestHandle:
        """Queue one request (one job per choice). Bad prompts raise the library's ValueError here."""
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        handle = RequestHandle(self, loop, len(jobs))
        added = loop.create_future()
        self._inbox.put(("add", (handle, jobs, arrival or time.perf_counter(), added)))
        try:
            await added
        except asyncio.CancelledError:
            handle.abort()
            raise
        return handle

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                if idle and self._busy:
                    self._busy = False
                    self._idle()
                for cmd, arg in self._commands(block=idle):
                    if cmd == "stop":
                        self._fail_all(RuntimeError("the server is shutting down"))
                        return
                    getattr(self, f"_{cmd}")(arg)
                if self.engine.has_unfinished():
                    self._busy = True
                    self._step()
        except BaseException as e:  # the loop must not die silently: fail everyone, /health turns 503
            log.exception("engine loop died")
            self.error = e
            self._fail_all(e)

    def _commands(self, block: bool) -> list[tuple[str, object]]:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, arg) -> None:
        handle, jobs, arrival, added = arg
        seqs = []
        try:
            for job in jobs:
                ids, params = job()
                seqs.append(self.engine.add_request(ids, params))
        except Exception as e:  # a bad prompt: refuse the whole request
            for s in seqs:
                self.engine.abort(s)
            _resolve(handle.loop, added, error=e)
            return
        handle.seqs = seqs
        for i, s in enumerate(seqs):
            self._tracks[s.seq_id] = _Track(handle, i, TextStreamer(self.engine.detokenizer, s), arrival)
        _resolve(handle.loop, added, result=None)

    def _abort(self, handle: RequestHandle) -> None:
        for s in handle.seqs:
            track = self._tracks.pop(s.seq_id, None)
            if track is not None and not s.finished:
                self.engine.abort(s)
                self.hooks.on_finish(s, track.arrival, track.first_token)

    def _step(self) -> None:
        try:
            gained = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self.hooks.on_error(e)
            self._fail_all(e)
            return
        for seq, tokens in gained:
            track = self._tracks.get(seq.seq_id)
            if track is None or not (tokens or seq.finished):
                continue
            delta = track.streamer.delta(tokens)
            if tokens and track.first_token is None:
                track.first_token = time.perf_counter()
                self.hooks.on_first_token(track.first_token - track.arrival)
            ev = Event(track.index, delta.text, list(tokens), delta.finish_reason)
            if seq.finished:
                del self._tracks[seq.seq_id]
                ev.prompt_tokens, ev.completion_tokens = seq.num_prompt_tokens, seq.num_output_tokens
                self.hooks.on_finish(seq, track.arrival, track.first_token)
            track.handle._post(ev)

    def _fail_all(self, error: BaseException) -> None:
        handles = {id(t.handle): t.handle for t in self._tracks.values()}
        for track in self._tracks.values():
            self.engine.abort(track.streamer.seq)
        self._tracks.clear()
        for h in handles.values():
            h._post(Event(0, "", [], error=error))

    def _idle(self) -> None:
        """No sequence left: give the KV caches' memory back (the engine keeps them at their peak size)."""
        if not self.release_when_idle:
            return
        self.engine.release_memory()  # and trims the heap (host_memory.py)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result=None, error: BaseException | None = None):
    def set_() -> None:
        if fut.done():  # the submitter was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(set_)
    except RuntimeError:
        pass

"""One engine loop for the server: a thread owns the ``Engine``; requests join between rounds.

The asyncio side tokenizes (off this thread, app.py) and hands over prompt token ids; it never
touches the engine or a ``Sequence``. Before a request is queued, ``Admission`` refuses one that
can never run (its KV cache alone exceeds the scheduler's ``KvBudget``: a 4xx) and one past
``max_queued_requests`` (``QueueFull``: a 429). Commands (add, abort) go through a thread-safe
inbox. The engine thread, between two rounds:
  1. applies the commands: new requests join the scheduler's queue (``Engine.add_group``), aborted
     ones leave it or the batch;
  2. runs one ``engine.step()``, whose scheduler admits queued requests in arrival order while the
     batch has seats, the round has prompt tokens left (``max_num_batched_tokens``) and their KV
     cache fits the memory budget (scheduler.py). If the step raises, it finds the request that made
     it fail and fails that request alone: first by checking each row's sampling parameters and
     prompt, then by re-running the step over halves of the batch (the others held aside) down to
     one request.
     A failed step changes nothing the retry depends on: KV past a sequence's ``num_computed`` is
     overwritten, drafters reconcile their own state, and seeded generators are restored;
  3. turns each sequence's new tokens into a text delta (``TextStreamer``) and posts it to the
     request's asyncio queue with ``loop.call_soon_threadsafe``.
Nothing raised inside the loop ends it: an unexpected error fails the requests in flight, is
counted (``LoopHooks.on_loop_error``) and the loop goes on. When no sequence is left it releases
the KV caches and blocks on the inbox.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.detokenizer import TextStreamer
from specdec.metrics import RequestSpecStats
from specdec.outputs import PositionLogprobs
from specdec.policy import is_seeded
from specdec.sampling import SamplingBatch, probs_from_logits
from specdec.sequence import Sequence
from specdec.scheduler import KvBudget
from specdec.server.limits import ServerLimits, available_memory

log = logging.getLogger(__name__)


class Prompt(NamedTuple):
    """One prompt of a request: its token ids (checked against the context), its parameters (``n``
    choices, each a sequence), and one grammar matcher per choice when the output is constrained
    (compiled off this thread, app.py)."""

    token_ids: list[int]
    params: SamplingParams
    grammars: list[Any] | None = None


@dataclass
class EngineInfo:
    """What the HTTP side needs of the model the engine runs (an engine process sends it once, loaded)."""

    model: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # None for a model folder without one
    eos_token_ids: set[int]

    @classmethod
    def of(cls, llm) -> EngineInfo:
        target = llm.engine.target
        return cls(llm.model_config.model, target.max_model_len, target.vocab_size, llm.tokenizer,
                   set(llm.engine.detokenizer.eos_token_ids))


class QueueFull(Exception):
    """The request queue is at ``max_queued_requests``: answer 429 and let the client retry."""


class RequestError(Exception):
    """One request failed; ``message`` is safe to show its client (no paths, no exception text)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def __reduce__(self):  # crosses the engine process's pipe (engine_process.py)
        return RequestError, (self.status, self.message)


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
    logprobs: list[PositionLogprobs] | None = None  # one per token of token_ids, when the params ask for them
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on a choice's first event, when asked for
    spec_stats: RequestSpecStats | None = None  # on a choice's last event: its speculative counters


_request_ids = itertools.count()


class RequestHandle:
    """The asyncio side of one request: a queue of Events for its choices, and a way to abort them.
    ``owner`` is the engine loop (``AsyncEngine``, or ``EngineProcess`` whose loop runs in another process)."""

    def __init__(self, owner, loop: asyncio.AbstractEventLoop | None, num_choices: int, rid: int | None = None):
        self.owner, self.loop = owner, loop
        self.rid = next(_request_ids) if rid is None else rid
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.num_choices = num_choices
        self.open = num_choices  # choices not finished yet (asyncio side)
        # engine thread only
        self.seqs: list[Sequence] = []
        self.state = "queued"  # -> "running" -> "done"

    @property
    def finished(self) -> bool:
        return self.open == 0

    async def events(self) -> AsyncIterator[Event]:
        """Every event until all choices finished; a failure is raised here."""
        while self.open:
            ev = await self.queue.get()
            if ev.error is not None:
                self.open = 0
                raise ev.error
            if ev.finish_reason is not None:
                self.open -= 1
            yield ev

    def abort(self) -> None:
        """Drop the request (thread-safe): it leaves the queue, or the batch within one round."""
        if self.open:
            self.open = 0
            self.owner.abort(self)

    def post(self, ev: Event) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Queued:
    handle: RequestHandle
    prompts: list[Prompt]
    arrival: float


@dataclass
class _Track:
    """Engine-thread bookkeeping for one running sequence."""

    handle: RequestHandle
    index: int
    seq: Sequence
    streamer: TextStreamer
    arrival: float  # perf_counter when the request arrived
    first_token: float | None = None
    posted: int = 0  # output tokens already posted


class Finished(NamedTuple):
    """A sequence that left the engine, for the metrics (times are ``time.perf_counter()``, which is
    system-wide monotonic, so they compare across the engine process and the HTTP one)."""

    finish_reason: str  # "abort" when the client went away
    prompt_tokens: int
    output_tokens: int
    arrival: float
    first_token: float | None
    end: float

    @classmethod
    def of(cls, seq: Sequence, track: _Track) -> Finished:
        return cls(seq.finish_reason or "abort", seq.num_prompt_tokens, seq.num_output_tokens, track.arrival,
                   track.first_token, time.perf_counter())


@dataclass
class Snapshot:
    """What /metrics reads of the engine: its speculative counters (``engine.stats``), the batch and
    the queue, and the KV budget."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_rounds_per_method: dict[str, int] = field(default_factory=dict)  # "none": rows without drafts
    num_draft_tokens_per_method: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens_per_method: dict[str, int] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    kv_budget_bytes: int = 0
    kv_reserved_bytes: int = 0


@dataclass
class LoopHooks:
    """Callbacks the engine thread fires (the Prometheus metrics hang on these)."""

    on_first_token: Callable[[float], None] = lambda ttft: None
    on_finish: Callable[[Finished], None] = lambda finished: None
    on_error: Callable[[BaseException], None] = lambda e: None  # an engine step raised
    on_loop_error: Callable[[BaseException], None] = lambda e: None  # anything else in the loop raised


@dataclass
class _Attempt:
    """What a step may change that a retry must undo: seeded generators' states, by seq_id, taken
    before the step (a sequence whose tokens grew kept its draws; the others get theirs back)."""

    lengths: dict[int, int] = field(default_factory=dict)
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, seqs: list[Sequence]) -> _Attempt:
        a = cls()
        for s in seqs:
            a.lengths[s.seq_id] = len(s.token_ids)
            if is_seeded(s.params):  # only seeded outputs must repeat exactly (policy.py)
                a.states[s.seq_id] = s.generator.get_state()
        return a

    def rewind(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            state = self.states.get(s.seq_id)
            if state is not None and len(s.token_ids) == self.lengths[s.seq_id]:
                s.generator.set_state(state)


class Admission:
    """What the HTTP side checks before a request joins the scheduler's queue, shared by the engine loop
    in a thread (``AsyncEngine``) and in a process (``EngineProcess``): the request's worst-case KV
    cache against the scheduler's budget (``KvBudget.check``; the engine process sends a copy), and
    the queue's bound."""

    def __init__(self, budget: KvBudget, limits: ServerLimits):
        self.budget, self.limits = budget, limits
        self._num_queued = 0  # requests submitted, not yet admitted or dropped (guarded by _lock)
        self._lock = threading.Lock()

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def check(self, prompts: list[Prompt | tuple]) -> list[Prompt]:
        """The prompts; ValueError for a request the server can never run (its KV cache alone exceeds the
        budget), QueueFull when the queue is full (then the caller owns one queue slot)."""
        prompts = [Prompt(*p) for p in prompts]
        self.budget.check([self.budget.positions(len(p.token_ids), p.params.max_tokens)
                           for p in prompts for _ in range(p.params.n)])
        with self._lock:
            if self._num_queued >= self.limits.max_queued_requests:
                raise QueueFull(f"{self._num_queued} requests are waiting")
            self._num_queued += 1
        return prompts

    def _joined_queue(self) -> None:  # a request checked elsewhere (the engine process's HTTP side)
        with self._lock:
            self._num_queued += 1

    def _left_queue(self) -> None:
        with self._lock:
            self._num_queued -= 1


class AsyncEngine(Admission):
    def __init__(self, engine: Engine, hooks: LoopHooks | None = None, release_when_idle: bool = True,
                 limits: ServerLimits | None = None):
        self.engine = engine
        self.hooks = hooks or LoopHooks()
        self.release_when_idle = release_when_idle
        limits = limits or ServerLimits()
        memory = limits.kv_cache_memory
        if memory is None:
            memory = int(limits.kv_cache_memory_fraction * available_memory(engine.target.device))
        super().__init__(engine.limit_admission(memory, limits.max_num_batched_tokens), limits)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queue: deque[_Queued] = deque()  # requests in the scheduler's queue, in order (engine thread only)
        self._tracks: dict[int, _Track] = {}  # seq_id -> track, queued or running (engine thread only)
        self._thread: threading.Thread | None = None
        self._busy = False
        self._stalled = False  # the last step ran nothing although requests wait
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

    @property
    def state(self) -> str:
        """"serving", or "stopped" (a loop in a thread is not restarted; ``EngineProcess`` restarts its process)."""
        return "serving" if self.alive else "stopped"

    def submit(self, prompts: list[Prompt | tuple], arrival: float | None = None) -> RequestHandle:
        """Queue one request (its choices: ``n`` per prompt, each a sequence); see ``Admission.check``."""
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        prompts = self.check(prompts)
        handle = RequestHandle(self, asyncio.get_running_loop(), sum(p.params.n for p in prompts))
        self.enqueue(handle, prompts, arrival)
        return handle

    def enqueue(self, handle: RequestHandle, prompts: list[Prompt], arrival: float | None = None) -> None:
        """Hand a checked request (it holds a queue slot) to the engine thread (thread-safe)."""
        self._inbox.put(("add", _Queued(handle, prompts, arrival or time.perf_counter())))

    def abort(self, handle: RequestHandle) -> None:
        """Drop a request (thread-safe): it leaves the queue, or the batch within one round."""
        self._inbox.put(("abort", handle))

    def snapshot(self) -> Snapshot:
        s, e = self.engine.stats, self.engine
        return Snapshot(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_emitted_tokens,
                        list(s.num_accepted_tokens_per_pos), dict(s.num_rounds_per_method),
                        dict(s.num_draft_tokens_per_method), dict(s.num_accepted_tokens_per_method),
                        len(e.running), self.num_queued, self.budget.budget, self.budget.reserved)

    # -- engine thread: the loop ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                try:
                    if self._iterate():
                        return
                except Exception as e:  # a bug in this loop: fail what is in flight, keep serving
                    log.exception("engine loop error; failing the requests in flight")
                    self._hook(self.hooks.on_loop_error, e)
                    self._fail_all(RequestError(500, "the engine failed while running this request"),
                                   include_queue=False)
                    time.sleep(0.01)  # a fault that repeats must not spin the CPU
        except BaseException as e:  # SystemExit, KeyboardInterrupt: the loop ends, /health turns 503
            log.exception("engine loop died")
            self.error = e
            self._fail_all(RequestError(503, "the server is shutting down"), include_queue=True)

    def _iterate(self) -> bool:
        """One pass: commands, then one step (which admits). Returns True when told to stop."""
        idle = not self.engine.has_unfinished()
        if idle and self._busy:
            self._busy = False
            self._idle()
        # nothing ran and the queue's head could not be admitted (never expected): wait, do not spin
        stalled = self._stalled and not idle
        for cmd, arg in self._commands(block=idle, timeout=0.05 if stalled else None):
            if cmd == "stop":
                self._fail_all(RequestError(503, "the server is shutting down"), include_queue=True)
                return True
            getattr(self, f"_{cmd}")(arg)
        self._stalled = False
        if self.engine.has_unfinished():
            self._busy = True
            self._step()
        return False

    def _commands(self, block: bool, timeout: float | None = None) -> list[tuple[str, object]]:
        cmds = []
        if block or timeout is not None:
            try:
                cmds.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                pass
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, q: _Queued) -> None:
        """A request joins the scheduler's queue; its choices are admitted together."""
        handle = q.handle
        try:  # choice i of a request is handle.seqs[i]: prompt-major, n per prompt
            handle.seqs = self.engine.add_group(q.prompts)
        except Exception as e:  # the asyncio side checked the prompts; this is a last line of defence
            log.warning("add_request refused a prompt: %s", e)
            handle.state = "done"
            self._left_queue()
            handle.post(Event(0, "", [], error=RequestError(400, str(e)[:500]) if isinstance(e, ValueError)
                               else RequestError(500, "the engine could not take this request")))
            return
        for i, s in enumerate(handle.seqs):
            self._tracks[s.seq_id] = _Track(handle, i, s, TextStreamer(self.engine.detokenizer, s), q.arrival)
        self._queue.append(q)

    def _abort(self, handle: RequestHandle) -> None:
        queued = handle.state == "queued"
        for s in handle.seqs:
            track = self._tracks.pop(s.seq_id, None)
            if not s.finished:
                self.engine.abort(s)  # a queued one is skipped at admission, a running one retires
                if track is not None and not queued:
                    self._hook(self.hooks.on_finish, Finished.of(s, track))
        handle.state = "done"
        if queued:
            self._admitted()  # it leaves the queue's count once it reaches the head: no O(n) removal

    def _admitted(self) -> None:
        """Requests at the head of the queue that the scheduler admitted (or that were dropped) leave it."""
        running = None
        while self._queue:
            handle = self._queue[0].handle
            if handle.state == "queued":
                running = running or {s.seq_id for s in self.engine.running}
                seq = handle.seqs[0]
                if seq.seq_id not in running and not seq.finished:
                    return  # still waiting, and so is everyone behind it
                handle.state = "running"
            self._queue.popleft()
            self._left_queue()

    def _idle(self) -> None:
        """No sequence left: give the KV caches' memory back (the engine keeps them at their peak size)."""
        if self.release_when_idle:
            self.engine.release_memory()  # and trims the heap (host_memory.py); the budget counts nothing

    # -- engine thread: a step and its failures -----------------------------------------------------

    def _step(self) -> None:
        # the step's rows: those running and those it may admit
        seqs = [s for s in self.engine.running if not s.finished] + self.engine.next_in_line()
        attempt = _Attempt.of(seqs)
        try:
            self._stalled = not self.engine.step() and self.engine.has_unfinished()
        except Exception as e:
            log.exception("engine step failed; looking for the request that caused it")
            self._hook(self.hooks.on_error, e)
            attempt.rewind(seqs)
            self._isolate([s for s in seqs if not s.finished])
        self._admitted()
        self._publish()

    def _isolate(self, suspects: list[Sequence]) -> None:
        """Fail the requests whose rows make a step fail; step the others once."""
        faulty = {}
        for s in suspects:
            reason = self._row_fault(s)
            track = self._tracks.get(s.seq_id)
            if reason is not None and track is not None:
                faulty[s.seq_id] = reason
                self._fail(track.handle, RequestError(400, reason))
        rest = [s for s in suspects if not s.finished]
        if rest:
            self._bisect(rest, retry_whole=bool(faulty))

    def _bisect(self, group: list[Sequence], retry_whole: bool) -> None:
        if retry_whole and self._try_step(group):
            return
        if len(group) == 1:
            track = self._tracks.get(group[0].seq_id)
            if track is not None:
                log.error("request %s fails every step it is in; failing it alone", group[0].seq_id)
                self._fail(track.handle, RequestError(500, "the engine failed while running this request"))
            return
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            part = [s for s in part if not s.finished]  # a sibling choice may have failed its request
            if part:
                self._bisect(part, retry_whole=True)

    def _try_step(self, group: list[Sequence]) -> bool:
        """One step of ``group`` alone (``Engine.isolated``: the others are held aside and recompute
        their history in their next step)."""
        attempt = _Attempt.of(group)
        with self.engine.isolated(group):
            try:
                self.engine.step()
                return True
            except Exception as e:
                log.warning("a step over %d of the sequences failed too", len(group), exc_info=True)
                self._hook(self.hooks.on_error, e)
                attempt.rewind(group)
                return False

    def _row_fault(self, seq: Sequence) -> str | None:
        """Why this sequence alone would break a step, if a per-row check can tell."""
        p = seq.params
        try:
            replace(p)  # validates (and sanitizes) again: catches values changed after construction
        except (ValueError, TypeError) as e:
            return f"invalid sampling parameters: {str(e)[:300]}"
        vocab = self.engine.target.vocab_size
        if any(not (0 <= t < vocab) for t in seq.token_ids):
            return "the sequence holds token ids outside the vocabulary"
        if p.greedy:
            return None
        try:
            sb = SamplingBatch.from_params([p], self.engine.target.device)
            probs = probs_from_logits(torch.zeros(1, vocab, device=sb.device), sb)  # [1, V]
            ok = bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0
        except Exception:
            ok = False
        return None if ok else "these sampling parameters give no valid distribution to sample from"

    # -- engine thread: results ---------------------------------------------------------------------

    def _publish(self) -> None:
        """Post each sequence's new tokens (counted from what was posted, so a step that failed half
        way loses nothing) and its text delta; a request whose results cannot be made fails alone."""
        for track in list(self._tracks.values()):
            seq = track.seq
            n = seq.num_output_tokens
            if n == track.posted and not seq.finished:
                continue
            try:
                start = track.posted
                tokens = seq.token_ids[seq.num_prompt_tokens + start:]
                track.posted = n
                delta = track.streamer.delta(tokens)
                ev = Event(track.index, delta.text, tokens, delta.finish_reason)
                if seq.params.logprobs is not None:
                    ev.logprobs = seq.logprobs[start:n]
                if tokens and track.first_token is None:
                    track.first_token = time.perf_counter()
                    self._hook(self.hooks.on_first_token, track.first_token - track.arrival)
                    if seq.params.prompt_logprobs is not None:
                        ev.prompt_logprobs = seq.prompt_logprobs
                if seq.finished:
                    del self._tracks[seq.seq_id]
                    ev.prompt_tokens, ev.completion_tokens = seq.num_prompt_tokens, seq.num_output_tokens
                    ev.spec_stats = seq.stats  # final: a finished sequence runs no more rounds
                    self._hook(self.hooks.on_finish, Finished.of(seq, track))
                    if all(s.finished for s in track.handle.seqs):
                        track.handle.state = "done"  # the engine process drops a done handle (and its seqs)
                track.handle.post(ev)
            except Exception as e:
                log.exception("turning sequence %s's tokens into text failed; failing its request", seq.seq_id)
                self._hook(self.hooks.on_loop_error, e)
                self._fail(track.handle, RequestError(500, "the server failed to detokenize this request's output"))

    def _fail(self, handle: RequestHandle, error: RequestError) -> None:
        """Fail one request: abort its sequences and raise ``error`` in its handler."""
        if handle.state == "done":
            return
        for s in handle.seqs:
            self._tracks.pop(s.seq_id, None)
            if not s.finished:
                self.engine.abort(s)
        handle.state = "done"
        handle.post(Event(0, "", [], error=error))

    def _fail_all(self, error: RequestError, include_queue: bool) -> None:
        handles = [t.handle for t in self._tracks.values() if include_queue or t.handle.state != "queued"]
        for h in {id(h): h for h in handles}.values():
            try:
                self._fail(h, error)
            except Exception:
                log.exception("failing a request failed")
        self._admitted()  # the failed ones leave the queue

    def _hook(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("a metrics hook failed")

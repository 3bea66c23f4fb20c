"""The OpenAI-compatible HTTP app: routes over one engine loop (``AsyncEngine``, or ``EngineProcess``).

    app = build_app(LLM("path/to/target", speculative_config={...}), api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every error is ``{"error": {"message", "type", "param", "code"}}`` with status 400 (bad request:
malformed JSON, a missing or mistyped field, a value out of range, an unsupported option, a prompt
too long for the context or the KV budget), 401 (missing or wrong API key), 403/400 (a Host or
Origin this server does not serve), 404 (unknown model or route), 408 (a body that came too
slowly), 413 (a body too large), 429 (the queue is full; ``Retry-After`` says when to retry), 500
(the engine failed on this request: the message carries a request id, the log the details) or 503
``engine_unavailable`` (the engine process died under the request, or is restarting: ``Retry-After``;
or could not be restarted, engine_process.py).
Messages never carry local paths, exception text or a long input back; the server keeps serving.

A request is checked cheaply first (body bytes, prompt count, prompt characters), then tokenized
and templated in a small thread pool, never on the engine thread or the event loop; its grammar
(structured output) compiles in a pool of its own, so a slow one holds up neither.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdec.config import SamplingParams, short_repr
from specdec.host_memory import trim_heap
from specdec.llm import LLM
from specdec.server import protocol as P
from specdec.grammar import GrammarCompiler
from specdec.logprobs import TokenText
from specdec.metrics import RequestSpecStats
from specdec.server.async_engine import AsyncEngine, EngineInfo, LoopHooks, Prompt, QueueFull, RequestError
from specdec.server.engine_process import EngineProcess
from specdec.server.chat import render_chat
from specdec.server.guard import Guard
from specdec.server.limits import ServerLimits
from specdec.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

_PARAM_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop_token_ids", "stop", "prompt",
                "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                "bad_words", "allowed_token_ids", "logprobs", "prompt_logprobs")
TOKENIZER_THREADS = 2  # tokenizing and chat templating run here, a few requests at a time
GRAMMAR_THREADS = 1  # structured output compiles here: a slow grammar delays other grammars, not plain requests
RETRY_AFTER_S = 1
LARGE_BODY_BYTES = 256 * 1024  # after such bodies the heap is trimmed (at most once a second)


class OpenAIServer:
    """What the routes share: the engine loop (in a thread, or in a process of its own), what the HTTP
    side knows of its model (``EngineInfo``), metrics and settings."""

    def __init__(self, engine: AsyncEngine | EngineProcess, info: EngineInfo, served_model_name: str | None = None,
                 api_key: str | None = None, limits: ServerLimits | None = None):
        self.engine, self.info = engine, info
        self.tokenizer = info.tokenizer
        self.model_name = served_model_name or info.model
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        self.metrics = ServerMetrics(self.engine)
        self.engine.hooks = LoopHooks(self.metrics.on_first_token, self.metrics.on_finish, self.metrics.on_error,
                                      self.metrics.on_loop_error)
        self._grammar_compiler = None
        self._token_text = TokenText(self.tokenizer)
        # A prompt of more characters than the context times the longest token's bytes cannot fit:
        # refuse it before tokenizing it.
        self.max_prompt_chars = self.max_model_len * _longest_token_bytes(self.tokenizer)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="specdec-tokenize")
        self.grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="specdec-grammar")
        self.created = P.now()
        self._large_at, self._trim_pending = 0.0, False

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The HTTP side's compiler (an engine in a thread gets the matchers it makes; one in a process
        compiles again from the request's parameters, after this one has checked them)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this model folder has none")
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.info.eos_token_ids)
        return self._grammar_compiler

    def trim_soon(self) -> None:
        """Give the heap's free pages back once large bodies stop coming for a second (at most one trim
        a second): parsed bodies of many small pieces leave the heap fragmented."""
        self._large_at = time.monotonic()
        if not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(1.0, self._trim)

    def _trim(self) -> None:
        wait = self._large_at + 1.0 - time.monotonic()
        if wait > 0:  # another large body came in meanwhile
            asyncio.get_running_loop().call_later(wait, self._trim)
            return
        self._trim_pending = False
        try:
            self.pool.submit(trim_heap)
        except RuntimeError:  # the server is shutting down
            pass

    # -- checks ---------------------------------------------------------------------------------

    async def check_api_key(self, request: Request) -> None:  # async: FastAPI runs a sync one in a thread pool
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.ApiError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.ApiError(404, f"the model {short_repr(model)} does not exist; this server serves "
                             f"{self.model_name!r}", "model", "model_not_found")

    # -- requests to choices ------------------------------------------------------------------------

    async def prepare(self, body: P._SamplingFields, prompts: list[P.Prompt] | list[list[P.ChatMessage]],
                      max_tokens: int | None) -> list[Prompt]:
        """The request's prompts with their parameters (``n`` choices each): the parameters checked, the
        prompts tokenized and the grammar compiled in the pool, never on the engine thread or the event loop."""
        # without max_tokens, each prompt may run to the end of the context (encode sets that)
        params = body.sampling_params(self.max_model_len if max_tokens is None else max_tokens)
        self._check_params(params)
        encoded = await self.encode(prompts, params, max_tokens)
        if params.structured_outputs is None:
            return [Prompt(ids, p) for ids, p in encoded]
        n = params.n
        matchers = await asyncio.get_running_loop().run_in_executor(
            self.grammar_pool, self._compile, params.structured_outputs, len(encoded) * n, body.constraint_field)
        return [Prompt(ids, p, matchers[i * n:(i + 1) * n]) for i, (ids, p) in enumerate(encoded)]

    def _check_params(self, params: SamplingParams) -> None:
        if params.n > self.limits.max_n:
            raise P.ApiError(400, f"n={params.n} is more choices than this server gives per prompt "
                             f"({self.limits.max_n}); send the request several times instead", "n")
        for name, limit in (("stop", self.limits.max_stop_strings), ("stop_token_ids", self.limits.max_stop_token_ids)):
            if len(getattr(params, name)) > limit:
                raise P.ApiError(400, f"{name} has {len(getattr(params, name))} entries; this server takes at most "
                                 f"{limit}", name)
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            if any(t >= self.vocab_size for t in ids):
                raise P.ApiError(400, f"{name} has token ids outside the vocabulary 0..{self.vocab_size - 1}", name)

    def _compile(self, so, count: int, field: str) -> list:  # in the grammar pool
        """One grammar matcher per choice (the compiler caches the compiled grammar), each with its first
        mask computed here: the grammar engine builds its lexer lazily, and a pathological regex can take
        seconds there, which must not happen on the engine thread. A grammar the engine refuses is a 400
        naming the field; its exception text goes to the log only."""
        compiler = self.grammar_compiler  # ValueError (400) when the model has no tokenizer
        try:
            return compiler.ready_matchers(so, count)
        except ValueError as e:
            log.info("%s could not be compiled: %s", field, e)
            raise P.ApiError(400, f"{field} could not be compiled into a grammar: check that the {so.kind} "
                             "is valid and uses only supported features", field) from None

    def token_text(self, token_id: int, as_id: bool) -> str:
        """How logprobs name a token: its text, or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids)."""
        text = None if as_id else self._token_text(token_id)  # decoded once per id (logprobs.py)
        return f"token_id:{token_id}" if text is None else text

    async def encode(self, prompts: list[P.Prompt] | list[list[P.ChatMessage]], params: SamplingParams,
                     max_tokens: int | None) -> list[tuple[list[int], SamplingParams]]:
        """Token ids and params per prompt: cheap checks here, tokenizing in the pool, context checks after.
        (How many prompts a request may hold is checked before its prompts are even read:
        ``CompletionRequest.prompts``; a chat request has one.)"""
        for prompt in prompts:
            if isinstance(prompt, str):
                chars = len(prompt)
            elif prompt and isinstance(prompt[0], P.ChatMessage):
                chars = sum(len(m.text()) for m in prompt)  # refuses non-text parts
            else:
                chars = 0
                self._check_length(len(prompt))
            if chars > self.max_prompt_chars:
                raise P.ApiError(400, f"prompt has {chars} characters: more than this model's context of "
                                 f"{self.max_model_len} tokens can hold", "prompt", "context_length_exceeded")
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self.pool, self._tokenize_all, prompts)
        out = []
        top_k = 0 if params.top_k >= self.vocab_size else params.top_k  # top_k >= V keeps every token
        for p in ids:
            self._check_length(len(p))
            if p and not (0 <= min(p) and max(p) < self.vocab_size):
                raise P.ApiError(400, f"prompt token ids must be in 0..{self.vocab_size - 1}", "prompt")
            room = self.max_model_len - len(p)
            out.append((p, replace(params, top_k=top_k, max_tokens=room if max_tokens is None else params.max_tokens)))
        return out

    def _check_length(self, n: int) -> None:
        if n == 0:
            raise P.ApiError(400, "prompt is empty; pass at least one token", "prompt")
        if n >= self.max_model_len:
            raise P.ApiError(400, f"prompt has {n} tokens but the model's context is {self.max_model_len} (prompt + "
                             "at least one new token); shorten the prompt", "prompt", "context_length_exceeded")

    def _tokenize_all(self, prompts: list) -> list[list[int]]:  # in the pool
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise P.ApiError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                                     "prompt")
                out.append(self.tokenizer.encode(prompt))
            elif prompt and isinstance(prompt[0], P.ChatMessage):
                out.append(render_chat(self.tokenizer, prompt))
            else:
                out.append(list(prompt))
        return out


def build_app(llm: LLM | None = None, *, served_model_name: str | None = None, api_key: str | None = None,
              release_when_idle: bool = True, limits: ServerLimits | None = None, engine_process: bool = False,
              **llm_kwargs: Any) -> FastAPI:
    """The FastAPI app over ``llm`` (or over ``LLM(**llm_kwargs)``). The engine loop runs while the app's
    lifespan does: start the app under uvicorn (``specdec.server.serve`` or ``ServerThread``), which
    also applies the connection timeouts of ``limits``. ``engine_process=True`` (with ``llm_kwargs``)
    loads the model and runs the loop in a process of its own (``engine_process.py``, what
    ``specdec serve`` does), so the HTTP side's Python work never holds up a round."""
    limits = limits or ServerLimits()
    if engine_process:
        if llm is not None:
            raise ValueError("engine_process=True loads the model in the engine's own process: pass LLM "
                             "arguments (model=..., ...), not an LLM")
        loop = EngineProcess(llm_kwargs, limits, release_when_idle)
        info = loop.info
    else:
        if llm is None:
            llm = LLM(**llm_kwargs)
        elif llm_kwargs:
            raise ValueError(f"pass an LLM or LLM arguments, not both (got {sorted(llm_kwargs)})")
        loop, info = AsyncEngine(llm.engine, release_when_idle=release_when_idle, limits=limits), EngineInfo.of(llm)
    server = OpenAIServer(loop, info, served_model_name, api_key, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            server.engine.stop()
            server.pool.shutdown(wait=False, cancel_futures=True)
            server.grammar_pool.shutdown(wait=False, cancel_futures=True)

    docs = server.limits.enable_docs
    app = FastAPI(title="specdec", summary="OpenAI-compatible server with speculative decoding", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.server = server
    app.add_middleware(Guard, limits=server.limits, on_reject=lambda status: server.metrics.errors.labels(
        str(status)).inc())
    _install_error_handlers(app, server)
    auth = [Depends(server.check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.alive:
            raise _unavailable(server)
        return Response(status_code=200)

    @app.get("/metrics", dependencies=[] if server.limits.metrics_public else auth)
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "specdec",
            "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        body = await _parse(request, P.CompletionRequest)
        server.check_model(body.model)
        body.check_supported()
        prompts = body.prompts(server.limits.max_prompts_per_request)
        choices = await server.prepare(body, prompts, body.max_tokens)
        echo = None
        if body.echo:  # each choice starts with its prompt's text
            echo = [p if isinstance(p, str) else await _decode(server, p) for p in prompts]
        return await _generate(server, _Reply("completion", body, body.num_generated, echo), choices, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, P.ChatCompletionRequest)
        server.check_model(body.model)
        body.check_supported()
        choices = await server.prepare(body, [body.messages], body.max_new_tokens)
        return await _generate(server, _Reply("chat", body, body.num_generated), choices, request)

    return app


# -- generation -------------------------------------------------------------------------------------


@dataclass
class _Reply:
    """What shapes a request's answer besides its tokens."""

    kind: P.Kind
    body: P._SamplingFields
    n: int  # sequences per prompt: sequence i answers prompt i // n (the best body.num_choices are kept)
    echo: list[str] | None = None  # per prompt: text each of its choices starts with (completions' echo)

    @property
    def top(self) -> int | None:
        return self.body.output_logprobs


class _Choice:
    """One choice's text, tokens and logprobs as they arrive, and the JSON they make."""

    def __init__(self, server: OpenAIServer, reply: _Reply, index: int, prompt_ids: list[int]):
        self.server, self.reply, self.index, self.prompt_ids = server, reply, index, prompt_ids
        self.text, self.token_ids, self.logprobs, self.reason = "", [], [], None
        self.prompt_logprobs = None
        self.offset = 0  # text offset of the next token (completions' logprobs)

    def token_text(self, t: int) -> str:
        return self.server.token_text(t, self.reply.body.return_tokens_as_token_ids)

    def add(self, ev) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        if ev.logprobs is not None:
            self.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finish_reason is not None:
            self.reason = ev.finish_reason

    def logprobs_json(self, token_ids: list[int], positions: list) -> dict | None:
        top = self.reply.top
        if top is None:
            return None
        if self.reply.kind == "chat":
            return P.chat_logprobs(token_ids, positions, top, self.token_text)
        out = P.completion_logprobs(token_ids, positions, top, self.token_text, self.offset)
        if out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def echo_text(self) -> str:
        return "" if self.reply.echo is None else self.reply.echo[self.index // self.reply.n]

    def echo_logprobs(self) -> dict | None:
        """Logprobs of the echoed prompt: its first token has none (null), the rest the prompt's."""
        if self.reply.top is None:
            return None
        return self.logprobs_json(self.prompt_ids, self.prompt_logprobs or [None] * len(self.prompt_ids))

    def prompt_logprobs_json(self) -> list | None:
        if self.reply.body.prompt_logprobs is None or self.prompt_logprobs is None:
            return None
        return P.prompt_logprobs_json(self.prompt_logprobs)


async def _generate(server: OpenAIServer, reply: _Reply, prompts: list[Prompt], request: Request) -> Response:
    arrival = time.perf_counter()
    try:
        handle = server.engine.submit(prompts, arrival)
    except QueueFull:
        raise P.ApiError(429, "the server is busy; retry later", code="rate_limit_exceeded", type="server_error",
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except RuntimeError:
        raise _unavailable(server) from None
    rid = P.new_id("cmpl" if reply.kind == "completion" else "chatcmpl")
    choices = [_Choice(server, reply, i, prompts[i // reply.n].token_ids) for i in range(handle.num_choices)]
    if reply.body.stream:
        return StreamingResponse(_stream(server, reply, choices, handle, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    use = _Usage(reply)

    async def consume() -> None:
        async for ev in handle.events():
            choices[ev.index].add(ev)
            use.add(ev)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():  # the client went away: nobody will read the answer
            handle.abort()
            consumer.cancel()
            return Response(status_code=499)
        if consumer.exception() is not None:
            raise _request_failed(consumer.exception(), rid)
    finally:
        watcher.cancel()
        if not handle.finished:
            handle.abort()
    out = []
    for i, c in enumerate(_best(choices, reply.n, reply.body.num_choices)):
        logprobs = c.echo_logprobs() if reply.echo is not None else None
        if reply.top is not None:
            logprobs = _joined(logprobs, c.logprobs_json(c.token_ids, c.logprobs))
        out.append(P.choice(reply.kind, i, c.echo_text() + c.text, c.reason,
                            c.token_ids if reply.body.return_token_ids else None, logprobs,
                            c.prompt_logprobs_json() if reply.kind == "completion" else None))
    body = P.response(reply.kind, rid, P.now(), server.model_name, out, use.json())
    if reply.kind == "chat" and reply.body.prompt_logprobs is not None:
        body["prompt_logprobs"] = choices[0].prompt_logprobs_json()  # vLLM: one list for the response
    return JSONResponse(body)


def _best(choices: list[_Choice], n: int, keep: int) -> list[_Choice]:
    """best_of: per prompt, the ``keep`` of its ``n`` choices whose tokens have the highest summed
    logprob (vLLM's ranking by cumulative logprob), most likely first."""
    if keep == n:
        return choices
    out = []
    for start in range(0, len(choices), n):
        group = choices[start:start + n]
        out += sorted(group, key=lambda c: -sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)))[:keep]
    return out


def _joined(first: dict | None, second: dict) -> dict:
    """Two runs of completions' logprobs (the echoed prompt's, the output's) as one."""
    return second if first is None else {key: first[key] + second[key] for key in first}


class _Usage:
    """Usage, added up as the choices finish: a prompt counts once however many choices it has (OpenAI's
    and vLLM's rule); with ``return_spec_metrics``, every choice's speculative counters, summed."""

    def __init__(self, reply: _Reply):
        self.n = reply.n
        self.prompt_tokens = self.completion_tokens = 0
        self.spec = RequestSpecStats() if reply.body.return_spec_metrics else None

    def add(self, ev) -> None:
        if ev.finish_reason is None:
            return
        self.prompt_tokens += ev.prompt_tokens if ev.index % self.n == 0 else 0
        self.completion_tokens += ev.completion_tokens
        if self.spec is not None and ev.spec_stats is not None:
            self.spec.merge(ev.spec_stats)

    def json(self) -> dict:
        return P.usage(self.prompt_tokens, self.completion_tokens, self.spec)


_UNAVAILABLE = {  # engine state -> what /health and a refused request say (503)
    "restarting": "the engine stopped and is restarting; retry in a few seconds",
    "failed": "the engine stopped and could not be restarted; the server's log says why",
}


def _unavailable(server: OpenAIServer) -> P.ApiError:
    """503 while no engine serves: restarting (retry soon), failed for good, or stopped."""
    state = server.engine.state
    message = _UNAVAILABLE.get(state, "the engine loop is not running")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if state == "restarting" else None
    return P.ApiError(503, message, code="engine_unavailable", type="server_error", headers=headers)


def _request_failed(e: BaseException, rid: str) -> P.ApiError:
    """What the client learns of a failure: the engine's safe message, or only a request id. A 503 (the
    engine died under it) says when to retry."""
    if isinstance(e, RequestError):
        message = e.message if e.status < 500 else f"{e.message} (request id {rid})"
        gone = e.status == 503
        return P.ApiError(e.status, message, code="engine_unavailable" if gone else None,
                          type="invalid_request_error" if e.status < 500 else "server_error",
                          headers={"Retry-After": str(RETRY_AFTER_S)} if gone else None)
    log.error("request %s failed", rid, exc_info=e)
    return P.ApiError(500, f"generation failed (request id {rid}); the server logged the details", type="server_error")


async def _stream(server: OpenAIServer, reply: _Reply, choices: list[_Choice], handle, rid: str
                  ) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. A client that goes
    away cancels this generator (Starlette listens for the disconnect); ``finally`` aborts its sequences."""
    kind, created, model = reply.kind, P.now(), server.model_name
    ids = reply.body.return_token_ids
    use = _Usage(reply)
    started = [False] * len(choices)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return _sse(P.response(kind, rid, created, model, choices, usage, chunk=True))

    try:
        if kind == "chat":
            for c in choices:
                yield chunk([P.chunk_choice(kind, c.index, "", None, None, role=True)])
        async for ev in handle.events():
            c = choices[ev.index]
            c.add(ev)
            use.add(ev)
            if not started[ev.index] and reply.echo is not None:  # the echoed prompt comes first
                started[ev.index] = True
                yield chunk([P.chunk_choice(kind, c.index, c.echo_text(), None, None,
                                            logprobs=c.echo_logprobs())])
            elif not ev.text and not ev.finish_reason and not (ev.token_ids and (ids or reply.top is not None)):
                continue  # text held back (half a character, or what a stop string may swallow)
            text = ev.text if (ev.text or kind == "completion") else None
            logprobs = c.logprobs_json(ev.token_ids, ev.logprobs) if ev.logprobs is not None else None
            prompt_logprobs = P.prompt_logprobs_json(ev.prompt_logprobs) if (
                ev.prompt_logprobs is not None and reply.body.prompt_logprobs is not None) else None
            yield chunk([P.chunk_choice(kind, ev.index, text, ev.finish_reason, ev.token_ids if ids else None,
                                        logprobs=logprobs, prompt_logprobs=prompt_logprobs)])
        if reply.body.include_usage:
            yield chunk([], use.json())
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the engine failed mid-stream: the status line is long gone, say it in the stream
        err = _request_failed(e, rid)
        server.metrics.errors.labels(str(err.status)).inc()
        yield _sse(err.body())
    finally:
        if not handle.finished:
            handle.abort()
    yield "data: [DONE]\n\n"


async def _decode(server: OpenAIServer, token_ids: list[int]) -> str:
    """A token-id prompt's text (for echo), decoded in the pool."""
    if server.tokenizer is None:
        raise P.ApiError(400, "echo needs the prompt's text, and this model has no tokenizer; prepend the prompt "
                         "yourself", "echo")
    return await asyncio.get_running_loop().run_in_executor(server.pool, server.tokenizer.decode, token_ids)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _HungUp(Exception):
    """The client closed the connection while sending its request: an abort, not an error."""


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise _HungUp() from None
    if len(raw) >= LARGE_BODY_BYTES:
        request.app.state.server.trim_soon()
    try:
        return model.model_validate_json(raw or b"", strict=True)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _validation_error(errors: list[dict]) -> P.ApiError:
    first = errors[0]
    if first["type"] == "json_invalid":
        return P.ApiError(400, f"the body is not valid JSON: {first['msg']}", code="json_invalid")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not loc:
        return P.ApiError(400, f"the body must be a JSON object: {first['msg']}", code=first["type"])
    field = loc[0]
    same = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == [field]]
    if len(same) > 1:  # a union (prompt: str | list[str] | list[int] | ...): no single member's message fits
        got = type(first.get("input")).__name__
        return P.ApiError(400, f"{field} has the wrong type ({got}): {'; '.join(_dedup(e['msg'] for e in same))}",
                          field, "invalid_type")
    return P.ApiError(400, f"{'.'.join(loc)}: {first['msg']}", field, first["type"])


def _dedup(items) -> list[str]:
    return list(dict.fromkeys(items))


def _install_error_handlers(app: FastAPI, server: OpenAIServer) -> None:
    def reply(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
        server.metrics.errors.labels(str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError) -> JSONResponse:
        return reply(e.status, e.body(), e.headers)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, e: ValueError) -> JSONResponse:
        message = str(e)
        word = message.split(" ", 1)[0]
        param = word if word in _PARAM_NAMES else None
        code = "context_length_exceeded" if "context" in message and param == "prompt" else None
        return reply(400, P.error_body(message, param=param, code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = _validation_error(list(e.errors()))
        return reply(err.status, err.body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return reply(e.status_code, P.error_body(str(e.detail), param=None, code=code))

    @app.exception_handler(_HungUp)
    async def hung_up(request: Request, e: _HungUp) -> Response:
        server.metrics.requests.labels("abort").inc()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        rid = P.new_id("error")
        log.error("request %s: internal error", rid, exc_info=e)
        return reply(500, P.error_body(f"internal error (request id {rid}); the server logged the details",
                                       "server_error"))



def _longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest token's spelling in the vocabulary (an upper bound on the text one
    token covers: byte-level and SentencePiece spellings take at least as many bytes as their text)."""
    if tokenizer is None:
        return 1
    return max((len(t.encode()) for t in tokenizer.get_vocab()), default=1)

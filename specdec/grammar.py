"""Grammar-constrained decoding: which tokens may come next under a request's ``structured_outputs``.

``GrammarCompiler`` (one per engine) turns a ``StructuredOutputsParams`` into a compiled grammar over the
model's tokenizer, once per distinct constraint (a bounded, thread-safe LRU cache, so the server may
compile off the engine thread); ``GrammarMatcher`` (one per sequence) follows the sequence's tokens,
gives the mask of allowed next tokens and rolls back rejected drafts. The engine is llguidance
(docs/api.md, "Structured output", says why): JSON schemas and ``json_object`` go through its JSON-schema
compiler, ``regex`` through its regex syntax (Rust ``regex``), ``choice`` as an alternation of literal
strings, ``grammar`` as Lark (llguidance's dialect, with inline ``/regex/`` terminals) or llama.cpp's
GBNF / vLLM's EBNF (``root ::= ...``), told apart by their syntax.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from specdec.config import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 64
_MAX_ERROR_CHARS = 300  # llguidance's messages can quote the grammar; keep the reply short


def _short(message: str) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."


def _grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for ``so``; ValueError when the input cannot be read."""
    import llguidance

    options = {"whitespace_flexible": not so.disable_any_whitespace}
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = so.spec_text if kind == "json" else '{"type": "object"}'
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs json is not valid JSON ({e.msg} at character {e.pos}); "
                             "pass a JSON schema object") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"structured_outputs json must be a JSON schema object, got a JSON {type(parsed).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    except Exception as e:  # the GBNF converter raises whatever its parser met
        raise ValueError(f"structured_outputs grammar is neither Lark nor GBNF/EBNF: {_short(e)}") from None


def _ll_tokenizer(tokenizer, n_vocab: int, eos_token_ids: list[int]):
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)
    except ValueError as e:  # a slow tokenizer, or a decoder llguidance cannot read token by token
        raise ValueError(f"structured_outputs cannot read this model's tokenizer ({type(tokenizer).__name__}: "
                         f"{_short(e)}); it needs a fast tokenizer with a byte-level, byte-fallback or "
                         "SentencePiece decoder") from None


class GrammarCompiler:
    """Compiles ``structured_outputs`` constraints for one model and hands out matchers.

    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's length: ids
    past the tokenizer are never allowed. ``eos_token_ids`` are the stop tokens a complete output ends
    with. Safe to call from several threads; compiled grammars are kept for the ``max_cached`` most
    recently used constraints.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_cached: int = MAX_CACHED_GRAMMARS):
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if not isinstance(max_cached, int) or max_cached < 1:
            raise ValueError(f"max_cached must be a positive integer, got {max_cached!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, object] = OrderedDict()  # key -> llguidance.LLMatcher in its start state
        self._ll_tok = None

    def _tokenizer(self):
        """llguidance's view of the tokenizer, built on first use (it reads the whole vocabulary)."""
        with self._lock:
            if self._ll_tok is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this model has none "
                                     "(for a GGUF file, pass tokenizer=<an HF tokenizer folder>)")
                if not self.eos_token_ids:
                    raise ValueError("structured_outputs needs the model's end-of-sequence token ids, and none are "
                                     "known (set eos_token_id in the model's generation_config.json)")
                self._ll_tok = _ll_tokenizer(self.tokenizer, max(self.vocab_size, len(self.tokenizer)),
                                             sorted(self.eos_token_ids))
            return self._ll_tok

    def _compile(self, so: StructuredOutputsParams):
        import llguidance

        tok = self._tokenizer()
        grammar = _grammar_text(so)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=limits)
        if is_error:
            raise ValueError(f"structured_outputs {so.kind} is not valid: {_short(messages[0])}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"structured_outputs {so.kind} is not valid: {_short(matcher.get_error())}")
        return matcher

    def matcher(self, so: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for ``so``, compiling it on a cache miss (ValueError for a bad grammar)."""
        if not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"expected StructuredOutputsParams, got {type(so).__name__}")
        key = (so.kind, so.spec_text, so.disable_any_whitespace)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                ll = template.deep_copy()
        if template is None:
            template = self._compile(so)  # outside the lock: llguidance releases the GIL while it compiles
            with self._lock:
                self._cache[key] = template
                self._cache.move_to_end(key)
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
                ll = template.deep_copy()
        return GrammarMatcher(ll, self.vocab_size, len(self.tokenizer), self.eos_token_ids)

    def ready_matchers(self, so: StructuredOutputsParams, count: int) -> list[GrammarMatcher]:
        """``count`` fresh matchers with their first mask computed: the grammar engine builds its lexer
        lazily, and a pathological regex can take seconds there, which a server does off its engine
        thread. ValueError for a bad grammar or one the engine gives up on before its first token."""
        matchers = [self.matcher(so) for _ in range(count)]
        for m in matchers:
            m.allowed_mask()
            if m.failed:  # e.g. a schema that refers to itself without end
                raise ValueError("the grammar engine gave up on it before its first token")
        return matchers

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    def clear_cache(self) -> None:
        """Forget every compiled grammar (the next matcher compiles afresh, with cold lexer caches)."""
        with self._lock:
            self._cache.clear()


class GrammarMatcher:
    """One sequence's position in its grammar: accept tokens, undo them, and say what may come next.

    Where the grammar forces the next bytes (a JSON key, say), llguidance allows only their canonical
    tokenization; ``accept_token`` agrees with ``allowed_mask`` there too, so a draft is refused exactly
    when the mask would give it probability 0. llguidance takes a stop token accepted after the grammar
    has ended as a no-op, so the matcher keeps its own history to roll back exactly the tokens it took.
    """

    def __init__(self, ll, vocab_size: int, tokenizer_len: int, stop_token_ids: frozenset[int]):
        self._ll = ll  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self._text_ids = min(tokenizer_len, vocab_size)  # ids past the tokenizer are padding rows
        self._stop_ids = stop_token_ids
        self._stop_list = sorted(i for i in stop_token_ids if i < vocab_size)
        self._history: list[tuple[int, bool]] = []  # (token, whether llguidance counted it)
        self._bits = np.zeros((max(vocab_size, tokenizer_len) + 31) // 32, dtype=np.int32)  # one bit per token
        self._mask: np.ndarray | None = None  # [vocab_size] bool, the current state's mask once computed
        self._warned = False

    @property
    def failed(self) -> bool:
        """Whether llguidance gave up on this sequence; from then on only the stop tokens are allowed."""
        return self._failed()

    def _failed(self) -> bool:
        """llguidance gave up (a step over its parser limits): the output ends there, as in vLLM."""
        if not self._ll.is_error():
            return False
        if not self._warned:
            self._warned = True
            log.warning("a grammar matcher failed, so its output ends here: %s", _short(self._ll.get_error()))
        return True

    def _current_mask(self) -> np.ndarray:
        if self._mask is None:
            if self.is_terminated() or self._failed():  # the stop tokens: a masked row is never empty
                bits = np.zeros(self.vocab_size, dtype=np.uint8)
                bits[self._stop_list] = 1
            else:
                self._ll.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
                if self._failed():
                    return self._current_mask()
                bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size]
                bits[self._text_ids:] = 0  # padding rows of the model's vocabulary
            self._mask = bits.view(np.bool_)
        return self._mask

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) where ``allowed_mask`` excludes it. Once
        terminated, only further stop tokens are taken (as no-ops), as the mask says."""
        if not 0 <= token_id < self.vocab_size:
            return False
        if self.is_terminated() or self._mask is not None or self._failed() or self._ll.compute_ff_bytes():
            if not self._current_mask()[token_id]:  # forced bytes: only their canonical tokens
                return False
        if token_id in self._stop_ids:
            if self._ll.is_stopped():  # the grammar has ended (or failed): llguidance takes a stop token as a no-op
                self._history.append((token_id, False))
                self._mask = None
                return True
            if self._ll.validate_tokens([token_id]) != 1:
                return False
            self._ll.consume_token(token_id)
        elif token_id >= self._text_ids or self._ll.try_consume_tokens([token_id]) != 1:
            return False
        self._history.append((token_id, True))
        self._mask = None
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher has accepted {len(self._history)}")
        if num_tokens == 0:
            return
        counted = sum(c for _, c in self._history[-num_tokens:])
        del self._history[-num_tokens:]
        self._mask = None
        if counted and not self._ll.is_error():
            self._ll.rollback(counted)  # a failure shows as the error state (_failed)

    def allowed_mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next (only the stop tokens once it is complete,
        and still only them after one was accepted, so a masked row is never empty)."""
        return torch.from_numpy(self._current_mask().copy())

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return bool(self._history) and self._history[-1][0] in self._stop_ids

    @property
    def num_accepted(self) -> int:
        return len(self._history)

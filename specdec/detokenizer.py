"""Token ids to text, and the stop conditions checked as a sequence's tokens are appended.

Shared by the engine (which stops sequences), ``LLM`` and the server (which stream text).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from specdec.config import SamplingParams
from specdec.outputs import StreamDelta
from specdec.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer=None, eos_token_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)

    def append(self, seq: Sequence, new_tokens: list[int]) -> list[int]:
        """Append tokens one by one until a stop condition ends the sequence; returns the tokens kept."""
        p = seq.params
        kept = []
        for t in new_tokens:
            seq.token_ids.append(t)
            kept.append(t)
            if not p.ignore_eos and t in self.eos_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", None
            elif t in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", t
            elif p.stop and seq.num_output_tokens > p.min_tokens and self._hit_stop_string(seq):
                pass
            elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= seq.max_len:
                seq.finish_reason = "length"
            if seq.finished:
                break
        return kept

    def _hit_stop_string(self, seq: Sequence) -> bool:
        stop = seq.params.stop
        window = 4 * max(len(s) for s in stop) + 8  # tokens enough to spell any stop string
        tail = self.decode(seq.output_token_ids[-window:], seq.params)
        if not any(s in tail for s in stop):
            return False
        text = self.decode(seq.output_token_ids, seq.params)
        pos, s = min((text.find(s), s) for s in stop if s in text)
        seq.text = text[:pos]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    def decode(self, token_ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def output_text(self, seq: Sequence) -> str:
        """The final text: cut at the stop string when one ended the sequence."""
        if isinstance(seq.stop_reason, str):
            return seq.text
        return self.decode(seq.output_token_ids, seq.params)


class TextStreamer:
    """Turns a sequence's growing token list into text deltas, never emitting half a character
    or text that a stop string may still swallow.

    Decoding is incremental, as vLLM's detokenizer does it: each round decodes only the window of
    tokens since the previous round's new ones, and the text it adds is the difference between the
    window's decode with and without the newest tokens (the same first token on both sides keeps a
    tokenizer's start-of-text rules out of the difference). Re-decoding everything is O(length)."""

    def __init__(self, detokenizer: Detokenizer, seq: Sequence):
        self.detokenizer, self.seq = detokenizer, seq
        self.sent = 0  # characters of self.text already emitted
        self.holdback = max((len(s) for s in seq.params.stop), default=1) - 1
        self.text = ""  # the output decoded so far
        self.prefix = 0  # output tokens [prefix, read) were the newest the last time text grew
        self.read = 0  # output tokens before read are in self.text

    def delta(self, tokens: list[int]) -> StreamDelta:
        seq = self.seq
        if seq.finished:
            text = self.detokenizer.output_text(seq)  # once per sequence: whole, and cut at a stop string
            end = len(text)
        else:
            text = self._decode_new()
            end = len(text) - self.holdback
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        logprobs = None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - len(tokens):]
        return StreamDelta(text=new, token_ids=tokens, finish_reason=seq.finish_reason, logprobs=logprobs)

    def _decode_new(self) -> str:
        ids = self.seq.output_token_ids
        if len(ids) > self.read:
            decode = functools.partial(self.detokenizer.decode, params=self.seq.params)
            before, after = decode(ids[self.prefix : self.read]), decode(ids[self.prefix :])
            if after.endswith("\ufffd"):
                pass  # the newest tokens end inside a character: wait for the rest
            elif after.startswith(before):
                new = after[len(before) :]
                self.text += new
                if new:  # tokens that decode to nothing (special ones) stay in the window: the next
                    self.prefix = self.read  # text must still be joined to the words before them
                self.read = len(ids)
            else:  # a tokenizer whose decode does not extend this way: decode it all once more
                self.text = decode(ids)
                self.prefix = self.read = len(ids)
        return self.text

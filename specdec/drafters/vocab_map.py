"""What a draft with another tokenizer shares with the target: token text, and a way between the two.

Two tokenizers meet in text. Each token has a *text*: what it adds when it continues other text
(" the" for GPT-2's "Ġthe" and for SentencePiece's "▁the"; "ing" for WordPiece's "##ing"), read by
decoding it after a plain anchor token, so every tokenizer's spacing rules are applied by the
tokenizer itself. Tokens whose texts are identical in both vocabularies map 1:1 (the token-level
intersection); text moves whole between them by decoding with one tokenizer and encoding with the
other (the string-level match). Two byte-level vocabularies (GPT-2's byte alphabet) also pair the
tokens that are bytes of a character, by those bytes. Special tokens map by their string (both
spell "</s>" or "<|im_start|>"), and end-of-sequence maps to end-of-sequence; a special token the
other tokenizer lacks is left out of the text.

``encode_continuation`` encodes text that follows other text: it encodes the context and the
context plus the text and keeps what follows the context's tokens, provided those did not change
(no token straddles the boundary). That keeps a tokenizer's start-of-text rules (a dummy prefix
space) out of the middle of a sequence, and lets a caller re-encode a tail window instead of
a whole history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character
COVERAGE_SAMPLE = 2048  # target token texts the draft's tokenizer is asked to spell (spread over the vocabulary)


def same_vocabulary(a, b) -> bool:
    """Whether tokenizers ``a`` and ``b`` map the same strings to the same ids (None: no tokenizer,
    which says nothing against it)."""
    return a is None or b is None or a.get_vocab() == b.get_vocab()


def decode(tok, ids: list[int], drop: frozenset[int] | set[int] = frozenset()) -> str:
    """The text of ``ids`` but those in ``drop`` (special tokens the other tokenizer lacks), spaces as
    the tokens spell them."""
    if drop:
        ids = [t for t in ids if t not in drop]
    backend = getattr(tok, "backend_tokenizer", None)  # a fast tokenizer's own: a fraction of the wrapper's cost
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=False)
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tok, text: str) -> list[int]:
    """``text``'s ids, without the special tokens a tokenizer adds around a sequence."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_start(tok, text: str) -> list[int]:
    """``text``'s ids where it begins a sequence: after the tokenizer's BOS when it adds one (and the
    text, which may spell its own BOS, does not already begin with it)."""
    ids = encode(tok, text)
    bos = [t for t in tok("", add_special_tokens=True)["input_ids"] if t == tok.bos_token_id]
    return ids if ids[: len(bos)] == bos else bos + ids


def encode_continuation(tok, context: str, text: str) -> list[int] | None:
    """The ids of ``text`` where it follows ``context``, or None when the context's last token would
    change (a token straddles the boundary)."""
    before = encode(tok, context)
    after = encode(tok, context + text)
    if after[: len(before)] != before:
        return None
    return after[len(before):]


def token_texts(tok, size: int) -> list[str | None]:
    """The text each of ids 0..size-1 adds after other text; None for special tokens and for tokens
    that are not whole characters (a byte of a multi-byte character)."""
    special = set(tok.all_special_ids)
    anchor = _anchor(tok, size, special)
    base = decode(tok, [anchor])
    pairs = tok.batch_decode([[anchor, t] for t in range(size)], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
    texts: list[str | None] = []
    for t, text in enumerate(pairs):
        piece = text[len(base):] if text.startswith(base) else None
        ok = t not in special and piece and REPLACEMENT not in piece
        texts.append(piece if ok else None)
    return texts


def _anchor(tok, size: int, special: set[int]) -> int:
    """A plain token to decode others after: the first whose text is letters or digits."""
    for t in range(size):
        if t not in special and decode(tok, [t]).strip().isalnum():
            return t
    raise ValueError("its vocabulary has no token that decodes to letters or digits")


@dataclass
class VocabMap:
    """The token-level intersection of a draft's and a target's vocabularies, and how well the
    draft's tokenizer spells the target's text (``coverage``: the draft must read the history)."""

    draft_to_target: torch.Tensor  # [V_draft] long: the target id of the same text, -1 where none
    target_to_draft: torch.Tensor  # [V_target] long: the draft id of the same text, -1 where none
    num_shared: int  # tokens of the same text in both, special tokens of the same string included
    num_shared_text: int  # of them, the ones that spell text (not special tokens)
    coverage: float  # fraction of the target's token texts the draft encodes without its unknown token
    draft_eos: list[int]  # the draft's end-of-sequence ids
    target_eos: int | None  # the target's end-of-sequence id (what a draft that ends proposes)
    target_drop: frozenset[int]  # the target's special tokens the draft has no token of the same string for
    draft_drop: frozenset[int]  # the draft's special tokens the target has none for

    @classmethod
    def build(cls, target_tok, draft_tok, target_size: int, draft_size: int, pair: str) -> VocabMap:
        """The map between the two tokenizers. ``pair`` names them for errors: a draft or target without
        a tokenizer, tokens that do not decode to text, or vocabularies that share no text cannot be
        mapped (ValueError)."""
        for role, tok in (("draft", draft_tok), ("target", target_tok)):
            if tok is None:
                raise ValueError(f"{pair}: the {role} has no tokenizer, so its tokens cannot be mapped to the other's "
                                 "through text; give its folder the tokenizer files (tokenizer.json) of its model")
        try:
            d_texts = token_texts(draft_tok, draft_size)
            t_texts = token_texts(target_tok, target_size)
        except ValueError as e:
            raise ValueError(f"{pair}: the tokenizers cannot be mapped through text ({e})") from None
        for role, texts in (("draft", d_texts), ("target", t_texts)):
            if not any(texts):
                raise ValueError(f"{pair}: no token of the {role}'s vocabulary decodes to text, so the two "
                                 "vocabularies cannot be mapped; use a draft whose tokenizer decodes to text")
        of_text: dict[str, int] = {}
        for t, text in enumerate(t_texts):
            if text is not None:
                of_text.setdefault(text, t)
        d2t = torch.full((draft_size,), -1, dtype=torch.long)
        t2d = torch.full((target_size,), -1, dtype=torch.long)
        for d, text in enumerate(d_texts):
            t = of_text.get(text) if text is not None else None
            if t is not None and t2d[t] < 0:
                d2t[d], t2d[t] = t, d
        if _byte_level(target_tok) and _byte_level(draft_tok):  # bytes of a character: by their byte
            t_raw = dict(zip(target_tok.convert_ids_to_tokens(list(range(target_size))), range(target_size)))
            d_special = set(draft_tok.all_special_ids)
            for d, raw in enumerate(draft_tok.convert_ids_to_tokens(list(range(draft_size)))):
                t = t_raw.get(raw)
                if d_texts[d] is None and d not in d_special and t is not None and t_texts[t] is None \
                        and t not in target_tok.all_special_ids and t2d[t] < 0:
                    d2t[d], t2d[t] = t, d
        num_text = int((d2t >= 0).sum())
        t_special = _specials(target_tok, target_size)
        d_special = _specials(draft_tok, draft_size)
        for text, t in t_special.items():  # special tokens of the same string
            d = d_special.get(text)
            if d is not None and t2d[t] < 0 and d2t[d] < 0:
                d2t[d], t2d[t] = t, d
        draft_eos = _eos_ids(draft_tok, draft_size)
        target_eos = target_tok.eos_token_id if target_tok.eos_token_id is not None and \
            0 <= target_tok.eos_token_id < target_size else None
        if target_eos is not None:
            for d in draft_eos:
                if t2d[target_eos] < 0:
                    t2d[target_eos] = d
                d2t[d] = target_eos
        coverage = _coverage(draft_tok, [t for t in t_texts if t is not None])
        num_shared = int((d2t >= 0).sum())
        if coverage == 0.0:
            raise ValueError(f"{pair}: the vocabularies share no text (the draft's tokenizer spells none of the "
                             f"target's tokens but as its unknown token, and {num_shared} tokens match), so the draft "
                             "cannot read the target's text; use a draft whose tokenizer covers the target's text "
                             "(e.g. from the same model family)")
        return cls(d2t, t2d, num_shared, num_text, coverage, draft_eos, target_eos,
                   frozenset(t for x, t in t_special.items() if x not in d_special),
                   frozenset(d for x, d in d_special.items() if x not in t_special))


def _byte_level(tok) -> bool:
    """Whether ``tok`` spells tokens in GPT-2's byte alphabet (its decoder is byte-level): two such
    vocabularies share a token's bytes when they share its string, whole characters or not."""
    from tokenizers import decoders

    return isinstance(getattr(getattr(tok, "backend_tokenizer", None), "decoder", None), decoders.ByteLevel)


def _specials(tok, size: int) -> dict[str, int]:
    """The special tokens of ``tok`` within its first ``size`` ids, by string."""
    return {text: t for text, t in zip(tok.all_special_tokens, tok.all_special_ids) if 0 <= t < size}


def _eos_ids(tok, size: int) -> list[int]:
    eos = tok.eos_token_id
    return [eos] if eos is not None and 0 <= eos < size else []


def _coverage(tok, texts: list[str]) -> float:
    """Fraction of ``texts`` (a spread sample) that ``tok`` encodes without its unknown token."""
    if not texts:
        return 0.0
    step = max(1, len(texts) // COVERAGE_SAMPLE)
    sample = texts[::step]
    unk = tok.unk_token_id
    encoded = tok(sample, add_special_tokens=False)["input_ids"]
    spelled = sum(1 for ids in encoded if ids and (unk is None or unk not in ids))
    return spelled / len(sample)

"""Byte-level BPE tokenizer: train one on a corpus, or reuse a saved one.

The result is saved as a ``transformers`` fast tokenizer folder
(``tokenizer.json`` + ``tokenizer_config.json``) so ``AutoTokenizer.from_pretrained``
loads it with no custom code. ``<|endoftext|>`` is the only special token; it
serves as bos, eos, pad and unk (byte-level BPE never needs unk in practice).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 8192
    min_frequency: int = 2

    def __post_init__(self) -> None:
        # 256 byte symbols + the special token must fit before any merge.
        if self.vocab_size < 258:
            raise ValueError(f"vocab_size must be >= 258, got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {self.min_frequency}")


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for ``transformers``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets on the raw text (leading spaces included).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer in {folder} has no eos token")
    return tokenizer

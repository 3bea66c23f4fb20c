"""Tiny random checkpoints with a word-level tokenizer, saved and loaded through ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(120)]
SMALL_WORDS = [f"w{i}" for i in range(20)]  # V = 23: small enough for exact distribution tests


def make_tokenizer(folder: Path, words: list[str] = WORDS) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


BYTE_CORPUS = [  # what the byte-level tokenizer's merges are learnt from: JSON records and short words
    '{"id":12,"tag":"red","name":"ab","ok":true}', '{"id":7,"tag":"blue","name":"cd","ok":false}',
    '{"name": "Ada", "age": 36, "tags": ["math", "code"]}', "abc cab bca aabbcc", "the cat sat on the mat",
    "def f(x):\n    return x + 1\n", "yes no maybe", "[1, 2, 3]", "null true false",
]


def make_byte_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    """A small byte-level BPE tokenizer (GPT-2's scheme: 256 byte tokens, merges, <|endoftext|> = 0) saved
    into ``folder``: grammars need a tokenizer that spells every byte, and a small vocabulary keeps
    exact distribution tests cheap."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BYTE_CORPUS, trainer)
    eos = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos, pad_token=eos).save_pretrained(folder)


def copy_tokenizer(src: Path, folder: Path) -> tuple[int, int]:
    """Copy the tokenizer of checkpoint ``src`` (e.g. the shipped target's byte-level BPE, which grammars
    need) into ``folder``; returns its length and its EOS id."""
    import shutil

    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / name, Path(folder) / name)
    tok = AutoTokenizer.from_pretrained(folder)
    return len(tok), tok.eos_token_id


def byte_level_token_bytes(tok) -> list[bytes]:
    """Each token's bytes in a byte-level BPE vocabulary (GPT-2's byte <-> character table); b"" for
    special tokens."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_of = dict(zip(map(chr, printable + [256 + i for i in range(256 - len(printable))]),
                       printable + [b for b in range(256) if b not in printable]))
    special = set(tok.all_special_ids)
    return [b"" if t in special else bytes(byte_of[c] for c in piece)
            for t, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok)))))]


def make_model(folder: Path, arch: str = "llama", *, vocab_rows: int | None = None, hidden: int = 64,
               layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0, tie: bool = False,
               rope_parameters: dict | None = None, max_pos: int = 256, words: list[str] = WORDS,
               init_std: float = 0.2, tokenizer_from: Path | None = None, **extra) -> Path:
    """Save a random ``arch`` model (llama, qwen2, qwen3, mistral) plus tokenizer into ``folder``: the
    word-level one over ``words``, or a copy of checkpoint ``tokenizer_from``'s."""
    import transformers as tf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        make_tokenizer(folder, words)
        n_tok, special = len(words) + 3, dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        n_tok, eos = copy_tokenizer(tokenizer_from, folder)
        special = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    cls_cfg, cls_model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    kwargs = dict(vocab_size=vocab_rows or n_tok, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_pos, tie_word_embeddings=tie, initializer_range=init_std, **special)
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    kwargs.update(extra)
    config = cls_cfg(**kwargs)
    torch.manual_seed(seed)
    model = cls_model(config)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, len(WORDS) + 3, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 2) -> Path:
    """A partly agreeing draft: ``src``'s weights plus Gaussian noise of std ``scale``."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(dst)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    return Path(dst)


def remapped_copy(src: Path, dst: Path, words: list[str], scale: float = 0.0, seed: int = 2) -> Path:
    """A draft with a word-level tokenizer of its own over ``words`` (some of them ``src``'s, in another
    order, some not): ``src``'s weights, its rows for the words both know moved to the draft's ids,
    random rows for the others, plus Gaussian noise of std ``scale``. It agrees with ``src`` where the
    two vocabularies meet, so a mapping that pairs the wrong tokens shows as low acceptance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    make_tokenizer(dst, words)
    new_vocab = AutoTokenizer.from_pretrained(dst).get_vocab()
    old_vocab = src_tok.get_vocab()
    g = torch.Generator().manual_seed(seed)
    V = len(new_vocab)
    with torch.no_grad():
        for name in ("embed", "head"):
            old = model.get_input_embeddings().weight if name == "embed" else model.lm_head.weight
            new = torch.randn(V, old.shape[1], generator=g) * old.std()
            for text, i in new_vocab.items():
                if text in old_vocab:
                    new[i] = old[old_vocab[text]]
            if name == "embed":
                model.set_input_embeddings(torch.nn.Embedding.from_pretrained(new, freeze=False))
            else:
                model.lm_head = torch.nn.Linear(old.shape[1], V, bias=False)
                model.lm_head.weight.copy_(new)
        model.config.vocab_size = V
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def small_vocab_pair(root: Path) -> tuple[str, str, torch.nn.Module]:
    """A sharp target over SMALL_WORDS and a draft close to it (chi-square tests of whole engines):
    (target folder, draft folder, the target's transformers model)."""
    from specdec.models.load import load_model

    target = make_model(root / "t", "llama", words=SMALL_WORDS, seed=3, init_std=0.5)
    draft = perturbed_copy(target, root / "d", 0.05)
    return str(target), str(draft), load_model(str(target)).hf_model

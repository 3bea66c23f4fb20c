"""Step 3 of loading a model: the runner, with its tokenizer and end-of-sequence ids.

``load`` takes what resolve.py found and what choose.py chose (a backend and a dtype) and builds
the runner: the torch ``LlamaRunner`` over transformers' model (read from safetensors, or from a
GGUF file through transformers' GGUF reader), or the ``LlamaCppRunner`` over a GGUF file (a
checkpoint is converted once and the conversion cached). Weights are read from safetensors only,
and remote code is never run unless asked for. ``load_model`` and ``load_runner`` go the whole way
from a name for callers that name the backend themselves (tests, benchmarks).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from specdec.models import timings
from specdec.models.base import ModelRunner
from specdec.models.dtype_choice import DTYPES, GGUF_DTYPES, OUTTYPE_OF_DTYPE, config_of, dtype_for, torch_dtype
from specdec.models.gguf import GGUFInfo, checkpoint_digest, convert, read_info
from specdec.models.llama import LlamaRunner, LoadedModel
from specdec.models.llamacpp import LlamaCppRunner
from specdec.models.resolve import SUPPORTED_ARCHITECTURES, ModelSource, check_architecture, resolve


def load(source: ModelSource, backend: str, dtype: str | None, device: str = "cpu", max_model_len: int | None = None,
         trust_remote_code: bool = False, vocab_size: int | None = None,
         tokenizer: str | None = None, enforce_eager: bool | None = None,
         longest_feed: int | None = None) -> tuple[ModelRunner, set[int]]:
    """A runner for ``source`` on ``backend`` ("torch" or "llama.cpp") and the model's end-of-sequence
    ids. ``dtype``: the weights' dtype by name (dtype_choice.dtype_for): on torch what they are cast
    to, on llama.cpp what a checkpoint is converted to; None for a GGUF file on llama.cpp.
    ``tokenizer``: an HF tokenizer folder for a GGUF model (default: its own). ``enforce_eager``
    (torch): True runs eager, False compiles the few-token step at load (compiled.py), None: compile
    unless SPECDEC_ENFORCE_EAGER=1; on llama.cpp it says the same of torch code beside it (an EAGLE-3 head).
    ``longest_feed`` (torch): the most tokens a verify pass will feed a row; the compiled sizes reach it."""
    if backend == "torch":
        loaded = load_hf(source, DTYPES[dtype], device, trust_remote_code)
        if tokenizer:
            loaded.tokenizer = load_tokenizer(tokenizer)
        runner = LlamaRunner(loaded, max_model_len=max_model_len, vocab_size=vocab_size, enforce_eager=enforce_eager,
                             longest_feed=longest_feed)
        return runner, eos_token_ids(loaded.hf_model, loaded.config, loaded.tokenizer)
    path, info = (source.path, source.gguf) if source.is_gguf else (converted_gguf(source, dtype), None)
    info = info or read_info(path)
    tok = load_tokenizer(tokenizer) if tokenizer else gguf_tokenizer(info)
    runner = LlamaCppRunner(path, tokenizer=tok, max_model_len=max_model_len, vocab_size=vocab_size, info=info,
                            enforce_eager=enforce_eager)
    return runner, eos_token_ids(None, info, tok)


def load_model(name: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False) -> LoadedModel:
    """Model ``name`` as transformers loads it (the torch runner's weights), in ``dtype`` or by
    dtype_choice's rule under "auto"."""
    source = resolve(name)
    return load_hf(source, torch_dtype(dtype, config_of(source), device), device, trust_remote_code)


def load_runner(name: str, backend: str = "torch", dtype: str = "auto", device: str = "cpu",
                max_model_len: int | None = None, trust_remote_code: bool = False, vocab_size: int | None = None,
                tokenizer: str | None = None, enforce_eager: bool | None = None,
                longest_feed: int | None = None) -> tuple[ModelRunner, set[int]]:
    """``load`` from a name on the backend named ("torch" or "llama.cpp"), the dtype chosen by
    dtype_choice's rule."""
    source = resolve(name)
    return load(source, backend, dtype_for(source, backend, dtype, device), device, max_model_len,
                trust_remote_code, vocab_size, tokenizer, enforce_eager, longest_feed)


def load_hf(source: ModelSource, dtype: torch.dtype, device: str = "cpu", trust_remote_code: bool = False) -> LoadedModel:
    """transformers' model of ``source`` in ``dtype``, with its tokenizer (None when the folder has none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.is_gguf:
        return _load_gguf(source.gguf, dtype, device)
    path = source.path
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)  # architecture: checked by resolve
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"model folder {path!r} has no .safetensors weights; specdec loads safetensors only "
                         "(convert with transformers: model.save_pretrained(folder, safe_serialization=True))")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                    trust_remote_code=trust_remote_code)
    hf_model.to(device).eval()
    return LoadedModel(path=path, config=config, hf_model=hf_model, tokenizer=load_tokenizer(path))


def _load_gguf(info: GGUFInfo, dtype: torch.dtype, device: str) -> LoadedModel:
    """A GGUF file as transformers' model (its GGUF reader maps the tensors back and dequantizes them),
    with the file's tokenizer, for the torch backend."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = info.path
    folder, file = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # an architecture transformers cannot read from GGUF
        raise ValueError(f"the torch backend cannot read {path!r} (architecture {info.architecture!r}: "
                         f"{type(e).__name__}); use backend='llama.cpp'") from None
    if not getattr(config, "architectures", None):  # a GGUF names the model type only
        config.architectures = [a for a in SUPPORTED_ARCHITECTURES if a.lower() == f"{config.model_type}forcausallm"]
    check_architecture(config)
    if not 0 <= (config.pad_token_id if config.pad_token_id is not None else 0) < config.vocab_size:
        config.pad_token_id = None  # a tokenizer's padding id past the embedding rows (it only marks padding)
    config.dtype = GGUF_DTYPES.get(info.weight_type, "float32")  # the file's own, as a checkpoint's config says
    extra = {}
    try:  # transformers keeps quantized blocks packed where it has kernels; the runner needs dense weights
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(gguf_file=file, dequantize=True)
    except ImportError:  # a transformers that always dequantizes
        pass
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=config, dtype=dtype, **extra)
    except NotImplementedError:  # e.g. a llama-architecture file that names Mistral: transformers lacks its mapping
        raise ValueError(f"the torch backend cannot read {path!r}: transformers' GGUF reader does not map model "
                         f"type {config.model_type!r}; use backend='llama.cpp' or the Hugging Face checkpoint") from None
    hf_model.to(device).eval()
    return LoadedModel(path=path, config=config, hf_model=hf_model, tokenizer=gguf_tokenizer(info))


def converted_gguf(source: ModelSource, dtype: str) -> str:
    """The GGUF conversion of checkpoint ``source`` with weights of ``dtype`` (a name), made once and
    cached under ~/.cache/specdec/gguf (SPECDEC_CACHE) by the checkpoint's contents and the weight type."""
    outtype = OUTTYPE_OF_DTYPE[dtype]
    path = source.path
    out = timings.cache_dir() / "gguf" / f"{Path(path).name}-{checkpoint_digest(path)}-{outtype}.gguf"
    if not out.exists():
        print(f"specdec: converting {source.name} to GGUF ({outtype}) for llama.cpp, once: {out}", file=sys.stderr,
              flush=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            convert(path, str(tmp), outtype)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return str(out)


def load_tokenizer(path: str):
    """The HF tokenizer in folder ``path``; None when it has none (prompts then go in as token ids)."""
    from transformers import AutoTokenizer

    has_tokenizer = any(os.path.exists(os.path.join(path, f))
                        for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"))
    if not has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(info):
    """The tokenizer of a GGUF file: the HF tokenizer specdec stored in it, else transformers' reading of
    its llama.cpp vocabulary; None when neither works (prompts then go in as token ids)."""
    from transformers import AutoTokenizer

    if info.hf_tokenizer_json:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "tokenizer.json").write_text(info.hf_tokenizer_json)
            if info.hf_tokenizer_config:
                Path(d, "tokenizer_config.json").write_text(info.hf_tokenizer_config)
            if info.hf_model_type:  # the class transformers gives the checkpoint's own tokenizer
                Path(d, "config.json").write_text(json.dumps({"model_type": info.hf_model_type}))
            return AutoTokenizer.from_pretrained(d)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(info.path)),
                                                 gguf_file=os.path.basename(info.path))
    except Exception:  # a vocabulary transformers cannot rebuild
        return None


def eos_token_ids(hf_model, config, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config, the model config (or GGUF metadata) and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(hf_model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(i for i in src if isinstance(i, int))
    return ids

"""Finding and loading checkpoints: local folders, hub ids and the pair shipped in the package.

Weights are read from safetensors only, and remote code is never run unless asked for.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models import timings
from specdec.models.cpu import bf16_verdict, largest_product

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED = {"specdec/demo-target": ASSETS / "demo-target", "specdec/demo-draft": ASSETS / "demo-draft"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    path: str
    config: object  # transformers.PretrainedConfig
    hf_model: torch.nn.Module  # the transformers model, used only as a source of weights
    tokenizer: object | None  # transformers tokenizer, or None when the folder ships none


def resolve_model_path(name: str) -> str:
    """A local folder for ``name``: a shipped model, an existing folder, or a hub snapshot (safetensors only)."""
    if name in SHIPPED:
        path = SHIPPED[name]
        if not (path / "config.json").exists():
            raise ValueError(f"the shipped model {name!r} is missing from this installation ({path}); "
                             "reinstall specdec or pass a model folder instead")
        return str(path)
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.exists(os.path.join(expanded, "config.json")):
            raise ValueError(f"model folder {name!r} has no config.json; point to a Hugging Face checkpoint folder")
        return expanded
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") != 1 or os.sep + os.sep in name
    if looks_like_path:
        raise ValueError(f"model folder {name!r} does not exist; pass an existing checkpoint folder or a "
                         "hub id such as 'HuggingFaceTB/SmolLM2-135M'")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as e:  # offline, unknown repo, no network
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = ("HF_HUB_OFFLINE is set and it is not in the local hub cache" if offline
                else f"it could not be fetched from the hub ({type(e).__name__})")
        raise ValueError(f"model {name!r} is neither a local folder nor an available hub id: {hint}; "
                         "pass an existing checkpoint folder") from None


def check_architecture(config) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', '?')}; "
                         f"specdec runs {', '.join(SUPPORTED_ARCHITECTURES)} checkpoints")


def load_model(name: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.gguf import find_gguf

    gguf_file = None if name in SHIPPED else find_gguf(name)
    if gguf_file is not None:
        return _load_gguf(gguf_file, dtype, device)
    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    check_architecture(config)
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(f"model folder {path!r} has no .safetensors weights; specdec loads safetensors only "
                         "(convert with transformers: model.save_pretrained(folder, safe_serialization=True))")
    torch_dtype = _torch_dtype(dtype, config, device)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, use_safetensors=True,
                                                    trust_remote_code=trust_remote_code)
    hf_model.to(device).eval()
    return LoadedModel(path=path, config=config, hf_model=hf_model, tokenizer=load_tokenizer(path))


# the dtype a GGUF file's weights load in on the torch backend: their own where torch has it; dequantized
# types (q8_0, k-quants) as float32, which holds their values exactly
GGUF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _load_gguf(path: str, dtype: str, device: str) -> LoadedModel:
    """A GGUF file as transformers' model (its GGUF reader maps the tensors back and dequantizes them),
    with the file's tokenizer, for the torch backend."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.gguf import read_info

    info = read_info(path)
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
    config.dtype = GGUF_DTYPES.get(info.weight_type, "float32")
    torch_dtype = _torch_dtype(dtype, config, device)
    extra = {}
    try:  # transformers keeps quantized blocks packed where it has kernels; the runner needs dense weights
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(gguf_file=file, dequantize=True)
    except ImportError:  # a transformers that always dequantizes
        pass
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=config, dtype=torch_dtype,
                                                        **extra)
    except NotImplementedError:  # e.g. a llama-architecture file that names Mistral: transformers lacks its mapping
        raise ValueError(f"the torch backend cannot read {path!r}: transformers' GGUF reader does not map model "
                         f"type {config.model_type!r}; use backend='llama.cpp' or the Hugging Face checkpoint") from None
    hf_model.to(device).eval()
    return LoadedModel(path=path, config=config, hf_model=hf_model, tokenizer=gguf_tokenizer(info))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    has_tokenizer = any(os.path.exists(os.path.join(path, f))
                        for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"))
    if not has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(path)


def _torch_dtype(dtype: str, config, device: str = "cpu") -> torch.dtype:
    """The weights' dtype. ``auto`` keeps the checkpoint's dtype where this device computes in it
    well: on a CPU, bfloat16 only where bf16 is native and the model's largest product measured
    faster in it (``cpu.bf16_verdict``), and float16 never (both become float32 otherwise)."""
    if dtype == "auto":
        dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = DTYPES.get(dt)
        if dt not in DTYPES.values():
            return torch.float32
        if str(device).startswith("cpu"):
            if dt == torch.float16 or (dt == torch.bfloat16 and not bf16_verdict(*largest_product(config)).use_bf16):
                return torch.float32
        return dt
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def check_same_vocabulary(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Draft and target must map the same strings to the same ids; padded embedding rows don't matter."""
    if target_tok is None or draft_tok is None:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        only_d = len(set(dv.items()) - set(tv.items()))
        raise ValueError(f"draft {draft_name!r} and target {target_name!r} have different vocabularies "
                         f"({len(dv)} vs {len(tv)} tokens; {only_t} target and {only_d} draft entries differ); "
                         "speculative decoding needs a draft with the target's tokenizer (same model family)")


# -- backends: torch (HF safetensors) and llama.cpp (GGUF) --------------------------------------------

BACKENDS = ("auto", "torch", "llama.cpp")
OUTTYPE_OF_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def choose_backend(name: str, backend: str = "auto", device: str = "cpu", method: str | None = None,
                   num_speculative_tokens: int = 0, dtype: str = "auto") -> tuple[str, str]:
    """The backend that runs model ``name`` and why: what was asked for, or for ``auto`` llama.cpp for a
    GGUF file, torch for CUDA and layer_skip, and for a checkpoint on CPU that llama.cpp can convert,
    the backend measured faster here (backend_choice.py)."""
    from specdec.models.gguf import find_gguf
    from specdec.models.llamacpp import llama_cpp_available

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gguf_file = find_gguf(name) if name not in SHIPPED else None
    if backend == "torch":
        return "torch", "asked for"  # a GGUF file is dequantized into transformers' model (load_model)
    if backend == "llama.cpp":
        if not str(device).startswith("cpu"):
            raise ValueError(f"specdec's llama.cpp backend runs on the CPU; got device={device!r} (use backend='torch')")
        if method == "layer_skip":
            raise ValueError(_LAYER_SKIP)
        return "llama.cpp", "asked for"
    if gguf_file:
        return "llama.cpp", "auto: a GGUF file"
    if not str(device).startswith("cpu"):
        return "torch", f"auto: device {device}"
    if method == "layer_skip":
        return "torch", "auto: layer_skip runs the target's first layers (torch only)"
    if not llama_cpp_available():
        return "torch", "auto: llama-cpp-python is not installed"
    if not _convertible(name):
        return "torch", "auto: not a checkpoint specdec converts to GGUF"
    from specdec.models.backend_choice import auto_backend

    verdict = auto_backend(resolve_model_path(name), dtype, num_speculative_tokens)
    return verdict.backend, f"auto: {verdict.reason}"


_LAYER_SKIP = ("layer_skip runs the target's first layers, which the llama.cpp backend cannot do (it runs whole "
               "models only); use backend='torch' with an HF checkpoint, or method draft_model, ngram or suffix")


def _convertible(name: str) -> bool:
    import json

    from specdec.models.gguf import ARCHITECTURES

    try:
        path = resolve_model_path(name)
        archs = json.loads(Path(path, "config.json").read_text()).get("architectures") or []
    except (ValueError, OSError):
        return False
    return bool(archs) and archs[0] in ARCHITECTURES and bool(glob.glob(os.path.join(path, "*.safetensors")))


def load_runner(name: str, backend: str = "torch", dtype: str = "auto", device: str = "cpu",
                max_model_len: int | None = None, trust_remote_code: bool = False, vocab_size: int | None = None,
                tokenizer: str | None = None):
    """A runner for model ``name`` on ``backend`` ("torch" or "llama.cpp", as choose_backend gave) and the
    model's end-of-sequence ids. ``tokenizer``: an HF tokenizer folder for a GGUF model (default: its own)."""
    if backend == "torch":
        from specdec.models.llama import LlamaRunner

        loaded = load_model(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        if tokenizer:
            loaded.tokenizer = load_tokenizer(tokenizer)
        runner = LlamaRunner(loaded, max_model_len=max_model_len, vocab_size=vocab_size)
        return runner, _eos_token_ids(loaded.hf_model, loaded.config, loaded.tokenizer)
    from specdec.models.gguf import find_gguf, read_info
    from specdec.models.llamacpp import LlamaCppRunner

    path = None if name in SHIPPED else find_gguf(name)
    if path is not None and dtype != "auto":
        raise ValueError(f"dtype={dtype!r} cannot change a GGUF file's weight types ({name!r}); leave dtype at 'auto' "
                         "or convert the checkpoint again with `specdec convert --outtype`")
    if path is None:
        path = converted_gguf(name, dtype)
    info = read_info(path)
    tok = load_tokenizer(tokenizer) if tokenizer else gguf_tokenizer(info)
    runner = LlamaCppRunner(path, tokenizer=tok, max_model_len=max_model_len, vocab_size=vocab_size, info=info)
    return runner, _eos_token_ids(None, info, tok)


def converted_gguf(name: str, dtype: str = "auto") -> str:
    """The GGUF conversion of checkpoint ``name``, made once and cached under ~/.cache/specdec/gguf
    (SPECDEC_CACHE) by the checkpoint's contents and the weight type."""
    import json
    import sys

    from specdec.models.gguf import checkpoint_digest, convert

    path = resolve_model_path(name)
    if dtype == "auto":
        config = json.loads(Path(path, "config.json").read_text())
        dt = config.get("dtype") or config.get("torch_dtype")
        outtype = OUTTYPE_OF_DTYPE.get(dt, "f32")
    elif dtype in OUTTYPE_OF_DTYPE:
        outtype = OUTTYPE_OF_DTYPE[dtype]
    else:
        raise ValueError(f"dtype must be one of {list(OUTTYPE_OF_DTYPE)} or 'auto', got {dtype!r}")
    cache = timings.cache_dir() / "gguf"
    out = cache / f"{Path(path).name}-{checkpoint_digest(path)}-{outtype}.gguf"
    if not out.exists():
        print(f"specdec: converting {name} to GGUF ({outtype}) for llama.cpp, once: {out}", file=sys.stderr, flush=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            convert(path, str(tmp), outtype)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return str(out)


def gguf_tokenizer(info):
    """The tokenizer of a GGUF file: the HF tokenizer specdec stored in it, else transformers' reading of
    its llama.cpp vocabulary; None when neither works (prompts then go in as token ids)."""
    import json
    import tempfile
    import warnings

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


def _eos_token_ids(hf_model, config, tokenizer) -> set[int]:
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

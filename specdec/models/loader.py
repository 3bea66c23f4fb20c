"""Finding and loading checkpoints: local folders, hub ids and the pair shipped in the package.

Weights are read from safetensors only, and remote code is never run unless asked for.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import torch

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

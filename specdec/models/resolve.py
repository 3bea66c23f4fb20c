"""Step 1 of loading a model: what a name points to.

A name is a model shipped in the package, a checkpoint folder, a GGUF file (or a folder holding
one), or a Hugging Face hub id (downloaded once, safetensors only). ``resolve`` answers with one
``ModelSource``; the later steps (choose.py, load.py) read it and never look at the name again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from specdec.models.gguf import GGUFInfo, read_info

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED = {"specdec/demo-target": ASSETS / "demo-target", "specdec/demo-draft": ASSETS / "demo-draft",
           "specdec/demo-draft-vocab4k": ASSETS / "demo-draft-vocab4k", "specdec/demo-eagle3": ASSETS / "demo-eagle3",
           "specdec/demo-draft-pard": ASSETS / "demo-draft-pard"}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelSource:
    """A model name resolved to files."""

    name: str  # as given
    kind: str  # "shipped" | "folder" | "hub" (a Hugging Face checkpoint folder) | "gguf" (one GGUF file)
    path: str  # the checkpoint folder, or the GGUF file
    config: dict | None = None  # a checkpoint's config.json
    gguf: GGUFInfo | None = None  # a GGUF file's metadata

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"


def resolve(name: str) -> ModelSource:
    """The files ``name`` names; ValueError saying what to pass instead when it names none."""
    gguf_file = None if name in SHIPPED else find_gguf(name)
    if gguf_file is not None:
        return ModelSource(name, "gguf", gguf_file, gguf=read_info(gguf_file))
    kind = "shipped" if name in SHIPPED else "folder" if os.path.isdir(os.path.expanduser(name)) else "hub"
    path = resolve_model_path(name)
    config = json.loads(Path(path, "config.json").read_text())
    check_architecture(SimpleNamespace(**config))
    return ModelSource(name, kind, path, config=config)


def check_architecture(config) -> None:
    """ValueError unless ``config`` (attributes ``architectures``, ``model_type``) is one specdec runs."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs or getattr(config, 'model_type', '?')}; "
                         f"specdec runs {', '.join(SUPPORTED_ARCHITECTURES)} checkpoints")


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


def find_gguf(name: str) -> str | None:
    """The GGUF file ``name`` names: the file itself, or the one .gguf in a folder; None when it names
    neither (an HF checkpoint). ValueError for a folder with several."""
    p = Path(os.path.expanduser(name))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"GGUF file {name!r} does not exist; check the path, or convert a checkpoint "
                             "with `specdec convert HF_DIR --out X.gguf`")
        return str(p)
    if p.is_dir() and not (p / "config.json").exists():
        files = sorted(p.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"folder {name!r} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                             "pass the one to load")
        if files:
            return str(files[0])
    return None

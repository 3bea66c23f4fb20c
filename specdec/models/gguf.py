"""GGUF files: converting a Hugging Face checkpoint into one, and reading what specdec needs back.

``convert`` writes llama.cpp's tensor names and hyperparameters for the architectures specdec
loads (Llama, Mistral, Qwen2, Qwen3), with the ``gguf`` package; q8_0 and q4_k_m files are
quantized from a float32 one by llama.cpp's own ``llama_model_quantize``. The file also carries
the checkpoint's ``tokenizer.json`` and ``tokenizer_config.json`` (``tokenizer.huggingface.json``,
``specdec.tokenizer_config``, ``specdec.model_type``), so the tokenizer read back is the one
transformers builds from the checkpoint;
llama.cpp gets its own vocabulary (tokens, types, merges) beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.models.llamacpp_lib import load_library

OUTTYPES = ("f32", "bf16", "f16", "q8_0", "q4_k_m")
TOKENIZER_CONFIG_KEY = "specdec.tokenizer_config"
MODEL_TYPE_KEY = "specdec.model_type"  # the HF model_type: transformers picks the tokenizer class by it
# Hugging Face architecture -> (gguf architecture name, whether q/k rows are permuted back to
# llama.cpp's interleaved RoPE layout, as its convert_hf_to_gguf does for the llama architecture)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}


@dataclass
class GGUFInfo:
    """What specdec reads from a GGUF file's metadata."""

    path: str
    architecture: str
    weight_type: str  # the type most weights are stored in: F32, BF16, F16, Q8_0, Q4_K, ...
    context_length: int
    kv_width: int  # KV heads x head size: one layer's keys (or values) per position
    # the shape, under Hugging Face's config names (dtype_choice.largest_product reads them)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tokens: list[str]  # llama.cpp's vocabulary, in id order
    hf_tokenizer_json: str | None  # the converted checkpoint's tokenizer.json, when specdec wrote the file
    hf_tokenizer_config: str | None
    hf_model_type: str | None
    bos_token_id: int | None
    eos_token_id: int | None


def read_info(path: str) -> GGUFInfo:
    """The metadata of the GGUF file at ``path``; ValueError when it is not a readable GGUF file."""
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated, not GGUF, wrong version
        raise ValueError(f"{path!r} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it or "
                         "convert the checkpoint again with `specdec convert HF_DIR --out X.gguf`") from None

    def field(key: str, default=None):
        f = reader.get_field(key)
        return default if f is None else f.contents()

    arch = field("general.architecture", "?")
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    hidden = int(field(f"{arch}.embedding_length", 0) or 0)
    heads = int(field(f"{arch}.attention.head_count", 0) or 0)
    kv_heads = int(field(f"{arch}.attention.head_count_kv", 0) or heads)
    head_dim = int(field(f"{arch}.attention.key_length", 0) or hidden // max(1, heads))
    tokens = list(field("tokenizer.ggml.tokens", []) or [])
    return GGUFInfo(path=path, architecture=arch, weight_type=max(counts, key=counts.get) if counts else "F32",
                    context_length=int(field(f"{arch}.context_length", 0) or 0), kv_width=kv_heads * head_dim,
                    hidden_size=hidden, intermediate_size=int(field(f"{arch}.feed_forward_length", 0) or 0),
                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                    vocab_size=int(field(f"{arch}.vocab_size", 0) or len(tokens)),
                    tokens=tokens,
                    hf_tokenizer_json=field("tokenizer.huggingface.json"),
                    hf_tokenizer_config=field(TOKENIZER_CONFIG_KEY),
                    hf_model_type=field(MODEL_TYPE_KEY),
                    bos_token_id=field("tokenizer.ggml.bos_token_id"),
                    eos_token_id=field("tokenizer.ggml.eos_token_id"))


# -- conversion -------------------------------------------------------------------------------------


def convert(hf_dir: str, out: str, outtype: str = "f32", progress=None) -> str:
    """Write the checkpoint in ``hf_dir`` to the GGUF file ``out`` with weights of ``outtype``.
    ``progress``: called with a line of text as the conversion goes. An EAGLE-3 head folder becomes a
    file of llama.cpp's eagle3 architecture (models/gguf_eagle3.py)."""
    from specdec.models.gguf_eagle3 import convert_head, is_head_folder

    if is_head_folder(hf_dir):
        return convert_head(hf_dir, out, outtype, progress)
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    config = _read_config(hf_dir)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if outtype in ("q8_0", "q4_k_m"):
        # llama.cpp quantizes from a float file; float32 keeps every bit of a bf16 or f32 checkpoint
        with tempfile.TemporaryDirectory(dir=out_path.parent) as tmp:
            f32 = os.path.join(tmp, "f32.gguf")
            _write(hf_dir, config, f32, "f32", progress)
            _quantize(f32, str(out_path), outtype, progress)
    else:
        _write(hf_dir, config, str(out_path), outtype, progress)
    return str(out_path)


def checkpoint_digest(hf_dir: str) -> str:
    """A short hash of a checkpoint's contents (config, tokenizer, weights): the key of its cached conversion."""
    h = hashlib.sha256()
    for f in sorted(Path(hf_dir).iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".model", ".txt")):
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def _read_config(hf_dir: str) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{hf_dir!r} has no config.json; `specdec convert` takes a Hugging Face checkpoint folder")
    config = json.loads(path.read_text())
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if archs[0] not in ARCHITECTURES:
        raise ValueError(f"cannot convert architecture {archs[0]!r}; specdec converts {', '.join(ARCHITECTURES)} "
                         "checkpoints (for others use llama.cpp's convert_hf_to_gguf.py)")
    if not list(Path(hf_dir).glob("*.safetensors")):
        raise ValueError(f"{hf_dir!r} has no .safetensors weights; specdec converts safetensors checkpoints only")
    return config


def _write(hf_dir: str, config: dict, out: str, outtype: str, progress) -> None:
    import gguf
    from safetensors import safe_open

    hf_arch = config["architectures"][0]
    arch_name, permute = ARCHITECTURES[hf_arch]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    n_layers = config["num_hidden_layers"]
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    names = gguf.get_tensor_name_map(arch, n_layers)
    w = gguf.GGUFWriter(out, arch_name)

    w.add_name(Path(hf_dir).name)
    w.add_block_count(n_layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    w.add_rope_freq_base(float(theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type not in ("default", None):
        raise ValueError(f"cannot convert RoPE scaling {rope_type!r}; `specdec convert` handles default and linear "
                         "RoPE (use llama.cpp's convert_hf_to_gguf.py for this checkpoint)")
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                     "f16": gguf.LlamaFileType.MOSTLY_F16}[outtype])
    _add_vocabulary(w, hf_dir, config)

    tied = config.get("tie_word_embeddings", False)
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    count = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name == "lm_head.weight" and tied:
                    continue  # llama.cpp reads a missing output.weight as the token embeddings
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                new = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise ValueError(f"cannot map tensor {name!r} of {hf_arch} to a GGUF name")
                t = st.get_tensor(name).float()
                if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                    t = _permute(t, n_head)
                elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                    t = _permute(t, n_kv)
                _add_tensor(w, gguf, new, t.numpy(), outtype)
                count += 1
    if progress:
        progress(f"writing {count} tensors ({outtype}) to {out}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs, head by head."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _add_tensor(w, gguf, name: str, data: np.ndarray, outtype: str) -> None:
    """1-D tensors (norms, biases) stay float32, as llama.cpp expects; matrices take ``outtype``."""
    if data.ndim == 1 or outtype == "f32":
        w.add_tensor(name, data.astype(np.float32))
    elif outtype == "f16":
        w.add_tensor(name, data.astype(np.float16))
    else:  # bf16: rounded to nearest even, exact for weights that were bf16
        q = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.BF16)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.BF16)


def _add_vocabulary(w, hf_dir: str, config: dict) -> None:
    """llama.cpp's vocabulary (byte-level BPE as "gpt2" with merges; others as "llama" with zero
    scores, for loading: specdec tokenizes with the Hugging Face tokenizer stored beside it)."""
    import gguf
    from transformers import AutoTokenizer

    tok_json = Path(hf_dir) / "tokenizer.json"
    tok_cfg = Path(hf_dir) / "tokenizer_config.json"
    rows = config["vocab_size"]
    if not tok_json.exists():
        # no tokenizer: placeholder tokens, so llama.cpp loads; prompts go in as token ids
        w.add_tokenizer_model("llama")
        w.add_token_list([f"[T{i}]" for i in range(rows)])
        w.add_token_scores([0.0] * rows)
        w.add_token_types([gguf.TokenType.NORMAL] * rows)
        return
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    # ids past the embedding rows (tokens a tokenizer class adds on load) cannot be fed: left out,
    # as the torch runner cuts its vocabulary at the rows
    by_id = {i: t for t, i in tokenizer.get_vocab().items() if i < rows}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(rows):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    spec = json.loads(tok_json.read_text())
    model = spec.get("model", {})
    if model.get("type") == "BPE" and model.get("merges"):
        w.add_tokenizer_model("gpt2")
        pre = spec.get("pre_tokenizer") or {}
        w.add_tokenizer_pre("qwen2" if config["architectures"][0].startswith("Qwen") else
                            "gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "default")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        w.add_token_merges(merges)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * rows)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for setter, tid in ((w.add_bos_token_id, tokenizer.bos_token_id), (w.add_eos_token_id, tokenizer.eos_token_id),
                        (w.add_pad_token_id, tokenizer.pad_token_id), (w.add_unk_token_id, tokenizer.unk_token_id)):
        if isinstance(tid, int):
            setter(tid)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        w.add_chat_template(template)
    w.add_string(gguf.Keys.Tokenizer.HF_JSON, tok_json.read_text())
    if tok_cfg.exists():
        w.add_string(TOKENIZER_CONFIG_KEY, tok_cfg.read_text())
    w.add_string(MODEL_TYPE_KEY, config.get("model_type", ""))


def _quantize(src: str, dst: str, outtype: str, progress) -> None:
    llama_cpp = load_library()

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[outtype]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    if progress:
        progress(f"quantizing to {outtype} with llama.cpp")
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise ValueError(f"llama.cpp could not quantize {src!r} to {outtype} (code {rc})")


"""An EAGLE-3 head (models/eagle3.py) -> a GGUF file of llama.cpp's ``eagle3`` architecture.

llama.cpp runs such a head itself (src/models/eagle3.cpp): an encoder graph, ``fc`` over the target's
three concatenated layer inputs (after ``enc.output_norm`` with norm_before_fc), and a decoder graph,
the head's one layer over (token embedding, g) with the draft vocabulary scattered into the target's by
``d2t``. The names and keys below are those src/llama-arch.cpp reads for LLM_ARCH_EAGLE3:

    fc.weight  [3 Dt -> D]        enc.output_norm.weight  [3 Dt] (norm_before_fc only)
    blk.0.attn_norm (input_layernorm), blk.0.attn_norm_2 (hidden_norm), blk.0.attn_q/k/v/output,
    blk.0.ffn_norm (post_attention_layernorm), blk.0.ffn_gate/up/down, output_norm, output (lm_head)
    d2t  [Vd] int64, absolute target ids (our file keeps offsets: target id = i + d2t[i])
    eagle3.target_layers, eagle3.target_hidden_size, eagle3.norm_before_residual, eagle3.norm_before_fc

No token embedding is written: llama.cpp takes the target's from the context the head's context names
(``llama_context_params.ctx_other``). The vocabulary is placeholder tokens, as many as the target's
(llama.cpp sizes the scattered logits and checks token ids by it); specdec feeds token ids.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import torch

ARCH = "eagle3"
# q8_0 is written here (gguf-py's reference quantizer), not by llama.cpp's quantize, which does not
# know this architecture's tensors
OUTTYPES = ("f32", "bf16", "f16", "q8_0")
# our state-dict names -> llama.cpp's (the layer's as blk.0.*)
NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def is_head_folder(path: str) -> bool:
    """Whether ``path`` holds an EAGLE-3 head (its config.json names one) rather than a model."""
    import json

    from specdec.models.eagle3 import CONFIG_FILE, KNOWN_ARCHITECTURES

    p = Path(path) / CONFIG_FILE
    if not p.is_file():
        return False
    d = json.loads(p.read_text())
    arch = (d.get("architectures") or [None])[0]
    return arch in KNOWN_ARCHITECTURES or ("draft_vocab_size" in d and d.get("num_hidden_layers") == 1)


def convert_head(head_dir: str, out: str, outtype: str = "bf16", progress=None) -> str:
    """Write the head folder ``head_dir`` (config.json + model.safetensors) to the GGUF file ``out``."""
    from specdec.models.eagle3 import load_head, read_config

    c = read_config(head_dir)
    layers = c.target_num_layers or (max(c.layer_ids) + 1 if c.layer_ids else 0)
    if not layers:
        raise ValueError(f"{head_dir!r}: its config names neither the target's layer ids nor its layer count "
                         "(eagle_aux_hidden_state_layer_ids); add them to convert it")
    # load_head checks every tensor's shape against the config; the embedding it asks for is the
    # target's, which the file does not hold (a stand-in of the right shape, no memory)
    stand_in = torch.zeros(1, c.hidden_size).expand(c.vocab_size, c.hidden_size)
    head = load_head(head_dir, stand_in, layers)
    return write_head(head, out, outtype, Path(head_dir).name, progress)


def write_head(head, out: str, outtype: str = "f32", name: str = "eagle3-head", progress=None) -> str:
    """Write the loaded head ``head`` (models/eagle3.Eagle3Head) to ``out``; matrices in ``outtype``."""
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"an EAGLE-3 head converts to one of {OUTTYPES}, got {outtype!r}")
    c = head.config
    if len(c.layer_ids) != 3:
        raise ValueError(f"EAGLE-3 head {name!r}: needs its 3 target layer ids to convert, got {c.layer_ids!r}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, ARCH)
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_array(f"{ARCH}.target_layers", [int(i) for i in c.layer_ids])  # INT32, as llama.cpp reads them
    w.add_uint32(f"{ARCH}.target_hidden_size", c.target_hidden_size)
    w.add_bool(f"{ARCH}.norm_before_residual", bool(c.norm_before_residual))
    w.add_bool(f"{ARCH}.norm_before_fc", bool(c.norm_before_fc))
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                     "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype])
    w.add_tokenizer_model("llama")  # placeholder tokens: specdec feeds ids
    w.add_token_list([f"[T{i}]" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)

    state = head.state_dict()
    for key, gguf_name in NAMES.items():
        if key not in state:
            if key == "input_norm.weight":  # only a norm_before_fc head has it
                continue
            raise ValueError(f"EAGLE-3 head {name!r} lacks tensor {key}")
        t = state[key].detach().float().cpu()
        if key.endswith("q_proj.weight"):  # rotate-half rows -> llama.cpp's interleaved RoPE pairs
            t = _permute(t, c.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            t = _permute(t, c.num_key_value_heads)
        _add_tensor(w, gguf, gguf_name, t.numpy(), outtype)
    ids = head.draft_to_target.detach().cpu().numpy().astype(np.int64)  # [Vd] absolute target ids
    if ids.min() < 0 or ids.max() >= c.vocab_size or len(np.unique(ids)) != len(ids):
        raise ValueError(f"EAGLE-3 head {name!r}: its d2t maps draft ids outside the target's vocabulary of "
                         f"{c.vocab_size} tokens, or two onto one")
    w.add_tensor("d2t", ids, raw_dtype=gguf.GGMLQuantizationType.I64)
    if progress:
        progress(f"writing EAGLE-3 head {name} ({outtype}) to {out}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs, head by head (as gguf.py's for models)."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _add_tensor(w, gguf, name: str, data: np.ndarray, outtype: str) -> None:
    """Norms stay float32, as llama.cpp expects; matrices take ``outtype`` (bf16 rounded to nearest even,
    q8_0 in blocks of 32 with one f16 scale each)."""
    if data.ndim == 1 or outtype == "f32":
        w.add_tensor(name, data.astype(np.float32))
    elif outtype == "f16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType.Q8_0 if outtype == "q8_0" else gguf.GGMLQuantizationType.BF16
        w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)


def cached_head_gguf(head, outtype: str) -> str:
    """``head`` as a GGUF file of ``outtype``, written once per weights under ~/.cache/specdec/gguf
    (SPECDEC_CACHE), keyed by a hash of its config and tensors."""
    from specdec.models.timings import cache_dir

    h = hashlib.sha256(repr(head.config).encode())
    for key, t in sorted(head.state_dict().items()):
        if key == "embed_tokens":  # the target's, not part of the file
            continue
        h.update(key.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    out = cache_dir() / "gguf" / f"eagle3-head-{h.hexdigest()[:16]}-{outtype}.gguf"
    if not out.exists():
        print(f"specdec: converting the EAGLE-3 head to GGUF ({outtype}) for llama.cpp, once: {out}",
              file=sys.stderr, flush=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            write_head(head, str(tmp), outtype)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return str(out)

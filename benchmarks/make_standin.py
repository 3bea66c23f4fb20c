"""A stand-in with a larger model's cost and the shipped target's function: a padded copy that computes
exactly what the source computes, at the shape of a 0.5B-8B model
(or of a 68M-160M draft: pad the shipped drafts with --source).

Hidden dims past the source's stay 0: embeddings (and an untied head) are padded with zero columns,
o_proj and down_proj rows past them are zero. RMSNorm stays exact over the wider stream: eps is scaled
by d/D and the weights by sqrt(d/D). Source q heads sit where GQA maps them to their own kv head; a
wider head keeps the source's RoPE pairs at every m-th pair (same frequencies) and its q rows are scaled
by sqrt(m) for the wider head's 1/sqrt(head_dim). Extra q and kv heads, extra MLP units and extra layers
get random weights but zero o_proj / down_proj columns: they cost a full forward and add nothing.

Writes an HF folder (safetensors, config.json, the source's tokenizer files) and, with --gguf, GGUF
files: bf16 (specdec's converter) and q8_0, q4_0, q4_k_m (llama.cpp's llama_model_quantize from one
float32 conversion). Quantized files only approximate the source, as any quantization does.

    python benchmarks/make_standin.py [--source specdec/demo-target] [--shape tinyllama-1.1b]
        [--hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4 --layers 22 --head-dim 64]
        [--gguf bf16,q8_0,q4_0,q4_k_m] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    head_dim: int


# the models' own shapes; the vocabulary stays the source's
SHAPES = {
    "llama-68m": Shape(768, 3072, 12, 12, 2, 64),  # draft sizes (JackFram/llama-68m, -160m)
    "llama-160m": Shape(768, 3072, 12, 12, 12, 64),
    "qwen2.5-0.5b": Shape(896, 4864, 14, 2, 24, 64),
    "tinyllama-1.1b": Shape(2048, 5632, 32, 4, 22, 64),
    "llama-3.2-1b": Shape(2048, 8192, 32, 8, 16, 64),
    "llama-3.2-3b": Shape(3072, 8192, 24, 8, 28, 128),
    "llama-3.1-8b": Shape(4096, 14336, 32, 8, 32, 128),
}
GGUF_TYPES = ("bf16", "q8_0", "q4_0", "q4_k_m")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json")
INIT_STD = 0.02  # the random parts' weights: their values change nothing, only their cost counts


def shape_of(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(config["hidden_size"], config["intermediate_size"], heads, config.get("num_key_value_heads") or heads,
                 config["num_hidden_layers"], config.get("head_dim") or config["hidden_size"] // heads)


def fit(shape: Shape, source: Shape) -> tuple[Shape, list[str]]:
    """``shape`` made able to hold ``source`` exactly, and a note per change: at least the source's kv
    heads (each source kv head keeps its own), a GQA group at least the source's (its q heads share it).
    ValueError where no padding can hold it (a smaller dimension, a head size not a multiple)."""
    for name in ("hidden", "intermediate", "layers", "head_dim"):
        if getattr(shape, name) < getattr(source, name):
            raise ValueError(f"the stand-in's {name} {getattr(shape, name)} is smaller than the source's "
                             f"{getattr(source, name)}: a padded copy can only grow; pick a larger shape")
    if shape.head_dim % source.head_dim:
        raise ValueError(f"head_dim {shape.head_dim} is not a multiple of the source's {source.head_dim}: RoPE "
                         "pairs map exactly only onto every m-th pair of a head m times as wide")
    if shape.heads % shape.kv_heads:
        raise ValueError(f"heads {shape.heads} is not a multiple of kv heads {shape.kv_heads}")
    notes = []
    kv = max(shape.kv_heads, source.kv_heads)
    heads = max(-(-shape.heads // kv), source.heads // source.kv_heads) * kv  # about as many q heads as asked
    if (kv, heads) != (shape.kv_heads, shape.heads):
        notes.append(f"{heads} q heads / {kv} kv heads instead of {shape.heads} / {shape.kv_heads}: each of the "
                     f"source's {source.kv_heads} kv heads keeps a kv head of its own and its "
                     f"{source.heads // source.kv_heads} q heads a place in that head's group")
    if shape.hidden % heads:
        raise ValueError(f"hidden {shape.hidden} is not a multiple of {heads} q heads (transformers requires it); "
                         "give --hidden or --heads so that it is")
    return replace(shape, heads=heads, kv_heads=kv), notes


def pad_state(state: dict[str, torch.Tensor], config: dict, shape: Shape,
              seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """The padded copy of a Llama state dict (HF names) at ``shape`` (already ``fit``), and its config.
    Tensors keep the source's dtype."""
    src = shape_of(config)
    d, D, i, I_ = src.hidden, shape.hidden, src.intermediate, shape.intermediate
    hd, HD, m = src.head_dim, shape.head_dim, shape.head_dim // src.head_dim
    group, GROUP = src.heads // src.kv_heads, shape.heads // shape.kv_heads
    gen = torch.Generator().manual_seed(seed)
    dtype = state["model.embed_tokens.weight"].dtype

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * INIT_STD).to(dtype)

    def zeros(*size: int) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype)

    # a source head's dim e (rotate-half: pair e mod hd/2 of half e // (hd/2)) -> the wide head's dim
    half, HALF = hd // 2, HD // 2
    dims = torch.tensor([(e // half) * HALF + m * (e % half) for e in range(hd)])
    q_rows = torch.cat([(c * GROUP + j % group) * HD + dims for j in range(src.heads) for c in [j // group]])
    kv_rows = torch.cat([c * HD + dims for c in range(src.kv_heads)])
    norm_scale = math.sqrt(d / D)

    def norm(w: torch.Tensor | None) -> torch.Tensor:
        out = zeros(D) if w is not None else (torch.ones(D) * norm_scale).to(dtype)
        if w is not None:
            out[:d] = (w.float() * norm_scale).to(dtype)
        return out

    def projection(w: torch.Tensor, rows: torch.Tensor, n_rows: int, scale: float = 1.0) -> torch.Tensor:
        """q/k/v: random rows, the source's at ``rows``, zero beside them (a wide head's other dims read nothing)."""
        out = rand(n_rows, D)
        for h in (rows.view(-1, hd)[:, 0] // HD).tolist():  # the wide heads the source's heads sit in
            out[h * HD:(h + 1) * HD] = 0
        out[rows, :d] = (w.float() * scale).to(dtype)
        return out

    out: dict[str, torch.Tensor] = {}
    emb = state["model.embed_tokens.weight"]
    V = emb.shape[0]
    out["model.embed_tokens.weight"] = torch.cat([emb, zeros(V, D - d)], dim=1)
    if "lm_head.weight" in state and not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = torch.cat([state["lm_head.weight"], zeros(V, D - d)], dim=1)
    out["model.norm.weight"] = norm(state["model.norm.weight"])
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        real = layer < src.layers
        get = (lambda name: state[p + name]) if real else (lambda name: None)  # noqa: E731
        out[p + "input_layernorm.weight"] = norm(get("input_layernorm.weight"))
        out[p + "post_attention_layernorm.weight"] = norm(get("post_attention_layernorm.weight"))
        o = zeros(D, shape.heads * HD)  # only the source's heads write, into the source's dims
        down = zeros(D, I_)
        gate, up = rand(I_, D), rand(I_, D)
        if real:
            out[p + "self_attn.q_proj.weight"] = projection(get("self_attn.q_proj.weight"), q_rows,
                                                            shape.heads * HD, math.sqrt(m))
            out[p + "self_attn.k_proj.weight"] = projection(get("self_attn.k_proj.weight"), kv_rows,
                                                            shape.kv_heads * HD)
            out[p + "self_attn.v_proj.weight"] = projection(get("self_attn.v_proj.weight"), kv_rows,
                                                            shape.kv_heads * HD)
            o[:d, q_rows] = get("self_attn.o_proj.weight")
            gate[:i] = 0
            gate[:i, :d] = get("mlp.gate_proj.weight")
            up[:i] = 0
            up[:i, :d] = get("mlp.up_proj.weight")
            down[:d, :i] = get("mlp.down_proj.weight")
        else:
            out[p + "self_attn.q_proj.weight"] = rand(shape.heads * HD, D)
            out[p + "self_attn.k_proj.weight"] = rand(shape.kv_heads * HD, D)
            out[p + "self_attn.v_proj.weight"] = rand(shape.kv_heads * HD, D)
        out[p + "self_attn.o_proj.weight"] = o
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = down
    new = dict(config)
    new.update(hidden_size=D, intermediate_size=I_, num_attention_heads=shape.heads,
               num_key_value_heads=shape.kv_heads, num_hidden_layers=shape.layers, head_dim=HD,
               rms_norm_eps=config["rms_norm_eps"] * d / D)
    return out, new


def check_source(config: dict) -> None:
    arch = (config.get("architectures") or ["?"])[0]
    if arch != "LlamaForCausalLM":
        raise ValueError(f"the source must be a LlamaForCausalLM checkpoint, got {arch}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("the source has biases; make_standin pads bias-free Llama checkpoints only")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the source's activation is {config['hidden_act']!r}; make_standin pads silu MLPs only")


def build(source: str | Path, shape: Shape, out: str | Path, seed: int = 0, progress=print) -> Path:
    """Write the stand-in of checkpoint folder ``source`` at ``shape`` into the folder ``out`` (kept
    as is when its config.json exists) and return it."""
    from safetensors.torch import load_file, save_file

    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    check_source(config)
    shape, notes = fit(shape, shape_of(config))
    for note in notes:
        progress(f"note: {note}")
    if (out / "config.json").exists() and shape_of(json.loads((out / "config.json").read_text())) == shape:
        return out  # built before at this shape
    state = {}
    for f in sorted(source.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise ValueError(f"{source} has no .safetensors weights")
    padded, new_config = pad_state(state, config, shape, seed)
    n = sum(t.numel() for name, t in padded.items() if name != "lm_head.weight" or not new_config.get(
        "tie_word_embeddings"))
    progress(f"{n / 1e6:.1f}M parameters at {asdict(shape)} ({shape_of(config)} in the source)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(padded, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_gguf(hf: Path, outdir: Path, types: list[str], progress=print) -> dict[str, Path]:
    """GGUF files of the stand-in ``hf``: bf16 by specdec's converter; q8_0, q4_0 and q4_k_m quantized
    by llama.cpp from one float32 conversion (deleted after). Existing files are kept."""
    from specdec.models.gguf import convert
    from specdec.models.llamacpp_lib import load_library

    paths = {t: outdir / f"{hf.name}-{t}.gguf" for t in types}
    if "bf16" in types and not paths["bf16"].exists():
        convert(str(hf), str(paths["bf16"]), "bf16", progress=progress)
    quantized = [t for t in types if t != "bf16" and not paths[t].exists()]
    if quantized:
        lib = load_library()
        ftypes = {"q8_0": lib.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": lib.LLAMA_FTYPE_MOSTLY_Q4_0,
                  "q4_k_m": lib.LLAMA_FTYPE_MOSTLY_Q4_K_M}
        with tempfile.TemporaryDirectory(dir=outdir) as tmp:
            f32 = os.path.join(tmp, "f32.gguf")
            convert(str(hf), f32, "f32", progress=progress)
            for t in quantized:
                params = lib.llama_model_quantize_default_params()
                params.ftype = ftypes[t]
                params.nthread = os.cpu_count() or 1
                progress(f"quantizing to {t} with llama.cpp")
                if lib.llama_model_quantize(f32.encode(), str(paths[t]).encode(), params) != 0:
                    raise ValueError(f"llama.cpp could not quantize the stand-in to {t}")
    return paths


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Shape]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="specdec/demo-target", help="an HF Llama folder or a shipped model's name")
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=sorted(SHAPES),
                    help="the model whose shape the stand-in takes (dims given below override it)")
    for name in ("hidden", "intermediate", "heads", "kv-heads", "layers", "head-dim"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--gguf", default="", help=f"comma-separated GGUF types to write: {','.join(GGUF_TYPES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for the HF stand-in (default "
                    "~/.cache/specdec/standin-SOURCE-SHAPE); GGUF files go beside it")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    dims = {f: getattr(args, f) for f in asdict(shape) if getattr(args, f, None) is not None}
    for f, v in dims.items():
        if v < 1:
            ap.error(f"--{f.replace('_', '-')} must be at least 1, got {v}")
    bad = [t for t in filter(None, args.gguf.split(",")) if t not in GGUF_TYPES]
    if bad:
        ap.error(f"--gguf takes {', '.join(GGUF_TYPES)}; got {', '.join(bad)}")
    return args, replace(shape, **dims)


def main(argv: list[str] | None = None) -> None:
    from specdec.models.resolve import resolve

    args, shape = parse_args(argv)
    source = resolve(args.source)
    if source.is_gguf:
        raise SystemExit(f"--source must be an HF checkpoint folder, got the GGUF file {source.path}")
    named = shape == SHAPES[args.shape]
    dims = f"{shape.hidden}h-{shape.intermediate}i-{shape.heads}q{shape.kv_heads}kv-{shape.layers}l-{shape.head_dim}d"
    name = f"standin-{Path(source.path).name}-{args.shape if named else dims}"
    default = Path("~/.cache/specdec").expanduser() / name
    out = Path(args.out).expanduser() if args.out else default
    hf = build(source.path, shape, out, args.seed)
    print(hf)
    types = [t for t in args.gguf.split(",") if t]
    for t, path in write_gguf(hf, hf.parent, types).items() if types else ():
        print(path)


if __name__ == "__main__":
    main()

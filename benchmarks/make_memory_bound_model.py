"""Build a 287M-parameter Llama with random weights, the size at which CPU decoding is bound by memory.

hidden 1024, 24 layers, 16 query / 4 KV heads, MLP 2816, vocab 8192 (the shipped pair's tokenizer), untied
head: 287.3M parameters. Writes the HF checkpoint (bf16) and its bf16 and q8_0 GGUF files:

    python benchmarks/make_memory_bound_model.py --out ~/.cache/specdec/mem287m
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from specdec.models.gguf import convert
from specdec.models.resolve import SHIPPED


def build(out: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = out / "hf"
    if (hf / "config.json").exists():
        return hf
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-6,
                         initializer_range=0.02, dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(hf, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED["specdec/demo-target"] / f, hf / f)
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path("~/.cache/specdec/mem287m").expanduser()))
    args = ap.parse_args()
    out = Path(args.out).expanduser()
    hf = build(out)
    for outtype in ("bf16", "q8_0"):
        path = out / f"mem287m-{outtype}.gguf"
        if not path.exists():
            convert(str(hf), str(path), outtype, progress=print)
        print(path)


if __name__ == "__main__":
    main()

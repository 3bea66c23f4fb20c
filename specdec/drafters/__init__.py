"""Drafters: one module per method, all behind ``drafters.base.Drafter``."""

from __future__ import annotations

from specdec.config import SpeculativeConfig
from specdec.drafters.base import DraftProposal, Drafter
from specdec.models.base import ModelRunner

__all__ = ["DraftProposal", "Drafter", "build_drafter"]


def build_drafter(spec: SpeculativeConfig, target: ModelRunner, dtype: str, device: str) -> Drafter:
    drafter = _build(spec, target, dtype, device)
    if spec.enable_suffix_decoding:
        from specdec.drafters.hybrid import HybridDrafter

        return HybridDrafter(_suffix(spec), drafter, spec.suffix_decoding_min_score)
    return drafter


def _suffix(spec: SpeculativeConfig) -> Drafter:
    from specdec.drafters.suffix import SuffixDrafter

    return SuffixDrafter(max_tree_depth=spec.suffix_decoding_max_tree_depth,
                         max_cached_requests=spec.suffix_decoding_max_cached_requests,
                         max_spec_factor=spec.suffix_decoding_max_spec_factor,
                         min_token_prob=spec.suffix_decoding_min_token_prob)


def _build(spec: SpeculativeConfig, target: ModelRunner, dtype: str, device: str) -> Drafter:
    if spec.method == "draft_model":
        from specdec.drafters.draft_model import DraftModelDrafter
        from specdec.models.gguf import find_gguf
        from specdec.models.loader import SHIPPED, check_same_vocabulary, load_runner

        # the draft runs where the target does; a GGUF draft runs on llama.cpp whatever the target's backend
        is_gguf = spec.model not in SHIPPED and find_gguf(spec.model) is not None
        backend = "llama.cpp" if is_gguf or getattr(target, "backend", "torch") == "llama.cpp" else "torch"
        runner, _ = load_runner(spec.model, backend, "auto" if is_gguf else dtype, device,
                                vocab_size=target.vocab_size)
        check_same_vocabulary(getattr(target, "tokenizer", None), runner.tokenizer, "target", spec.model)
        if runner.vocab_size < target.vocab_size:
            raise ValueError(f"draft {spec.model!r} has {runner.vocab_size} vocabulary rows but the target's "
                             f"vocabulary has {target.vocab_size} tokens; use a draft from the target's model family")
        runner.max_model_len = min(runner.max_model_len, target.max_model_len)
        return DraftModelDrafter(runner, spec.draft_p_min)
    if spec.method == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return _suffix(spec)
    if spec.method == "layer_skip":
        from specdec.drafters.layer_skip import LayerSkipDrafter
        from specdec.models.loader import _LAYER_SKIP

        if getattr(target, "backend", "torch") == "llama.cpp":
            raise ValueError(_LAYER_SKIP)

        return LayerSkipDrafter(target, spec.num_draft_layers, spec.draft_p_min)
    raise ValueError(f"unknown speculative method {spec.method!r}")

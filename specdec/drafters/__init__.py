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
        from specdec.models.llama import LlamaRunner
        from specdec.models.loader import check_same_vocabulary, load_model

        loaded = load_model(spec.model, dtype=dtype, device=device)
        check_same_vocabulary(getattr(target, "tokenizer", None), loaded.tokenizer, "target", spec.model)
        rows = loaded.hf_model.get_input_embeddings().weight.shape[0]
        if rows < target.vocab_size:
            raise ValueError(f"draft {spec.model!r} has {rows} embedding rows but the target's vocabulary has "
                             f"{target.vocab_size} tokens; use a draft from the target's model family")
        runner = LlamaRunner(loaded, max_model_len=min(target.max_model_len,
                                                       loaded.config.max_position_embeddings),
                             vocab_size=target.vocab_size)
        return DraftModelDrafter(runner, spec.draft_p_min)
    if spec.method == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return _suffix(spec)
    if spec.method == "layer_skip":
        from specdec.drafters.layer_skip import LayerSkipDrafter

        return LayerSkipDrafter(target, spec.num_draft_layers, spec.draft_p_min)
    raise ValueError(f"unknown speculative method {spec.method!r}")

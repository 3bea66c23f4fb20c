"""Drafters: one module per method, all behind ``drafters.base.Drafter``."""

from __future__ import annotations

from specdec.config import SpeculativeConfig
from specdec.drafters.base import DraftProposal, Drafter
from specdec.models.base import ModelRunner

__all__ = ["DraftProposal", "Drafter", "build_drafter"]


def build_drafter(spec: SpeculativeConfig, target: ModelRunner, draft=None) -> Drafter:
    """The drafter ``spec`` names, beside ``target``. ``draft``: what ``spec.model`` names, loaded by
    the caller (``LLM`` resolves, chooses and loads it with the target): the draft model's runner for
    method draft_model, the EAGLE-3 head (models/eagle3.Eagle3Head) for eagle3; config.py lets a
    method list hold only one of the two.
    Several methods: a ChoosingDrafter over one drafter each, picked per request and round."""
    if len(spec.methods) > 1:
        from specdec.drafters.choice import ChoosingDrafter, member_config

        return ChoosingDrafter({m: build_drafter(member_config(spec, m), target, draft) for m in spec.methods})
    drafter = _build(spec, target, draft)
    drafter.method = spec.method
    if spec.enable_suffix_decoding:
        from specdec.drafters.hybrid import HybridDrafter

        drafter = HybridDrafter(_suffix(spec), drafter, spec.suffix_decoding_min_score)
        drafter.method = spec.method
    return drafter


def _suffix(spec: SpeculativeConfig) -> Drafter:
    from specdec.drafters.suffix_native import suffix_drafter

    return suffix_drafter(max_tree_depth=spec.suffix_decoding_max_tree_depth,
                          max_cached_requests=spec.suffix_decoding_max_cached_requests,
                          max_spec_factor=spec.suffix_decoding_max_spec_factor,
                          min_token_prob=spec.suffix_decoding_min_token_prob,
                          probability=spec.suffix_decoding_probability)


def _build(spec: SpeculativeConfig, target: ModelRunner, draft) -> Drafter:
    if spec.method == "draft_model":
        from specdec.drafters.draft_model import DraftModelDrafter

        if draft is None:
            raise ValueError("method draft_model needs the draft model's runner (LLM loads it from spec.model)")
        vocab_map = _check_draft(target, draft, spec.model)
        if spec.parallel_drafting:
            return _parallel_draft(spec, target, draft, vocab_map)
        if vocab_map is not None:  # another tokenizer: drafts mapped into the target's tokens
            from specdec.drafters.other_vocab import OtherVocabDrafter

            return OtherVocabDrafter(draft, target.tokenizer, vocab_map, spec.draft_tokenizer_mapping,
                                     spec.draft_p_min, spec.model)
        draft.max_model_len = min(draft.max_model_len, target.max_model_len)
        return DraftModelDrafter(draft, spec.draft_p_min)
    if spec.method == "eagle3":
        from specdec.drafters.eagle3 import Eagle3Drafter
        from specdec.models.eagle3 import Eagle3Head

        if not isinstance(draft, Eagle3Head):
            raise ValueError("method eagle3 needs the EAGLE-3 head (LLM loads it from spec.model)")
        return Eagle3Drafter(draft, target, spec.draft_p_min, quantization=spec.quantization)
    if spec.method == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return _suffix(spec)
    if spec.method == "layer_skip":
        from specdec.drafters.layer_skip import LayerSkipDrafter

        if not target.can_run_layer_subsets:
            raise ValueError(f"layer_skip needs a target that runs its first layers alone; the {target.backend} "
                             "backend cannot do that (use backend='torch', or method draft_model, ngram or suffix)")
        return LayerSkipDrafter(target, spec.num_draft_layers, spec.draft_p_min)
    raise ValueError(f"unknown speculative method {spec.method!r}")


def _parallel_draft(spec: SpeculativeConfig, target: ModelRunner, draft: ModelRunner, vocab_map) -> Drafter:
    """The PARD drafter (drafters/pard.py) over ``draft``, its mask token and trained k read from the
    draft's config.json; a ValueError when the draft lacks them or has another tokenizer."""
    from specdec.drafters.pard import ParallelDraftDrafter, pard_settings
    from specdec.models.resolve import resolve

    if vocab_map is not None:
        raise ValueError(f"parallel_drafting: draft {spec.model!r} has another tokenizer than the target's; a "
                         "parallel draft must share the target's vocabulary")
    source = resolve(spec.model)
    rows = (source.config or {}).get("vocab_size", draft.vocab_size)
    mask, max_k = pard_settings(source.config, spec.model, spec.num_speculative_tokens, rows)
    draft.max_model_len = min(draft.max_model_len, target.max_model_len)
    return ParallelDraftDrafter(draft, mask, max_k, spec.draft_p_min)


def _check_draft(target: ModelRunner, draft: ModelRunner, name: str):
    """None when draft and target map the same strings to the same ids (padded embedding rows don't
    matter) and the draft has a row for every token of the target's vocabulary; the map between the
    two tokenizers (drafters/vocab_map.py) when they differ; a ValueError naming the pair when they
    cannot be mapped. A draft without a tokenizer is taken to share the target's."""
    from specdec.drafters.vocab_map import VocabMap, same_vocabulary

    if not same_vocabulary(target.tokenizer, draft.tokenizer):
        tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        pair = (f"draft {name!r} and target have different vocabularies ({len(dv)} vs {len(tv)} tokens; "
                f"{len(set(tv.items()) - set(dv.items()))} target and {len(set(dv.items()) - set(tv.items()))} "
                "draft entries differ)")
        return VocabMap.build(target.tokenizer, draft.tokenizer, target.vocab_size, draft.vocab_size, pair)
    if draft.vocab_size < target.vocab_size:
        raise ValueError(f"draft {name!r} has {draft.vocab_size} vocabulary rows but the target's vocabulary has "
                         f"{target.vocab_size} tokens; use a draft from the target's model family, or give the "
                         "draft folder its own tokenizer files if its vocabulary is another one")
    return None

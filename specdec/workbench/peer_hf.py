"""Hugging Face transformers as a peer in ``specdec bench --peer hf``.

Two more sides join the bench's rotation, on the same checkpoints, prompts (the same token ids),
greedy settings, stop tokens and token budget, in the same process:
- ``hf_ar``: the target's plain ``generate``;
- ``hf_spec``: transformers' own speculative decoding: assisted generation with
  ``assistant_model=`` for ``draft_model``, prompt lookup (``prompt_lookup_num_tokens=``) for
  ``ngram``, and ``assistant_early_exit=`` for ``layer_skip``. Suffix decoding has no transformers
  counterpart.
Outputs must agree token for token with specdec's plain greedy output; a divergence counts as
agreement only at a near-tie, where the target's top-2 logit gap (computed with the HF model) at the
first differing position is below 1e-3 (docs/algorithm.md).
"""

from __future__ import annotations

from specdec.bench import BenchResult, run_bench
from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.near_tie import first_mismatch

NEAR_TIE = 1e-3


class HFPeer:
    """Loads the target (and draft) with transformers and runs ``generate`` for one prompt at a time."""

    def __init__(self, spec_llm: LLM, params: SamplingParams, dtype: str = "auto", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        from specdec.models.dtype_choice import torch_dtype as _torch_dtype
        from specdec.models.resolve import resolve_model_path

        if not params.greedy:
            raise ValueError("--peer hf compares greedy outputs token for token; use --temperature 0")
        spec = spec_llm.speculative_config
        if spec is None or spec.num_speculative_tokens == 0:
            raise ValueError("--peer hf needs a drafter: pass --draft D or --speculative-config")
        if spec.method == "suffix":
            raise ValueError("transformers has no suffix-decoding counterpart; --peer hf supports draft_model, "
                             "ngram (prompt lookup) and layer_skip (assistant_early_exit)")
        self.torch = torch
        self.llm, self.spec, self.params = spec_llm, spec, params
        self.device = device
        path = resolve_model_path(spec_llm.model_config.model)
        from transformers import AutoConfig

        torch_dtype = _torch_dtype(dtype, AutoConfig.from_pretrained(path), device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
        self.k = spec.num_speculative_tokens
        eos = sorted(spec_llm.engine.detokenizer.eos_token_ids)
        self.common = {"max_new_tokens": params.max_tokens, "do_sample": False, "num_beams": 1,
                       "eos_token_id": eos or None, "pad_token_id": eos[0] if eos else 0,
                       "temperature": None, "top_p": None, "top_k": None}
        self.assisted: dict = {}
        self.draft = None
        if spec.method == "draft_model":
            self.draft = AutoModelForCausalLM.from_pretrained(resolve_model_path(spec.model),
                                                              dtype=torch_dtype).to(device).eval()
            self.assisted = {"assistant_model": self.draft}
        elif spec.method == "ngram":
            self.assisted = {"prompt_lookup_num_tokens": self.k, "max_matching_ngram_size": spec.prompt_lookup_max}
        else:  # layer_skip
            layers = spec.num_draft_layers or max(1, self.model.config.num_hidden_layers // 4)
            self.assisted = {"assistant_early_exit": layers, "num_assistant_tokens": self.k,
                             "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}

    def _reset_assistant(self) -> None:
        """transformers keeps the assistant's k in its generation config between calls; start each run equal."""
        if self.draft is None:
            return
        gc = self.draft.generation_config
        gc.num_assistant_tokens = self.k
        # specdec's adaptive k vs fixed k: transformers' "heuristic" schedule vs "constant"
        gc.num_assistant_tokens_schedule = "heuristic" if self.spec.adaptive else "constant"
        gc.assistant_confidence_threshold = self.spec.draft_p_min  # specdec's draft_p_min; 0 never stops early

    def _ids(self, prompt) -> list[int]:
        return self.llm.tokenize(prompt["prompt"] if isinstance(prompt, dict) and "prompt" in prompt
                                  and "prompt_token_ids" not in prompt else prompt)

    def generate(self, prompt, assisted: bool) -> list[int]:
        ids = self._ids(prompt)
        x = self.torch.tensor([ids], device=self.device)
        kwargs = dict(self.common)
        if assisted:
            self._reset_assistant()
            kwargs.update(self.assisted)
        with self.torch.inference_mode():
            out = self.model.generate(x, attention_mask=self.torch.ones_like(x), **kwargs)
        return out[0, len(ids):].tolist()

    def top2_gap(self, ids: list[int]) -> float:
        with self.torch.inference_mode():
            logits = self.model(self.torch.tensor([ids], device=self.device)).logits[0, -1]
        top = logits.float().topk(2).values
        return float(top[0] - top[1])


def run_bench_with_hf(ar_llm: LLM, spec_llm: LLM, prompts: list, params: SamplingParams, repeats: int = 1,
                      dtype: str = "auto", device: str = "cpu") -> BenchResult:
    """``run_bench`` with transformers' plain and assisted ``generate`` in the same rotation; adds
    ``hf_ar``, ``hf_spec``, ``speedup_vs_hf`` and ``hf_agreement`` to the result's ``extra``."""
    _quiet_generation_warnings()
    peer = HFPeer(spec_llm, params, dtype=dtype, device=device)
    result = run_bench(ar_llm, spec_llm, prompts, params, repeats=repeats,
                       peers={"hf_ar": lambda p: peer.generate(p, assisted=False),
                              "hf_spec": lambda p: peer.generate(p, assisted=True)})
    totals = result.peers()
    hf_ar, hf_spec = totals["hf_ar"], totals["hf_spec"]
    hf_ar["method"] = "transformers generate (greedy)"
    hf_spec["method"] = {"draft_model": f"transformers assisted generation (assistant_model, {peer.k} tokens, "
                                        f"{'heuristic' if peer.spec.adaptive else 'constant'} schedule)",
                         "ngram": f"transformers prompt lookup (prompt_lookup_num_tokens={peer.k})",
                         "layer_skip": "transformers assistant_early_exit"}[peer.spec.method]
    spec_tps = result.spec_tokens_per_s
    result.extra.update({
        "hf_ar": hf_ar, "hf_spec": hf_spec,
        "speedup_vs_hf": spec_tps / hf_spec["tokens_per_s"] if hf_spec["tokens_per_s"] else 0.0,
        "speedup_vs_hf_ar": spec_tps / hf_ar["tokens_per_s"] if hf_ar["tokens_per_s"] else 0.0,
        "hf_spec_speedup": hf_spec["tokens_per_s"] / hf_ar["tokens_per_s"] if hf_ar["tokens_per_s"] else 0.0,
        "hf_agreement": _agreement(peer, prompts, result),
    })
    return result


def _agreement(peer: HFPeer, prompts: list, result: BenchResult) -> dict:
    """Every side's output against specdec's plain greedy output: identical, or parting at a near-tie."""
    out = {}
    for side in ("spec", "hf_ar", "hf_spec"):
        exact, near_tie, mismatched = 0, 0, []
        for i, (prompt, run) in enumerate(zip(prompts, result.runs)):
            ref, got = run.outputs["ar"], run.outputs[side]
            j = first_mismatch(ref, got)
            if j is None:
                exact += 1
                continue
            if j >= min(len(ref), len(got)):  # one stopped earlier: no token to compare, not a near-tie
                mismatched.append({"prompt": i, "first_mismatch": j, "gap": None})
                continue
            gap = peer.top2_gap(peer._ids(prompt) + ref[:j])
            if gap < NEAR_TIE:
                near_tie += 1
            else:
                mismatched.append({"prompt": i, "first_mismatch": j, "gap": gap})
        out[side] = {"exact": exact, "near_tie": near_tie, "agree": exact + near_tie, "total": len(result.runs),
                     "mismatched": mismatched}
    out["all_agree"] = all(out[s]["agree"] == out[s]["total"] for s in ("spec", "hf_ar", "hf_spec"))
    return out


def _quiet_generation_warnings() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # cosmetic only
        pass

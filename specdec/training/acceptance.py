"""How often a target accepts a draft's tokens: the number that decides whether a draft pays.

Runs speculative decoding with k fixed (adaptive off, so every round drafts k tokens and the
per-position rates are comparable between drafts) over held-out prompts and reads specdec's
metrics: acceptance rate, acceptance per draft position (share of rounds whose positions 1..j
were all accepted) and tau, the mean tokens per verify pass with the bonus token included.
"""

from __future__ import annotations


def draft_acceptance(target: str, draft: str, prompts: list, k: int = 4, max_tokens: int = 64,
                     temperature: float = 0.0, seed: int | None = 0, dtype: str = "auto", device: str = "cpu",
                     method: str = "draft_model", backend: str = "auto", **speculative) -> dict:
    """Acceptance of ``draft`` by ``target`` (names or folders) over ``prompts`` (text or token-id lists);
    ``method``: how ``draft`` drafts ("draft_model", or "eagle3" for an EAGLE-3 head); ``speculative``:
    further speculative_config keys (e.g. ``parallel_drafting=True``)."""
    from specdec import LLM, SamplingParams

    if not prompts:
        raise ValueError("draft_acceptance needs at least one prompt")
    llm = LLM(target, dtype=dtype, device=device, backend=backend,
              speculative_config={"method": method, "model": draft, "num_speculative_tokens": k, "adaptive": False,
                                  **speculative})
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            seed=None if temperature == 0 else seed)
    llm.generate([{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts], params)
    m = llm.get_metrics()
    return {"k": k, "temperature": temperature, "prompts": len(prompts), "max_tokens": max_tokens,
            "num_drafts": m["num_drafts"], "acceptance_rate": m["acceptance_rate"],
            "acceptance_rate_per_pos": m["acceptance_rate_per_pos"],
            "mean_acceptance_length": m["mean_acceptance_length"]}


def format_acceptance(r: dict) -> str:
    per_pos = " / ".join(f"{a:.2f}" for a in r["acceptance_rate_per_pos"])
    return (f"acceptance {r['acceptance_rate']:.3f}, per position {per_pos}, tau {r['mean_acceptance_length']:.2f} "
            f"(k={r['k']} fixed, temperature {r['temperature']:g}, {r['prompts']} prompts x {r['max_tokens']} tokens)")

"""``specdec verify-lossless``: a statistical self-test that sampled output has the target's exact distribution.

For each prompt and sampling setting it draws the first two generated tokens N times through the
engine (one batched ``LLM.generate`` call, seeds 0..N-1; seeded requests keep k fixed) and compares
their joint distribution with the target's exact probabilities, computed by target forwards on the
prompt and on the prompt plus each first token, with the request's own logit processing
(``specdec.sampling.probs_from_logits``). Pearson's chi-square test, bins expecting fewer than 5
samples merged into one; the family-wise false-alarm rate is split over the tests (Bonferroni), so a
correct engine fails the whole run with probability at most ``false_alarm``.

The first-token values whose expected count is below 5 are pooled into one bin before their
second-token distributions are needed, so only a bounded number of target forwards is run even for
a large vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.models.base import next_token_logits
from specdec.sampling import SamplingBatch, probs_from_logits

ROW_TAG = "__specdec_lossless__"  # the cache rows its next-token probes use, apart from the engine's

SETTINGS: list[tuple[str, dict]] = [
    ("temperature=1", {"temperature": 1.0}),
    ("top_k=8", {"temperature": 1.0, "top_k": 8}),
    ("top_p=0.8", {"temperature": 1.0, "top_p": 0.8}),
]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
ID_PROMPTS = [[1, 5, 9, 3], [1, 7, 7, 12, 4]]  # for a model folder without a tokenizer
MIN_EXPECTED = 5.0
NUM_TOKENS = 2  # tokens per sample whose joint distribution is tested
CHUNK = 64  # rows per target forward when computing second-token distributions


def verify_lossless(llm: LLM, samples: int = 2000, false_alarm: float = 1e-3,
                    prompts: list | None = None, settings: list[tuple[str, dict]] | None = None,
                    progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict:
    """Run the tests on ``llm`` (a speculative LLM); returns the result dict (``passed``, per-test p-values)."""
    if not (isinstance(samples, int) and samples >= 10):
        raise ValueError(f"--samples must be an integer >= 10, got {samples!r}")
    if not (0 < false_alarm < 1):
        raise ValueError(f"the false-alarm rate must be in (0, 1), got {false_alarm!r}")
    spec = llm.speculative_config
    if spec is None or spec.num_speculative_tokens == 0:
        raise ValueError("verify-lossless tests speculative decoding: pass a --speculative-config that drafts tokens")
    settings = settings or SETTINGS
    prompt_ids = _prompt_ids(llm, prompts)
    num_tests = len(prompt_ids) * len(settings)
    threshold = false_alarm / num_tests
    tick = progress or (lambda desc, total: (lambda: None))
    advance = tick("sampling and testing", num_tests)
    tests = []
    for ids in prompt_ids:
        for name, setting in settings:
            tests.append(_one_test(llm, ids, name, setting, samples, threshold))
            advance()
    passed = all(t["passed"] for t in tests)
    return {
        "passed": passed, "verdict": "PASS" if passed else "FAIL", "false_alarm": false_alarm,
        "num_tests": num_tests, "threshold_per_test": threshold, "samples_per_test": samples,
        "tokens_per_sample": NUM_TOKENS, "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
        "tests": tests,
        "note": (f"chi-square on the joint distribution of the first {NUM_TOKENS} generated tokens; bins expecting "
                 f"< {MIN_EXPECTED:g} samples merged; Bonferroni: each test fails a correct engine with "
                 f"probability {threshold:.2g}, the whole run with at most {false_alarm:.2g}"),
    }


def _one_test(llm: LLM, ids: list[int], name: str, setting: dict, n: int, threshold: float) -> dict:
    params = [SamplingParams(max_tokens=NUM_TOKENS + 1, seed=i, ignore_eos=True, **setting) for i in range(n)]
    before = llm.get_metrics()
    outs = llm.generate([{"prompt_token_ids": ids}] * n, params)
    after = llm.get_metrics()
    tokens = torch.tensor([o.outputs[0].token_ids[:NUM_TOKENS] for o in outs])  # [n, 2]

    probs, first = exact_joint(llm, ids, params[0], n)  # [bins], first-token ids with their own bins
    V = llm.engine.target.vocab_size
    slot = torch.full((V,), -1, dtype=torch.long)
    slot[first] = torch.arange(len(first))
    s = slot[tokens[:, 0]]
    bins = torch.where(s >= 0, s * V + tokens[:, 1], torch.full_like(s, len(first) * V))  # last bin: other t1
    observed = torch.bincount(bins, minlength=len(probs)).double()
    statistic, df, p_value, impossible = chi_square(observed, probs)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {"prompt_token_ids": ids, "setting": name, "samples": n, "statistic": statistic, "df": df,
            "p_value": p_value, "threshold": threshold, "passed": p_value > threshold,
            "impossible_outcomes": impossible, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0}


def exact_joint(llm: LLM, ids: list[int], params: SamplingParams, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact probabilities of (t1, t2) after the request's logit processing.

    Returns (probs, first): probs[j * V + t2] = p(first[j]) p(t2 | first[j]) for the first tokens whose
    expected count n·p(t1) reaches MIN_EXPECTED, then one last bin holding P(t1 not in first)."""
    target = llm.engine.target
    device = llm.engine.device
    sb = SamplingBatch.from_params([params], device)
    if llm.engine.has_unfinished():
        raise RuntimeError("exact_joint needs an idle engine")
    p1 = probs_from_logits(next_token_logits(target, [ids], ROW_TAG), sb)[0].double().cpu()  # [V]
    first = torch.nonzero(p1 * n >= MIN_EXPECTED).flatten()
    if first.numel() == 0:
        first = p1.argmax().view(1)
    rows = []
    for start in range(0, len(first), CHUNK):
        chunk = first[start:start + CHUNK].tolist()
        logits = next_token_logits(target, [ids + [t] for t in chunk], ROW_TAG)  # [b, V]
        rows.append(probs_from_logits(logits, SamplingBatch.from_params([params] * len(chunk), device)).double().cpu())
    p2 = torch.cat(rows)  # [len(first), V]
    joint = (p1[first][:, None] * p2).flatten()
    other = (1.0 - p1[first].sum()).clamp(min=0.0)
    return torch.cat([joint, other.view(1)]), first


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float, int]:
    """Pearson chi-square of counts ``observed`` against ``probs``; bins expecting < 5 merged into one.
    Returns (statistic, degrees of freedom, p-value, samples in zero-probability bins). A sample the
    target gives probability 0 is proof of a broken engine: p-value 0."""
    n = observed.sum()
    impossible = int(observed[probs <= 0].sum())
    if impossible:
        return float("inf"), 0, 0.0, impossible
    expected = probs * n
    small = expected < MIN_EXPECTED
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    df = int(obs.numel()) - 1
    if df < 1:
        return statistic, 0, 1.0, 0
    # chi2.sf(x, df) = Q(df/2, x/2), the regularized upper incomplete gamma function
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, df, p, 0


def _prompt_ids(llm: LLM, prompts: list | None) -> list[list[int]]:
    V = llm.engine.target.vocab_size
    if prompts:
        if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("this model folder has no tokenizer, so text prompts cannot be encoded; omit --prompt "
                             "to use the built-in token-id prompts")
        out = [llm.tokenize(p) for p in prompts]
    elif llm.tokenizer is not None:
        out = [llm.tokenize(p) for p in TEXT_PROMPTS]
    else:
        out = [[t % V for t in p] for p in ID_PROMPTS]
    for ids in out:
        if not ids:
            raise ValueError("a prompt tokenized to nothing; pass a longer one")
    return out


def format_result(r: dict) -> list[str]:
    lines = [f"{r['verdict']}: {r['method']} k={r['num_speculative_tokens']}, {r['num_tests']} tests × "
             f"{r['samples_per_test']} samples, first {r['tokens_per_sample']} tokens; false-alarm rate "
             f"{r['false_alarm']:.2g} overall (each test fails below p = {r['threshold_per_test']:.2g})"]
    for t in r["tests"]:
        mark = "pass" if t["passed"] else "FAIL"
        extra = f", {t['impossible_outcomes']} samples of probability 0" if t["impossible_outcomes"] else ""
        lines.append(f"  {mark}  prompt {t['prompt_token_ids'][:6]}{'…' if len(t['prompt_token_ids']) > 6 else ''} "
                     f"{t['setting']:<14} p = {t['p_value']:.3g}  (chi2 {t['statistic']:.1f}, df {t['df']}, "
                     f"n {t['samples']}, acceptance {t['acceptance_rate']:.0%}{extra})")
    return lines

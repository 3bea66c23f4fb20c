"""Profile a workload: measure acceptance and costs, predict the speedup for every k, recommend a
setting, then run it and compare the prediction with the measured speedup.

The cost model is specdec/cost_model.py's (docs/algorithm.md), with the measured per-position
acceptance instead of one i.i.d. α:
- α_i, the conditional acceptance of draft position i: of the rounds that asked for at least i drafts
  and accepted positions 1..i-1, the share that accepted position i (a drafter that proposed fewer than
  i tokens counts as not accepted: lookup drafters often find shorter continuations);
- E(k) = 1 + Σ_{i≤k} Π_{j≤i} α_j, tokens per round (the recovered or bonus token included);
- c = drafter time per drafted position ÷ one 1-token target step (the plain engine's verify pass,
  timed in the same alternating runs as the drafter). A parallel draft (drafters/pard.py) runs one
  forward per round whatever k, so its c is per round and has a shape: c(k) = its measured time per
  round at K × f(k) / f(K), f(k) the draft's own forward over one new token and k - 1 masks, timed
  like v(k) and fitted by a line that does not fall (``measure_parallel_draft_cost``); its round
  costs c(k) + v(k) (cost_model.round_cost);
- v(k) = one (k+1)-token target forward ÷ one 1-token target forward, timed directly on the target
  runner at batch 1 on real prompt prefixes (lower quartile of repeats: preemption by other work only
  ever adds time; the k interleaved so that load changes hit every k alike), so v(0) = 1;
- S(k) = E(k) / (k·c + v(k)); S(0) = 1 is plain decoding. The recommended k maximises S(k). k here
  is the number of tokens drafted: when the drafter proposed fewer than asked, the cost is averaged
  over the measured proposal lengths n, n_k = min(n, k): mean(n_k·c + v(n_k)).

S(k) is the decode-loop speedup. Measured tokens/s also pays the prefill and the loop's own
per-round work, so the profile adds an end-to-end prediction built from the same parts plus those
measured costs: T_plain = P + N·t_plain and T_spec(k) = P + N/E(k) · (t_1·(k·c + v(k)) + o), with P
the prefill per prompt, N the tokens per prompt, t_plain the plain step per token, t_1 the 1-token
step and o the speculative loop's overhead per round.

Acceptance is measured with adaptive k off and k = K, so that every position 1..K is drafted.
Tokens/s is measured with plain and speculative runs of every prompt alternating in one process.

Every round is tagged with its prompt's category, so all of the above also holds per category: each
configured drafter gets its α_i, S(k) and measured speedup per category, and each category its own
pick (workbench/categories.py), checked by a run on that category's prompts. A config whose method
lists several is profiled as each method and as the list itself (specdec's per-request choice).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from specdec.bench import run_bench
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.cost_model import best_k, draft_passes, mean_expected_tokens, mean_round_cost, predicted_speedups
from specdec.llm import LLM
from specdec.metrics import SpecDecodingStats
from specdec.models.base import ForwardBatch
from specdec.workbench.categories import ALL, drafter_rows, labels, recommend

TAU_NOTE = "τ = tokens emitted per target verify pass, the recovered or bonus token included (1..k+1)"
PROFILE_VERSION = 1

Progress = Callable[[str, int], Callable[[], None]]  # (description, total) -> advance()


@dataclass
class _RecordingStats(SpecDecodingStats):
    """The engine's counters, plus (tag, asked, drafted, accepted) for every sequence in every round."""

    rounds: list = field(default_factory=list)
    tag: str | None = None

    def record_round(self, k_per_seq: list[int], num_accepted: list[int], num_asked: list[int] | None = None) -> None:
        super().record_round(k_per_seq, num_accepted, num_asked)
        asked = num_asked if num_asked is not None else k_per_seq  # fewer than k near a sequence's end
        self.rounds += [(self.tag, max(a, k), k, n) for a, k, n in zip(asked, k_per_seq, num_accepted)]


@dataclass
class _Side:
    """Totals of one side (plain or speculative) within one category."""

    tokens: int = 0
    time_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    step_s: float = 0.0
    prefill_s: float = 0.0
    passes: int = 0  # verify passes (rounds, batch 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    def add(self, tokens: int, elapsed: float, before: SpecDecodingStats, after: SpecDecodingStats) -> None:
        self.tokens += tokens
        self.time_s += elapsed
        self.draft_s += after.draft_time_s - before.draft_time_s
        self.verify_s += after.verify_time_s - before.verify_time_s
        self.step_s += after.step_time_s - before.step_time_s
        self.prefill_s += after.prefill_time_s - before.prefill_time_s
        self.passes += after.num_verify_passes - before.num_verify_passes


def acceptance_from_rounds(rounds: list[tuple], k_max: int) -> dict:
    """Per-position acceptance from (asked, drafted, accepted) triples, one per sequence and round
    ((drafted, accepted) pairs mean the drafter always proposed what it was asked for)."""
    rounds = [r if len(r) == 3 else (r[0], r[0], r[1]) for r in rounds]
    asked_rounds = [(a, nd, na) for a, nd, na in rounds if a > 0]
    drafted = [(nd, na) for _, nd, na in asked_rounds if nd > 0]
    pos = range(1, k_max + 1)
    reached = [sum(1 for a, nd, na in asked_rounds if a >= i and na >= i - 1) for i in pos]
    accepted = [sum(1 for _, _, na in asked_rounds if na >= i) for i in pos]
    proposed = [sum(1 for _, nd, _ in asked_rounds if nd >= i) for i in pos]
    asked = [sum(1 for a, _, _ in asked_rounds if a >= i) for i in pos]
    lengths = [0] * (k_max + 1)  # lengths[n]: rounds in which the drafter proposed n tokens
    for _, nd, _ in asked_rounds:
        lengths[min(nd, k_max)] += 1
    alphas: list[float] = []
    for r, a in zip(reached, accepted):
        # a position never reached keeps the previous one's rate (0 when nothing was measured)
        alphas.append(a / r if r else (alphas[-1] if alphas else 0.0))
    num_draft_tokens = sum(nd for nd, _ in drafted)
    num_accepted = sum(na for _, na in drafted)
    hist = [0] * (k_max + 2)  # hist[t]: rounds that emitted t tokens (t = accepted + 1)
    for _, na in drafted:
        hist[na + 1] += 1
    return {
        "num_rounds": len(drafted),
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + num_accepted / len(drafted) if drafted else 1.0,
        "alpha_conditional": alphas,
        "reached_per_pos": reached,
        "accepted_per_pos": accepted,
        # vLLM's acceptance_rate_per_pos: accepted at i / drafted at i (= Π α_j over j ≤ i when every round drafts k)
        "acceptance_rate_per_pos": [a / p if p else 0.0 for a, p in zip(accepted, proposed)],
        "tau_histogram": hist[1:],  # index t-1 holds the rounds that emitted t tokens, t = 1..k+1
        "accepted_per_round": [na for _, na in drafted],
        "num_rounds_asked": len(asked_rounds),  # rounds that asked for drafts, also those that got none
        "proposal_rate_per_pos": [p / a if a else 0.0 for p, a in zip(proposed, asked)],
        "draft_length_histogram": lengths,
    }


def measure_verify_cost(llm: LLM, prefixes: list[list[int]], k_max: int, repeats: int = 9,
                        warmup: int = 2) -> dict:
    """v(k) for k = 0..k_max: (k+1)-token target forwards at batch 1 after real prompt prefixes,
    the lower quartile of ``repeats`` timings each, divided by the 1-token one. The engine must be idle."""
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("measure_verify_cost needs an idle engine")
    quartiles, medians = _time_forwards(engine.target, engine.device, prefixes, list(range(1, k_max + 2)),
                                        repeats, warmup)
    t1 = quartiles[0]
    return {"k": list(range(k_max + 1)), "v": [q / t1 for q in quartiles], "t1_s": t1, "lower_quartile_s": quartiles,
            "median_s": medians, "repeats": repeats * len(prefixes), "prefix_lengths": [len(p) for p in prefixes]}


def measure_parallel_draft_cost(llm: LLM, prefixes: list[list[int]], k_max: int, repeats: int = 9,
                                warmup: int = 2) -> dict:
    """The shape of a parallel draft's round cost: its forward over one new token and k - 1 masks after
    real prompt prefixes, for k = 1..k_max, at batch 1 (lower quartile of ``repeats``), and f(k): the
    least-squares line through those times, its slope at least 0 (a forward over more tokens is not
    cheaper: a falling measurement is noise), ÷ its value at k = 1. The engine must be idle; the
    drafter re-feeds its rows afterwards."""
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("measure_parallel_draft_cost needs an idle engine")
    drafter = engine.drafter
    quartiles, medians = _time_forwards(drafter.runner, engine.device, prefixes, list(range(1, k_max + 1)),
                                        repeats, warmup, fill=drafter.mask_token_id)
    drafter.release_memory()  # its rows were overwritten: every sequence starts from an empty draft cache
    ks = list(range(1, k_max + 1))
    line = _rising_line(ks, quartiles)
    return {"k": ks, "f": [y / line[0] for y in line], "lower_quartile_s": quartiles, "median_s": medians,
            "repeats": repeats * len(prefixes)}


def _rising_line(xs: list[int], ys: list[float]) -> list[float]:
    """The least-squares line through (xs, ys) at xs, its slope clamped at 0 (flat: the mean)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    return [my + slope * (x - mx) for x in xs]


def _time_forwards(runner, device, prefixes: list[list[int]], lengths: list[int], repeats: int, warmup: int,
                   fill: int | None = None) -> tuple[list[float], list[float]]:
    """(lower quartiles, medians) of ``runner``'s forward of T tokens at batch 1 after each prefix, per T
    in ``lengths``: the prefix's last token, then T - 1 more (``fill``, or the prefix's own tokens)."""
    times: list[list[float]] = [[] for _ in lengths]
    for ids in prefixes:
        ids = ids[: max(1, runner.max_model_len - max(lengths) - 1)]
        start = len(ids) - 1
        runner.sync_rows(["__specdec_profile__"])
        if start > 0:
            runner.forward(ForwardBatch.dense(torch.tensor([ids[:-1]], device=device), [0]))
        more = [(ids * (T + 1))[:T - 1] if fill is None else [fill] * (T - 1) for T in lengths]
        inputs = [ForwardBatch.dense(torch.tensor([[ids[-1]] + m], device=device), [start], "all")
                  for m in more]  # [1, T]
        for rep in range(warmup + repeats):
            for i, batch in enumerate(inputs):  # every repeat times every T: load changes hit all alike
                _sync(device)
                t0 = time.perf_counter()
                runner.forward(batch)  # rewrites positions start..start+T-1 each time
                _sync(device)
                if rep >= warmup:
                    times[i].append(time.perf_counter() - t0)
    quartiles = [statistics.quantiles(t, n=4)[0] if len(t) > 1 else t[0] for t in times]
    return quartiles, [statistics.median(t) for t in times]


def run_profile(model: str, speculative_configs: list[dict], prompts: list[dict], *, max_tokens: int = 128,
                k_max: int | None = None, temperature: float = 0.0, seed: int | None = 0, dtype: str = "auto",
                device: str = "cpu", backend: str = "auto", validate: bool = True, sweep: bool = False,
                verify_repeats: int = 9, progress: Progress | None = None) -> dict:
    """Measure, predict, recommend (on all prompts and per category) and (``validate``) check the
    recommendations; returns the profile dict.
    ``sweep``: also measure the recommended method at every k = 1..K against its prediction.

    ``prompts``: ``load_prompts`` records ({"prompt": ..., "category": ...}) or token-id dicts."""
    if not speculative_configs:
        raise ValueError("profile needs at least one --speculative-config")
    if not prompts:
        raise ValueError("profile needs at least one prompt")
    specs, method_lists = _expand_configs(speculative_configs)
    K = k_max if k_max is not None else max(s.num_speculative_tokens for s in specs)
    if not (isinstance(K, int) and 1 <= K <= 32):
        raise ValueError(f"--k-max must be an integer in 1..32, got {K!r}")
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    tick = progress or (lambda desc, total: (lambda: None))
    records = [_record(p) for p in prompts]
    categories = sorted({cat for _, cat in records})

    load = {"dtype": dtype, "device": device, "backend": backend}  # how every LLM here loads the target
    ar_llm = LLM(model, **load)
    profile: dict = {
        "version": PROFILE_VERSION, "model": model, "dtype": dtype, "device": device, "backend": ar_llm.backend,
        "num_prompts": len(records), "categories": categories, "max_tokens": max_tokens,
        "temperature": temperature, "k_max": K,
        "cost_model": "S(k) = E(k) / (k*c + v(k)); E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j; "
                      "alpha_j = conditional acceptance of draft position j; k*c + v(k) averaged over the "
                      "measured proposal lengths when a drafter proposes fewer than k; a parallel draft "
                      "(one forward per round): c(k) + v(k)",
        "tau_definition": TAU_NOTE,
    }
    if method_lists:
        profile["method_lists"] = method_lists

    # 1. the verify cost curve v(k), straight from the target runner on real prompt prefixes
    prefixes = [ar_llm.tokenize(p) for p, _ in records[:3]]
    advance = tick("verify cost v(k)", 1)
    _warm(ar_llm, records[0][0], params)
    verify_cost = measure_verify_cost(ar_llm, prefixes, K, repeats=verify_repeats)
    advance()
    profile["verify_cost"] = verify_cost
    t1, v = verify_cost["t1_s"], verify_cost["v"]

    # 2. every config at k = K, adaptive off: acceptance per position, c, tokens/s (plain alternating)
    profile["configs"] = []
    for spec in specs:
        profile["configs"].append(_profile_config(ar_llm, model, spec, K, records, categories, params, t1, v,
                                                  load, tick, prefixes, verify_repeats))

    for c, label in zip(profile["configs"], labels(profile["configs"])):
        c["label"] = label

    # 3. recommend: the config and k with the highest predicted S(k), on all prompts and per category
    profile["recommendation"] = recommend(profile["configs"], ALL)
    best_i = profile["recommendation"]["config_index"]
    best = profile["configs"][best_i]
    k_best = best["overall"]["best_k"]
    profile["by_category"] = {cat: {"num_prompts": best["categories"][cat]["num_prompts"],
                                    "drafters": drafter_rows(profile["configs"], cat),
                                    "recommendation": recommend(profile["configs"], cat)} for cat in categories}

    # 4. run the recommended setting (the best k >= 1 when plain wins, to check the model anyway)
    if validate:
        k_run = k_best if k_best > 0 else max(range(1, K + 1), key=lambda k: best["overall"]["predicted_speedup"][k])
        profile["validation"] = _validate(ar_llm, model, best, k_run, records, params, load, tick)
        _validate_categories(profile, ar_llm, model, records, params, load, tick)
    if sweep:
        profile["sweep"] = []
        for k in range(1, K + 1):
            run = (profile["validation"] if validate and k == profile["validation"]["k"] else
                   _validate(ar_llm, model, best, k, records, params, load, tick))
            profile["sweep"].append({key: run[key] for key in (
                "k", "predicted_speedup", "predicted_speedup_end_to_end", "measured_speedup",
                "plain_tokens_per_s", "spec_tokens_per_s")})
    return profile


def _profile_config(ar_llm: LLM, model: str, spec: SpeculativeConfig, K: int, records: list, categories: list[str],
                    params: SamplingParams, t1: float, v: list[float], load: dict, tick,
                    prefixes: list[list[int]], repeats: int = 9) -> dict:
    cfg = _config_dict(spec)
    spec_llm = LLM(model, **load,
                   speculative_config={**cfg, "num_speculative_tokens": K, "adaptive": False})
    _warm(spec_llm, records[0][0], params)
    _warm(ar_llm, records[0][0], params)
    stats = _RecordingStats()
    spec_llm.engine.stats = stats
    sides = {cat: {"ar": _Side(), "spec": _Side()} for cat in categories}
    matched = 0
    advance = tick(f"{'+'.join(spec.methods)} at k={K}", len(records))
    for i, (prompt, cat) in enumerate(records):
        stats.tag = cat
        outs = {}
        for side in (("ar", "spec") if i % 2 == 0 else ("spec", "ar")):
            llm = ar_llm if side == "ar" else spec_llm
            before = _snapshot(llm.engine.stats)
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0]
            elapsed = time.perf_counter() - t0
            outs[side] = out.token_ids
            sides[cat][side].add(len(out.token_ids), elapsed, before, llm.engine.stats)
        matched += outs["ar"] == outs["spec"]
        advance()

    draft_tokens = stats.num_draft_tokens
    draft_rounds = sum(1 for _, asked, _, _ in stats.rounds if asked > 0)  # batch 1: one row per round
    plain = _merge([s_["ar"] for s_ in sides.values()])
    t_step = plain.verify_s / plain.passes if plain.passes else t1  # the 1-token target step, in the engine
    per_round = stats.draft_time_s / draft_rounds if draft_rounds else 0.0
    parallel = getattr(spec_llm.engine.drafter, "parallel_drafting", False)  # one draft forward per round
    if parallel:  # c(k): the round's measured cost at K, shaped by the draft forward's time per k
        shape = measure_parallel_draft_cost(spec_llm, prefixes, K, repeats=repeats)
        c_round = per_round / t_step
        c: float | list[float] = [0.0] + [c_round * f / shape["f"][-1] for f in shape["f"]]
    else:
        shape = None
        c = (stats.draft_time_s / draft_tokens) / t_step if draft_tokens else 0.0
    result = {
        "method": spec.method, "speculative_config": cfg, "k_measured": K,
        "draft_time_per_position_s": stats.draft_time_s / draft_tokens if draft_tokens else 0.0,
        "draft_time_per_round_s": per_round,
        "target_step_s": t_step,
        # c: per drafted token (per round at K for a parallel draft: draft_cost_per_round holds c(k))
        "draft_cost_ratio": c[K] if parallel else c,
        "draft_cost_shape": "per_round" if parallel else "per_token",
        "draft_cost_per_round": [c[k] if parallel else draft_passes(k) * c for k in range(K + 1)],
        "parallel_draft_forward": shape,
        "greedy_match": {"matched": matched, "total": len(records)} if params.greedy else None,
        "categories": {},
    }
    groups = {cat: [cat] for cat in categories}
    groups[ALL] = categories
    for name, cats in groups.items():
        rounds = [(asked, nd, na) for tag, asked, nd, na in stats.rounds if tag in cats]
        acc = acceptance_from_rounds(rounds, K)
        ar = _merge([sides[c_]["ar"] for c_ in cats])
        sp = _merge([sides[c_]["spec"] for c_ in cats])
        s_pred = predicted_speedups(acc["alpha_conditional"], c, v, acc["draft_length_histogram"], parallel)
        k_best = best_k(s_pred)
        entry = {
            **acc,
            "num_prompts": sum(1 for _, cat in records if cat in cats),
            "expected_tokens": mean_expected_tokens([acc["alpha_conditional"]], K),
            "predicted_speedup": s_pred, "best_k": k_best, "best_speedup": s_pred[k_best],
            "plain_tokens_per_s": ar.tokens_per_s, "spec_tokens_per_s": sp.tokens_per_s,
            "measured_speedup_at_k_max": sp.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0,
            "time_split": _time_split(sp),
            "plain_time_split": _time_split(ar),
        }
        entry["round_cost"] = [mean_round_cost(k, c, v, acc["draft_length_histogram"], parallel) for k in range(K + 1)]
        entry["predicted_speedup_end_to_end"] = _end_to_end(entry, ar, sp, t_step)
        result["categories"][name] = entry
    result["overall"] = result["categories"][ALL]
    del spec_llm
    return result


def _end_to_end(entry: dict, ar: _Side, sp: _Side, t_step: float) -> list[float]:
    """T_plain / T_spec(k) per prompt: prefill P, N tokens, plain step t_plain per token, and per speculative
    round t_step·(k·c + v(k)) plus the loop overhead o measured at k = K."""
    n_prompts = entry["num_prompts"]
    if not (ar.passes and sp.passes and n_prompts):
        return entry["predicted_speedup"]
    prefill = ar.prefill_s / n_prompts
    tokens = ar.tokens / n_prompts
    t_plain = ar.step_s / ar.passes
    overhead = max(0.0, sp.step_s - sp.draft_s - sp.verify_s) / sp.passes
    plain_time = prefill + tokens * t_plain
    out = []
    for k, cost in enumerate(entry["round_cost"]):
        if k == 0:
            out.append(1.0)
            continue
        rounds = tokens / entry["expected_tokens"][k]
        out.append(plain_time / (prefill + rounds * (t_step * cost + overhead)))
    return out


def _validate(ar_llm: LLM, model: str, best: dict, k: int, records: list, params: SamplingParams, load: dict,
              tick, cat: str = ALL) -> dict:
    """Run ``best`` at k against plain decoding on ``records`` (those of category ``cat`` unless ALL)."""
    cfg = {**best["speculative_config"], "num_speculative_tokens": k, "adaptive": False}
    spec_llm = LLM(model, **load, speculative_config=cfg)
    where = "" if cat == ALL else f" on {cat}"
    advance = tick(f"run {best.get('label', best['method'])} at k={k} vs plain{where}", 1)
    prompts = [{"prompt": p, "category": c_} if isinstance(p, str) else {"prompt": p, "category": c_}
               for p, c_ in records if cat == ALL or c_ == cat]
    _warm(spec_llm, prompts[0]["prompt"], params)
    _warm(ar_llm, prompts[0]["prompt"], params)
    result = run_bench(ar_llm, spec_llm, prompts, params, warmup=0).as_dict()  # warmed off the set, above
    advance()
    predicted = best["categories"][cat]["predicted_speedup"][k]
    predicted_e2e = best["categories"][cat]["predicted_speedup_end_to_end"][k]
    measured = result["speedup"]
    m = result["spec"]["metrics"]
    by_cat = {}
    for cat, r in result["by_category"].items():
        pc = best["categories"].get(cat)
        by_cat[cat] = {"measured_speedup": r["speedup"],
                       "predicted_speedup": pc["predicted_speedup"][k] if pc else None,
                       "plain_tokens_per_s": r["ar_tokens_per_s"], "spec_tokens_per_s": r["spec_tokens_per_s"]}
    return {
        "speculative_config": cfg, "k": k, "predicted_speedup": predicted,
        "predicted_speedup_end_to_end": predicted_e2e, "measured_speedup": measured,
        "relative_error": (predicted - measured) / measured if measured else None,
        "relative_error_end_to_end": (predicted_e2e - measured) / measured if measured else None,
        "plain_tokens_per_s": result["ar"]["tokens_per_s"], "spec_tokens_per_s": result["spec"]["tokens_per_s"],
        "acceptance_rate": result["spec"]["acceptance_rate"],
        "mean_acceptance_length": result["spec"]["mean_acceptance_length"],
        "time_split": {"draft_s": m["draft_time_s"], "verify_s": m["verify_time_s"],
                       "overhead_s": m["overhead_time_s"], "prefill_s": m["prefill_time_s"]},
        "greedy_match": result["greedy_match"], "by_category": by_cat,
    }


def _validate_categories(profile: dict, ar_llm: LLM, model: str, records: list, params: SamplingParams,
                         load: dict, tick) -> None:
    """Measure each category's recommendation on that category's prompts. A category whose pick is the
    all-prompts setting reads its figure from that run; one whose pick is plain decoding has none to run.
    Beside it: the all-prompts setting's measured speedup in the category (one deployment for all)."""
    overall = profile["validation"]
    for cat, entry in profile["by_category"].items():
        rec = entry["recommendation"]
        single = overall["by_category"].get(cat, {})
        if rec["plain"]:
            entry["validation"] = None
            continue
        c = profile["configs"][rec["config_index"]]
        if (rec["config_index"], rec["k"]) == (profile["recommendation"]["config_index"], overall["k"]):
            run = {"k": rec["k"], "predicted_speedup": c["categories"][cat]["predicted_speedup"][rec["k"]],
                   "predicted_speedup_end_to_end": c["categories"][cat]["predicted_speedup_end_to_end"][rec["k"]],
                   "measured_speedup": single.get("measured_speedup"),
                   "plain_tokens_per_s": single.get("plain_tokens_per_s"),
                   "spec_tokens_per_s": single.get("spec_tokens_per_s"),
                   "greedy_match": None, "run": "the all-prompts run"}
        else:
            full = _validate(ar_llm, model, c, rec["k"], records, params, load, tick, cat)
            run = {key: full[key] for key in ("k", "predicted_speedup", "predicted_speedup_end_to_end",
                                              "measured_speedup", "plain_tokens_per_s", "spec_tokens_per_s",
                                              "greedy_match")}
            run["run"] = "its own run"
        run["label"] = rec["label"]
        run["all_prompts_setting_measured_speedup"] = single.get("measured_speedup")
        entry["validation"] = run


def _expand_configs(raw_configs: list) -> tuple[list[SpeculativeConfig], list[dict]]:
    """The configs to measure: a config whose method lists several is profiled as each of its methods,
    then as the list itself (specdec's per-request choice, drafters/choice.py) to compare with them.
    Returns the configs and, per list, the config numbers of its methods and of the list."""
    specs: list[SpeculativeConfig] = []
    lists: list[dict] = []
    for raw in raw_configs:
        spec = _parse_config(raw)
        if len(spec.methods) == 1:
            specs.append(spec)
            continue
        first = len(specs)
        specs += [replace(spec, method=m, parallel_drafting=spec.parallel_drafting and m == "draft_model")
                  for m in spec.methods]
        lists.append({"methods": spec.methods, "config_indices": list(range(first, len(specs))),
                      "choice_config_index": len(specs), "speculative_config": _config_dict(spec)})
        specs.append(spec)
    return specs, lists


# -- helpers --------------------------------------------------------------------------------------


def _parse_config(raw) -> SpeculativeConfig:
    spec = SpeculativeConfig.from_dict(raw)
    if spec is None:
        raise ValueError("a speculative config is empty")
    return spec


def _config_dict(spec: SpeculativeConfig) -> dict:
    """Only the fields that matter for the method (so exports and reports stay readable)."""
    suffix = {f for f in vars(spec) if f.startswith("suffix_decoding_")}
    keep = {"method", "num_speculative_tokens", "adaptive", "draft_p_min"}
    if spec.parallel_drafting:  # a parallel draft (PARD): without the flag it would run autoregressively
        keep.add("parallel_drafting")
    for method in spec.methods:
        keep |= {"draft_model": {"model"}, "eagle3": {"model"}, "ngram": {"prompt_lookup_max", "prompt_lookup_min"},
                 "suffix": suffix, "layer_skip": {"num_draft_layers"}}[method]
    if spec.draft_tokenizer_mapping != "auto":  # a draft with another tokenizer, mapped as the user chose
        keep.add("draft_tokenizer_mapping")
    if spec.enable_suffix_decoding:  # suffix drafts in front of the model's
        keep |= suffix | {"enable_suffix_decoding"}
    return {k: v for k, v in vars(spec).items() if k in keep}


def _record(p) -> tuple:
    if isinstance(p, dict) and "prompt" in p and "prompt_token_ids" not in p:
        return p["prompt"], p.get("category") or "-"
    return p, "-"


def _warm(llm: LLM, prompt, params: SamplingParams) -> None:
    """A short run on the prompt's tokens reversed: not a prompt of the set, so a drafter that caches
    responses (suffix decoding) learns nothing about the measured ones from it."""
    ids = llm.tokenize(prompt)[::-1]
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=params.temperature, max_tokens=min(8, params.max_tokens), seed=params.seed))


def _snapshot(stats: SpecDecodingStats) -> SpecDecodingStats:
    return SpecDecodingStats(draft_time_s=stats.draft_time_s, verify_time_s=stats.verify_time_s,
                             step_time_s=stats.step_time_s, prefill_time_s=stats.prefill_time_s,
                             num_verify_passes=stats.num_verify_passes)


def _merge(sides: list[_Side]) -> _Side:
    out = _Side()
    for s in sides:
        for f in ("tokens", "time_s", "draft_s", "verify_s", "step_s", "prefill_s", "passes"):
            setattr(out, f, getattr(out, f) + getattr(s, f))
    return out


def _time_split(s: _Side) -> dict:
    return {"draft_s": s.draft_s, "verify_s": s.verify_s, "overhead_s": max(0.0, s.step_s - s.draft_s - s.verify_s),
            "prefill_s": s.prefill_s, "total_s": s.time_s}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()

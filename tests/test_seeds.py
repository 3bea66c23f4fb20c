"""A seeded request's output does not depend on what else runs: alone, in a batch of 8 with seeded and
unseeded, greedy and sampled neighbours that come and go, and through the server under load, the same
seed gives the same tokens (same method, same fixed k; float32 on tiny models). Each row draws from
its own generator only what it uses (specdec/verify.py). A difference is allowed only where a random
decision of the request had a margin below the noise of a batched forward, and the test reports it."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from test_drafters_lookup import make_repetitive_model, repetitive_prompts
from tiny_models import perturbed_copy

K = 3
NOISE = 1e-4  # relative: float32 logits of a batched forward differ from a lone one's by far less
SEEDED = SamplingParams(temperature=0.3, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
METHODS = ["draft_model", "ngram", "suffix"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    target = make_repetitive_model(root / "target", seed=0)
    return target, str(perturbed_copy(target, root / "draft", 0.01))


def spec_config(method: str, draft: str) -> dict:
    cfg = {"method": method, "num_speculative_tokens": K, "adaptive": False}
    return cfg | {"draft_model": {"model": draft}, "ngram": {"prompt_lookup_min": 1},
                  "suffix": {"suffix_decoding_max_spec_factor": 2.0}}[method]


def neighbours() -> list[SamplingParams]:
    """Seven other requests: greedy, seeded and unseeded sampled, with other filters and lengths."""
    return [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=5, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=1.2, min_p=0.1, seed=99, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]


class Margins:
    """Records the margin of every random decision a generator takes part in: for a token drawn
    (specdec.sampling.draw: u times the total mass against the running sums), how far u times the total
    lies from the nearest of the drawn token's two bounds, relative to the total; for an accept test
    u * q < p, |u q - p| / p. A decision whose margin is below NOISE could go the other way between a
    lone and a batched forward."""

    def __init__(self, monkeypatch, generator_of):
        import specdec.drafters.autoregressive as autoregressive
        import specdec.verify as verify

        self.generator_of, self.values = generator_of, []
        for module in (verify, autoregressive):
            monkeypatch.setattr(module, "sample", self._wrap_sample(module.sample))
        monkeypatch.setattr(autoregressive, "sample_from_logits",
                            self._wrap_sample_from_logits(autoregressive.sample_from_logits))
        monkeypatch.setattr(autoregressive, "row_sampler", self._wrap_row_sampler(autoregressive.row_sampler))
        monkeypatch.setattr(verify, "draw", self._wrap_draw(verify.draw))
        monkeypatch.setattr(verify, "_accept_or_recover", self._wrap_accept(verify._accept_or_recover))
        monkeypatch.setattr(verify, "verify_row", self._wrap_row(verify.verify_row))
        self.replay = None  # a copy of the watched generator while the Python rule replays a native row's

    def _watched(self, generators) -> int | None:
        g = self.generator_of()
        return next((i for i, x in enumerate(generators) if x is g or x is self.replay), None)

    def _wrap_row(self, verify_row):
        """A native row (verify.verify_row) records nothing itself: the Python rule replays it on a copy of the
        generator, recorded by the wrappers above, and must reach the same decision."""
        import specdec.verify as verify
        from specdec.sampling import probs_from_logits

        def recorded(target_logits, draft_token_ids, draft_probs, num_draft, sb, b, generator):
            if self._watched([generator]) is not None and self.replay is None:
                self.replay = torch.Generator().set_state(generator.get_state())
                try:
                    row = sb.select([b])
                    p = probs_from_logits(target_logits[b:b + 1], row)  # [1, k+1, V]
                    ref = verify.rejection_sample(draft_token_ids[b:b + 1],
                                                  None if draft_probs is None else draft_probs[b:b + 1], p,
                                                  [self.replay], torch.tensor([num_draft]))
                finally:
                    self.replay = None
                out = verify_row(target_logits, draft_token_ids, draft_probs, num_draft, sb, b, generator)
                assert out == (ref.num_accepted[0], ref.next_token_ids[0])
                return out
            return verify_row(target_logits, draft_token_ids, draft_probs, num_draft, sb, b, generator)
        return recorded

    def _wrap_sample(self, sample):
        def recorded(probs, generators):
            i = self._watched(generators)
            if i is not None:
                self._draw_margin(probs[i], generators[i])
            return sample(probs, generators)
        return recorded

    def _wrap_sample_from_logits(self, sample_from_logits):
        def recorded(logits, sb, generators, out=None, step=0):
            i = self._watched(generators)
            before = None if i is None else torch.Generator().set_state(generators[i].get_state())
            probs, ids = sample_from_logits(logits, sb, generators, out, step)
            if before is not None:
                self._draw_margin(probs[i] if out is None else probs[i, step], before)
            return probs, ids
        return recorded

    def _wrap_row_sampler(self, row_sampler):
        def recorded(sb, generators, device, vocab_map=None):
            rows = self._wrap_sample_from_logits(
                lambda logits, sb, generators, out, step: row_sampler(sb, generators, device, vocab_map)(logits, out,
                                                                                                     step))
            return lambda logits, out=None, step=0: rows(logits, sb, generators, out, step)
        return recorded

    def _wrap_draw(self, draw):
        def recorded(probs, generator):
            if self._watched([generator]) is not None:
                self._draw_margin(probs, generator)
            return draw(probs, generator)
        return recorded

    def _draw_margin(self, probs, generator):
        replay = torch.Generator().set_state(generator.get_state())
        u = float(torch.rand(1, dtype=torch.float64, generator=replay))
        c = probs.double().cumsum(-1)  # [V]
        v = u * float(c[-1])
        x = int(torch.searchsorted(c, torch.tensor([v], dtype=torch.float64), right=True)[0])
        low, high = (float(c[x - 1]) if x else 0.0), float(c[min(x, len(c) - 1)])
        self.values.append(min(v - low, high - v) / float(c[-1]))

    def _wrap_accept(self, accept):
        def recorded(draft_token_ids, draft_probs, target_probs, generators, num_draft):
            i = self._watched(generators)
            if i is not None:
                n = int(num_draft[i])
                u = torch.rand(n, generator=torch.Generator().set_state(generators[i].get_state()))
                x = draft_token_ids[i, :n]
                q = draft_probs[i, torch.arange(n), x]
                result = accept(draft_token_ids, draft_probs, target_probs, generators, num_draft)
                m = min(result.num_accepted[i] + 1, n)  # the tests that were made: up to the first rejection
                p = torch.stack([target_probs[i][j][x[j]] for j in range(m)])  # rows a ProbRows has made by then
                self.values += ((u[:m] * q[:m] - p).abs() / p.clamp(min=1e-30)).tolist()
                return result
            return accept(draft_token_ids, draft_probs, target_probs, generators, num_draft)
        return recorded


def run_alone(target, cfg, prompt, monkeypatch=None) -> tuple[list[int], dict, list[float]]:
    llm = LLM(target, dtype="float32", speculative_config=cfg)
    seq = None
    margins = Margins(monkeypatch, lambda: seq.generator) if monkeypatch is not None else None
    seq = llm.engine.add_request(prompt, SEEDED)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return seq.output_token_ids, llm.get_metrics(), margins.values if margins else []


def run_in_batch(target, cfg, prompt, others: list[list[int]]) -> list[int]:
    """Four neighbours start; after two rounds the seeded request joins with three more (their prompts
    ride in the running batch's verify pass, and their first round drafts nothing while the others
    draft k); neighbours leave at different rounds."""
    llm = LLM(target, dtype="float32", speculative_config=cfg)
    params = neighbours()
    engine = llm.engine
    for p, sp in zip(others[:4], params[:4]):
        engine.add_request(p, sp)
    for _ in range(2):
        engine.step()
    seq = engine.add_request(prompt, SEEDED)
    for p, sp in zip(others[4:], params[4:]):
        engine.add_request(p, sp)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


def assert_same_or_near_tie(alone: list[int], batched: list[int], margins: list[float], what: str) -> None:
    if alone == batched:
        return
    j = next(i for i, (a, b) in enumerate(zip(alone, batched)) if a != b)
    smallest = min(margins)
    assert smallest < NOISE, (f"{what}: the seeded request's output differs at token {j} ({alone[j]} vs "
                              f"{batched[j]}) although its smallest decision margin was {smallest:.2e}")
    print(f"{what}: output differs at token {j}, allowed: a decision margin of {smallest:.2e} < {NOISE:g}")


def prompts() -> tuple[list[int], list[list[int]]]:
    """The seeded request's prompt and its seven neighbours'."""
    p = repetitive_prompts(4, seed=4) + repetitive_prompts(4, seed=5)
    return p[3], p[:3] + p[4:]


@pytest.mark.parametrize("method", METHODS)
def test_a_seeded_request_gives_the_same_output_alone_and_in_a_batch(models, method, monkeypatch):
    target, cfg = models[0], spec_config(method, models[1])
    prompt, others = prompts()
    alone, metrics, margins = run_alone(target, cfg, prompt, monkeypatch)
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0  # it did speculate
    assert len(margins) >= len(alone)  # at least one recorded decision per token
    batched = run_in_batch(target, cfg, prompt, others)
    assert_same_or_near_tie(alone, batched, margins, method)
    if method != "draft_model":  # one-hot drafts: a seeded row emits plain decoding's tokens
        plain, _, plain_margins = run_alone(target, None, prompt, monkeypatch)
        assert_same_or_near_tie(plain, alone, plain_margins, f"{method} vs plain decoding")


def completion_args(sp: SamplingParams) -> dict:
    """An OpenAI completions request with these sampling parameters."""
    extra = {"ignore_eos": sp.ignore_eos, "return_token_ids": True, "top_k": sp.top_k, "min_p": sp.min_p}
    return dict(temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, max_tokens=sp.max_tokens,
                extra_body=extra)


@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_a_seeded_request_through_the_server_under_load_gives_its_output_alone(models, method, monkeypatch):
    """Seven concurrent requests keep the server's batch busy; the seeded one arrives once six of them run."""
    import asyncio

    import openai

    from specdec.server import ServerThread, build_app

    target, cfg = models[0], spec_config(method, models[1])
    prompt, others = prompts()
    alone, _, margins = run_alone(target, cfg, prompt, monkeypatch)
    llm = LLM(target, dtype="float32", speculative_config=cfg, max_num_seqs=8)
    neighbours_of_seeded = []  # per round with the seeded request running: how many others ran with it
    step = llm.engine.step

    def recorded_step():
        running = llm.engine.running
        if any(s.prompt_token_ids == prompt for s in running):
            neighbours_of_seeded.append(len(running) - 1)
        return step()

    llm.engine.step = recorded_step

    async def complete(ac, p, sp, after_running=0):
        while len(llm.engine.running) < after_running:  # the server's batch is this full
            await asyncio.sleep(0.001)
        r = await ac.completions.create(model="tiny", prompt=p, **completion_args(sp))
        return r.choices[0].model_extra["token_ids"]

    async def main(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as ac:
            load = [complete(ac, p, sp) for p, sp in zip(others, neighbours())]
            return await asyncio.gather(complete(ac, prompt, SEEDED, after_running=6), *load)

    with ServerThread(build_app(llm, served_model_name="tiny")) as server:
        served = asyncio.run(main(server.url))[0]
    assert llm.get_metrics()["num_drafts"] > 0 and max(neighbours_of_seeded) >= 3
    assert_same_or_near_tie(alone, served, margins, f"{method} through the server")

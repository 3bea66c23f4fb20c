"""Every sampling field of the OpenAI / vLLM wire through a real uvicorn server and the official openai
client, streaming and not: n, penalties and biases, logprobs (completions and chat shapes),
prompt_logprobs, echo, and structured output (response_format, structured_outputs, guided_*). The
server speculates (a draft model, k fixed); each answer must equal the library's (``LLM``) for the same
parameters, and the metrics must show that the drafts ran."""

from __future__ import annotations


import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.server import ServerThread, build_app
from test_server import KEY, NAME, one_thread, scrape, spec_config  # noqa: F401 (one_thread: a fixture)
from tiny_models import make_model, perturbed_copy

PROMPTS = ["w1 w2 w3", "w7 w8 w7 w8", "w20 w21 w22 w23 w24"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    target = make_model(root / "target", "llama", max_pos=256)
    return str(target), str(perturbed_copy(target, root / "draft", 0.01))


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    llm = LLM(target, speculative_config=spec_config(draft), max_num_seqs=8)
    with ServerThread(build_app(llm, served_model_name=NAME, api_key=KEY)) as s:
        s.llm = llm
        yield s


@pytest.fixture(scope="module")
def library(models):
    """The same models and speculation in the library: what the server must answer."""
    target, draft = models
    return LLM(target, speculative_config=spec_config(draft), max_num_seqs=8)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def completion(client, prompt, stream: bool, **kw):
    """A completions request as one choice list: streamed chunks are joined per choice index."""
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    if not stream:
        r = client.completions.create(model=NAME, prompt=prompt, extra_body=extra, **kw)
        return [(c.text, c.model_extra["token_ids"], c.logprobs, c.finish_reason) for c in r.choices], r.usage
    chunks = list(client.completions.create(model=NAME, prompt=prompt, stream=True, extra_body=extra,
                                            stream_options={"include_usage": True}, **kw))
    out: dict[int, list] = {}
    for ch in chunks:
        for c in ch.choices:
            text, ids, lp, reason = out.setdefault(c.index, ["", [], None, None])
            out[c.index][0] += c.text
            out[c.index][1] += c.model_extra.get("token_ids") or []
            if c.logprobs is not None:
                lp = out[c.index][2] = lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for key in lp:
                    lp[key] += getattr(c.logprobs, key)
            out[c.index][3] = c.finish_reason or reason
    choices = [out[i] for i in sorted(out)]
    for c in choices:
        c[2] = None if c[2] is None else openai.types.completion_choice.Logprobs(**c[2])
    assert list(sorted(out)) == list(range(len(out)))
    return [tuple(c) for c in choices], chunks[-1].usage


# -- n ---------------------------------------------------------------------------------------------------


def test_chat_n_choices_stream_a_role_chunk_each(client):
    messages = [{"role": "user", "content": "w3 w4"}]
    kw = dict(model=NAME, messages=messages, n=3, temperature=0.9, seed=3, max_tokens=6,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(stream=True, **kw))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert text == r.choices[i].message.content


# -- penalties and biases -------------------------------------------------------------------------------

PROCESSING = [  # the plain greedy output of PROMPTS[0] repeats w6 (token 9)
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.0},
    {"repetition_penalty": 1.8},
    {"logit_bias": {"9": -100, "40": 4.0}},
    {"bad_words": ["w6", "w42"]},
    {"allowed_token_ids": [4, 8, 12, 16, 20]},
    {"min_tokens": 5, "logit_bias": {"2": 100}},  # EOS is all but certain, and masked for 5 tokens
]


@pytest.mark.parametrize("extra", PROCESSING, ids=lambda e: "+".join(e))
def test_penalties_and_biases_equal_the_library(server, client, library, extra):
    """Greedy with speculation: the server's tokens are the library's for the same parameters, and
    the parameters change the output."""
    prompt, ignore_eos = PROMPTS[0], "min_tokens" not in extra
    params = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in extra.items()}
    want = library.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=ignore_eos,
                                                   **params))[0].outputs[0]
    plain = library.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert want.token_ids != plain.token_ids
    before = scrape(server.url)
    for stream in (False, True):
        openai_kw = {k: v for k, v in extra.items() if k in ("presence_penalty", "frequency_penalty", "logit_bias")}
        wire = {k: v for k, v in extra.items() if k not in openai_kw}  # vLLM's names go in the body
        ((text, ids, _, reason),), _ = completion(client, prompt, stream, max_tokens=16, temperature=0,
                                                  extra_body={**wire, "ignore_eos": ignore_eos}, **openai_kw)
        assert (text, ids, reason) == (want.text, want.token_ids, want.finish_reason)
    drafts = ("specdec:spec_decode_num_drafts_total", ())
    assert scrape(server.url)[drafts] > before[drafts]  # speculation ran for these requests
    if "allowed_token_ids" in extra:
        assert set(ids) <= set(extra["allowed_token_ids"])
    if "bad_words" in extra:
        assert not {server.llm.tokenizer.convert_tokens_to_ids(w) for w in extra["bad_words"]} & set(ids)
    if "min_tokens" in extra:
        assert reason == "stop" and len(ids) == 6 and ids[-1] == 2  # 5 tokens, then EOS

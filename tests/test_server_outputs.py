"""Every sampling field of the OpenAI / vLLM wire through a real uvicorn server and the official openai
client, streaming and not: n, penalties and biases, logprobs (completions and chat shapes),
prompt_logprobs, echo, and structured output (response_format, structured_outputs, guided_*). The
server speculates (a draft model, k fixed); each answer must equal the library's (``LLM``) for the same
parameters, and the metrics must show that the drafts ran."""

from __future__ import annotations


import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from test_server import KEY, NAME, scrape, serving, spec_config
from tiny_models import make_byte_tokenizer, make_model, perturbed_copy

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread, the machine is shared

PROMPTS = ["w1 w2 w3", "w7 w8 w7 w8", "w20 w21 w22 w23 w24"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    target = make_model(root / "target", "llama", max_pos=256)
    return str(target), str(perturbed_copy(target, root / "draft", 0.01))


@pytest.fixture(scope="module")
def server(models):
    with serving(*models, max_num_seqs=8) as s:
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
        c[2] = None if c[2] is None else SimpleNamespace(**c[2])
    assert list(sorted(out)) == list(range(len(out)))
    return [tuple(c) for c in choices], chunks[-1].usage


# -- n ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_per_prompt_equal_the_library(server, client, library, stream):
    kw = dict(temperature=0.8, seed=7, max_tokens=10)
    choices, usage = completion(client, PROMPTS[:2], stream, n=2, **kw)
    want = library.generate(PROMPTS[:2], SamplingParams(n=2, ignore_eos=True, **kw))
    assert len(choices) == 4  # prompt-major: choice i answers prompt i // n
    for i, (text, ids, _, reason) in enumerate(choices):
        ref = want[i // 2].outputs[i % 2]
        assert (text, ids, reason) == (ref.text, ref.token_ids, "length")
    assert choices[0][1] != choices[1][1]  # two choices of one prompt draw differently
    prompt_tokens = sum(len(server.llm.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 40)  # the prompt counts once


def test_best_of_keeps_the_likeliest_choices(client, library):
    kw = dict(temperature=1.0, seed=21, max_tokens=8)
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], n=2, best_of=4,
                                  extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    runs = library.generate(PROMPTS[2], SamplingParams(n=4, logprobs=0, ignore_eos=True, **kw))[0].outputs
    best = sorted(runs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [c.model_extra["token_ids"] for c in r.choices] == [o.token_ids for o in best]
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].logprobs is None  # not asked for
    assert r.usage.completion_tokens == 32  # all four ran


def test_chat_n_choices_stream_a_role_chunk_each(client):
    messages = [{"role": "user", "content": "w3 w4"}]
    kw = dict(model=NAME, messages=messages, n=3, temperature=0.9, seed=3, max_tokens=6,
              extra_body={"ignore_eos": True, "min_tokens": 2})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(stream=True, **kw))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert text == r.choices[i].message.content
    r = client.chat.completions.create(model=NAME, messages=messages, logit_bias={"2": 100},
                                       extra_body={"min_tokens": 3})  # no max_tokens: up to the context's end
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4  # 3 tokens, then EOS


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


# -- logprobs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_the_library(server, client, library, stream):
    kw = dict(max_tokens=10, temperature=0)
    before = scrape(server.url)
    ((text, ids, lp, _),), _ = completion(client, PROMPTS[0], stream, logprobs=3, **kw)
    drafts = ("specdec:spec_decode_num_drafts_total", ())
    assert scrape(server.url)[drafts] > before[drafts]  # logprobs do not turn speculation off
    want = library.generate(PROMPTS[0], SamplingParams(ignore_eos=True, logprobs=3, **kw))[0].outputs[0]
    assert ids == want.token_ids and len(lp.tokens) == len(ids)
    tok = server.llm.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in ids]
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for t, got, top, pos in zip(ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert got == pytest.approx(pos[t].logprob, abs=1e-5)
        best = sorted(pos.values(), key=lambda x: x.rank)[:3]
        assert set(top) == {pos[t].decoded_token} | {x.decoded_token for x in best}  # chosen + the top 3
        for x in best:
            assert top[x.decoded_token] == pytest.approx(x.logprob, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_the_library(server, client, library, stream):
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    kw = dict(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    if stream:
        content = []
        for ch in client.chat.completions.create(stream=True, **kw):
            if ch.choices and ch.choices[0].logprobs is not None:
                content += ch.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    prompt = "user: w5 w6 w7\nassistant:"  # the default chat template (chat.py)
    want = library.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    out = want[0].outputs[0]
    assert [c.token for c in content] == [out.logprobs[i][t].decoded_token for i, t in enumerate(out.token_ids)]
    for c, t, pos in zip(content, out.token_ids, out.logprobs):
        assert c.logprob == pytest.approx(pos[t].logprob, abs=1e-5) and c.bytes == list(c.token.encode())
        best = sorted(pos.values(), key=lambda x: x.rank)[:2]
        assert [x.token for x in c.top_logprobs] == [x.decoded_token for x in best]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx([x.logprob for x in best], abs=1e-5)


def test_prompt_logprobs_and_echo(server, client, library):
    prompt = PROMPTS[2]
    want = library.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                   prompt_logprobs=2))[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for g, w in zip(got[1:], want.prompt_logprobs[1:]):
        assert {int(t): (v["rank"], v["decoded_token"]) for t, v in g.items()} == {
            t: (x.rank, x.decoded_token) for t, x in w.items()}
        assert [v["logprob"] for v in g.values()] == pytest.approx([x.logprob for x in w.values()], abs=1e-5)
    # echo: the prompt's text and tokens come first; its first token has no logprob
    for stream in (False, True):
        ((text, _, lp, _),), _ = completion(client, prompt, stream, max_tokens=4, temperature=0, logprobs=1,
                                            echo=True)
        assert text == prompt + want.outputs[0].text
        n = len(want.prompt_token_ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == n + 4
        assert lp.token_logprobs[1:n] == pytest.approx(
            [w[t].logprob for w, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])], abs=1e-5)


def test_logprobs_name_tokens_by_id_when_asked(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                              "return_token_ids": True})
    c = r.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]]
    assert all(len(top) == 1 for top in c.logprobs.top_logprobs)  # logprobs=0: the chosen token alone


# -- structured output -----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


def valid(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"color", "n"} and obj["color"] in ("red", "green", "blue") and obj["n"] in range(10)


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    """A target and draft whose tokenizer has one token per byte: any JSON or regex match is spelled."""
    root = tmp_path_factory.mktemp("outputs_bytes")
    make_byte_tokenizer(root / "bytes")
    target = make_model(root / "target", "llama", max_pos=512, tokenizer_from=root / "bytes")
    return str(target), str(perturbed_copy(target, root / "draft", 0.01))


@pytest.fixture(scope="module")
def byte_server(byte_models):
    with serving(*byte_models, max_num_seqs=8) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        yield s


@pytest.fixture(scope="module")
def byte_library(byte_models):
    target, draft = byte_models
    return LLM(target, speculative_config=spec_config(draft), max_num_seqs=8)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_parses_validates_and_equals_the_library(byte_server, byte_library, stream):
    messages = [{"role": "user", "content": "Pick a color and a digit."}]
    kw = dict(model=NAME, messages=messages, max_tokens=300, temperature=1.0, seed=5, n=2,
              response_format=RESPONSE_FORMAT)
    before = scrape(byte_server.url)
    if stream:
        texts, reasons = ["", ""], [None, None]
        for ch in byte_server.client.chat.completions.create(stream=True, **kw):
            c = ch.choices[0]
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    else:
        r = byte_server.client.chat.completions.create(**kw)
        texts, reasons = [c.message.content for c in r.choices], [c.finish_reason for c in r.choices]
    want = byte_library.generate("user: Pick a color and a digit.\nassistant:", SamplingParams(
        max_tokens=300, temperature=1.0, seed=5, n=2, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    assert texts == [o.text for o in want[0].outputs] and reasons == ["stop", "stop"]
    assert all(valid(t) for t in texts)
    drafts = ("specdec:spec_decode_num_drafts_total", ())
    assert scrape(byte_server.url)[drafts] > before[drafts]  # speculation ran under the grammar


STRUCTURED = [  # (extra body, the library's StructuredOutputsParams fields, what the text must be)
    ({"guided_regex": "[a-c]{2,5}x[0-9]"}, {"regex": "[a-c]{2,5}x[0-9]"},
     lambda t: re.fullmatch("[a-c]{2,5}x[0-9]", t)),
    ({"structured_outputs": {"regex": "(yes|no), [0-9]+\\."}}, {"regex": "(yes|no), [0-9]+\\."},
     lambda t: re.fullmatch("(yes|no), [0-9]+\\.", t)),
    ({"guided_choice": ["alpha", "beta", "gamma ray"]}, {"choice": ["alpha", "beta", "gamma ray"]},
     lambda t: t in ("alpha", "beta", "gamma ray")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}, valid),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     {"json": SCHEMA, "disable_any_whitespace": True}, lambda t: valid(t) and " " not in t),
    ({"guided_grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}, {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
     lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t)),
    # a random model writes long strings: seed 3 ends its object within max_tokens (91 tokens)
    ({"response_format": {"type": "json_object"}, "seed": 3}, {"json_object": True},
     lambda t: isinstance(json.loads(t), dict)),
]


@pytest.mark.parametrize("extra, so, check", STRUCTURED, ids=lambda x: next(iter(x)) if isinstance(x, dict) else "")
def test_structured_outputs_and_guided_names_equal_the_library(byte_server, byte_library, extra, so, check):
    prompt, seed = "Answer: ", extra.get("seed", 11)
    for stream in (False, True):
        ((text, ids, _, reason),), _ = completion(byte_server.client, prompt, stream, max_tokens=200, temperature=1.0,
                                                  extra_body={"seed": seed, **extra, "ignore_eos": False})
        want = byte_library.generate(prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                                            structured_outputs=StructuredOutputsParams(**so)))
        assert (text, ids) == (want[0].outputs[0].text, want[0].outputs[0].token_ids)
        assert reason == "stop" and check(text), text


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}}}}, "response_format"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_its_field(byte_server, extra, param):
    r = httpx.post(byte_server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": NAME, "prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    message = r.json()["error"]["message"]
    assert "objekt" not in message and "unclosed" not in message.lower()  # no grammar-engine text
    ((text, _, _, _),), _ = completion(byte_server.client, "x", False, max_tokens=4, temperature=0)
    assert len(text) > 0  # the server keeps serving

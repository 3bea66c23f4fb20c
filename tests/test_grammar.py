"""specdec.grammar: masks allow exactly the grammar's continuations, rollback restores the state, a
complete grammar allows only the stop tokens, bad constraints fail clearly, the cache stays bounded."""

from __future__ import annotations

import functools
import itertools
import json
import threading

import pytest
import torch

from specdec.config import StructuredOutputsParams as SO
from specdec.grammar import GrammarCompiler
from specdec.models.resolve import SHIPPED
from tiny_models import byte_level_token_bytes

SHIPPED_TOKENIZER = SHIPPED["specdec/demo-target"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "manager"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok) + 8, {tok.eos_token_id})  # 8 padding rows past the tokenizer


def allowed(m) -> set[int]:
    return set(m.allowed_mask().nonzero().flatten().tolist())


@functools.lru_cache(maxsize=2)
def token_bytes(tok) -> list[bytes]:
    return byte_level_token_bytes(tok)


def expected_allowed(tok, language: list[str], text: bytes) -> set[int]:
    """Independently of the grammar engine: the tokens whose bytes extend ``text`` towards a string of
    the finite ``language``, plus EOS where ``text`` is complete."""
    strings = [s.encode() for s in language]
    out = {t for t, piece in enumerate(token_bytes(tok)) if piece and any(s.startswith(text + piece) for s in strings)}
    return out | ({tok.eos_token_id} if text in strings else set())


def forced(language: list[str], text: bytes) -> bool:
    """Whether every string of ``language`` that extends ``text`` continues with the same byte."""
    rest = [s.encode()[len(text):] for s in language if s.encode().startswith(text)]
    return text not in [s.encode() for s in language] and len({r[:1] for r in rest}) == 1


def walk_checking(tok, m, language: list[str], path: list[int]) -> None:
    """Along ``path``, the mask allows exactly the continuations (only their canonical spelling where the
    grammar forces the next bytes), and ``accept_token`` agrees with the mask."""
    text = b""
    for t in [*path, None]:
        got, want = allowed(m), expected_allowed(tok, language, text)
        if forced(language, text):
            assert got and got <= want, repr(text)
        else:
            assert got == want, repr(text)
        for u in sorted(want - got)[:5]:
            assert not m.accept_token(u)
        for u in sorted(got)[:5]:
            assert m.accept_token(u)
            m.rollback(1)
        if t is None:
            return
        assert m.accept_token(t)
        text += token_bytes(tok)[t]


def test_regex_mask_is_exactly_the_continuations(tok, compiler):
    language = ["".join(p) for p in itertools.product(["cat", "car", "dog"], ["", "s"], [" ran", " run"])]
    m = compiler.matcher(SO(regex=r"(cat|car|dog)s? r[au]n"))
    path = tok.encode("cars run", add_special_tokens=False)
    walk_checking(tok, m, language, path)
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()


def test_choice_allows_each_string_and_their_overlaps(tok, compiler):
    choices = ["a", "ab", 'say "hi"\\', "é!"]
    m = compiler.matcher(SO(choice=choices))
    walk_checking(tok, m, choices, tok.encode("ab", add_special_tokens=False))
    m2 = compiler.matcher(SO(choice=choices))
    walk_checking(tok, m2, choices, tok.encode('say "hi"\\', add_special_tokens=False))
    m3 = compiler.matcher(SO(choice=choices))
    walk_checking(tok, m3, choices, tok.encode("é!", add_special_tokens=False))


@pytest.mark.parametrize("grammar", [
    'start: ("yes" | "no") "!"?',  # Lark
    'root ::= ("yes" | "no") "!"?',  # GBNF / vLLM's EBNF
])
def test_grammar_in_lark_and_gbnf(tok, compiler, grammar):
    language = ["yes", "no", "yes!", "no!"]
    walk_checking(tok, compiler.matcher(SO(grammar=grammar)), language, tok.encode("yes!", add_special_tokens=False))


def test_json_schema_accepts_a_valid_record_and_then_only_eos(tok, compiler):
    record = {"name": "Ada", "age": 36, "role": "engineer", "tags": ["math", "code"]}
    m = compiler.matcher(SO(json=SCHEMA))
    for t in tok.encode(json.dumps(record), add_special_tokens=False):
        mask = m.allowed_mask()
        assert mask[t] and not mask[len(tok):].any()
        assert m.accept_token(t)
    assert allowed(m) == {tok.eos_token_id}  # the object is closed: only the stop token may follow
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    assert not m.accept_token(tok.encode(" ", add_special_tokens=False)[0])
    assert allowed(m) == {tok.eos_token_id}  # still never an empty row, and what it allows is taken
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    m.rollback(2)
    assert allowed(m) == {tok.eos_token_id} and not m.is_terminated()


def test_json_schema_refuses_what_the_schema_forbids(tok, compiler):
    m = compiler.matcher(SO(json=SCHEMA))
    for t in tok.encode('{"name": "Ada", "age": ', add_special_tokens=False):
        assert m.accept_token(t)
    before = m.allowed_mask()
    for text in ['"', "x", "}"]:  # age is an integer
        t = tok.encode(text, add_special_tokens=False)[0]
        assert not before[t] and not m.accept_token(t)
    assert not m.accept_token(len(tok) + 1)  # a padding id
    assert not m.accept_token(tok.eos_token_id)  # the object is not complete
    assert torch.equal(m.allowed_mask(), before)  # refusals leave the state as it was
    digit = tok.encode("7", add_special_tokens=False)[0]
    assert before[digit] and m.accept_token(digit)


def test_json_properties_come_in_the_schemas_order(tok, compiler):
    """Two schemas that differ only in key order are two constraints (the grammar's cache key,
    StructuredOutputsParams.spec_text, keeps the order)."""
    def schema(names):
        return {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names,
                "additionalProperties": False}

    for names in (["zeta", "alpha"], ["alpha", "zeta"]):
        m = compiler.matcher(SO(json=schema(names), disable_any_whitespace=True))
        text = json.dumps({n: 1 for n in names}, separators=(",", ":"))
        for t in tok.encode(text, add_special_tokens=False):
            assert m.accept_token(t), text
        assert allowed(m) == {tok.eos_token_id}


def test_json_object_and_whitespace_switch(tok, compiler):
    space_brace = tok.encode('{ "', add_special_tokens=False)
    assert len(space_brace) >= 2 and tok.decode(space_brace[:1]) == "{"
    loose, tight = compiler.matcher(SO(json_object=True)), compiler.matcher(SO(json_object=True,
                                                                               disable_any_whitespace=True))
    assert loose.accept_token(space_brace[0]) and tight.accept_token(space_brace[0])
    nxt = space_brace[1]  # ' "': whitespace then a key
    assert loose.allowed_mask()[nxt] and not tight.allowed_mask()[nxt]
    for t in tok.encode('"k": [1, {"x": null}]}', add_special_tokens=False):
        assert loose.accept_token(t)
    assert allowed(loose) == {tok.eos_token_id}


def test_rollback_restores_masks(tok, compiler):
    g = torch.Generator().manual_seed(0)
    m = compiler.matcher(SO(json=SCHEMA))
    masks, tokens = [m.allowed_mask()], []
    while not m.is_terminated() and len(tokens) < 60:
        ids = masks[-1].nonzero().flatten()
        t = int(ids[torch.randint(len(ids), (1,), generator=g)])
        assert m.accept_token(t)
        tokens.append(t)
        masks.append(m.allowed_mask())
    for k in (1, 3, 5, 2):
        if k > len(tokens):
            break
        m.rollback(k)
        del tokens[-k:], masks[-k:]
        assert torch.equal(m.allowed_mask(), masks[-1])
        assert m.num_accepted == len(tokens)
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(len(tokens) + 1)


@pytest.mark.parametrize("regex,text", [("ab", "ab"), ("a+", "a")])
def test_rollback_over_the_stop_token(tok, compiler, regex, text):
    """'ab' has ended before the stop token, 'a+' has not: either way one rollback undoes exactly it."""
    m = compiler.matcher(SO(regex=regex))
    ids = tok.encode(text, add_special_tokens=False)
    for t in ids:
        assert m.accept_token(t)
    after_text = m.allowed_mask()
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and torch.equal(m.allowed_mask(), after_text)
    m.rollback(len(ids))
    assert torch.equal(m.allowed_mask(), compiler.matcher(SO(regex=regex)).allowed_mask())


def test_several_stop_tokens_and_padding_rows(tok):
    other = tok.encode("\n", add_special_tokens=False)[0]
    c = GrammarCompiler(tok, len(tok) + 64, {tok.eos_token_id, other})
    m = c.matcher(SO(regex="ok"))
    for t in tok.encode("ok", add_special_tokens=False):
        assert m.accept_token(t)
    assert allowed(m) == {tok.eos_token_id, other}
    assert m.allowed_mask().shape == (len(tok) + 64,)
    assert m.accept_token(other) and m.is_terminated()


def test_a_failed_matcher_ends_the_output(tok, compiler, caplog):
    """Where llguidance gives up (a step over its limits; forced here), only the stop token remains."""
    m = compiler.matcher(SO(regex="abc"))
    m._ll.consume_token(tok.encode("x", add_special_tokens=False)[0])  # llguidance's own error state
    assert allowed(m) == {tok.eos_token_id} and "grammar matcher failed" in caplog.text
    assert not m.accept_token(tok.encode("a", add_special_tokens=False)[0])
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    m.rollback(1)
    assert allowed(m) == {tok.eos_token_id}


@pytest.mark.parametrize("so,message", [
    (SO(json="{not json"), "not valid JSON"),
    (SO(json="[1, 2]"), "must be a JSON schema object"),
    (SO(json={"type": "strnig"}), "json is not valid"),
    (SO(regex="(ab"), "regex is not valid"),
    (SO(grammar="start: undefined_rule"), "grammar is not valid"),
    (SO(grammar="root ::= ("), "grammar"),
])
def test_bad_constraints_fail_clearly(compiler, so, message):
    with pytest.raises(ValueError, match=message):
        compiler.matcher(so)


def test_errors_stay_short_for_huge_inputs(compiler):
    with pytest.raises(ValueError) as e:
        compiler.matcher(SO(regex="(" * 20_000 + "a"))
    assert len(str(e.value)) < 500


def test_cache_is_bounded_and_reused(tok):
    c = GrammarCompiler(tok, len(tok), {tok.eos_token_id}, max_cached=2)
    for rx in ("a", "b", "c"):
        c.matcher(SO(regex=rx))
    assert c.cache_size() == 2
    m1, m2 = c.matcher(SO(regex="c")), c.matcher(SO(regex="c"))  # one template, independent matchers
    assert m1.accept_token(tok.encode("c", add_special_tokens=False)[0])
    assert not m2.is_terminated() and m2.num_accepted == 0
    c.clear_cache()
    assert c.cache_size() == 0 and c.matcher(SO(regex="c")).accept_token(tok.encode("c", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="max_cached"):
        GrammarCompiler(tok, len(tok), {0}, max_cached=0)


def test_compiles_from_several_threads(tok):
    c = GrammarCompiler(tok, len(tok), {tok.eos_token_id}, max_cached=3)
    results, errors = {}, []

    def work(i):
        try:
            so = SO(choice=[f"option{i % 5}", "other"])
            m = c.matcher(so)
            for t in tok.encode(f"option{i % 5}", add_special_tokens=False):
                assert m.accept_token(t)
            results[i] = allowed(m)
        except Exception as e:  # collected: an assert in a thread would not fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r == {tok.eos_token_id} for r in results.values()) and len(results) == 12
    assert c.cache_size() == 3


def test_needs_a_tokenizer_and_stop_tokens(tok):
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCompiler(None, 100, {0}).matcher(SO(regex="a"))
    with pytest.raises(ValueError, match="end-of-sequence"):
        GrammarCompiler(tok, len(tok), set()).matcher(SO(regex="a"))


def test_refuses_a_tokenizer_it_cannot_read(tmp_path):
    """The tests' word-level tokenizer has no byte-level decoder: the compiler says so."""
    from tiny_models import make_tokenizer
    from transformers import AutoTokenizer

    make_tokenizer(tmp_path)
    wtok = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot read this model's tokenizer"):
        GrammarCompiler(wtok, len(wtok), {wtok.eos_token_id}).matcher(SO(regex="w1"))

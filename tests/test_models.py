"""The runner's logits equal transformers' own forward, for each supported architecture."""

import json

import pytest
import torch

from specdec.models.base import ForwardBatch
from specdec.models.layers import FEW_QUERIES, attention_mask, few_query_attention
from specdec.models.llama import LlamaRunner
from specdec.models.load import load_model
from tiny_models import make_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied-llama3-rope": ("llama", dict(tie=True, kv_heads=4, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-yarn-rope": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 64})),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, tie=True)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=6)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    arch, kw = CASES[request.param]
    folder = make_model(tmp_path_factory.mktemp(request.param), arch, **kw)
    loaded = load_model(str(folder))
    return loaded.hf_model, LlamaRunner(load_model(str(folder)))


def test_logits_match_transformers_in_chunks_and_ragged_batches(pair):
    hf, runner = pair
    ids = torch.randint(3, 100, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[..., : runner.vocab_size]  # [3, 24, V]
    runner.release()
    runner.sync_rows([0, 1, 2])
    # different rows at different positions in one call: row b has fed 5 + 4b tokens already
    runner.forward(ForwardBatch.dense(ids[:, :5], [0, 0, 0]))
    runner.forward(ForwardBatch.dense(torch.stack([ids[1, 5:9], ids[2, 5:9]]), [5, 5], row_offset=1))
    runner.forward(ForwardBatch.dense(ids[2:3, 9:13], [9], row_offset=2))
    starts = [5, 9, 13]
    step = torch.stack([ids[b, s : s + 6] for b, s in enumerate(starts)])
    out = runner.forward(ForwardBatch.dense(step, starts, "all"))  # [3, 6, V]
    for b, s in enumerate(starts):
        torch.testing.assert_close(out[b], ref[b, s : s + 6], atol=1e-4, rtol=0)


def test_packed_rows_with_a_long_prompt_match_transformers(pair):
    """A merged prompt longer than FEW_QUERIES among short rows (not the last row, so the short
    ones are not contiguous): packed, the prompt attends alone, the short rows together."""
    hf, runner = pair
    ids = torch.randint(3, 100, (4, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits[..., : runner.vocab_size]  # [4, 24, V]
    runner.release()
    runner.sync_rows([0, 1, 2, 3])
    runner.forward(ForwardBatch.dense(ids[:, :10], [0, 0, 0, 0]))  # rows 0, 2, 3 go on from 10 tokens; row 1 starts over
    lengths, starts = [2, FEW_QUERIES + 4, 1, 3], [10, 0, 10, 10]
    tokens = torch.zeros(4, max(lengths), dtype=torch.long)
    for b, (n, s) in enumerate(zip(lengths, starts)):
        tokens[b, :n] = ids[b, s : s + n]
    out = runner.forward(ForwardBatch(tokens, starts, lengths, torch.arange(tokens.shape[1]).expand(4, -1)))  # [4, T, V]
    for b, (n, s) in enumerate(zip(lengths, starts)):
        torch.testing.assert_close(out[b, :n], ref[b, s : s + n], atol=1e-4, rtol=0)
    # the cache holds exactly the real tokens: each row goes on by one
    ends = [s + n for s, n in zip(starts, lengths)]
    nxt = runner.forward(ForwardBatch.dense(torch.stack([ids[b, e : e + 1] for b, e in enumerate(ends)]), ends,
                                            "last"))
    for b, e in enumerate(ends):
        torch.testing.assert_close(nxt[b], ref[b, e], atol=1e-4, rtol=0)


def test_rollback_is_a_length_change(pair):
    hf, runner = pair
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[..., : runner.vocab_size]
    runner.release()
    runner.sync_rows(["a"])
    runner.forward(ForwardBatch.dense(ids[:, :10], [0]))
    junk = torch.randint(3, 100, (1, 5))
    runner.forward(ForwardBatch.dense(junk, [10]))  # speculative tokens that get rejected...
    out = runner.forward(ForwardBatch.dense(ids[:, 10:], [10], "all"))  # ...are simply overwritten
    torch.testing.assert_close(out[0], ref[0, 10:], atol=1e-4, rtol=0)
    last = runner.forward(ForwardBatch.dense(ids[:, 15:16], [15], "last"))
    torch.testing.assert_close(last[0], ref[0, 15], atol=1e-4, rtol=0)


def runner_and_reference(tmp_path, shape: tuple[int, int], seed: int):
    """A tiny Llama's runner, random token ids of ``shape`` and transformers' logits for them."""
    folder = make_model(tmp_path / "m", "llama")
    hf = load_model(str(folder)).hf_model
    ids = torch.randint(3, 100, shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids).logits
    return LlamaRunner(load_model(str(folder))), ids, ref


def test_rows_follow_their_sequences_when_the_batch_changes(tmp_path):
    runner, ids, ref = runner_and_reference(tmp_path, (3, 12), seed=2)
    assert runner.sync_rows(["a", "b", "c"]) == [True, True, True]
    runner.forward(ForwardBatch.dense(ids[:, :8], [0, 0, 0]))
    assert runner.sync_rows(["c", "a", "new"]) == [False, False, True]  # b left, c and a move, new joins
    runner.forward(ForwardBatch.dense(ids[2:3, :8], [0], row_offset=2))
    out = runner.forward(ForwardBatch.dense(torch.stack([ids[2, 8:], ids[0, 8:], ids[2, 8:]]), [8, 8, 8], "all"))
    torch.testing.assert_close(out[0], ref[2, 8:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], ref[0, 8:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], ref[2, 8:], atol=1e-4, rtol=0)


def test_a_departure_moves_only_the_rows_that_must_move(tmp_path, monkeypatch):
    runner, ids, ref = runner_and_reference(tmp_path, (4, 12), seed=3)
    runner.sync_rows(["a", "b", "c", "d"])
    runner.forward(ForwardBatch.dense(ids[:, :8], [0] * 4))
    moves = []
    move_rows = runner.cache.move_rows
    monkeypatch.setattr(runner.cache, "move_rows", lambda m: (moves.append(list(m)), move_rows(m)))
    runner.sync_rows(["a", "d", "c"])  # b left; d takes its row, a and c stay
    assert moves == [[(1, 3)]]
    out = runner.forward(ForwardBatch.dense(ids[[0, 3, 2], 8:], [8, 8, 8], "all"))
    for row, src in enumerate([0, 3, 2]):
        torch.testing.assert_close(out[row], ref[src, 8:], atol=1e-4, rtol=0)


def test_ragged_rows_are_packed_and_equal_their_dense_results(tmp_path):
    """lengths: each row's real tokens; the packed pass equals each row run alone, and a 2-D
    logits_index picks each row's own positions."""
    runner, ids, ref = runner_and_reference(tmp_path, (3, 16), seed=4)
    runner.sync_rows(["a", "b", "c"])
    runner.forward(ForwardBatch.dense(ids[:2, :6], [0, 0]))  # rows a and b hold 6 tokens; c is new
    tokens = torch.zeros(3, 10, dtype=torch.long)  # a: 2 tokens, b: 1, c: its first 10
    tokens[0, :2], tokens[1, :1], tokens[2] = ids[0, 6:8], ids[1, 6:7], ids[2, :10]
    index = torch.tensor([[0, 1], [0, 0], [8, 9]])  # [B, L]
    out = runner.forward(ForwardBatch(tokens, [6, 6, 0], [2, 1, 10], index))  # [3, 2, V]
    torch.testing.assert_close(out[0], ref[0, 6:8], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1, 0], ref[1, 6], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], ref[2, 8:10], atol=1e-4, rtol=0)
    # the cache holds every row's real tokens: continue each by one token
    nxt = runner.forward(ForwardBatch.dense(torch.stack([ids[0, 8:9], ids[1, 7:8], ids[2, 10:11]]), [8, 7, 10],
                                            "last"))
    for b, p in enumerate([8, 7, 10]):
        torch.testing.assert_close(nxt[b], ref[b, p], atol=1e-4, rtol=0)


def test_a_long_ragged_row_does_not_push_the_others_past_the_context(tmp_path):
    """A row deep in its context beside a newcomer's long prompt: the short row's padding goes to
    one scratch position, not to start + T, so the cache stays within the context."""
    folder = make_model(tmp_path / "m", "llama", max_pos=256)
    runner = LlamaRunner(load_model(str(folder)))
    runner.sync_rows(["old", "new"])
    runner.forward(ForwardBatch.dense(torch.randint(3, 100, (1, 250)), [0]))  # "old" holds 250 tokens
    tokens = torch.randint(3, 100, (2, 100))  # old: 1 token at 250; new: a 100-token prompt
    out = runner.forward(ForwardBatch(tokens, [250, 0], [1, 100], torch.tensor([0, 99])))
    assert runner.cache.max_len == 256 and torch.isfinite(out).all()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 5])
def test_few_query_attention_equals_sdpa(kv_heads, window):
    g = torch.Generator().manual_seed(0)
    B, H, T, end, hd = 3, 4, 4, 11, 8
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(2, B, kv_heads, end, hd, generator=g)
    pos = torch.tensor([[7], [3], [10]]) - torch.arange(T - 1, -1, -1)  # rows at different positions
    pos = pos.clamp(min=0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask(pos, end, window), enable_gqa=kv_heads != H)
    out = few_query_attention(q, k, v, attention_mask(pos, end, window, additive=True))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_padded_embedding_rows_are_cut_to_the_tokenizer(tmp_path):
    folder = make_model(tmp_path / "m", "llama", vocab_rows=160)
    runner = LlamaRunner(load_model(str(folder)))
    assert runner.vocab_size == 123  # the tokenizer's length, not the 160 embedding rows
    runner.sync_rows([0])
    assert runner.forward(ForwardBatch.dense(torch.tensor([[5, 6]]), [0], "all")).shape == (1, 2, 123)


def test_bfloat16_runs_close_to_float32(tmp_path):
    folder = make_model(tmp_path / "m", "llama")
    r32 = LlamaRunner(load_model(str(folder)))
    r16 = LlamaRunner(load_model(str(folder), dtype="bfloat16"))
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(3))
    for r in (r32, r16):
        r.sync_rows([0])
    a = r32.forward(ForwardBatch.dense(ids, [0], "all"))
    b = r16.forward(ForwardBatch.dense(ids, [0], "all"))
    assert b.dtype == torch.float32
    # 2 layers of 4 products and the LM head; each rounds its weight, input and result to bf16 (relative 2^-8
    # each, adding in quadrature within a product), and the products' errors add at worst linearly
    assert (a - b).abs().max() < (4 * 2 + 1) * 3**0.5 * 2**-8 * a.abs().max()


def test_unsupported_architecture_is_refused(tmp_path):
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    tf.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(str(tmp_path / "gpt2"))


def test_missing_folder_and_non_safetensors_weights_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="neither a local folder nor an available hub id"):
        load_model("no-such-org/no-such-model")
    folder = make_model(tmp_path / "m", "llama")
    state = {k: v for k, v in load_model(str(folder)).hf_model.state_dict().items()}
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors only"):
        load_model(str(folder))


def test_dynamic_rope_is_refused_with_the_supported_list(tmp_path):
    folder = make_model(tmp_path / "m", "llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                   "factor": 2.0})
    with pytest.raises(ValueError, match="RoPE type 'dynamic' is not supported"):
        LlamaRunner(load_model(str(folder)))


def test_stories260k_reproduces_llama2c_greedy_output(shared_data):
    from specdec import LLM, SamplingParams

    folder = shared_data / "stories260k"
    pieces = json.loads((folder / "llama2c_pieces.json").read_text())
    reference = (folder / "llama2c_greedy_reference.txt").read_text()
    llm = LLM(str(folder))
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
    text = _decode_llama2c([1] + out[0].outputs[0].token_ids, pieces)
    n = min(len(text), len(reference.rstrip("\n")))
    assert n > 500
    assert text[:n] == reference[:n]


def _decode_llama2c(ids, pieces):
    out = bytearray()
    for prev, tok in zip(ids, ids[1:]):
        piece = pieces[tok]
        if prev == 1 and piece.startswith(" "):
            piece = piece[1:]
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            out += bytes([int(piece[3:5], 16)])
        else:
            out += piece.encode()
    return out.decode("utf-8", errors="replace")

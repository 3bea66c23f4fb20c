"""benchmarks/peer_openvino.py's pure helpers: its arguments, the configurations they make, the
alternation, OpenVINO's τ and the result table. The comparison itself needs the throwaway OpenVINO
venv and never runs here."""

import importlib.util
import sys
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_openvino.py"
_spec = importlib.util.spec_from_file_location("peer_openvino", _path)
peer = importlib.util.module_from_spec(_spec)
sys.modules["peer_openvino"] = peer  # dataclasses look their module up by name
_spec.loader.exec_module(peer)


def test_int_list_and_bad_lists():
    assert peer.int_list("2, 4,8", "--x") == [2, 4, 8]
    for bad in ("", "a,2", "0,2", "-1"):
        with pytest.raises(ValueError, match="--x must be"):
            peer.int_list(bad, "--x")


def test_configs_from_arguments():
    args = peer.parse_args(["--backends", "auto,torch", "--ov-draft-ks", "2,5", "--ov-lookup-ks", "8",
                            "--enforce-eager", "both", "--ngram", "4"])
    with_eager = peer.build_configs(args, has_enforce_eager=True)
    without = peer.build_configs(args, has_enforce_eager=False)
    methods = ["plain", "draft k=8 adaptive", "suffix k=32 x3", "suffix k=8", "suffix + draft k=8 adaptive",
               "eagle3 k=8 adaptive", "pard k=6 adaptive"]
    torch_names = [c.name for c in with_eager if c.backend == "torch"]
    assert torch_names == [f"torch {m}" for m in methods] + [f"torch {m} eager" for m in methods]
    assert [c.name for c in without if c.backend == "torch"] == [f"torch {m}" for m in methods]
    eager = [c for c in with_eager if c.name.endswith("eager")]
    assert all(c.llm_kwargs == {"enforce_eager": True} and c.plain_key == "specdec torch plain eager" for c in eager)
    ov = [c for c in with_eager if c.engine == "openvino"]
    assert [c.ov for c in ov] == [{"config": "plain"}, {"config": "plain-sdpa"}, {"config": "draft", "k": 2},
                                  {"config": "draft", "k": 5}, {"config": "lookup", "k": 8, "ngram": 4}]
    assert all(c.plain_key == "openvino plain" for c in ov)
    by_name = {c.name: c for c in with_eager}
    assert by_name["torch suffix + draft k=8 adaptive"].spec == {"method": "draft_model", "model": args.draft,
                                                                 "num_speculative_tokens": 8,
                                                                 "enable_suffix_decoding": True}
    assert by_name["torch pard k=6 adaptive"].spec == {"method": "draft_model", "model": args.pard,
                                                       "num_speculative_tokens": 6, "parallel_drafting": True}
    no_head = peer.build_configs(peer.parse_args(["--eagle3-head", "", "--pard", "", "--backends", "llama.cpp"]), False)
    assert not any("eagle3" in c.name or "pard" in c.name for c in no_head)
    with pytest.raises(ValueError, match="--backends"):
        peer.build_configs(peer.parse_args(["--backends", "onnx"]), False)


def test_interleave_alternates_engines_and_reverses():
    args = peer.parse_args(["--backends", "torch", "--ov-draft-ks", "4", "--ov-lookup-ks", "8"])
    configs = peer.build_configs(args, False)
    order = peer.interleave(configs, reverse=False)
    assert sorted(c.key for c in order) == sorted(c.key for c in configs)
    assert [c.engine for c in order[:6]] == ["specdec", "openvino"] * 3
    assert peer.interleave(configs, reverse=True) == order[::-1]


def test_tau_and_table():
    ov_runs = [{"tokens": list(range(11)), "seconds": 0.1, "accepted": 6, "drafted": 8},
               {"tokens": list(range(11)), "seconds": 0.2, "accepted": 2, "drafted": 8}]
    # 20 tokens after the prefills' first ones, 8 of them accepted drafts: 12 verify passes
    assert peer.tau_openvino(ov_runs) == pytest.approx(20 / 12)
    assert peer.tau_openvino([{"tokens": [1, 2], "seconds": 1.0}]) is None
    results = {"openvino draft k=4": ov_runs,
               "openvino plain": [{"tokens": list(range(10)), "seconds": s} for s in (0.5, 0.2, 0.25)],
               "specdec torch plain": [{"tokens": list(range(10)), "seconds": s} for s in (0.4, 0.1, 0.2)],
               "specdec torch suffix k=32 x3": [{"tokens": list(range(10)), "seconds": 0.05}]}
    rows = peer.summarize(results, {"openvino draft k=4": peer.tau_openvino(ov_runs)})
    by_key = {r["key"]: r for r in rows}
    assert by_key["openvino plain"]["median"] == pytest.approx(10 / 0.25)
    assert by_key["openvino plain"]["total"] == pytest.approx(30 / 0.95)
    assert [r["median"] for r in rows] == sorted((r["median"] for r in rows), reverse=True)
    assert peer.best_of(rows, "specdec")["key"] == "specdec torch suffix k=32 x3"
    assert peer.best_of(rows, "openvino", speculative=False)["key"] == "openvino plain"
    lines = peer.ratio_lines(rows)
    assert len(lines) == 4 and lines[1].endswith(f"{(10 / 0.2) / (10 / 0.25):.2f}x")
    # by the set's tok/s: the best of each engine by all its tokens over all its seconds
    assert lines[3].startswith("by set tok/s: specdec best (torch suffix k=32 x3")
    assert "OpenVINO best (draft k=4" in lines[3] and lines[3].endswith(f"{(10 / 0.05) / (22 / 0.3):.2f}x")
    table = peer.format_table(rows, {"openvino plain": "bf16 inference"})
    assert "| openvino plain | 40.0 |" in table and "bf16 inference" in table and "| 1.67 |" in table


def test_setup_installs_cpu_torch_first_and_drops_torchvision(tmp_path):
    cmds = peer.setup_commands(tmp_path / "v", torch_index="file:///wheels")
    assert cmds[0][-1] == str(tmp_path / "v")
    assert cmds[2][-1] == peer.TORCH_PIN and "--index-url" in cmds[2]
    assert peer.TORCH_PIN in cmds[3] and all(p in cmds[3] for p in peer.OPENVINO_PINS)
    assert cmds[-1][-2:] == ["-y", "torchvision"]

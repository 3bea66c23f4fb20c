"""The same speculative setting for the engine one deploys on, with that engine's own option names.

Names checked against each engine's documentation:
- vLLM: ``speculative_config`` keys ``method`` (``draft_model``, ``ngram``, ``suffix``), ``model``,
  ``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``, ``suffix_decoding_*``.
- SGLang: ``--speculative-algorithm STANDALONE|NGRAM``, ``--speculative-draft-model-path``,
  ``--speculative-num-steps``, ``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``
  (the verified tokens: the drafts plus the last committed token, so k + 1 for a chain of k),
  ``--speculative-ngram-min/max-match-window-size``, ``--speculative-ngram-max-bfs-breadth``.
- TensorRT-LLM (LLM API / ``trtllm-serve --extra_llm_api_options``): ``speculative_config`` with
  ``decoding_type: DraftTarget|NGram``, ``max_draft_len``, ``speculative_model_dir``,
  ``max_matching_ngram_size``, ``is_public_pool``.
- llama.cpp ``llama-server``: ``-md``, ``--draft-max``, ``--draft-min``, ``--draft-p-min``, ``--spec-type``.

Where an engine has no equivalent of a setting the export says so in a note (a ``#`` comment in the
text) instead of emitting an option that would mean something else.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specdec.config import SpeculativeConfig
from specdec.json_input import json_object

ENGINES = ("vllm", "sglang", "trtllm", "llamacpp")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM", "llamacpp": "llama.cpp"}
# Per engine, the methods it has no equivalent of, each with the nearest option it does have ("": none to name).
MISSING = {
    "vllm": {"layer_skip": "nearest options are a draft model or EAGLE heads, which need separately trained weights"},
    "sglang": {"suffix": "the nearest is --speculative-algorithm NGRAM (an n-gram cache over earlier requests)",
               "layer_skip": ""},
    "trtllm": {"suffix": "the nearest is decoding_type NGram", "layer_skip": ""},
    "llamacpp": {"suffix": "", "layer_skip": ""},
}
METHOD_NAMES = {"suffix": "suffix-decoding drafter",
                "layer_skip": "layer-skip self-speculation (drafting with the target's first layers)"}
ENGINE_NOTES = {"llamacpp": ["llama.cpp loads GGUF files: convert each checkpoint with llama.cpp's convert_hf_to_gguf.py "
                             "and pass the .gguf paths"]}


@dataclass
class Export:
    engine: str
    method: str
    supported: bool  # False: the engine has no equivalent of the method; ``text`` only explains
    options: dict  # the engine's options as data (vLLM/TRT-LLM: the config; SGLang/llama.cpp: flag -> value)
    command: str | None  # how to launch it, or None
    notes: list[str] = field(default_factory=list)
    text: str = ""  # what the CLI prints: notes as comments, then the config or the command

    def as_dict(self) -> dict:
        return {"engine": self.engine, "method": self.method, "supported": self.supported,
                "options": self.options, "command": self.command, "notes": self.notes, "text": self.text}


def export_config(engine: str, speculative_config: dict | SpeculativeConfig, model: str | None = None) -> Export:
    """The equivalent of ``speculative_config`` (for target ``model``) on ``engine``."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    spec = SpeculativeConfig.from_dict(speculative_config)
    if spec is None or spec.num_speculative_tokens == 0:
        raise ValueError("the speculative config drafts no tokens (num_speculative_tokens is 0); nothing to export")
    target = model or "TARGET_MODEL"
    notes = _common_notes(spec) + ENGINE_NOTES.get(engine, [])
    if spec.method in MISSING[engine]:
        nearest = MISSING[engine][spec.method]
        why = f"{ENGINE_NAMES[engine]} has no {METHOD_NAMES[spec.method]}" + (f"; {nearest}" if nearest else "")
        exp = Export(engine, spec.method, False, {}, None, notes + [why])
    else:
        exp = {"vllm": _vllm, "sglang": _sglang, "trtllm": _trtllm, "llamacpp": _llamacpp}[engine](spec, target, notes)
    exp.text = _render(exp)
    return exp


def export_from_profile(engine: str, profile_path: str | Path) -> Export:
    """Export the setting a ``specdec profile`` run recommended."""
    path = Path(profile_path)
    if not path.is_file():
        raise ValueError(f"profile {str(path)!r} does not exist; run `specdec profile ... --out DIR` first")
    profile = json_object(path.read_text(), f"profile {str(path)!r}")
    rec = profile.get("recommendation")
    if not isinstance(rec, dict) or "speculative_config" not in rec:
        raise ValueError(f"profile {str(path)!r} has no recommendation; is it a specdec profile.json?")
    if rec.get("plain"):
        raise ValueError("the profile recommends plain decoding (no k paid off on this workload); "
                         "export a setting explicitly with --speculative-config if you want one anyway")
    return export_config(engine, rec["speculative_config"], profile.get("model"))


# -- per engine -----------------------------------------------------------------------------------


def _common_notes(spec: SpeculativeConfig) -> list[str]:
    notes = []
    if spec.adaptive:
        notes.append("specdec's adaptive k (one per round for the batch, from measured acceptance and costs) has no equivalent "
                     f"here; this uses a fixed k = {spec.num_speculative_tokens} (profile with --k-max to pick it)")
    if spec.enable_suffix_decoding:
        notes.append("enable_suffix_decoding (suffix drafts in front of the model's) has no equivalent here; this "
                     f"exports {spec.method} alone (Snowflake's Arctic Inference plugin for vLLM pairs the two)")
    return notes


def _vllm(spec: SpeculativeConfig, target: str, notes: list[str]) -> Export:
    k = spec.num_speculative_tokens
    if spec.method == "draft_model":
        cfg = {"method": "draft_model", "model": spec.model, "num_speculative_tokens": k}
        if spec.draft_p_min > 0:
            notes.append(f"draft_p_min={spec.draft_p_min} (stop drafting below this draft probability) has no "
                         "vLLM option; vLLM always drafts num_speculative_tokens")
    elif spec.method == "ngram":
        cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": spec.prompt_lookup_max,
               "prompt_lookup_min": spec.prompt_lookup_min}
    else:  # suffix
        cfg = {"method": "suffix", "num_speculative_tokens": k,
               "suffix_decoding_max_tree_depth": spec.suffix_decoding_max_tree_depth,
               "suffix_decoding_max_cached_requests": spec.suffix_decoding_max_cached_requests,
               "suffix_decoding_max_spec_factor": spec.suffix_decoding_max_spec_factor,
               "suffix_decoding_min_token_prob": spec.suffix_decoding_min_token_prob}
        notes.append("vLLM's suffix decoding needs the arctic-inference package installed")
    command = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(cfg))}"
    return Export("vllm", spec.method, True, {"speculative_config": cfg}, command, notes)


def _sglang(spec: SpeculativeConfig, target: str, notes: list[str]) -> Export:
    k = spec.num_speculative_tokens
    if spec.method == "draft_model":
        flags = {"--speculative-algorithm": "STANDALONE", "--speculative-draft-model-path": spec.model,
                 "--speculative-num-steps": k, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": k + 1}
        notes.append("--speculative-num-draft-tokens counts the last committed token too: k drafts -> k + 1; "
                     "--speculative-eagle-topk 1 makes it a chain like specdec's, not a tree")
        if spec.draft_p_min > 0:
            notes.append(f"draft_p_min={spec.draft_p_min} has no SGLang option; SGLang always drafts "
                         "--speculative-num-steps tokens")
    else:  # ngram
        flags = {"--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": k + 1,
                 "--speculative-ngram-min-match-window-size": spec.prompt_lookup_min,
                 "--speculative-ngram-max-match-window-size": spec.prompt_lookup_max,
                 "--speculative-ngram-max-bfs-breadth": 1}
        notes.append("SGLang's NGRAM matches against a cache of earlier prompts and outputs, not only this "
                     "request's context, and runs on CUDA only; --speculative-ngram-max-bfs-breadth 1 keeps one "
                     "chain of drafts as specdec does")
        notes.append("newer SGLang releases replace the match-window flags by --speculative-ngram-max-trie-depth; "
                     "check `python -m sglang.launch_server --help` for your version")
    parts = ["python -m sglang.launch_server", f"--model-path {shlex.quote(target)}"]
    parts += [f"{name} {shlex.quote(str(value))}" for name, value in flags.items()]
    return Export("sglang", spec.method, True, flags, " \\\n  ".join(parts), notes)


def _trtllm(spec: SpeculativeConfig, target: str, notes: list[str]) -> Export:
    k = spec.num_speculative_tokens
    extra: dict = {}
    if spec.method == "draft_model":
        cfg = {"decoding_type": "DraftTarget", "max_draft_len": k, "speculative_model_dir": spec.model}
        extra = {"disable_overlap_scheduler": True}  # as TensorRT-LLM's own draft/target example sets it
        if spec.draft_p_min > 0:
            notes.append(f"draft_p_min={spec.draft_p_min} has no TensorRT-LLM option; it always drafts max_draft_len")
    else:  # ngram
        cfg = {"decoding_type": "NGram", "max_draft_len": k, "max_matching_ngram_size": spec.prompt_lookup_max,
               "is_public_pool": False}
        notes.append(f"prompt_lookup_min={spec.prompt_lookup_min} has no TensorRT-LLM option (NGram has only "
                     "max_matching_ngram_size); is_public_pool false keeps a pool per request rather than one "
                     "shared by all requests, as specdec's prompt lookup does")
    options = {"speculative_config": cfg, **extra}
    command = f"trtllm-serve {shlex.quote(target)} --backend pytorch --extra_llm_api_options extra-llm-api-config.yml"
    return Export("trtllm", spec.method, True, options, command, notes)


def _llamacpp(spec: SpeculativeConfig, target: str, notes: list[str]) -> Export:
    k = spec.num_speculative_tokens
    if spec.method == "draft_model":
        flags = {"-md": _gguf(spec.model), "--draft-max": k, "--draft-min": 0, "--draft-p-min": spec.draft_p_min}
        notes.append("--draft-p-min is set explicitly: llama.cpp's default (0.75) stops drafting early, specdec's "
                     f"draft_p_min is {spec.draft_p_min}")
    else:  # ngram
        flags = {"--spec-type": "ngram-simple", "--draft-max": k}
        notes.append("model-free drafting (--spec-type) exists only in recent llama-server builds; its n-gram "
                     f"sizes are its own, prompt_lookup_min/max ({spec.prompt_lookup_min}/{spec.prompt_lookup_max}) "
                     "have no llama-server option")
    parts = ["llama-server", f"-m {shlex.quote(_gguf(target))}"]
    parts += [f"{name} {shlex.quote(str(value))}" for name, value in flags.items()]
    return Export("llamacpp", spec.method, True, flags, " \\\n  ".join(parts), notes)


def _gguf(model: str) -> str:
    return model.rstrip("/") + ".gguf"


# -- text -----------------------------------------------------------------------------------------


def _render(exp: Export) -> str:
    name = ENGINE_NAMES[exp.engine]
    lines = [f"# {name}: speculative decoding with method {exp.method!r} (exported by specdec)"]
    if not exp.supported:
        lines.append(f"# no equivalent on {name}; nothing to emit")
    lines += [f"# note: {n}" for n in exp.notes]
    if not exp.supported:
        return "\n".join(lines) + "\n"
    if exp.engine == "vllm":
        cfg = exp.options["speculative_config"]
        lines += [f"# Python: LLM(model=..., speculative_config={json.dumps(cfg)})", exp.command]
    elif exp.engine == "trtllm":
        lines += [f"# save as extra-llm-api-config.yml, then: {exp.command}", _yaml(exp.options)]
    else:
        lines.append(exp.command)
    return "\n".join(lines).rstrip("\n") + "\n"


def _yaml(obj: dict, indent: int = 0) -> str:
    """A tiny YAML writer for nested dicts of scalars (no dependency on PyYAML)."""
    out = []
    pad = "  " * indent
    for key, value in obj.items():
        if isinstance(value, dict):
            out.append(f"{pad}{key}:")
            out.append(_yaml(value, indent + 1))
        else:
            out.append(f"{pad}{key}: {_yaml_scalar(value)}")
    return "\n".join(out)


def _yaml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    if re.fullmatch(r"[A-Za-z_/.~][\w./~-]*", text) and text.lower() not in ("true", "false", "null", "yes", "no",
                                                                             "on", "off", "~"):
        return text
    return json.dumps(text)  # a JSON string is a valid YAML string

"""The same speculative setting for the engine one deploys on, with that engine's own option names.

Names checked against each engine's documentation:
- vLLM: ``speculative_config`` keys ``method`` (``draft_model``, ``ngram``, ``suffix``, ``eagle3``), ``model``,
  ``num_speculative_tokens``, ``parallel_drafting``, ``prompt_lookup_max``, ``prompt_lookup_min``,
  ``suffix_decoding_*``.
- SGLang: ``--speculative-algorithm STANDALONE|NGRAM|EAGLE3``, ``--speculative-draft-model-path``,
  ``--speculative-num-steps``, ``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``
  (the verified tokens: the drafts plus the last committed token, so k + 1 for a chain of k),
  ``--speculative-ngram-min/max-match-window-size``, ``--speculative-ngram-max-bfs-breadth``.
- TensorRT-LLM (LLM API / ``trtllm-serve --extra_llm_api_options``): ``speculative_config`` with
  ``decoding_type: DraftTarget|NGram|Eagle3|PARD``, ``max_draft_len``, ``speculative_model_dir``, ``mask_token_id``,
  ``max_matching_ngram_size``, ``is_public_pool``.
- llama.cpp ``llama-server``: ``-md``, ``--spec-type``, ``--spec-draft-n-max``, ``--spec-draft-n-min``,
  ``--spec-draft-p-min``
  (``draft-eagle3`` with ``--spec-draft-n-max``: the builds that have it renamed the ``--draft-*`` options).

Draft trees (``draft_tree="tree"``, tree.py): SGLang's ``--speculative-eagle-topk`` /
``--speculative-num-draft-tokens`` (STANDALONE and EAGLE3), TensorRT-LLM's ``use_dynamic_tree``,
``dynamic_tree_max_topK``, ``max_total_draft_tokens`` (Eagle3), vLLM's ``speculative_token_tree``
(a fixed tree, EAGLE methods only: tree.static_tree picks it); elsewhere a chain, with a note.

An EAGLE-3 head (method ``eagle3``) exports as each engine's EAGLE-3 setting; its files in each
engine's own layout (speculators for vLLM, SpecForge for SGLang, GGUF for llama.cpp) are written by
``specdec export --eagle3-head`` (workbench/export_head.py).

Where an engine has no equivalent of a setting the export says so in a note (a ``#`` comment in the
text) instead of emitting an option that would mean something else.

These four engines take one speculative method per deployment. So a ``speculative_config`` whose
method lists several (specdec picks one per request and round) exports the best single method the
engine has (by a profile, else the first listed), and a profile's per-category picks export as one
setting per category: one deployment per category, with requests routed to their category's.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec.config import SpeculativeConfig
from specdec.json_input import json_object
from specdec.tree import TreeShape, static_tree
from specdec.workbench.categories import ALL, drafter_rows, with_categories

ENGINES = ("vllm", "sglang", "trtllm", "llamacpp")
PRIOR_TREE_ALPHA = 0.6  # a draft's top choice accepted this often, for a static tree without a measurement
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


def one_method_note(engine: str) -> str:
    return (f"{ENGINE_NAMES[engine]} takes one speculative method per deployment (one speculative config per "
            "server): a different drafter per category means one deployment per category, with each request "
            "routed to its category's deployment")


def export_config(engine: str, speculative_config: dict | SpeculativeConfig, model: str | None = None,
                  profile: dict | None = None) -> Export:
    """The equivalent of ``speculative_config`` (for target ``model``) on ``engine``. A config whose
    method lists several exports one of them: the best the engine has by ``profile`` (a profile.json
    dict) when given, else the first listed that the engine has."""
    _check_engine(engine)
    spec = SpeculativeConfig.from_dict(speculative_config)
    if spec is None or spec.num_speculative_tokens == 0:
        raise ValueError("the speculative config drafts no tokens (num_speculative_tokens is 0); nothing to export")
    if len(spec.methods) > 1:
        return _export_method_list(engine, spec, model, profile)
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


def load_profile_json(profile_path: str | Path) -> dict:
    """profile.json of ``specdec profile``, with its per-category section."""
    path = Path(profile_path)
    if not path.is_file():
        raise ValueError(f"profile {str(path)!r} does not exist; run `specdec profile ... --out DIR` first")
    profile = json_object(path.read_text(), f"profile {str(path)!r}")
    rec = profile.get("recommendation")
    if not isinstance(rec, dict) or "speculative_config" not in rec or not isinstance(profile.get("configs"), list):
        raise ValueError(f"profile {str(path)!r} has no recommendation; is it a specdec profile.json?")
    return with_categories(profile)


def export_from_profile(engine: str, profile_path: str | Path) -> Export:
    """Export the setting a ``specdec profile`` run recommended on all its prompts (the best the engine
    has by the profile, with a note, when the engine lacks the recommended method)."""
    _check_engine(engine)
    profile = load_profile_json(profile_path)
    if profile["recommendation"].get("plain"):
        raise ValueError("the profile recommends plain decoding (no k paid off on this workload); "
                         "export a setting explicitly with --speculative-config if you want one anyway")
    exp = _export_pick(engine, profile, ALL)
    if exp is None:
        raise ValueError(f"none of the profiled drafters that pay on this workload has an equivalent on "
                         f"{ENGINE_NAMES[engine]}; see `specdec export --engine {engine} --speculative-config ...`")
    if profile.get("method_lists"):
        exp.notes.insert(0, _choice_note(engine, profile["method_lists"][0]["methods"]))
        exp.text = _render(exp)
    return exp


@dataclass
class CategoryExports:
    """One setting per prompt category for an engine that takes one method per deployment."""

    engine: str
    profile: str
    notes: list[str]
    categories: dict[str, dict]  # category -> {"plain", "recommended", "predicted_speedup", ..., "export"}
    text: str = ""

    def as_dict(self) -> dict:
        return {"engine": self.engine, "profile": self.profile, "notes": self.notes, "text": self.text,
                "categories": {cat: {**e, "export": e["export"].as_dict() if e["export"] else None}
                               for cat, e in self.categories.items()}}

    def write(self, folder: str | Path) -> dict[str, str]:
        """One file per category (a shell script with the launch command; TensorRT-LLM: its YAML), the
        notes as comments; returns category -> path."""
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {str(folder)!r} exists and is not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        ext = "yml" if self.engine == "trtllm" else "sh"
        paths = {}
        for cat, e in self.categories.items():
            path = folder / f"{self.engine}-{_slug(cat)}.{ext}"
            path.write_text(e["text"])
            paths[cat] = str(path)
        return paths


def export_by_category(engine: str, profile_path: str | Path) -> CategoryExports:
    """A setting per category of a profile: each category's recommended drafter and k, or the best the
    engine has by the profile when it lacks that one, or plain decoding when none pays."""
    _check_engine(engine)
    profile = load_profile_json(profile_path)
    by_cat = profile["by_category"]
    if not by_cat:
        raise ValueError(f"profile {str(profile_path)!r} has no categories")
    name = ENGINE_NAMES[engine]
    notes = [one_method_note(engine)]
    if profile.get("method_lists"):
        notes.append(_choice_note(engine, profile["method_lists"][0]["methods"]))
    cats: dict[str, dict] = {}
    for cat, entry in by_cat.items():
        rec = entry["recommendation"]
        exp = None if rec["plain"] else _export_pick(engine, profile, cat)
        head = f"category {cat!r} ({entry['num_prompts']} prompts)"
        if exp is None:
            why = ("no drafter predicts a gain over plain decoding here" if rec["plain"] else
                   f"none of the drafters that pay here has an equivalent on {name}")
            text = f"# {name}, {head}: serve without speculative decoding ({why})\n"
        else:
            text = f"# {name}, {head}\n" + exp.text
        val = entry.get("validation") or {}
        cats[cat] = {"plain": exp is None, "recommended": None if rec["plain"] else rec["label"],
                     "k": rec["k"], "predicted_speedup": rec["predicted_speedup"],
                     "measured_speedup": val.get("measured_speedup"),
                     "exported_method": exp.method if exp else None, "export": exp, "text": text}
    header = [f"# {name}: speculative settings per prompt category, from {profile_path} (exported by specdec)"]
    header += [f"# note: {n}" for n in notes]
    body = []
    for cat, e in cats.items():
        body += ["", f"# === {cat} ===", e["text"].rstrip("\n")]
    return CategoryExports(engine, str(profile_path), notes, cats, "\n".join(header + body) + "\n")


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")


def _has(engine: str, method: str) -> bool:
    return method not in MISSING[engine]


def _choice_note(engine: str, methods: list[str]) -> str:
    return (f"specdec picks among {', '.join(methods)} per request and round (speculative_config method as a "
            f"list); {ENGINE_NAMES[engine]} takes one method per deployment, so this is one of them")


def _export_pick(engine: str, profile: dict, cat: str) -> Export | None:
    """Category ``cat``'s recommendation on ``engine`` or, when the engine lacks its method, the drafter
    with the next best predicted speedup that the engine has (with a note). None: nothing that pays."""
    rec = profile["recommendation"] if cat == ALL else profile["by_category"][cat]["recommendation"]
    if rec.get("plain"):
        return None
    where = "on all prompts" if cat == ALL else f"in category {cat!r}"
    method = rec["speculative_config"].get("method", "draft_model")  # what will be exported
    label = rec.get("label") or method
    if not isinstance(method, list) and _has(engine, method):
        exp = export_config(engine, rec["speculative_config"], profile.get("model"))
        why = f"the profile's pick {where}: {label} at k={rec['k']}, predicted {rec['predicted_speedup']:.2f}x"
    else:
        rows = sorted(drafter_rows(profile["configs"], cat), key=lambda r: -r["best_speedup"])
        usable = [r for r in rows if r["best_k"] > 0 and not r["choice"] and _has(engine, r["method"])]
        if not usable:
            return None
        pick = usable[0]
        c = profile["configs"][pick["config_index"]]
        cfg = {**c["speculative_config"], "num_speculative_tokens": pick["best_k"], "adaptive": False}
        exp = export_config(engine, cfg, profile.get("model"))
        why = (f"the profile's pick {where}, {label} ({rec['predicted_speedup']:.2f}x), has no equivalent on "
               f"{ENGINE_NAMES[engine]}, so this is the best it has: {pick['label']} at k={pick['best_k']}, "
               f"predicted {pick['best_speedup']:.2f}x")
    exp.notes.insert(0, why)
    exp.text = _render(exp)
    return exp


def _export_method_list(engine: str, spec: SpeculativeConfig, model: str | None, profile: dict | None) -> Export:
    """A config that lists methods: the one the engine can take (by ``profile``, else the first it has)."""
    name = ENGINE_NAMES[engine]
    lacking = [m for m in spec.methods if not _has(engine, m)]
    notes = [_choice_note(engine, spec.methods)]
    if lacking:
        notes.append(f"{name} has no " + ", ".join(METHOD_NAMES.get(m, m) for m in lacking))
    chosen, k = None, spec.num_speculative_tokens
    if profile is not None:
        rows = sorted(drafter_rows(profile["configs"], ALL), key=lambda r: -r["best_speedup"])
        ranked = [r for r in rows if not r["choice"] and r["method"] in spec.methods and _has(engine, r["method"])
                  and r["best_k"] > 0]
        if ranked:
            chosen, k = ranked[0]["method"], ranked[0]["best_k"]
            notes.append(f"{chosen} is the best single method of the list that {name} has, by the profile: "
                         f"predicted {ranked[0]['best_speedup']:.2f}x at k={k} on all its prompts")
        else:
            notes.append(f"by the profile no method of the list that {name} has predicts a gain on all its prompts "
                         "(plain decoding pays most there; `--by-category` shows where one does); this exports the "
                         "first listed that it has, at the config's k, if you want one anyway")
    if chosen is None:
        chosen = next((m for m in spec.methods if _has(engine, m)), None)
        if chosen is not None and profile is None:
            notes.append(f"{chosen} is the first listed method that {name} has; `specdec profile` with this config "
                         "measures each, and `specdec export --profile profile.json` picks the best by measurement")
    if chosen is None:
        exp = Export(engine, "+".join(spec.methods), False, {}, None, notes)
        exp.text = _render(exp)
        return exp
    single = replace(spec, method=chosen, num_speculative_tokens=k)
    exp = export_config(engine, single, model)
    exp.notes[:0] = notes
    exp.text = _render(exp)
    return exp


def _slug(cat: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", cat).strip("_.")
    return slug or "uncategorized"


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


def _serial_note(engine: str) -> str:
    """A parallel draft on an engine without parallel drafting: it drafts one token per forward there."""
    return (f"parallel_drafting: {ENGINE_NAMES[engine]} has no parallel drafting; the draft runs one forward per "
            "draft token there (a PARD draft was trained on the plain next-token loss too)")


def _pard_mask_token(model: str) -> int | None:
    """The mask token a parallel draft's config.json names (drafters/pard.py), or None when unreadable."""
    from specdec.drafters.pard import MASK_TOKEN_KEYS
    from specdec.models.resolve import resolve

    try:
        config = resolve(model).config or {}
    except (ValueError, OSError):
        return None
    return next((config[k] for k in MASK_TOKEN_KEYS if isinstance(config.get(k), int)), None)


def _tree_note(engine: str, spec: SpeculativeConfig, what: str) -> str:
    return (f"draft_tree={spec.draft_tree!r}: {ENGINE_NAMES[engine]} {what}; this exports a chain of "
            f"{spec.num_speculative_tokens} drafts")


def vllm_token_tree(spec: SpeculativeConfig, alpha: float = PRIOR_TREE_ALPHA) -> list[tuple[int, ...]]:
    """The static tree vLLM takes (``speculative_token_tree``) for specdec's tree settings: the best
    tree of draft_tree_max_nodes nodes, depth num_speculative_tokens and draft_tree_top_k children
    when a draft's top choice is accepted with probability ``alpha`` and each lower rank a factor
    (1 - alpha) less often (tree.static_tree)."""
    shape = TreeShape(spec.draft_tree_max_nodes, spec.num_speculative_tokens, spec.draft_tree_top_k)
    return static_tree(shape, [alpha * (1 - alpha) ** r for r in range(spec.draft_tree_top_k)])


def _vllm(spec: SpeculativeConfig, target: str, notes: list[str]) -> Export:
    k = spec.num_speculative_tokens
    if spec.draft_tree == "tree" and spec.method != "eagle3":
        notes.append(_tree_note("vllm", spec, "takes a token tree (speculative_token_tree) for EAGLE methods only"))
    if spec.method == "draft_model":
        cfg = {"method": "draft_model", "model": spec.model, "num_speculative_tokens": k}
        if spec.parallel_drafting:
            cfg["parallel_drafting"] = True
            notes.append("vLLM reads the mask token from the draft's config.json (pard_token), as specdec does")
        if spec.draft_p_min > 0:
            notes.append(f"draft_p_min={spec.draft_p_min} (stop drafting below this draft probability) has no "
                         "vLLM option; vLLM always drafts num_speculative_tokens")
    elif spec.method == "eagle3":
        cfg = {"method": "eagle3", "model": spec.model, "num_speculative_tokens": k}
        if spec.draft_tree == "tree":
            tree = vllm_token_tree(spec)
            cfg.update(num_speculative_tokens=len(tree), speculative_token_tree=str(tree))
            notes.append(f"vLLM's token tree is fixed (each node: the ranks of the draft's choices from the root); "
                         f"specdec sizes its trees each round. This is the best tree of {len(tree)} nodes, depth <= {k}, "
                         f"<= {spec.draft_tree_top_k} children when the top draft is accepted {PRIOR_TREE_ALPHA:.0%} "
                         "of the time (tree.static_tree)")
        notes.append(_head_note("vllm", spec.model))
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
    tree = spec.draft_tree == "tree"
    # a tree: top-k children per step, the best draft_tree_max_nodes verified (+1: the last committed token)
    topk, verified = (spec.draft_tree_top_k, spec.draft_tree_max_nodes + 1) if tree else (1, k + 1)
    shape_note = ("--speculative-num-draft-tokens counts the last committed token too: k drafts -> k + 1; "
                  "--speculative-eagle-topk 1 makes it a chain like specdec's, not a tree") if not tree else (
                  f"a draft tree like specdec's draft_tree='tree': --speculative-eagle-topk {topk} children per step, "
                  f"--speculative-num-steps {k} levels, --speculative-num-draft-tokens {verified} = "
                  f"draft_tree_max_nodes + the last committed token")
    if spec.method == "draft_model":
        flags = {"--speculative-algorithm": "STANDALONE", "--speculative-draft-model-path": spec.model,
                 "--speculative-num-steps": k, "--speculative-eagle-topk": topk, "--speculative-num-draft-tokens": verified}
        notes.append(shape_note)
        if spec.parallel_drafting:
            notes.append(_serial_note("sglang"))
        if spec.draft_p_min > 0:
            notes.append(f"draft_p_min={spec.draft_p_min} has no SGLang option; SGLang always drafts "
                         "--speculative-num-steps tokens")
    elif spec.method == "eagle3":
        flags = {"--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": spec.model,
                 "--speculative-num-steps": k, "--speculative-eagle-topk": topk, "--speculative-num-draft-tokens": verified}
        notes.append(shape_note)
        notes.append(_head_note("sglang", spec.model))
    else:  # ngram
        if tree:
            notes.append(_tree_note("sglang", spec, "branches its NGRAM drafts by --speculative-ngram-max-bfs-breadth "
                                    "over its own cache, not by specdec's tree settings"))
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
    if spec.method == "draft_model" and spec.parallel_drafting:
        cfg = {"decoding_type": "PARD", "max_draft_len": k, "speculative_model_dir": spec.model}
        mask = _pard_mask_token(spec.model)
        if mask is not None:  # TensorRT-LLM's own default guesses the draft's vocab_size
            cfg["mask_token_id"] = mask
        else:
            notes.append("the draft's config.json was not readable here: set mask_token_id to its pard_token")
    elif spec.method == "draft_model":
        cfg = {"decoding_type": "DraftTarget", "max_draft_len": k, "speculative_model_dir": spec.model}
        extra = {"disable_overlap_scheduler": True}  # as TensorRT-LLM's own draft/target example sets it
        if spec.draft_p_min > 0:
            notes.append(f"draft_p_min={spec.draft_p_min} has no TensorRT-LLM option; it always drafts max_draft_len")
    elif spec.method == "eagle3":
        cfg = {"decoding_type": "Eagle3", "max_draft_len": k, "speculative_model_dir": spec.model}
        if spec.draft_tree == "tree":  # EAGLE-2's dynamic tree, as specdec's draft_tree='tree'
            cfg.update(use_dynamic_tree=True, dynamic_tree_max_topK=spec.draft_tree_top_k,
                       max_total_draft_tokens=spec.draft_tree_max_nodes)
        notes.append("TensorRT-LLM reads the head folder as specdec writes it (SpecForge layout: midlayer.*); newer "
                     "releases name the folder option speculative_model")
    else:  # ngram
        cfg = {"decoding_type": "NGram", "max_draft_len": k, "max_matching_ngram_size": spec.prompt_lookup_max,
               "is_public_pool": False}
        notes.append(f"prompt_lookup_min={spec.prompt_lookup_min} has no TensorRT-LLM option (NGram has only "
                     "max_matching_ngram_size); is_public_pool false keeps a pool per request rather than one "
                     "shared by all requests, as specdec's prompt lookup does")
    if spec.draft_tree == "tree" and spec.method != "eagle3":
        notes.append(_tree_note("trtllm", spec, "drafts trees (use_dynamic_tree) for EAGLE methods only"))
    options = {"speculative_config": cfg, **extra}
    command = f"trtllm-serve {shlex.quote(target)} --backend pytorch --extra_llm_api_options extra-llm-api-config.yml"
    return Export("trtllm", spec.method, True, options, command, notes)


def _llamacpp(spec: SpeculativeConfig, target: str, notes: list[str]) -> Export:
    k = spec.num_speculative_tokens
    if spec.method == "draft_model":
        flags = {"-md": _gguf(spec.model), "--spec-type": "draft-simple", "--spec-draft-n-max": k,
                 "--spec-draft-n-min": 0, "--spec-draft-p-min": spec.draft_p_min}
        notes.append("--spec-type draft-simple is needed: recent llama-server builds load a -md draft without it but "
                     "never draft with it; --spec-draft-p-min is set explicitly (older builds defaulted to 0.75, "
                     f"which stops drafting early), specdec's draft_p_min is {spec.draft_p_min}")
        if spec.parallel_drafting:
            notes.append(_serial_note("llamacpp"))
    elif spec.method == "eagle3":
        flags = {"-md": _gguf(spec.model), "--spec-type": "draft-eagle3", "--spec-draft-n-max": k}
        notes.append(_head_note("llamacpp", spec.model))
    else:  # ngram
        flags = {"--spec-type": "ngram-simple", "--spec-draft-n-max": k,
                 "--spec-ngram-simple-size-n": spec.prompt_lookup_max}
        notes.append("model-free drafting (--spec-type) exists only in recent llama-server builds; its lookup length "
                     f"is one size (--spec-ngram-simple-size-n = prompt_lookup_max {spec.prompt_lookup_max}), "
                     f"prompt_lookup_min ({spec.prompt_lookup_min}) has no llama-server option")
    if spec.draft_tree == "tree":
        notes.append(_tree_note("llamacpp", spec, "drafts chains only"))
    parts = ["llama-server", f"-m {shlex.quote(_gguf(target))}"]
    parts += [f"{name} {shlex.quote(str(value))}" for name, value in flags.items()]
    return Export("llamacpp", spec.method, True, flags, " \\\n  ".join(parts), notes)


def _gguf(model: str) -> str:
    return model.rstrip("/") + ".gguf"


def _head_note(engine: str, head: str) -> str:
    """Where an EAGLE-3 head's files for ``engine`` come from."""
    def write(fmt: str) -> str:
        return f"`specdec export --eagle3-head {head} --model TARGET --out DIR --format {fmt}`"

    return {"vllm": f"vLLM loads the head folder as specdec writes it (SpecForge layout); {write('vllm')} also writes "
                    "the speculators layout vLLM's own tools write (DIR/vllm, naming its target and k)",
            "sglang": "SGLang counts layer ids as layer outputs, specdec as layer inputs: pass DIR/sglang of "
                      f"{write('sglang')}, whose ids are written one lower",
            "llamacpp": f"llama-server reads the head as GGUF: {write('gguf')} writes it with llama.cpp's own "
                        "converter (its vocabulary copied from the target's GGUF)"}[engine]


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

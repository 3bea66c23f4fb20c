"""An EAGLE-3 head, written as vLLM, SGLang and llama.cpp load it.

specdec writes a head in the SpecForge layout (models/eagle3.py: ``LlamaForCausalLMEagle3``,
``midlayer.*``). The engines each read their own:

- vLLM (``speculative_config={"method": "eagle3", "model": DIR}``): the speculators layout, which
  vLLM's config parser recognises by ``speculators_config`` (and no ``model_type``), turns into an
  ``Eagle3LlamaForCausalLM`` config (draft_vocab_size, target_hidden_size, norm_before_residual,
  eagle_aux_hidden_state_layer_ids) and whose ``layers.0.*`` weights its loader prefixes with
  ``model.``. It carries the target (``verifier``) and k, so ``vllm serve DIR`` alone also works.
  vLLM reads the SpecForge layout too; the speculators one is chosen because it is the format vLLM's
  own training library writes and it says which target and k it is for.
- SGLang (``--speculative-algorithm EAGLE3``): the SpecForge layout (its loader keeps ``midlayer.*``
  and drops names it does not know). SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids``
  as layer OUTPUTS (it captures the input of id + 1), so that copy is written one lower than specdec's
  ids, which are layer inputs like vLLM's and llama.cpp's.
- llama.cpp (``llama-server -md HEAD.gguf --spec-type draft-eagle3``): a GGUF written by llama.cpp's
  own converter (``convert_hf_to_gguf.py --target-model-dir``, from the llama.cpp tree vendored in
  llama-cpp-python's source), with the vocabulary copied from the target's GGUF so the pair matches
  token for token (the converter's own vocabulary step cannot read every tokenizer).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from specdec.models.eagle3 import CONFIG_FILE, WEIGHTS_FILE, Eagle3Config, check_head_for_target, read_config

FORMATS = ("vllm", "sglang", "gguf")
GGUF_OUTTYPES = ("f32", "bf16", "f16", "q8_0")

# Runs llama.cpp's converter with its own gguf-py; argv: TREE VOCAB_GGUF converter-args... With a
# VOCAB_GGUF, the vocabulary (every tokenizer.* key) is copied from it instead of built from the
# target folder's tokenizer files.
_CONVERTER = r"""
import runpy, sys
tree, vocab_gguf, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [tree, tree + "/gguf-py"]
import gguf
from conversion import llama as conv

def copy_vocab(self):
    reader = gguf.GGUFReader(vocab_gguf, "r")
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            self.gguf_writer.add_key_value(name, f.contents(), vtype, sub)

if vocab_gguf:
    conv.LlamaModel.set_vocab = copy_vocab
sys.argv = [tree + "/convert_hf_to_gguf.py", *args]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@dataclass
class HeadExport:
    """What ``export_head`` wrote and how each engine runs it."""

    head: str
    target: str
    k: int
    files: dict[str, str] = field(default_factory=dict)  # format -> folder or file
    commands: dict[str, str] = field(default_factory=dict)  # engine -> launch command
    notes: list[str] = field(default_factory=list)
    text: str = ""

    def as_dict(self) -> dict:
        return {"head": self.head, "target": self.target, "num_speculative_tokens": self.k, "files": self.files,
                "commands": self.commands, "notes": self.notes, "text": self.text}


# -- vLLM: the speculators layout -----------------------------------------------------------------


def speculators_config(c: Eagle3Config, verifier: str, k: int, verifier_architectures: list[str]) -> dict:
    """config.json of the speculators layout, with the keys vLLM reads: ``speculators_model_type``
    and ``speculators_config`` (proposal_methods[0].speculative_tokens, verifier.name_or_path) pick
    the parser; ``transformer_layer_config`` becomes the draft's config; the eagle3 keys at the top
    (vLLM defaults ``norm_before_residual`` to true when absent, so it is always written)."""
    layer = {
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "eagle_aux_hidden_state_layer_ids": list(c.layer_ids),
        "specdec_target_num_layers": c.target_num_layers,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def speculators_name(name: str) -> str:
    """specdec's (SpecForge) tensor name -> the speculators layout's."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def specforge_name(name: str) -> str:
    """A head tensor name in either layout -> SpecForge's (what specdec and SGLang read)."""
    name = name.removeprefix("model.")
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def _head_tensors(head_dir: Path, rename) -> dict:
    from safetensors import safe_open

    weights = head_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"EAGLE-3 head folder {str(head_dir)!r} has no {WEIGHTS_FILE}")
    with safe_open(str(weights), framework="pt") as f:
        return {rename(n): f.get_tensor(n) for n in f.keys() if not n.endswith("embed_tokens.weight")}


def write_speculators(head_dir: str | Path, out_dir: str | Path, verifier: str, k: int,
                      verifier_architectures: list[str] | None = None) -> Path:
    """The head in ``head_dir`` as vLLM's speculators layout in ``out_dir`` (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    head_dir, out = Path(head_dir), Path(out_dir)
    c = read_config(head_dir)
    _check_out(head_dir, out)
    tensors = _head_tensors(head_dir, lambda n: speculators_name(specforge_name(n)))
    out.mkdir(parents=True, exist_ok=True)
    cfg = speculators_config(c, verifier, k, verifier_architectures or [])
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


# -- SGLang: the SpecForge layout -----------------------------------------------------------------


def write_specforge(head_dir: str | Path, out_dir: str | Path) -> Path:
    """The head as SGLang loads it: SpecForge names, ``eagle_config`` layer ids as layer outputs (id - 1)."""
    from safetensors.torch import save_file

    head_dir, out = Path(head_dir), Path(out_dir)
    c = read_config(head_dir)
    _check_out(head_dir, out)
    tensors = _head_tensors(head_dir, specforge_name)
    cfg = c.to_json()
    # SGLang captures, for a configured id L, the input of layer L + 1 (the output of layer L)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.layer_ids],
                           "use_aux_hidden_state": True}
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


# -- llama.cpp: GGUF by its own converter ---------------------------------------------------------


def llama_cpp_tree(download: bool = True) -> Path:
    """The llama.cpp source tree vendored in the installed llama-cpp-python's source distribution
    ($SPECDEC_LLAMA_CPP_DIR, else under specdec's cache; fetched with pip once when ``download``)."""
    from importlib.metadata import PackageNotFoundError, version

    from specdec.models.timings import cache_dir

    if os.environ.get("SPECDEC_LLAMA_CPP_DIR"):
        tree = Path(os.environ["SPECDEC_LLAMA_CPP_DIR"]).expanduser()
        if not (tree / "convert_hf_to_gguf.py").is_file():
            raise ValueError(f"SPECDEC_LLAMA_CPP_DIR={str(tree)!r} holds no convert_hf_to_gguf.py; point it at a "
                             "llama.cpp source tree")
        return tree
    try:
        ver = version("llama-cpp-python")
    except PackageNotFoundError:
        raise ValueError("writing a GGUF needs llama-cpp-python installed (its source holds llama.cpp's "
                         "converter); install it or set SPECDEC_LLAMA_CPP_DIR to a llama.cpp tree") from None
    build = cache_dir() / "llama.cpp-build"
    src = build / f"llama_cpp_python-{ver}"
    tree = src / "vendor" / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        if not download:
            raise ValueError(f"llama.cpp's source tree is not at {tree}")
        build.mkdir(parents=True, exist_ok=True)
        archive = build / f"llama_cpp_python-{ver}.tar.gz"
        if not archive.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={ver}", "-d", str(build)], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(build, filter="data")
    return tree


def write_gguf(head_dir: str | Path, target_dir: str | Path, out_file: str | Path, vocab_gguf: str | None = None,
               outtype: str = "bf16") -> Path:
    """The head as a GGUF for llama-server's draft-eagle3, by llama.cpp's converter with
    ``--target-model-dir target_dir`` (the target's Hugging Face folder: vocabulary size, layers,
    hidden size). ``vocab_gguf``: the target's GGUF (the file llama-server loads with ``-m``), whose
    vocabulary is copied; None: the converter builds it from the target folder's tokenizer."""
    head_dir, target_dir, out = Path(head_dir), Path(target_dir), Path(out_file)
    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"GGUF outtype must be one of {GGUF_OUTTYPES}, got {outtype!r}")
    read_config(head_dir)
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"the target {str(target_dir)!r} has no config.json; the converter reads the target's "
                         "Hugging Face folder (its layers, hidden size and vocabulary)")
    if vocab_gguf is not None and not Path(vocab_gguf).is_file():
        raise ValueError(f"target GGUF {vocab_gguf!r} does not exist")
    tree = llama_cpp_tree()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [sys.executable, "-c", _CONVERTER, str(tree), vocab_gguf or "", str(head_dir), "--outfile", str(tmp),
           "--outtype", outtype, "--target-model-dir", str(target_dir)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-6:])
            hint = ("; pass the target's GGUF (--target-gguf) to copy its vocabulary"
                    if vocab_gguf is None and ("tokenizer" in tail.lower() or "sentencepiece" in tail) else "")
            raise ValueError(f"llama.cpp's converter failed on {str(head_dir)!r}{hint}:\n{tail}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# -- all of it ------------------------------------------------------------------------------------


def export_head(head: str, target: str, out_dir: str, formats: tuple[str, ...] = FORMATS, k: int = 4,
                target_gguf: str | None = None, gguf_outtype: str = "bf16", verifier: str | None = None) -> HeadExport:
    """Write head ``head`` (a folder or a shipped name) for target ``target`` (a Hugging Face folder or
    a shipped name) in each of ``formats`` under ``out_dir`` (vllm/, sglang/, NAME.gguf) and say how
    each engine runs it. Checks the head was made for the target first."""
    from transformers import AutoConfig

    from specdec.models.resolve import resolve, resolve_model_path

    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"unknown export format(s) {bad or formats}; choose from {', '.join(FORMATS)}")
    if not (isinstance(k, int) and 1 <= k <= 32):
        raise ValueError(f"num_speculative_tokens must be an integer in 1..32, got {k!r}")
    head_dir = Path(resolve_model_path(head)) if head.startswith("specdec/") else Path(os.path.expanduser(head))
    if not head_dir.is_dir():
        raise ValueError(f"EAGLE-3 head folder {head!r} does not exist")
    c = read_config(head_dir)
    source = resolve(target)
    if source.is_gguf:
        raise ValueError(f"--target {target!r} is a GGUF file; pass the target's Hugging Face folder (the converter "
                         "and vLLM read it) and its GGUF with --target-gguf")
    target_dir = Path(source.path)
    tc = AutoConfig.from_pretrained(target_dir)
    tc = getattr(tc, "text_config", None) or tc
    c.fill_layer_ids(tc.num_hidden_layers)
    check_head_for_target(c, tc.hidden_size, tc.vocab_size, tc.num_hidden_layers, head_dir.name)
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out_dir!r} exists and is not a folder")
    verifier = verifier or str(target_dir.resolve())
    archs = list(getattr(tc, "architectures", None) or [])
    res = HeadExport(head=str(head_dir), target=str(target_dir), k=k)
    q = shlex.quote
    if "vllm" in formats:
        d = write_speculators(head_dir, out / "vllm", verifier, k, archs)
        res.files["vllm"] = str(d)
        cfg = {"method": "eagle3", "model": str(d), "num_speculative_tokens": k}
        res.commands["vllm"] = f"vllm serve {q(verifier)} --speculative-config {q(json.dumps(cfg))}"
        res.notes.append(f"vLLM: LLM(model={verifier!r}, speculative_config={json.dumps(cfg)}); the folder names "
                         f"its target and k, so `vllm serve {d}` alone also starts both")
    if "sglang" in formats:
        d = write_specforge(head_dir, out / "sglang")
        res.files["sglang"] = str(d)
        res.commands["sglang"] = " \\\n  ".join([
            "python -m sglang.launch_server", f"--model-path {q(verifier)}", "--speculative-algorithm EAGLE3",
            f"--speculative-draft-model-path {q(str(d))}", f"--speculative-num-steps {k}",
            "--speculative-eagle-topk 1", f"--speculative-num-draft-tokens {k + 1}"])
        res.notes.append("SGLang: --speculative-num-draft-tokens counts the last committed token too (k + 1); "
                         "--speculative-eagle-topk 1 keeps one chain as specdec drafts")
    if "gguf" in formats:
        vocab = target_gguf
        if vocab is None:
            from specdec.models.load import converted_gguf

            vocab = converted_gguf(source, "bfloat16")
            res.notes.append(f"llama.cpp: the target as GGUF is specdec's conversion {vocab} (pass --target-gguf to "
                             "use your own: the head's vocabulary is copied from that file)")
        stem = head_dir.name if "eagle3" in head_dir.name else f"{head_dir.name}-eagle3"
        f = write_gguf(head_dir, target_dir, out / f"{stem}-{gguf_outtype}.gguf", vocab, gguf_outtype)
        res.files["gguf"] = str(f)
        res.commands["llamacpp"] = (f"llama-server -m {q(vocab)} -md {q(str(f))} --spec-type draft-eagle3 "
                                    f"--spec-draft-n-max {k}")
    res.text = _render(res, c)
    return res


def _check_out(head_dir: Path, out: Path) -> None:
    if out.exists() and out.resolve() == head_dir.resolve():
        raise ValueError(f"the export folder {str(out)!r} is the head's own folder; choose another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} exists and is not a folder")


def _render(res: HeadExport, c: Eagle3Config) -> str:
    lines = [f"# EAGLE-3 head {res.head} for {res.target} (layers {c.layer_ids}, draft vocabulary "
             f"{c.draft_vocab_size}), k = {res.k} (exported by specdec)"]
    lines += [f"# wrote {fmt}: {path}" for fmt, path in res.files.items()]
    lines += [f"# note: {n}" for n in res.notes]
    names = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}
    for engine, cmd in res.commands.items():
        lines += [f"# {names[engine]}:", cmd]
    return "\n".join(lines) + "\n"

"""specdec against OpenVINO GenAI on the same pair and prompts: greedy, batch 1, exactly N new tokens,
alternating prompt by prompt in one run, so both see the same machine noise.

OpenVINO GenAI runs in a throwaway venv outside the repository (~/.cache/specdec/openvino-venv: its
optimum-intel, openvino and transformers must not become the project's dependencies), as a worker
process (``benchmarks/openvino_worker.py``) kept alive across prompts: ``LLMPipeline`` plain (its
default attention backend, and the stateful SDPA model), with the draft (``draft_model``,
``num_assistant_tokens`` = k) and with prompt lookup (``prompt_lookup``, k, ``max_ngram_size``), at
``INFERENCE_NUM_THREADS`` = --threads. The models are exported once with optimum-intel
(``optimum-cli export openvino``, tokenizers converted by openvino-tokenizers) into
~/.cache/specdec/openvino. specdec runs in this process: ``LLM`` with each of --backends, plain and
its best methods (draft_model k=8 adaptive, suffix k=32 x3 and k=8, suffix in front of the draft,
eagle3 with specdec/demo-eagle3, the parallel draft specdec/demo-draft-pard k=6 adaptive).

Reported: per configuration the median tok/s over prompts (end to end, prefill included), each
engine's best, the ratios specdec / OpenVINO, τ where the engine counts it, the CPU path beside each
(OpenVINO's inference precision read back from the compiled model, specdec's runner describe()),
and the one-token step and 5-token verify cost of both targets at --context cached positions. Run
it on a quiet machine: under load a 2-thread forward waits at a barrier whenever its other thread is
descheduled, which hurts engines with many small ops far more (the load average is printed).

    python benchmarks/peer_openvino.py --setup            # build the venv and the IR, print the commands
    python benchmarks/peer_openvino.py                    # the comparison (sets up on first use)
    python benchmarks/peer_openvino.py --backends torch --enforce-eager both --num-prompts 4
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path("~/.cache/specdec").expanduser()
VENV = CACHE / "openvino-venv"
IR_CACHE = CACHE / "openvino"
HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "prompts" / "code_heldout.jsonl"
TORCH_PIN = "torch==2.13.0"  # the project's torch: the CPU wheel where pip finds it (a local wheel, or --torch-index)
OPENVINO_PINS = ("optimum-intel[openvino]==2.2.0", "openvino==2026.4.1", "openvino-genai==2026.4.1.0",
                 "openvino-tokenizers==2026.4.1.0")
ENGINES = ("specdec", "openvino")


# -- the throwaway venv and the exported IR ---------------------------------------------------------

def setup_commands(venv: Path = VENV, torch_index: str | None = None) -> list[list[str]]:
    """The commands that build the venv: torch first (so pip keeps that wheel), then optimum-intel,
    openvino, openvino-genai and openvino-tokenizers at versions that agree, then torchvision out
    (optimum-intel pulls one whose compiled ops do not register against a CPU torch, which breaks
    transformers' import of PreTrainedModel; only vision models need it)."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    index = ["--index-url", torch_index] if torch_index else []
    return [[sys.executable, "-m", "venv", str(venv)],
            [*pip, "--upgrade", "pip"],
            [*pip, *index, TORCH_PIN],
            [*pip, TORCH_PIN, *OPENVINO_PINS],
            [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "torchvision"]]


def setup_venv(venv: Path = VENV, torch_index: str | None = None) -> None:
    """Build the throwaway venv, printing each command; stops before installing if pip would pull a
    CUDA torch (GBs) instead of the CPU wheel."""
    if (venv / "bin" / "optimum-cli").exists():
        return
    print(f"OpenVINO GenAI runs in a throwaway venv, outside the project's dependencies: building {venv} "
          "(about 1.6 GB, a minute or two)", flush=True)
    cmds = setup_commands(venv, torch_index)
    for cmd in cmds[:2]:
        _run(cmd)
    torch_cmd = cmds[2]
    dry = subprocess.run([*torch_cmd[:4], "--dry-run", *torch_cmd[4:]], capture_output=True, text=True, check=True)
    if any(w in dry.stdout for w in ("nvidia-", "cuda-")):
        raise SystemExit(f"pip would install a CUDA build of torch here ({' '.join(torch_cmd)}); rerun with "
                         "--torch-index https://download.pytorch.org/whl/cpu (or a local index with the CPU wheel)")
    for cmd in cmds[2:]:
        _run(cmd, check=cmd[-1] != "torchvision")


def _run(cmd: list[str], check: bool = True) -> None:
    print("  $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=check)


def ir_folder(source: str, weight_format: str) -> Path:
    """Where the IR of the HF checkpoint ``source`` in ``weight_format`` is cached: keyed by the
    checkpoint's contents, so a retrained model gets a new export."""
    from specdec.models.gguf import checkpoint_digest

    return IR_CACHE / f"{Path(source).name}-{checkpoint_digest(source)[:12]}-{weight_format}"


def export_ir(source: str, weight_format: str, venv: Path = VENV) -> Path:
    """``source`` (an HF checkpoint folder) as OpenVINO IR with its tokenizer and detokenizer, once."""
    out = ir_folder(source, weight_format)
    if (out / "openvino_model.xml").exists() and (out / "openvino_tokenizer.xml").exists():
        return out
    print(f"exporting {source} to OpenVINO IR ({weight_format} weights) in {out}", flush=True)
    _run([str(venv / "bin" / "optimum-cli"), "export", "openvino", "--model", source, "--task",
          "text-generation-with-past", "--weight-format", weight_format, str(out)])
    if not (out / "openvino_tokenizer.xml").exists():  # optimum-cli converts it when openvino-tokenizers imports
        _run([str(venv / "bin" / "convert_tokenizer"), source, "--with-detokenizer", "-o", str(out)])
    return out


class Worker:
    """The OpenVINO GenAI worker in the throwaway venv: one JSON request, one JSON reply."""

    def __init__(self, target_ir: Path, draft_ir: Path | None, threads: int, venv: Path = VENV):
        cmd = [str(venv / "bin" / "python"), str(HERE / "openvino_worker.py"), "--target", str(target_ir),
               "--threads", str(threads)] + (["--draft", str(draft_ir)] if draft_ir else [])
        # OMP/MKL settings of this process must not leak into OpenVINO's own threading
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def request(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the OpenVINO worker exited (code {self.proc.wait()}); its stderr is above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"OpenVINO worker, {op}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(60)


# -- what runs ------------------------------------------------------------------------------------

@dataclass
class Config:
    """One measured configuration: ``engine`` "specdec" (``backend``, ``spec``, ``llm_kwargs`` for
    ``LLM``) or "openvino" (``ov`` = the worker's generate fields)."""

    engine: str
    name: str
    backend: str = ""
    spec: dict | None = None
    llm_kwargs: dict = field(default_factory=dict)
    ov: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.engine} {self.name}"

    @property
    def plain_key(self) -> str:
        """The plain configuration on the same engine and backend: the greedy reference."""
        if self.engine == "openvino":
            return "openvino plain"
        eager = " eager" if self.llm_kwargs.get("enforce_eager") else ""
        return f"specdec {self.backend} plain{eager}"


def int_list(text: str, what: str) -> list[int]:
    """"2,4,8" as [2, 4, 8]; a ValueError naming the option for anything else."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x < 1 for x in out):
        raise ValueError(f"{what} must be a comma-separated list of integers >= 1, got {text!r}")
    return out


def build_configs(args, has_enforce_eager: bool) -> list[Config]:
    """Every configuration of a run, from the parsed arguments: specdec's per backend (torch with
    and without enforce_eager where LLM takes it and --enforce-eager says so), then OpenVINO's."""
    methods = {"plain": None,
               "draft k=8 adaptive": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 8},
               "suffix k=32 x3": {"method": "suffix", "num_speculative_tokens": 32, "adaptive": False,
                                  "suffix_decoding_max_spec_factor": 3.0},
               "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False},
               "suffix + draft k=8 adaptive": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 8,
                                               "enable_suffix_decoding": True},
               "eagle3 k=8 adaptive": {"method": "eagle3", "model": args.eagle3_head, "num_speculative_tokens": 8},
               "pard k=6 adaptive": {"method": "draft_model", "model": args.pard, "num_speculative_tokens": 6,
                                     "parallel_drafting": True}}
    if not args.eagle3_head:
        del methods["eagle3 k=8 adaptive"]
    if not args.pard:
        del methods["pard k=6 adaptive"]
    eager_modes = {"default": [None], "true": [True], "both": [None, True]}[args.enforce_eager]
    out = []
    for backend in args.backends.split(","):
        if backend not in ("auto", "torch", "llama.cpp"):
            raise ValueError(f"--backends takes auto, torch and llama.cpp, got {backend!r}")
        for eager in (eager_modes if backend == "torch" and has_enforce_eager else [None]):
            for name, spec in methods.items():
                out.append(Config("specdec", f"{backend} {name}" + (" eager" if eager else ""), backend, spec,
                                  {"enforce_eager": True} if eager else {}))
    out.append(Config("openvino", "plain", ov={"config": "plain"}))
    out.append(Config("openvino", "plain SDPA", ov={"config": "plain-sdpa"}))
    out += [Config("openvino", f"draft k={k}", ov={"config": "draft", "k": k})
            for k in int_list(args.ov_draft_ks, "--ov-draft-ks")]
    out += [Config("openvino", f"lookup k={k} ngram={args.ngram}", ov={"config": "lookup", "k": k, "ngram": args.ngram})
            for k in int_list(args.ov_lookup_ks, "--ov-lookup-ks")]
    return out


def interleave(configs: list[Config], reverse: bool) -> list[Config]:
    """specdec and OpenVINO configurations taken in turn (the longer list's tail at the end),
    reversed on every other prompt so neither side always runs right after the other."""
    ours = [c for c in configs if c.engine == "specdec"]
    theirs = [c for c in configs if c.engine == "openvino"]
    mixed = [c for i in range(max(len(ours), len(theirs))) for c in ours[i:i + 1] + theirs[i:i + 1]]
    return mixed[::-1] if reverse else mixed


def tau_openvino(runs: list[dict]) -> float | None:
    """Tokens per verify pass of OpenVINO's speculative runs: each prompt's first token comes from the
    prefill, every later pass gives its accepted drafts plus one."""
    if not runs or any("accepted" not in r for r in runs):
        return None
    made = sum(len(r["tokens"]) - 1 for r in runs)
    passes = made - sum(r["accepted"] for r in runs)
    return made / passes if passes > 0 else None


def summarize(results: dict[str, list[dict]], taus: dict[str, float | None]) -> list[dict]:
    """One row per configuration: median tok/s over prompts (end to end), tok/s of the whole set,
    τ; best first."""
    rows = []
    for key, runs in results.items():
        rates = [len(r["tokens"]) / r["seconds"] for r in runs]
        rows.append({"key": key, "engine": key.split(" ", 1)[0], "median": statistics.median(rates),
                     "total": sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs),
                     "tau": taus.get(key), "prompts": len(runs)})
    return sorted(rows, key=lambda r: -r["median"])


def best_of(rows: list[dict], engine: str, speculative: bool | None = None) -> dict | None:
    """The fastest row of ``engine`` (by median), among its speculative or plain rows if said."""
    cands = [r for r in rows if r["engine"] == engine
             and (speculative is None or ("plain" not in r["key"]) == speculative)]
    return max(cands, key=lambda r: r["median"]) if cands else None


def format_table(rows: list[dict], paths: dict[str, str]) -> str:
    """The results as a Markdown table, with each row's CPU path."""
    lines = ["| engine, configuration | median tok/s | set tok/s | τ | CPU path |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        lines.append(f"| {r['key']} | {r['median']:.1f} | {r['total']:.1f} | {tau} | {paths.get(r['key'], '')} |")
    return "\n".join(lines)


def ratio_lines(rows: list[dict]) -> list[str]:
    """specdec / OpenVINO: best against best, plain against plain, best speculative against best, by the
    median of the prompts' tok/s; then best against best by the set's tok/s (all tokens over all seconds,
    which a few fast or slow prompts do not swing as they swing a median of 8)."""
    out = []
    for label, spec in (("best", None), ("plain", False), ("best speculative", True)):
        ours, theirs = best_of(rows, "specdec", spec), best_of(rows, "openvino", spec)
        if ours and theirs:
            out.append(f"specdec {label} ({ours['key'].removeprefix('specdec ')}, {ours['median']:.1f} tok/s) / "
                       f"OpenVINO {label} ({theirs['key'].removeprefix('openvino ')}, {theirs['median']:.1f} tok/s): "
                       f"{ours['median'] / theirs['median']:.2f}x")
    ours = max((r for r in rows if r["engine"] == "specdec"), key=lambda r: r["total"], default=None)
    theirs = max((r for r in rows if r["engine"] == "openvino"), key=lambda r: r["total"], default=None)
    if ours and theirs:
        out.append(f"by set tok/s: specdec best ({ours['key'].removeprefix('specdec ')}, {ours['total']:.1f}) / "
                   f"OpenVINO best ({theirs['key'].removeprefix('openvino ')}, {theirs['total']:.1f}): "
                   f"{ours['total'] / theirs['total']:.2f}x")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help="only build the throwaway venv and export the IR, then stop")
    ap.add_argument("--venv", type=Path, default=VENV, help="the throwaway venv for OpenVINO GenAI and optimum-intel")
    ap.add_argument("--torch-index", default=None,
                    help="pip index for the venv's torch where the plain one would be a CUDA build")
    ap.add_argument("--target", default="specdec/demo-target", help="HF checkpoint (a name or a folder)")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--eagle3-head", default="specdec/demo-eagle3", help="'' for none")
    ap.add_argument("--pard", default="specdec/demo-draft-pard", help="a parallel draft (PARD); '' for none")
    ap.add_argument("--weight-format", default="fp16", choices=("fp16", "int8", "fp32"),
                    help="the IR's weights (optimum-cli --weight-format); OpenVINO computes in bf16 or f32 anyway")
    ap.add_argument("--backends", default="auto,torch,llama.cpp", help="specdec backends to run")
    ap.add_argument("--enforce-eager", default="both", choices=("default", "true", "both"),
                    help="the torch backend with LLM's enforce_eager (where LLM has it): its default, True, or both")
    ap.add_argument("--ov-draft-ks", default="3,4,6", help="OpenVINO num_assistant_tokens with the draft")
    ap.add_argument("--ov-lookup-ks", default="4,8,16", help="OpenVINO num_assistant_tokens with prompt lookup")
    ap.add_argument("--ngram", type=int, default=3, help="OpenVINO prompt lookup's max_ngram_size")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts, each run once by every configuration")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="cached positions before the timed step / verify")
    ap.add_argument("--step-repeats", type=int, default=9)
    ap.add_argument("--step-burst", type=int, default=6, help="forwards of one length in a row; the second half timed")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.threads < 1:
        ap.error("--num-prompts, --max-tokens and --threads must be at least 1")
    return args


# -- the run --------------------------------------------------------------------------------------

def step_costs(worker: Worker, runners: dict[str, object], context: int, repeats: int,
               burst: int = 6) -> dict[str, dict[int, float]]:
    """ms of one forward of 1 and of 5 tokens after ``context`` cached positions: OpenVINO's
    exported target on the plain runtime and each specdec runner, alternating repeat by repeat;
    each repeat feeds ``burst`` forwards of one length in a row and times the second half (the
    steady state of a decode or verify loop), the cache growing by T each."""
    import torch

    from specdec.models.base import ForwardBatch

    tokens = (1, 5)
    times: dict[str, dict[int, list[float]]] = {k: {T: [] for T in tokens} for k in ["openvino", *runners]}
    for r in runners.values():
        r.reserve(1, context + burst * max(tokens) + 1)
        r.sync_rows(["probe"])
        r.forward(ForwardBatch.from_rows([[(i * 7919) % (r.vocab_size - 10) + 5 for i in range(context)]], [0],
                                         logits="none"))
    with torch.inference_mode():
        for _ in range(repeats):
            got = worker.request("step_cost", context=context, tokens=list(tokens), repeats=1, burst=burst)["ms"]
            for T in tokens:
                times["openvino"][T] += got[str(T)]
            for name, r in runners.items():
                for T in tokens:
                    ids = [(j * 31) % (r.vocab_size - 10) + 5 for j in range(T)]
                    for i in range(burst):  # logits at every position, as a verify pass
                        feed = ForwardBatch.from_rows([ids], [context + i * T], logits="all")
                        t0 = time.perf_counter()
                        r.forward(feed)
                        if i >= burst // 2:
                            times[name][T].append(1e3 * (time.perf_counter() - t0))
    return {k: {T: statistics.median(v) for T, v in d.items()} for k, d in times.items()}


def divergence_note(c: Config, prompt: list[int], expected: list[int], got: list[int], llms: dict,
                    worker: Worker) -> str:
    """Where ``got`` parts from the plain output ``expected`` and the target's top-2 gap there:
    specdec's near-tie check (its runner, its dtype's threshold), or OpenVINO's exported target."""
    if c.engine == "specdec":
        from specdec.near_tie import first_divergence

        d = first_divergence(llms[c.plain_key].target, prompt, expected, got)
        return f"@{d['position']} gap {d['gap']:.3g} < {d['threshold']:.3g}: {d['near_tie']}"
    j = next(i for i, (a, b) in enumerate(zip(expected + [-1], got + [-2])) if a != b)
    t = worker.request("top2", ids=list(prompt) + list(expected[:j]))
    return f"@{j} gap {t['gap']:.3g}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from specdec.models.resolve import resolve_model_path

    setup_venv(args.venv, args.torch_index)
    target_ir = export_ir(resolve_model_path(args.target), args.weight_format, args.venv)
    draft_ir = export_ir(resolve_model_path(args.draft), args.weight_format, args.venv)
    if args.setup:
        print(f"ready: {args.venv}, {target_ir}, {draft_ir}")
        return

    import torch

    from specdec import LLM, SamplingParams
    from specdec.prompts import load_prompts

    torch.set_num_threads(args.threads)
    has_eager = "enforce_eager" in inspect.signature(LLM.__init__).parameters
    configs = build_configs(args, has_eager)
    worker = Worker(target_ir, draft_ir, args.threads, args.venv)
    try:
        info = worker.request("info")
        ov_path = (f"OpenVINO {info['openvino'].split('-')[0]} CPU ({info['cpu']}): {args.weight_format} IR, "
                   f"{info['inference_precision']} inference, {info['kv_cache_precision']} KV cache, "
                   f"{info['threads']} threads")
        print(f"OpenVINO: {ov_path}; GenAI {info['openvino_genai'].split('-')[0]}", flush=True)
        llms, paths = {}, {}
        for c in configs:
            if c.engine == "openvino":
                paths[c.key] = ov_path
                continue
            t0 = time.perf_counter()
            try:
                llms[c.key] = LLM(args.target, backend=c.backend, speculative_config=c.spec, **c.llm_kwargs)
            except ValueError as e:  # a method this backend cannot run: said, not hidden
                print(f"specdec {c.name}: skipped: {e}", flush=True)
                continue
            llm = llms[c.key]
            paths[c.key] = f"{llm.backend}: {llm.target.describe()}"
            print(f"specdec {c.name}: loaded in {time.perf_counter() - t0:.1f} s, {paths[c.key]} "
                  f"({llm.backend_reason})", flush=True)
        configs = [c for c in configs if c.engine == "openvino" or c.key in llms]
        auto_picks = {}  # auto's configurations: their backend's own row where the run has it, else measured
        for c in [c for c in configs if c.backend == "auto"]:
            llm, method = llms[c.key], c.name.split(" ", 1)[1]
            same = f"specdec {llm.backend} {method}"
            auto_picks[method] = (llm.backend, llm.backend_reason, same if same in llms else c.key)
            if same in llms:
                configs.remove(c)
                del llms[c.key]
        tok = next(iter(llms.values())).tokenizer if llms else None
        rows_all = load_prompts(args.prompts, args.num_prompts + 1)
        if len(rows_all) < args.num_prompts + 1:
            raise SystemExit(f"{args.prompts} holds {len(rows_all)} prompts; --num-prompts {args.num_prompts} "
                             "needs one more (the warm-up)")
        if tok is None:
            raise SystemExit("no specdec configuration loaded; nothing to compare against")
        prompts = [tok.encode(r["prompt"]) for r in rows_all]
        warm, prompts = prompts[-1], prompts[:-1]  # the warm-up prompt is not one of the measured ones

        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for c in configs:  # warm up: compile, allocate, fill caches
            if c.engine == "openvino":
                worker.request("generate", ids=warm, n=16, **c.ov)
            else:
                llms[c.key].generate([{"prompt_token_ids": warm}], SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True))
                llms[c.key].reset_metrics()
        results: dict[str, list[dict]] = {c.key: [] for c in configs}
        load = os.getloadavg()
        for i, ids in enumerate(prompts):
            for c in interleave(configs, reverse=i % 2 == 1):
                if c.engine == "openvino":
                    results[c.key].append(worker.request("generate", ids=ids, n=args.max_tokens, **c.ov))
                else:
                    t0 = time.perf_counter()
                    out = llms[c.key].generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
                    results[c.key].append({"tokens": list(out), "seconds": time.perf_counter() - t0})
            last = {c.key: results[c.key][-1] for c in configs}
            print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{k.removeprefix('specdec ')} {len(r['tokens']) / r['seconds']:.0f}" for k, r in last.items()),
                flush=True)

        taus = {c.key: (llms[c.key].get_metrics().get("mean_acceptance_length") if c.engine == "specdec"
                        else tau_openvino(results[c.key])) for c in configs if c.spec or c.ov.get("config") == "draft"}
        rows = summarize(results, taus)
        print(f"\n{args.num_prompts} prompts of {Path(args.prompts).name}, greedy, exactly {args.max_tokens} new "
              f"tokens, batch 1, {args.threads} threads, alternating prompt by prompt; tok/s end to end:\n")
        print(format_table(rows, paths))
        print()
        for method, (backend, reason, key) in auto_picks.items():
            print(f"specdec backend auto, {method}: {backend} ({reason}); measured as '{key}'")
        for line in ratio_lines(rows):
            print(line)
        print(f"load average (1 min) before / after the prompts: {load[0]:.1f} / {os.getloadavg()[0]:.1f}")

        print("\nsame greedy outputs as plain decoding on the same engine and backend (else: where they part, "
              "the target's top-2 logit gap there):")
        for c in configs:
            base = results.get(c.plain_key)
            if base and c.key != c.plain_key:
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(results[c.key], base))
                notes = [divergence_note(c, ids, b["tokens"], a["tokens"], llms, worker)
                         for ids, a, b in zip(prompts, results[c.key], base) if a["tokens"] != b["tokens"]]
                print(f"  {c.key:40s} {same}/{len(base)}  {'; '.join(notes)}")
        for c in configs:
            if c.engine == "specdec" and c.name.endswith("plain"):
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(results[c.key], results["openvino plain"]))
                print(f"  {c.key} vs openvino plain (different numerics): {same}/{len(prompts)}")

        runners = {c.key: llms[c.key].target for c in configs if c.engine == "specdec" and c.spec is None}
        costs = step_costs(worker, runners, args.context, args.step_repeats, args.step_burst)
        print(f"\none-token step and 5-token verify at context {args.context}, {args.threads} threads "
              f"(median of {args.step_repeats} repeats x the second half of bursts of {args.step_burst}, alternating):")
        for name, c in costs.items():
            path = ov_path + ", stateful model on the plain runtime" if name == "openvino" else paths[name]
            print(f"  {name:32s} t(1) {c[1]:6.2f} ms  t(5) {c[5]:6.2f} ms  v(4) = {c[5] / c[1]:.2f}  [{path}]")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "paths": paths, "openvino": info,
                                                   "step_ms": costs, "auto": auto_picks,
                                                   "args": vars(args)}, indent=1, default=str))
    finally:
        worker.close()


if __name__ == "__main__":
    main()

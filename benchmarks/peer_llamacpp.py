"""specdec on its llama.cpp backend against llama.cpp's own ``llama-server``: same GGUF files, same
prompts, greedy, batch 1, alternating in one run.

llama-server runs plain, with the draft (``-md``, ``--spec-draft-n-max`` 2..8, the best reported) and
with its draft-free types (ngram-mod, ngram-simple, ngram-map-k); specdec runs plain, the draft
(adaptive k), suffix, ngram and the draft with suffix in front. With ``--eagle3-head H`` both also run
the EAGLE-3 head: llama-server as ``-md H.gguf --spec-type draft-eagle3`` (the GGUF written by
``specdec export --eagle3-head``, i.e. llama.cpp's own converter, vocabulary from the target's GGUF)
at each k, specdec with method eagle3 (adaptive k, and with suffix in front). Prompts go to the server as token ids
and both sides generate exactly ``--max-tokens`` tokens (EOS ignored), so the outputs compare token for
token. End to end is the client's wall time per request (prefill included); decode-only leaves out
the prompt's prefill (the server's ``prompt_ms``, specdec's ``prefill_time_s``).

llama.cpp's tools are built once with CMake from the llama.cpp tree vendored in llama-cpp-python's
source distribution, cached outside the repository (~/.cache/specdec/llama.cpp-build):

    python benchmarks/peer_llamacpp.py                       # the shipped pair, bf16 target, f32 draft
    python benchmarks/peer_llamacpp.py --target X.gguf --draft-free-only
    python benchmarks/peer_llamacpp.py --eagle3-head specdec/demo-eagle3 --ks 2,4,6
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

BUILD = Path("~/.cache/specdec/llama.cpp-build").expanduser()
PROMPTS = Path(__file__).resolve().parent / "prompts" / "code_heldout.jsonl"
FREE_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k")


def build_tools(build: Path = BUILD) -> Path:
    """llama-server and llama-bench from the llama.cpp tree of the installed llama-cpp-python's sdist."""
    from specdec.workbench.export_head import llama_cpp_tree

    bin_dir = build / "build" / "bin"
    if (bin_dir / "llama-server").exists() and (bin_dir / "llama-bench").exists():
        return bin_dir
    tree = llama_cpp_tree()  # fetched with pip into specdec's cache once
    t0 = time.time()
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build / "build"), "--target", "llama-server", "llama-bench",
                    "-j", str(os.cpu_count() or 2)], check=True)
    print(f"built llama.cpp's tools in {time.time() - t0:.0f} s")
    return bin_dir


def gguf_of(name: str, outtype: str) -> str:
    """``name`` as a GGUF file: itself, the one in its folder, or an HF checkpoint (the shipped pair's
    names too) converted to ``outtype`` once into ~/.cache/specdec/peer."""
    from specdec.models.gguf import convert
    from specdec.models.resolve import find_gguf, resolve_model_path

    found = None if name.startswith("specdec/") else find_gguf(name)
    if found:
        return found
    out = BUILD.parent / "peer" / f"{Path(resolve_model_path(name)).name}-{outtype}.gguf"
    if not out.exists():
        convert(resolve_model_path(name), str(out), outtype, progress=print)
    return str(out)


def eagle3_gguf(head: str, target: str, target_gguf: str, outtype: str) -> str:
    """The EAGLE-3 head ``head`` as GGUF for llama-server (llama.cpp's converter, via specdec export),
    written once into ~/.cache/specdec/peer per head contents, target file and weight type."""
    import hashlib

    from specdec.models.gguf import checkpoint_digest
    from specdec.models.resolve import resolve_model_path
    from specdec.workbench.export_head import write_gguf

    head_dir = resolve_model_path(head) if head.startswith("specdec/") else head
    key = hashlib.sha256(f"{checkpoint_digest(head_dir)} {Path(target_gguf).resolve()}".encode()).hexdigest()[:12]
    out = BUILD.parent / "peer" / f"{Path(head_dir).name}-{key}-eagle3-{outtype}.gguf"
    if not out.exists():
        write_gguf(head_dir, resolve_model_path(target), out, vocab_gguf=target_gguf, outtype=outtype)
    return str(out)


def check_eagle3_gguf(bin_dir: Path, head: str, target: str, target_gguf: str, head_gguf: str,
                      prompts: list[list[int]], n: int, threads: int) -> None:
    """Does llama-server run the converted head as specdec runs it? The head's acceptance at k = 1 on
    the target's greedy continuations (torch, the head's own files, rounds replayed as llama-server
    runs them) against llama-server's draft-eagle3 acceptance at k = 1 on the same prompts: equal up
    to float rounding and the few tokens where the two backends' greedy paths part."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.models.eagle3 import load_head
    from specdec.models.resolve import resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(target), dtype=torch.float32).eval()
    head_dir = resolve_model_path(head) if head.startswith("specdec/") else head
    h = load_head(head_dir, hf.get_input_embeddings().weight, hf.config.num_hidden_layers)
    hits = total = 0
    with torch.no_grad():
        for ids in prompts:
            full = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)  # [1, T]
            hs = hf(full, output_hidden_states=True).hidden_states  # hs[i]: the input of layer i
            feats = torch.cat([hs[i] for i in h.config.layer_ids], -1)[:, :-1]  # [1, T-1, 3D]: f_0..f_{T-2}
            logits, *_ = h.step(full[:, 1:], h.fuse(feats), torch.arange(full.shape[1] - 1)[None])
            pred = h.draft_to_target[logits[0].argmax(-1)]  # position p predicts token p + 2
            L = len(ids)  # rounds of k = 1 as llama-server runs them: draft t_L, then a bonus token if accepted
            while L < full.shape[1] - 1:
                ok = int(pred[L - 2] == full[0, L])
                hits, total, L = hits + ok, total + 1, L + 1 + ok
    res = run_server(bin_dir, target_gguf, threads, ["-md", head_gguf, "--spec-type", "draft-eagle3",
                                                     "--spec-draft-n-max", "1"], prompts, n)
    print(f"EAGLE-3 head check, k=1 acceptance: the head in torch {hits / total:.3f} ({total} drafts); llama-server "
          f"draft-eagle3 {res['accept'] or 0:.3f}", flush=True)


def quantized(gguf: str) -> bool:
    from specdec.models.gguf import read_info

    return read_info(gguf).weight_type not in ("F32", "BF16", "F16")


def completion_body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """llama-server's own /completion request: greedy, exactly ``max_tokens`` tokens, the ids returned,
    no reuse of an earlier request's prompt cache."""
    return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True, "stream": stream}


def completion_chunk(obj: dict) -> tuple[list[int], str | None]:
    """(new token ids, finish reason or None) of one streamed /completion chunk."""
    return obj.get("tokens") or [], (obj.get("stop_type") or "stop") if obj.get("stop") else None


class Server:
    """One llama-server process with the given extra arguments, on a free local port: ``parallel``
    slots (continuous batching) of ``ctx // parallel`` positions each."""

    def __init__(self, bin_dir: Path, model: str, threads: int, extra: list[str], ctx: int = 4096, parallel: int = 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(bin_dir / "llama-server"), "-m", model, "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-c", str(ctx), "-np", str(parallel), "--no-webui", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {' '.join(cmd)}\n{self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("llama-server did not become healthy")

    def complete(self, ids: list[int], n: int) -> tuple[list[int], float, dict]:
        body = json.dumps(completion_body(ids, n, stream=False)).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req) as r:
            out = json.loads(r.read())
        return out["tokens"], time.perf_counter() - t0, out.get("timings", {})

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_specdec(llm, prompts: list[list[int]], n: int) -> dict:
    from specdec import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0, max_tokens=8))  # warm up
    total = prefill = 0.0
    outs = []
    llm.reset_metrics()
    for ids in prompts:
        t0 = time.perf_counter()
        outs.append(llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids)
        total += time.perf_counter() - t0
    m = llm.get_metrics()
    prefill = m.get("prefill_time_s", 0.0)
    tokens = sum(map(len, outs))
    return {"tokens": tokens, "e2e": tokens / total, "decode": tokens / max(total - prefill, 1e-9), "outputs": outs,
            "accept": m.get("acceptance_rate"), "tau": m.get("mean_acceptance_length")}


def run_server(bin_dir: Path, target: str, threads: int, extra: list[str], prompts: list[list[int]], n: int) -> dict:
    server = Server(bin_dir, target, threads, extra)
    try:
        server.complete(prompts[0][:8], 8)  # warm up
        total = decode_ms = 0.0
        outs, drafted, accepted = [], 0, 0
        for ids in prompts:
            toks, t, timings = server.complete(ids, n)
            outs.append(toks)
            total += t
            decode_ms += timings.get("predicted_ms", 0.0)
            drafted += timings.get("draft_n", 0)
            accepted += timings.get("draft_n_accepted", 0)
    finally:
        server.close()
    tokens = sum(map(len, outs))
    return {"tokens": tokens, "e2e": tokens / total, "decode": tokens / max(decode_ms / 1000, 1e-9), "outputs": outs,
            "accept": accepted / drafted if drafted else None}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--target/--draft (GGUF files or HF checkpoints, converted) and the types they convert to."""
    ap.add_argument("--target", default="specdec/demo-target", help="GGUF file or HF checkpoint (converted)")
    ap.add_argument("--target-outtype", default="bf16")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--draft-outtype", default="f32")
    ap.add_argument("--eagle3-head", default=None,
                    help="also run this EAGLE-3 head (e.g. specdec/demo-eagle3): llama-server draft-eagle3 and "
                         "specdec method eagle3; --target must then be the Hugging Face checkpoint it was trained for")
    ap.add_argument("--eagle3-outtype", default="bf16",
                    help="the head GGUF's weight type for llama-server (bf16: the trained bytes, and faster here than f32)")
    ap.add_argument("--eagle3-check", action="store_true",
                    help="only check that llama-server runs the converted head as specdec does (k = 1 acceptance "
                         "against the head's teacher-forced top-1 on the same prompts), then stop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--draft-free-only", action="store_true", help="no draft model (a random-weight target)")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--ks", default="2,3,4,5,6,8", help="llama-server --spec-draft-n-max values to try")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of every configuration")
    ap.add_argument("--torch", action="store_true", help="also run specdec's torch backend on the same GGUF files")
    ap.add_argument("--server-fa", default="auto,off",
                    help="llama-server --flash-attn settings to run every configuration with (its default is auto: "
                         "on for the CPU; specdec's runner turns it off)")
    ap.add_argument("--no-server", action="store_true", help="specdec only (llama.cpp's tools not built)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    import torch

    from specdec import LLM
    from specdec.prompts import load_prompts

    torch.set_num_threads(args.threads)
    bin_dir = None if args.no_server else build_tools()
    target = gguf_of(args.target, args.target_outtype)
    draft = None if args.draft_free_only else gguf_of(args.draft, args.draft_outtype)
    plain_llm = LLM(target)
    tok = plain_llm.tokenizer
    # fresh prompts every round: suffix decoding remembers earlier outputs, so a repeated prompt would be
    # drafted from its own previous answer
    prompts = [tok.encode(r["prompt"]) for r in load_prompts(args.prompts, args.num_prompts * args.rounds)]
    if len(prompts) < args.num_prompts * args.rounds:
        raise SystemExit(f"{args.prompts} holds {len(prompts)} prompts; {args.rounds} rounds of {args.num_prompts} "
                         "need more: lower --rounds or --num-prompts")

    specdec_cfgs = {"plain": None, "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8},
                    # up to 3 drafts per matched token, k fixed: long copies where text repeats
                    "suffix k=32 x3 fixed": {"method": "suffix", "num_speculative_tokens": 32, "adaptive": False,
                                             "suffix_decoding_max_spec_factor": 3.0},
                    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4}}
    server_cfgs = {"plain": [], **{t: ["--spec-type", t] for t in FREE_TYPES}}
    if args.eagle3_head:
        head_gguf = eagle3_gguf(args.eagle3_head, args.target, target, args.eagle3_outtype)
        print(f"EAGLE-3 head for llama-server: {head_gguf}", flush=True)
        if args.eagle3_check:
            check_eagle3_gguf(bin_dir, args.eagle3_head, args.target, target, head_gguf,
                              prompts[: args.num_prompts], args.max_tokens, args.threads)
            return
        specdec_cfgs |= {"eagle3 k=8 adaptive": {"method": "eagle3", "model": args.eagle3_head,
                                                 "num_speculative_tokens": 8},
                         "eagle3+suffix": {"method": "eagle3", "model": args.eagle3_head, "num_speculative_tokens": 8,
                                           "enable_suffix_decoding": True}}
        server_cfgs |= {f"draft-eagle3 k={k}": ["-md", head_gguf, "--spec-type", "draft-eagle3", "--spec-draft-n-max",
                                                str(k), "-tbd", str(args.threads), "-td", str(args.threads)]
                        for k in map(int, args.ks.split(","))}
    if quantized(target):
        # as specdec's runner loads quantized files: llama.cpp's repacked q8_0 kernels crash on AMX CPUs
        server_cfgs = {k: ["--no-repack", *v] for k, v in server_cfgs.items()}
    if draft:
        specdec_cfgs |= {"draft k=8 adaptive": {"method": "draft_model", "model": draft, "num_speculative_tokens": 8},
                         "draft+suffix": {"method": "draft_model", "model": draft, "num_speculative_tokens": 8,
                                          "enable_suffix_decoding": True}}
        # --spec-type draft-simple: this llama-server loads a -md draft without it but does not speculate with it
        server_cfgs |= {f"-md k={k}": [*server_cfgs["plain"], "-md", draft, "--spec-type", "draft-simple",
                                       "--spec-draft-n-max", str(k), "-tbd", str(args.threads), "-td", str(args.threads)]
                        for k in map(int, args.ks.split(","))}
    fa_settings = args.server_fa.split(",")
    server_cfgs = {(name if fa == "auto" else f"{name} -fa {fa}"): [*extra, "-fa", fa]
                   for name, extra in server_cfgs.items() for fa in fa_settings}
    backend_of = dict.fromkeys(specdec_cfgs, (target, "llama.cpp"))
    if args.torch:  # the same configurations and files on the torch runner (a GGUF draft stays on llama.cpp)
        for name, cfg in list(specdec_cfgs.items()):
            specdec_cfgs[f"torch {name}"] = cfg
            backend_of[f"torch {name}"] = (target, "torch")

    def build(name: str):
        """A new LLM per round: no drafter state (suffix trees, adaptive k) carries over from the last one."""
        if name == "plain":
            return plain_llm
        model, backend = backend_of[name]
        return LLM(model, backend=backend, speculative_config=specdec_cfgs[name])

    llms = {}
    if args.no_server:
        server_cfgs = {}

    results: dict[str, list[dict]] = {}
    ours, theirs = [("specdec", n) for n in specdec_cfgs], [("llama-server", n) for n in server_cfgs]
    mixed = [x for i in range(max(len(ours), len(theirs))) for x in ours[i : i + 1] + theirs[i : i + 1]]
    for r in range(args.rounds):
        batch = prompts[r * args.num_prompts : (r + 1) * args.num_prompts]
        for side, name in (mixed if r % 2 == 0 else mixed[::-1]):
            if side == "specdec":
                try:
                    llms[name] = build(name)
                except ValueError as e:  # e.g. a method this backend cannot run: said, not hidden
                    print(f"{side:12s} {name:20s} skipped: {e}", flush=True)
                    continue
            res = run_specdec(llms[name], batch, args.max_tokens) if side == "specdec" else \
                run_server(bin_dir, target, args.threads, server_cfgs[name], batch, args.max_tokens)
            results.setdefault(f"{side} {name}", []).append(res)
            print(f"{side:12s} {name:20s} e2e {res['e2e']:7.1f} tok/s  decode {res['decode']:7.1f} tok/s  "
                  f"accept {res['accept'] if res['accept'] is not None else '-'}", flush=True)

    mean = {k: {m: sum(x[m] for x in v) / len(v) for m in ("e2e", "decode")} for k, v in results.items()}
    from specdec.near_tie import first_divergence

    print("\nsame greedy outputs as plain decoding on the same backend (else: where, the top-2 gap, near-tie?):")
    for k, v in results.items():
        plain_key = "specdec torch plain" if k.startswith("specdec torch") else \
            "specdec plain" if k.startswith("specdec") else "llama-server plain" + "".join(k.partition(" -fa ")[1:])
        base = [o for x in results[plain_key] for o in x["outputs"]]  # every round's, in prompt order
        got = [o for x in v for o in x["outputs"]]
        same = sum(a == b for a, b in zip(got, base))
        notes = []
        if k.startswith("specdec"):
            runner = llms[plain_key.removeprefix("specdec ")].target
            for ids, e, g in zip(prompts, base, got):
                d = first_divergence(runner, ids, e, g)
                if d:
                    notes.append(f"@{d['position']} gap {d['gap']:.3g} < {d['threshold']:.3g}: {d['near_tie']}")
        print(f"  {k:34s} {same}/{len(base)}  {'; '.join(notes)}")
    print("\nmeans over rounds (tok/s, end to end / decode-only):")
    for k, v in sorted(mean.items(), key=lambda kv: -kv[1]["e2e"]):
        print(f"  {k:34s} {v['e2e']:7.1f} / {v['decode']:7.1f}")

    def best(prefix: str, names, without: tuple[str, ...] = (), torch_too: bool = False) -> tuple[str, float]:
        cands = [(k, mean[k]["e2e"]) for k in mean if k.startswith(prefix) and any(n in k for n in names)
                 and not any(w in k for w in without) and (torch_too or "torch" not in k)]
        return max(cands, key=lambda x: x[1]) if cands else ("-", float("nan"))

    if args.torch:
        print()
        for name in (n for n in specdec_cfgs if not n.startswith("torch ")):
            print(f"specdec {name}: llama.cpp / torch backend {mean[f'specdec {name}']['e2e'] / mean[f'specdec torch {name}']['e2e']:.2f}x")
    if not server_cfgs:
        return
    lc_plain_name, lc_plain = best("llama-server", ["plain"])
    print(f"\nspecdec plain / llama-server plain ({lc_plain_name}): {mean['specdec plain']['e2e'] / lc_plain:.2f}x")
    if draft:
        md, md_v = best("llama-server", ["-md"])
        print(f"specdec draft (adaptive) / llama-server best -md ({md}): "
              f"{mean['specdec draft k=8 adaptive']['e2e'] / md_v:.2f}x")
    if args.eagle3_head:
        e3, e3_v = best("llama-server", ["draft-eagle3"])
        sd_e3, sd_e3_v = best("specdec", ["eagle3"])
        print(f"specdec eagle3 ({sd_e3}) / llama-server best draft-eagle3 ({e3}), same head: {sd_e3_v / e3_v:.2f}x")
    any_spec, any_v = best("llama-server", ["-md", "draft-eagle3", *FREE_TYPES])
    free, free_v = best("llama-server", FREE_TYPES)
    sd_best, sd_v = best("specdec", ["suffix", "ngram", "draft", "eagle3"])
    print(f"specdec best ({sd_best}) / llama-server best speculative ({any_spec}): {sd_v / any_v:.2f}x")
    if args.torch:
        sd_any, sd_any_v = best("specdec", ["suffix", "ngram", "draft", "eagle3"], torch_too=True)
        print(f"specdec best on either backend ({sd_any}) / llama-server best speculative ({any_spec}): "
              f"{sd_any_v / any_v:.2f}x")
    sd_free, sd_free_v = best("specdec", ["suffix", "ngram"], without=("draft", "eagle3"))
    print(f"specdec best draft-free ({sd_free}) / llama-server best draft-free ({free}): {sd_free_v / free_v:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"mean": mean, "runs": {k: [{m: x[m] for m in x if m != "outputs"}
                                                                         for x in v] for k, v in results.items()}}))


if __name__ == "__main__":
    main()

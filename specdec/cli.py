"""``specdec``: generate, bench and demo from the command line, thin over ``specdec.LLM``.

Every ``ValueError`` the library raises for bad input is printed as ``error: <message>`` on
stderr and exits with status 2 (the status click uses for usage errors), without a traceback.
"""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from specdec.cli_common import (TAU, CliError, DeviceOpt, Drafting, JsonOpt, KOpt, Loading, ModelOpt, errors_exit_2,
                                option_groups, parse_methods, print_json, quiet_transformers)
from specdec.config import SPECULATIVE_METHODS, SchedulerConfig
from specdec.demo import PROBE_ROUNDS
from specdec.workbench.cli import register as register_workbench


app = typer.Typer(help="Lossless speculative decoding for Hugging Face Llama-family checkpoints.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)

DEMO_TARGET, DEMO_DRAFT, DEMO_HEAD = "specdec/demo-target", "specdec/demo-draft", "specdec/demo-eagle3"
DEMO_PARD = "specdec/demo-draft-pard"  # the demo's parallel draft (its method "pard": draft_model, parallel_drafting)
# Each ends where the tokenizer ends a token in running text: a prompt ending in a bare newline
# leaves a token that training text merges with the next line's indentation, and the model then
# starts a top-level line instead of the function body.
DEMO_PROMPTS = [
    'def fibonacci(n):\n    """',
    'def is_prime(n):\n    """',
    "class Stack:\n    def __init__(self):\n        self.",
]

@app.command()
@option_groups
def generate(
    model: ModelOpt,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text.")] = None,
    prompt_token_ids: Annotated[str | None, typer.Option(
        "--prompt-token-ids", help='Prompt as token ids instead of text, e.g. "1,2,3".')] = None,
    drafting: Drafting = Drafting(),
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling; 1 disables it.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 or -1 disables it.")] = 0,
    min_p: Annotated[float, typer.Option(help="0 disables it.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Per-request seed for reproducible sampling.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 64,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past end-of-sequence.")] = False,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string; repeat for several.")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="transformers' repetition penalty; 1 disables it.")] = 1.0,
    presence_penalty: Annotated[float, typer.Option(help="OpenAI's, in [-2, 2]; 0 disables it.")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="OpenAI's, in [-2, 2]; 0 disables it.")] = 0.0,
    min_tokens: Annotated[int, typer.Option(help="No end of sequence before this many tokens.")] = 0,
    json_schema: Annotated[str | None, typer.Option(
        "--json-schema", help="Constrain the output to this JSON schema: a .json file or the schema's text.")] = None,
    json_object: Annotated[bool, typer.Option("--json-object", help="Constrain the output to a JSON object.")] = False,
    regex: Annotated[str | None, typer.Option(help="Constrain the output to this regular expression.")] = None,
    choice: Annotated[list[str] | None, typer.Option(
        "--choice", help="Constrain the output to one of these strings; repeat for several.")] = None,
    grammar: Annotated[str | None, typer.Option(
        help="Constrain the output to this grammar (EBNF): a file or the grammar's text.")] = None,
    n: Annotated[int, typer.Option("-n", "--n", help="Choices to generate (with --seed S, choice i uses S + i).")] = 1,
    logprobs: Annotated[int | None, typer.Option(
        help="With --json: each token's logprob plus the top N alternatives (the target's raw distribution).")] = None,
    loading: Loading = Loading(),
    as_json: JsonOpt = False,
) -> None:
    """Generate a completion for one prompt, with or without a drafter, and print speed and acceptance."""
    with errors_exit_2():
        from specdec import LLM, SamplingParams
        from specdec.config import StructuredOutputsParams

        request = _prompt_input(prompt, prompt_token_ids)
        structured = None
        if json_schema or json_object or regex or choice or grammar:
            structured = StructuredOutputsParams(json=_text_or_file(json_schema), json_object=json_object or None,
                                                 regex=regex, choice=choice, grammar=_text_or_file(grammar))
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                max_tokens=max_tokens, ignore_eos=ignore_eos, stop=stop,
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, min_tokens=min_tokens,
                                structured_outputs=structured, n=n, logprobs=logprobs)
        spec = drafting.config()
        quiet_transformers()
        llm = LLM(model=model, speculative_config=spec, **loading.llm_kwargs())
        t0 = time.perf_counter()
        outs = llm.generate([request], params)[0].outputs
        elapsed = time.perf_counter() - t0
    metrics = llm.get_metrics()
    out = outs[0]
    if as_json:
        choices = [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                   | ({} if o.logprobs is None else {"logprobs": _logprobs_json(o.logprobs)}) for o in outs]
        print_json({**choices[0], "metrics": metrics} | ({"choices": choices} if n > 1 else {}))
        return
    for o in outs:
        typer.echo(o.text)
    n = sum(len(o.token_ids) for o in outs)
    line = f"{n} tokens in {elapsed:.2f} s ({n / elapsed if elapsed > 0 else 0.0:.1f} tokens/s)"
    cfg = llm.speculative_config
    if cfg is not None and cfg.num_speculative_tokens > 0:
        line += (f" | acceptance rate {metrics['acceptance_rate']:.1%} | {TAU} {metrics['mean_acceptance_length']:.2f}"
                 f" | draft {metrics['draft_time_s']:.3f} s, verify {metrics['verify_time_s']:.3f} s")
    else:
        line += f" | plain decoding | verify {metrics['verify_time_s']:.3f} s"
    line += f" | finish: {out.finish_reason}"
    Console(stderr=True, highlight=False, soft_wrap=True).print(line, style="dim", markup=False)


@app.command()
@option_groups
def bench(
    model: ModelOpt,
    prompts: Annotated[str, typer.Option(
        "--prompts", help="JSONL file: {\"prompt\": ...} per line, or Spec-Bench's question.jsonl.")],
    drafting: Drafting = Drafting(),
    max_tokens: Annotated[int, typer.Option(help="Most tokens per prompt.")] = 128,
    num_prompts: Annotated[int | None, typer.Option(help="Use only the first N prompts.")] = None,
    temperature: Annotated[float, typer.Option(help="0 (greedy) also checks that outputs match.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Per-request seed when sampling.")] = None,
    repeats: Annotated[int, typer.Option(help="Run every prompt this many times with each.")] = 1,
    peer: Annotated[str | None, typer.Option(
        "--peer", help="hf: also run transformers' generate and its assisted generation, alternating.")] = None,
    loading: Loading = Loading(),
    as_json: JsonOpt = False,
) -> None:
    """Plain vs speculative decoding, batch 1, same process: tokens/s, speedup, acceptance and τ."""
    with errors_exit_2():
        from specdec import LLM, SamplingParams
        from specdec.bench import run_bench
        from specdec.prompts import load_prompts

        records = load_prompts(prompts, num_prompts)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
        spec = drafting.config()
        if spec is None:
            raise CliError("bench compares plain and speculative decoding: pass --draft D or --speculative-config "
                           "(or --method M)")
        quiet_transformers()
        if peer not in (None, "hf"):
            raise CliError(f"--peer must be 'hf', got {peer!r}")
        spec_llm = LLM(model=model, speculative_config=spec, **loading.llm_kwargs())
        # the baseline runs where the speculative side does, whichever auto picked: one backend's ratio
        ar_llm = LLM(model=model, **(loading.llm_kwargs() | {"backend": spec_llm.backend}))
        if peer == "hf":
            from specdec.workbench.peer_hf import run_bench_with_hf

            result = run_bench_with_hf(ar_llm, spec_llm, records, params, repeats=repeats, dtype=loading.dtype,
                                       device=loading.device)
        else:
            result = run_bench(ar_llm, spec_llm, records, params, repeats=repeats)
    if as_json:
        print_json(result.as_dict())
    else:
        _print_bench(result.as_dict(), Console(highlight=False))


@app.command()
def demo(
    max_tokens: Annotated[int, typer.Option(help="Most tokens per completion.")] = 64,
    device: DeviceOpt = "cpu",
    backend: Annotated[str, typer.Option(
        "--backend", help="auto: measure every backend here (llama.cpp and torch; the one $SPECDEC_AUTO_BACKEND "
                          "names if set) and run the fastest; torch or llama.cpp: that one only.")] = "auto",
    method: Annotated[list[str] | None, typer.Option(
        "--method", help="Measure only this speculative method: draft_model, pard (the shipped parallel draft: "
                         "draft_model with parallel_drafting), suffix, eagle3 (when the head is installed) or a "
                         "list chosen per request such as suffix,eagle3; repeat the option for several. Default: "
                         "each of the four and suffix with the best model drafter.")] = None,
    k: KOpt = None,
    probe_rounds: Annotated[int, typer.Option(
        min=1, help="Times each configuration runs the probe prompts before the choice.")] = PROBE_ROUNDS,
    as_json: JsonOpt = False,
) -> None:
    """Measure plain decoding on each backend and a few speculative configurations here, then complete
    three Python prompts with the best one and bench it against plain decoding on the fastest backend."""
    from specdec.models.resolve import SHIPPED

    missing = [name for name in (DEMO_TARGET, DEMO_DRAFT) if not (SHIPPED[name] / "config.json").exists()]
    if missing:
        typer.echo(f"error: the shipped demo pair is not installed (missing {', '.join(missing)} under "
                   f"{SHIPPED[DEMO_TARGET].parent}); run `specdec generate --model FOLDER --draft FOLDER "
                   "--prompt ...` with your own checkpoints instead", err=True)
        raise typer.Exit(1)
    head = DEMO_HEAD if DEMO_HEAD in SHIPPED and (SHIPPED[DEMO_HEAD] / "config.json").exists() else None
    pard = DEMO_PARD if DEMO_PARD in SHIPPED and (SHIPPED[DEMO_PARD] / "config.json").exists() else None
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    with errors_exit_2():
        from specdec import SamplingParams
        from specdec.demo import (PROBE_PROMPTS, PROBE_TOKENS, VERIFY_K, build, candidates, choose, explain,
                                  final_comparison, forward_costs, measure)

        backends = _demo_backends(backend, device)
        methods = [m.strip() for m in method] if method else None
        if methods is not None:
            for entry in methods:  # the same errors as --method elsewhere ("pard" is the demo's name for a draft_model)
                parse_methods(entry)
                unknown = [m.strip() for m in entry.split(",") if m.strip() not in (*SPECULATIVE_METHODS, "pard")]
                if unknown:
                    raise CliError(f"--method {entry!r}: unknown method {unknown[0]!r}; the demo takes "
                                   f"{', '.join((*SPECULATIVE_METHODS, 'pard'))} (or a list of them)")
            if any("pard" in entry.split(",") for entry in methods) and pard is None:
                raise CliError(f"--method pard: the shipped parallel draft {DEMO_PARD} is not installed (no "
                               f"{SHIPPED.get(DEMO_PARD, DEMO_PARD)}/config.json); train one with `specdec distill "
                               "--method pard` or leave pard out")
            if any("eagle3" in entry.split(",") for entry in methods) and head is None:
                raise CliError(f"--method eagle3: the shipped EAGLE-3 head {DEMO_HEAD} is not installed (no "
                               f"{SHIPPED.get(DEMO_HEAD, DEMO_HEAD)}/config.json); train one with `specdec distill "
                               "--method eagle3` or leave eagle3 out")
        cands = candidates(backends, DEMO_DRAFT, head, methods, k, pard=pard)
        probe_tokens = min(PROBE_TOKENS, max_tokens)
        err.print(f"specdec demo: measuring {len(cands)} configurations on this machine ({len(PROBE_PROMPTS)} "
                  f"probe prompts x {probe_rounds}, {probe_tokens} tokens each, greedy, batch 1, alternating)",
                  style="dim", markup=False)
        quiet_transformers()
        t0 = time.perf_counter()
        llms = build(cands, DEMO_TARGET, device, progress=lambda line: err.print(line, style="dim", markup=False))
        measured = measure(llms, max_tokens=probe_tokens, rounds=probe_rounds)
        costs = None
        if len(backends) > 1:  # what a step and a verify pass cost on each: the same figures backend=auto times
            try:
                costs = forward_costs(llms)
            except (ValueError, RuntimeError, OSError) as e:  # the explanation then uses the controller's line
                err.print(f"  (the forward's costs could not be timed: {e})", style="dim", markup=False)
        measure_s = time.perf_counter() - t0  # loading the candidates and timing the forwards included
        choice = choose(measured)
        why = explain(choice, costs)
        if choice.spec is None:
            _print_measured(choice, why, probe_tokens, probe_rounds, measure_s, Console(highlight=False))
            raise CliError("no speculative configuration could run here (see the table)")
        spec_c, fast_c = choice.spec.candidate, choice.plain.candidate
        same_c = (choice.plain_on(spec_c.backend) or choice.plain).candidate
        for c in [c for c in llms if c not in (spec_c, fast_c, same_c)]:
            del llms[c]  # the losers' models and KV caches go before the full run
        spec_llm, fast_llm, same_llm = llms[spec_c], llms[fast_c], llms[same_c]
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        completions = [o.outputs[0].text for o in spec_llm.generate(DEMO_PROMPTS, params)]
        peer = f"plain {fast_c.backend}"
        peers = {} if fast_c == same_c else {
            peer: lambda p: fast_llm.generate([p], params)[0].outputs[0].token_ids}
        result = final_comparison(same_llm, spec_llm, DEMO_PROMPTS, params, peers=peers, choice=choice, costs=costs)
    baseline = result["peers"][peer]["tokens_per_s"] if peers else result["ar"]["tokens_per_s"]
    spec_tps = result["spec"]["tokens_per_s"]
    summary = {"ar_tokens_per_s": baseline, "spec_tokens_per_s": spec_tps,
               "speedup": spec_tps / baseline if baseline else 0.0,
               "plain_backend": fast_c.backend, "same_backend_speedup": result["speedup"],
               "same_backend_ar_tokens_per_s": result["ar"]["tokens_per_s"],
               "acceptance_rate": result["spec"]["acceptance_rate"],
               "mean_acceptance_length": result["spec"]["mean_acceptance_length"], "paths": result["paths"],
               "backend": spec_c.backend, "backend_reason": "measured by the demo: the best speculative configuration",
               "configuration": spec_c.name, "speculative_config": spec_c.speculative_config(), "why": why,
               "measured": [m.as_dict() for m in measured], "measure_time_s": measure_s,
               "doubts": result["doubts"], "remeasured": result["remeasured"], "runs": result["runs"],
               "expected_same_backend_speedup": result["expected_speedup"],
               "num_draft_tokens": result["spec"]["metrics"]["num_draft_tokens"],
               "forward_ms": None if costs is None else {b: {"1": t1, str(VERIFY_K + 1): tk}
                                                         for b, (t1, tk) in costs.items()}}
    if as_json:
        print_json({**summary, "completions": completions, "greedy_match": result["greedy_match"]})
        return
    console = Console(highlight=False)
    _print_measured(choice, why, probe_tokens, probe_rounds, measure_s, console)
    for p, c in zip(DEMO_PROMPTS, completions):
        console.rule(f"{DEMO_TARGET}, {spec_c.name}, greedy", style="dim")
        console.print(p, style="bold", end="", markup=False)
        console.print(c, markup=False)
    console.rule(style="dim")
    _print_demo_bench(result, summary, fast_c.backend, peer if peers else None, console)


def _demo_backends(backend: str, device: str) -> list[str]:
    """The backends the demo measures: the one asked for, else every one that runs here."""
    from specdec.demo import BACKENDS
    from specdec.models import llamacpp_lib
    from specdec.models.backend_choice import ENV

    if backend != "auto":
        if backend not in BACKENDS:
            raise CliError(f"--backend must be auto, torch or llama.cpp, got {backend!r}")
        return [backend]
    if os.environ.get(ENV):  # fixed for this machine (the test suite fixes torch)
        return [os.environ[ENV]]
    if not str(device).startswith("cpu") or not llamacpp_lib.available():
        return ["torch"]
    return list(BACKENDS)


@app.command()
def convert(
    hf_dir: Annotated[str, typer.Argument(help="A Hugging Face checkpoint folder (Llama, Mistral, Qwen2, Qwen3), or an EAGLE-3 head "
                                                   "folder (written as llama.cpp's eagle3 architecture).")],
    out: Annotated[str, typer.Option("--out", help="The GGUF file to write.")],
    outtype: Annotated[str, typer.Option(help="Weight type: f32, bf16, f16, q8_0 or q4_k_m.")] = "bf16",
) -> None:
    """Convert a checkpoint to GGUF for the llama.cpp backend (and llama.cpp's own tools)."""
    with errors_exit_2():
        from specdec.models.gguf import convert as convert_checkpoint
        from specdec.models.resolve import resolve_model_path

        quiet_transformers()
        path = convert_checkpoint(resolve_model_path(hf_dir), out, outtype,
                                  progress=lambda line: typer.echo(line, err=True))
    typer.echo(path)


@app.command()
@option_groups
def serve(
    model: ModelOpt,
    drafting: Drafting = Drafting(),
    host: Annotated[str, typer.Option(help="Address to bind; 127.0.0.1 keeps the server local.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="SPECDEC_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    max_num_seqs: Annotated[int, typer.Option(
        help="Most sequences decoded at once; the rest wait.")] = SchedulerConfig.max_num_seqs,
    num_scheduler_steps: Annotated[int, typer.Option(
        help="Plain steps a greedy round that drafts nothing may take in one call (1: one a round).")
    ] = SchedulerConfig.num_scheduler_steps,
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model name clients send (default: --model).")] = None,
    loading: Loading = Loading(),
    threads: Annotated[int | None, typer.Option(
        help="Torch threads (default: $OMP_NUM_THREADS, else one fewer than the CPU cores, leaving one to "
             "the HTTP event loop, which otherwise competes with the rounds for the CPU).")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(
        help="Most prompt tokens admitted into one round (a longer single prompt is still admitted).")] = 8192,
    max_queued_requests: Annotated[int, typer.Option(
        help="Requests that may wait for a batch slot or KV memory; past it the server answers 429.")] = 1024,
    max_prompts_per_request: Annotated[int, typer.Option(help="Prompts in one completions request.")] = 64,
    max_n: Annotated[int, typer.Option(
        help="Most choices per prompt (n); each is a sequence in the batch and the KV budget.")] = 16,
    max_stop_strings: Annotated[int, typer.Option(
        help="Most stop strings per request (each is searched in the output after every round).")] = 16,
    max_stop_token_ids: Annotated[int, typer.Option(help="Most stop_token_ids per request.")] = 256,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body; larger ones get 413.")] = 4 * 2**20,
    kv_cache_memory: Annotated[str | None, typer.Option(
        help="KV cache memory budget, e.g. 8GiB (default: --kv-cache-memory-fraction of the free memory "
             "once the models are loaded). Requests wait until theirs fits.")] = None,
    kv_cache_memory_fraction: Annotated[float, typer.Option(
        help="Share of the free memory the KV caches may use when --kv-cache-memory is not given.")] = 0.5,
    timeout_keep_alive: Annotated[float, typer.Option(help="Seconds an idle keep-alive connection stays open.")] = 5.0,
    header_timeout: Annotated[float, typer.Option(help="Seconds a client has to send a request's headers.")] = 10.0,
    body_timeout: Annotated[float, typer.Option(help="Seconds a client has to send a request's body.")] = 30.0,
    limit_concurrency: Annotated[int, typer.Option(
        help="Connections and requests in progress before the server answers 503.")] = 1024,
    allowed_hosts: Annotated[list[str] | None, typer.Option(
        "--allowed-hosts", help="Host (and Origin) names to accept besides loopback ones; repeat for several. "
                                "Without it a loopback-bound server accepts only loopback names.")] = None,
    metrics_public: Annotated[bool, typer.Option(
        "--metrics-public", help="Serve /metrics without the API key.")] = False,
    enable_docs: Annotated[bool, typer.Option("--enable-docs", help="Serve /docs, /redoc and /openapi.json.")] = False,
    engine_in_process: Annotated[bool, typer.Option(
        "--engine-in-process", help="Run the engine loop as a thread of the HTTP process instead of a process of "
                                    "its own (one process; the HTTP side's work then slows the rounds).")] = False,
    http_nice: Annotated[int, typer.Option(
        min=0, max=19, help="CPU niceness the HTTP process adds to its own once the engine process runs, so on a "
                            "machine with few cores the rounds of admitted requests come before handling new (or "
                            "hostile) ones; 0 keeps both at the same priority.")] = 5,
    engine_restarts: Annotated[int, typer.Option(
        help="Restarts of a dead engine process tried in a row before the server reports failure (0: none).")] = 5,
    engine_restart_backoff: Annotated[float, typer.Option(
        help="Seconds before the first restart of a dead engine process; doubles with each failure in a row.")] = 0.5,
    engine_iteration_timeout: Annotated[float, typer.Option(
        help="Seconds the engine process may go without finishing a round while requests are in flight; past "
             "it the process is taken as hung, killed and restarted (vLLM: VLLM_ENGINE_ITERATION_TIMEOUT_S).")] = 120.0,
) -> None:
    """OpenAI-compatible server: completions, chat, streaming, /metrics; continuous batching; every
    resource a client can ask for is bounded (see the options)."""
    with errors_exit_2():
        import torch

        from specdec.server import build_app, serve as run_server
        from specdec.server.limits import ServerLimits, parse_bytes

        limits = ServerLimits(
            max_body_bytes=max_body_bytes, max_prompts_per_request=max_prompts_per_request, max_n=max_n,
            max_stop_strings=max_stop_strings, max_stop_token_ids=max_stop_token_ids,
            max_queued_requests=max_queued_requests, max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
            kv_cache_memory_fraction=kv_cache_memory_fraction, timeout_keep_alive=timeout_keep_alive,
            header_timeout=header_timeout, body_timeout=body_timeout, limit_concurrency=limit_concurrency,
            allowed_hosts=tuple(allowed_hosts) if allowed_hosts else None, metrics_public=metrics_public,
            enable_docs=enable_docs, engine_restarts=engine_restarts, engine_restart_backoff=engine_restart_backoff,
            engine_iteration_timeout=engine_iteration_timeout)

        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        if threads is None and not os.environ.get("OMP_NUM_THREADS"):
            threads = max(1, (os.cpu_count() or 2) - 1)
        if threads is not None:
            torch.set_num_threads(threads)

        spec = drafting.config()
        quiet_transformers()
        server_app = build_app(model=model, speculative_config=spec, max_model_len=max_model_len,
                               max_num_seqs=max_num_seqs, num_scheduler_steps=num_scheduler_steps,
                               served_model_name=served_model_name, api_key=api_key, limits=limits,
                               engine_process=not engine_in_process, **loading.llm_kwargs())
    if not engine_in_process and http_nice:
        os.nice(http_nice)  # after the engine process started: it keeps the priority this process had
    run_server(server_app, host=host, port=port)


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def train(ctx: typer.Context) -> None:
    """Train a tokenizer and a Llama model from scratch (options: specdec train --help).

    Runs unchanged under torchrun: torchrun --nproc_per_node 2 -m specdec.training.train ...
    """
    from specdec.training.train import main as train_main

    with errors_exit_2():
        train_main(list(ctx.args))


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def distill(ctx: typer.Context) -> None:
    """Distill a small draft from a target on your text (options: specdec distill --help).

    Runs unchanged under torchrun: torchrun --nproc_per_node 2 -m specdec.training.distill ...
    """
    from specdec.training.distill import main as distill_main

    with errors_exit_2():
        distill_main(list(ctx.args))


def main() -> None:
    app()


# -- helpers --------------------------------------------------------------------------------------


def _logprobs_json(positions: list[dict]) -> list[dict]:
    """Per output token: {token id (as text, JSON's keys): {"logprob", "rank", "decoded_token"}}."""
    return [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in d.items()} for d in positions]


def _text_or_file(value: str | None) -> str | None:
    """An option that takes a file's path or the text itself (a schema, a grammar)."""
    if value is not None and len(value) < 4096 and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def _prompt_input(prompt: str | None, prompt_token_ids: str | None) -> str | dict:
    if (prompt is None) == (prompt_token_ids is None):
        raise CliError("pass exactly one of --prompt TEXT or --prompt-token-ids \"1,2,3\"")
    if prompt is not None:
        return prompt
    try:
        ids = [int(t) for t in prompt_token_ids.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise CliError(f"--prompt-token-ids must be comma-separated integers, got {prompt_token_ids!r}") from None
    if not ids:
        raise CliError("--prompt-token-ids is empty; pass at least one token id")
    return {"prompt_token_ids": ids}


def _divergence(m: dict) -> str:
    where = f"prompt {m['prompt']} token {m['first_mismatch']}"
    if m.get("gap") is None:
        return f"{where} (length differs)"
    kind = "a near-tie" if m["near_tie"] else "NOT a near-tie"
    return f"{where}, {kind} (top-2 logit gap {m['gap']:.3f} vs rounding threshold {m['threshold']:.3f})"


def _print_bench(r: dict, console: Console) -> None:
    table = Table(title=f"{r['num_prompts']} prompts × {r['repeats']}, batch 1, max {r['max_tokens']} tokens, "
                        f"k={r['num_speculative_tokens']}", title_style="bold")
    for col in ("", "tokens", "time (s)", "tokens/s", "median tokens/s per prompt"):
        table.add_column(col, justify="left" if not col else "right")
    for name, side in (("plain", r["ar"]), ("speculative", r["spec"])):
        table.add_row(name, str(side["tokens"]), f"{side['time_s']:.2f}", f"{side['tokens_per_s']:.1f}",
                      f"{side['median_tokens_per_s']:.1f}")
    console.print(table)
    for line in _bench_lines(r):
        console.print(line, markup=False, soft_wrap=True)


def _bench_lines(r: dict) -> list[str]:
    """The summary under a bench table: speedup (first), acceptance, τ, greedy equality, peers, paths."""
    s = r["spec"]
    per_pos = ", ".join(f"{a:.2f}" for a in s["acceptance_rate_per_pos"]) or "-"
    lines = [
        f"speedup: {r['speedup']:.2f}x (speculative tokens/s ÷ plain tokens/s, prompt prefill included); "
        f"decoding alone: {r['decode_speedup']:.2f}x",
        f"acceptance rate: {s['acceptance_rate']:.1%}",
        f"{TAU}: {s['mean_acceptance_length']:.2f}",
        f"acceptance per draft position: {per_pos}",
        f"draft time: {s['draft_time_s']:.3f} s, verify time: {s['verify_time_s']:.3f} s",
    ]
    gm = r.get("greedy_match")
    if gm is not None:
        lossless = gm["matched"] + gm["near_ties"]
        line = f"greedy outputs equal to plain decoding: {lossless}/{gm['total']} prompts"
        if gm["mismatched"]:
            line += (f" ({gm['matched']} token for token; the others part at "
                     + ", ".join(_divergence(m) for m in gm["mismatched"]) + ")")
        lines.append(line)
    if "hf_spec" in r:
        hf_ar, hf_spec, agree = r["hf_ar"], r["hf_spec"], r["hf_agreement"]
        lines += [
            f"transformers plain generate: {hf_ar['tokens_per_s']:.1f} tokens/s; {hf_spec['method']}: "
            f"{hf_spec['tokens_per_s']:.1f} tokens/s ({r['hf_spec_speedup']:.2f}x its plain)",
            f"specdec speculative vs transformers assisted: {r['speedup_vs_hf']:.2f}x; vs transformers plain: "
            f"{r['speedup_vs_hf_ar']:.2f}x",
            "outputs agreeing with specdec plain (exact or at a near-tie < 1e-3): " + ", ".join(
                f"{side} {agree[side]['agree']}/{agree[side]['total']}" for side in ("spec", "hf_ar", "hf_spec")),
        ]
    cats = r.get("by_category") or {}
    if len(cats) > 1:
        lines.append("by category: " + "; ".join(
            f"{c} {v['speedup']:.2f}x, τ {v['mean_acceptance_length']:.2f}" for c, v in cats.items()))
    lines += [f"{side} path: {path}" for side, path in (r.get("paths") or {}).items()]
    return lines


def _print_measured(choice, why: str, probe_tokens: int, rounds: int, seconds: float, console: Console) -> None:
    """The demo's measurements: one row per configuration, against the fastest plain backend."""
    console.print(f"measured here in {seconds:.0f} s: 3 probe prompts, best of {rounds}, {probe_tokens} tokens, "
                  "greedy, batch 1", style="bold", markup=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    tau = TAU.split()[0]
    for col in ("configuration", "tokens/s", "x plain", tau, "k/round"):
        table.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=col == "configuration")
    base = choice.plain.tokens_per_s
    for m in choice.measured:
        name = m.candidate.name + (" *" if m is choice.spec or m is choice.plain else "")
        if not m.ok:
            table.add_row(name, "-", "", "", "")
            continue
        spec = not m.candidate.plain
        table.add_row(name, f"{m.tokens_per_s:.1f}", f"{m.tokens_per_s / base:.2f}" if base else "-",
                      f"{m.tau:.2f}" if spec else "-", f"{m.mean_k:.1f}" if spec else "-")
    console.print(table)
    notes = [f"x plain: over plain decoding on {choice.plain.candidate.backend}, the fastest plain backend here; "
             f"{tau}: tokens per verify pass (incl. bonus); k/round: drafts per round that drafted; *: the "
             "baseline and the choice"]
    notes += [f"{m.candidate.name}: not run: {m.error or 'no tokens'}" for m in choice.measured if not m.ok]
    for line in notes:
        console.print(line, markup=False, soft_wrap=True, style="dim")
    console.print(f"why: {why}", markup=False, soft_wrap=True)


def _print_demo_bench(r: dict, summary: dict, fast_backend: str, peer: str | None, console: Console) -> None:
    """The full run: plain on the fastest backend (the baseline), plain on the speculative side's own
    backend (its exactness reference) when that differs, and the chosen configuration."""
    table = Table(title=f"{r['num_prompts']} demo prompts, batch 1, max {r['max_tokens']} tokens, greedy",
                  title_style="bold")
    for col in ("", "tokens", "time (s)", "tokens/s"):
        table.add_column(col, justify="left" if not col else "right")
    rows = []
    if peer is not None:
        p = r["peers"][peer]
        rows.append((f"plain, {fast_backend} (fastest plain)", p["tokens"], p["time_s"], p["tokens_per_s"]))
    same = " (fastest plain)" if peer is None else " (same backend)"
    rows.append((f"plain, {summary['backend']}{same}", r["ar"]["tokens"], r["ar"]["time_s"], r["ar"]["tokens_per_s"]))
    rows.append((f"speculative, {summary['configuration']}", r["spec"]["tokens"], r["spec"]["time_s"],
                 r["spec"]["tokens_per_s"]))
    for name, tokens, seconds, tps in rows:
        table.add_row(name, str(tokens), f"{seconds:.2f}", f"{tps:.1f}")
    console.print(table)
    from specdec.demo import final_lines

    for line in final_lines(r, fast_backend, summary["backend"], summary["speedup"], peer):
        console.print(line, markup=False, soft_wrap=True)


register_workbench(app)  # profile, report, verify-lossless, export

if __name__ == "__main__":
    main()

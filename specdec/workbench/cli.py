"""The workbench commands: ``profile``, ``report``, ``verify-lossless`` and ``export``.

``register(app)`` adds them to specdec's typer app. They share the main CLI's conventions: every
command has ``--json`` (one JSON object on stdout), long runs show rich progress bars on stderr,
and bad input prints ``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdec import cli_common as base
from specdec.json_input import json_object

SpecsOpt = Annotated[list[str] | None, typer.Option(
    "--speculative-config", help='vLLM-style JSON; repeat it to compare methods, e.g. \'{"method": "ngram"}\'.')]


@contextmanager
def progress_bars() -> Iterator:
    """``tick(description, total) -> advance()`` backed by rich progress bars on stderr."""
    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as prog:
        def tick(description: str, total: int):
            task = prog.add_task(description, total=total)
            return lambda: prog.advance(task)

        yield tick


def profile(
    model: base.ModelOpt,
    prompts: Annotated[str, typer.Option(
        "--prompts", help="JSONL file: {\"prompt\": ...} per line, or Spec-Bench's question.jsonl (with categories).")],
    speculative_config: SpecsOpt = None,
    draft: base.DraftOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per prompt.")] = 128,
    num_prompts: Annotated[int | None, typer.Option(help="Use only the first N prompts.")] = None,
    k_max: Annotated[int | None, typer.Option(
        "--k-max", help="Measure acceptance at draft positions 1..K (default: the configs' largest k).")] = None,
    temperature: Annotated[float, typer.Option(help="0 (greedy) also checks that outputs match.")] = 0.0,
    out: Annotated[str, typer.Option("--out", help="Folder for profile.json.")] = "specdec-profile",
    validate: Annotated[bool, typer.Option(
        "--validate/--no-validate", help="Run the recommended setting and measure its speedup.")] = True,
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="Also measure the recommended method at every k = 1..K (checks the whole S(k) curve).")] = False,
    dtype: base.DtypeOpt = "auto",
    device: base.DeviceOpt = "cpu",
    backend: base.BackendOpt = "auto",
    threads: Annotated[int | None, typer.Option(
        help="Torch threads (default: torch's); fewer than the cores keeps timings steadier on a shared "
             "machine.")] = None,
    as_json: base.JsonOpt = False,
) -> None:
    """Measure acceptance per position, c and v(k) per category for every drafter; predict S(k); recommend
    a drafter and k on all prompts and per category; check them."""
    with base.errors_exit_2():
        if threads is not None:
            if threads < 1:
                raise base.CliError(f"--threads must be >= 1, got {threads}")
            import torch

            torch.set_num_threads(threads)
        from specdec.prompts import load_prompts
        from specdec.workbench.profile import run_profile
        from specdec.workbench.report import summarize

        records = load_prompts(prompts, num_prompts)
        configs = [json_object(raw, "--speculative-config") for raw in (speculative_config or [])]
        if draft is not None:
            configs.append({"method": "draft_model", "model": draft})
        if not configs:
            raise base.CliError("profile needs a drafter: pass --speculative-config JSON (repeatable) or --draft D")
        if max_tokens < 1:
            raise base.CliError(f"--max-tokens must be >= 1, got {max_tokens}")
        folder = Path(out)
        if folder.exists() and not folder.is_dir():
            raise base.CliError(f"--out {out!r} exists and is not a folder")
        base.quiet_transformers()
        with progress_bars() as tick:
            result = run_profile(model, configs, records, max_tokens=max_tokens, k_max=k_max,
                                 temperature=temperature, dtype=dtype, device=device, backend=backend,
                                 validate=validate, sweep=sweep, progress=tick)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "profile.json").write_text(json.dumps(result, indent=1))
    summary = {**summarize(result), "profile": str(folder / "profile.json")}
    if as_json:
        base.print_json(summary)
        return
    _print_profile(result, str(folder / "profile.json"), Console(highlight=False))


def report(
    folder: Annotated[str, typer.Argument(help="The --out folder of `specdec profile` (holds profile.json).")],
    as_json: base.JsonOpt = False,
) -> None:
    """Write report.html (self-contained), PNG figures and report.md from a profile."""
    with base.errors_exit_2():
        from specdec.workbench.report import write_report

        result = write_report(folder)
    if as_json:
        base.print_json(result)
        return
    console = Console(highlight=False)
    for name, path in result["files"].items():
        console.print(f"wrote {path}", markup=False)


def verify_lossless(
    model: base.ModelOpt,
    speculative_config: base.SpecOpt = None,
    draft: base.DraftOpt = None,
    k: base.KOpt = None,
    samples: Annotated[int, typer.Option(help="Samples per prompt and sampling setting.")] = 2000,
    false_alarm: Annotated[float, typer.Option(
        help="Chance that a correct engine FAILs the whole run (split over the tests, Bonferroni).")] = 1e-3,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", help="Prompt text; repeat for several (default: two built-in prompts).")] = None,
    dtype: base.DtypeOpt = "auto",
    device: base.DeviceOpt = "cpu",
    backend: base.BackendOpt = "auto",
    as_json: base.JsonOpt = False,
) -> None:
    """Chi-square self-test: sampled output (temperature 1, top-k 8, top-p 0.8) vs the target's exact probabilities."""
    with base.errors_exit_2():
        from specdec import LLM
        from specdec.workbench.lossless import format_result, verify_lossless as run

        spec = base.build_speculative_config(draft, k, speculative_config)
        if spec is None:
            raise base.CliError("verify-lossless needs a drafter: pass --speculative-config JSON or --draft D")
        base.quiet_transformers()
        llm = LLM(model=model, dtype=dtype, device=device, speculative_config=spec, backend=backend)
        with progress_bars() as tick:
            result = run(llm, samples=samples, false_alarm=false_alarm, prompts=prompt, progress=tick)
    if as_json:
        base.print_json(result)
    else:
        console = Console(highlight=False)
        for line in format_result(result):
            console.print(line, markup=False, soft_wrap=True)
    if not result["passed"]:
        raise typer.Exit(1)


def export(
    engine: Annotated[str | None, typer.Option("--engine", help="vllm, sglang, trtllm or llamacpp.")] = None,
    profile_path: Annotated[str | None, typer.Option(
        "--profile", help="profile.json from `specdec profile`: export its recommendation (with a "
                          "--speculative-config that lists methods: rank them).")] = None,
    speculative_config: base.SpecOpt = None,
    by_category: Annotated[bool, typer.Option(
        "--by-category", help="With --profile: one setting per prompt category (these engines take one method "
                              "per deployment: one deployment per category).")] = False,
    out: Annotated[str | None, typer.Option(
        "--out", help="With --by-category: write one file per category into this folder; with --eagle3-head: "
                      "the folder for the head's files.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "--target", help="Target model (used in the launch command; with --eagle3-head its Hugging "
                                    "Face folder).")] = None,
    eagle3_head: Annotated[str | None, typer.Option(
        "--eagle3-head", help="Write this EAGLE-3 head's files for the engines (vLLM's speculators layout, "
                              "SGLang's SpecForge layout, a GGUF for llama-server) into --out.")] = None,
    head_format: Annotated[str, typer.Option(
        "--format", help="With --eagle3-head: vllm, sglang, gguf, both (vllm and gguf) or all.")] = "all",
    target_gguf: Annotated[str | None, typer.Option(
        "--target-gguf", help="With --eagle3-head: the target's GGUF that llama-server loads (the head's GGUF "
                              "copies its vocabulary; default: specdec's conversion of --model).")] = None,
    gguf_outtype: Annotated[str, typer.Option(
        "--gguf-outtype", help="With --eagle3-head: the head GGUF's weight type (f32, bf16, f16, q8_0).")] = "bf16",
    k: base.KOpt = None,
    as_json: base.JsonOpt = False,
) -> None:
    """Print the equivalent speculative-decoding settings for vLLM, SGLang, TensorRT-LLM or llama.cpp, or
    (--eagle3-head) write an EAGLE-3 head's files in each engine's layout with the commands that run them."""
    with base.errors_exit_2():
        from specdec.workbench.export import export_by_category, export_config, export_from_profile, load_profile_json

        files = None
        if eagle3_head is not None:
            result = _export_head(eagle3_head, model, out, head_format, target_gguf, gguf_outtype, k,
                                  engine or profile_path or speculative_config or by_category)
        elif engine is None:
            raise base.CliError("pass --engine vllm|sglang|trtllm|llamacpp (or --eagle3-head HEAD to write a head's "
                                "files)")
        elif profile_path is None and speculative_config is None:
            raise base.CliError("pass --profile profile.json or --speculative-config JSON")
        elif by_category and (profile_path is None or speculative_config is not None):
            raise base.CliError("--by-category exports a profile's per-category picks: pass --profile profile.json "
                                "and no --speculative-config")
        elif out is not None and not by_category:
            raise base.CliError("--out writes one file per category: use it with --by-category")
        elif by_category:
            result = export_by_category(engine, profile_path)
            if out is not None:
                files = result.write(out)
        elif speculative_config is None:
            result = export_from_profile(engine, profile_path)
        else:
            cfg = json_object(speculative_config, "--speculative-config")
            profile = None
            if profile_path is not None:
                if not isinstance(cfg.get("method"), list):
                    raise base.CliError("--profile with --speculative-config ranks the methods of a list "
                                        '(e.g. {"method": ["suffix", "ngram"]}); for one method pass only one '
                                        "of them")
                profile = load_profile_json(profile_path)
            result = export_config(engine, cfg, model or (profile or {}).get("model"), profile)
    if as_json:
        base.print_json({**result.as_dict(), **({"files": files} if files else {})})
    else:
        typer.echo(result.text, nl=False)
        for cat, path in (files or {}).items():
            typer.echo(f"# wrote {path} ({cat})")


HEAD_FORMATS = {"vllm": ("vllm",), "sglang": ("sglang",), "gguf": ("gguf",), "both": ("vllm", "gguf"),
                "all": ("vllm", "sglang", "gguf")}


def _export_head(head: str, target: str | None, out: str | None, fmt: str, target_gguf: str | None,
                 outtype: str, k: int | None, other):
    """``specdec export --eagle3-head``: the head's files for each engine."""
    from specdec.workbench.export_head import export_head

    if other:
        raise base.CliError("--eagle3-head writes a head's files; it takes no --engine, --profile, "
                            "--speculative-config or --by-category")
    if target is None or out is None:
        raise base.CliError("--eagle3-head needs --model TARGET (the Hugging Face folder the head was trained for) "
                            "and --out DIR")
    if fmt not in HEAD_FORMATS:
        raise base.CliError(f"--format must be one of {', '.join(HEAD_FORMATS)}, got {fmt!r}")
    base.quiet_transformers()
    return export_head(head, target, out, HEAD_FORMATS[fmt], k=4 if k is None else k, target_gguf=target_gguf,
                       gguf_outtype=outtype)


def register(app: typer.Typer) -> None:
    app.command()(profile)
    app.command()(report)
    app.command("verify-lossless")(verify_lossless)
    app.command()(export)


# -- helpers --------------------------------------------------------------------------------------


def _print_profile(p: dict, path: str, console: Console) -> None:
    from specdec.workbench.categories import ALL, drafter_rows

    console.print(f"{p['num_prompts']} prompts, max {p['max_tokens']} tokens, k measured up to {p['k_max']}; "
                  f"v(k) = " + " ".join(f"{x:.2f}" for x in p["verify_cost"]["v"])
                  + f" (1-token forward {p['verify_cost']['t1_s'] * 1e3:.2f} ms)", markup=False, soft_wrap=True)
    for c in p["configs"]:
        cost = (f"c(k) = " + " ".join(f"{x:.3f}" for x in c["draft_cost_per_round"][1:])
                + " (one draft forward per round ÷ target step, k = 1..K)"
                if c.get("draft_cost_shape") == "per_round" else
                f"c = {c['draft_cost_ratio']:.3f} (draft step ÷ target step)")
        console.print(f"{c.get('label', c['method'])}: {cost}; "
                      "predicted S(k), all prompts: " + ", ".join(
                          f"k={k}: {s:.2f}" for k, s in enumerate(c["overall"]["predicted_speedup"])),
                      markup=False, soft_wrap=True)
    by_cat = p.get("by_category", {})
    tables = [(cat, e["num_prompts"], e["drafters"], e["recommendation"], e.get("validation"))
              for cat, e in by_cat.items()]
    if len(by_cat) != 1:  # one category: its table is the all-prompts one
        tables.append((ALL, p["num_prompts"], drafter_rows(p["configs"], ALL), p["recommendation"], None))
    for cat, num_prompts, rows, rec, val in tables:
        console.print(_category_table(p, cat, num_prompts, rows, rec, val))
        for r in rows:
            console.print(f"  {r['label']}: α_1..α_{p['k_max']} (conditional acceptance) = "
                          + " ".join(f"{a:.2f}" for a in r["alpha_conditional"]), markup=False, soft_wrap=True)
    console.print(f"{base.TAU}", style="dim", markup=False)
    rec = p["recommendation"]
    console.print(f"recommendation: {rec['reason']} -> {json.dumps(rec['speculative_config'])}", markup=False,
                  soft_wrap=True)
    v = p.get("validation")
    if v:
        console.print(f"measured at k={v['k']}: {v['measured_speedup']:.2f}x ({v['spec_tokens_per_s']:.1f} vs "
                      f"{v['plain_tokens_per_s']:.1f} tokens/s, same process, alternating); predicted "
                      f"{v['predicted_speedup']:.2f}x, {v['predicted_speedup_end_to_end']:.2f}x end to end",
                      markup=False, soft_wrap=True)
    for row in p.get("sweep", []):
        console.print(f"  k={row['k']}: measured {row['measured_speedup']:.2f}x, predicted {row['predicted_speedup']:.2f}x "
                      f"({row['predicted_speedup_end_to_end']:.2f}x end to end)", markup=False, soft_wrap=True)
    if by_cat:
        console.print("per category (one deployment per category on engines that take one method): " + "; ".join(
            f"{cat}: {_pick(e['recommendation'])}" for cat, e in by_cat.items()), markup=False, soft_wrap=True)
    console.print(f"wrote {path}; `specdec report {Path(path).parent}` draws it; "
                  f"`specdec export --engine vllm --profile {path} --by-category` writes a setting per category",
                  markup=False, soft_wrap=True)


def _pick(rec: dict) -> str:
    return "plain decoding" if rec["plain"] else f"{rec['label']} k={rec['k']} ({rec['predicted_speedup']:.2f}x)"


def _category_table(p: dict, cat: str, num_prompts: int, rows: list[dict], rec: dict, val: dict | None) -> Table:
    """One category: a row per drafter (acceptance and τ at k = K, predicted and measured speedup at K,
    best k), the recommended one starred."""
    from specdec.workbench.categories import ALL

    K = p["k_max"]
    name = "all prompts" if cat == ALL else f"category {cat}"
    title = f"{name} ({num_prompts} prompt{'s' if num_prompts != 1 else ''}): recommended {_pick(rec)}"
    if val and val.get("measured_speedup") is not None:
        title += f", measured {val['measured_speedup']:.2f}x"
    table = Table(title=title, title_style="bold", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False,
                  caption=f"at k={K}: accept, τ, S pred(icted), S meas(ured); S(best k): predicted"
                          + ("; choice: per-request choice among a method list, measured only"
                             if any(r["choice"] for r in rows) else ""),
                  caption_justify="left")
    for col in ("drafter", "accept", "τ", "S pred", "S meas", "best k", "S(best k)"):
        table.add_column(col, justify="left" if col == "drafter" else "right", no_wrap=True)
    for r in rows:
        star = " ★" if r["config_index"] == rec["config_index"] and not rec["plain"] else ""
        pred = ("-", "-", "-") if r["choice"] else (  # a choice's cost per drafted token mixes its methods'
            f"{r['predicted_speedup_at_k_max']:.2f}x", str(r["best_k"]), f"{r['best_speedup']:.2f}x")
        table.add_row(r["label"] + star, f"{r['acceptance_rate']:.0%}", f"{r['mean_acceptance_length']:.2f}",
                      pred[0], f"{r['measured_speedup_at_k_max']:.2f}x", *pred[1:])
    return table

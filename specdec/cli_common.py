"""What every ``specdec`` command shares: option types and groups, the bad-input error and how it
exits, the speculative config built from flags, JSON output. Both ``cli.py`` and ``workbench/cli.py``
import it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer

from specdec.config import short_repr
from specdec.json_input import json_object

TAU = "τ (mean acceptance length: tokens per verify pass, incl. bonus)"

ModelOpt = Annotated[str, typer.Option(
    "--model", help="Target: a checkpoint folder, a hub id, a .gguf file or a folder holding one.")]
DraftOpt = Annotated[str | None, typer.Option(
    "--draft", "--speculative-model",
    help='Draft model, or with --method eagle3 the EAGLE-3 head (e.g. specdec/demo-eagle3); shorthand for '
         '--speculative-config \'{"method": "draft_model", "model": D}\'. --speculative-model is vLLM\'s name.')]
MethodOpt = Annotated[str | None, typer.Option(
    "--method", help="Speculative method: draft_model (the model from --draft), eagle3 (the head from --draft), "
                     "ngram, suffix or layer_skip; or several separated by commas (e.g. suffix,eagle3): each "
                     "request then drafts, round by round, with the one that pays most on its text.")]
SuffixInFrontOpt = Annotated[bool, typer.Option(
    "--enable-suffix-decoding", help="Suffix decoding in front of the model drafter (draft_model, eagle3 or "
                                     "layer_skip): a sequence takes the suffix draft when it expects enough of it "
                                     "accepted, else the model's.")]
AdaptiveOpt = Annotated[bool | None, typer.Option(
    "--adaptive/--no-adaptive", help="Choose one k per round for the batch from measured acceptance and costs (the "
                                     "default), or keep k fixed.")]
KOpt = Annotated[int | None, typer.Option(
    "-k", "--num-speculative-tokens", help="Draft tokens per round (default 4).")]
SpecOpt = Annotated[str | None, typer.Option(
    "--speculative-config", help='vLLM-style JSON, e.g. \'{"method": "draft_model", "model": "D", '
                                 '"num_speculative_tokens": 4}\'.')]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="float32, bfloat16, float16 or auto.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda[:N].")]
BackendOpt = Annotated[str, typer.Option(
    "--backend", help="auto (llama.cpp for GGUF files), torch or llama.cpp.")]
TokenizerOpt = Annotated[str | None, typer.Option(
    "--tokenizer", help="HF tokenizer folder for a GGUF model (default: the one in the GGUF).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
EnforceEagerOpt = Annotated[bool, typer.Option(
    "--enforce-eager", help="torch backend: run every forward eager instead of compiling the one-token step and "
                            "the verify pass at load (vLLM's name; SPECDEC_ENFORCE_EAGER=1 does the same).")]


@dataclasses.dataclass
class Drafting:
    """The drafter options of a command that speculates (an option group: ``option_groups``)."""

    draft: DraftOpt = None
    method: MethodOpt = None
    k: KOpt = None
    adaptive: AdaptiveOpt = None
    suffix_in_front: SuffixInFrontOpt = False
    speculative_config: SpecOpt = None

    def config(self) -> dict[str, Any] | None:
        """The speculative_config these options make (``build_speculative_config``); None: no drafter."""
        return build_speculative_config(self.draft, self.k, self.speculative_config, self.adaptive, self.method,
                                        self.suffix_in_front)


@dataclasses.dataclass
class Loading:
    """How a command loads its models (an option group: ``option_groups``)."""

    dtype: DtypeOpt = "auto"
    device: DeviceOpt = "cpu"
    backend: BackendOpt = "auto"
    tokenizer: TokenizerOpt = None
    enforce_eager: EnforceEagerOpt = False

    def llm_kwargs(self) -> dict[str, Any]:
        """``LLM``'s keyword arguments (enforce_eager None without the flag: SPECDEC_ENFORCE_EAGER decides)."""
        return {"dtype": self.dtype, "device": self.device, "backend": self.backend, "tokenizer": self.tokenizer,
                "enforce_eager": self.enforce_eager or None}


def option_groups(command: Callable) -> Callable:
    """Let a typer command take a group of options as one argument: a parameter annotated with an
    option group (``drafting: Drafting``) stands for the group's fields, each an option of the
    command in that place, and the command receives them as one object."""
    hints = typing.get_type_hints(command, include_extras=True)
    groups = {name: hint for name, hint in hints.items() if hint in (Drafting, Loading)}
    keyword = inspect.Parameter.KEYWORD_ONLY  # typer passes every option by name
    params = []
    for p in inspect.signature(command).parameters.values():
        group = groups.get(p.name)
        if group is None:
            params.append(p.replace(kind=keyword, annotation=hints[p.name]))
            continue
        options = typing.get_type_hints(group, include_extras=True)
        params += [inspect.Parameter(f.name, keyword, annotation=options[f.name], default=f.default)
                   for f in dataclasses.fields(group)]

    @functools.wraps(command)
    def run(**kwargs):
        for name, group in groups.items():
            kwargs[name] = group(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(group)})
        return command(**kwargs)

    run.__signature__ = inspect.Signature(params)  # what typer reads the options from
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


class CliError(Exception):
    """Bad command-line input found by the CLI itself (the library raises ValueError)."""


@contextmanager
def errors_exit_2() -> Iterator[None]:
    """Turn a ValueError (the library's bad-input error) or CliError into ``error: ...``, exit status 2."""
    try:
        yield
    except (ValueError, CliError) as e:
        fail(str(e))


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


# the methods that read speculative_config's "model", and what it is for each
MODEL_METHODS = {"draft_model": "the draft model: pass --draft D",
                 "eagle3": "the EAGLE-3 head: pass --draft HEAD (or --speculative-model HEAD), e.g. "
                           "--method eagle3 --draft specdec/demo-eagle3"}


def build_speculative_config(draft: str | None, k: int | None, raw: str | None,
                             adaptive: bool | None = None, method: str | None = None,
                             suffix_in_front: bool = False) -> dict[str, Any] | None:
    """The speculative_config dict from --draft / -k / --speculative-config / --[no-]adaptive / --method /
    --enable-suffix-decoding (validated by the library; the CLI adds what a flag-level mistake needs)."""
    cfg = _speculative_config_base(draft, k, raw)
    if method is not None:
        methods = parse_methods(method)
        if cfg is None:
            cfg = {"method": methods, "num_speculative_tokens": 4 if k is None else k}
        elif raw is not None and cfg.get("method", methods) != methods:
            raise CliError(f"--method {method} disagrees with method {short_repr(cfg['method'])} in "
                           "--speculative-config; pass one of them")
        else:
            cfg["method"] = methods
    if cfg is None and k is not None:
        raise CliError("-k/--num-speculative-tokens needs a drafter: pass --draft D, --method M or "
                       "--speculative-config")
    if adaptive is not None:
        if cfg is None:
            raise CliError("--adaptive/--no-adaptive needs a drafter: pass --draft D, --method M or "
                           "--speculative-config")
        cfg["adaptive"] = adaptive
    if suffix_in_front:
        if cfg is None:
            raise CliError("--enable-suffix-decoding puts suffix decoding in front of a model drafter: pass "
                           "--draft D (or --method eagle3 --draft HEAD) too; for suffix decoding alone use "
                           "--method suffix")
        cfg["enable_suffix_decoding"] = True
    if cfg is not None and not cfg.get("model") and cfg.get("num_speculative_tokens", 4) != 0:
        listed = cfg.get("method", "draft_model")
        for m in [listed] if isinstance(listed, str) else listed if isinstance(listed, list) else []:
            if isinstance(m, str) and m in MODEL_METHODS:
                raise CliError(f"method {m} needs {MODEL_METHODS[m]}")
    return cfg


def parse_methods(value: str) -> str | list[str]:
    """--method's value: one method name, or several separated by commas (a list: chosen per request)."""
    names = [m.strip() for m in value.split(",")]
    if not all(names):
        raise CliError(f"--method {value!r} has an empty name; separate method names with single commas, "
                       "e.g. suffix,draft_model,ngram")
    return names[0] if len(names) == 1 else names


def _speculative_config_base(draft: str | None, k: int | None, raw: str | None) -> dict[str, Any] | None:
    if draft is not None and raw is not None:
        raise CliError("pass either --draft or --speculative-config, not both")
    if raw is not None:
        cfg = json_object(raw, "--speculative-config")
        if k is not None:
            if cfg.get("num_speculative_tokens", k) != k:
                raise CliError(f"-k {k} disagrees with num_speculative_tokens "
                               f"{cfg['num_speculative_tokens']} in --speculative-config; pass one of them")
            cfg["num_speculative_tokens"] = k
        return cfg
    if draft is not None:
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4 if k is None else k}
    return None


def quiet_transformers() -> None:
    """No weight-loading progress bars: stdout stays the result, stderr the summary."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # an older or newer transformers without it: bars are only cosmetic
        pass


def print_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

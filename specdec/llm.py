"""The public entry point, shaped like vLLM's ``LLM`` so code moves between the two."""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from typing import Any

import torch

from specdec.config import PLAIN_STEPS, ModelConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from specdec.detokenizer import TextStreamer
from specdec.drafters import build_drafter
from specdec.drafters.vocab_map import same_vocabulary
from specdec.engine import Engine
from specdec.logprobs import check_logprobs_mode
from specdec.metrics import RequestSpecStats, SpecDecodingStats
from specdec.models.choose import choose, choose_draft
from specdec.models.load import load
from specdec.models.resolve import resolve
from specdec.outputs import CompletionOutput, RequestOutput, StreamDelta
from specdec.sequence import Sequence

Prompt = str | dict | list[int]


class LLM:
    """A target model, optionally with a drafter, that generates text.

    >>> llm = LLM(model="specdec/demo-target",
    ...           speculative_config={"method": "draft_model", "model": "specdec/demo-draft",
    ...                               "num_speculative_tokens": 4})
    >>> out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))

    ``logprobs_mode``: what ``SamplingParams(logprobs=N)`` reports (vLLM's names): "raw_logprobs"
    (default) the model's own log_softmax, "processed_logprobs" the distribution each token was
    sampled from, after penalties, grammar, temperature and top-k / top-p / min-p (logprobs.py).
    ``num_scheduler_steps`` (vLLM's name): greedy rounds that draft nothing take up to this many
    plain steps in one runner call (1: one step a round); tokens past a stop are dropped.
    ``enforce_eager`` (vLLM's name): on the torch backend, True runs eager; False compiles the
    one-token step and the verify pass at load (models/compiled.py, cached on disk); None (default):
    compile unless the environment sets SPECDEC_ENFORCE_EAGER=1.
    """

    def __init__(self, model: str, dtype: str = "auto", device: str = "cpu",
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 256, trust_remote_code: bool = False,
                 backend: str = "auto", tokenizer: str | None = None, logprobs_mode: str = "raw_logprobs",
                 num_scheduler_steps: int = PLAIN_STEPS, enforce_eager: bool | None = None):
        self.model_config = ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                                        trust_remote_code=trust_remote_code, backend=backend, tokenizer=tokenizer,
                                        enforce_eager=enforce_eager)
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        # no token or KV bound: generate() takes every prompt in turn (a server sets its own)
        scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, num_scheduler_steps=num_scheduler_steps)
        _check_device(device)  # all of it before the models load
        check_logprobs_mode(logprobs_mode)
        spec = self.speculative_config
        methods, k = (spec.methods, spec.num_speculative_tokens) if spec else ([], 0)
        # the models, in three steps (specdec/models/): resolve the names to files, choose each model's
        # backend and dtype ("torch" or "llama.cpp", and why: auto times both on CPU), load the runners
        target_source = resolve(model)
        draft_source = resolve(spec.model) if k > 0 and "draft_model" in methods else None
        # layer_skip among the methods needs a backend that runs the first layers alone
        method = "layer_skip" if "layer_skip" in methods else (methods[0] if methods else None)
        target_choice = choose(target_source, backend, dtype, device, method, k, draft=draft_source,
                               enforce_eager=enforce_eager)
        draft_choice = (choose_draft(draft_source, target_choice, dtype, device, spec.parallel_drafting)
                        if draft_source else None)
        self.backend, self.backend_reason = target_choice.backend, target_choice.reason
        self.target, eos = load(target_source, target_choice.backend, target_choice.dtype, device, max_model_len,
                                trust_remote_code, tokenizer=tokenizer, enforce_eager=enforce_eager,
                                longest_feed=spec.longest_verify if spec else None)
        draft = None
        if draft_source:  # its own vocabulary; with the target's tokenizer, the target's rows (padding cut)
            draft, _ = load(draft_source, draft_choice.backend, draft_choice.dtype, device, enforce_eager=True)
            if same_vocabulary(self.target.tokenizer, draft.tokenizer) and draft.vocab_size > self.target.vocab_size:
                draft, _ = load(draft_source, draft_choice.backend, draft_choice.dtype, device,
                                vocab_size=self.target.vocab_size, enforce_eager=enforce_eager)
            elif enforce_eager is not True and draft.backend == "torch":  # loaded eager to read its vocabulary
                draft, _ = load(draft_source, draft_choice.backend, draft_choice.dtype, device,
                                enforce_eager=enforce_eager)
        if k > 0 and "eagle3" in methods:  # a head over the target's own states, not a causal LM: no load()
            draft = _load_eagle3_head(spec.model, self.target)
        self.tokenizer = self.target.tokenizer
        drafter = build_drafter(spec, self.target, draft) if k > 0 else None
        self.engine = Engine(self.target, drafter, k, tokenizer=self.tokenizer, eos_token_ids=eos,
                             scheduler_config=scheduler_config, adaptive=spec is not None and spec.adaptive,
                             logprobs_mode=logprobs_mode,
                             **(dict(draft_tree=spec.draft_tree, draft_tree_max_nodes=spec.draft_tree_max_nodes,
                                     draft_tree_top_k=spec.draft_tree_top_k) if spec is not None else {}))

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt in one batch. ``sampling_params``: one for all, or one per prompt.
        Each RequestOutput holds ``n`` CompletionOutputs (index 0..n-1)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty; pass a string, a {'prompt_token_ids': [...]} dict, or a list of them")
        params = self._params_per_prompt(prompts, sampling_params)
        token_ids = [self.tokenize(p) for p in prompts]
        choices = [self.engine.add_choices(ids, sp) for ids, sp in zip(token_ids, params)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self._output(p, seqs) for p, seqs in zip(prompts, choices)]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding the tokens and text each round adds (``StreamDelta.index``
        says which of the ``n`` choices, with their logprobs when asked)."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        seqs = self.engine.add_choices(self.tokenize(prompt), params)
        streamers = {s.seq_id: (i, TextStreamer(self.engine.detokenizer, s)) for i, s in enumerate(seqs)}
        try:
            while not all(s.finished for s in seqs):
                for s, tokens in self.engine.step():
                    if s.seq_id in streamers and (tokens or s.finished):
                        i, streamer = streamers[s.seq_id]
                        delta = streamer.delta(tokens)
                        delta.index = i
                        if s.finished:
                            delta.metrics = s.stats.as_dict()
                        yield delta
        finally:
            if not all(s.finished for s in seqs):
                for s in seqs:
                    self.engine.abort(s)
                self.engine.step()  # let them leave the batch

    # -- metrics ----------------------------------------------------------------------------------

    def get_metrics(self) -> dict:
        """vLLM-named speculative counters plus timings: acceptance_rate, mean_acceptance_length (tau,
        tokens per verify pass including the recovered/bonus token), draft_time_s, verify_time_s."""
        return self.engine.stats.as_dict()

    def reset_metrics(self) -> None:
        self.engine.stats = SpecDecodingStats()

    def get_tokenizer(self):
        return self.tokenizer

    # -- helpers ----------------------------------------------------------------------------------

    def _params_per_prompt(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be SamplingParams objects")
        return params

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt (text, token ids, or a dict with 'prompt' or 'prompt_token_ids') as the target's token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer; pass {'prompt_token_ids': [...]} instead of text")
        return self.tokenizer.encode(prompt)

    def _output(self, prompt: Prompt, seqs: list[Sequence]) -> RequestOutput:
        text_prompt = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
        outs = [CompletionOutput(index=i, text=self.engine.detokenizer.output_text(s), token_ids=s.output_token_ids,
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                 cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs)
                for i, s in enumerate(seqs)]
        first = seqs[0]
        total = RequestSpecStats()  # the choices' counters summed; their times too (each choice's rounds)
        for s in seqs:
            total.merge(s.stats)
        metrics = {"spec_decoding": total.as_dict(), "spec_decoding_per_choice": [s.stats.as_dict() for s in seqs]}
        return RequestOutput(request_id=str(first.seq_id), prompt=text_prompt, prompt_token_ids=first.prompt_token_ids,
                             outputs=outs, finished=all(s.finished for s in seqs), metrics=metrics,
                             prompt_logprobs=first.prompt_logprobs)


def _load_eagle3_head(name: str, target):
    """The EAGLE-3 head ``name`` (a folder or hub id) for ``target``: its files are checked against the
    target (hidden size, vocabulary, layers), its embedding is the target's. The target must keep
    hidden states (the torch backend does); else the ValueError says which backend can."""
    import os

    from specdec.models.eagle3 import load_head
    from specdec.models.resolve import resolve_model_path

    if not target.can_keep_hidden_states:
        target.keep_hidden_states([0])  # raises the backend's ValueError, naming the one that can
    embedding = target.token_embedding()  # [V_rows, D]
    # a folder goes straight to load_head, whose errors name the head's missing file
    path = name if os.path.isdir(os.path.expanduser(name)) else resolve_model_path(name)
    return load_head(os.path.expanduser(path), embedding, target.num_layers, embedding.shape[0],
                     device=target.device)


def _check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")


"""Validated configuration: sampling parameters, the speculative, model and scheduler configs.

Each dataclass checks its own fields on construction and raises ``ValueError``
with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 64
SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS): logits / T overflow float32
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: smaller top_p / min_p round to 0 on the way in
FLOAT32_MAX = 3.4028234663852886e38
MAX_TOP_K = 2**31 - 1  # any top_k >= the vocabulary keeps every token; larger values overflow int64 tensors
MAX_STOP_STRINGS = 64  # each is searched in the output's tail after every token
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 64  # choices per request
MAX_LOGPROBS = 20  # top logprobs per position (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 1024  # entries in logit_bias (OpenAI allows 300)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value; larger ones are clipped to it
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 2**20
MAX_GRAMMAR_CHARS = 100_000  # a JSON schema, regex or EBNF grammar, serialized
MAX_CHOICES = 256  # strings in a structured_outputs choice list


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``): set exactly one of
    ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings) or ``grammar`` (EBNF / Lark)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        kinds = self._kinds()
        _check(len(kinds) == 1, "structured_outputs needs exactly one of json, json_object, regex, choice, "
               f"grammar; got {kinds or 'none'}")
        _check(self.json is None or isinstance(self.json, (str, dict)),
               f"structured_outputs json must be a JSON schema (a dict or its text), got {type(self.json).__name__}")
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs regex must be a string")
        _check(self.grammar is None or isinstance(self.grammar, str), "structured_outputs grammar must be a string")
        _check(self.json_object is None or isinstance(self.json_object, bool),
               "structured_outputs json_object must be true or false")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
                   and all(isinstance(c, str) and c for c in self.choice),
                   f"structured_outputs choice must be a list of 1..{MAX_CHOICES} non-empty strings, "
                   f"got {short_repr(self.choice)}")
            self.choice = list(self.choice)
        size = len(self.spec_text)
        _check(size <= MAX_GRAMMAR_CHARS, f"structured_outputs {self.kind} is {size} characters; "
               f"at most {MAX_GRAMMAR_CHARS} are allowed")

    def _kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return self._kinds()[0]

    @property
    def spec_text(self) -> str:
        """The constraint as one string (a cache key for compiled grammars). A schema keeps its key order:
        JSON grammars emit properties in that order, so two orders are two constraints."""
        import json as _json
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else _json.dumps(value)


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as vLLM names them.

    ``temperature == 0`` means greedy decoding; top-k / top-p / min-p then have no effect. Values are
    made safe for float32 sampling on construction without changing what they mean: a temperature
    below ``SAMPLING_EPS`` is greedy (as in vLLM), a ``top_p`` below float32's reach keeps the top
    token only, a ``min_p`` below it disables min-p. The stop lists are bounded (``MAX_STOP_*``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) disables top-k
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    n: int = 1  # choices per prompt, each its own sequence; with a seed, choice i uses seed + i
    # penalties and biases (vLLM's order: grammar, allowed/bad words, min_tokens, logit_bias, penalties)
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF's: a token seen in prompt or output has its logit divided (> 0) or multiplied (< 0)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clipped to +-100
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings unchecked) until this many
    bad_words: list[str] | None = None  # words never generated (each tokenized with and without a leading space)
    allowed_token_ids: list[int] | None = None  # only these may be generated
    structured_outputs: StructuredOutputsParams | None = None
    # logprobs of the target's distribution at each emitted position: the chosen token plus the top N
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)),
               f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_finite(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX,
               f"temperature must be a number >= 0 and finite in float32 (0 means greedy), "
               f"got {short_repr(self.temperature)}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {short_repr(self.top_p)}; use 1.0 to disable nucleus sampling")
        _check(_is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
               f"top_k must be an integer >= 0 and at most {MAX_TOP_K} (0 or -1 disables it; any value at least "
               f"the vocabulary size keeps every token), got {short_repr(self.top_k)}")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {short_repr(self.min_p)}; use 0 to disable it")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {short_repr(self.max_tokens)}")
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
               f"seed must be an integer in [-2**63, 2**64) or None, got {short_repr(self.seed)}")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
               f"stop must be a non-empty string or a list of non-empty strings of at most "
               f"{MAX_STOP_STRING_CHARS} characters each, got {short_repr(self.stop)}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        _check(all(_is_int(t) and 0 <= t <= MAX_TOP_K for t in self.stop_token_ids),
               f"stop_token_ids must be integers in 0..{MAX_TOP_K}, got {short_repr(self.stop_token_ids)}")
        self._check_processing()
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if self.top_p < FLOAT32_TINY:
            self.top_p = FLOAT32_TINY
        if self.min_p < FLOAT32_TINY:
            self.min_p = 0.0

    def _check_processing(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in 1..{MAX_N}, got {short_repr(self.n)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_finite(v) and -2 <= v <= 2, f"{name} must be in [-2, 2] (0 disables it), got {short_repr(v)}")
        _check(_is_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
               f"repetition_penalty must be in (0, 100] (1 disables it), got {short_repr(self.repetition_penalty)}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS,
                   f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries, "
                   f"got {short_repr(self.logit_bias)}")
            bias = {}
            for t, v in self.logit_bias.items():
                t = int(t) if isinstance(t, str) and t.strip().isdigit() else t
                _check(_is_int(t) and 0 <= t <= MAX_TOP_K and _is_finite(v),
                       f"logit_bias maps token ids (integers >= 0) to finite numbers, got {short_repr(self.logit_bias)}")
                bias[t] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
            self.logit_bias = bias
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {short_repr(self.min_tokens)}")
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)) and len(self.bad_words) <= MAX_BAD_WORDS
                   and all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_STRING_CHARS for w in self.bad_words),
                   f"bad_words must be a list of at most {MAX_BAD_WORDS} non-empty strings of at most "
                   f"{MAX_STOP_STRING_CHARS} characters, got {short_repr(self.bad_words)}")
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple))
                   and 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                   and all(_is_int(t) and 0 <= t <= MAX_TOP_K for t in self.allowed_token_ids),
                   f"allowed_token_ids must be a non-empty list of token ids, got {short_repr(self.allowed_token_ids)}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                   f"{name} must be None or an integer in 0..{MAX_LOGPROBS} (top tokens per position besides "
                   f"the chosen one), got {short_repr(v)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits pass through penalties, biases, masks or a grammar (processing.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)


SPECULATIVE_METHODS = ("draft_model", "ngram", "suffix", "layer_skip", "eagle3")
DRAFT_TOKENIZER_MAPPINGS = ("auto", "string", "intersection")
SUFFIX_PROBABILITY_ESTIMATES = ("continuations", "occurrences")
BACKENDS = ("llama.cpp", "torch")  # the runners' names (ModelRunner.backend): models/llamacpp.py, models/llama.py
DRAFT_TREE_MODES = ("auto", "chain", "tree")
DRAFT_QUANTIZATIONS = (None, "int4", "int8", "none")
MAX_TREE_NODES = 64


@dataclass
class SpeculativeConfig:
    """What drafts and how many tokens it proposes per round (vLLM's ``speculative_config``).

    Option names follow vLLM where vLLM has the option; each method reads only its own fields.
    ``method`` may list several methods (e.g. ``["suffix", "draft_model", "ngram"]``): the engine then
    picks, per request and round, the one whose measured acceptance and cost pay most (drafters/choice.py).
    """

    method: str | list[str] = "draft_model"
    num_speculative_tokens: int = 4  # the most drafts per round (the adaptive controller may use fewer)
    adaptive: bool = True  # choose one k per round for the batch from measured acceptance and costs; False: fixed
    # draft_model: the draft model; eagle3: the EAGLE-3 head (models/eagle3.py)
    model: str | None = None
    # a draft whose tokenizer differs from the target's (drafters/other_vocab.py): "string" maps its
    # draft text to the target's tokens, "intersection" drafts over the tokens both vocabularies share,
    # "auto" measures both on the first rounds and keeps the better
    draft_tokenizer_mapping: str = "auto"
    draft_p_min: float = 0.0  # model drafters stop drafting when their top probability falls below this
    # draft_model: a parallel draft (PARD, vLLM's name): the draft sees the history plus k - 1 mask tokens
    # and proposes all k drafts from one forward (drafters/pard.py); its config.json names the mask token
    parallel_drafting: bool = False
    # eagle3: the head's products quantized at load (as vLLM's ``quantization``). None: in int4 (groups of 64) where
    # specdec's kernels run (x86 with AVX2; VNNI where the CPU has it: models/linear8.py), else in the target's dtype;
    # "int4" / "int8": so, or an error saying why not; "none": never (the drafts change, never the output's distribution)
    quantization: str | None = None
    # ngram (prompt lookup)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2  # single-token matches were right a third as often as 2-gram ones
    # suffix decoding
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000  # outputs kept, running ones included (as vLLM; its default: 10000)
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # a continuation's probability: its count over the node's continuations ("continuations"), or over all
    # the node's occurrences, those that end there included ("occurrences": Arctic's, so vLLM's); neither
    # wins on every workload (benchmarks/suffix_replay.py)
    suffix_decoding_probability: str = "continuations"
    # layer_skip (self-speculation with the target's first layers)
    num_draft_layers: int | None = None  # None: a quarter of the target's layers
    # draft_model / layer_skip with suffix decoding in front (Arctic Inference's hybrid): a sequence
    # takes the suffix tries' draft when it expects at least suffix_decoding_min_score accepted
    # tokens, else the model's; a round in which no sequence needs the model skips it
    enable_suffix_decoding: bool = False
    suffix_decoding_min_score: float = 2.0
    # draft trees (tree.py): several candidate continuations verified in one pass. "auto": trees where
    # the drafter can branch and the backend verifies trees, sized by the controller from the measured
    # verify cost per node count (chains where trees lose); "chain": never; "tree": always (a backend
    # that cannot verify trees is an error). Depth: num_speculative_tokens.
    draft_tree: str = "auto"
    # nodes per tree at most (SGLang's speculative_num_draft_tokens - 1); 7: a tree pass of 8 tokens
    draft_tree_max_nodes: int = 7
    draft_tree_top_k: int = 4  # children per node at most (SGLang's speculative_eagle_topk)

    @property
    def longest_verify(self) -> int:
        """The most tokens a verify pass feeds a row: the newest token and k drafts, or a tree's nodes
        (the torch target compiles its step up to this size: models/compiled.py, sizes_for)."""
        return 1 + max(self.num_speculative_tokens, self.draft_tree_max_nodes if self.draft_tree != "chain" else 0)

    def __post_init__(self) -> None:
        if isinstance(self.method, (list, tuple)):
            _check(len(self.method) >= 1 and all(isinstance(m, str) for m in self.method),
                   f"speculative_config method must be a method name or a non-empty list of them, "
                   f"got {short_repr(self.method)}")
            _check(len(set(self.method)) == len(self.method),
                   f"speculative_config method lists {short_repr(self.method)}: name each method once")
            self.method = self.method[0] if len(self.method) == 1 else list(self.method)
        for m in self.methods:
            _check(m in SPECULATIVE_METHODS,
                   f"speculative_config method {m!r} is not supported; choose one of {SPECULATIVE_METHODS} "
                   "(or a list of them)")
        _check(_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               f"num_speculative_tokens must be an integer in 0..{MAX_SPECULATIVE_TOKENS}, "
               f"got {self.num_speculative_tokens!r}")
        _check(isinstance(self.adaptive, bool), f"adaptive must be true or false, got {self.adaptive!r}")
        _check(_is_number(self.draft_p_min) and 0 <= self.draft_p_min < 1,
               f"draft_p_min must be in [0, 1), got {self.draft_p_min!r}")
        for m, what in (("draft_model", "the draft"), ("eagle3", "the EAGLE-3 head")):
            if m in self.methods and self.num_speculative_tokens > 0:
                _check(isinstance(self.model, str) and self.model,
                       f"speculative_config with method {m!r} needs 'model': a folder or hub id of {what}")
        _check(isinstance(self.parallel_drafting, bool),
               f"parallel_drafting must be true or false, got {short_repr(self.parallel_drafting)}")
        _check(not self.parallel_drafting or "draft_model" in self.methods,
               "parallel_drafting runs a draft model trained with mask tokens (PARD): it needs method "
               f"'draft_model' (got method {short_repr(self.method)})")
        _check(self.quantization in DRAFT_QUANTIZATIONS,
               f"speculative_config quantization must be one of {DRAFT_QUANTIZATIONS}, got {short_repr(self.quantization)}")
        _check(self.quantization is None or "eagle3" in self.methods,
               f"speculative_config quantization {self.quantization!r} applies to an EAGLE-3 head's products: it needs "
               f"method 'eagle3' (got method {short_repr(self.method)})")
        _check(not ("draft_model" in self.methods and "eagle3" in self.methods),
               "speculative_config: methods draft_model and eagle3 both read 'model'; list one of them")
        _check(_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
               and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min!r} "
               f"and {self.prompt_lookup_max!r}")
        _check(_is_int(self.suffix_decoding_max_tree_depth) and self.suffix_decoding_max_tree_depth >= 1,
               f"suffix_decoding_max_tree_depth must be an integer >= 1, got {self.suffix_decoding_max_tree_depth!r}")
        _check(_is_int(self.suffix_decoding_max_cached_requests) and self.suffix_decoding_max_cached_requests >= 0,
               "suffix_decoding_max_cached_requests must be an integer >= 0, "
               f"got {self.suffix_decoding_max_cached_requests!r}")
        _check(_is_number(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0,
               f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor!r}")
        _check(_is_number(self.suffix_decoding_min_token_prob) and 0 <= self.suffix_decoding_min_token_prob <= 1,
               f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob!r}")
        _check(self.suffix_decoding_probability in SUFFIX_PROBABILITY_ESTIMATES,
               f"suffix_decoding_probability must be one of {SUFFIX_PROBABILITY_ESTIMATES}, "
               f"got {short_repr(self.suffix_decoding_probability)}")
        _check(isinstance(self.enable_suffix_decoding, bool),
               f"enable_suffix_decoding must be true or false, got {self.enable_suffix_decoding!r}")
        _check(not (self.enable_suffix_decoding and len(self.methods) > 1),
               "enable_suffix_decoding with a list of methods: list 'suffix' among the methods instead "
               f"(got method {short_repr(self.method)})")
        _check(not self.enable_suffix_decoding or self.method in ("draft_model", "layer_skip", "eagle3"),
               f"enable_suffix_decoding puts suffix decoding in front of a model drafter (draft_model, "
               f"layer_skip or eagle3); for suffix decoding alone use method 'suffix' (got method {self.method!r})")
        _check(_is_number(self.suffix_decoding_min_score) and self.suffix_decoding_min_score >= 0,
               f"suffix_decoding_min_score must be a number >= 0, got {self.suffix_decoding_min_score!r}")
        _check(self.draft_tree in DRAFT_TREE_MODES,
               f"draft_tree must be one of {DRAFT_TREE_MODES}, got {short_repr(self.draft_tree)}")
        _check(_is_int(self.draft_tree_max_nodes) and 1 <= self.draft_tree_max_nodes <= MAX_TREE_NODES,
               f"draft_tree_max_nodes must be an integer in 1..{MAX_TREE_NODES}, got {self.draft_tree_max_nodes!r}")
        _check(_is_int(self.draft_tree_top_k) and self.draft_tree_top_k >= 1,
               f"draft_tree_top_k must be an integer >= 1, got {self.draft_tree_top_k!r}")
        # a tree of N nodes is N levels deep at most, and a chain-drafting member drafts k levels
        _check(self.draft_tree != "tree" or self.num_speculative_tokens <= self.draft_tree_max_nodes,
               f"draft_tree='tree' verifies trees of at most draft_tree_max_nodes={self.draft_tree_max_nodes} "
               f"nodes, so at most {self.draft_tree_max_nodes} levels, but num_speculative_tokens="
               f"{self.num_speculative_tokens} asks for that many; raise draft_tree_max_nodes to "
               f"{self.num_speculative_tokens} or lower num_speculative_tokens (draft_tree='auto' caps its trees' depth)")
        _check(self.draft_tokenizer_mapping in DRAFT_TOKENIZER_MAPPINGS,
               f"draft_tokenizer_mapping must be one of {DRAFT_TOKENIZER_MAPPINGS}, "
               f"got {short_repr(self.draft_tokenizer_mapping)}")
        _check(self.num_draft_layers is None or (_is_int(self.num_draft_layers) and self.num_draft_layers >= 1),
               f"num_draft_layers must be an integer >= 1, got {self.num_draft_layers!r}")

    @property
    def methods(self) -> list[str]:
        """The configured methods as a list (one, or several to choose from per request)."""
        return list(self.method) if isinstance(self.method, list) else [self.method]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Build from a vLLM-style dict; ``None`` or ``num_speculative_tokens == 0`` means no speculation."""
        if cfg is None or isinstance(cfg, SpeculativeConfig):
            return cfg
        _check(isinstance(cfg, dict), f"speculative_config must be a dict, got {type(cfg).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known)
        _check(not unknown, f"unknown speculative_config keys {unknown}; known keys are {sorted(known)}")
        if "method" not in cfg and "model" in cfg:
            cfg = {**cfg, "method": "draft_model"}
        return cls(**cfg)


@dataclass
class ModelConfig:
    """How to load a checkpoint."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    trust_remote_code: bool = False
    backend: str = "auto"  # "torch", "llama.cpp", or auto: llama.cpp for GGUF files and convertible checkpoints on CPU
    tokenizer: str | None = None  # an HF tokenizer folder for a GGUF model (default: the GGUF's own)
    # vLLM's name. torch backend: True runs every forward eager; False compiles the few-token step at load
    # (models/compiled.py); None: compile unless SPECDEC_ENFORCE_EAGER=1. llama.cpp ignores it.
    enforce_eager: bool | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model,
               "model must be a local folder or a Hugging Face hub id, e.g. model='path/to/checkpoint'")
        _check(self.dtype in ("float32", "bfloat16", "float16", "auto"),
               f"dtype must be one of float32, bfloat16, float16, auto; got {self.dtype!r}")
        _check(self.backend in ("auto", *BACKENDS),
               f"backend must be 'auto', 'torch' or 'llama.cpp', got {self.backend!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        _check(self.enforce_eager is None or isinstance(self.enforce_eager, bool),
               f"enforce_eager must be True, False or None (compile unless SPECDEC_ENFORCE_EAGER=1), "
               f"got {short_repr(self.enforce_eager)}")


PLAIN_STEPS = 4  # greedy plain rounds take up to this many steps in one runner call (Engine's plain round)


@dataclass
class SchedulerConfig:
    """How the scheduler admits and batches requests (vLLM's ``SchedulerConfig`` names), built once
    by ``LLM`` and read by the scheduler alone. ``None`` bounds nothing: ``LLM.generate`` takes every
    prompt in turn; a server sets its token and KV bounds (``Engine.limit_admission``)."""

    max_num_seqs: int = 256  # sequences decoded at once; the rest wait
    # greedy rounds that draft nothing take up to this many plain steps in one runner call (1: one a round)
    num_scheduler_steps: int = PLAIN_STEPS
    max_num_batched_tokens: int | None = None  # prompt tokens admitted into one round (one prompt always fits)
    kv_cache_memory: int | None = None  # bytes of KV cache (target and drafter) admission never over-commits

    def __post_init__(self) -> None:
        _check(_is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
               f"max_num_seqs must be an integer >= 1, got {short_repr(self.max_num_seqs)}; "
               "it is how many sequences decode at once (e.g. max_num_seqs=8)")
        _check(_is_int(self.num_scheduler_steps) and self.num_scheduler_steps >= 1,
               f"num_scheduler_steps must be an integer >= 1, got {short_repr(self.num_scheduler_steps)}; "
               f"1 takes one plain step a round, the default {PLAIN_STEPS} up to that many in one call")
        _check(self.max_num_batched_tokens is None
               or (_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1),
               f"max_num_batched_tokens must be an integer >= 1 or None (no bound), "
               f"got {short_repr(self.max_num_batched_tokens)}")
        _check(self.kv_cache_memory is None or (_is_int(self.kv_cache_memory) and self.kv_cache_memory >= 0),
               f"kv_cache_memory must be a number of bytes >= 0 or None (no bound), "
               f"got {short_repr(self.kv_cache_memory)}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _is_finite(x: Any) -> bool:
    return _is_number(x) and (isinstance(x, int) or math.isfinite(x))  # rejects NaN and +-inf


def short_repr(x: Any, limit: int = 80) -> str:
    """``repr(x)`` cut to ``limit`` characters: an error message never echoes a long input back."""
    r = repr(x)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

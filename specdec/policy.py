"""The speculation policy in one place: the rules and priors that decide how a round speculates,
read by the controller (adaptive/), the drafter choice (drafters/choice.py) and the backend choice
(models/backend_choice.py); the seeds rule and the tree-or-chain decision, read by the scheduler,
the engine, the drafters that pick a member or a mapping, and the server."""

from __future__ import annotations

from specdec.config import DRAFT_TREE_MODES
from specdec.tree import TreeShape

# -- priors: what the cost model assumes until the controller has measured it ----------------------
PRIOR_ALPHA = 0.6  # acceptance per draft position before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-rounds of the batch-wide rates mixed into a sequence's own counts
PRIOR_VERIFY_SLOPE = 0.07  # v(T) = 1 + slope * (T - 1) one-token steps until measured (docs/benchmarks.md)
PRIOR_DRAFT_COST = 0.1  # c, one draft step in units of a 1-token target step, until measured


def prior_verify_line(T: int) -> float:
    """The verify pass of T tokens per row in one-token steps, before any pass is timed."""
    return 1.0 + PRIOR_VERIFY_SLOPE * (T - 1)


# -- lookups: drafters that read the text and run no model ------------------------------------------
LOOKUP_METHODS = frozenset({"ngram", "suffix"})  # cost ~0; their drafts are one-hot and seen before choosing


# -- the seeds rule ---------------------------------------------------------------------------------
# A seeded sampled request's output is a function of its prompt, its parameters, its seed and the
# engine's configuration alone: never of the batch it runs in, of earlier requests, or of timings.
# Each row draws from its own generator only what it uses (verify.py, verify_tree.py); what must be
# fixed besides is how the row drafts, since its draws follow its drafts. So a seeded sampled row
# drafts with k = num_speculative_tokens (never the controller's k, which follows timings), a tree of
# the largest shape in a tree round (never the controller's), with the members and the vocabulary
# mapping below (never a choice read from measured acceptance, which other requests' outputs move),
# and runs the round type its configuration gives (``tree_round``). docs/algorithm.md, "Seeds".

def is_seeded(params) -> bool:
    """Whether the seeds rule holds a row (its SamplingParams): seeded and sampled (greedy is
    deterministic whatever drafts)."""
    return params.seed is not None and not params.greedy


def seeded_k(params, k: int, chosen: int) -> int:
    """Drafts a row asks for: the configured ``k`` for a seeded sampled row, else the controller's."""
    return k if is_seeded(params) else chosen


def seeded_members(methods: list[str]) -> list[str]:
    """The members that may draft a seeded sampled row, among several methods (drafters/choice.py) or
    suffix decoding in front of a model (drafters/hybrid.py): the lookups listed (their one-hot drafts
    race plain decoding's own draw, verify.py, so the row emits its plain output whichever lookup
    drafts it), else the first method alone."""
    lookups = [m for m in methods if m in LOOKUP_METHODS]
    return lookups or list(methods[:1])


# draft_tokenizer_mapping "auto" (drafters/other_vocab.py) measures both mappings on the batch: a
# seeded sampled row drafts strings (one-hot: it emits its plain output) whatever the batch keeps.
SEEDED_MAPPING = "string"


# -- tree or chain ----------------------------------------------------------------------------------

def tree_mode(draft_tree: str, k: int, drafter, target) -> str:
    """The draft_tree mode an engine runs, decided once: "tree" needs a drafter that branches and a
    backend that verifies trees (else a ValueError); "auto" is "chain" where either cannot (llama.cpp
    verifies chains: such a target runs the drafter's chains)."""
    if draft_tree not in DRAFT_TREE_MODES:
        raise ValueError(f"draft_tree must be one of {DRAFT_TREE_MODES}, got {draft_tree!r}")
    if drafter is None or k == 0 or draft_tree == "chain":
        return "chain"
    if draft_tree == "tree" and not target.can_verify_trees:
        raise ValueError(f"draft_tree='tree' needs a backend that verifies draft trees in one pass; the "
                         f"{target.backend} backend verifies chains only: use backend='torch' or draft_tree='chain'")
    if draft_tree == "tree" and not drafter.can_draft_trees:
        raise ValueError(f"draft_tree='tree' needs a drafter that branches; the {drafter.label} drafter drafts chains "
                         "only: use draft_tree='auto' or 'chain'")
    return draft_tree if target.can_verify_trees and drafter.can_draft_trees else "chain"


def tree_round(mode: str, seqs, carries_prompt: bool, controller_tree, full, tree_sequences: int | None = None):
    """The tree shape this round drafts within, or None: a chain round. The one place that decides.

    "chain": never trees. "tree": always, so every row's round type is its configuration's
    (``controller_tree(True)``: the controller's shape, forced to branch; no controller: ``full``).
    "auto": the controller's choice (``controller_tree(False)``: a shape, or None where chains pay
    more; no controller: chains), but chains while a seeded sampled row runs (its round type must
    not follow timings). Chains too while a prompt rides in the pass (a tree pass feeds one token
    per row): with "tree" newcomers are prefilled instead (``Scheduler.admit``). A row whose logits
    are processed or reported joins a tree round with a chain (``row_tree``). ``tree_sequences``: the
    target's bound on rows x tree nodes (``ModelRunner.max_tree_sequences``): an "auto" batch past it
    verifies chains ("tree" holds fewer seats instead, ``Scheduler.max_num_seqs``)."""
    if mode == "chain" or carries_prompt:
        return None
    if mode == "tree":
        return controller_tree(True) or full
    if any(is_seeded(s.params) for s in seqs):
        return None
    if tree_sequences is not None and len(seqs) * full.num_nodes > tree_sequences:
        return None
    return controller_tree(False)


def row_tree(seq, depth: int, shape, full):
    """Row ``seq``'s tree shape in a tree round, ``depth`` levels at most (0: it drafts nothing):
    the largest tree ``full`` for a seeded sampled row (the round's ``shape`` for the others); a chain
    where its logits are processed or reported, as a chain round's are (processing.py, logprobs.py)."""
    if depth <= 0:
        return None
    row = full if is_seeded(seq.params) else shape
    d = min(depth, row.max_depth)
    if seq.processor is not None or seq.params.logprobs is not None:
        return TreeShape(d, d, 1)
    return TreeShape(row.num_nodes, d, row.max_children)

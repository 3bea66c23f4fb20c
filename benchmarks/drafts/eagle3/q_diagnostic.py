"""How well an EAGLE-3 head's q (and the draft model's) matches the target's p at temperature 1, teacher
forced on the target's own sampled continuations of held-out prompts. A diagnostic: nothing is fitted
on these prompts (benchmarks/drafts/eagle3/calibrate.py fits on training data's held-out files).

Per draft step: the entropies of p and q, the target's mass on the head's draft vocabulary (the most
any q over it can get accepted), the expected acceptance sum_x min(p, q_s) for q_s = softmax(z / s),
and with the tokens outside the draft vocabulary given logits from the target's own LM head over the
head's normed output plus a bias; then the draft model's expected acceptance one step ahead. For both,
the acceptance split between each position's top ``--top`` tokens of p and the rest (a head trained on
top-k labels and one bucket for the rest never learns how the rest is spread).

    python benchmarks/drafts/eagle3/q_diagnostic.py --head specdec/demo-eagle3 --draft specdec/demo-draft
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCALES = [0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.4]
BIASES = [-2.0, -1.0, 0.0, 1.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="specdec/demo-target")
    ap.add_argument("--head", default="specdec/demo-eagle3")
    ap.add_argument("--draft", default="specdec/demo-draft")
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/code_heldout.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=64, help="split the acceptance at each position's top N tokens of p")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from specdec.models.eagle3 import load_head
    from specdec.models.resolve import resolve_model_path
    from specdec.training.eagle3 import TTTModel, load_target, read_prompts_file, shift
    from specdec.training.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    target, path = load_target(a.target, torch.device("cpu"))
    tok = load_tokenizer(path)
    draft = AutoModelForCausalLM.from_pretrained(resolve_model_path(a.draft), dtype=torch.float32).eval()
    emb = target.get_input_embeddings().weight.detach().float()
    head = load_head(resolve_model_path(a.head) if not Path(a.head).is_dir() else a.head, emb,
                     target.config.num_hidden_layers, target.config.vocab_size)
    model = TTTModel(head, a.steps, 1.0)
    V = target.config.vocab_size
    vocab = head.draft_to_target.long()  # [Vd]
    off = torch.ones(V, dtype=torch.bool)
    off[vocab] = False
    W = target.lm_head.weight.detach().float()[off]  # [V - Vd, D] the target's LM head rows off the draft vocabulary
    torch.manual_seed(a.seed)
    z_all, o_all, p_all = [[] for _ in range(a.steps)], [[] for _ in range(a.steps)], [[] for _ in range(a.steps)]
    draft_logits, draft_p = [], []
    with torch.no_grad():
        for prompt in read_prompts_file(a.prompts):
            ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
            x = target.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.max_tokens,
                                pad_token_id=tok.eos_token_id)  # [1, T]
            out = target(input_ids=x, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[L] for L in head.config.layer_ids], dim=-1)
            logits = out.logits.float()  # [1, T, V]
            first = ids.shape[1] - 2  # score the positions whose guessed token is in the continuation
            for j, (z, scored, g) in enumerate(model.unroll(x, feats)):
                scored = scored[0] & (torch.arange(x.shape[1] - 1) >= first)  # [P]
                z_all[j].append(z[0][scored])  # [m, Vd]
                o_all[j].append(head.norm(g[0][scored]) @ W.T)  # [m, V - Vd]
                p_all[j].append(shift(logits, j)[0][scored])  # [m, V]
            d = draft(input_ids=x).logits.float()[0, first:-1]  # the draft's guess of token t + 1 after t
            draft_logits.append(d)
            draft_p.append(logits[0, first:-1])
    H = lambda p: float(-(p * p.clamp(min=1e-30).log()).sum(-1).mean())  # noqa: E731

    def split(p: torch.Tensor, q: torch.Tensor) -> str:
        """p, q [m, V]: the mass of p in each position's top N and past it, and the share of each accepted."""
        top = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, p.topk(a.top, dim=-1).indices, True)
        kept = torch.minimum(p, q)
        pt, pr = float((p * top).sum(-1).mean()), float((p * ~top).sum(-1).mean())
        at, ar = float((kept * top).sum(-1).mean()), float((kept * ~top).sum(-1).mean())
        return (f"p's top {a.top}: mass {pt:.3f}, accepted {at:.3f} ({at / pt:.0%}); past it: mass {pr:.3f}, "
                f"accepted {ar:.3f} ({ar / max(pr, 1e-12):.0%})")
    for j in range(a.steps):
        z, p = torch.cat(z_all[j]), torch.softmax(torch.cat(p_all[j]), dim=-1)
        pd = p[:, vocab]
        acc = " ".join(f"{s}:{float(torch.minimum(pd, torch.softmax(z / s, -1)).sum(-1).mean()):.4f}" for s in SCALES)
        print(f"step {j}: {len(z)} positions, H(p) {H(p):.2f} H(q) {H(torch.softmax(z, -1)):.2f} nats, target mass on the "
              f"draft vocabulary {float(pd.sum(-1).mean()):.3f}; expected acceptance by s {acc}")
        o, po = torch.cat(o_all[j]), p[:, off]
        wide = []
        for b in BIASES:
            q = torch.softmax(torch.cat([z, o + b], dim=-1), dim=-1)  # [m, V] draft vocabulary first, then the rest
            both = torch.minimum(pd, q[:, : len(vocab)]).sum(-1) + torch.minimum(po, q[:, len(vocab):]).sum(-1)
            wide.append(f"{b:+g}:{float(both.mean()):.4f}")
        print(f"  step {j}, the rest of the vocabulary from the target's LM head, by bias: {' '.join(wide)}")
        q = torch.zeros_like(p)
        q[:, vocab] = torch.softmax(z, dim=-1)
        print(f"  step {j}, {split(p, q)}")
    d, p = torch.cat(draft_logits), torch.softmax(torch.cat(draft_p), dim=-1)
    acc = " ".join(f"{s}:{float(torch.minimum(p, torch.softmax(d / s, -1)).sum(-1).mean()):.4f}" for s in SCALES)
    print(f"draft model, one step ahead: {len(d)} positions, H(q) {H(torch.softmax(d, -1)):.2f}; expected acceptance by s {acc}")
    print(f"  draft model, {split(p, torch.softmax(d, -1))}")


if __name__ == "__main__":
    main()

"""Training the shipped model pair: pretrain a target, distill a draft.

Modules, one concept each:
    data.py         collect text files, tokenize once, random windows
    tokenizer.py    byte-level BPE, saved for ``AutoTokenizer``
    train.py        pretrain a Llama model from scratch (``specdec train``)
    distill.py      distill a draft from a target's logits, forward KL
    finetune.py     continue training a saved model on new text (a draft taught on its target's outputs)
    loop.py         the resumable, DDP-aware optimisation loop and shared options
    distributed.py  plain process or torchrun (DDP), one code path
    checkpoint.py   resumable checkpoints
    progress.py     rich progress bar
    model_card.py   README.md model cards

Nothing is imported here so ``import specdec`` stays light; import the
module you need, e.g. ``from specdec.training.train import TrainConfig, train``.
"""

"""Chat messages to prompt token ids: the tokenizer's chat template, or a simple default.

The default, for tokenizers without a template, is one line per message and an open assistant turn:

    system: You are terse.
    user: Hello!
    assistant:

(each line is ``{role}: {content}`` followed by a newline; the prompt ends with ``assistant:``).
"""

from __future__ import annotations

from specdec.server.protocol import ChatMessage


def default_chat_prompt(messages: list[dict[str, str]]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def render_chat(tokenizer, messages: list[ChatMessage]) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be encoded; "
                         "use /v1/completions with a list of token ids")
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template already wrote BOS if it wants one
    return tokenizer.encode(default_chat_prompt(msgs))

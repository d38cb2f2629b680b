"""Chat templates: ChatML by default, the model's own template when it has one.

The model's own template is a transformers tokenizer's (``apply_chat_template``) or a Jinja
string attached to any other tokenizer with :func:`attach_template` (a GGUF file's or a
checkpoint's ``chat_template.jinja``), rendered in a sandbox with the globals transformers gives
templates (``raise_exception``, ``bos_token``, ``eos_token``), so both render the same text.

:func:`chat_example` turns a list of ``{"role", "content"}`` messages into an
:class:`~lmforge.posttrain.core.Example` whose trainable tokens are the assistant replies
(content and end-of-turn marker), never the role headers or other turns.

Simplification: each piece of the conversation is tokenized on its own, so no BPE merge crosses
a piece boundary (as TRL's assistant masks); with a tokenizer template, the pieces are the
differences between renderings of growing prefixes. Exercised by ``pytest
tests/test_posttrain_core.py -k chat``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmforge.posttrain.core import Example, encode_text
from lmforge.serve.templates import render_template
from lmforge.utils.errors import LmforgeError

ROLES = ("system", "user", "assistant")


def check_messages(messages: Any, where: str = "conversation") -> list[dict[str, str]]:
    """Validated messages: a non-empty list of {role in ROLES, content: str}; else one-line error."""
    if not isinstance(messages, list) or not messages:
        raise LmforgeError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise LmforgeError(f"{where}: message {i} needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise LmforgeError(f"{where}: message {i} has role {m['role']!r}, expected {ROLES}")
        if not isinstance(m["content"], str):
            raise LmforgeError(f"{where}: message {i} content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def chatml_header(role: str) -> str:
    return f"<|im_start|>{role}\n"


CHATML_END = "<|im_end|>\n"


def render_chatml(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """The conversation in ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn)."""
    text = "".join(chatml_header(m["role"]) + m["content"] + CHATML_END for m in messages)
    return text + (chatml_header("assistant") if add_generation_prompt else "")


def attach_template(tokenizer: Any, template: str | None) -> Any:
    """``tokenizer`` carrying the Jinja chat ``template`` as ``tokenizer.chat_template`` (a
    transformers tokenizer keeps its own; ``None`` or an empty template attaches nothing)."""
    if tokenizer is not None and template and not hasattr(tokenizer, "apply_chat_template"):
        tokenizer.chat_template = template
    return tokenizer


def template_of(tokenizer: Any) -> str | None:
    """The chat template string a tokenizer carries (either kind), or None (ChatML is used)."""
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) and t else None


def _special_token(tokenizer: Any, attr: str) -> str:
    """The text of ``tokenizer``'s BOS/EOS token ("" when it has none), for template globals:
    an ``HFTokenizer``'s ``tokenizer_config.json`` names them (GGUF imports write both), else
    the tokenizer's id attributes."""
    folder = getattr(tokenizer, "folder", None)
    if folder is not None:
        import json
        from pathlib import Path

        cfg = Path(folder) / "tokenizer_config.json"
        try:
            named = json.loads(cfg.read_text(encoding="utf-8")).get(f"{attr}_token")
        except (OSError, ValueError):
            named = None
        if isinstance(named, dict):
            named = named.get("content")
        if isinstance(named, str):
            return named
    ids = {"eos": ("eos_id", "eos_token_id", "eot_id"), "bos": ("bos_id", "bos_token_id")}[attr]
    for name in ids:
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return tokenizer.decode([v])
    return ""


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
) -> str:
    """The conversation as text: the tokenizer's own template when present, else ChatML."""
    template = template_of(tokenizer)
    if hasattr(tokenizer, "apply_chat_template") and template:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    if template is not None:
        special = {k: _special_token(tokenizer, k) for k in ("bos", "eos")}
        return render_template(
            template,
            messages,
            add_generation_prompt,
            bos_token=special["bos"],
            eos_token=special["eos"],
        )
    return render_chatml(messages, add_generation_prompt)


def _pieces(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """(text, trainable) pieces whose concatenation is the rendered conversation."""
    if template_of(tokenizer) is None:
        pieces: list[tuple[str, bool]] = []
        for m in messages:
            pieces.append((chatml_header(m["role"]), False))
            pieces.append((m["content"] + CHATML_END, m["role"] == "assistant"))
        return pieces
    pieces = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
            if not head.startswith(done):
                raise LmforgeError("the tokenizer's chat template does not render prefixes stably")
            pieces.append((head[len(done) :], False))
            done = head
        full = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not full.startswith(done):
            raise LmforgeError("the tokenizer's chat template does not render prefixes stably")
        pieces.append((full[len(done) :], m["role"] == "assistant"))
        done = full
    return pieces


def chat_example(tokenizer: Any, messages: Any, where: str = "conversation") -> Example:
    """Tokens of a conversation with the assistant replies marked trainable."""
    msgs = check_messages(messages, where)
    if not any(m["role"] == "assistant" for m in msgs):
        raise LmforgeError(f"{where}: no assistant message to train on")
    tokens: list[int] = []
    trainable: list[bool] = []
    for text, train in _pieces(tokenizer, msgs):
        ids = encode_text(tokenizer, text) if text else []
        tokens += ids
        trainable += [train] * len(ids)
    if len(tokens) < 2:
        raise LmforgeError(f"{where}: conversation tokenizes to fewer than 2 tokens")
    return Example(tokens, trainable)


def prompt_text(tokenizer: Any, prompt: str, chat: bool) -> str:
    """A user prompt as the model should see it: templated (with the assistant header) or raw."""
    if not chat:
        return prompt
    return render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)

"""Chat templates (Jinja, rendered sandboxed as transformers does) and the request error type."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmforge.utils.errors import LmforgeError

__all__ = ["CHATML_TEMPLATE", "BadRequest", "ChatTemplateError", "render_chat", "render_template"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class BadRequest(Exception):
    """A request the server refuses: HTTP status, message and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class ChatTemplateError(LmforgeError):
    """A chat template that cannot be rendered (a syntax error, or its own ``raise_exception``)."""


def render_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """``messages`` under a Jinja chat template, rendered as transformers renders it (sandboxed,
    trimmed blocks, loop controls); a template that fails raises one :class:`ChatTemplateError`
    line. The one renderer of lmforge: the server, ``lmforge chat`` and post-training use it."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **extra
        )
    except TemplateError as e:
        raise ChatTemplateError(f"chat template cannot be rendered: {e}") from None


def render_chat(template: str | None, messages: list[dict[str, Any]], **extra: Any) -> str:
    """The prompt text of a request's ``messages`` (ChatML when the model records no template);
    a template failure is the request's fault: a 400 naming ``messages``."""
    try:
        return render_template(template or CHATML_TEMPLATE, messages, **extra)
    except ChatTemplateError as e:
        raise BadRequest(str(e), "messages") from None

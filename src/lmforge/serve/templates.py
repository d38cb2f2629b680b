"""Chat templates (Jinja, rendered sandboxed as transformers does) and the request error type."""

from __future__ import annotations

from typing import Any

__all__ = ["CHATML_TEMPLATE", "BadRequest", "render_chat"]

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


def render_chat(template: str | None, messages: list[dict[str, Any]], **extra: Any) -> str:
    """The prompt text for ``messages`` under a Jinja chat template (sandboxed, as HF renders)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise BadRequest(f"chat template: {message}", "messages")

    env.globals["raise_exception"] = raise_exception
    tpl = env.from_string(template or CHATML_TEMPLATE)
    return tpl.render(messages=messages, add_generation_prompt=True, **extra)

"""``lmforge chat``: an interactive terminal chat on the engine, replies streamed token by token."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from lmforge.serve.engine import Engine
from lmforge.serve.sampling import SamplingParams
from lmforge.serve.templates import render_chat

__all__ = ["chat_repl", "stream_text"]


def chat_repl(
    engine: Engine,
    tokenizer: Any,
    template: str | None,
    temperature: float = 0.0,
    max_tokens: int = 256,
    system: str | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> int:
    """Read user turns from ``stdin`` until EOF or ``/quit``; stream each reply to ``stdout``."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if engine.tokenizer is None:  # the engine streams final text pieces (stop-safe, O(new))
        engine.tokenizer = tokenizer  # for requests added from now on
    ctx = engine.config.context_length
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() == "/quit":
            break
        if text.strip() == "/reset":
            history = history[:1] if system else []
            stdout.write("(history cleared)\n")
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        prompt = tokenizer.encode(render_chat(template, history))
        while len(prompt) >= ctx - 1 and len(history) > 1:  # forget the oldest turns
            history.pop(1 if system else 0)
            prompt = tokenizer.encode(render_chat(template, history))
        if len(prompt) >= ctx - 1:
            stdout.write(f"(message too long for the {ctx}-token context)\n")
            history.pop()
            continue
        params = SamplingParams(
            temperature=temperature, max_tokens=min(max_tokens, ctx - len(prompt))
        )
        reply = stream_text(engine, prompt, params, stdout)
        stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
    return 0


def stream_text(engine: Engine, prompt: list[int], params: SamplingParams, out: TextIO) -> str:
    """Run one request on ``engine`` (with a tokenizer), writing its text to ``out`` as the
    engine releases it (final pieces: never past a stop string); returns the whole text."""
    rid = engine.add_request(prompt, params)
    pieces: list[str] = []
    while engine.has_unfinished():
        for ro in engine.step():
            new = ro.outputs[0].text_pieces[len(pieces) :] if ro.request_id == rid else []
            if new:
                pieces += new
                out.write("".join(new))
                out.flush()
    return "".join(pieces)

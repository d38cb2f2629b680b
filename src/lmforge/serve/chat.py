"""``lmforge chat``: an interactive terminal chat on the engine, replies streamed token by token.

With a VLM and ``--image FILE`` the image goes with the first user turn (an ``<image>``
placeholder before its text); every turn's prompt carries it while that turn is in the history,
and the prefix cache (keyed on the image's pixels) keeps its KV between turns."""

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
    image: tuple[Any, str] | None = None,
    vision: Any = None,
) -> int:
    """Read user turns from ``stdin`` until EOF or ``/quit``; stream each reply to ``stdout``.

    ``image``: ``(pixels, digest)`` (:func:`lmforge.vision.serving.image_pixels`) shown with
    the first user turn to ``vision``, the VLM's tower (:class:`~lmforge.vision.serving.VisionTower`).
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if engine.tokenizer is None:  # the engine streams final text pieces (stop-safe, O(new))
        engine.tokenizer = tokenizer  # for requests added from now on
    ctx = engine.config.context_length
    interactive = stdin.isatty()
    pending_image = image is not None  # the next user turn carries it

    def encode(history: list[dict[str, str]]) -> tuple[list[int], Any]:
        ids = tokenizer.encode(render_chat(template, history))
        if vision is None or image is None:
            return ids, None
        from lmforge.vision.serving import prepare_image_prompt

        # the image's turn holds one placeholder; once that turn is forgotten, none is left
        n = sum(1 for t in ids if t == vision.image_id)
        p = prepare_image_prompt(vision, ids, [], pixels=[image] * n)
        return p.token_ids, p

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
            pending_image = image is not None  # starting over shows the image again
            stdout.write("(history cleared)\n")
            continue
        if not text.strip():
            continue
        if pending_image:
            text, pending_image = f"<image>\n{text}", False
        history.append({"role": "user", "content": text})
        prompt, images = encode(history)
        while len(prompt) >= ctx - 1 and len(history) > 1:  # forget the oldest turns
            history.pop(1 if system else 0)
            prompt, images = encode(history)
        if len(prompt) >= ctx - 1:
            stdout.write(f"(message too long for the {ctx}-token context)\n")
            history.pop()
            continue
        params = SamplingParams(
            temperature=temperature, max_tokens=min(max_tokens, ctx - len(prompt))
        )
        reply = stream_text(engine, prompt, params, stdout, images)
        stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
    return 0


def stream_text(
    engine: Engine, prompt: list[int], params: SamplingParams, out: TextIO, images: Any = None
) -> str:
    """Run one request on ``engine`` (with a tokenizer), writing its text to ``out`` as the
    engine releases it (final pieces: never past a stop string); returns the whole text.
    ``images``: the prompt's image embeddings (``Engine.add_request(image_embeds=)``)."""
    rid = engine.add_request(prompt, params, image_embeds=images)
    pieces: list[str] = []
    while engine.has_unfinished():
        for ro in engine.step():
            new = ro.outputs[0].text_pieces[len(pieces) :] if ro.request_id == rid else []
            if new:
                pieces += new
                out.write("".join(new))
                out.flush()
    return "".join(pieces)

"""The OpenAI-compatible HTTP server (``lmforge serve``): FastAPI + uvicorn over the engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template,
ChatML when none is recorded), both with ``stream: true`` as server-sent events; ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). With an API key every endpoint
but ``/health`` needs ``Authorization: Bearer KEY``.

Processes: ``lmforge serve`` runs the engine in its own process
(:mod:`lmforge.serve.engine_process`, as vLLM runs its engine core apart from its API server),
so the engine's steps and this event loop never share a GIL; :class:`EngineLoop` runs the same
loop in a thread of this process instead (tests, which reach into the engine). Either way the handlers
validate the request (bad ones get an OpenAI-style 4xx JSON error; the server keeps serving),
tokenize it and submit it without waiting for a step; each engine step comes back as one batch
of per-request :class:`~lmforge.serve.output.Delta` objects (new ids and logprobs), and a
handler that fell behind sends what piled up as one SSE chunk. A full queue answers 429; a
client that disconnects has its request aborted and its blocks freed; a body over
``--max-request-bytes`` is refused (413) before it is read; SIGTERM drains (:func:`run_server`:
``/health`` answers 503, in-flight requests finish, then the engine stops).

Text: the handlers' output processor (:mod:`lmforge.serve.output`) detokenizes incrementally
and ends samples on ``stop`` strings, outside the engine; streamed and non-streamed text are
the same released pieces and a stream never shows text past a stop string. The token that
ended a sample (EOS / stop id) and the matched stop string are not part of the text.

Images (a VLM, ``lmforge serve --checkpoint VLM_RUN_DIR``): chat content parts ``{"type":
"image_url", "image_url": {"url": "data:image/...;base64,..."}}`` become ``<image>``
placeholders; the images are decoded, checked and preprocessed here in a worker thread
(:mod:`lmforge.vision.serving`; only ``data:`` URLs, nothing is fetched) and the engine side
embeds them. A bad image, a non-data URL or an image for a text model is a 400.

Exercised by ``pytest tests/test_serve_server.py tests/test_serve_images_server.py`` (the
official ``openai`` client or httpx against a server on a free 127.0.0.1 port).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from lmforge.serve.engine import QueueFull
from lmforge.serve.engine_process import EngineLoop, EngineProcess
from lmforge.serve.output import Delta, OutputProcessor, Piece, join_pieces
from lmforge.serve.sampling import SamplingParams
from lmforge.serve.templates import CHATML_TEMPLATE, BadRequest, render_chat
from lmforge.utils.errors import LmforgeError

__all__ = [
    "CHATML_TEMPLATE",
    "DEFAULT_MAX_REQUEST_BYTES",
    "EngineLoop",
    "ServerState",
    "build_app",
    "make_server",
    "render_chat",
    "run_server",
]

MAX_N = 16
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 128k-token prompt as JSON token ids is ~1 MiB
ROLES = ("system", "developer", "user", "assistant", "tool")
# Bodies and texts this large are parsed / tokenized in a worker thread: the event loop (and
# /health, and every stream) keeps its turn every few ms instead of waiting for the whole of it.
OFFLOAD_BYTES = 1 << 16


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine side (:class:`EngineProcess`, or :class:`EngineLoop`
    in a thread), the tokenizer and the served model's name."""

    loop: EngineProcess
    tokenizer: Any
    model_name: str
    chat_template: str | None = None
    api_key: str | None = None
    max_default_tokens: int = 512
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    "bodies larger than this are refused with 413 before they are read"
    draining: bool = False
    "set by SIGTERM / Ctrl-C: /health answers 503, new requests 503, in-flight ones finish"
    inflight: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0


def _error(status: int, message: str, param: str | None = None, kind: str | None = None) -> Any:
    kind = kind or {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def _get(body: dict, key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    if key not in body or body[key] is None:
        return default
    value = body[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"'{key}' must be {_type_names(types)}, got a boolean", key)
    if not isinstance(value, types):
        raise BadRequest(f"'{key}' must be {_type_names(types)}, got {type(value).__name__}", key)
    return value


def _type_names(types: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    ts = types if isinstance(types, tuple) else (types,)
    if set(ts) == {int, float}:
        return "a number"
    return " or ".join(names.get(t, t.__name__) for t in ts)


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "ignore_eos",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


def _number(
    body: dict,
    key: str,
    default: Any,
    lo: float,
    hi: float,
    lo_open: bool = False,
    kind: Any = float,
) -> Any:
    """``body[key]`` (``default`` when absent or null) checked to lie in [lo, hi] ((lo, hi]
    with ``lo_open``); ``kind`` int takes integers only, float any number (as a float)."""
    v = _get(body, key, int if kind is int else (int, float), default)
    if v is None:
        return None
    v = kind(v)
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        bounds = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise BadRequest(f"'{key}' must be in {bounds}, got {v}", key)
    return v


def _logit_bias(body: dict, vocab: int) -> dict[int, float]:
    raw = _get(body, "logit_bias", dict, {})
    out = {}
    for k, v in raw.items():
        try:
            t = int(k)
        except ValueError:
            raise BadRequest(
                f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias"
            ) from None
        if not 0 <= t < vocab:
            raise BadRequest(f"'logit_bias' token id {t} is not in [0, {vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(f"'logit_bias' values must be numbers in [-100, 100], got {v!r}",
                             "logit_bias")  # fmt: skip
        out[t] = float(v)
    return out


def _sampling(
    body: dict, n_prompt: int, ctx: int, vocab: int, default_max: int, chat: bool
) -> tuple[SamplingParams, list[str]]:
    """The engine's SamplingParams (no stop strings: the output processor matches them) and
    the request's stop strings."""
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    room = ctx - n_prompt
    if room < 1:
        raise BadRequest(
            f"the prompt has {n_prompt} tokens; this model's context is {ctx} tokens",
            "messages" if chat else "prompt",
        )
    max_tokens = _get(body, max_key, int, min(room, default_max) if chat else min(16, room))
    if max_tokens < 1:
        raise BadRequest(f"'{max_key}' must be at least 1, got {max_tokens}", max_key)
    if max_tokens > room:
        raise BadRequest(
            f"'{max_key}' is {max_tokens}, but the prompt ({n_prompt} tokens) leaves room for "
            f"{room} in this model's {ctx}-token context",
            max_key,
        )
    n = _number(body, "n", 1, 1, MAX_N, kind=int)
    top_k = _get(body, "top_k", int, 0)
    if top_k < 0 and top_k != -1:
        raise BadRequest(f"'top_k' must be >= 0 (or -1 for off), got {top_k}", "top_k")
    if chat:
        want = _get(body, "logprobs", bool, False)
        logprobs = _number(body, "top_logprobs", 0, 0, 20, kind=int) if want else None
    else:
        logprobs = _number(body, "logprobs", None, 0, 20, kind=int)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of up to 4 strings", "stop")
    stops = [s for s in stops if s]
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0, 100),
        top_k=max(top_k, 0),
        top_p=_number(body, "top_p", 1.0, 0, 1, lo_open=True),
        min_p=_number(body, "min_p", 0.0, 0, 1),
        max_tokens=max_tokens,
        n=n,
        seed=_get(body, "seed", int, None),
        logprobs=logprobs,
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True),
        logit_bias=_logit_bias(body, vocab),
    )
    return params, stops


def _chat_text(m: Any, images: list[str] | None) -> dict:
    """A message with string content: a list of text parts is joined (as vLLM: with newlines).
    An ``image_url`` part (a VLM; ``images`` is None for a text model: 400) becomes the
    ``<image>`` placeholder, its URL appended to ``images``."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest("each message needs a string 'role'", "messages")
    role = m["role"]
    if role not in ROLES:
        raise BadRequest(
            f"unknown message role '{role}' (expected one of {', '.join(ROLES)})", "messages"
        )
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url":
                texts.append(_image_part(part, images))
                continue
            if kind != "text":
                raise BadRequest(
                    f"message content parts must be {{'type': 'text', ...}} or "
                    f"{{'type': 'image_url', ...}}, got {kind!r}",
                    "messages",
                )
            if not isinstance(part.get("text"), str):
                raise BadRequest("a text content part needs a string 'text'", "messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise BadRequest("each message needs a string 'content' (or a list of text parts)",
                         "messages")  # fmt: skip
    # 'developer' is OpenAI's newer name for the system role; chat templates know 'system'
    return {**m, "role": "system" if role == "developer" else role, "content": content}


def _image_part(part: dict, images: list[str] | None) -> str:
    """The placeholder text of an ``image_url`` part; its URL goes to ``images``."""
    if images is None:
        raise BadRequest("this model has no vision tower (it serves text only): image_url "
                         "content needs a VLM (lmforge serve --checkpoint VLM_RUN_DIR)",
                         "messages")  # fmt: skip
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise BadRequest("an image_url content part needs {'url': 'data:image/...'}", "messages")
    images.append(url)
    return "<image>"


def _read_images(urls: list[str], vision: dict[str, int]) -> tuple[Any, list[str]]:
    """``(pixels (M, 3, S, S) float32 numpy, digests)`` of data URLs (worker thread: decoding
    and resizing are CPU work); a bad one is a 400 naming it."""
    import numpy as np

    from lmforge.vision.serving import decode_data_url, decode_image, image_pixels

    pixels, digests = [], []
    for i, url in enumerate(urls):
        name = f"image {i + 1}"
        try:
            image = decode_image(decode_data_url(url), name)
            px, digest = image_pixels(image, vision["image_size"])
        except LmforgeError as e:
            msg = str(e) if str(e).startswith(name) else f"{name}: {e}"
            raise BadRequest(msg, "messages") from None
        pixels.append(px.numpy())
        digests.append(digest)
    return np.stack(pixels), digests


def build_app(state: ServerState) -> Any:
    """The FastAPI application serving ``state``'s engine side."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # Started with the server, stopped after the graceful shutdown has let in-flight
        # requests finish (SIGTERM drains: see run_server).
        state.loop.start()
        # Everything built so far (FastAPI, the tokenizer, imported modules) lives as long as
        # the server: move it out of the collector's generations, so the collections that the
        # per-step allocations trigger do not walk it (measured by benchmarks/serve_api_cost.py).
        gc.freeze()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="lmforge serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    ctx = state.loop.context_length
    vocab = state.loop.vocab_size
    tok = state.tokenizer
    eos = state.loop.eos_token_id  # a template may name the model's EOS text
    special = {} if eos is None else {"eos_token": tok.decode([eos])}
    # Plain ASGI middlewares: starlette's BaseHTTPMiddleware would put every streamed chunk
    # through an extra task and memory stream. The size limit is outermost: an oversized body
    # is refused before anything reads, parses or tokenizes it.
    if state.api_key:
        app.add_middleware(_ApiKey, key=state.api_key)
    app.add_middleware(_BodyLimit, state=state)

    @app.get("/health")
    async def health() -> Any:
        if state.loop.error is not None:
            return JSONResponse({"status": "error", "detail": str(state.loop.error)}, 500)
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "lmforge"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Any:
        m = state.loop.metrics()
        rows = [
            ("requests_running", "gauge", "Sequences in the running batch.", m["running"]),
            ("requests_waiting", "gauge", "Sequences waiting for admission.", m["waiting"]),
            ("kv_blocks_used", "gauge", "KV-cache blocks held by sequences.", m["kv_used"]),
            ("kv_blocks_total", "gauge", "KV-cache blocks.", m["kv_total"]),
            ("generated_tokens_total", "counter", "Tokens sampled.", m["generated_tokens"]),
            ("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
             f"{m['tokens_per_second']:.3f}"),
            ("requests_total", "counter", "Requests accepted.", m["requests_total"]),
            ("prefix_cache_hits_total", "counter", "Prefix-cache block hits.", m["prefix_hits"]),
            ("preemptions_total", "counter", "Sequences preempted (recomputed later).",
             m["preemptions"]),
        ]  # fmt: skip
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP lmforge_{name} {help_}", f"# TYPE lmforge_{name} {kind}",
                      f"lmforge_{name} {value}"]  # fmt: skip
        for name, help_, total, count in (
            ("time_to_first_token_seconds", "Time to first token.", state.ttft_sum,
             state.ttft_count),
            ("engine_step_seconds", "Time inside engine steps (hand-offs excluded).",
             m["step_seconds"], m["step_count"]),
        ):  # fmt: skip
            lines += [f"# HELP lmforge_{name} {help_}", f"# TYPE lmforge_{name} summary",
                      f"lmforge_{name}_sum {total:.6f}", f"lmforge_{name}_count {int(count)}"]  # fmt: skip
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _body(request: Request, fields: set[str]) -> dict:
        try:
            raw = await request.body()
            body = (
                json.loads(raw)
                if len(raw) < OFFLOAD_BYTES
                else await asyncio.to_thread(json.loads, raw)
            )
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise BadRequest(f"unknown field '{unknown[0]}'", unknown[0])
        model = body.get("model")
        if model is not None and model != state.model_name:
            raise BadRequest(
                f"model '{model}' does not exist (this server serves '{state.model_name}')",
                "model",
                404,
            )
        return body

    def _usage(n_prompt: int, completion: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": completion,
                "total_tokens": n_prompt + completion}  # fmt: skip

    async def _run(
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        chat: bool,
        stream: bool,
        include_usage: bool,
        echo: str | None,
        images: tuple | None = None,
    ) -> Any:
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        t0 = time.monotonic()
        try:
            rid = state.loop.submit(prompt, params, queue, images)
        except QueueFull as e:
            return _error(429, str(e))
        except LmforgeError as e:
            return _error(400, str(e))
        proc = OutputProcessor(tok, prompt, params.n, stops)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        want_lp = params.logprobs is not None
        base = len(echo) if echo else 0
        offsets = [base] * params.n  # text_offset of each sample's next token

        finished = [False] * params.n

        async def updates(watch: Request | None) -> AsyncIterator[dict[int, Piece]]:
            """Per-sample pieces of each batch of deltas (a handler that fell behind takes what
            piled up at once) until every sample ended; an engine error raises BadRequest with
            its status. ``watch``: the request whose disconnect ends the wait (non-streamed)."""
            first = True
            while not all(finished):
                deltas = [await (queue.get() if watch is None else _get_watching(queue, watch))]
                while not queue.empty():
                    deltas.append(queue.get_nowait())
                error = next((d for d in deltas if d.error), None)
                if error is not None:
                    finished[:] = [True] * params.n  # the engine has dropped the request
                    raise BadRequest(error.error or "engine failed", status=error.status)
                if first:
                    first = False
                    state.ttft_sum += time.monotonic() - t0
                    state.ttft_count += 1
                pieces = proc.process(deltas)
                if proc.finished and not deltas[-1].finished:
                    state.loop.abort(rid)  # every sample ended on a stop string: free the blocks
                for i, p in pieces.items():
                    finished[i] = finished[i] or p.finish_reason is not None
                yield pieces

        def leave() -> None:
            state.inflight -= 1
            if not all(finished):
                state.loop.abort(rid)  # client went away (or its wait did): free the blocks now

        def logprobs(i: int, p: Piece) -> Any:
            lp = _logprobs_json(tok, p.token_ids, p.logprobs, p.top_logprobs, chat, offsets[i])
            if not chat:
                offsets[i] += sum(len(t) for t in lp["tokens"])
            return lp

        if stream:
            # Everything but the choices is the same in every chunk: encode it once.
            obj = "chat.completion.chunk" if chat else kind
            head = (
                f'data: {{"id": "{rid}", "object": "{obj}", "created": {created}, '
                f'"model": {json.dumps(state.model_name)}, "choices": '
            ).encode()
            tail = b', "usage": null}\n\n' if include_usage else b"}\n\n"

            def chunk(choices: list) -> bytes:
                return head + json.dumps(choices).encode() + tail

            async def events() -> AsyncIterator[bytes]:
                n_tokens = 0
                state.inflight += 1
                try:
                    if chat:  # OpenAI sends the role first
                        yield chunk(
                            [
                                {"index": i, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}
                                for i in range(params.n)
                            ]
                        )  # fmt: skip
                    elif echo:
                        yield chunk([{"index": i, "text": echo, "logprobs": None,
                                      "finish_reason": None} for i in range(params.n)])  # fmt: skip
                    async for pieces in updates(None):
                        choices = []
                        for i, p in pieces.items():
                            n_tokens += len(p.token_ids)
                            if not want_lp:  # the common case: no dict, no json.dumps of it
                                choices.append(_choice_json(i, p.text, p.finish_reason, chat))
                                continue
                            lp = logprobs(i, p)
                            if chat:
                                delta = (
                                    {"content": p.text} if p.text or p.finish_reason is None else {}
                                )
                                choices.append({"index": i, "delta": delta, "logprobs": lp,
                                                "finish_reason": p.finish_reason})  # fmt: skip
                            else:
                                choices.append({"index": i, "text": p.text, "logprobs": lp,
                                                "finish_reason": p.finish_reason})  # fmt: skip
                            choices[-1] = json.dumps(choices[-1]).encode()
                        if choices:
                            yield head + b"[" + b", ".join(choices) + b"]" + tail
                    if include_usage:
                        yield (
                            head
                            + b"[], "
                            + b'"usage": '
                            + json.dumps(_usage(len(prompt), n_tokens)).encode()
                            + b"}\n\n"
                        )
                    yield b"data: [DONE]\n\n"
                except BadRequest as e:
                    err = {"message": e.message, "type": "server_error" if e.status >= 500
                           else "invalid_request_error", "param": None, "code": e.status}  # fmt: skip
                    yield _sse({"error": err})
                finally:
                    leave()

            return StreamingResponse(events(), media_type="text/event-stream")

        got: list[Piece | None] = [None] * params.n
        state.inflight += 1
        try:
            async for pieces in updates(request):
                for i, p in pieces.items():
                    got[i] = p if got[i] is None else join_pieces(got[i], p)
        except BadRequest as e:
            return _error(e.status, e.message)
        finally:
            leave()
        choices = []
        for i, p in enumerate(got):
            assert p is not None
            lp = logprobs(i, p) if want_lp else None
            if chat:
                msg = {"role": "assistant", "content": p.text}
                choices.append(
                    {"index": i, "message": msg, "logprobs": lp, "finish_reason": p.finish_reason}
                )
            else:
                choices.append({"index": i, "text": (echo or "") + p.text, "logprobs": lp,
                                "finish_reason": p.finish_reason})  # fmt: skip
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": _usage(len(prompt), sum(len(p.token_ids) for p in got if p is not None)),
        }

    async def handle(request: Request, chat: bool) -> Any:
        if state.draining:
            return _error(503, "the server is shutting down", kind="server_error")
        if state.loop.error is not None:
            return _error(500, f"engine failed: {state.loop.error}")
        try:
            body = await _body(request, _CHAT_FIELDS if chat else _COMPLETION_FIELDS)
            echo, pixels, digests = None, None, []
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise BadRequest("'messages' must be a non-empty list", "messages")
                urls: list[str] | None = None if state.loop.vision is None else []
                messages = [_chat_text(m, urls) for m in messages]
                text = render_chat(state.chat_template, messages, **special)
                prompt = await _encode(tok, text)
                if urls:  # decoded off the event loop
                    pixels, digests = await asyncio.to_thread(_read_images, urls, state.loop.vision)
            else:
                raw = body.get("prompt")
                if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
                    raw = raw[0]  # a batch of one text
                if isinstance(raw, str):
                    prompt = await _encode(tok, raw)
                elif (
                    isinstance(raw, list)
                    and raw
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
                ):
                    prompt = list(raw)
                else:
                    raise BadRequest(
                        "'prompt' must be a string or a non-empty list of token ids", "prompt"
                    )
                if _get(body, "echo", bool, False):
                    if body.get("logprobs") is not None:
                        raise BadRequest(
                            "'echo' with 'logprobs' needs the prompt's logprobs, which this "
                            "server does not compute; ask for one or the other",
                            "echo",
                        )
                    echo = raw if isinstance(raw, str) else tok.decode(prompt)
            if not prompt:
                raise BadRequest("the prompt is empty", "messages" if chat else "prompt")
            images = None
            if state.loop.vision is not None:  # a VLM: one image per placeholder, expanded
                prompt, images = _expand(prompt, pixels, digests, state.loop.vision, chat)
            if any(t < 0 or t >= vocab for t in prompt):
                raise BadRequest(f"token ids must be in [0, {vocab})", "prompt")
            params, stops = _sampling(body, len(prompt), ctx, vocab, state.max_default_tokens, chat)
            stream = bool(_get(body, "stream", bool, False))
            include_usage = _stream_options(body, stream)
        except BadRequest as e:
            return _error(e.status, e.message, e.param)
        return await _run(request, prompt, params, stops, chat, stream, include_usage, echo,
                          images)  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Any) -> Any:
        return _error(404, f"no route {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Any) -> Any:
        return _error(405, f"method {request.method} is not allowed on {request.url.path}")

    return app


def run_server(state: ServerState, sock: socket.socket, drain_timeout: float = 60.0) -> None:
    """Serve ``state`` on the bound socket ``sock`` until SIGTERM or Ctrl-C.

    The first signal starts draining: ``/health`` answers 503 (a load balancer stops sending
    traffic), new completions 503, in-flight ones run to the end; when none is left (or after
    ``drain_timeout`` seconds) uvicorn's own graceful shutdown closes the listener and the
    engine side stops. A second signal skips the wait. The socket is bound by the caller, so a
    busy port is reported before anything is loaded.
    """
    make_server(state, drain_timeout).run(sockets=[sock])


def make_server(state: ServerState, drain_timeout: float = 60.0, **config: Any) -> Any:
    """A ``uvicorn.Server`` for ``state``'s app with the draining phase of :func:`run_server`
    (``config``: more ``uvicorn.Config`` arguments, e.g. host and port)."""
    import uvicorn

    cfg = uvicorn.Config(
        build_app(state),
        log_level=config.pop("log_level", "warning"),
        timeout_graceful_shutdown=int(drain_timeout),
        **config,
    )
    return _draining_server_class()(cfg, state, drain_timeout)


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: Any, state: ServerState, drain_timeout: float) -> None:
            super().__init__(config)
            self.state, self.drain_timeout = state, drain_timeout
            self.deadline = 0.0

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.state.draining or self.state.inflight == 0:
                self.state.draining = True
                super().handle_exit(sig, frame)
                return
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:  # uvicorn re-raises it once shut down (exit status)
                captured.append(sig)
            self.state.draining = True
            self.deadline = time.monotonic() + self.drain_timeout

        async def on_tick(self, counter: int) -> bool:
            st = self.state
            if (
                st.draining
                and not self.should_exit
                and (st.inflight == 0 or time.monotonic() > self.deadline)
            ):
                self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer


async def _get_watching(queue: asyncio.Queue, request: Request) -> Delta:
    """``queue.get()``, or :class:`BadRequest` (499) once the client has gone (checked each 0.5 s)."""
    get = asyncio.ensure_future(queue.get())
    while True:
        done, _ = await asyncio.wait({get}, timeout=0.5)
        if done:
            return get.result()
        if await request.is_disconnected():
            get.cancel()
            raise BadRequest("client disconnected", status=499)


def _expand(
    prompt: list[int], pixels: Any, digests: list[str], vision: dict[str, int], chat: bool
) -> tuple[list[int], tuple | None]:
    """A VLM prompt with its ``<image>`` placeholders expanded to the image slots, and what
    :meth:`EngineProcess.submit` takes for its images (None without images)."""
    from lmforge.vision.serving import expand_placeholders

    try:
        ids, spans = expand_placeholders(prompt, vision["image_id"], vision["n_image_tokens"],
                                         len(digests))  # fmt: skip
    except LmforgeError as e:
        raise BadRequest(str(e), "messages" if chat else "prompt") from None
    return ids, ((pixels, spans, digests) if digests else None)


async def _encode(tok: Any, text: str) -> list[int]:
    if len(text) < OFFLOAD_BYTES:
        return tok.encode(text)
    return await asyncio.to_thread(tok.encode, text)


def _stream_options(body: dict, stream: bool) -> bool:
    """Whether the stream ends with a usage chunk (``stream_options.include_usage``)."""
    opts = _get(body, "stream_options", dict, None)
    if opts is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    unknown = sorted(set(opts) - {"include_usage"})
    if unknown:
        raise BadRequest(f"unknown field 'stream_options.{unknown[0]}'", "stream_options")
    return bool(_get(opts, "include_usage", bool, False))


class _ApiKey:
    """ASGI middleware: every path but /health needs ``Authorization: Bearer KEY``."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.want = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            got = dict(scope.get("headers") or []).get(b"authorization")
            if got != self.want:
                msg = "invalid or missing API key (Authorization: Bearer KEY)"
                await _error(401, msg)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a body over ``state.max_request_bytes`` is answered 413 at once.

    A declared ``Content-Length`` is checked before a byte is read; a chunked body is read
    up to the limit and refused the moment it passes it (then replayed to the app if it fits).
    Nothing is parsed or tokenized before this check, so a huge body costs the event loop
    nothing but the bytes it reads."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.max_request_bytes
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await _error(400, "the Content-Length header is not a number")(scope, receive, send)
                return
            if n > limit:
                await self._refuse(n, scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding") is None:
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(size, scope, receive, send, at_least=True)
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(
        self, n: int, scope: dict, receive: Any, send: Any, at_least: bool = False
    ) -> None:
        size = f"more than {self.state.max_request_bytes}" if at_least else str(n)
        msg = (f"the request body is {size} bytes; this server takes at most "
               f"{self.state.max_request_bytes} (lmforge serve --max-request-bytes)")  # fmt: skip
        await _error(413, msg)(scope, receive, send)


def _logprobs_json(
    tok: Any, ids: list[int], lps: list[float], tops: list, chat: bool, offset: int = 0
) -> Any:
    if chat:
        content = []
        for j, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            alts = tops[j] if j < len(tops) else {}
            content.append(
                {
                    "token": tok.decode([t]),
                    "logprob": lp,
                    "bytes": list(tok.decode([t]).encode("utf-8")),
                    "top_logprobs": [
                        {"token": tok.decode([a]), "logprob": v, "bytes": None}
                        for a, v in alts.items()
                    ],
                }
            )
        return {"content": content}
    tokens = [tok.decode([t]) for t in ids]
    text_offset = []
    for t in tokens:  # each token's start in the choice's text (after an echoed prompt)
        text_offset.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(lps),
        "top_logprobs": [
            {tok.decode([a]): v for a, v in (tops[j] if j < len(tops) else {}).items()}
            for j in range(len(ids))
        ],
        "text_offset": text_offset,
    }


def _choice_json(i: int, text: str, finish: str | None, chat: bool) -> bytes:
    """One streamed choice without logprobs as JSON bytes, the bytes ``json.dumps`` gives the
    dict the slow path builds (``tests/test_serve_server.py`` checks they are equal)."""
    reason = b"null" if finish is None else b'"' + finish.encode() + b'"'
    if chat:
        if not text and finish is not None:
            return b'{"index": %d, "delta": {}, "logprobs": null, "finish_reason": %s}' % (
                i, reason)  # fmt: skip
        return b'{"index": %d, "delta": {"content": %s}, "logprobs": null, "finish_reason": %s}' % (
            i, json.dumps(text).encode(), reason)  # fmt: skip
    return b'{"index": %d, "text": %s, "logprobs": null, "finish_reason": %s}' % (
        i, json.dumps(text).encode(), reason)  # fmt: skip


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()

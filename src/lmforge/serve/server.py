"""The OpenAI-compatible HTTP server (``lmforge serve``): FastAPI + uvicorn over the engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template,
ChatML when none is recorded), both with ``stream: true`` as server-sent events; ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). With an API key every endpoint
but ``/health`` needs ``Authorization: Bearer KEY``.

Threads: the engine runs in one background thread (:class:`EngineLoop`) that steps while there
is work and hands each request's new state to the asyncio handler waiting for it. Handlers
validate the request (bad ones get an OpenAI-style 4xx JSON error; the server keeps serving),
tokenize, submit, and turn engine outputs into JSON or SSE chunks. A full queue answers 429; a
client that disconnects has its request aborted and its blocks freed; SIGTERM (uvicorn's
graceful shutdown) lets in-flight requests finish before the engine thread stops.

Text: streamed text is decoded incrementally (the whole completion is decoded each time and the
new suffix sent, holding back a trailing incomplete UTF-8 character). ``stop`` strings are
matched on the decoded text; the matched string is cut and the request aborted. The token that
ended a sample (EOS / stop id) is not part of the text.

Exercised by ``pytest tests/test_serve_server.py`` (the official ``openai`` client against a
server on a free 127.0.0.1 port).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from lmforge.serve.engine import Engine, QueueFull, RequestOutput
from lmforge.serve.sampling import SamplingParams
from lmforge.serve.templates import CHATML_TEMPLATE, BadRequest, render_chat
from lmforge.utils.errors import LmforgeError

__all__ = ["CHATML_TEMPLATE", "EngineLoop", "build_app", "render_chat"]

MAX_N = 16


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the handler can read while the engine thread keeps appending to the original."""
    outs = [
        dataclasses.replace(
            o,
            token_ids=list(o.token_ids),
            logprobs=list(o.logprobs),
            policy_versions=list(o.policy_versions),
            top_logprobs=None if o.top_logprobs is None else list(o.top_logprobs),
        )
        for o in out.outputs
    ]
    return RequestOutput(out.request_id, out.prompt_token_ids, outs, out.finished)


class EngineLoop:
    """Runs ``engine.step()`` in a background thread and routes outputs to subscribers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        # None is sent when the engine failed (a bug): the handler answers 500.
        self._subs: dict[str, Callable[[RequestOutput | None], None]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.requests_total = 0
        self._tokens_window: list[tuple[float, int]] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        callback: Callable[[RequestOutput | None], None],
    ) -> str:
        with self._cv:
            rid = self.engine.add_request(prompt, params, request_id=f"cmpl-{uuid.uuid4().hex}")
            self._subs[rid] = callback
            self.requests_total += 1
            self._cv.notify_all()
        return rid

    def abort(self, rid: str) -> None:
        with self._cv:
            self._subs.pop(rid, None)
            self.engine.abort(rid)

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._tokens_window if now - t <= window]
        self._tokens_window = recent
        return sum(n for _, n in recent) / window

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.engine.has_unfinished():
                    self._cv.wait(timeout=0.5)
                if self._stop and not self.engine.has_unfinished():
                    return
            try:
                before = self.engine.stats["generated_tokens"]
                outs = self.engine.step()
                made = self.engine.stats["generated_tokens"] - before
            except Exception as e:  # a bug, not a user error: fail every waiting request loudly
                self.error = e
                with self._cv:
                    subs, self._subs = self._subs, {}
                for rid, cb in subs.items():
                    self.engine.abort(rid)
                    cb(None)  # wake the handler: it answers 500 instead of waiting forever
                continue
            now = time.monotonic()
            if made:
                self._tokens_window.append((now, made))
            for out in outs:
                with self._cv:
                    cb = self._subs.get(out.request_id)
                    if out.finished:
                        self._subs.pop(out.request_id, None)
                if cb is not None:
                    cb(_snapshot(out))


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine loop, the tokenizer and the served model's name."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str
    chat_template: str | None = None
    api_key: str | None = None
    max_default_tokens: int = 512


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
}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


def _sampling(
    body: dict, n_prompt: int, ctx: int, default_max: int, chat: bool
) -> tuple[SamplingParams, list[str]]:
    for pen in ("frequency_penalty", "presence_penalty"):
        if _get(body, pen, (int, float), 0) != 0:
            raise BadRequest(f"'{pen}' is not supported (only 0)", pen)
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
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not 0 <= temperature <= 100:
        raise BadRequest(
            f"'temperature' must be between 0 and 100, got {temperature}", "temperature"
        )
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", int, 0)
    if top_k < 0 and top_k != -1:
        raise BadRequest(f"'top_k' must be >= 0 (or -1 for off), got {top_k}", "top_k")
    min_p = float(_get(body, "min_p", (int, float), 0.0))
    if not 0 <= min_p <= 1:
        raise BadRequest(f"'min_p' must be in [0, 1], got {min_p}", "min_p")
    seed = _get(body, "seed", int, None)
    if chat:
        want = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, 0)
        if not 0 <= top <= 20:
            raise BadRequest(f"'top_logprobs' must be between 0 and 20, got {top}", "top_logprobs")
        logprobs = top if want else None
    else:
        logprobs = _get(body, "logprobs", int, None)
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise BadRequest(f"'logprobs' must be between 0 and 20, got {logprobs}", "logprobs")
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
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=min_p,
        max_tokens=max_tokens,
        n=n,
        seed=seed,
        logprobs=logprobs,
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
    )
    return params, stops


class _TextTracker:
    """Incremental detokenisation and stop-string matching for one sample."""

    def __init__(self, tokenizer: Any, stops: list[str], eos_ids: set[int]) -> None:
        self.tok = tokenizer
        self.stops = stops
        self.eos_ids = eos_ids
        self.sent = ""
        self.stopped = False

    def text_of(self, token_ids: list[int], finish_reason: str | None) -> str:
        ids = token_ids
        if finish_reason == "stop" and ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.tok.decode(ids)

    def update(self, token_ids: list[int], finish_reason: str | None) -> tuple[str, bool]:
        """(new text to send, whether a stop string ended the sample)."""
        text = self.text_of(token_ids, finish_reason)
        for s in self.stops:
            at = text.find(s)
            if at != -1:
                text, self.stopped = text[:at], True
        hold = 0
        if not self.stopped and finish_reason is None:
            if text.endswith("\ufffd"):
                hold = 1  # an incomplete UTF-8 sequence: wait for its next bytes
            for s in self.stops:  # a stop string may be starting: hold its possible prefix
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        visible = text[: len(text) - hold] if hold else text
        if not visible.startswith(self.sent):
            visible = self.sent  # decoding changed earlier text (rare with byte-level BPE)
        new = visible[len(self.sent) :]
        self.sent = visible
        return new, self.stopped


def build_app(state: ServerState) -> Any:
    """The FastAPI application serving ``state``'s engine."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # Started with the server, stopped after uvicorn's graceful shutdown has let in-flight
        # requests finish (SIGTERM drains).
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="lmforge serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    engine = state.loop.engine
    ctx = engine.config.context_length
    eos_ids = {engine.eos_token_id} if engine.eos_token_id is not None else set()

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        if state.api_key and request.url.path != "/health":
            if request.headers.get("authorization") != f"Bearer {state.api_key}":
                return _error(401, "invalid or missing API key (Authorization: Bearer KEY)")
        return await call_next(request)

    @app.get("/health")
    async def health() -> Any:
        if state.loop.error is not None:
            return JSONResponse({"status": "error", "detail": str(state.loop.error)}, 500)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "lmforge"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Any:
        a = engine.allocator
        lines = [
            "# HELP lmforge_requests_running Sequences in the running batch.",
            "# TYPE lmforge_requests_running gauge",
            f"lmforge_requests_running {len(engine.running)}",
            "# HELP lmforge_requests_waiting Sequences waiting for admission.",
            "# TYPE lmforge_requests_waiting gauge",
            f"lmforge_requests_waiting {len(engine.waiting)}",
            "# HELP lmforge_kv_blocks_used KV-cache blocks held by sequences.",
            "# TYPE lmforge_kv_blocks_used gauge",
            f"lmforge_kv_blocks_used {a.num_used}",
            "# HELP lmforge_kv_blocks_total KV-cache blocks.",
            "# TYPE lmforge_kv_blocks_total gauge",
            f"lmforge_kv_blocks_total {a.num_blocks}",
            "# HELP lmforge_generated_tokens_total Tokens sampled.",
            "# TYPE lmforge_generated_tokens_total counter",
            f"lmforge_generated_tokens_total {engine.stats['generated_tokens']}",
            "# HELP lmforge_tokens_per_second Generated tokens per second over the last 10 s.",
            "# TYPE lmforge_tokens_per_second gauge",
            f"lmforge_tokens_per_second {state.loop.tokens_per_second():.3f}",
            "# HELP lmforge_time_to_first_token_seconds Time to first token.",
            "# TYPE lmforge_time_to_first_token_seconds summary",
            f"lmforge_time_to_first_token_seconds_sum {state.loop.ttft_sum:.6f}",
            f"lmforge_time_to_first_token_seconds_count {state.loop.ttft_count}",
            "# HELP lmforge_requests_total Requests accepted.",
            "# TYPE lmforge_requests_total counter",
            f"lmforge_requests_total {state.loop.requests_total}",
            "# HELP lmforge_prefix_cache_hits_total Prefix-cache block hits.",
            "# TYPE lmforge_prefix_cache_hits_total counter",
            f"lmforge_prefix_cache_hits_total {a.hits}",
            "# HELP lmforge_preemptions_total Sequences preempted (recomputed later).",
            "# TYPE lmforge_preemptions_total counter",
            f"lmforge_preemptions_total {engine.stats['preemptions']}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _body(request: Request, fields: set[str]) -> dict:
        try:
            body = json.loads(await request.body())
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

    async def _run(
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        chat: bool,
        stream: bool,
    ) -> Any:
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        t0 = time.monotonic()
        try:
            rid = state.loop.submit(
                prompt, params, lambda o: aloop.call_soon_threadsafe(queue.put_nowait, o)
            )
        except QueueFull as e:
            return _error(429, str(e))
        except LmforgeError as e:
            return _error(400, str(e))
        trackers = [_TextTracker(state.tokenizer, stops, eos_ids) for _ in range(params.n)]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice_delta(i: int, text: str, finish: str | None, out: Any, new: int) -> dict:
            lp = None
            if out is not None and params.logprobs is not None and new:
                toks = out.token_ids[-new:]
                lps = out.logprobs[-new:]
                tops = (out.top_logprobs or [])[-new:]
                lp = _logprobs_json(state.tokenizer, toks, lps, tops, chat)
            if chat:
                delta = {"content": text} if text or finish is None else {}
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

        async def events() -> AsyncIterator[bytes]:
            finished = [False] * params.n
            counts = [0] * params.n
            first = True
            try:
                if chat:  # OpenAI sends the role first
                    for i in range(params.n):
                        head = {"index": i, "delta": {"role": "assistant", "content": ""}}
                        head["finish_reason"] = None
                        chunk = _chunk(rid, kind, created, state.model_name, [head], chat)
                        yield _sse(chunk)
                while not all(finished):
                    out = await queue.get()
                    if out is None:
                        err = {"error": {"message": f"engine failed: {state.loop.error}",
                                         "type": "server_error", "param": None, "code": None}}  # fmt: skip
                        yield _sse(err)
                        finished = [True] * params.n
                        return
                    if first:
                        first = False
                        state.loop.ttft_sum += time.monotonic() - t0
                        state.loop.ttft_count += 1
                    choices = []
                    for o in out.outputs:
                        i = o.index
                        if finished[i]:
                            continue
                        text, hit = trackers[i].update(o.token_ids, o.finish_reason)
                        finish = "stop" if hit else o.finish_reason
                        new = len(o.token_ids) - counts[i]
                        counts[i] = len(o.token_ids)
                        if text or finish or new:
                            choices.append(choice_delta(i, text, finish, o, new))
                        if finish:
                            finished[i] = True
                    if all(finished) and not out.finished:
                        state.loop.abort(rid)  # stop strings ended every sample
                    if choices:
                        yield _sse(_chunk(rid, kind, created, state.model_name, choices, chat))
                yield b"data: [DONE]\n\n"
            finally:
                if not all(finished):
                    state.loop.abort(rid)  # client went away: free the blocks now

        if stream:
            return StreamingResponse(events(), media_type="text/event-stream")

        final: dict[int, Any] = {}
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        try:
            while len(reasons) < params.n:
                get = asyncio.ensure_future(queue.get())
                while not get.done():
                    done, _ = await asyncio.wait({get}, timeout=0.5)
                    if not done and await request.is_disconnected():
                        get.cancel()
                        state.loop.abort(rid)
                        return _error(499, "client disconnected")
                out = get.result()
                if out is None:
                    reasons = dict.fromkeys(range(params.n), "error")
                    return _error(500, f"engine failed: {state.loop.error}")
                if not texts:
                    state.loop.ttft_sum += time.monotonic() - t0
                    state.loop.ttft_count += 1
                for o in out.outputs:
                    if o.index in reasons:
                        continue
                    _text, hit = trackers[o.index].update(o.token_ids, o.finish_reason)
                    texts[o.index] = trackers[o.index].sent
                    final[o.index] = o
                    if hit or o.finish_reason:
                        reasons[o.index] = "stop" if hit else o.finish_reason
                if len(reasons) == params.n and not out.finished:
                    state.loop.abort(rid)
        finally:
            if len(reasons) < params.n:
                state.loop.abort(rid)
        choices = []
        completion_tokens = 0
        for i in range(params.n):
            o = final[i]
            completion_tokens += len(o.token_ids)
            lp = None
            if params.logprobs is not None:
                lp = _logprobs_json(
                    state.tokenizer, o.token_ids, o.logprobs, o.top_logprobs or [], chat
                )
            if chat:
                msg = {"role": "assistant", "content": texts[i]}
                choices.append(
                    {"index": i, "message": msg, "logprobs": lp, "finish_reason": reasons[i]}
                )
            else:
                choices.append(
                    {"index": i, "text": texts[i], "logprobs": lp, "finish_reason": reasons[i]}
                )
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
        }
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": usage,
        }

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await _body(request, _CHAT_FIELDS if chat else _COMPLETION_FIELDS)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise BadRequest("'messages' must be a non-empty list", "messages")
                for m in messages:
                    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                        raise BadRequest("each message needs a string 'role'", "messages")
                    if not isinstance(m.get("content"), str):
                        raise BadRequest("each message needs a string 'content'", "messages")
                text = render_chat(state.chat_template, messages, **_special_names(state))
                prompt = state.tokenizer.encode(text)
            else:
                raw = body.get("prompt")
                if isinstance(raw, str):
                    prompt = state.tokenizer.encode(raw)
                elif (
                    isinstance(raw, list)
                    and raw
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
                ):
                    prompt = list(raw)
                elif isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
                    prompt = state.tokenizer.encode(raw[0])
                else:
                    raise BadRequest(
                        "'prompt' must be a string or a non-empty list of token ids", "prompt"
                    )
                if body.get("echo"):
                    raise BadRequest("'echo' is not supported", "echo")
            if not prompt:
                raise BadRequest("the prompt is empty", "messages" if chat else "prompt")
            vocab = engine.config.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise BadRequest(f"token ids must be in [0, {vocab})", "prompt")
            params, stops = _sampling(body, len(prompt), ctx, state.max_default_tokens, chat)
            stream = bool(_get(body, "stream", bool, False))
        except BadRequest as e:
            return _error(e.status, e.message, e.param)
        return await _run(request, prompt, params, stops, chat, stream)

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


def _special_names(state: ServerState) -> dict[str, str]:
    out = {}
    eos = state.loop.engine.eos_token_id
    if eos is not None:
        out["eos_token"] = state.tokenizer.decode([eos])
    return out


def _logprobs_json(tok: Any, ids: list[int], lps: list[float], tops: list, chat: bool) -> Any:
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
    return {
        "tokens": [tok.decode([t]) for t in ids],
        "token_logprobs": list(lps),
        "top_logprobs": [
            {tok.decode([a]): v for a, v in (tops[j] if j < len(tops) else {}).items()}
            for j in range(len(ids))
        ],
        "text_offset": None,
    }


def _chunk(rid: str, kind: str, created: int, model: str, choices: list, chat: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else kind,
        "created": created,
        "model": model,
        "choices": choices,
    }


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()

"""The OpenAI-compatible HTTP server (``lmforge serve``): FastAPI + uvicorn over the engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat template,
ChatML when none is recorded), both with ``stream: true`` as server-sent events; ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). With an API key every endpoint
but ``/health`` needs ``Authorization: Bearer KEY``.

Threads: the engine runs in one background thread (:class:`EngineLoop`) that steps while there
is work. Handlers validate the request (bad ones get an OpenAI-style 4xx JSON error; the server
keeps serving), tokenize and submit it to an inbox the engine thread drains between steps (the
event loop never waits for a step). After each step the engine thread hands every request's
:class:`Delta` (new ids, logprobs, text) to the event loop in one ``call_soon_threadsafe``; a
handler that fell behind sends what piled up as one SSE chunk. A full queue answers 429; a
client that disconnects has its request aborted and its blocks freed; SIGTERM (uvicorn's
graceful shutdown) lets in-flight requests finish before the engine thread stops.

Text: the engine detokenizes incrementally and ends samples on ``stop`` strings itself
(:mod:`lmforge.serve.detok`), so streamed and non-streamed text are the same released pieces
and a stream never shows text past a stop string. The token that ended a sample (EOS / stop
id) and the matched stop string are not part of the text.

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
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from lmforge.serve.engine import Engine, QueueFull, RequestOutput
from lmforge.serve.sampling import SamplingParams
from lmforge.serve.templates import CHATML_TEMPLATE, BadRequest, render_chat
from lmforge.utils.errors import LmforgeError

__all__ = ["CHATML_TEMPLATE", "EngineLoop", "build_app", "render_chat"]

MAX_N = 16


@dataclasses.dataclass(slots=True)
class SampleDelta:
    """What one sample gained in one engine step (the engine thread builds it: O(new))."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    text: str
    finish_reason: str | None


@dataclasses.dataclass(slots=True)
class Delta:
    """A request's progress in one engine step; ``error`` set when the engine failed."""

    samples: list[SampleDelta]
    finished: bool
    error: str | None = None
    status: int = 500
    "the HTTP status of ``error`` (429: the queue filled up before the request was admitted)"


class _Sub:
    """A request the loop routes deltas for: its event loop, its queue, what it was sent."""

    __slots__ = ("aloop", "n_pieces", "n_tokens", "queue")

    def __init__(self, aloop: asyncio.AbstractEventLoop, queue: asyncio.Queue, n: int) -> None:
        self.aloop, self.queue = aloop, queue
        self.n_tokens = [0] * n
        self.n_pieces = [0] * n

    def delta(self, out: RequestOutput) -> Delta:
        samples = []
        for o in out.outputs:
            i = o.index
            a, b = self.n_tokens[i], len(o.token_ids)
            pa, pb = self.n_pieces[i], len(o.text_pieces)
            if a == b and pa == pb and o.finish_reason is None:
                continue
            self.n_tokens[i], self.n_pieces[i] = b, pb
            tops = o.top_logprobs[a:b] if o.top_logprobs is not None else []
            text = o.text_pieces[pa] if pb == pa + 1 else "".join(o.text_pieces[pa:pb])
            samples.append(
                SampleDelta(i, o.token_ids[a:b], o.logprobs[a:b], tops, text, o.finish_reason)
            )
        return Delta(samples, out.finished)


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


class EngineLoop:
    """Runs ``engine.step()`` in a background thread and routes outputs to subscribers.

    The hand-offs are batched: requests arriving from the event loop go into an inbox the
    engine thread drains before its next step (the event loop never waits for a step to end),
    and after each step the engine thread sends *one* ``call_soon_threadsafe`` per event loop
    carrying every request's :class:`Delta` (new ids, logprobs and text since the last step,
    sliced from the end: O(new tokens)). Aborts go through an inbox the same way.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: deque[tuple[str, list[int], SamplingParams, _Sub]] = deque()
        self._aborts: deque[str] = deque()
        self._subs: dict[str, _Sub] = {}  # the engine thread's: requests it routes
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.requests_total = 0
        self.step_seconds = 0.0  # time inside engine.step() (the rest of the loop is hand-off)
        self.step_count = 0
        self._tokens_window: deque[tuple[float, int]] = deque()
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
        queue: asyncio.Queue,
        aloop: asyncio.AbstractEventLoop | None = None,
    ) -> str:
        """Queue a request whose :class:`Delta` objects go to ``queue`` (on ``aloop``, the
        running loop by default). Invalid requests raise LmforgeError; a full queue QueueFull.
        Does not wait for the engine thread (it is usually inside a step)."""
        eng = self.engine
        prompt = eng.check_request(prompt, params)
        if eng.max_queue is not None and len(eng.waiting) + len(self._inbox) >= eng.max_queue:
            raise QueueFull(f"the queue is full ({eng.max_queue} requests waiting)")
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub = _Sub(aloop or asyncio.get_running_loop(), queue, params.n)
        with self._cv:
            self._inbox.append((rid, prompt, params, sub))
            self.requests_total += 1
            self._cv.notify_all()
        return rid

    def abort(self, rid: str) -> None:
        """Drop a request (the engine thread frees its blocks before its next step)."""
        with self._cv:
            self._aborts.append(rid)
            self._cv.notify_all()

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._tokens_window) if now - t <= window]
        return sum(n for _, n in recent) / window

    def _drain(self) -> list[tuple[_Sub, Delta]]:
        """Admit the inbox, apply aborts (engine thread). Refusals to deliver, if any."""
        failed = []
        while self._inbox:
            rid, prompt, params, sub = self._inbox.popleft()
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except LmforgeError as e:  # a race with the queue bound: say so to the handler
                status = 429 if isinstance(e, QueueFull) else 400
                failed.append((sub, Delta([], True, str(e), status)))
                continue
            self._subs[rid] = sub
        while self._aborts:  # after admission: an abort may follow its submit in one drain
            rid = self._aborts.popleft()
            self._subs.pop(rid, None)
            self.engine.abort(rid)
        return failed

    def _send(self, items: list[tuple[_Sub, Delta]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sub, delta in items:
            by_loop.setdefault(sub.aloop, []).append((sub.queue, delta))
        for aloop, batch in by_loop.items():
            try:
                aloop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while (
                    not self._stop
                    and not self._inbox
                    and not self._aborts
                    and not engine.has_unfinished()
                ):
                    self._cv.wait(timeout=0.5)
                if self._stop and not self._inbox and not engine.has_unfinished():
                    return
            items = self._drain()
            try:
                before = engine.stats["generated_tokens"]
                outs = []
                if engine.has_unfinished():
                    t0 = time.perf_counter()
                    outs = engine.step()
                    self.step_seconds += time.perf_counter() - t0
                    self.step_count += 1
                made = engine.stats["generated_tokens"] - before
            except Exception as e:  # a bug, not a user error: fail every waiting request loudly
                self.error = e
                subs, self._subs = self._subs, {}
                for rid in subs:
                    engine.abort(rid)
                msg = f"engine failed: {e}"
                self._send(items + [(sub, Delta([], True, msg)) for sub in subs.values()])
                continue
            if made:
                self._tokens_window.append((time.monotonic(), made))
                while len(self._tokens_window) > 4096:
                    self._tokens_window.popleft()
            for out in outs:
                sub = self._subs.get(out.request_id)
                if sub is None:
                    continue  # aborted meanwhile
                if out.finished:
                    del self._subs[out.request_id]
                items.append((sub, sub.delta(out)))
            if items:
                self._send(items)


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
        stop=stops,
    )
    return params, stops


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
    if engine.tokenizer is None:  # the engine detokenizes and matches stop strings
        engine.set_tokenizer(state.tokenizer)
    ctx = engine.config.context_length
    if state.api_key:
        # A plain ASGI middleware: starlette's BaseHTTPMiddleware would put every streamed
        # chunk through an extra task and memory stream.
        app.add_middleware(_ApiKey, key=state.api_key)

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
            "# HELP lmforge_engine_step_seconds Time inside engine steps (hand-offs excluded).",
            "# TYPE lmforge_engine_step_seconds summary",
            f"lmforge_engine_step_seconds_sum {state.loop.step_seconds:.6f}",
            f"lmforge_engine_step_seconds_count {state.loop.step_count}",
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
        chat: bool,
        stream: bool,
    ) -> Any:
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        t0 = time.monotonic()
        try:
            rid = state.loop.submit(prompt, params, queue)
        except QueueFull as e:
            return _error(429, str(e))
        except LmforgeError as e:
            return _error(400, str(e))
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        want_lp = params.logprobs is not None
        tok = state.tokenizer

        def first_seen() -> None:
            state.loop.ttft_sum += time.monotonic() - t0
            state.loop.ttft_count += 1

        if stream:
            # Everything but the choices is the same in every chunk: encode it once.
            obj = "chat.completion.chunk" if chat else kind
            head = (
                f'data: {{"id": "{rid}", "object": "{obj}", "created": {created}, '
                f'"model": {json.dumps(state.model_name)}, "choices": '
            ).encode()

            def chunk(choices: list) -> bytes:
                return head + json.dumps(choices).encode() + b"}\n\n"

            async def events() -> AsyncIterator[bytes]:
                finished = [False] * params.n
                first = True
                try:
                    if chat:  # OpenAI sends the role first
                        yield chunk(
                            [
                                {"index": i, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None}
                                for i in range(params.n)
                            ]
                        )  # fmt: skip
                    while not all(finished):
                        deltas = [await queue.get()]
                        while not queue.empty():  # behind: send what piled up as one chunk
                            deltas.append(queue.get_nowait())
                        error = next((d.error for d in deltas if d.error), None)
                        if error is not None:
                            err = {"message": error, "type": "server_error", "param": None,
                                   "code": None}  # fmt: skip
                            yield _sse({"error": err})
                            finished = [True] * params.n
                            return
                        if first:
                            first = False
                            first_seen()
                        choices = []
                        for i, parts in _merge(deltas).items():
                            text, finish, ids, lps, tops = parts
                            lp = _logprobs_json(tok, ids, lps, tops, chat) if want_lp else None
                            if chat:
                                delta = {"content": text} if text or finish is None else {}
                                choices.append({"index": i, "delta": delta, "logprobs": lp,
                                                "finish_reason": finish})  # fmt: skip
                            else:
                                choices.append({"index": i, "text": text, "logprobs": lp,
                                                "finish_reason": finish})  # fmt: skip
                            if finish is not None:
                                finished[i] = True
                        if choices:
                            yield chunk(choices)
                    yield b"data: [DONE]\n\n"
                finally:
                    if not all(finished):
                        state.loop.abort(rid)  # client went away: free the blocks now

            return StreamingResponse(events(), media_type="text/event-stream")

        texts: list[list[str]] = [[] for _ in range(params.n)]
        ids: list[list[int]] = [[] for _ in range(params.n)]
        lps: list[list[float]] = [[] for _ in range(params.n)]
        tops: list[list[dict]] = [[] for _ in range(params.n)]
        reasons: dict[int, str] = {}
        first = True
        try:
            while len(reasons) < params.n:
                get = asyncio.ensure_future(queue.get())
                while not get.done():
                    done, _ = await asyncio.wait({get}, timeout=0.5)
                    if not done and await request.is_disconnected():
                        get.cancel()
                        return _error(499, "client disconnected")
                d = get.result()
                if d.error is not None:
                    reasons = dict.fromkeys(range(params.n), "error")
                    return _error(d.status, d.error)
                if first:
                    first = False
                    first_seen()
                for sd in d.samples:
                    i = sd.index
                    texts[i].append(sd.text)
                    ids[i] += sd.token_ids
                    lps[i] += sd.logprobs
                    tops[i] += sd.top_logprobs
                    if sd.finish_reason is not None:
                        reasons[i] = sd.finish_reason
        finally:
            if len(reasons) < params.n:
                state.loop.abort(rid)
        choices = []
        for i in range(params.n):
            text = "".join(texts[i])
            lp = _logprobs_json(tok, ids[i], lps[i], tops[i], chat) if want_lp else None
            if chat:
                msg = {"role": "assistant", "content": text}
                choices.append(
                    {"index": i, "message": msg, "logprobs": lp, "finish_reason": reasons[i]}
                )
            else:
                choices.append(
                    {"index": i, "text": text, "logprobs": lp, "finish_reason": reasons[i]}
                )
        completion_tokens = sum(len(x) for x in ids)
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
            params, _stops = _sampling(body, len(prompt), ctx, state.max_default_tokens, chat)
            stream = bool(_get(body, "stream", bool, False))
        except BadRequest as e:
            return _error(e.status, e.message, e.param)
        return await _run(request, prompt, params, chat, stream)

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


def _merge(deltas: list[Delta]) -> dict[int, tuple[str, str | None, list, list, list]]:
    """Per sample: (text, finish reason, ids, logprobs, top logprobs) over several deltas."""
    if len(deltas) == 1:
        return {
            sd.index: (sd.text, sd.finish_reason, sd.token_ids, sd.logprobs, sd.top_logprobs)
            for sd in deltas[0].samples
        }
    out: dict[int, tuple[str, str | None, list, list, list]] = {}
    for d in deltas:
        for sd in d.samples:
            if sd.index in out:
                text, _f, ids, lps, tops = out[sd.index]
                out[sd.index] = (text + sd.text, sd.finish_reason, ids + sd.token_ids,
                                 lps + sd.logprobs, tops + sd.top_logprobs)  # fmt: skip
            else:
                out[sd.index] = (sd.text, sd.finish_reason, sd.token_ids, sd.logprobs,
                                 sd.top_logprobs)  # fmt: skip
    return out


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

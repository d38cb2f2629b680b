"""The OpenAI-compatible server with the official ``openai`` client on a free 127.0.0.1 port:
completion, chat, streaming, bad requests (4xx, server keeps serving), API key, metrics, 429,
disconnect frees blocks, and a 64-client streaming load test equal to solo greedy runs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from conftest import optional_import
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.server import EngineLoop, ServerState, make_server
from lmforge.serve.templates import render_chat
from lmforge.tokenizer import Tokenizer

openai = optional_import("openai")
uvicorn = optional_import("uvicorn")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], SPECIALS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(
        self, engine: Engine, api_key: str | None = None, tok: object = None, **state: object
    ) -> None:
        self.tok = tok or _tokenizer()
        self.engine = engine
        self.state = ServerState(EngineLoop(engine), self.tok, "tiny", None, api_key, **state)
        self.port = _free_port()
        self.server = make_server(self.state, host="127.0.0.1", port=self.port, log_level="error")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _model() -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=259, context_length=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return TransformerLM(cfg).eval()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    tok = _tokenizer()
    engine = Engine(
        _model(), block_size=8, num_blocks=400, eos_token_id=tok.special_ids["<|im_end|>"]
    )
    s = _Server(engine)
    yield s
    s.close()


def _solo(server: _Server, prompt: str, max_tokens: int) -> str:
    """What the request gets alone: a fresh engine on the same weights, greedy."""
    ids = server.tok.encode(prompt)
    e = Engine(server.engine.model, block_size=8, eos_token_id=server.engine.eos_token_id)
    out = e.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]
    toks = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
    return server.tok.decode(toks)


def test_completion_chat_and_models(server: _Server) -> None:
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0)
    assert r.choices[0].text == _solo(server, "Hello", 10)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens <= 10
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    want = _solo(server, render_chat(None, msgs), 8)
    assert chat.choices[0].message.content == want
    assert chat.choices[0].message.role == "assistant"
    lp = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert len(content) >= 1 and len(content[0].top_logprobs) == 2
    assert content[0].logprob <= 0


def test_streaming_equals_non_streaming(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    c = server.client()
    full = c.completions.create(model="tiny", prompt="Stream me", max_tokens=12, temperature=0)
    # Each engine step after the first waits until the client has read a chunk: the stream's
    # chunking is then one per step however busy the machine (a handler that falls behind
    # rightly sends what piled up as one chunk, which would make the count a matter of timing).
    read, gated = threading.Semaphore(0), {"on": True, "first": True}
    real_step = server.engine.step

    def step():  # the engine thread's
        if gated["on"] and not gated["first"]:
            read.acquire(timeout=30)
        gated["first"] = False
        return real_step()

    monkeypatch.setattr(server.engine, "step", step)
    parts = []
    for ch in c.completions.create(
        model="tiny", prompt="Stream me", max_tokens=12, temperature=0, stream=True
    ):
        parts.append(ch.choices[0].text)
        read.release()
    gated["on"] = False
    read.release()
    assert "".join(parts) == full.choices[0].text and len(parts) > 1
    msgs = [{"role": "user", "content": "abc"}]
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == _solo(server, render_chat(None, msgs), 6)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_and_n(server: _Server) -> None:
    c = server.client()
    base = c.completions.create(model="tiny", prompt="xyz", max_tokens=20, temperature=0)
    text = base.choices[0].text
    if len(text) >= 4:
        stop = text[2:4]
        cut = c.completions.create(
            model="tiny", prompt="xyz", max_tokens=20, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"
    many = c.completions.create(model="tiny", prompt="xyz", max_tokens=5, n=3, seed=1)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert server.engine.allocator.num_used == 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "not valid JSON"),
        ({"prompt": "x", "bogus": 1}, 400, "unknown field 'bogus'"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "model 'gpt-9' does not exist"),
        ({"prompt": "x", "max_tokens": -1}, 400, "'max_tokens' must be at least 1"),
        ({"prompt": "x", "max_tokens": 10**9}, 400, "leaves room for"),
        ({"prompt": "x" * 300}, 400, "context is 256 tokens"),
        ({"prompt": "y" * 100_000}, 400, "context is 256 tokens"),  # parsed in a thread
        ({"prompt": "x", "n": 99}, 400, "'n' must be in [1, 16]"),
        ({"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": 5}, 400, "'prompt' must be a string"),
        ({"prompt": "x", "stream": "yes"}, 400, "'stream' must be a boolean"),
        ({"prompt": [1, 9999]}, 400, "token ids must be in [0, 259)"),
    ],
)
def test_bad_requests_get_openai_errors(server: _Server, body, status: int, needle: str) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        server.url + "/v1/completions", content=data, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = server.client().completions.create(model="tiny", prompt="still up", max_tokens=2)
    assert ok.choices[0].text is not None


def test_chat_bad_messages_and_the_client_raises(server: _Server) -> None:
    c = server.client()
    with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
        c.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x")


def test_metrics_and_health(server: _Server) -> None:
    server.client().completions.create(model="tiny", prompt="m", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "lmforge_requests_running",
        "lmforge_requests_waiting",
        "lmforge_kv_blocks_used 0",
        "lmforge_tokens_per_second",
        "lmforge_time_to_first_token_seconds_count",
    ):
        assert name in text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_disconnect_mid_stream_frees_blocks(server: _Server) -> None:
    body = {
        "prompt": "long one",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    for _ in range(100):  # the engine thread notices within a step or two
        if server.engine.allocator.num_used == 0 and not server.engine.has_unfinished():
            break
        time.sleep(0.05)
    assert server.engine.allocator.num_used == 0
    assert not server.engine.has_unfinished()


def test_api_key_and_full_queue() -> None:
    tok = _tokenizer()
    engine = Engine(_model(), block_size=8, num_blocks=64, max_queue=0, eos_token_id=None)
    s = _Server(engine, api_key="sekrit")
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # open without the key
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert httpx.get(s.url + "/metrics").status_code == 401
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            s.client("sekrit").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert tok is not None
    finally:
        s.close()


def test_64_concurrent_streaming_clients_equal_solo_runs(server: _Server) -> None:
    prompts = [f"client {i}: " + "ab" * (i % 7) for i in range(64)]
    want = [_solo(server, p, 8) for p in prompts]

    async def one(client: openai.AsyncOpenAI, p: str) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=p, max_tokens=8, temperature=0, stream=True
        )
        return "".join([ch.choices[0].text async for ch in stream])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == want
    assert server.engine.allocator.num_used == 0


def test_chat_repl_streams_replies() -> None:
    import io

    from lmforge.serve.chat import chat_repl

    tok = _tokenizer()
    engine = Engine(_model(), block_size=8, eos_token_id=tok.special_ids["<|im_end|>"])
    out = io.StringIO()
    chat_repl(engine, tok, None, 0.0, 6, None, io.StringIO("hello\n/reset\nagain\n/quit\n"), out)
    lines = out.getvalue().split("\n")
    want = _solo_engine(engine, tok, [{"role": "user", "content": "hello"}], 6)
    assert lines[0] == want and "(history cleared)" in lines
    assert engine.allocator.num_used == 0


def _solo_engine(engine: Engine, tok: Tokenizer, msgs: list, n: int) -> str:
    e = Engine(engine.model, block_size=8, eos_token_id=engine.eos_token_id)
    out = e.generate(
        [tok.encode(render_chat(None, msgs))], SamplingParams(temperature=0, max_tokens=n)
    )
    ids = out[0].outputs[0].token_ids
    return tok.decode(ids[:-1] if out[0].outputs[0].finish_reason == "stop" else ids)


def test_cli_help_lists_examples() -> None:
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    for cmd in ("serve", "chat"):
        r = subprocess.run(
            [sys.executable, "-m", "lmforge", cmd, "--help"],
            capture_output=True, text=True, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert r.returncode == 0 and "examples:" in r.stdout and "--gguf" in r.stdout
        assert "--no-cuda-graphs" in r.stdout and "--no-compile" in r.stdout
        assert ("--max-request-bytes" in r.stdout) == (cmd == "serve")


def test_engine_failure_answers_500_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(_model(), block_size=8, num_blocks=64)
    s = _Server(engine)
    try:

        def boom() -> list:
            raise RuntimeError("simulated kernel failure")

        monkeypatch.setattr(engine, "step", boom)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 500
    finally:
        s.close()


def test_stop_strings_streamed_equals_non_streamed(server: _Server) -> None:
    """The output processor ends the sample at the token completing the stop string (its ids
    and usage end there; the engine's request is aborted); streamed chunks concatenate to the
    non-streamed text, never past the stop string."""
    c = server.client()
    e = Engine(server.engine.model, block_size=8, tokenizer=server.tok)
    ids = e.generate([server.tok.encode("stop here")], SamplingParams(temperature=0, max_tokens=24))
    ids = ids[0].outputs[0].token_ids
    text = server.tok.decode(ids)
    at = next(i for i in range(2, len(text)) if text[i : i + 3].isascii() and len(text) >= i + 3)
    stop = text[at : at + 3]  # three one-byte tokens: spans token boundaries
    cut = text.find(stop)
    n_tok = next(k for k in range(1, len(ids) + 1) if stop in server.tok.decode(ids[:k]))
    full = c.completions.create(
        model="tiny", prompt="stop here", max_tokens=24, temperature=0, stop=[stop, "\x00\x01"]
    )
    assert full.choices[0].text == text[:cut] and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == n_tok
    parts, reasons = [], []
    for ch in c.completions.create(
        model="tiny", prompt="stop here", max_tokens=24, temperature=0, stop=stop, stream=True
    ):
        parts.append(ch.choices[0].text)
        reasons.append(ch.choices[0].finish_reason)
    assert "".join(parts) == text[:cut] and reasons[-1] == "stop"
    _wait_idle(server.engine)


def _wait_idle(engine: Engine) -> None:
    for _ in range(200):  # an abort is applied by the engine thread before its next step
        if engine.allocator.num_used == 0 and not engine.has_unfinished():
            break
        time.sleep(0.05)
    assert engine.allocator.num_used == 0 and not engine.has_unfinished()


def test_submissions_do_not_wait_for_the_engine_lock(server: _Server) -> None:
    """The event loop never blocks on a running step: while the engine lock is held (a step in
    progress), a request is still accepted into the inbox and answered once the step ends."""
    result: dict = {}
    total = server.state.loop.requests_total

    def call() -> None:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "q", "max_tokens": 2},
                       timeout=60)  # fmt: skip
        result["status"] = r.status_code

    with server.engine.lock:
        t = threading.Thread(target=call)
        t.start()
        for _ in range(600):  # liveness, not speed: the submit returns while the lock is held
            if server.state.loop.requests_total > total:
                break
            time.sleep(0.05)
        assert server.state.loop.requests_total == total + 1
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    t.join(timeout=60)
    assert result["status"] == 200


def test_engine_loop_hands_off_once_per_step_for_all_requests() -> None:
    """One message per engine step carries every request's delta (not one per request per
    token); the deltas add up to the engine's own outputs."""
    from lmforge.serve.output import Delta, OutputProcessor

    tok = _tokenizer()
    engine = Engine(_model(), block_size=8, num_blocks=200, tokenizer=tok)

    async def main() -> tuple[list[list[Delta]], int]:
        loop = EngineLoop(engine)
        real, calls = loop._dispatch, []

        def dispatch(msg: tuple) -> None:  # the event loop's side of the pipe
            calls.append(msg[0] == "out" and bool(msg[1][0]))  # a message carrying deltas
            real(msg)

        loop._dispatch = dispatch  # type: ignore[method-assign]
        queues = [asyncio.Queue() for _ in range(8)]
        for i, q in enumerate(queues):
            p = SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True)
            loop.submit(tok.encode(f"req {i}"), p, q)
        loop.start()
        got: list[list[Delta]] = [[] for _ in queues]
        for i, q in enumerate(queues):
            while not got[i] or not got[i][-1].finished:
                got[i].append(await asyncio.wait_for(q.get(), 60))
        loop.stop()
        return got, sum(calls)

    got, calls = asyncio.run(main())
    assert calls == engine.stats["steps"]  # one hand-off per step, whatever the batch
    for i, deltas in enumerate(got):
        ids = [t for d in deltas for s in d.samples for t in s.token_ids]
        text = OutputProcessor(tok, tok.encode(f"req {i}"), 1, []).process(deltas)[0].text
        solo = Engine(engine.model, block_size=8, tokenizer=tok).generate(
            [tok.encode(f"req {i}")], SamplingParams(temperature=0, max_tokens=6 + i)
        )[0]
        assert len(ids) == 6 + i and text == tok.decode(ids)
        assert ids[: len(solo.outputs[0].token_ids)] == solo.outputs[0].token_ids[: len(ids)]
    assert engine.allocator.num_used == 0


def test_a_message_bigger_than_the_socket_buffer_survives_a_non_blocking_loop() -> None:
    """uvloop's add_reader (libuv) makes the pipe's socket non-blocking, and a message bigger
    than the socket's buffer (an image's pixels, a long prompt) then stopped half-way: the
    engine waited forever for the rest (vlm_serve's hung image request on the GPU host). Under
    a loop that does the same, the big request reaches the engine whole (an image for a text
    model: its one-line 400) and the next request is served."""
    import os

    import numpy as np

    tok = _tokenizer()
    engine = Engine(_model(), block_size=8, num_blocks=200, tokenizer=tok)

    async def main() -> tuple[object, list[object]]:
        aloop = asyncio.get_running_loop()
        real = aloop.add_reader

        def add_reader(fd: int, callback: object, *args: object) -> None:
            real(fd, callback, *args)
            os.set_blocking(fd, False)  # what libuv's uv_poll_init does to the fd

        aloop.add_reader = add_reader  # type: ignore[method-assign]
        loop = EngineLoop(engine)
        loop.start()
        pixels = np.random.default_rng(0).random((6, 3, 224, 224), dtype=np.float32)  # 3.6 MB
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        q_image, q_text = asyncio.Queue(), asyncio.Queue()
        loop.submit(tok.encode("look"), params, q_image, images=(pixels, [], []))
        loop.submit(tok.encode("then this"), params, q_text)
        refused = await asyncio.wait_for(q_image.get(), 30)
        text = [await asyncio.wait_for(q_text.get(), 30)]
        while not text[-1].finished:
            text.append(await asyncio.wait_for(q_text.get(), 30))
        loop.stop()
        return refused, text

    refused, text = asyncio.run(main())
    assert refused.finished and refused.status == 400 and "vision tower" in refused.error
    assert sum(len(s.token_ids) for d in text for s in d.samples) == 3
    assert text[-1].error is None


def test_one_template_renderer_for_server_and_posttrain() -> None:
    # the server and post-training render through lmforge.serve.templates.render_template:
    # a broken template is one ChatTemplateError line, which the server answers as a 400
    from lmforge.serve.templates import BadRequest, ChatTemplateError, render_chat, render_template

    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(None, msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError, match="cannot be rendered"):
        render_template("{% for m in messages %}", msgs)
    with pytest.raises(BadRequest) as e:
        render_chat("{{ raise_exception('no system role') }}", msgs)
    assert (
        e.value.status == 400 and e.value.param == "messages" and "no system role" in str(e.value)
    )


def test_content_parts_roles_and_developer(server: _Server) -> None:
    c = server.client()
    plain = [{"role": "user", "content": "one\ntwo"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                          {"type": "text", "text": "two"}]}]  # fmt: skip
    a = c.chat.completions.create(model="tiny", messages=plain, max_tokens=6, temperature=0)
    b = c.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    dev = [{"role": "developer", "content": "terse"}, {"role": "user", "content": "hi"}]
    sys_ = [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]
    d = c.chat.completions.create(model="tiny", messages=dev, max_tokens=4, temperature=0)
    s = c.chat.completions.create(model="tiny", messages=sys_, max_tokens=4, temperature=0)
    assert d.choices[0].message.content == s.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="unknown message role 'wizard'"):
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError, match="text only"):
        c.chat.completions.create(model="tiny", messages=image)


def test_stream_options_include_usage(server: _Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "count"}]
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=7, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    n_prompt = len(server.tok.encode(render_chat(None, msgs)))
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(ch.usage is None for ch in chunks[:-1])
    plain = list(c.completions.create(model="tiny", prompt="x", max_tokens=3, stream=True))
    assert all(ch.usage is None and ch.choices for ch in plain)
    with pytest.raises(openai.BadRequestError, match="only allowed with 'stream': true"):
        c.completions.create(model="tiny", prompt="x", stream_options={"include_usage": True})


class _CountingTokenizer:
    """The test tokenizer, counting encode calls (the body limit must come before them)."""

    def __init__(self) -> None:
        self.inner = _tokenizer()
        self.encodes = 0

    def encode(self, text: str) -> list[int]:
        self.encodes += 1
        return self.inner.encode(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_request_body_limit_is_checked_before_parsing() -> None:
    engine = Engine(_model(), block_size=8, num_blocks=64)
    counting = _CountingTokenizer()
    s = _Server(engine, tok=counting, max_request_bytes=2000)
    try:
        big = json.dumps({"prompt": "x" * (20 << 20), "max_tokens": 1})  # a 20 MB body
        r = httpx.post(s.url + "/v1/completions", content=big, timeout=60,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 413 and "takes at most 2000" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
            for _ in range(10):
                yield b" " * 500

        r = httpx.post(s.url + "/v1/completions", content=chunks(), timeout=60)
        assert r.status_code == 413 and "more than 2000" in r.json()["error"]["message"]
        assert counting.encodes == 0
        small = s.client().completions.create(model="tiny", prompt="ok", max_tokens=2)
        assert small.usage.prompt_tokens == 2 and counting.encodes == 1
        r = httpx.post(s.url + "/v1/completions", content=_chunked_json({"prompt": "ok",
                       "max_tokens": 2}), timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text  # a chunked body under the limit is replayed
    finally:
        s.close()


def _chunked_json(body: dict) -> Iterator[bytes]:
    data = json.dumps(body).encode()
    yield data[:5]
    yield data[5:]


def test_sigterm_drains_health_503_new_requests_503() -> None:
    import signal

    engine = Engine(_model(), block_size=8, num_blocks=64)
    s = _Server(engine)
    try:
        read, real_step = threading.Semaphore(0), engine.step

        def step():  # the engine thread waits for the test between steps
            read.acquire(timeout=30)
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        body = {"prompt": "drain", "max_tokens": 6, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            read.release()
            it = r.iter_lines()
            lines.append(next(it))
            s.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
            h = httpx.get(s.url + "/health", timeout=30)
            assert h.status_code == 503 and h.json() == {"status": "draining"}
            refused = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
            assert refused.status_code == 503 and "shutting down" in refused.text
            for line in it:
                read.release()
                lines.append(line)
        texts = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
        assert texts[-1]["finish_reason"] == "length" and "data: [DONE]" in lines
        s.thread.join(timeout=30)  # nothing left in flight: the server shuts down by itself
        assert not s.thread.is_alive()
    finally:
        read.release(100)
        s.close()


def test_logit_bias_and_penalties_through_the_client(server: _Server) -> None:
    c = server.client()
    a = server.tok.encode("A")[0]
    r = c.completions.create(model="tiny", prompt="bias", max_tokens=5, temperature=0,
                             logit_bias={str(a): 100})  # fmt: skip
    assert r.choices[0].text == "AAAAA"
    ids = server.tok.encode("pen")
    want = (
        Engine(server.engine.model, block_size=8)
        .generate(
            [ids],
            SamplingParams(
                temperature=0,
                max_tokens=8,
                ignore_eos=True,
                presence_penalty=1.5,
                frequency_penalty=0.5,
                repetition_penalty=1.3,
            ),
        )[0]
        .outputs[0]
        .token_ids
    )
    r = c.completions.create(
        model="tiny", prompt="pen", max_tokens=8, temperature=0, presence_penalty=1.5,
        frequency_penalty=0.5, extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == server.tok.decode(want)
    with pytest.raises(openai.BadRequestError, match="'presence_penalty' must be in"):
        c.completions.create(model="tiny", prompt="x", presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="'logit_bias' token id 999 is not in"):
        c.completions.create(model="tiny", prompt="x", logit_bias={"999": 1})


def test_echo_and_text_offset(server: _Server) -> None:
    c = server.client()
    plain = c.completions.create(model="tiny", prompt="Echo", max_tokens=6, temperature=0)
    echoed = c.completions.create(model="tiny", prompt="Echo", max_tokens=6, temperature=0,
                                  echo=True)  # fmt: skip
    assert echoed.choices[0].text == "Echo" + plain.choices[0].text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny", prompt="Echo", max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert streamed == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError, match="'echo' with 'logprobs'"):
        c.completions.create(model="tiny", prompt="Echo", echo=True, logprobs=1)
    lp = c.completions.create(model="tiny", prompt="Offs", max_tokens=8, temperature=0,
                              logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    tokens, offsets = lp.choices[0].logprobs.tokens, lp.choices[0].logprobs.text_offset
    assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    stream_offsets = []
    for ch in c.completions.create(model="tiny", prompt="Offs", max_tokens=8, temperature=0,
                                   logprobs=1, stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
        stream_offsets += ch.choices[0].logprobs.text_offset
    assert stream_offsets == offsets


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "text", ["", "hello", ' a "quoted"\n\\ line', "caf\u00e9 \u2603 \U0001f600"]
)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_streamed_choice_bytes_equal_json_dumps(chat: bool, text: str, finish: str | None) -> None:
    """The streaming fast path's choice bytes are exactly json.dumps of the dict it replaces."""
    from lmforge.serve.server import _choice_json

    if chat:
        delta = {"content": text} if text or finish is None else {}
        ref = {"index": 3, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        ref = {"index": 3, "text": text, "logprobs": None, "finish_reason": finish}
    assert _choice_json(3, text, finish, chat) == json.dumps(ref).encode()


def test_sigusr1_writes_every_threads_stack() -> None:
    """`lmforge serve` and its engine process register SIGUSR1 (faulthandler): a hung server
    shows where each thread waits without being stopped."""
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    code = (
        "import os, signal, threading, time\n"
        "from lmforge.serve.engine_process import dump_stacks_on_sigusr1\n"
        "dump_stacks_on_sigusr1()\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "print('still running')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "still running"
    assert "Current thread" in r.stderr and r.stderr.count("Thread 0x") >= 1


def test_a_slow_engine_step_prints_where_it_is(capsys) -> None:
    """An engine step past its limit prints, once, the engine thread's stack from Python's
    frames (a hung or compiling step in a server log says where), then how long it took."""
    import time

    from lmforge.serve.engine_process import StepWatch

    def _slow_marker_step() -> None:
        time.sleep(0.8)

    watch = StepWatch(limit=0.2, poll=0.05)
    try:
        with watch.step():
            _slow_marker_step()
        with watch.step():  # a fast step: nothing
            pass
        time.sleep(0.2)
    finally:
        watch.close()
    err = capsys.readouterr().err
    assert err.count("an engine step has run for") == 1
    assert "_slow_marker_step" in err and "that engine step ended after" in err

"""The server with the engine in its own process (what ``lmforge serve`` runs): the official
openai client on 127.0.0.1 gets the same greedy text as a solo in-process engine, streamed and
not, 64 concurrent streams, stop strings, disconnects abort in the child, a full queue answers
429, a dead engine process answers 500; and the CLI: a busy port is one line before loading,
SIGTERM drains, startup says what the engine chose."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.engine_process import EngineProcess, EngineSpec
from lmforge.serve.server import ServerState, make_server
from lmforge.serve.templates import render_chat
from lmforge.tokenizer import Tokenizer

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], SPECIALS)


def _model() -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=259, context_length=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2
    )
    return TransformerLM(cfg).eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lmforge.hf import save_as_checkpoint

    out = tmp_path_factory.mktemp("proc") / "ckpt"
    save_as_checkpoint(_model(), _tokenizer(), out, "test")
    return str(out)


class _ProcServer:
    def __init__(self, checkpoint: str, **engine: object) -> None:
        kw = {"block_size": 8, "num_blocks": 400, **engine}
        self.proc = EngineProcess(EngineSpec({"checkpoint": checkpoint, "device": "cpu"}, kw))
        info = self.proc.launch(timeout=300)
        self.tok = info["tokenizer"]
        self.state = ServerState(self.proc, self.tok, "tiny", info["template"])
        self.port = _free_port()
        self.server = make_server(self.state, host="127.0.0.1", port=self.port, log_level="error")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=120)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(f"lmforge_{name} "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self) -> None:
        for _ in range(200):
            if self.metric("kv_blocks_used") == 0 and self.metric("requests_running") == 0:
                return
            time.sleep(0.05)
        raise AssertionError("the engine process did not free its blocks")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def server(checkpoint: str) -> Iterator[_ProcServer]:
    s = _ProcServer(checkpoint)
    yield s
    s.close()
    assert s.proc._proc.exitcode == 0  # the child stopped when told, not killed


def _solo(tok: Tokenizer, prompt: str, max_tokens: int, eos: int | None) -> str:
    e = Engine(_model(), block_size=8, eos_token_id=eos)
    out = e.generate([tok.encode(prompt)], SamplingParams(temperature=0, max_tokens=max_tokens))
    o = out[0].outputs[0]
    return tok.decode(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids)


def test_completion_chat_and_stream_equal_the_solo_engine(server: _ProcServer) -> None:
    c = server.client()
    eos = server.proc.eos_token_id
    r = c.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0)
    assert r.choices[0].text == _solo(server.tok, "Hello", 10, eos)
    parts = [ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, temperature=0, stream=True)]  # fmt: skip
    assert "".join(parts) == r.choices[0].text
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == _solo(server.tok, render_chat(None, msgs), 8, eos)
    text = r.choices[0].text
    if len(text) >= 4:  # stop strings are the parent's: cut there, the child's request aborted
        cut = c.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0,
                                   stop=[text[2:4]])  # fmt: skip
        assert cut.choices[0].text == text[: text.find(text[2:4])]
    many = c.completions.create(model="tiny", prompt="xyz", max_tokens=5, n=3, seed=1)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    server.wait_idle()
    assert server.metric("generated_tokens_total") > 0
    assert server.metric("requests_total") >= 5


def test_64_concurrent_streams_equal_solo_runs(server: _ProcServer) -> None:
    prompts = [f"client {i}: " + "ab" * (i % 7) for i in range(64)]
    eos = server.proc.eos_token_id
    want = [_solo(server.tok, p, 8, eos) for p in prompts]

    async def one(client: openai.AsyncOpenAI, p: str) -> str:
        stream = await client.completions.create(
            model="tiny", prompt=p, max_tokens=8, temperature=0, stream=True
        )
        return "".join([ch.choices[0].text async for ch in stream])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0,
                                    timeout=120)  # fmt: skip
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(main()) == want
    server.wait_idle()


def test_disconnect_aborts_in_the_engine_process(server: _ProcServer) -> None:
    body = {"prompt": "long one", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    server.wait_idle()
    assert server.metric("generated_tokens_total") < 1000  # not run to max_tokens


def test_full_queue_429_and_dead_engine_500(checkpoint: str) -> None:
    s = _ProcServer(checkpoint, max_queue=0, num_blocks=64)
    try:
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            s.client().completions.create(model="tiny", prompt="x", max_tokens=2)
        assert httpx.get(s.url + "/health").status_code == 200
        os.kill(s.proc.pid, signal.SIGKILL)  # the engine process dies
        for _ in range(200):
            if httpx.get(s.url + "/health").status_code == 500:
                break
            time.sleep(0.05)
        h = httpx.get(s.url + "/health")
        assert h.status_code == 500 and "engine process exited" in h.json()["detail"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"]
    finally:
        s.close()


def test_a_loading_error_in_the_child_is_one_line(tmp_path: Path) -> None:
    from lmforge.utils.errors import LmforgeError

    proc = EngineProcess(EngineSpec({"checkpoint": str(tmp_path / "nope"), "device": "cpu"}))
    with pytest.raises(LmforgeError) as e:
        proc.launch(timeout=300)
    assert "\n" not in str(e.value) and "nope" in str(e.value)
    proc.stop()


def test_cli_busy_port_is_one_line_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "lmforge", "serve", "--checkpoint", "/does/not/matter",
             "--port", str(port), "--device", "cpu"],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=120,
        )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port} on 127.0.0.1 is already in use" in lines[0]
    assert "serving" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_serve_prints_the_choice_and_sigterm_drains(checkpoint: str) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "serve", "--checkpoint", checkpoint,
         "--port", str(port), "--device", "cpu"],
        env={**os.environ, "PYTHONPATH": SRC}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "drain", "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 1:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                lines.append(line)
        texts = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
        assert texts[-1]["finish_reason"] == "length" and "data: [DONE]" in lines
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        err = proc.stderr.read()
        assert (
            "engine on cpu, CUDA graphs off, compiled decode step off" in err
            and "KV dtype float32" in err
        )
        assert err.index("engine: cpu") < err.index("serving ")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_step_message_round_trip() -> None:
    """pack_step / unpack_step (the engine process's per-step message) lose nothing: several
    tokens per sample, n > 1, top logprobs, finish reasons, errors, empty deltas."""
    from lmforge.serve.engine_process import pack_step, unpack_step
    from lmforge.serve.output import Delta, SampleDelta

    items = [
        ("a", False, None, 200, [(0, [5], [-0.25], [], None)]),
        (
            "b",
            True,
            None,
            200,
            [
                (
                    1,
                    [7, 8, 9],
                    [-1.0, -2.5, -0.125],
                    [{7: -1.0}, {8: -2.5, 3: -3.0}, {9: -0.125}],
                    "length",
                ),
                (0, [], [], [], "stop"),
            ],
        ),
        ("c", True, "the queue is full", 429, []),
        ("d", False, None, 200, []),
    ]
    want = [
        (rid, Delta([SampleDelta(*s) for s in samples], fin, err, status))
        for rid, fin, err, status, samples in items
    ]
    assert unpack_step(pack_step(items)) == want
    assert unpack_step(pack_step([])) == []


def test_engine_process_builds_the_speculative_mode_from_the_flag(checkpoint: str) -> None:
    """``lmforge serve --speculative ngram`` passes the flag value to the engine process, which
    builds the proposer next to the loaded model; a bad value fails the start in one line."""
    from lmforge.serve.engine_process import _build
    from lmforge.serve.speculative import Speculative
    from lmforge.utils.errors import LmforgeError

    load = {"checkpoint": checkpoint, "device": "cpu"}
    engine, _ = _build(EngineSpec(load, {"num_blocks": 64, "speculative": "ngram",
                                         "speculative_k": 3}))  # fmt: skip
    assert isinstance(engine.speculative, Speculative) and engine.speculative.k == 3
    with pytest.raises(LmforgeError, match="--speculative must be"):
        _build(EngineSpec(load, {"num_blocks": 64, "speculative": "bogus"}))

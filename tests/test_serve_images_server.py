"""A VLM behind the OpenAI-compatible server (127.0.0.1): ``image_url`` content parts with
``data:`` URLs answer what the engine answers for the same image; every bad image input is one
400 line and the server keeps answering; a text model refuses images."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from conftest import optional_import
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.server import EngineLoop, ServerState, make_server
from lmforge.serve.templates import render_template
from lmforge.vision.data import WordTokenizer
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.scenes import ProceduralScenes, vocabulary
from lmforge.vision.serving import (
    VLM_CHAT_TEMPLATE,
    VisionTower,
    VLMTokenizer,
    prepare_image_prompt,
)
from lmforge.vision.vlm import VisionLanguageModel

httpx = optional_import("httpx")
uvicorn = optional_import("uvicorn")

WORDS = WordTokenizer(vocabulary())
TOK = VLMTokenizer(WORDS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vlm() -> VisionLanguageModel:
    torch.manual_seed(0)
    lm_cfg = ModelConfig(vocab_size=WORDS.vocab_size, context_length=64, d_model=32, n_layers=2,
                         n_heads=4, n_kv_heads=2)  # fmt: skip
    vit = ViT(ViTConfig(image_size=24, patch_size=8, d_model=32, n_layers=1, n_heads=2))
    return VisionLanguageModel(vit, TransformerLM(lm_cfg), WORDS.image_id).eval()


class _Server:
    def __init__(self, engine: Engine, vision: VisionTower | None, template: str | None) -> None:
        self.engine = engine
        self.state = ServerState(EngineLoop(engine, vision), TOK, "vlm", template)
        self.port = _free_port()
        self.server = make_server(self.state, host="127.0.0.1", port=self.port, log_level="error")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}/v1", timeout=60)

    def chat(self, content, **kw) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
                "temperature": 0, **kw}  # fmt: skip
        return self.http.post("/chat/completions", json=body)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def vlm() -> VisionLanguageModel:
    return _vlm()


@pytest.fixture(scope="module")
def server(vlm: VisionLanguageModel) -> Iterator[_Server]:
    engine = Engine(vlm.lm, block_size=8, num_blocks=64, eos_token_id=TOK.eot_id)
    s = _Server(engine, VisionTower.from_vlm(vlm), VLM_CHAT_TEMPLATE)
    yield s
    s.close()


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


SCENE = np.asarray(ProceduralScenes(seed=2, image_size=24)[0].image)
QUESTION = "how many shapes are there ?"


def test_image_url_answers_what_the_engine_answers(server: _Server, vlm) -> None:
    r = server.chat([_image_part(_url(_png(SCENE))), {"type": "text", "text": QUESTION}])
    assert r.status_code == 200, r.text
    body = r.json()
    # the same prompt through the engine in-process: template, placeholder, image embeddings
    text = render_template(VLM_CHAT_TEMPLATE, [{"role": "user", "content": "<image>\n" + QUESTION}])
    p = prepare_image_prompt(VisionTower.from_vlm(vlm), TOK.encode(text), [SCENE])
    e = Engine(vlm.lm, block_size=8, eos_token_id=TOK.eot_id, tokenizer=TOK)
    rid = e.add_request(p.token_ids, SamplingParams(temperature=0, max_tokens=6), image_embeds=p)
    out = None
    while e.has_unfinished():
        out = next((o for o in e.step() if o.request_id == rid and o.finished), out)
    assert body["choices"][0]["message"]["content"] == out.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(p.token_ids)  # the image's 9 slots counted
    # streamed, the same text
    s = server.chat([_image_part(_url(_png(SCENE))), {"type": "text", "text": QUESTION}],
                    stream=True)  # fmt: skip
    assert s.status_code == 200 and "data: [DONE]" in s.text


def test_bad_images_are_400_and_the_server_keeps_serving(server: _Server) -> None:
    from PIL import Image

    png = _png(SCENE)
    huge = io.BytesIO()
    Image.new("1", (5000, 5000)).save(huge, format="PNG")
    cases = [
        (_url(b"definitely not an image"), "image 1: not a readable image"),
        (_url(png[: len(png) // 2]), "image 1: not a readable image"),  # truncated
        (_url(huge.getvalue()), "image 1: image of 5000x5000"),
        ("data:image/png;base64,%%%%", "does not decode"),
        ("https://example.com/cat.png", "'https' URLs are not fetched"),
        (_url(png, "application/pdf"), "MIME type 'application/pdf'"),
    ]
    for url, match in cases:
        r = server.chat([_image_part(url), {"type": "text", "text": QUESTION}])
        assert r.status_code == 400, (url[:40], r.text)
        err = r.json()["error"]
        assert match in err["message"] and "\n" not in err["message"], err
        assert err["param"] == "messages"
    for content, match in [
        ([{"type": "image_url", "image_url": {}}], "needs {'url'"),
        ("<image> " + QUESTION, "1 <image> placeholder(s) but 0 image(s)"),  # typed, no image
        ([_image_part(_url(png)), _image_part(_url(png))], "0 <image>"),  # no template slot
    ]:
        if isinstance(content, list) and len(content) == 2:
            # two images but the text also names one: 3 placeholders, 2 images
            content = [*content, {"type": "text", "text": "<image>"}]
            match = "3 <image> placeholder(s) but 2 image(s)"
        r = server.chat(content)
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    # nothing was queued or left holding blocks, and the server still answers
    assert not server.engine.has_unfinished() and server.engine.allocator.num_used == 0
    r = server.chat([_image_part(_url(png)), {"type": "text", "text": QUESTION}])
    assert r.status_code == 200
    assert server.http.get("/models").status_code == 200


def test_a_text_model_refuses_images() -> None:
    torch.manual_seed(0)
    lm = TransformerLM(ModelConfig(vocab_size=WORDS.vocab_size, context_length=32, d_model=16,
                                   n_layers=1, n_heads=2)).eval()  # fmt: skip
    s = _Server(Engine(lm, block_size=8, num_blocks=16), None, VLM_CHAT_TEMPLATE)
    try:
        r = s.chat([_image_part(_url(_png(SCENE))), {"type": "text", "text": QUESTION}])
        assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
        # text still works; and "<image>" typed into text is just text for a text model
        assert s.chat(QUESTION).status_code == 200
        assert s.chat("<image> " + QUESTION).status_code == 200
    finally:
        s.close()

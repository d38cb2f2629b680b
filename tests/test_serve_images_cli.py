"""A VLM run folder through the commands: ``load_model`` gives its LM and tower; the engine in
its own process (what ``lmforge serve --checkpoint VLM_DIR`` runs) answers an image_url request
as the in-process engine does (pixels cross the pipe, the tower runs in the child) and keeps
serving after a bad image; ``lmforge chat --image FILE`` streams the same reply; bad --image
inputs are one line."""

from __future__ import annotations

import base64
import io
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.vision.data import WordTokenizer
from lmforge.vision.encoders import ViT, ViTConfig
from lmforge.vision.scenes import ProceduralScenes, vocabulary
from lmforge.vision.serving import VLM_CHAT_TEMPLATE, VLMTokenizer, load_vlm, prepare_image_prompt
from lmforge.vision.vlm import VisionLanguageModel

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

WORDS = WordTokenizer(vocabulary())
TOK = VLMTokenizer(WORDS)
QUESTION = "how many shapes are there ?"
SCENE = np.asarray(ProceduralScenes(seed=2, image_size=24)[1].image)


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder in the layout ``lmforge vision vlm`` writes (config.toml, vision.toml,
    vocab.json, stage2/checkpoints/step_*), with random weights."""
    import dataclasses

    from lmforge.checkpoint import checkpoint_path, save_checkpoint
    from lmforge.utils.config import save_config
    from lmforge.vision.vlm_train import VLMRunConfig

    out = tmp_path_factory.mktemp("vlm") / "run"
    out.mkdir()
    lm_cfg = ModelConfig(vocab_size=WORDS.vocab_size, context_length=64, d_model=32, n_layers=2,
                         n_heads=4, n_kv_heads=2)  # fmt: skip
    vit_cfg = ViTConfig(image_size=24, patch_size=8, d_model=32, n_layers=1, n_heads=2)
    torch.manual_seed(0)
    vlm = VisionLanguageModel(ViT(vit_cfg), TransformerLM(lm_cfg), WORDS.image_id)
    save_config(dataclasses.replace(VLMRunConfig(), lm=lm_cfg), out / "config.toml")
    save_config(vit_cfg, out / "vision.toml")
    WORDS.save(out / "vocab.json")
    save_checkpoint(checkpoint_path(out / "stage2", 3), vlm, None, 3)
    return out


def _reference_text(folder: Path, image: np.ndarray, max_tokens: int = 6) -> str:
    """The reply of an in-process engine on the folder's VLM (greedy, the VLM template)."""
    from lmforge.serve.templates import render_template

    loaded = load_vlm(folder)
    text = render_template(VLM_CHAT_TEMPLATE, [{"role": "user", "content": "<image>\n" + QUESTION}])
    p = prepare_image_prompt(loaded.tower, TOK.encode(text), [image])
    e = Engine(loaded.lm, block_size=8, eos_token_id=TOK.eot_id, tokenizer=TOK)
    rid = e.add_request(p.token_ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                        image_embeds=p)  # fmt: skip
    out = None
    while e.has_unfinished():
        out = next((o for o in e.step() if o.request_id == rid and o.finished), out)
    return out.outputs[0].text


def test_load_model_gives_the_lm_and_the_tower(vlm_dir: Path) -> None:
    from lmforge.serve.loading import load_for_serving, load_model

    m = load_model(checkpoint=str(vlm_dir), device="cpu")
    assert m.vision is not None and m.vision.n_image_tokens == 9 and m.name == "run"
    assert m.template == VLM_CHAT_TEMPLATE and m.tokenizer.eot_id == WORDS.eos_id
    assert isinstance(m.model, TransformerLM)
    model, tok, _, _ = load_for_serving(checkpoint=str(vlm_dir), device="cpu")
    assert isinstance(model, TransformerLM) and tok.vocab_size == WORDS.vocab_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_process_serves_images(vlm_dir: Path) -> None:
    from lmforge.serve.engine_process import EngineProcess, EngineSpec
    from lmforge.serve.server import ServerState, make_server

    proc = EngineProcess(EngineSpec({"checkpoint": str(vlm_dir), "device": "cpu"},
                                    {"block_size": 8, "num_blocks": 64}))  # fmt: skip
    info = proc.launch(timeout=300)
    assert info["vision"] == {"image_size": 24, "n_image_tokens": 9, "image_id": WORDS.image_id}
    assert "vision_tower" not in info  # the tower stays in the engine process
    state = ServerState(proc, info["tokenizer"], "vlm", info["template"])
    port = _free_port()
    server = make_server(state, host="127.0.0.1", port=port, log_level="error")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(400):
            if server.started:
                break
            time.sleep(0.05)
        url = "data:image/png;base64," + base64.b64encode(_png(SCENE)).decode()
        content = [{"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": QUESTION}]  # fmt: skip
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
                "temperature": 0}  # fmt: skip
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=120) as http:
            want = _reference_text(vlm_dir, SCENE)
            for _ in range(2):  # the second time the image's blocks come from the prefix cache
                r = http.post("/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == want
            bad = {**body, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}  # fmt: skip
            r = http.post("/chat/completions", json=bad)
            assert r.status_code == 400 and "image 1: not a readable image" in r.text
            assert http.post("/chat/completions", json=body).status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_chat_command_with_image(
    vlm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from lmforge.cli import main

    png = tmp_path / "scene.png"
    png.write_bytes(_png(SCENE))
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n/quit\n"))
    args = ["chat", "--checkpoint", str(vlm_dir), "--device", "cpu", "--max-tokens", "6"]
    assert main([*args, "--image", str(png)]) == 0
    assert capsys.readouterr().out == _reference_text(vlm_dir, SCENE) + "\n"
    # bad --image inputs: one line each, exit status 2
    (tmp_path / "bad.png").write_bytes(b"not a png")
    for extra, match in [
        (["--image", str(tmp_path / "missing.png")], "image not found"),
        (["--image", str(tmp_path / "bad.png")], "bad.png: not a readable image"),
    ]:
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err


def test_chat_image_needs_a_vlm(tmp_path: Path, capsys) -> None:
    from lmforge.cli import main
    from lmforge.hf import save_as_checkpoint
    from lmforge.tokenizer import Tokenizer

    torch.manual_seed(0)
    lm = TransformerLM(ModelConfig(vocab_size=259, context_length=32, d_model=16, n_layers=1,
                                   n_heads=2))  # fmt: skip
    save_as_checkpoint(lm, Tokenizer({i: bytes([i]) for i in range(256)}, [], []), tmp_path / "c",
                       "test")  # fmt: skip
    png = tmp_path / "scene.png"
    png.write_bytes(_png(SCENE))
    assert main(["chat", "--checkpoint", str(tmp_path / "c"), "--image", str(png)]) == 2
    assert "--image needs a VLM" in capsys.readouterr().err

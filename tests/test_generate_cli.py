"""``lmforge generate`` end to end: every source (a trained checkpoint, an ``hf import``-style
folder with ``hf_tokenizer/``, a Hugging Face folder, a GGUF file the test writes itself) decodes
on the serving engine, and greedy output equals the reference loop (``lmforge.generate``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.generate import greedy_generate_reference
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.tokenizer import bytes_to_unicode

TINY = ModelConfig(
    vocab_size=257, context_length=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
)
SMOL = Path(__file__).resolve().parents[1].parent / "shared" / "models"
SMOL = SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _write_checkpoint(path: Path, cfg: ModelConfig, tokenizer=None) -> TransformerLM:
    from safetensors.torch import save_file

    from lmforge.config import RunConfig
    from lmforge.utils import config_to_toml

    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), path / "model.safetensors")
    (path / "config.toml").write_text(config_to_toml(RunConfig(model=cfg)))
    if tokenizer is not None:
        tokenizer.save(path / "tokenizer")
    return model


def _byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])


def _greedy_text(model, tok, prompt: str, n: int) -> str:
    """Reference: full recomputation, greedy, up to the end-of-text id (not printed)."""
    new = greedy_generate_reference(model, tok.encode(prompt), n)
    if tok.eot_id in new:
        new = new[: new.index(tok.eot_id)]
    return prompt + tok.decode(new)


def _gen(capsys, *argv: str) -> str:
    rc = main(["generate", *argv, "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


# ----------------------------------------------------------------------------- checkpoints


def test_token_ids_in_and_out(tmp_path: Path, capsys) -> None:
    model = _write_checkpoint(tmp_path / "ckpt", dataclasses.replace(TINY, tie_embeddings=True))
    ck = ("--checkpoint", str(tmp_path / "ckpt"))
    out = _gen(
        capsys, *ck, "--prompt-ids", "5 17 42", "--max-new-tokens", "6", "--temperature", "0"
    )
    assert [int(t) for t in out.split()] == [
        5,
        17,
        42,
        *greedy_generate_reference(model, [5, 17, 42], 6),
    ]
    # A stop id ends the sample and is not printed.
    want = greedy_generate_reference(model, [5, 17, 42], 6)
    out = _gen(capsys, *ck, "--prompt-ids", "5 17 42", "--max-new-tokens", "6",
               "--temperature", "0", "--stop-id", str(want[2]))  # fmt: skip
    cut = want.index(want[2])
    assert [int(t) for t in out.split()] == [5, 17, 42, *want[:cut]]

    sampled = ("--prompt-ids", "1 2", "--prompt-ids", "3", "--num-samples", "3",
               "--max-new-tokens", "4", "--top-k", "20", "--seed", "3")  # fmt: skip
    out = _gen(capsys, *ck, *sampled)
    assert out.count("--- prompt 1, sample") == 3 and out.count("--- prompt 2, sample") == 3
    assert _gen(capsys, *ck, *sampled) == out  # seeded: the same run prints the same samples


def test_text_prompts_greedy_equal_the_reference(tmp_path: Path, capsys) -> None:
    tok = _byte_tokenizer()
    model = _write_checkpoint(tmp_path / "ckpt", TINY, tok)
    ck = ("--checkpoint", str(tmp_path / "ckpt"), "--max-new-tokens", "7", "--temperature", "0")
    # One prompt streams; two go through the batch; both equal the reference.
    assert _gen(capsys, *ck, "--prompt", "def f(") == _greedy_text(model, tok, "def f(", 7) + "\n"
    out = _gen(capsys, *ck, "--prompt", "def f(", "--prompt", "x = 1")
    lines = out.splitlines()
    assert lines[0] == "--- prompt 1, sample 1 ---" and lines[2] == "--- prompt 2, sample 1 ---"
    assert out == (
        f"--- prompt 1, sample 1 ---\n{_greedy_text(model, tok, 'def f(', 7)}\n"
        f"--- prompt 2, sample 1 ---\n{_greedy_text(model, tok, 'x = 1', 7)}\n"
    )


def test_padded_vocabulary_ids_read_as_no_text(tmp_path: Path, capsys) -> None:
    """A model with more rows than its tokenizer has ids (300 vs 257): greedy output is the
    reference's, the padding ids printing as nothing, never a KeyError."""
    tok = _byte_tokenizer()
    model = _write_checkpoint(tmp_path / "ckpt", dataclasses.replace(TINY, vocab_size=300), tok)
    new = greedy_generate_reference(model, tok.encode("ab"), 30)
    new = new[: new.index(tok.eot_id)] if tok.eot_id in new else new
    assert any(i >= tok.vocab_size for i in new)  # the case is exercised
    out = _gen(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "ab",
               "--max-new-tokens", "30", "--temperature", "0")  # fmt: skip
    assert out == "ab" + tok.decode([i for i in new if i < tok.vocab_size]) + "\n"
    for seed in range(3):  # sampled: every id reachable, the command still prints
        _gen(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "ab", "--prompt", "c",
             "--max-new-tokens", "30", "--seed", str(seed))  # fmt: skip


def test_stop_strings_cut_the_text(tmp_path: Path, capsys) -> None:
    tok = _byte_tokenizer()
    model = _write_checkpoint(tmp_path / "ckpt", TINY, tok)
    full = _greedy_text(model, tok, "ab", 12)[2:]
    stop = full[3:5]
    assert stop and "\n" not in stop
    out = _gen(capsys, "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "ab",
               "--max-new-tokens", "12", "--temperature", "0", "--stop", stop)  # fmt: skip
    assert out == "ab" + full[: full.index(stop)] + "\n"


def test_errors_are_one_line(tmp_path: Path, capsys) -> None:
    rc = main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "not found" in err and len(err.strip().splitlines()) == 1

    _write_checkpoint(tmp_path / "ckpt", TINY)
    base = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--device", "cpu"]
    for extra, message in [
        (["--prompt", "hello"], "tokenizer"),
        (["--prompt-ids", "1", "--stop", "x"], "tokenizer"),
        (["--prompt-ids", "1 x"], "integers"),
        (["--prompt-ids", "1 999"], "outside the vocabulary"),
        (["--prompt-ids", "1", "--max-new-tokens", "100"], "context_length"),
        (["--prompt-ids", "1", "--top-p", "0"], "--top-p"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompt-ids", "1", "--dtype", "float16", "--device", "nope"], "invalid device"),
        ([], "at least one"),
    ]:
        rc = main(base + extra)
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (extra, err)
        assert len(err.strip().splitlines()) == 1


def test_help_has_examples_and_the_sources(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--max-new-tokens" in out and "--top-p" in out
    assert "--gguf" in out and "--hf" in out and "hf_tokenizer/" in out
    assert "--no-compile" in out and "--no-cuda-graphs" in out and "--no-compile-prefill" in out


def test_decoding_runs_on_the_engine(tmp_path: Path, capsys, monkeypatch) -> None:
    """No other decode loop: the command's tokens come from serve.Engine's steps."""
    from lmforge.serve import Engine

    steps = []
    real = Engine.step

    def counted(self):
        steps.append(1)
        return real(self)

    monkeypatch.setattr(Engine, "step", counted)
    _write_checkpoint(tmp_path / "ckpt", TINY)
    _gen(
        capsys,
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--prompt-ids",
        "1 2",
        "--max-new-tokens",
        "3",
    )
    assert len(steps) >= 3


# ----------------------------------------------------------------------------- imports


def _write_gguf(path: Path, seed: int = 0) -> None:
    """A tiny Llama GGUF: random fp32 weights, a byte-level BPE vocabulary (256 bytes + EOS)."""
    import gguf

    cfg = dict(d=32, layers=2, heads=4, kv=2, ff=64, vocab=257)
    rng = np.random.default_rng(seed)
    d, e = cfg["d"], cfg["d"] // cfg["heads"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_block_count(cfg["layers"])
    writer.add_feed_forward_length(cfg["ff"])
    writer.add_head_count(cfg["heads"])
    writer.add_head_count_kv(cfg["kv"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3])
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    writer.add_tensor("token_embd.weight", w(cfg["vocab"], d))
    writer.add_tensor("output_norm.weight", 1 + w(d))
    for i in range(cfg["layers"]):
        for name, shape in [("attn_q", (d, d)), ("attn_k", (cfg["kv"] * e, d)),
                            ("attn_v", (cfg["kv"] * e, d)), ("attn_output", (d, d)),
                            ("ffn_gate", (cfg["ff"], d)), ("ffn_up", (cfg["ff"], d)),
                            ("ffn_down", (d, cfg["ff"])), ("attn_norm", (d,)),
                            ("ffn_norm", (d,))]:  # fmt: skip
            writer.add_tensor(f"blk.{i}.{name}.weight", w(*shape) + (1 if len(shape) == 1 else 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path)
    return path


def _reference_text(model, tok, prompt: str, n: int) -> str:
    new = greedy_generate_reference(model.float(), tok.encode(prompt), n)
    if tok.eot_id is not None and tok.eot_id in new:
        new = new[: new.index(tok.eot_id)]
    return prompt + tok.decode(new)


@pytest.mark.requires("gguf")
def test_gguf_file(tiny_gguf: Path, capsys) -> None:
    from lmforge.hf.gguf import import_gguf

    model, tok, _ = import_gguf(tiny_gguf, context_length=4096)
    out = _gen(capsys, "--gguf", str(tiny_gguf), "--prompt", "hello", "--max-new-tokens", "8",
               "--temperature", "0")  # fmt: skip
    assert out == _reference_text(model, tok, "hello", 8) + "\n"


@pytest.mark.requires("gguf", "tokenizers")
def test_hf_import_checkpoint_and_hf_folder(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    """The folder ``lmforge hf import`` writes (tokenizer in hf_tokenizer/), and an HF folder."""
    from lmforge.hf import HFTokenizer, export_model, save_as_checkpoint
    from lmforge.hf.gguf import import_gguf, load_gguf, write_tokenizer_folder

    model, _, _ = import_gguf(tiny_gguf, context_length=48)
    hf_tok = HFTokenizer(write_tokenizer_folder(load_gguf(tiny_gguf), tmp_path / "tok"))
    save_as_checkpoint(model, hf_tok, tmp_path / "imported", source="tiny")
    assert (tmp_path / "imported" / "hf_tokenizer").is_dir()
    assert not (tmp_path / "imported" / "tokenizer").exists()
    want = _reference_text(model, hf_tok, "hello", 8) + "\n"
    args = ("--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0")
    assert _gen(capsys, "--checkpoint", str(tmp_path / "imported"), *args) == want

    export_model(model, tmp_path / "hf", hf_tok)
    assert _gen(capsys, "--hf", str(tmp_path / "hf"), "--context-length", "48", *args) == want


@pytest.mark.slow
@pytest.mark.requires("gguf")
@pytest.mark.skipif(not SMOL.is_file(), reason=f"shared model not present: {SMOL}")
def test_shared_smollm2_gguf(capsys) -> None:
    from lmforge.hf.gguf import import_gguf

    model, tok, _ = import_gguf(SMOL, context_length=256)
    prompt = "The capital of France is"
    out = _gen(capsys, "--gguf", str(SMOL), "--context-length", "256", "--prompt", prompt,
               "--max-new-tokens", "6", "--temperature", "0")  # fmt: skip
    assert out == _reference_text(model, tok, prompt, 6) + "\n" and "Paris" in out


@pytest.mark.gpu
def test_on_cuda_the_command_equals_the_reference(tmp_path: Path, capsys) -> None:
    """On the GPU, the engine's defaults (compiled step, CUDA graphs where on), float32: the
    command's greedy text and eval's engine decode equal the reference loop's."""
    from lmforge.eval.runner import generate_texts

    tok = _byte_tokenizer()
    cfg = dataclasses.replace(TINY, context_length=128, d_model=64, n_layers=3)
    model = _write_checkpoint(tmp_path / "ckpt", cfg, tok).cuda()
    prompts = ["def f(", "x = 1", "import os"]
    rc = main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--device", "cuda",
               "--dtype", "float32", "--temperature", "0", "--max-new-tokens", "16",
               *(a for p in prompts for a in ("--prompt", p))])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    want = [_greedy_text(model, tok, p, 16) for p in prompts]
    assert out == "".join(f"--- prompt {i + 1}, sample 1 ---\n{w}\n" for i, w in enumerate(want))
    texts = generate_texts(model, tok, prompts, max_new_tokens=16)
    bos = [_greedy_text_from(model, tok, [tok.eot_id, *tok.encode(p)], 16) for p in prompts]
    assert [t[0] for t in texts] == bos


def _greedy_text_from(model, tok, ids: list[int], n: int) -> str:
    new = greedy_generate_reference(model, ids, n)
    return tok.decode(new[: new.index(tok.eot_id)] if tok.eot_id in new else new)


def test_speculative_flag_keeps_greedy_output(tmp_path: Path, capsys) -> None:
    """``--speculative ngram`` and ``draft:1`` run the engine's speculative mode; greedy output is
    the plain engine's, token for token; a bad value is one line (exit 2)."""
    cfg = dataclasses.replace(TINY, n_layers=3)
    model = _write_checkpoint(tmp_path / "ckpt", cfg)
    ck = ("--checkpoint", str(tmp_path / "ckpt"), "--max-new-tokens", "12", "--temperature", "0")
    prompt = ("--prompt-ids", "5 17 42 5 17 42 5 17")
    want = [
        5,
        17,
        42,
        5,
        17,
        42,
        5,
        17,
        *greedy_generate_reference(model, [5, 17, 42] * 2 + [5, 17], 12),
    ]
    for mode in ("ngram", "draft:1"):
        out = _gen(capsys, *ck, *prompt, "--speculative", mode, "--speculative-k", "3")
        assert [int(t) for t in out.split()] == want, mode
    rc = main(["generate", *ck, *prompt, "--speculative", "draft:3", "--device", "cpu"])
    err = capsys.readouterr().err
    assert (
        rc == 2
        and "--speculative must be 'ngram' or 'draft:N'" in err
        and len(err.splitlines()) == 1
    )

"""GGUF import: our dequantizers against the gguf package's, SmolLM2's logits against
transformers' own GGUF loader, and its tokenizer (which lacks 21 single bytes) encoding exactly
like ``tokenizers`` (issue 21 item 12)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import optional_import
from lmforge.hf import HFTokenizer, load_hf_tokenizer
from lmforge.hf.gguf import dequantize, import_gguf, load_gguf, write_tokenizer_folder
from lmforge.utils import LmforgeError

gguf = optional_import("gguf")

SMOL = Path("/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smol = pytest.mark.skipif(not SMOL.is_file(), reason="shared SmolLM2 GGUF not present")

TEXTS = [
    "The capital of France is Paris.",
    "  two  spaces\nand\ta tab\x04 and a control byte \x01\x7f",
    "naïve café 🎉 <|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # 12345",
    "",
]


def _random_blocks(kind: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ``n_blocks`` blocks of ``kind`` with finite, non-zero fp16 scales."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    n_halves = 2 if kind == "Q4_1" else 1
    scales = rng.uniform(0.01, 2.0, size=(n_blocks, n_halves)) * rng.choice([-1, 1], (n_blocks, 1))
    raw[:, : 2 * n_halves] = scales.astype(np.float16).view(np.uint8).reshape(n_blocks, -1)
    return raw


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_reference(kind: str) -> None:
    rng = np.random.default_rng(0)
    rows, cols = 6, 96  # 3 blocks per row
    raw = _random_blocks(kind, rows * cols // 32, rng).reshape(rows, -1)
    ours = dequantize(raw, kind, (rows, cols))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert ours.shape == ref.shape == (rows, cols)
    assert np.abs(ours).min() >= 0 and np.abs(ours).max() > 0
    np.testing.assert_array_equal(ours, ref.astype(np.float32))


@pytest.mark.parametrize("kind", ["F16", "BF16", "F32"])
def test_dequantize_float_types(kind: str) -> None:
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    if kind == "F16":
        data, want = x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    elif kind == "BF16":
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        data, want = (
            bits.view(np.uint8).reshape(4, 16),
            (bits.astype(np.uint32) << 16).view(np.float32),
        )
    else:
        data, want = x, x
    np.testing.assert_array_equal(dequantize(data, kind, (4, 8)), want)


def test_unsupported_type_and_bad_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match="Q6_K is not supported"):
        dequantize(np.zeros((1, 210), np.uint8), "Q6_K", (1, 256))
    with pytest.raises(LmforgeError, match="GGUF file not found"):
        load_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(LmforgeError, match="not a readable GGUF file"):
        load_gguf(bad)


@pytest.fixture(scope="module")
def smol_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SMOL.is_file():
        pytest.skip("shared SmolLM2 GGUF not present")
    d = tmp_path_factory.mktemp("smol_tok")
    write_tokenizer_folder(load_gguf(SMOL, context_length=64), d)
    return d


@needs_smol
def test_smollm2_tokenizer_encodes_like_tokenizers(smol_tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer as HF

    tok = load_hf_tokenizer(smol_tokenizer_dir)
    assert isinstance(tok, HFTokenizer)  # 21 single bytes missing: lmforge's encoder can't be exact
    ref = HF.from_file(str(smol_tokenizer_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False)
    assert tok.eot_id == 2  # <|im_end|>, the instruct model's end of turn


@needs_smol
@pytest.mark.slow
@pytest.mark.requires("transformers")
def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smol_tokenizer_dir: Path) -> None:
    """Our tokenizer.json from the GGUF metadata encodes like the one transformers builds."""
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name)
    ours = load_hf_tokenizer(smol_tokenizer_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@needs_smol
def test_smollm2_tokenizer_random_text(smol_tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer as HF

    tok = load_hf_tokenizer(smol_tokenizer_dir)
    ref = HF.from_file(str(smol_tokenizer_dir / "tokenizer.json"))

    @settings(max_examples=30, deadline=None)
    @given(st.text(max_size=40))
    def check(text: str) -> None:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False)

    check()


def _transformers_gguf_model():
    import transformers
    import transformers.modeling_utils as mu

    # transformers asks for accelerate before any GGUF load, though a CPU load never uses it;
    # the check is all that stands between us and its loader (accelerate is not installed here).
    # Patched for this call only: save_pretrained would otherwise believe accelerate is there.
    saved = mu.is_accelerate_available
    mu.is_accelerate_available = lambda: True
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(SMOL.parent), gguf_file=SMOL.name, dtype=torch.float32
        ).eval()
    finally:
        mu.is_accelerate_available = saved


@needs_smol
@pytest.mark.slow
@pytest.mark.requires("transformers")
def test_smollm2_logits_match_transformers_gguf_loader() -> None:
    ours, tok, template = import_gguf(SMOL, context_length=256)
    assert template is not None and "<|im_start|>" in template
    theirs = _transformers_gguf_model()
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    assert float((a - b).abs().max()) < 2e-4
    assert int(a[0, -1].argmax()) == int(b[0, -1].argmax())


@needs_smol
@pytest.mark.slow
@pytest.mark.requires("transformers")
def test_cli_import_gguf_and_hf_folder_written_by_transformers(tmp_path: Path) -> None:
    """`hf import --gguf`, and item 12: `hf import --model` on the folder transformers writes."""
    from lmforge.hf import load_pretrained

    run = [sys.executable, "-m", "lmforge", "hf", "import"]
    env_src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": env_src, "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [*run, "--gguf", str(SMOL), "--out", str(tmp_path / "a"), "--context-length", "128"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "lacks 21 of the 256 single bytes" in r.stderr
    assert (tmp_path / "a" / "chat_template.jinja").is_file()

    hf_dir = tmp_path / "hf"
    import transformers

    loaded = _transformers_gguf_model()
    # A GGUF-loaded model refuses save_pretrained; a plain copy of it does not.
    plain = transformers.AutoModelForCausalLM.from_config(loaded.config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(
        str(SMOL.parent), gguf_file=SMOL.name
    ).save_pretrained(hf_dir)
    r = subprocess.run(
        [*run, "--model", str(hf_dir), "--out", str(tmp_path / "b"), "--context-length", "128"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    ma, ta = load_pretrained(tmp_path / "a")
    mb, tb = load_pretrained(tmp_path / "b")
    ids = ta.encode("Hello there, how are you?")
    assert ids == tb.encode("Hello there, how are you?")
    with torch.no_grad():
        la, lb = ma(torch.tensor([ids])), mb(torch.tensor([ids]))
    assert float((la - lb).abs().max()) < 2e-4

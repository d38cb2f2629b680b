"""GGUF import: llama.cpp model files (Llama / Qwen3) as lmforge models, tokenizer included.

The file is parsed with the ``gguf`` package's reader (memory-mapped, no code runs); tensors are
dequantized here by :func:`dequantize`, our own vectorised NumPy code for the block formats
below (``gguf.quants.dequantize`` is the reference the tests compare against):

- ``Q8_0``: blocks of 32 weights = fp16 scale d, 32 int8 q; ``w = d·q``.
- ``Q4_0``: fp16 d, 16 bytes of 4-bit q (low nibbles are weights 0..15, high nibbles 16..31);
  ``w = d·(q − 8)``.
- ``Q4_1``: fp16 d, fp16 minimum m, 16 bytes of nibbles as Q4_0; ``w = d·q + m``.
- ``F32``/``F16``/``BF16``: plain.

Layout: llama.cpp's converter permutes Llama's q/k rows from HF's rotate-half order into
interleaved pairs, which is lmforge's own RoPE layout, so those rows are taken as they are;
Qwen3 files keep HF's order (llama.cpp runs them with NEOX RoPE) and are un-permuted like an HF
import. The tokenizer (``tokenizer.ggml.*``, GPT-2-style byte-level BPE) is written out as a
``tokenizer.json`` and loaded with :func:`lmforge.hf.load_hf_tokenizer`; the chat template is
kept. Exercised by ``pytest tests/test_hf_gguf.py`` and ``lmforge hf import --gguf FILE``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.model.config import ModelConfig
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

__all__ = ["GGUFModel", "GGUFTensor", "dequantize", "load_gguf", "read_gguf"]

_BLOCK = 32  # weights per quantization block in Q4_0 / Q4_1 / Q8_0


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian -> (...,) float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(N, 16) packed bytes -> (N, 32) values 0..15: low nibbles first, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Weights of one GGUF tensor as float32 of ``shape`` (rows outermost, like torch).

    ``data`` is the tensor's bytes as the reader maps them (uint8 rows of blocks for the quantized
    types, the plain array for float types); ``shape`` is the torch-order shape. Raises
    :class:`LmforgeError` for a type not listed in the module docstring.
    """
    n = int(np.prod(shape))
    if type_name in ("F32", "F16"):
        return np.asarray(data).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        raw = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}.get(type_name)
    if size is None:
        raise LmforgeError(
            f"GGUF tensor type {type_name} is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1)"
        )
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)  # (N, bytes)
    d = _f16(blocks[:, 0:2].reshape(-1, 1, 2))  # (N, 1)
    if type_name == "Q8_0":
        q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (N, 32)
        w = d * q
    elif type_name == "Q4_0":
        w = d * (_nibbles(blocks[:, 2:]) - 8.0)  # (N, 32)
    else:
        m = _f16(blocks[:, 2:4].reshape(-1, 1, 2))  # (N, 1)
        w = d * _nibbles(blocks[:, 4:]) + m  # (N, 32)
    if w.size != n:
        raise LmforgeError(f"GGUF tensor holds {w.size} weights, its shape {shape} needs {n}")
    return w.reshape(shape)


@dataclasses.dataclass
class GGUFModel:
    """What a GGUF file holds, in lmforge terms."""

    config: ModelConfig
    "the model's configuration"
    state: dict[str, torch.Tensor]
    "lmforge state dict (fp32)"
    tokenizer_json: dict[str, Any] | None
    "a tokenizers-library tokenizer.json built from tokenizer.ggml.* (None if absent)"
    eos_token_id: int | None
    "end-of-sequence id"
    bos_token_id: int | None
    "beginning-of-sequence id"
    chat_template: str | None
    "the Jinja chat template (None if the file has none)"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # a malformed field: treat as absent, callers check what they need
        return default


def _config(reader: Any, where: str, context_length: int | None) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise LmforgeError(f"{where}: GGUF architecture {arch!r} is not supported (llama, qwen3)")

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise LmforgeError(f"{where}: GGUF metadata lacks {arch}.{key}")
        return v

    n_heads = int(need("attention.head_count"))
    d_model = int(need("embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or d_model // n_heads)
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens", []) or [])
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise LmforgeError(f"{where}: partial rotary embeddings are not supported")
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise LmforgeError(f"{where}: GGUF RoPE scaling is not supported")
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            context_length=int(context_length or need("context_length")),
            d_model=d_model,
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=None if head_dim * n_heads == d_model else head_dim,
            d_ff=int(need("feed_forward_length")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            qk_norm=arch == "qwen3",
            tie_embeddings="output.weight" not in names,
            attention="sdpa",
        )
    except ValueError as e:
        raise LmforgeError(f"{where}: {e}") from None


def _names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> lmforge name."""
    out = {"token_embd.weight": "token_embeddings.weight", "output_norm.weight": "ln_final.weight"}
    if not cfg.tie_embeddings:
        out["output.weight"] = "lm_head.weight"
    per_layer = {
        "attn_q": "attn.q_proj",
        "attn_k": "attn.k_proj",
        "attn_v": "attn.v_proj",
        "attn_output": "attn.output_proj",
        "ffn_gate": "ffn.w1",
        "ffn_up": "ffn.w3",
        "ffn_down": "ffn.w2",
        "attn_norm": "ln1",
        "ffn_norm": "ln2",
    }
    if cfg.qk_norm:
        per_layer.update(attn_q_norm="attn.q_norm", attn_k_norm="attn.k_norm")
    for i in range(cfg.n_layers):
        for g, lm in per_layer.items():
            out[f"blk.{i}.{g}.weight"] = f"layers.{i}.{lm}.weight"
    return out


def _tokenizer_json(reader: Any) -> dict[str, Any] | None:
    """tokenizer.json (tokenizers' format) for a GGUF ``gpt2``-model byte-level BPE vocabulary."""
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        return None
    if model != "gpt2":
        raise LmforgeError(
            f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' only)"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens", []))
    types = list(_field(reader, "tokenizer.ggml.token_type", []) or [1] * len(tokens))
    merges = list(_field(reader, "tokenizer.ggml.merges", []))
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": int(kind) == 3,  # 3 = control token, 4 = user-defined
        }
        for i, (t, kind) in enumerate(zip(tokens, types, strict=False))
        if int(kind) in (3, 4)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def load_gguf(path: str | os.PathLike, context_length: int | None = None) -> GGUFModel:
    """Read a GGUF file: config, dequantized fp32 lmforge state dict, tokenizer and template.

    ``context_length`` overrides the file's (lmforge keeps fp32 RoPE tables that long).
    A missing, truncated or unsupported file raises one line naming it.
    """
    from gguf import GGUFReader

    from lmforge.hf.convert import _permute_heads, rope_permutation

    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"GGUF file not found: {p}")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError/struct errors on damaged files
        raise LmforgeError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    cfg = _config(reader, str(p), context_length)
    names = _names(cfg)
    inv = torch.argsort(rope_permutation(cfg.head_dim))
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        lm = names.get(t.name)
        if lm is None:
            if t.name.startswith("rope_freqs"):
                raise LmforgeError(f"{p}: GGUF RoPE frequency factors are not supported")
            raise LmforgeError(f"{p}: unexpected tensor {t.name!r} (lmforge has no place for it)")
        shape = tuple(int(x) for x in reversed(list(t.shape)))  # GGUF lists the inner dim first
        w = torch.from_numpy(dequantize(t.data, t.tensor_type.name, shape).copy())
        if cfg.qk_norm and (".attn_q" in t.name or ".attn_k" in t.name) and w.dim() == 2:
            # Qwen3 files keep HF's rotate-half rows: back to interleaved pairs.
            heads = cfg.n_heads if ".attn_q" in t.name else cfg.kv_heads
            w = _permute_heads(w, heads, cfg.head_dim, inv)
        elif t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            w = w[inv].contiguous()
        state[lm] = w
    missing = sorted(set(names.values()) - set(state))
    if missing:
        raise LmforgeError(f"{p}: tensor for {missing[0]!r} is missing")
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["token_embeddings.weight"]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return GGUFModel(
        config=cfg,
        state=state,
        tokenizer_json=_tokenizer_json(reader),
        eos_token_id=None if eos is None else int(eos),
        bos_token_id=None if bos is None else int(bos),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


@dataclasses.dataclass
class GGUFTensor:
    """One tensor of a GGUF file as stored (not dequantized), under its lmforge name."""

    name: str
    "lmforge state-dict name"
    type_name: str
    "GGUF type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...)"
    data: np.ndarray
    "the reader's memory-mapped bytes (uint8 rows of blocks for quantized types)"
    shape: tuple[int, ...]
    "torch-order shape of the weights"
    row_perm: torch.Tensor | None
    "rows (or entries, for a 1-D tensor) to take in this order (Qwen3 q/k un-permutation), or None"


def read_gguf(
    path: str | os.PathLike, context_length: int | None = None
) -> tuple[GGUFModel, list[GGUFTensor]]:
    """Like :func:`load_gguf` without dequantizing anything: the metadata (``state`` left empty)
    and every tensor as stored, so a caller can keep the quantized blocks
    (:func:`lmforge.quant.import_gguf_quantized`). Same one-line errors as :func:`load_gguf`."""
    from gguf import GGUFReader

    from lmforge.hf.convert import _permute_heads, rope_permutation

    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"GGUF file not found: {p}")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError/struct errors on damaged files
        raise LmforgeError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    cfg = _config(reader, str(p), context_length)
    names = _names(cfg)
    inv = torch.argsort(rope_permutation(cfg.head_dim))
    tensors: list[GGUFTensor] = []
    for t in reader.tensors:
        lm = names.get(t.name)
        if lm is None:
            if t.name.startswith("rope_freqs"):
                raise LmforgeError(f"{p}: GGUF RoPE frequency factors are not supported")
            raise LmforgeError(f"{p}: unexpected tensor {t.name!r} (lmforge has no place for it)")
        shape = tuple(int(x) for x in reversed(list(t.shape)))  # GGUF lists the inner dim first
        perm = None
        if cfg.qk_norm and (".attn_q" in t.name or ".attn_k" in t.name) and len(shape) == 2:
            heads = cfg.n_heads if ".attn_q" in t.name else cfg.kv_heads
            rows = torch.arange(shape[0]).reshape(shape[0], 1)
            perm = _permute_heads(rows, heads, cfg.head_dim, inv).reshape(-1)
        elif t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            perm = inv
        tensors.append(GGUFTensor(lm, t.tensor_type.name, t.data, shape, perm))
    missing = sorted(set(names.values()) - {t.name for t in tensors})
    if missing:
        raise LmforgeError(f"{p}: tensor for {missing[0]!r} is missing")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    meta = GGUFModel(
        config=cfg,
        state={},
        tokenizer_json=_tokenizer_json(reader),
        eos_token_id=None if eos is None else int(eos),
        bos_token_id=None if bos is None else int(bos),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
    return meta, tensors


def write_tokenizer_folder(g: GGUFModel, out_dir: str | os.PathLike) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (EOS, chat template) into out_dir."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    assert g.tokenizer_json is not None
    atomic_write_text(d / "tokenizer.json", json.dumps(g.tokenizer_json, ensure_ascii=False))
    vocab = {i: t for t, i in g.tokenizer_json["model"]["vocab"].items()}
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    if g.eos_token_id is not None and g.eos_token_id in vocab:
        cfg["eos_token"] = vocab[g.eos_token_id]
    if g.bos_token_id is not None and g.bos_token_id in vocab:
        cfg["bos_token"] = vocab[g.bos_token_id]
    if g.chat_template:
        cfg["chat_template"] = g.chat_template
    atomic_write_text(d / "tokenizer_config.json", json.dumps(cfg, indent=2) + "\n")
    return d


def import_gguf(
    path: str | os.PathLike, *, context_length: int | None = None, device: str = "cpu"
) -> tuple[Any, Any, str | None]:
    """``(TransformerLM, tokenizer or None, chat template or None)`` from a GGUF file.

    The tokenizer is what :func:`lmforge.hf.load_hf_tokenizer` makes of the file's vocabulary
    (an :class:`~lmforge.hf.HFTokenizer` whenever lmforge's encoder would not be exact).
    """
    from lmforge.hf.tokenizer import load_hf_tokenizer
    from lmforge.model import TransformerLM

    g = load_gguf(path, context_length)
    model = TransformerLM(g.config, device="meta")
    model.load_state_dict(g.state, assign=True)
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "cos") and hasattr(module, "reset_parameters"):
            module.cos = torch.empty_like(module.cos, device="cpu")
            module.sin = torch.empty_like(module.sin, device="cpu")
            module.reset_parameters()
    model.to(device).eval()
    tokenizer = None
    if g.tokenizer_json is not None:
        # HFTokenizer reads its folder lazily for save(): give it a folder that stays.
        folder = Path(tempfile.mkdtemp(prefix="lmforge-gguf-tok-"))
        write_tokenizer_folder(g, folder)
        tokenizer = load_hf_tokenizer(folder)
    return model, tokenizer, g.chat_template
